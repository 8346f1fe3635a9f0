"""export: the untied HF checkpoint -> an fp32 ONNX decode step with explicit per-layer KV, and where
export.prompt_tokens asks (a phone's device.qnn.prompt_tokens) the prompt graph beside it, that many tokens
a call over the same weights and KV layout.

The artifact (ctx.out) is self-contained: `model.onnx`, `io.json` (inputs,
outputs, per-layer cache sizes and slot rules; see pipeline/graphs/decode_graph.py),
plus the checkpoint's `config.json`, generation config and tokenizer files.

With export.genie (a phone's default), `genie/` beside them: the same graphs in the I/O form Qualcomm's
Genie runtime feeds (decode_graph.export_genie_step), where the model has that form; where it has not
(every layer sliding, a prompt graph longer than the window) the stage says why and `graph.genie` records it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.engine.context import StageContext, StageError

READS = ("export",)
INPUTS = ("untie_head",)
TOOLCHAIN = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")
MEMORY_KEYS = ("export.context_length",)  # the settings that size its memory (named when the kernel kills it)

MIN_OPSET = 18  # the dynamo exporter's floor
GENIE_DIR = "genie"  # the Genie-form graphs, beside ours
GENIE_FACTS = "genie.json"  # built or not, and why not


def run(ctx: StageContext) -> dict:
    from pipeline.engine.child import ChildDied, run_in_child
    from pipeline.sources.checkpoint_files import copy_side_files
    from pipeline.graphs.decode_graph import DecodeGraphError, export_decode_step, export_genie_step

    src = Path(ctx.inputs["untie_head"])
    if not (src / "config.json").is_file():
        raise StageError(f"export: no HF checkpoint at {src} (config.json missing); rerun untie_head")
    cfg = ctx.cfg.export
    context_length = int(cfg.context_length)
    opset = int(cfg.opset)
    mask_value = float(cfg.mask_value)
    prompt_tokens = int(cfg.get("prompt_tokens") or 0)  # null or absent (a config before it): none
    if context_length < 2:
        raise StageError(f"export.context_length must be >= 2, got {context_length}")
    if opset < MIN_OPSET:
        raise StageError(f"export.opset {opset} is below the dynamo exporter's minimum {MIN_OPSET} (use 21)")
    if not mask_value < 0:
        raise StageError(f"export.mask_value must be negative (about -100), got {mask_value}")

    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(str(src))
    except (OSError, ValueError, KeyError) as err:
        raise StageError(f"export: cannot read the checkpoint config at {src}: {err}") from None

    ctx.log(f"exporting {src.name}: context_length={context_length} opset={opset} mask={mask_value}"
            + (f" prompt graph={prompt_tokens} tokens a call" if prompt_tokens else ""))
    what = "the decode step" + (" and the prompt graph" if prompt_tokens else "")
    try:
        with ctx.progress(None, f"torch.onnx.export (dynamo) of {what}, then its checks"):
            # where Genie's form follows, this export in a process of its own: torch keeps a traced model
            # alive after its export returns (pipeline/engine/child.py), and the second export would load its
            # own beside it (19.5 GB at 1.75B). The last export runs here: what it leaves goes with the stage.
            summary = (run_in_child if cfg.get("genie") else _here)(
                export_decode_step, src, ctx.out, context_length=context_length, opset=opset, mask_value=mask_value,
                prompt_tokens=prompt_tokens, what=f"export of {what}")
    except DecodeGraphError as err:
        raise StageError(f"export: {err}") from None
    except ChildDied as err:
        raise StageError(f"export: {err}; export.context_length and export.prompt_tokens size the graphs") from None

    genie = None
    if cfg.get("genie"):
        try:
            with ctx.progress(None, f"{what} in Genie's I/O form (genie/)"):
                g = export_genie_step(src, Path(ctx.out) / GENIE_DIR, context_length=context_length, opset=opset,
                                      prompt_tokens=prompt_tokens)
        except DecodeGraphError as err:
            genie = {"built": False, "why": str(err)}
            ctx.log(f"Genie form not built: {err}")
        except Exception as err:  # noqa: BLE001 - the form is an addition: our graph, exported above, is the artifact
            import shutil

            shutil.rmtree(Path(ctx.out) / GENIE_DIR, ignore_errors=True)
            last = (str(err).strip().splitlines() or [""])[-1][:300]
            genie = {"built": False, "why": f"its export failed: {type(err).__name__}: {last}"}
            ctx.log(f"warning: Genie form not built: its export failed ({type(err).__name__}: {last})")
        else:
            genie = {"built": True, "dir": GENIE_DIR, "bytes": g["bytes"], "prompt_bytes": g["prompt_bytes"],
                     "context_length": context_length, "export_s": g["export_s"],
                     "cache_groups": g["io"].get("cache_groups", []),
                     "positional_encoding": "absolute" if "positions" in g["io"] else "rope"}
            ctx.log(f"{GENIE_DIR}/model.onnx (Genie's form) {g['bytes'] / 1e6:.1f} MB, {g['export_s']} s")
            if g["io"].get("prompt_refused"):
                genie["prompt_refused"] = g["io"]["prompt_refused"]
                ctx.log(f"Genie form: no prompt graph ({g['io']['prompt_refused']}): Genie runs a prompt through "
                        "the token graph")

    # config and tokenizer travel with the graph, so the artifact serves on its own
    copied = copy_side_files(src, Path(ctx.out))
    if not any(n.startswith("tokenizer") for n in copied):
        ctx.log("warning: the checkpoint has no tokenizer files; the artifact carries none")

    io = summary["io"]
    layers = io["layers"]
    kinds = {}
    for layer in layers:
        key = f"{layer['type']}:{layer['cache_len']}"
        kinds[key] = kinds.get(key, 0) + 1
    kv_bytes = sum(2 * io["n_kv_heads"] * layer["cache_len"] * io["head_dim"] * 4 for layer in layers)
    graph = {
        "file": "model.onnx",
        "bytes": summary["bytes"],
        "param_bytes": summary["param_bytes"],
        "external_data": io["external_data"],
        "opset": io["opset"],
        "nodes": summary["nodes"],
        "ops_top": dict(list(summary["ops"].items())[:12]),
        "context_length": io["context_length"],
        "vocab_size": io["vocab_size"],
        "n_layers": io["n_layers"],
        "layers_by_cache": kinds,
        "kv_cache_bytes_fp32": kv_bytes,
        "inputs": len(io["inputs"]),
        "outputs": len(io["outputs"]),
        "bos_token_id": io["bos_token_id"],
        "eos_token_id": io["eos_token_id"],
        "export_s": summary["export_s"],
        "side_files": copied,
    }
    if prompt_tokens:
        graph["prompt"] = {"file": io["prompt"]["file"], "tokens": prompt_tokens, "bytes": summary["prompt_bytes"],
                           "masks": io["prompt"]["masks"]}
    if genie is not None:
        graph["genie"] = genie
        (Path(ctx.out) / GENIE_FACTS).write_text(json.dumps(genie, indent=2) + "\n")  # what the pack reads of it
    ctx.log(f"model.onnx {summary['bytes'] / 1e6:.1f} MB, {summary['nodes']} nodes, {summary['export_s']} s")
    return {
        "graph": graph,
        "metrics": {"export_s": summary["export_s"], "onnx_bytes": summary["bytes"], "nodes": summary["nodes"]},
    }


def _here(fn, *args, what: str, **kwargs):
    """run_in_child's call shape, run in this process."""
    return fn(*args, **kwargs)
