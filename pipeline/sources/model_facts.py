"""What a build needs to know of its checkpoint before any stage runs.

The defaults that depend on the model (context length, parity decode length,
calibration length, the phone parity's prompts) are derived here from the
checkpoint's own config, and an explicit value that cannot exercise the model
is refused, at compose time, in one line: not 17 minutes into a build, as it
was on Gemma 3 270M, whose 512-token sliding window the embedded model's
defaults (a 64-token window) never left.

Facts come from where the model stage will read the checkpoint, without
loading weights: the embedded recipe, a checkpoint folder's config.json, or a
GGUF file's header (also across the chunks of a model package, which are the
file cut in pieces, so nothing is assembled to read them).
"""

from __future__ import annotations

import importlib
import json
import math
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.sources import families
# The embedded recipe's window and positions when conf/model/embedded.yaml
# leaves them out: stages/model.py TRAIN_DEFAULTS (a test checks they agree).
EMBEDDED_SLIDING_WINDOW = 64
EMBEDDED_MAX_POSITIONS = 1024

# Derived defaults (derive()). Measured: the embedded model's hand-set values
# (context 256, parity 80 decode tokens, calibration 64 x 128 tokens, 4 phone
# prompts) are exactly what these rules give for its 64-token window, so its
# builds are unchanged.
MIN_CONTEXT = 256
# A real checkpoint (model=hf, model=gguf) is built for the context it is deployed at: llama.cpp's
# default (common_params.n_ctx = 4096, what llama-cli and llama-server open with), or twice its window
# where that is more, within its positions, within the positions its static rotary tables hold (Phi-3's
# LongRoPE: families.rope_limit) and with its KV in a share of the device's memory. 256 is the embedded
# model's figure, its quick default; a chat model served at 256 tokens ends a conversation in one turn.
# Measured on tests/conftest.py's tiny model for x86_avx512, 256 -> 4096 tokens: export 33.7 -> 31.3 s,
# verify_parity 26.4 -> 20.1 s (no change past this shared 2-core host's noise; both pass, 140.3 dB).
DEPLOY_CONTEXT = 4096
# The share of the device's memory the default context's KV may take (the planner's per-layer-type
# figure with its headroom, pipeline/sources/kv_budget.py): the rest holds the weights (a 1.7B's 4-bit
# codes ~1 GB), the runtime's buffers and everything else the device runs (a phone's other apps).
# A choice, not a measurement; it binds only for a large model on a small device (a 7B Mistral at 4096:
# 0.6 GiB of KV, under a quarter of an 8 GB phone).
KV_MEMORY_SHARE = 0.25
KV_DTYPE = "float16"  # the deployed graphs' KV (ORT's GroupQueryAttention, the phone's fp16 and w8a16 graphs)
# A phone's (device.accelerator qnn_htp) default is 1024: its QNN context binary is a static graph that
# attends over its whole KV capacity on every step, whatever the position, on the phone and in the HTP
# emulation this host checks parity in. Measured on tests/conftest.py's tiny model for galaxy_s25,
# 256 -> 4096 tokens: pack (the QDQ graphs' calibration) 28 -> 151 s, verify_parity 127 -> 313 s, the
# context binaries 2.7 -> 6.5 MB; Gemma 3 270M's phone build already takes ~20 minutes at 1024
# (tests/test_real_checkpoint.py). 1024 is the context the S25's measured step is at
# (conf/device/galaxy_s25.yaml: 27.2 ms at 1k); twice a window still wins where that is more.
PHONE_CONTEXT = 1024
PHONE_ACCELERATOR = "qnn_htp"
WINDOW_MARGIN = 16  # tokens past the window: the ring has wrapped a few times
NO_WINDOW_DECODE = 80  # a model without sliding layers: nothing to leave
MIN_CALIBRATION_LEN = 128
CALIBRATION_TOKENS = 8192  # samples x seq_len: GPTQ's Hessians saw 64 x 128 on every measured build
MIN_CALIBRATION_SAMPLES = 16
# The HTP emulation costs seconds per step on a real model (the ~135M model's
# 4 prompts x 85 steps x 2 precisions ran 32 minutes): past a 128-token run,
# one prompt that leaves the window is what the phone gate measures. And from
# QNN_FEW_PROMPTS_PARAMETERS one prompt whatever the run: the emulation's
# step grows with the weights (0.7 s a w8a16 step on the embedded model; 28 s
# on SmolLM2-135M with the cores shared, whose 4 prompts planned 245 HTP
# steps, over 2 hours at that rate; Gemma 3 270M 10-47 s), so its time is
# bounded by the steps of one prompt: 64 on the deployed binary, 50 on fp16.
QNN_PROMPTS_SHORT, QNN_PROMPTS_LONG, QNN_LONG_RUN = 4, 1, 128
QNN_FEW_PROMPTS_PARAMETERS = 50_000_000
# Parity's steps over all prompts (each prompt + decode_tokens): the embedded
# model's 12 prompts x ~88 steps; a 512-token window gets 2 prompts past it.
PARITY_STEPS, PROMPT_TOKENS = 1024, 8
# From this many parameters one parity prompt (still past the window): every step of the eager fp32
# reference and of the fp32 graph reads the whole model (the 1.75B geometry: ~0.3 s a step here, a
# prompt of 536 steps ~3 minutes for each of the two).
LARGE_MODEL_PARAMETERS = 1_000_000_000


class FactsError(ValueError):
    """The checkpoint cannot be read for its facts (one line)."""


@dataclass(frozen=True)
class ModelFacts:
    name: str  # what the messages call it
    sliding_window: int  # the largest window of any sliding layer; 0: none
    max_positions: int  # positions the model was trained for
    parameters: int = 0  # the checkpoint's parameter count (its safetensors headers); 0: not read
    source: str = "embedded"  # model.source: the embedded model keeps its quick defaults
    family: str = ""  # its family's architecture (the messages name it)
    rope_limit: int = 0  # the last context its static rotary tables are exact for (LongRoPE); 0: any
    # the last context the device's runtime computes the model at, where it applies none of the model's
    # window (on_runtime: llama.cpp and a Mistral); 0: any. The runtime's name says why.
    window_limit: int = 0
    window_runtime: str = ""
    # what the KV planner reads (geometry and which layers slide), None where the file does not say
    kv_config: dict | None = field(default=None, compare=False, hash=False)


def of(model: dict) -> ModelFacts:
    """The facts of a resolved `model` section (conf/model/<name>.yaml)."""
    facts = _read(model)
    if facts.max_positions and facts.sliding_window >= facts.max_positions:
        # A window no sequence can fill never binds: the model attends fully.
        return replace(facts, sliding_window=0)
    return facts


def on_runtime(facts: ModelFacts, runtime: str | None) -> ModelFacts:
    """The facts as the device's runtime (device.runtime) computes the model. llama.cpp applies no window
    to a family whose GGUF it runs without one (families.GGUF_WINDOW_NONE: Mistral, written as llama;
    Qwen2): the file is the model only within the window, so there the window is the last context the
    build may have (window_limit) and no layer slides (parity has no window to pass). Unchanged elsewhere."""
    if runtime != "llama.cpp" or not facts.sliding_window or not facts.family:
        return facts
    try:
        fam = families.of_architecture(facts.family)
    except families.FamilyError:
        return facts
    if fam.gguf_window != families.GGUF_WINDOW_NONE:
        return facts
    return replace(facts, sliding_window=0, window_limit=facts.sliding_window, window_runtime=runtime)


def _read(model: dict) -> ModelFacts:
    source = model["source"]
    name = str(model.get("name") or source)
    if source == "embedded":
        train = model.get("train") or {}

        def whole(key: str, default: int) -> int:
            v = train.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v != int(v) or v < 0:
                raise FactsError(f"model.train.{key}={v!r}: a whole number of positions (>= 0) is needed")
            return int(v)

        return ModelFacts(name, whole("sliding_window", EMBEDDED_SLIDING_WINDOW),
                          whole("max_position_embeddings", EMBEDDED_MAX_POSITIONS))
    if source == "hf":
        return _hf_facts(name, Path(str(model["path"])).expanduser())
    if source == "gguf":
        return _gguf_facts(name, gguf_parts(model))
    raise FactsError(f"model.source={source!r} is not known")


def _hf_facts(name: str, folder: Path) -> ModelFacts:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FactsError(f"no config.json in {folder}: not a Hugging Face checkpoint folder") from None
    except (OSError, ValueError) as e:
        raise FactsError(f"{path} is not readable JSON ({e})") from None
    archs = raw.get("architectures") or []
    try:  # refused here, at compose time, before any stage runs
        fam = families.of_architecture(archs[0] if archs else None)
    except families.FamilyError as e:
        raise FactsError(f"{folder}: {e}") from None
    raw = raw.get("text_config") or raw
    window = raw.get("sliding_window") or 0
    types = raw.get("layer_types")
    # Qwen-style configs carry a window they do not use; a layer_types map
    # without sliding layers means none slides either.
    if raw.get("use_sliding_window") is False or (types and "sliding_attention" not in types):
        window = 0
    text = {**raw, "model_type": fam.model_type}
    return ModelFacts(name, int(window), int(raw.get("max_position_embeddings") or 0), _parameters(folder),
                      source="hf", family=fam.architecture, rope_limit=_rope_limit(text, folder),
                      kv_config=text if all(raw.get(k) for k in GEOMETRY) else None)


GEOMETRY = ("num_hidden_layers", "num_attention_heads", "hidden_size")  # what the KV planner needs of a config


def _rope_limit(text: dict, folder: Path) -> int:
    """families.rope_limit on the config as transformers reads it (a Phi-3 config.json's `rope_scaling`
    and top-level original_max_position_embeddings become its rope_parameters there); 0: any context."""
    scaling = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if "longrope" not in json.dumps(scaling):
        return 0  # only LongRoPE has a limit: no transformers import for the others
    try:
        cfg = families.hf_config(text)
    except Exception as e:  # transformers' config validation raises several types
        raise FactsError(f"{folder / 'config.json'}: transformers cannot read it: "
                         f"{str(e).strip().splitlines()[0]}") from None
    return int(families.rope_limit(cfg) or 0)


def _parameters(folder: Path) -> int:
    """The parameter count of a checkpoint folder from its safetensors headers alone (8 bytes and a
    JSON header per file: no weight is read); 0 where a header cannot be read."""
    total = 0
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            with open(shard, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n)) if n < 100 << 20 else {}
        except (OSError, ValueError, struct.error):
            return 0
        for key, info in header.items():
            if key != "__metadata__" and isinstance(info, dict):
                count = 1
                for d in info.get("shape", []):
                    count *= int(d)
                total += count
    return total


def gguf_parts(model: dict) -> list[Path]:
    """The GGUF file of a `gguf` model section: its path, or the installed
    package's chunks in order (the file is their concatenation)."""
    if model.get("package"):
        module = package_module(model["package"])
        return [Path(p) for p in module.chunk_paths()]
    return [Path(str(model["path"])).expanduser()]


def package_module(package: str):
    """The installed model package's module; FactsError with the install command if absent."""
    try:
        return importlib.import_module(package.replace("-", "_"))
    except ImportError:
        raise FactsError(f"the model package {package} is not installed: "
                         f"pip install -e '.[models]' (or pip install {package})") from None


class _Chained:
    """Reads a sequence of files as one stream (a package's chunks)."""

    def __init__(self, parts: list[Path]):
        self._parts = list(parts)
        self._f = None

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            if self._f is None:
                if not self._parts:
                    break
                self._f = open(self._parts.pop(0), "rb")
            chunk = self._f.read(n - len(out))
            if not chunk:
                self._f.close()
                self._f = None
                continue
            out += chunk
        return out

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


# GGUF value types (the spec's numbering) -> struct format; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_BOOL = 7


GGUF_PARAMETERS = "edgekiln.parameters"  # gguf_metadata's own entry: the tensors' element count


def gguf_metadata(parts: list[Path], wanted: tuple[str, ...] = ()) -> dict:
    """The GGUF header's key/values (arrays skipped, but for per-layer flag lists), stopping once `wanted`
    are read; read to the end, with GGUF_PARAMETERS, the parameter count of its tensor infos.

    Written by hand because gguf's GGUFReader maps and parses the whole file,
    tensors and the 262k-token vocabulary included: 7.7 s for Gemma 3 270M on
    this machine, too slow for every compose; this reads the header only."""
    f = _Chained(parts)

    def take(fmt: str):
        size = struct.calcsize("<" + fmt)
        data = f.read(size)
        if len(data) != size:
            raise FactsError(f"{parts[0]}: truncated GGUF header")
        return struct.unpack("<" + fmt, data)[0]

    def string() -> str:
        n = take("Q")
        return f.read(n).decode("utf-8", "replace")

    def value(kind: int):
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("I"), take("Q")
            if item == 8:
                for _ in range(count):
                    f.read(take("Q"))
            elif item == _BOOL and count <= 4096:  # a per-layer flag list: sliding_window_pattern
                return [bool(take("?")) for _ in range(count)]
            elif item in _SCALARS:
                f.read(struct.calcsize("<" + _SCALARS[item]) * count)
            else:
                raise FactsError(f"{parts[0]}: nested GGUF arrays are not read")
            return None
        raise FactsError(f"{parts[0]}: unknown GGUF value type {kind}")

    try:
        if f.read(4) != b"GGUF":
            raise FactsError(f"{parts[0]} is not a GGUF file (no GGUF magic)")
        take("I")  # version
        tensors = take("Q")
        out = {}
        for _ in range(take("Q")):
            key = string()
            out[key] = value(take("I"))
            if wanted and all(k in out for k in wanted):
                return out
        # the tensor infos follow the key/values: their element counts are the parameter count
        total = 0
        for _ in range(tensors):
            string()  # name
            total += math.prod(take("Q") for _ in range(take("I")))
            take("I")  # type
            take("Q")  # offset
        out[GGUF_PARAMETERS] = total
        return out
    except OSError as e:
        raise FactsError(f"{parts[0]}: {e.strerror or e}") from None
    finally:
        f.close()


def _gguf_facts(name: str, parts: list[Path]) -> ModelFacts:
    meta = gguf_metadata(parts)
    arch = meta.get("general.architecture")
    if not arch:
        raise FactsError(f"{parts[0]}: no general.architecture in the GGUF header")
    try:
        fam = families.of_gguf_arch(arch)
    except families.FamilyError as e:
        raise FactsError(f"{parts[0]}: {e}") from None
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    if arch == "llama" and window:  # a Mistral, which llama.cpp writes as llama (gguf_checkpoint builds it so)
        fam = families.FAMILIES["mistral"]
    heads = meta.get(f"{arch}.attention.head_count")
    geometry = {"num_hidden_layers": meta.get(f"{arch}.block_count"), "num_attention_heads": heads,
                "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or heads,
                "head_dim": meta.get(f"{arch}.attention.key_length"),
                "hidden_size": meta.get(f"{arch}.embedding_length"), "sliding_window": window or None}
    # No model_type: the header does not say which layers slide, so the planner charges every layer the
    # whole context (its conservative rule). A per-layer head count is an array, which the reader skips.
    kv = geometry if all(isinstance(geometry[k], int) for k in GEOMETRY) else None
    # LongRoPE in a GGUF: llama.cpp writes the factors as tensors and the short factor's positions here.
    limit = int(meta.get(f"{arch}.rope.scaling.original_context_length") or 0) if arch == "phi3" else 0
    return ModelFacts(name, window, int(meta.get(f"{arch}.context_length") or 0), int(meta.get(GGUF_PARAMETERS, 0)),
                      source="gguf", family=fam.architecture, rope_limit=limit, kv_config=kv)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def kv_bytes(facts: ModelFacts, context: int) -> int | None:
    """The KV bytes of one stream at `context` as the planner charges them (per layer type, with its
    headroom); None where the checkpoint's config does not give its geometry."""
    if facts.kv_config is None:
        return None
    from pipeline.sources.kv_budget import kv_budget

    try:
        return kv_budget(facts.kv_config, context, kv_dtype=KV_DTYPE)["per_layer_type_with_headroom"]
    except Exception as e:  # the config goes through transformers' config class, which raises several types
        raise FactsError(f"{facts.name}: its config cannot be sized for its KV cache: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if unit == "GiB" else f"{n / scale:.0f} {unit}"
    return f"{n / 2**10:.0f} KiB"  # a tiny test model's


def default_context(facts: ModelFacts, memory_gib: float = 0.0, device: str = "",
                    accelerator: str = "") -> tuple[int, str]:
    """(export.context_length's default, one line saying why). `memory_gib`: the device's memory
    (0: not known, no memory bound); `accelerator`: the device's (a phone's qnn_htp: PHONE_CONTEXT)."""
    w = facts.sliding_window
    floor = max(MIN_CONTEXT, _next_pow2(2 * w)) if w else MIN_CONTEXT  # passes the window: parity's need
    if facts.source == "embedded":  # its quick default: 256, or twice its window, within its positions
        context = min(floor, facts.max_positions) if facts.max_positions else floor
        return context, f"context {context}: the embedded model's quick default ({MIN_CONTEXT}, or twice its " \
                        f"window, within its positions)"
    phone = accelerator == PHONE_ACCELERATOR
    target = PHONE_CONTEXT if phone else DEPLOY_CONTEXT
    context = max(target, floor)
    why = (f"twice its {w}-token window" if floor > target else
           "a phone's static graph pays its whole context every step" if phone else "llama.cpp's default")
    family = facts.family or facts.name
    bounds = []
    if facts.max_positions:
        if facts.max_positions < context:
            context, why = facts.max_positions, f"{family}'s {facts.max_positions} positions"
        else:
            bounds.append(f"{family}'s {facts.max_positions} positions")
    if facts.rope_limit:
        if facts.rope_limit < context:
            context, why = facts.rope_limit, f"LongRoPE's short factor ends at {facts.rope_limit} positions"
        else:
            bounds.append(f"LongRoPE's {facts.rope_limit} short-factor positions")
    if facts.window_limit:
        if facts.window_limit < context:
            context, why = facts.window_limit, (f"{facts.window_runtime} applies no sliding window to "
                                                f"{family}: its {facts.window_limit}-token window ends the context")
        else:
            bounds.append(f"its {facts.window_limit}-token window, which {facts.window_runtime} does not apply")
    kv = kv_bytes(facts, context)
    if kv is not None and memory_gib > 0:
        allowed = KV_MEMORY_SHARE * memory_gib * 2**30
        on = f"{device}'s {memory_gib:g} GiB" if device else f"{memory_gib:g} GiB"
        if kv > allowed:
            while context > floor and kv > allowed:
                context = max(floor, _next_pow2(context) // 2)
                kv = kv_bytes(facts, context)
            why = (f"its KV ({_size(kv)}) within {KV_MEMORY_SHARE:.0%} of {on}" if kv <= allowed else
                   f"the least that passes its window; its KV ({_size(kv)}) exceeds {KV_MEMORY_SHARE:.0%} of {on}")
        else:
            bounds.append(f"{_size(kv)} of KV on {on}")
    elif kv is not None:
        bounds.append(f"{_size(kv)} of KV")
    return context, f"context {context}: {why}" + (f", within {' and '.join(bounds)}" if bounds else "")


def derive(facts: ModelFacts, memory_gib: float = 0.0, device: str = "", accelerator: str = "") -> dict[str, int]:
    """The model-dependent defaults, by dotted key (`memory_gib`, `device`, `accelerator`: default_context's)."""
    w = facts.sliding_window
    decode = w + WINDOW_MARGIN if w else NO_WINDOW_DECODE
    context, _ = default_context(facts, memory_gib, device, accelerator)
    seq_len = max(MIN_CALIBRATION_LEN, decode if w else 0)
    if facts.max_positions:
        seq_len = min(seq_len, facts.max_positions)
    samples = max(MIN_CALIBRATION_SAMPLES, CALIBRATION_TOKENS // seq_len)
    return {
        "export.context_length": context,
        "parity.decode_tokens": decode,
        "calibrate.seq_len": seq_len,
        "calibrate.samples": samples,
        "calibrate.min_samples": samples,
        "parity.qnn_prompts": QNN_PROMPTS_SHORT
        if decode <= QNN_LONG_RUN and facts.parameters < QNN_FEW_PROMPTS_PARAMETERS else QNN_PROMPTS_LONG,
        "parity.max_prompts": 1 if facts.parameters >= LARGE_MODEL_PARAMETERS
        else max(1, -(-PARITY_STEPS // (decode + PROMPT_TOKENS))),
    }


def refusals(facts: ModelFacts, cfg: dict, prompts_upper: int, memory_gib: float = 0.0,
             accelerator: str = "") -> list[tuple[str, str]]:
    """(key, reason) for each explicit setting that cannot exercise the model.

    `prompts_upper`: an upper bound of the shortest parity prompt's token count
    (its UTF-8 bytes, plus BOS), so a refusal here is certain; the parity stage
    checks each tokenized prompt exactly."""
    w, positions = facts.sliding_window, facts.max_positions
    derived = derive(facts, memory_gib, accelerator=accelerator)
    out = []
    ctx = cfg["export"]["context_length"]
    decode = cfg["parity"]["decode_tokens"]
    if positions and ctx > positions:
        out.append(("export.context_length",
                    f"export.context_length={ctx} exceeds {facts.name}'s {positions} positions; "
                    f"set it to at most {positions} (or null: {derived['export.context_length']})"))
    if facts.rope_limit and ctx > facts.rope_limit:
        out.append(("export.context_length",
                    f"export.context_length={ctx} passes the {facts.rope_limit} positions of {facts.name}'s LongRoPE "
                    f"short factor, the one table a static graph holds; set it to at most {facts.rope_limit} "
                    f"(or null: {derived['export.context_length']})"))
    if facts.window_limit and ctx > facts.window_limit:
        out.append(("export.context_length",
                    f"export.context_length={ctx} passes {facts.name}'s {facts.window_limit}-token sliding window, "
                    f"which {facts.window_runtime} does not apply (it would attend past it: another model); set it "
                    f"to at most {facts.window_limit} (or null: {derived['export.context_length']}), or build for "
                    f"a device whose runtime applies the window (x86_avx512)"))
    if w and ctx <= w:
        out.append(("export.context_length",
                    f"export.context_length={ctx} does not pass {facts.name}'s {w}-token sliding window, so its "
                    f"sliding layers are never exercised; set it above {w} "
                    f"(or null: {derived['export.context_length']})"))
    if w and decode + prompts_upper <= w:
        out.append(("parity.decode_tokens",
                    f"parity.decode_tokens={decode}: the parity prompts (at most {prompts_upper} tokens) plus "
                    f"{decode} decoded tokens stay inside {facts.name}'s {w}-token sliding window; "
                    f"set parity.decode_tokens >= {w} (or null: {derived['parity.decode_tokens']})"))
    return out
