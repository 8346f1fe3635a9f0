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
import struct
from dataclasses import dataclass
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
WINDOW_MARGIN = 16  # tokens past the window: the ring has wrapped a few times
NO_WINDOW_DECODE = 80  # a model without sliding layers: nothing to leave
MIN_CALIBRATION_LEN = 128
CALIBRATION_TOKENS = 8192  # samples x seq_len: GPTQ's Hessians saw 64 x 128 on every measured build
MIN_CALIBRATION_SAMPLES = 16
# The HTP emulation costs seconds per step on a real model (the ~135M model's
# 4 prompts x 85 steps x 2 precisions ran 32 minutes): past a 128-token run,
# one prompt that leaves the window is what the phone gate measures.
QNN_PROMPTS_SHORT, QNN_PROMPTS_LONG, QNN_LONG_RUN = 4, 1, 128
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


def of(model: dict) -> ModelFacts:
    """The facts of a resolved `model` section (conf/model/<name>.yaml)."""
    facts = _read(model)
    if facts.max_positions and facts.sliding_window >= facts.max_positions:
        # A window no sequence can fill never binds: the model attends fully.
        return ModelFacts(facts.name, 0, facts.max_positions, facts.parameters)
    return facts


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
        families.of_architecture(archs[0] if archs else None)
    except families.FamilyError as e:
        raise FactsError(f"{folder}: {e}") from None
    raw = raw.get("text_config") or raw
    window = raw.get("sliding_window") or 0
    types = raw.get("layer_types")
    # Qwen-style configs carry a window they do not use; a layer_types map
    # without sliding layers means none slides either.
    if raw.get("use_sliding_window") is False or (types and "sliding_attention" not in types):
        window = 0
    return ModelFacts(name, int(window), int(raw.get("max_position_embeddings") or 0), _parameters(folder))


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


def gguf_metadata(parts: list[Path], wanted: tuple[str, ...] = ()) -> dict:
    """The GGUF header's key/values (arrays skipped), stopping once `wanted` are read.

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
        take("Q")  # tensor count
        out = {}
        for _ in range(take("Q")):
            key = string()
            out[key] = value(take("I"))
            if wanted and all(k in out for k in wanted):
                break
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
        families.of_gguf_arch(arch)
    except families.FamilyError as e:
        raise FactsError(f"{parts[0]}: {e}") from None
    return ModelFacts(name, int(meta.get(f"{arch}.attention.sliding_window") or 0),
                      int(meta.get(f"{arch}.context_length") or 0))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def derive(facts: ModelFacts) -> dict[str, int]:
    """The model-dependent defaults, by dotted key."""
    w = facts.sliding_window
    decode = w + WINDOW_MARGIN if w else NO_WINDOW_DECODE
    context = max(MIN_CONTEXT, _next_pow2(2 * w)) if w else MIN_CONTEXT
    if facts.max_positions:
        context = min(context, facts.max_positions)
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
        "parity.qnn_prompts": QNN_PROMPTS_SHORT if decode <= QNN_LONG_RUN else QNN_PROMPTS_LONG,
        "parity.max_prompts": 1 if facts.parameters >= LARGE_MODEL_PARAMETERS
        else max(1, -(-PARITY_STEPS // (decode + PROMPT_TOKENS))),
    }


def refusals(facts: ModelFacts, cfg: dict, prompts_upper: int) -> list[tuple[str, str]]:
    """(key, reason) for each explicit setting that cannot exercise the model.

    `prompts_upper`: an upper bound of the shortest parity prompt's token count
    (its UTF-8 bytes, plus BOS), so a refusal here is certain; the parity stage
    checks each tokenized prompt exactly."""
    w, positions = facts.sliding_window, facts.max_positions
    derived = derive(facts)
    out = []
    ctx = cfg["export"]["context_length"]
    decode = cfg["parity"]["decode_tokens"]
    if positions and ctx > positions:
        out.append(("export.context_length",
                    f"export.context_length={ctx} exceeds {facts.name}'s {positions} positions; "
                    f"set it to at most {positions} (or null: {derived['export.context_length']})"))
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
