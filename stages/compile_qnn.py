"""compile_qnn: the pack stage's QNN-ready graphs -> HTP context binaries, offline.

For a phone (weight path qnn_graph), each precision the pack stage built is
compiled by onnxruntime-qnn's HTP backend for the device's chip (`device.qnn`:
soc_model / soc_id and htp_arch, e.g. SM8750 / v79 for the S25) into
`<precision>/model_ctx.onnx` + its `.bin` context binary, or, where the graph's
weights pass 90% of the HTP's per-graph limit (`device.qnn.max_graph_bytes`), into
parts of whole layers, `<precision>/part<k>/` (pipeline/graphs/parts.py; qnn.json
lists them in order). The QNN EP is
registered as a plugin with CPU fallback disabled, and the compiled model must
hold nothing but EPContext nodes: a graph that would silently run on the CPU
is a failure (pipeline/graphs/qnn.py). The QNN SDK version the wheel bundles is in
this stage's toolchain key (`qnn-sdk`), since a context binary is tied to it.

Each binary is kept in the stage's journal the moment it is compiled (StageContext.remembered_files): a
run killed later (a session's end; at 1.75B a prompt graph compiles for most of an hour) resumes past
the binaries it had, and a rerun with another cache key cannot read them.

Where the pack stage built the deployed precision's token graph in the I/O form Qualcomm's Genie runtime
feeds (its `genie/`), that graph is compiled too, into `genie/<precision>/` with `genie/io.json`: the
binary the phone's Genie bundle lists (stages/deploy_profile.py).

`io.json` (inputs, outputs, per-layer KV layout and slot rules), the token
embedding's lookup (`embed/model.onnx`, which the phone runs on its CPU and
whose rows are the binaries' `inputs_embeds`, pack.qnn_embedding) and the
tokenizer travel along, so the folder is what a phone runtime needs.

Other devices have no compile_qnn stage: `applies(device)` is false for them,
so dvc.yaml leaves it out of their builds and no consumer reads it. The `exp`
build (`dvc exp run -S device=...`), whose device dvc.yaml cannot know, runs it
and records {"applies": false}. Without onnxruntime-qnn the stage fails with
what to install.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.engine.context import StageContext, StageError

READS = ("device",)
INPUTS = ("pack",)
TOOLCHAIN = ("onnx", "onnxruntime", "onnxruntime-qnn", "qnn-sdk")


def applies(device: dict) -> bool:
    """Only a build for a QNN HTP (a phone) has this stage (pipeline/engine/layout.py stage_applies)."""
    return device.get("accelerator") == "qnn_htp"


def run(ctx: StageContext) -> dict:
    from omegaconf import OmegaConf

    from pipeline.graphs import qnn
    from pipeline.sources.checkpoint_files import copy_side_files

    device = OmegaConf.to_container(ctx.cfg.device, resolve=True)
    pack = Path(ctx.inputs["pack"])
    npu_file = pack / "npu.json"
    if not applies(device):
        return {"applies": False, "reason": f"device {device.get('name')!r} has no QNN HTP",
                "metrics": {"binaries": 0, "bytes": 0}}
    if not npu_file.is_file():
        raise StageError(f"compile_qnn: {npu_file} is missing: the pack stage built no QNN graph; rerun pack")
    target = device.get("qnn")
    if not target:
        raise StageError(f"compile_qnn: device {device.get('name')!r} has accelerator qnn_htp but no qnn block")
    reason = qnn.missing()
    if reason:
        raise StageError(f"compile_qnn: cannot compile for {target['soc_model']} ({target['htp_arch']}): {reason}")
    npu = json.loads(npu_file.read_text())
    out = Path(ctx.out)

    def compile_kept(name: str, dest: Path, graph: Path, float_graph: Path, precision: str, what: str, **kw) -> dict:
        """qnn.compile_parts into `dest`, its binaries kept in the stage's journal as soon as they are made."""
        return ctx.remembered_files(
            name, dest, lambda d: qnn.compile_parts(graph, float_graph, d, target, precision, **kw), what)

    compiled = {}
    float_graph = pack / "float" / "model.onnx"
    with ctx.progress(None, "QNN HTP context binaries") as bar:
        for precision in npu["precisions"]:
            entry = npu["graphs"][precision]
            graph = pack / entry["graph"]
            try:
                facts = compile_kept(precision, out / precision, graph, float_graph if float_graph.is_file() else graph,
                                 precision, f"the {precision} context binary", progress=lambda _: bar.advance(),
                                 ranges=entry.get("parts"))
            except qnn.QnnError as err:
                raise StageError(f"compile_qnn: {err}") from None
            # a mixed graph (pack.qnn_mix_groups): which layers are 4-bit, which 8-bit
            compiled[precision] = {"dir": precision, **facts,
                                   **({"groups": entry["groups"], "head": entry.get("head")} if entry.get("groups") else {})}
            prompt_graph = npu["graphs"][precision].get("prompt_graph")
            if prompt_graph:  # the prompt graph beside the token graph, its own binaries (no weight sharing yet)
                try:
                    float_prompt = pack / "float" / Path(prompt_graph).name  # where a QDQ graph's layers are found
                    pfacts = compile_kept(f"{precision}-prompt", out / precision / "prompt", pack / prompt_graph,
                                      float_prompt if float_prompt.is_file() else pack / prompt_graph, precision,
                                      f"the {precision} prompt graph's context binary",
                                      progress=lambda _: bar.advance(), options=qnn.PROMPT_COMPILE_OPTIONS,
                                      ranges=entry.get("parts"))
                except qnn.QnnError as err:
                    # The token graph is the artifact; the prompt graph only shortens a prompt's way in. A
                    # precision whose prompt graph the HTP refuses ships without it, said here and in qnn.json
                    # (Gemma 3 270M's w8a16 one at 128 tokens did, QNN_COMMON_ERROR_MEM_ALLOC, before
                    # qnn.PROMPT_COMPILE_OPTIONS).
                    shutil.rmtree(out / precision / "prompt", ignore_errors=True)
                    compiled[precision]["prompt_refused"] = str(err)
                    ctx.log(f"warning: {precision}: the HTP refused its prompt graph ({err}); this precision takes "
                            "a prompt a token a call (export.prompt_tokens smaller, or =0 for none)")
                else:
                    compiled[precision]["prompt"] = {"dir": f"{precision}/prompt",
                                                     "tokens": npu["prompt_graph"]["tokens"], **pfacts}
                    ctx.log(f"{precision} prompt graph ({npu['prompt_graph']['tokens']} tokens a call): "
                            f"{pfacts['bytes'] / 1e6:.1f} MB in {len(pfacts['parts'])} part(s), "
                            f"{pfacts['compile_s']:.1f} s")
            n = len(facts["parts"])
            ctx.log(f"{precision}: {facts['bytes'] / 1e6:.1f} MB of context binary for {target['soc_model']} "
                    f"(HTP {target['htp_arch']}) in {facts['compile_s']:.1f} s"
                    + (f", {n} parts of layers {', '.join('%d-%d' % (p['layers'][0], p['layers'][1] - 1) for p in facts['parts'])}"
                       f" ({max(p['weight_bytes'] for p in facts['parts']) / 2**20:.0f} MiB of weights at most, the "
                       f"budget {facts['budget_bytes'] / 2**20:.0f} MiB)" if n > 1 else ""))
    genie = npu.get("genie") or {"built": False, "why": "the pack stage predates the Genie form"}
    if genie["built"]:  # the deployed precision's token graph in Genie's I/O form (pack's genie/)
        p = genie["precision"]
        with ctx.progress(None, f"the {p} token graph in Genie's form: its context binary"):
            try:
                gfacts = compile_kept(f"genie-{p}", out / "genie" / p, pack / genie["graph"],
                                  pack / "genie" / "float" / "model.onnx", p, f"the {p} context binary in Genie's form",
                                  ranges=npu["graphs"][p].get("parts"))
            except qnn.QnnError as err:
                genie = {"built": False, "why": f"compile_qnn: {err}"}
                shutil.rmtree(out / "genie", ignore_errors=True)
                # our binaries are the artifact; the Genie bundle then lists ours, and says why
                ctx.log(f"warning: the Genie form not compiled: {err}")
    if genie["built"]:
        shutil.copy2(pack / genie["io"], out / "genie" / "io.json")
        prompt = genie.get("prompt") if isinstance(genie.get("prompt"), dict) else None
        genie = {"built": True, "precision": p, "dir": f"genie/{p}", "io": "genie/io.json", **gfacts}
        ctx.log(f"{p} in Genie's form: {gfacts['bytes'] / 1e6:.1f} MB of context binary in {len(gfacts['parts'])} "
                f"part(s), {gfacts['compile_s']:.1f} s")
        if prompt is not None:  # its prompt graph, as ours: a binary of its own, shipped without where refused
            with ctx.progress(None, f"the {p} prompt graph in Genie's form: its context binary"):
                try:
                    pfacts = compile_kept(f"genie-{p}-prompt", out / "genie" / p / "prompt", pack / prompt["graph"],
                                      pack / "genie" / "float" / "prompt.onnx", p,
                                      f"the {p} prompt graph's context binary in Genie's form",
                                      options=qnn.PROMPT_COMPILE_OPTIONS, ranges=npu["graphs"][p].get("parts"))
                except qnn.QnnError as err:
                    shutil.rmtree(out / "genie" / p / "prompt", ignore_errors=True)
                    genie["prompt_refused"] = str(err)
                    ctx.log(f"warning: the HTP refused the Genie-form prompt graph ({err}): Genie takes a prompt "
                            "through the token graph, a token a call")
                else:
                    genie["prompt"] = {"dir": f"genie/{p}/prompt", "tokens": prompt["tokens"], **pfacts}
                    ctx.log(f"{p} prompt graph in Genie's form ({prompt['tokens']} tokens a call): "
                            f"{pfacts['bytes'] / 1e6:.1f} MB, {pfacts['compile_s']:.1f} s")
    shutil.copy2(pack / "io.json", out / "io.json")
    embedding = npu.get("embedding", {})
    off_graph = (pack / qnn.EMBED_DIR).is_dir()
    if off_graph:  # the lookup the phone runs on its CPU, before every binary
        shutil.copytree(pack / qnn.EMBED_DIR, out / qnn.EMBED_DIR)
    copy_side_files(pack, out)
    info = {
        "format": "edgekiln-qnn-context/1",
        "deployed": npu["deployed"],
        "precisions": npu["precisions"],
        "selection": npu.get("selection"),  # which precision ships and why, every option's figures (pack)
        "compiled": compiled,
        "target": {"soc_model": target["soc_model"], "htp_arch": target["htp_arch"], "soc_id": target["soc_id"],
                   "device": device["name"]},
        "qnn_sdk": qnn.sdk_version(),
        "max_graph_bytes": int(target.get("max_graph_bytes") or 2**31),
        "backend": "onnxruntime-qnn HTP backend (libQnnHtp), plugin EP, CPU fallback disabled",
        "genie": genie,
        "embedding": ({"dir": qnn.EMBED_DIR, **{k: embedding[k] for k in ("model", "bits", "block_size", "bytes",
                                                                        "input", "output", "op")}}
                      if off_graph else {"in_graph": True}),
    }
    (out / "qnn.json").write_text(json.dumps(info, indent=2) + "\n")
    return {**info, "metrics": {"binaries": len(compiled),
                                "bytes": sum(c["bytes"] for c in compiled.values())}}
