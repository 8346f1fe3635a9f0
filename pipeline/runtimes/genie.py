"""Qualcomm Genie: the bundle a phone's Genie runtime (libGenie, `genie-t2t-run` in the
QAIRT SDK) starts from, written beside the phone build's qnn.json.

Genie reads these files:
- `genie_config.json`: a "dialog": the context (size, vocabulary, BOS / EOS ids), the
  sampler, the tokenizer's path, and an engine on the QnnHtp backend (mmap, the
  spill-fill buffer, kv-dim, CPU mask and polling; the context binaries in order; the
  model's positional encoding);
- `htp_backend_ext_config.json`: the HTP's soc model and DSP arch, its core profile,
  shared-buffer memory and weight sharing;
- `tokenizer.json`: the model's Hugging Face tokenizer;
- `embedding_lut.bin`, where the binary takes fixed-point `inputs_embeds` (the Genie form's,
  the table off the HTP): the token-embedding table Genie looks rows up in (`dialog.embedding`,
  type `lut`), in that input's encoding.

The schema is the one Qualcomm publishes, read (not copied) from quic/ai-hub-apps
v0.20.0 `tutorials/llm_on_genie` (`configs/genie/*.json`,
`configs/htp/htp_backend_ext_config.json.template`, `manual_bundle.md`'s soc table)
and quic/ai-hub-models v0.46.1 (`utils/llm_helpers.py`: how its export fills them;
`models/_shared/llm/`: how it splits an LLM and names the graphs); the embedding block and
what the LUT must hold from the Genie sources the QAIRT SDK ships in its examples
(`examples/Genie/Genie/src/Dialog.cpp` and `qualla/`, read in a public copy, kyungraekim/qnn). The files are
written here from the build's own facts; tests/test_genie_bundle.py checks their keys
and types against that schema.

What Genie expects of the context binaries goes beyond these files, and our build
differs there: `missing()` names each difference, so the profile says exactly what
stands between this bundle and Genie loading it. Nothing here runs Genie or a phone.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

CONFIG = "genie_config.json"
HTP_CONFIG = "htp_backend_ext_config.json"
TOKENIZER = "tokenizer.json"
LUT = "embedding_lut.bin"
FILES = (CONFIG, HTP_CONFIG, TOKENIZER, LUT)
# Ids looked up a call when the LUT is written: 8192 rows of 2048 are 134 MB in the float64 its error is summed in.
LUT_CHUNK = 8192

# Qualcomm's published soc_model / dsp_arch per chip (ai-hub-apps tutorials/llm_on_genie/manual_bundle.md,
# "HTP Backend Config": Snapdragon 8 Gen 2 43 v73, 8 Gen 3 57 v75, 8 Elite 69 v79). A device config that
# disagrees is refused: a wrong soc_model makes the HTP refuse the binary on the phone, not here.
PUBLISHED_SOC = {"SM8550": (43, "v73"), "SM8650": (57, "v75"), "SM8750": (69, "v79")}

# The engine settings of every published Genie config for these phones (ai-hub-apps configs/genie/*.json,
# ai-hub-models create_genie_config): 3 threads on CPU mask 0xe0 (cores 5-7, the big cores of the 8-core
# Snapdragons), polling on, weights memory-mapped (the tutorial turns mmap off only on Windows laptops).
# None was measured here: there is no phone.
N_THREADS, CPU_MASK, POLL, USE_MMAP = 3, "0xe0", True, True
# Greedy by default: `python -m pipeline generate` decodes greedily unless given a temperature, and the
# parity stage measured greedy agreement. The other values are the published configs' sampling settings,
# used only when greedy is set false.
SAMPLER = {"version": 1, "seed": 42, "temp": 0.8, "top-k": 40, "top-p": 0.95, "greedy": True}

# What Genie's HTP engine asks of a binary's graphs, read in the Genie sources the QAIRT SDK ships
# (examples/Genie/Genie/src/qualla/engines/qnn-htp/nsp-graph.cpp, nsp-model.cpp, qnn-api/qnn-utils.hpp; the
# public copy kyungraekim/qnn at da1ce87). It sorts graphs by their tensors, not their names: a graph's
# tokens a call (AR) from input_ids' size or attention_mask's rows, its context (CL) from attention_mask's
# last dimension or its KV lengths; names are a fallback only, and they order the parts of one (AR, CL)
# (sorted as strings) and key shared buffers (so they must be unique across the ctx-bins). Tensor names are
# looked up exactly. `missing()` checks our io.json against these, so the list shrinks as the graph meets them.
GENIE_FIRST_INPUT = {"input_ids": ("int32",), "inputs_embeds": ("uint8", "uint16")}
# A KV tensor of a cache group: its prefix (past_, Genie's default group, or a group the config names), key or
# value, a number (the layer), _in / _out (nsp-model.cpp, qnn-utils.hpp). A prefix holds no digit: Genie reads
# the layer from the first number in the name.
GENIE_DEFAULT_GROUP = "past_"
# Genie's sliding-window cache group (Dialog.cpp validateCacheGroupConfig / validateLongContextConfig): no
# reserved (sink) tokens, which Genie attends after the buffer wraps and may mask before (context-manager.cpp).
SWA_RESERVED_TOKENS = 0


def _kv_name(prefixes, suffix: str) -> re.Pattern:
    return re.compile(rf"^(?:{'|'.join(re.escape(x) for x in prefixes)}).*(key|value).*_{suffix}$")


class GenieError(ValueError):
    """A device or model this bundle cannot describe (one line, user-facing)."""


def htp_config(target: dict) -> dict:
    """htp_backend_ext_config.json for a QNN target {soc_model, htp_arch, soc_id}."""
    chip, soc_id, arch = str(target["soc_model"]), int(target["soc_id"]), "v" + str(target["htp_arch"]).lstrip("vV")
    published = PUBLISHED_SOC.get(chip)
    if published and published != (soc_id, arch):
        raise GenieError(f"device qnn block says {chip} is soc_id {soc_id} / {arch}; Qualcomm publishes "
                         f"{published[0]} / {published[1]} for it (ai-hub-apps llm_on_genie/manual_bundle.md)")
    return {
        "devices": [{"soc_model": soc_id, "dsp_arch": arch,
                     "cores": [{"core_id": 0, "perf_profile": "burst", "rpc_control_latency": 100}]}],
        "memory": {"mem_type": "shared_buffer"},
        # Off: each of our binaries holds one graph, compiled alone. Qualcomm's exports turn it on because
        # they link a prompt graph and a token graph over one set of weights into each binary.
        "context": {"weight_sharing_enabled": False},
    }


def _token_id(tokenizer, entry) -> int | None:
    text = entry.get("content") if isinstance(entry, dict) else entry
    return tokenizer.token_to_id(text) if isinstance(text, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def special_tokens(model_dir: Path) -> dict:
    """BOS and EOS ids: the tokenizer config's bos_token / eos_token looked up in tokenizer.json, then the
    generation config's and model config's eos ids (an instruct model stops on several); -1 for no BOS
    (as Qualcomm's Android ChatApp config writes it)."""
    from tokenizers import Tokenizer

    def read(name):
        p = model_dir / name
        return json.loads(p.read_text()) if p.is_file() else {}

    tok_cfg = {**read("special_tokens_map.json"), **read("tokenizer_config.json")}
    gen, cfg = read("generation_config.json"), read("config.json")
    cfg = cfg.get("text_config", cfg)
    bos, eos, source = None, [], "config.json"
    if (model_dir / TOKENIZER).is_file():
        tok = Tokenizer.from_file(str(model_dir / TOKENIZER))
        bos = _token_id(tok, tok_cfg.get("bos_token"))
        eos = [i for i in [_token_id(tok, tok_cfg.get("eos_token"))] if i is not None]
        source = "tokenizer_config.json's bos_token / eos_token in tokenizer.json"
    if bos is None:
        bos = next(iter(_ids(cfg.get("bos_token_id")) + _ids(gen.get("bos_token_id"))), None)
    for i in _ids(gen.get("eos_token_id")) + _ids(cfg.get("eos_token_id")):
        if i not in eos:
            eos.append(i)
    if not eos:
        raise GenieError(f"{model_dir}: no EOS token in the tokenizer config, generation_config.json or "
                         "config.json: Genie would never stop")
    return {"bos": -1 if bos is None else int(bos), "eos": eos,
            "source": source + ", then generation_config.json / config.json eos_token_id"}


def _rope_sets(text: dict) -> dict[str, dict]:
    """Layer type (or "all") -> {rope_type, rope_theta, scaling...}, from a config.json written by
    transformers 5 (rope_parameters, maybe per layer type) or earlier (rope_theta + rope_scaling)."""
    rp = text.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        if all(isinstance(v, dict) for v in rp.values()):
            return {k: dict(v) for k, v in rp.items()}
        return {"all": dict(rp)}
    scaling = dict(text.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    sets = {"all": {"rope_type": kind, "rope_theta": text.get("rope_theta", 10000.0), **scaling}}
    if text.get("rope_local_base_freq"):  # Gemma 3 before transformers 5: the sliding layers' own base
        sets = {"full_attention": sets["all"],
                "sliding_attention": {"rope_type": "default", "rope_theta": text["rope_local_base_freq"]}}
    return sets


def _number(x):
    x = float(x)
    return int(x) if x.is_integer() else x


def positional_encoding(config: dict, head_dim: int) -> tuple[dict, list[str]]:
    """Genie's `positional-encoding` for a config.json, and what it cannot say about this model."""
    text = config.get("text_config", config)
    sets = _rope_sets(text)
    chosen = sets.get("full_attention") or sets.get("all") or next(iter(sets.values()))
    factor = float(chosen.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)) or 1.0)
    # rope-dim is half the rotated dims (the cos/sin width): 32 for Llama 3.2 1B's head_dim 64
    enc = {"type": "rope", "rope-dim": int(head_dim * factor) // 2, "rope-theta": _number(chosen["rope_theta"])}
    gaps = []
    kind = chosen.get("rope_type", "default")
    if kind == "llama3":
        enc["rope-scaling"] = {"rope-type": "llama3", "factor": float(chosen["factor"]),
                               "low-freq-factor": float(chosen["low_freq_factor"]),
                               "high-freq-factor": float(chosen["high_freq_factor"]),
                               "original-max-position-embeddings": int(chosen["original_max_position_embeddings"])}
    elif kind == "longrope":  # Phi-3.5 / Phi-4-mini: Genie's sources take it (nsp-params.cpp, nsp-model.cpp)
        orig = int(chosen.get("original_max_position_embeddings") or text["original_max_position_embeddings"])
        # Genie's validator takes `factor` (not max-position-embeddings): HF's longrope factor when the config
        # gives none is the context extension itself
        scale = float(chosen.get("factor") or text["max_position_embeddings"] / orig)
        short, long = ([float(x) for x in chosen[k]] for k in ("short_factor", "long_factor"))
        enc["rope-scaling"] = {"rope-type": "longrope", "factor": scale, "short-factor": short, "long-factor": long,
                               "original-max-position-embeddings": orig}
        if not len(short) == len(long) == enc["rope-dim"]:
            gaps.append(f"longrope: Genie's engine wants short-factor and long-factor of rope-dim "
                        f"({enc['rope-dim']}) entries each; the model has {len(short)} and {len(long)}")
    elif kind != "default":
        gaps.append(f"rope type {kind!r}: Genie's sources take rope-scaling for llama3 and longrope only; "
                    "none is written")
    if not float(chosen["rope_theta"]).is_integer():
        gaps.append(f"rope-theta {chosen['rope_theta']}: Genie's engine reads it as an int32 (nsp-params.cpp), "
                    "dropping the fraction")
    thetas = {k: _number(v["rope_theta"]) for k, v in sets.items()}
    if len(set(thetas.values())) > 1:
        gaps.append(f"one rotary base per layer type ({thetas}): Genie's positional-encoding holds one "
                    f"rope-theta; written: {enc['rope-theta']} (the full-attention layers')")
    return enc, gaps


def write_lut(embed_model: Path, out_file: Path, encoding: dict) -> dict:
    """Genie's token-embedding table from the build's embedding model (compile_qnn's embed/model.onnx), at
    the width of the 16-bit activations Qualcomm's exports quantize their I/O to: ufixed16 with one scale
    and offset (`quant-param`), row-major
    [vocab, hidden], little-endian. Its rows are that model's own output (ONNX Runtime's
    GatherBlockQuantized over the build's int codes, exactly what our phone runtime feeds the binaries;
    the model's [1, 1] ids opened to [1, n] to look up LUT_CHUNK ids a call: a row depends on its id
    alone), written as codes in `encoding` (the Genie-form binary's inputs_embeds encoding, {scale,
    offset} in QNN's convention, pipeline/graphs/genie_io.py), so that Genie's requantization of the LUT
    into that input is a copy; their error against those rows measured as they are written (the report's
    `snr_db`, `max_abs_error`, and the rows' `range`).

    Why ufixed16: Genie requantizes a fixed-point LUT into the binary's embedding input, and quantizes a
    float32 one into it (nsp-model.cpp quantizeInput, truncating): either way that input is ufixed8 /
    ufixed16, so a float32 table only costs twice the bytes. SmolLM2-135M's table in its Genie binary's
    encoding: 78.1 dB from the int8 blocks' rows, 56.6 MB."""
    import hashlib

    import numpy as np
    import onnx
    import onnxruntime as ort

    m = onnx.load(str(embed_model))  # with its data: the table as int codes (the 1.75B geometry's: 0.3 GB)
    ids, rows = m.graph.input[0], m.graph.output[0]
    ids.type.tensor_type.shape.dim[-1].dim_param = "n"
    rows.type.tensor_type.shape.dim[-2].dim_param = "n"
    table = next(n.input[0] for n in m.graph.node if n.op_type in ("GatherBlockQuantized", "Gather"))
    vocab = int(next(t.dims[0] for t in m.graph.initializer if t.name == table))
    hidden = int(rows.type.tensor_type.shape.dim[-1].dim_value)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    del m

    def chunks():
        for start in range(0, vocab, LUT_CHUNK):
            ids_ = np.arange(start, min(vocab, start + LUT_CHUNK), dtype=np.int64)[None, :]
            yield sess.run(None, {ids.name: ids_})[0].reshape(-1, hidden).astype(np.float64)

    lo, hi = np.inf, -np.inf
    scale, offset = float(encoding["scale"]), int(encoding["offset"])
    digest, part = hashlib.sha256(), out_file.with_name(out_file.name + ".part")
    sig = err = worst = 0.0
    with open(part, "wb") as f:
        for x in chunks():
            lo, hi = min(lo, float(x.min())), max(hi, float(x.max()))
            q = np.clip(np.rint(x / scale) - offset, 0, 65535)
            d = x - (q + offset) * scale
            sig, err, worst = sig + float(np.einsum("ij,ij->", x, x)), err + float(np.einsum("ij,ij->", d, d)), \
                max(worst, float(np.abs(d).max()))
            data = q.astype("<u2").tobytes()
            digest.update(data)
            f.write(data)
    part.replace(out_file)
    return {"lut-path": out_file.name, "datatype": "ufixed16", "quant-param": {"scale": scale, "offset": offset},
            "rows": vocab, "size": hidden, "bytes": out_file.stat().st_size, "sha256": digest.hexdigest(),
            "range": [lo, hi], "snr_db": round(10 * float(np.log10(sig / err)), 1) if err else None,
            "max_abs_error": worst}


def cache_groups(io: dict) -> list[dict]:
    """The engine's `cache-groups` for a Genie-form graph with sliding layers (io.json "cache_groups"), as the
    Genie SDK's validator takes them (Dialog.cpp validateCacheGroupConfig, validateLongContextConfig): the
    default group (past_, which Genie requires once any group is named), then each sliding group with its
    mask's name and a sliding-window long context of the model's window; [] for a graph without."""
    groups = io.get("cache_groups") or []
    if not groups:
        return []
    return [{"version": 1, "prefix": GENIE_DEFAULT_GROUP}] + [
        {"version": 1, "prefix": g["prefix"], "attention-mask-tensor-name": g["mask"],
         "longcontext": {"version": 1, "type": "sliding-window", "reserved-tokens": SWA_RESERVED_TOKENS,
                         "sliding-window": {"version": 1, "window-size": int(g["window"])}}} for g in groups]


def genie_config(*, context: int, vocab: int, tokens: dict, kv_dim: int, ctx_bins: list[str],
                 encoding: dict, spill_fill: int, lut: dict | None = None, groups: list[dict] | None = None) -> dict:
    """genie_config.json (the dialog schema of Qualcomm's published configs; with `lut`, the SDK's
    dialog.embedding block: its Dialog.cpp validator takes version and size (the hidden width, its
    n-embd), type lut with a lut-path, a datatype, a quant-param {scale, offset}; with `groups`, the engine's
    cache-groups, cache_groups())."""
    eos = tokens["eos"]
    embedding = {"embedding": {"version": 1, "type": "lut", "lut-path": lut["lut-path"], "size": int(lut["size"]),
                               "datatype": lut["datatype"], "quant-param": dict(lut["quant-param"])}} if lut else {}
    return {"dialog": {
        "version": 1,
        "type": "basic",
        "context": {"version": 1, "size": int(context), "n-vocab": int(vocab), "bos-token": int(tokens["bos"]),
                    "eos-token": eos[0] if len(eos) == 1 else list(eos)},
        "sampler": dict(SAMPLER),
        "tokenizer": {"version": 1, "path": TOKENIZER},
        **embedding,
        "engine": {
            "version": 1,
            "n-threads": N_THREADS,
            "backend": {
                "version": 1,
                "type": "QnnHtp",
                "QnnHtp": {"version": 1, "use-mmap": USE_MMAP, "spill-fill-bufsize": int(spill_fill),
                           "mmap-budget": 0, "poll": POLL, "cpu-mask": CPU_MASK, "kv-dim": int(kv_dim),
                           "allow-async-init": False},
                "extensions": HTP_CONFIG,
            },
            "model": {"version": 1, "type": "binary", "binary": {"version": 1, "ctx-bins": list(ctx_bins)},
                      "positional-encoding": encoding},
            **({"cache-groups": groups} if groups else {}),
        },
    }}


def context_graphs(ctx_model: Path) -> list[dict]:
    """The graphs of a compiled model_ctx.onnx, one EPContext node each: the name onnxruntime-qnn gave the
    graph in the binary (`partition_name`), and its spill-fill buffer's size (`max_size`, which
    onnxruntime-qnn records as the largest spill-fill buffer of the binary; 0 unless it was compiled with
    enable_htp_spill_fill_buffer)."""
    import onnx

    m = onnx.load(str(ctx_model), load_external_data=False)
    graphs = []
    for node in m.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        name = attrs.get("partition_name") or node.name
        graphs.append({"name": name.decode() if isinstance(name, bytes) else str(name),
                       "spill_fill_bytes": int(attrs.get("max_size", 0))})
    return graphs


def _io_gaps(io: dict) -> list[str]:
    """Our graph's I/O against what Genie's HTP engine feeds and reads (GENIE_*), one line per rule missed."""
    names = {i["name"]: i for i in io["inputs"]}
    first = io["inputs"][0]
    gaps = []
    if first["name"] not in GENIE_FIRST_INPUT:
        gaps.append(f"first input {first['name']}: Genie's engine feeds input_ids (int32) or inputs_embeds")
    elif first["dtype"] not in GENIE_FIRST_INPUT[first["name"]]:
        gaps.append(f"{first['name']} {first['dtype']}: Genie's engine writes "
                    + ("token ids as 4-byte int32" if first["name"] == "input_ids" else
                       "embeddings only into a ufixed8 / ufixed16 input, quantized with the tensor's own scale "
                       "and offset (nsp-model.cpp quantizeInput); a float input is left unfilled")
                    + ": the binary's boundary would have to be quantized")
    if "attention_mask" not in names:
        gaps.append("attention_mask: Genie's engine feeds it (and reads a graph's context from its last "
                    "dimension); ours computes the mask inside the graph from `position`")
    positions = names.get((io.get("positions") or {}).get("input", ""))
    if positions is not None:  # Genie's absolute encoding: it writes n_past + i as int32 (nsp-model.cpp)
        if positions["dtype"] != "int32" or positions["shape"][:-1] != [1, 1]:
            gaps.append(f"{positions['name']} {positions['dtype']} {positions['shape']}: Genie's absolute positional "
                        "encoding writes int32 positions into [1, 1, ar]")
    elif not {"position_ids_cos", "position_ids_sin"} <= set(names):
        gaps.append("position_ids_cos / position_ids_sin [1, 1, ar, rope-dim]: Genie's engine feeds the rotary "
                    "tables for rope (int32 position_ids for its absolute / alibi types); ours computes them inside "
                    "from `position`")
    groups = io.get("cache_groups") or []
    prefixes = [GENIE_DEFAULT_GROUP] + [g["prefix"] for g in groups]
    kv_in = [n for n in names if re.search(r"key|value", n)]
    kv_out = [o["name"] for o in io["outputs"] if re.search(r"key|value", o["name"])]
    bad = [n for n in kv_in if not _kv_name(prefixes, "in").match(n)] + \
        [n for n in kv_out if not _kv_name(prefixes, "out").match(n)]
    if bad:
        gaps.append(f"KV names: Genie's engine pairs past_<...>key<...>_in with its _out, the layer the first number "
                    f"in the name (qnn-utils.hpp); ours {bad[0]} ... {bad[-1]}")
    boundary = io.get("boundary") or {}
    mask = boundary.get("attention_mask")
    if mask is not None and (np.iinfo(mask["dtype"]).max + mask["offset"]) != 0:
        gaps.append(f"attention_mask {mask}: Genie's engine writes the code {np.iinfo(mask['dtype']).max} where a token "
                    "may attend and 0 elsewhere, so the top code must mean 0 (offset = -top)")
    for g in groups:  # Genie writes a group's mask in the global mask's type and codes, unchecked (nsp-model.cpp)
        if g["mask"] not in names:
            gaps.append(f"{g['mask']}: the {g['prefix']} cache group's mask, which Genie's engine fills, is not an input")
        elif boundary and boundary.get(g["mask"]) != mask:
            gaps.append(f"{g['mask']} {boundary.get(g['mask'])}: Genie writes it in attention_mask's codes ({mask})")
    untied = [n[:-3] for n in kv_in if n.endswith("_in") and boundary.get(n) != boundary.get(n[:-3] + "_out")]
    if boundary and untied:
        gaps.append(f"KV encodings: Genie's validator wants each *_in and its _out alike; {untied[0]} ... differ")
    key = next((names[n] for n in kv_in if "key" in n), None)
    if key is not None and int(key["shape"][-1]) == int(io["head_dim"]):
        gaps.append(f"key layout: Genie's engine keeps keys transposed, [n_kv, head_dim, len] (values [n_kv, len, "
                    f"head_dim]); ours {key['name']} is {key['shape']}, head_dim last")
    return gaps


def missing(io: dict, graph_names: list[str], *, tokenizer: bool, lut: bool, extra: list[str],
            prompt_binary: bool = False) -> list[str]:
    """What stands between this bundle and Genie loading it on a phone, one line each: our io.json and graph
    names checked against the rules of Genie's sources (GENIE_*), and what nothing here can check."""
    gaps = _io_gaps(io)
    if graph_names != sorted(graph_names):
        gaps.append(f"part order: Genie orders the parts of one graph by their names sorted as strings; ours, "
                    f"named by onnxruntime-qnn, sort otherwise: {graph_names}")
    if len(set(graph_names)) != len(graph_names):
        gaps.append(f"graph names repeat across the ctx-bins ({graph_names}): Genie keys each graph by its name")
    grouped = {g["prefix"] for g in io.get("cache_groups") or []}
    rings = [x for x in io["layers"] if x["slot_rule"] != "position" and x.get("prefix") not in grouped]
    if rings:
        gaps.append(f"sliding layers' KV: ours a ring of {rings[0]['cache_len']} slots written at "
                    f"`{rings[0]['slot_rule']}` ({len(rings)} of {len(io['layers'])} layers), masked inside the "
                    "graph; Genie gives such layers a cache group of their own (engine cache-groups: a name prefix, "
                    "its own attention mask and KV length, longcontext sliding-window), which our names and masks "
                    "do not form")
    if prompt_binary:  # without one (none built, or the HTP refused it) Genie runs a prompt through ar1 too
        gaps.append(f"the prompt graph is a binary of its own ({io['prompt']['tokens']} tokens a call, compile_qnn's "
                    "<precision>/prompt/), not listed in ctx-bins: Genie would tell it from the token graph by its "
                    "tensors' shapes, but its weights are compiled apart (Qualcomm's exports link the two over one "
                    "set of weights, which this host's HTP emulation cannot load)")
    gaps.append("the .bin is onnxruntime-qnn's EPContext binary: that Genie takes it as a ctx-bin is unchecked")
    if io.get("embedding") and not lut:
        first = io["inputs"][0]
        gaps.append(f"token embedding: our binaries take {first['name']} from an ONNX Runtime lookup "
                    f"({io['embedding']['model']}, int{io['embedding']['bits']} blocks) run on the CPU; Genie would "
                    f"need the table as its embedding LUT ({LUT}), not written: "
                    + ("the compiled embedding model is missing" if (io.get("boundary") or {}).get(first["name"])
                       else f"the binary's {first['name']} is {first['dtype']}, which Genie does not fill from a LUT"))
    if not tokenizer:
        gaps.append("tokenizer.json: the checkpoint has none (Genie reads only that form)")
    return gaps + list(extra)


def write_bundle(out: Path, *, model_dir: Path, io: dict, target: dict, ctx_bins: list[str],
                 graphs: list[dict], embed_model: Path | None = None, prompt_binary: bool = False) -> dict:
    """Write the bundle's files into `out` (ctx-bins as given, relative to `out`; the embedding LUT from
    `embed_model` where the binaries take embeddings, in their input's encoding where `io` has a quantized
    boundary, the Genie form's); the profile's `genie` entry."""
    tokens = special_tokens(model_dir)
    # Only for a binary that takes fixed-point embeddings (the Genie form's): into a float input Genie writes
    # nothing, so for ours the table would be dead weight in every bundle (335 MB on Gemma 3 270M)
    enc = (io.get("boundary") or {}).get(io["inputs"][0]["name"])
    lut = (write_lut(embed_model, out / LUT, encoding=enc)
           if embed_model is not None and embed_model.is_file() and enc is not None else None)
    config = json.loads((model_dir / "config.json").read_text())
    if "positions" in io:  # Genie's absolute encoding: it writes positions, the graph holds every rotary table
        encoding, rope_gaps = {"type": "absolute"}, []
    else:
        encoding, rope_gaps = positional_encoding(config, int(io["head_dim"]))
    logits = next(o for o in io["outputs"] if o["name"] == "logits")
    cfg = genie_config(context=int(io["context_length"]), vocab=int(logits["shape"][-1]), tokens=tokens,
                       kv_dim=int(io["head_dim"]), ctx_bins=ctx_bins, encoding=encoding,
                       spill_fill=max((g["spill_fill_bytes"] for g in graphs), default=0), lut=lut,
                       groups=cache_groups(io))
    (out / CONFIG).write_text(json.dumps(cfg, indent=4) + "\n")
    (out / HTP_CONFIG).write_text(json.dumps(htp_config(target), indent=4) + "\n")
    has_tokenizer = (model_dir / TOKENIZER).is_file()
    if has_tokenizer:
        shutil.copy2(model_dir / TOKENIZER, out / TOKENIZER)
    gaps = missing(io, [g["name"] for g in graphs], tokenizer=has_tokenizer, lut=lut is not None,
                   extra=rope_gaps, prompt_binary=prompt_binary)
    io_gaps = _io_gaps(io)
    return {
        "verified": False,
        "why": ("nothing here runs Genie or a phone: the files are checked against Qualcomm's published schema, "
                "the binary's I/O against the rules of Genie's sources"),
        "files": [f for f in FILES if (out / f).is_file()],
        "run": (f"on the phone, from this folder with ../compile_qnn beside it: genie-t2t-run -c {CONFIG} -p PROMPT "
                "(docs/phone.md, \"Genie\"); "
                + ("it does not load as it stands: see missing" if io_gaps else
                   "unverified: the binary's I/O meets Genie's rules as read; see missing for what is unchecked")),
        "checked": ("every key and type of Qualcomm's published genie_config.json and htp_backend_ext_config.json "
                    "(quic/ai-hub-apps tutorials/llm_on_genie, quic/ai-hub-models create_genie_config) and the "
                    "values derived from the build: tests/test_genie_bundle.py"),
        "ctx_bins": list(ctx_bins),
        "graphs": graphs,
        "tokens": tokens,
        **({"embedding_lut": {**lut, "from": "the build's embedding model, every id through ONNX Runtime (the "
                              "rows our phone runtime feeds the binaries), encoded ufixed16 over their range"}}
           if lut else {}),
        "missing": gaps,
    }
