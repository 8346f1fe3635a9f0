"""Qualcomm Genie: the bundle a phone's Genie runtime (libGenie, `genie-t2t-run` in the
QAIRT SDK) starts from, written beside the phone build's qnn.json.

Genie reads three files:
- `genie_config.json`: a "dialog": the context (size, vocabulary, BOS / EOS ids), the
  sampler, the tokenizer's path, and an engine on the QnnHtp backend (mmap, the
  spill-fill buffer, kv-dim, CPU mask and polling; the context binaries in order; the
  model's positional encoding);
- `htp_backend_ext_config.json`: the HTP's soc model and DSP arch, its core profile,
  shared-buffer memory and weight sharing;
- `tokenizer.json`: the model's Hugging Face tokenizer.

The schema is the one Qualcomm publishes, read (not copied) from quic/ai-hub-apps
v0.20.0 `tutorials/llm_on_genie` (`configs/genie/*.json`,
`configs/htp/htp_backend_ext_config.json.template`, `manual_bundle.md`'s soc table)
and quic/ai-hub-models v0.46.1 (`utils/llm_helpers.py`: how its export fills them;
`models/_shared/llm/`: how it splits an LLM and names the graphs). The files are
written here from the build's own facts; tests/test_genie_bundle.py checks their keys
and types against that schema.

What Genie expects of the context binaries goes beyond these files, and our build
differs there: `missing()` names each difference, so the profile says exactly what
stands between this bundle and Genie loading it. Nothing here runs Genie or a phone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CONFIG = "genie_config.json"
HTP_CONFIG = "htp_backend_ext_config.json"
TOKENIZER = "tokenizer.json"
FILES = (CONFIG, HTP_CONFIG, TOKENIZER)

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

# What Genie's HTP engine feeds and reads, as Qualcomm's exports build their graphs (ai-hub-models
# _shared/llm/model.py `_get_input_spec`, `_get_output_names`, `construct_qnn_context_graph_name`).
GENIE_GRAPH = "token_ar1_cl{context}_1_of_1"
GENIE_IO = ("input_ids int32 [1, ar] (or input_embeds [1, ar, hidden]), attention_mask float [1, 1, ar, cl], "
            "position_ids_cos / position_ids_sin [1, 1, ar, rope-dim], past_key_{l}_in [n_kv, 1, head_dim, cl-ar] "
            "(keys transposed), past_value_{l}_in [n_kv, 1, cl-ar, head_dim]; outputs logits, past_key_{l}_out, "
            "past_value_{l}_out")


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
    elif kind != "default":
        gaps.append(f"rope type {kind!r}: Qualcomm's published Genie configs show rope-scaling for llama3 "
                    "only; none is written")
    thetas = {k: _number(v["rope_theta"]) for k, v in sets.items()}
    if len(set(thetas.values())) > 1:
        gaps.append(f"one rotary base per layer type ({thetas}): Genie's positional-encoding holds one "
                    f"rope-theta; written: {enc['rope-theta']} (the full-attention layers')")
    return enc, gaps


def genie_config(*, context: int, vocab: int, tokens: dict, kv_dim: int, ctx_bins: list[str],
                 encoding: dict, spill_fill: int) -> dict:
    """genie_config.json (the dialog schema of Qualcomm's published configs)."""
    eos = tokens["eos"]
    return {"dialog": {
        "version": 1,
        "type": "basic",
        "context": {"version": 1, "size": int(context), "n-vocab": int(vocab), "bos-token": int(tokens["bos"]),
                    "eos-token": eos[0] if len(eos) == 1 else list(eos)},
        "sampler": dict(SAMPLER),
        "tokenizer": {"version": 1, "path": TOKENIZER},
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


def missing(io: dict, graph_names: list[str], *, tokenizer: bool, extra: list[str]) -> list[str]:
    """What stands between this bundle and Genie loading it on a phone, one line each."""
    C = int(io["context_length"])
    ours_in = ", ".join(f"{i['name']} {i['dtype']} {i['shape']}" for i in io["inputs"][:4])
    ours_out = ", ".join(o["name"] for o in io["outputs"][:3])
    gaps = [
        f"graph names: Genie picks a graph by its name, {GENIE_GRAPH.format(context=C)} for the token "
        f"generator (and prompt_ar<N>_cl{C}_1_of_1 for a prompt processor); ours is {graph_names} as "
        "onnxruntime-qnn named it",
        ("the prompt processor is a binary of its own: " + (f"ours takes {io['prompt']['tokens']} tokens a call "
         "(compile_qnn's <precision>/prompt/), its weights the token graph's but compiled apart" if "prompt" in io
         else "none: our binary holds one decode-step graph (one token a call)") +
         "; Qualcomm's Genie exports link a prompt graph (ar128) and a token graph (ar1) over one set of "
         "weights into each binary (weight sharing, which this host's HTP emulation cannot load to check)"),
        f"graph I/O: ours {ours_in}, ... -> {ours_out}, ... (the mask and rotary computed inside from "
        f"`position`); Genie's HTP engine feeds {GENIE_IO}",
        "I/O types: ours float32 at the binary's boundary; Qualcomm's Genie exports quantize the I/O "
        "(AI Hub --quantize_io, 16-bit activations)",
        "the .bin is onnxruntime-qnn's EPContext binary: that Genie takes it as a ctx-bin is unchecked",
    ]
    rings = [x for x in io["layers"] if x["slot_rule"] != "position"]
    if rings:
        gaps.append(f"sliding layers' KV: ours a ring of {rings[0]['cache_len']} slots written at "
                    f"`{rings[0]['slot_rule']}` ({len(rings)} of {len(io['layers'])} layers); Genie's HTP engine feeds "
                    "every layer a linear past of cl-ar entries (no ring)")
    if io.get("embedding"):
        gaps.append(f"token embedding: our binaries take {io['inputs'][0]['name']} from an ONNX Runtime lookup "
                    f"({io['embedding']['model']}, int{io['embedding']['bits']} blocks) run on the CPU; Genie would "
                    "need the table in its own embedding-LUT form (lut-path, datatype, quant-param), not written")
    if not tokenizer:
        gaps.append("tokenizer.json: the checkpoint has none (Genie reads only that form)")
    return gaps + list(extra)


def write_bundle(out: Path, *, model_dir: Path, io: dict, target: dict, ctx_bins: list[str],
                 graphs: list[dict]) -> dict:
    """Write the three files into `out` (ctx-bins as given, relative to `out`); the profile's `genie` entry."""
    tokens = special_tokens(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    encoding, rope_gaps = positional_encoding(config, int(io["head_dim"]))
    logits = next(o for o in io["outputs"] if o["name"] == "logits")
    cfg = genie_config(context=int(io["context_length"]), vocab=int(logits["shape"][-1]), tokens=tokens,
                       kv_dim=int(io["head_dim"]), ctx_bins=ctx_bins, encoding=encoding,
                       spill_fill=max((g["spill_fill_bytes"] for g in graphs), default=0))
    (out / CONFIG).write_text(json.dumps(cfg, indent=4) + "\n")
    (out / HTP_CONFIG).write_text(json.dumps(htp_config(target), indent=4) + "\n")
    has_tokenizer = (model_dir / TOKENIZER).is_file()
    if has_tokenizer:
        shutil.copy2(model_dir / TOKENIZER, out / TOKENIZER)
    return {
        "verified": False,
        "why": "nothing here runs Genie or a phone: the files are checked against Qualcomm's published schema only",
        "files": [f for f in FILES if (out / f).is_file()],
        "run": (f"on the phone, from this folder with ../compile_qnn beside it: genie-t2t-run -c {CONFIG} -p PROMPT "
                "(docs/phone.md, \"Genie\"); it does not load as it stands: see missing"),
        "checked": ("every key and type of Qualcomm's published genie_config.json and htp_backend_ext_config.json "
                    "(quic/ai-hub-apps tutorials/llm_on_genie, quic/ai-hub-models create_genie_config) and the "
                    "values derived from the build: tests/test_genie_bundle.py"),
        "ctx_bins": list(ctx_bins),
        "graphs": graphs,
        "tokens": tokens,
        "missing": missing(io, [g["name"] for g in graphs], tokenizer=has_tokenizer, extra=rope_gaps),
    }
