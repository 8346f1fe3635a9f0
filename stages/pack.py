"""pack: the quantize stage's 4-bit codes -> the layout of the kernel the device runs.

The weight path is chosen by `pipeline.quant.weight_path.select(device, priority)`
(written as `weight_path.json` in every case). Per path the artifact is:

- w4a8_gptq_vllm: `gptq/`, a GPTQ v1 checkpoint vLLM loads from its config.json
  alone (quantization_config: gptq, 4 bits, sym, desc_act false, lm_head true;
  qweight/qzeros/scales/g_idx per quantized linear, the head included; the
  untied checkpoint's other tensors; tokenizer files). dtype is set to
  bfloat16: vLLM's GPTQ kernels take fp16/bf16 activations only.
- w4a16_tinygemm: `tinygemm.safetensors` (per layer `L.packed` in this CPU's
  tinygemm layout + `L.scales_and_zeros` bf16 [K/g, N, 2]; `L.rowmajor` codes
  for a layer the kernel refuses) + `tinygemm.json` (layout, per-layer record,
  prefill mode), plus `model.safetensors` with the untied checkpoint's
  non-quantized tensors and its config/tokenizer, so the folder loads on its
  own: `pipeline.runtimes.tinygemm.load_tinygemm_model(out, out)`.
- w4_ort_matmulnbits: `model.onnx` + `io.json` (format edgekiln-gqa/1), the
  graph ONNX Runtime runs fast (pipeline/graphs/gqa_graph.py): GroupQueryAttention
  over KV buffers the runtime binds as past and present, window-sized for
  sliding layers, every linear (the head included) a MatMulNBits from the
  quantize stage's own codes, one graph for prefill and decode; serves the
  export's context length. The token embedding: a tied checkpoint's is a
  GatherBlockQuantized over the head's own weight (one copy); an untied one's
  a GatherBlockQuantized of its table's 8- or 4-bit codes, or its fp32 table,
  as the quantize stage measured and chose (quant.json "embedding"). Config and tokenizer copied from the export
  artifact; runs in `edgekiln_runtime.gqa.GqaDecoder`. The graph takes onnxruntime-genai's inputs
  and `genai_config.json` (the device's threads) lies beside it: the folder is an onnxruntime-genai model
  as it is (`og.Model(folder)`). The layout before it (lengths fed, `past_key_i`) measured no faster
  (benchmarks/genai_layout.py, docs/devices.md), so it is no option; GqaDecoder still reads such folders.
- qnn_graph (phone NPU): `float/model.onnx` (+ its external data), the export made QNN-ready
  (pipeline/graphs/npu_rewrite.py: sanitized, rotary tables, fused RMSNorm; checked
  against the export on a decode past the window), and per QDQ precision in
  `pack.qnn_precisions` `<precision>/model.onnx`, calibrated on the calibrate
  stage's windows run through the float graph (16-bit activations, MatMul
  weights symmetric with a scale per output channel, `pack.qnn_weights`, w8a16's
  codes from GPTQ on the calibrate stage's Hessians, `pack.qnn_weight_method`; the
  residual stream left float for the HTP's fp16, `pack.qnn_residual`, and so are the
  attention cores (q.K^T, mask, Softmax, softmax.V), `pack.qnn_attention`;
  fp16 runs the float graph itself in the HTP's fp16 math). Which one ships is measured
  (`pack.qnn_select`, _Selection): the first QDQ precision whose CPU-EP figures over
  held-out windows meet parity.artifact.qnn_<p> (w4a16 where it passes, w8a16 where not); the
  later ones are recorded, not kept. `npu.json` lists what is kept with the selection, the
  rewrites and the calibration; `io.json` and the tokenizer travel along.
  stages/compile_qnn.py turns each into a context binary.
- gguf_q4_0 (llama.cpp devices): `model.gguf`, llama.cpp's own conversion of
  the untied checkpoint (metadata, tokenizer, names: pipeline/toolchains/converter.py
  finds the converter) with every quantized linear, the head included, written
  as Q4_0 blocks of the quantize stage's own codes and fp16 scales (a group-32
  symmetric result is Q4_0 exactly, an 8-bit one Q8_0: pipeline/quant/gguf_q4.py);
  a tied checkpoint's token embedding is the head's own tensor, one copy, an
  untied one's the quantize stage's measured choice (its codes as Q8_0 / Q4_0,
  or the converter's f16 table) (pack.gguf_token_embedding: auto). Read back with
  gguf's dequantizer and checked bit-for-bit against the quant result before
  the stage succeeds. `gguf.json` records the tensor map, the rows the
  converter reordered, the tensor types and the converter's identity.
- model_dtype: nothing but weight_path.json; {"applies": false}.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.sources.checkpoint_files import copy_side_files
from pipeline.engine.context import StageContext, StageError

READS = ("pack", "device", "priority", "parity.artifact")  # the floors: _Selection
INPUTS = ("untie_head", "calibrate", "quantize", "export")
TOOLCHAIN = ("torch", "onnx", "onnxruntime", "safetensors", "numpy", "gguf", "llama.cpp-converter")
MEMORY_KEYS = ("pack.qnn_calibration_sequences",)  # the settings that size its memory (named when the kernel kills it)

GPTQ_DIR = "gptq"
GPTQ_GROUP_SIZES = (32, 64, 128)  # vLLM's gptq_marlin/CPU check (-1 aside)


def _untied_tensors(src: Path, skip: set[str]) -> dict:
    """The untied checkpoint's tensors except `skip` (the quantized linears' weights)."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key not in skip:
                    out[key] = f.get_tensor(key)
    if not out:
        raise StageError(f"pack: no safetensors tensors in {src}")
    return out


def _bytes(paths) -> int:
    total = 0
    for p in paths:
        p = Path(p)
        total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    return total


def _write_gptq(ctx, meta, layers, src: Path) -> dict:
    from safetensors.torch import save_file

    from pipeline.quant import int4_layouts as L

    if any((z != 8).any() for _, _, z, _ in layers.values()):
        raise StageError("pack: the vLLM GPTQ path takes symmetric codes only (vLLM's gptq_marlin/CPU kernels "
                         "support sym=true, zero pinned at 8); quantize with quantize.sym=true or use "
                         "priority=fidelity (W4A16)")
    groups = {g for *_, g in layers.values()}
    if len(groups) != 1:
        raise StageError(f"pack: the GPTQ config has one group size, the layers have {sorted(groups)} "
                         "(vLLM fuses q/k/v and gate/up, which must share it); use quantize.group_fallback=error")
    g = groups.pop()
    if g not in GPTQ_GROUP_SIZES:
        raise StageError(f"pack: vLLM's GPTQ kernels take group sizes {GPTQ_GROUP_SIZES}, got {g}")
    for name, (q, *_rest) in layers.items():
        n, k = q.shape
        if n % 32 or k % 32:
            raise StageError(f"pack: {name} is [{n}, {k}]; vLLM's CPU GPTQ kernel needs both multiples of 32")
    out = Path(ctx.out) / GPTQ_DIR
    out.mkdir(parents=True, exist_ok=True)
    tensors = _untied_tensors(src, {f"{name}.weight" for name in layers})
    for name, (q, s, z, _g) in layers.items():
        try:
            packed = L.to_gptq(q, s, z, g)
        except L.LayoutError as err:
            raise StageError(f"pack: {name}: {err}") from None
        for part, t in packed.items():
            tensors[f"{name}.{part}"] = t
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    copied = copy_side_files(src, out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    if "text_config" in cfg and isinstance(cfg["text_config"], dict):
        cfg["text_config"]["tie_word_embeddings"] = False
    cfg["dtype"] = "bfloat16"
    cfg["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": g, "sym": True, "desc_act": False,
        "lm_head": "lm_head" in layers, "checkpoint_format": "gptq", "static_groups": False,
        "true_sequential": True, "damp_percent": 0.01,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"dir": GPTQ_DIR, "group_size": g, "side_files": copied,
            "bytes": _bytes([out])}


def _write_tinygemm(ctx, meta, layers, src: Path, prefill: str, threshold: int) -> dict:
    from safetensors.torch import save_file

    from pipeline.quant import int4_layouts as L
    from pipeline.runtimes.tinygemm import TINYGEMM_JSON, TINYGEMM_TENSORS, pack_tinygemm

    for name, (q, s, z, g) in layers.items():
        if g not in L.TINYGEMM_GROUP_SIZES:
            raise StageError(f"pack: tinygemm takes group sizes {L.TINYGEMM_GROUP_SIZES}; {name} has {g}")
    tensors, records = pack_tinygemm(layers)
    out = Path(ctx.out)
    save_file(tensors, str(out / TINYGEMM_TENSORS))
    base = _untied_tensors(src, {f"{name}.weight" for name in layers})
    save_file({k: v.contiguous() for k, v in base.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    copied = copy_side_files(src, out)
    fallback = sorted(n for n, r in records.items() if r["kernel"] != "tinygemm")
    for name in fallback:
        ctx.log(f"warning: {name} runs dequant + GEMM at every row count: {records[name]['reason']}")
    doc = {
        "format": "edgekiln-tinygemm/1", "layout": L.tinygemm_layout(), "group_size": int(meta["group_size"]),
        "sym": bool(meta.get("sym", False)), "activation_dtype": "bfloat16", "prefill": prefill,
        "prefill_threshold": threshold, "layers": records, "fallback_layers": fallback,
        "base_tensors": "model.safetensors", "side_files": copied,
        "load": "pipeline.runtimes.tinygemm.load_tinygemm_model(<this folder>, <this folder>, prefill_mode)",
    }
    (out / TINYGEMM_JSON).write_text(json.dumps(doc, indent=2) + "\n")
    return {"files": [TINYGEMM_TENSORS, TINYGEMM_JSON, "model.safetensors"], "fallback_layers": fallback,
            "layout": doc["layout"], "bytes": _bytes([out / TINYGEMM_TENSORS, out / "model.safetensors"])}


def _write_ort(ctx, untied: Path, export_dir: Path, quant_dir: Path, accuracy_level: int, io_layout: str,
               threads: int, kv_dtype: str) -> dict:
    from pipeline.graphs.gqa_graph import GENAI_CONFIG, GqaGraphError, build_gqa_graph, write_genai_config
    from pipeline.quant.codes import PackError

    io_path = export_dir / "io.json"
    if not io_path.is_file():
        raise StageError(f"pack: no io.json in the export artifact {export_dir}; rerun export")
    max_len = int(json.loads(io_path.read_text())["context_length"])
    with ctx.progress(None, f"GroupQueryAttention + MatMulNBits graph, {max_len} positions"):
        try:
            facts = build_gqa_graph(untied, quant_dir, Path(ctx.out), max_len=max_len, accuracy_level=accuracy_level,
                                    io_layout=io_layout, kv_dtype=kv_dtype)
        except (GqaGraphError, PackError) as err:
            raise StageError(f"pack: {err}") from None
    # the tokenizer (tokenizer.json, its config with the special tokens, the chat template) travels with
    # the graph: GqaDecoder's callers and onnxruntime-genai's og.Tokenizer read it from this folder
    copied = copy_side_files(export_dir, Path(ctx.out))
    genai = None
    if io_layout == "genai":
        try:
            write_genai_config(Path(ctx.out), threads=threads)
        except GqaGraphError as err:
            raise StageError(f"pack: {err}") from None
        genai = GENAI_CONFIG
    files = [p for p in Path(ctx.out).glob("model.onnx*")]
    return {"graph": "edgekiln-gqa/1", "io_layout": io_layout, "genai_config": genai, "max_len": max_len,
            "bytes": sum(p.stat().st_size for p in files), "ops": facts.get("ops"), "side_files": copied,
            "facts": {k: v for k, v in facts.items() if k not in ("records", "ops")}}


# The QNN-ready float graph must compute what the export computes: checked
# over this many decode steps (past a sliding window) before anything is built on it.
QNN_CHECK_STEPS = 96
# Decode steps the QDQ calibration may spend (pack.qnn_calibration_steps: null), see _write_qnn.
QNN_CALIBRATION_STEPS = 1024
QNN_CHECK_MIN_SNR_DB = 100.0


def _calibration_sequences(cal_dir: Path, context_length: int, n: int) -> list[list[int]]:
    import numpy as np

    from pipeline.graphs.qnn import calibration_sequences

    tokens = cal_dir / "token_ids.npy"
    if not tokens.is_file():
        raise StageError(f"pack: {tokens} is missing: the calibrate stage predates QDQ calibration; rerun it")
    return calibration_sequences(np.load(tokens), context_length, n)


STREAM_PROBE = ".stream_probe.onnx"


def _check_and_probe_stream(float_dir: Path, want: list, check: list[int], embed) -> tuple[float, float]:
    """The QNN-ready float graph decoding `check` against the export's logits `want`: (its worst step's
    SNR, the largest |entry| of its residual stream over those steps). The stream's tensors are fetched
    through a second model file of the same structure with them as outputs, beside the same weights
    (model.onnx.data), removed after."""
    import numpy as np
    import onnx

    from pipeline.graphs import npu_rewrite
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.graphs.decode_graph import snr_db

    structure = onnx.load(str(float_dir / "model.onnx"), load_external_data=False)
    stream = npu_rewrite.residual_tensors(structure)
    structure.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                                  for t in stream)
    onnx.save(structure, str(float_dir / STREAM_PROBE))
    del structure
    try:
        probe = OnnxDecoder(float_dir, threads=2, model_file=STREAM_PROBE, embed=embed, extra_outputs=stream)
        worst, peak = float("inf"), 0.0
        for w, t in zip(want, check):
            worst = min(worst, snr_db(w, probe.step(t)))
            peak = max([peak] + [float(np.abs(a).max()) for a in probe.extra.values()])
    finally:
        (float_dir / STREAM_PROBE).unlink(missing_ok=True)
    return worst, peak


PROMPT_MODEL = "prompt.onnx"


class _Selection:
    """Which precision ships (pack.qnn_select). With `measured`, the precisions are built in
    pack.qnn_precisions' order and each QDQ one, once built, runs its token graph on the CPU EP
    (qnn.cpu_qdq_decoder: the HTP's quantization arithmetic) against the fp32 export over
    pack.qnn_select_windows windows of the embedded corpus's held-out tail clear of the calibration
    text, in llama.cpp's units (pipeline/measure/kld.py), gated by parity.artifact.qnn_<p>. The first
    that meets its floors ships; the QDQ precisions after it are neither built nor kept (`wants`), only
    recorded; fp16 (no CPU stand-in) is kept where listed, and ships where it comes first. None
    passing is a StageError naming each one's figures, before any compile. verify_parity then gates
    the shipped binary on the HTP itself.

    Why the export and not the eager model: pack holds no torch model, and the export matches it
    (verify_parity's x86 figures). Why verify_parity's held-out tail: a precision is chosen by the
    measure that will gate it. Memory: the reference's scored rows are kept (windows x n_ctx/2 x
    vocabulary float32: 0.5 GB on Gemma 3 270M's 262k vocabulary), one decoder session at a time."""

    def __init__(self, ctx, out: Path, export_dir: Path, hf_dir: Path, cal_dir: Path, precisions: list[str], bos):
        self.ctx, self.out, self.export_dir, self.hf_dir, self.cal_dir = ctx, out, export_dir, hf_dir, cal_dir
        self.precisions, self.bos = precisions, bos
        self.measured = str(ctx.cfg.pack.get("qnn_select", "measured")) == "measured"
        self.options, self.deployed, self.windows, self.base, self.data = {}, None, None, None, None

    def wants(self, p: str) -> bool:
        """Whether precision `p` is built: every one unmeasured; measured, until one has shipped (and fp16)."""
        if self.measured and self.deployed is not None and p != "fp16":
            self.options[p] = {"measured": False, "why": f"{self.deployed} is listed before it and ships"}
            return False
        return True

    def _held_out(self) -> None:
        """The held-out windows and their facts (self.windows, self.data): seconds of tokenizing."""
        import numpy as np
        from transformers import AutoTokenizer

        from pipeline.measure import kld
        from pipeline.sources import textdata

        io = json.loads((self.export_dir / "io.json").read_text())
        n_ctx = min(512, int(io["context_length"]))
        n = int(self.ctx.cfg.pack.get("qnn_select_windows", 2))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.hf_dir))
            bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else self.bos  # verify_parity's framing
            cal = np.load(self.cal_dir / "token_ids.npy").reshape(-1)
            self.windows, facts = kld.heldout_windows(self.hf_dir, tokenizer, cal, n_ctx, bos, n)
        except (OSError, ValueError, textdata.TextDataError) as err:
            raise StageError(f"pack: pack.qnn_select=measured needs the held-out text: {err} (pack.qnn_select="
                             "first ships the first of pack.qnn_precisions unmeasured)") from None
        if len(self.windows) < n:
            raise StageError(f"pack: {len(self.windows)} held-out windows of {n_ctx} tokens clear of the calibration "
                             f"text, pack.qnn_select_windows={n}: lower it")
        scored = sum(len(kld.scored_positions(len(w))) for w in self.windows)
        self.data = {**{k: v for k, v in facts.items() if isinstance(v, (int, float, str, bool))},
                     "windows": len(self.windows), "n_ctx": n_ctx, "scored_tokens": scored,
                     "windows_sha256": textdata.ids_sha256([t for w in self.windows for t in w])}

    def _reference(self) -> None:
        """The fp32 export's scored rows over the held-out windows (self.base): minutes at 1.75B."""
        from pipeline.measure import kld
        from pipeline.runtimes.onnx import OnnxDecoder

        ref = OnnxDecoder(self.export_dir, threads=2)
        with self.ctx.progress(self.data["scored_tokens"], "precision selection: the fp32 export over the "
                                                           "held-out windows") as bar:
            self.base = [kld.scored_logits(ref, w, bar.advance) for w in self.windows]

    def measure(self, p: str) -> None:
        """`p` just built: its figures, and whether it ships."""
        from pipeline.measure import kld

        if p == "fp16" or not self.measured:
            self.options[p] = {"measured": False, "why": "pack.qnn_select=first" if not self.measured else
                               "no CPU stand-in (its arithmetic is the HTP's fp16): verify_parity gates it on the HTP"}
            self.deployed = self.deployed or p
            return
        figures = self._figures(p, f"{p}/model.onnx")
        limits = self.ctx.cfg.parity.artifact.get(f"qnn_{p}")
        missed = kld.below_floors(figures, limits) if limits is not None else []
        self.options[p] = {"measured": True, "passed": not missed, "missed": missed, **figures}
        self._say(p, figures, missed, f"parity.artifact.qnn_{p}")
        if not missed:
            self.deployed = p

    def _figures(self, what: str, model_file: str) -> dict:
        """The QDQ graph `model_file` (relative to the pack folder) on the CPU EP against the fp32 export over
        the held-out windows: llama.cpp's KL statistics and the logits' SNR. Kept in the stage's journal
        (StageContext.remembered) by `what`: at 1.75B each is ten minutes, and a per-part search runs
        several; a pack stopped later measures none of them again (nor the reference, if all are kept)."""
        import re

        if self.data is None:
            self._held_out()
        return self.ctx.remembered(f"selection-{re.sub(r'[^A-Za-z0-9.-]+', '_', what)}",
                                   lambda: self._measured(what, model_file),
                                   f"precision selection: {what} on the CPU EP")

    def _measured(self, what: str, model_file: str) -> dict:
        import numpy as np

        from pipeline.graphs import qnn
        from pipeline.graphs.decode_graph import snr_from_sums
        from pipeline.measure import kld

        if self.base is None:
            self._reference()
        dec = qnn.cpu_qdq_decoder(self.out, model_file)
        acc, sig, err = kld.Accumulator(), 0.0, 0.0
        with self.ctx.progress(self.data["scored_tokens"], f"precision selection: {what} on the CPU EP") as bar:
            for w, rows in zip(self.windows, self.base):
                got = kld.scored_logits(dec, w, bar.advance)
                first = kld.scored_positions(len(w)).start
                for i in range(0, len(rows), 32):  # float64 in chunks: a 262k vocabulary is 2 MB a row
                    b, q = rows[i:i + 32].astype(np.float64), got[i:i + 32].astype(np.float64)
                    acc.add(b, q, w[first + 1 + i:first + 1 + i + len(b)])
                    sig, err = sig + float((b * b).sum()), err + float(((b - q) ** 2).sum())
        del dec
        figures = {**acc.summary(), "logits_snr_db": snr_from_sums(sig, err)}
        keep = ("tokens", "ppl_ratio", "kld_mean", "kld_p99", "kld_max", "same_top1_pct", "logits_snr_db")
        return {k: float(figures[k]) for k in keep}

    def _say(self, what: str, figures: dict, missed: list, floors: str) -> None:
        self.ctx.log(f"precision selection: {what} on the CPU EP: KLD mean {figures['kld_mean']:.4f}, p99 "
                     f"{figures['kld_p99']:.4f}, PPL ratio {figures['ppl_ratio']:.4f}, same top-1 "
                     f"{figures['same_top1_pct']:.2f}%, {figures['logits_snr_db']:.1f} dB over "
                     f"{self.data['scored_tokens']} held-out tokens: "
                     + (f"meets {floors}" if not missed else "misses " + ", ".join(missed)))

    def mix(self, graphs: dict, float_dir: Path) -> None:
        """Per part, where w4a16 missed its floors as a whole and w8a16 met its own (pack.qnn_mix_groups):
        the layers in groups, the w8a16 graph's parts under the HTP's per-graph budget (compile_qnn's
        plan) or, where it is one part, that many even groups; and the head (the final norm and the head's
        MatMul) as a unit of its own. Each unit at w4a16 with the rest at w8a16 (parts.assemble: the two QDQ
        graphs share one calibration, so a mixed graph is their layers side by side) runs on the CPU EP
        over the same held-out windows; the units that meet
        parity.artifact.qnn_mixed alone are added, least KLD added per byte saved first, each addition measured and kept
        while the whole still meets them. Where any group stays 4-bit, `mixed/` ships in w8a16's place
        (its prompt graph assembled the same way); every trial is recorded. Memory: both QDQ graphs with
        their weights, the assembled one and one CPU session (~2.5x the w8a16 graph)."""
        import shutil

        import onnx

        from pipeline.graphs import parts, qnn
        from pipeline.measure import kld
        from pipeline.sources.tensorfile import share_external_data

        w4 = self.options.get("w4a16") or {}
        if not (self.measured and self.deployed == "w8a16" and w4.get("measured") and not w4.get("passed")
                and "w4a16" in graphs):
            return
        groups_cfg = int(self.ctx.cfg.pack.get("qnn_mix_groups", 0) or 0)
        if groups_cfg <= 1:
            self.options["mixed"] = {"measured": False, "why": f"pack.qnn_mix_groups={groups_cfg}: the whole "
                                                                "graph's choice only"}
            return
        token = {p: self.out / p / "model.onnx" for p in ("w4a16", "w8a16")}
        structure = onnx.load(str(token["w8a16"]), load_external_data=False)
        float_model = onnx.load(str(float_dir / "model.onnx"), load_external_data=False)
        target = self.ctx.cfg.device.get("qnn") or {}
        budget = int(qnn.PART_WEIGHT_SHARE * int(target.get("max_graph_bytes") or 2**31))
        try:
            bounds = parts.boundaries(structure, float_model)
            htp = parts.plan(structure, budget, bounds)
        except parts.PartsError as err:
            raise StageError(f"pack: per-part precision (pack.qnn_mix_groups): {err}") from None
        del structure, float_model
        n = len(bounds) - 1
        if len(htp) > 1:
            ranges, how = htp, "the w8a16 graph's parts under the HTP's per-graph budget (compile_qnn's cut)"
        else:
            k = min(groups_cfg, n)
            cuts = [round(i * n / k) for i in range(k + 1)]
            ranges = list(zip(cuts[:-1], cuts[1:]))
            how = f"pack.qnn_mix_groups={groups_cfg}: even groups of layers (the w8a16 graph is one part)"
        if len(ranges) < 2:
            self.options["mixed"] = {"measured": False, "why": f"{n} layer(s): no groups to choose over"}
            return
        limits = self.ctx.cfg.parity.artifact.get("qnn_mixed")
        if limits is None:  # a build file from before per-part precision: w8a16 ships as it did
            self.options["mixed"] = {"measured": False, "why": "parity.artifact has no qnn_mixed floors (conf/parity/"
                                                                "default.yaml has them): the whole graph's choice only"}
            self.ctx.log("precision selection: no parity.artifact.qnn_mixed floors: per-part precision not tried")
            return
        models = {p: onnx.load(str(f)) for p, f in token.items()}
        mixed_dir, trials, built = self.out / "mixed", [], [None]
        head = len(ranges)  # a unit of its own: the final norm and the head (Gemma 3's 262k rows: most bytes)

        def choice(four: set) -> list[tuple[int, int, str]]:
            return [(a, b, "w4a16" if i in four else "w8a16") for i, (a, b) in enumerate(ranges)]

        def head_of(four: set) -> str:
            return "w4a16" if head in four else "w8a16"

        def named(four: set) -> str:
            layers = [f"{ranges[i][0]}-{ranges[i][1] - 1}" for i in sorted(four - {head})]
            return " and ".join((["layers " + ", ".join(layers)] if layers else []) + (["the head"] if head in four else []))

        def build(four: set) -> int:
            """The mixed graph written to mixed/; its weights' bytes."""
            shutil.rmtree(mixed_dir, ignore_errors=True)
            mixed_dir.mkdir()
            try:
                m = parts.assemble(models, choice(four), bounds, head=head_of(four))
            except parts.PartsError as err:
                raise StageError(f"pack: per-part precision (pack.qnn_mix_groups): {err}") from None
            onnx.save(m, str(mixed_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                      location="model.onnx.data", size_threshold=1024)
            built[0] = set(four)
            return parts.weight_bytes(m)

        def trial(four: set) -> dict:
            size = build(four)
            label = f"mixed, w4a16 in {named(four)}"
            figures = self._figures(label, "mixed/model.onnx")
            missed = kld.below_floors(figures, limits)
            self._say(label, figures, missed, "parity.artifact.qnn_mixed")
            row = {"w4a16_layers": [list(ranges[i]) for i in sorted(four) if i != head], "w4a16_head": head in four,
                   "weight_bytes": size, "passed": not missed, "missed": missed, **figures}
            trials.append(row)
            return row

        alone = {i: trial({i}) for i in range(len(ranges) + 1)}
        # by the error a byte saved costs, as the quantize stage spends its 8-bit budget (a 262k-row head
        # saves more bytes than a group of layers at a like error)
        base_bytes, base_kld = parts.weight_bytes(models["w8a16"]), float(self.options["w8a16"]["kld_mean"])

        def cost(i: int) -> float:
            return max(alone[i]["kld_mean"] - base_kld, 0.0) / max(base_bytes - alone[i]["weight_bytes"], 1)

        order = sorted((i for i, r in alone.items() if r["passed"]), key=cost)
        four, best = set(), None
        for i in order:
            row = alone[i] if not four else trial(four | {i})
            if row["passed"]:
                four, best = four | {i}, row
        record = {"measured": True, "groups_from": how, "w8a16_weight_bytes": base_bytes, "trials": trials}
        if not four:
            shutil.rmtree(mixed_dir, ignore_errors=True)
            self.options["mixed"] = {**record, "passed": False, "why": "no group meets parity.artifact.qnn_mixed "
                                                                       "at w4a16 with the rest at w8a16: w8a16 ships"}
            self.ctx.log("precision selection: no group of layers passes at w4a16 with the rest at w8a16: w8a16 ships")
            return
        if built[0] != four:
            build(four)
        groups = [{"layers": [a, b], "precision": p} for a, b, p in choice(four)]
        entry = {**{k: v for k, v in graphs["w8a16"].items()
                    if k not in ("graph", "prompt_graph", "matmul_weights", "weight_type")},
                 "weight_type": {p: graphs[p].get("weight_type") for p in ("w4a16", "w8a16")},
                 "matmul_weights": {p: graphs[p].get("matmul_weights") for p in ("w4a16", "w8a16")},
                 "graph": "mixed/model.onnx", "groups": groups, "head": head_of(four), "groups_from": how,
                 "parts": [list(r) for r in ranges] if len(htp) > 1 else None}
        prompts = [graphs[p].get("prompt_graph") for p in ("w4a16", "w8a16")]
        if all(prompts):  # the prompt graph the same way, on its own layer boundaries
            pmodels = {p: onnx.load(str(self.out / graphs[p]["prompt_graph"])) for p in ("w4a16", "w8a16")}
            pname = Path(prompts[1]).name
            try:
                pbounds = parts.boundaries(pmodels["w8a16"], onnx.load(str(float_dir / pname), load_external_data=False))
                pm = parts.assemble(pmodels, choice(four), pbounds, head=head_of(four))
            except parts.PartsError as err:
                raise StageError(f"pack: per-part precision, the prompt graph: {err}") from None
            onnx.save(pm, str(mixed_dir / pname), save_as_external_data=True, all_tensors_to_one_file=True,
                      location=f"{pname}.data", size_threshold=1024)
            del pmodels, pm
            differ = qnn.same_weights(mixed_dir / "model.onnx", float_dir / "model.onnx", mixed_dir / pname,
                                      float_dir / pname)
            if differ:
                raise StageError(f"pack: the mixed prompt graph's weights are not its token graph's ({len(differ)} "
                                 f"differ, first {differ[0]})")
            share_external_data(mixed_dir / "model.onnx", mixed_dir / pname)
            entry["prompt_graph"] = f"mixed/{pname}"
        graphs["mixed"] = entry
        self.options["mixed"] = {**record, "passed": True, "missed": [], "groups": groups, "head": head_of(four),
                                 **{k: best[k] for k in best if k not in ("w4a16_layers", "w4a16_head", "passed",
                                                                          "missed")}}
        self.deployed = "mixed"
        self.ctx.log(f"precision selection: mixed ships, w4a16 in {named(four)}, w8a16 in the rest ({how})")

    def result(self) -> dict:
        """npu.json's `selection`: the rule, the data, every option's figures or why it has none, what ships,
        what is kept (the shipped one first) and what was measured and not kept."""
        if self.deployed is None:
            raise StageError("pack: no phone precision meets its parity.artifact floors on the CPU EP (" + "; ".join(
                f"qnn_{p}: {', '.join(o['missed'])}" for p, o in self.options.items() if o.get("measured"))
                + "): add fp16 to pack.qnn_precisions, or pack.qnn_select=first to build the first one regardless")
        names = (["mixed"] if "mixed" in self.options else []) + self.precisions  # mixed: tried in mix()
        kept = [self.deployed] + [p for p in self.precisions if p == "fp16" and p != self.deployed
                                  or not self.measured and p != self.deployed]
        dropped = [p for p in names if p not in kept and (p != "mixed" or self.options[p].get("measured"))]
        if self.measured:
            self.ctx.log(f"precision selection: {self.deployed} ships"
                         + (f"; not kept: {', '.join(dropped)}" if dropped else ""))
        return {"rule": ("the first of pack.qnn_precisions whose CPU-EP figures meet parity.artifact.qnn_<p> "
                         "(pack.qnn_select=measured); where w4a16 misses and w8a16 passes, w4a16 per group of "
                         "layers where the whole still meets parity.artifact.qnn_mixed (pack.qnn_mix_groups)")
                if self.measured else
                        "pack.qnn_select=first: the first listed, not measured",
                "data": self.data, "reference": "the fp32 export (ONNX Runtime CPU EP)" if self.data else None,
                "options": {p: self.options[p] for p in names if p in self.options},
                "deployed": self.deployed, "kept": kept, "dropped": dropped}


def _float_islands(graph, cfg) -> tuple[list[str], dict, dict]:
    """(the nodes a QDQ graph leaves float, as pack.qnn_residual and pack.qnn_attention ask; the residual
    stream's nodes; the attention cores' nodes) of a QNN-ready float graph, its embedding lookup still in
    it (the stream is followed from the lookup)."""
    from pipeline.graphs import npu_rewrite

    residual = npu_rewrite.residual_stream(graph)
    attention = npu_rewrite.attention_cores(graph)
    float_nodes = [n for k in ("adds", "norms", "writers") for n in residual[k]] \
        if str(cfg.qnn_residual) == "fp16" else []
    if str(cfg.qnn_attention) == "fp16":
        float_nodes += [n for names in attention.values() for n in names]
    return float_nodes, residual, attention


def _embedding_out(graph, overrides: dict):
    """npu_rewrite.embedding_input on `graph` (RewriteError as it raises), the embedding's range override
    moved to the input that replaces its lookup: (graph, the cut)."""
    from pipeline.graphs import npu_rewrite

    graph, cut = npu_rewrite.embedding_input(graph)
    if cut["gather_output"] in overrides:
        overrides[npu_rewrite.EMBEDS_INPUT] = overrides.pop(cut["gather_output"])
    return graph, cut


def _qdq_graph(ctx, p: str, src: Path, dst: Path, paths: list[Path], overrides: dict, float_nodes: list,
               cal_dir: Path, what: str = "", made: dict | None = None) -> dict:
    """One QDQ graph of precision `p` from the float graph `src`: ONNX Runtime's quantizer over the spilled
    samples `paths`, then the weights' codes as pack.qnn_weights / qnn_weight_method ask (w8a16: GPTQ and/or
    blocks; w4a16: the quantize stage's codes). The same for the token graph and its prompt graph, so
    both hold the same weights (checked by the caller): `made` carries the token graph's codes to its
    prompt graph (qnn.requantize_weights), so they are made once."""
    from pipeline.graphs import qnn

    cfg = ctx.cfg.pack
    weights, method = str(cfg.qnn_weights), str(cfg.qnn_weight_method)
    block = int(cfg.qnn_weight_block) if weights == "per_block" else None
    ort_weights = "per_channel" if weights == "per_block" else weights  # the blocks come after ORT's pass
    label = f"QDQ {p}" + (f" ({what})" if what else "")
    with ctx.progress(None, f"{label}: ONNX Runtime's quantizer over {len(paths)} samples"):
        try:
            facts = qnn.qdq_quantize(src, dst, qnn.read_samples(paths), p, overrides, ort_weights,
                                     float_nodes=float_nodes)
        except qnn.QnnError as err:
            raise StageError(f"pack: {err}") from None
    # w8a16's codes made here, not ONNX Runtime's rounding: GPTQ's, and/or on a grid in blocks
    # (ORT's quantizer goes no finer than a scale per channel). w4a16's are the quantize stage's own
    # 4-bit codes in its groups (the build's 4-bit weights, which every CPU path packs).
    if p == "w4a16" and weights != "per_tensor":
        n_w = facts["matmul_weights"]["count"]
        with ctx.progress(n_w, f"{label}: the quantize stage's codes for {n_w} MatMul weights") as bar:
            try:
                facts["matmul_weights"].update(qnn.requantize_weights(
                    dst, src, Path(ctx.inputs["untie_head"]), cal_dir, codes_from=Path(ctx.inputs["quantize"]),
                    advance=bar.advance, made=made))
            except qnn.QnnError as err:
                raise StageError(f"pack: {err}") from None
    elif p == "w8a16" and weights != "per_tensor" and (method == "gptq" or block is not None):
        n_w = facts["matmul_weights"]["count"]
        reuse = " (the token graph's, not made again)" if made else ""
        with ctx.progress(n_w, f"{label}: {method} codes for {n_w} MatMul weights{reuse}") as bar:
            try:
                facts["matmul_weights"].update(qnn.requantize_weights(
                    dst, src, Path(ctx.inputs["untie_head"]), cal_dir, method=method, block=block,
                    advance=bar.advance, made=made))
            except qnn.QnnError as err:
                raise StageError(f"pack: {err}") from None
    else:
        facts["matmul_weights"]["method"] = "rtn"
    return facts


def _qnn_ready(path: Path, C: int, embedding_out: bool, factor: int, cfg, what: str, position: str = "position"):
    """An exported graph beside the token graph (its prompt graph, or a Genie-form graph) made QNN-ready as
    the token graph was: prepare, the embedding's lookup out where the token graph's is, the residual
    stream carried divided by the same `factor`; (graph, its quantization's {"overrides": the embedding's
    ranges, "float_nodes": the float islands pack.qnn_residual and pack.qnn_attention ask for, found on this
    graph}). `position`: the input the rotary tables are computed from (Genie's form: position_ids, where it
    has any). StageError naming `what` where a rewrite refuses it."""
    from pipeline.graphs import npu_rewrite
    from pipeline.sources.tensorfile import load_onnx

    try:
        graph, _ = npu_rewrite.prepare(load_onnx(path), position=position, context_length=C)
        overrides = npu_rewrite.embedding_ranges(graph)
        float_nodes, _, _ = _float_islands(graph, cfg)
        if embedding_out:
            graph, _ = _embedding_out(graph, overrides)
        if factor > 1:
            muls = npu_rewrite.scale_residual(graph, factor)["muls"]
            float_nodes += muls if str(cfg.qnn_residual) == "fp16" else []
    except npu_rewrite.RewriteError as err:
        raise StageError(f"pack: {what} cannot be made QNN-ready: {err}") from None
    return graph, {"overrides": overrides, "float_nodes": float_nodes}


def _prompt_float(export_dir: Path, float_dir: Path, C: int, embedding_out: bool, factor: int,
                  want: list, check: list[int], embed, cfg) -> tuple[dict, dict]:
    """The export's prompt graph made QNN-ready as the token graph was (prepare, the embedding's lookup
    out where the token graph's is, the residual stream carried divided by the same `factor`), saved as
    float/prompt.onnx, then run over `check` a chunk at a time against the export's decode-step logits
    `want` at each chunk's last token: ({tokens, chunks, worst_snr_db, bytes}, what its QDQ variants take
    as the token graph's do: {"overrides": the embedding's ranges, "float_nodes": the float islands
    pack.qnn_residual and pack.qnn_attention ask for, found on this graph})."""
    import gc

    import onnx

    from pipeline.graphs.decode_graph import snr_db
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.sources.tensorfile import share_external_data

    graph, quant = _qnn_ready(export_dir / PROMPT_MODEL, C, embedding_out, factor, cfg, "the exported prompt graph")
    onnx.save(graph, str(float_dir / PROMPT_MODEL), save_as_external_data=True, all_tensors_to_one_file=True,
              location=PROMPT_MODEL + ".data", size_threshold=1024)
    del graph
    gc.collect()
    # its weights read from the token graph's data file (the same bytes; checked below through them)
    shared = share_external_data(float_dir / "model.onnx", float_dir / PROMPT_MODEL)
    dec = OnnxDecoder(float_dir, threads=2, embed=embed, model_file=None, prompt_file=PROMPT_MODEL)
    T = dec.prompt_tokens
    # at least 3 calls, so the check reads a cache that earlier calls wrote (96 steps under a chunk of 128
    # would otherwise be one padded call); a call shorter than T is padded as a prompt's last one is
    n = min(T, -(-len(check) // 3))
    worst = min(snr_db(want[min(i + n, len(check)) - 1], dec.prefill(check[i:i + n]))
                for i in range(0, len(check), n))
    chunks = dec.calls["prompt"]
    del dec
    gc.collect()
    return ({"graph": f"float/{PROMPT_MODEL}", "tokens": T, "chunks": chunks, "worst_snr_db": worst,
             "bytes": sum(f.stat().st_size for f in float_dir.glob(PROMPT_MODEL + "*")),
             "shared_bytes": shared["shared_bytes"]},
            quant)


GENIE_DIR = "genie"  # the export's Genie-form graphs (stages/export.py), and this stage's of them
# The inputs Genie's engine writes as codes into a quantized graph where the graph has them (pipeline/runtimes/
# genie_feed.py): the sliding layers' mask only with their cache group, the rotary tables only under Genie's rope
# encoding (its absolute one writes int32 positions)
GENIE_WRITES = ("inputs_embeds", "attention_mask", "swa_attention_mask", "position_ids_cos", "position_ids_sin")


def _genie_ready(src: Path, name: str, C: int, factor: int, scaling: float | None, cfg):
    """One Genie-form graph of the export (`name` in genie/) made QNN-ready as ours was: prepare, the
    embedding's lookup out, the residual stream divided by the same `factor`; (graph, its quantization's
    overrides and float nodes). The inputs Genie writes get their full ranges, not calibrated ones (the
    calibration's positions and masks may not reach them): the rotary tables +-their `scaling` (None: Genie's
    absolute encoding, the tables in the graph as ours), the masks from the masked value to the attend value
    (one encoding: Genie writes the sliding group's mask in the global mask's codes)."""
    import numpy as np

    from pipeline.graphs.decode_graph import GENIE_ATTEND, GENIE_MASKED, GENIE_POSITIONS, GENIE_ROPE, GENIE_SWA_MASK

    graph, quant = _qnn_ready(src / name, C, True, factor, cfg, f"the export's Genie-form {name}",
                              position=GENIE_POSITIONS)
    if scaling is not None:
        quant["overrides"].update({t: [{"rmin": np.float32(-scaling), "rmax": np.float32(scaling)}]
                                   for t in GENIE_ROPE})
    masks = {"attention_mask", GENIE_SWA_MASK} & {i.name for i in graph.graph.input}
    quant["overrides"].update({t: [{"rmin": np.float32(GENIE_MASKED), "rmax": np.float32(GENIE_ATTEND)}]
                               for t in masks})
    return graph, quant


def _genie_float(export_dir: Path, out: Path, C: int, factor: int, want: list, check: list[int], embed,
                 embedding: dict | None, cfg) -> tuple[dict, dict | None]:
    """The export's Genie-form token graph (genie/, decode_graph.export_genie_step) and its prompt graph
    where it has one, made QNN-ready (_genie_ready), saved in genie/float/ (the prompt graph's weights read
    from the token graph's data file), and checked against the export's decode steps `want` over `check`,
    fed as Genie feeds them (pipeline/runtimes/genie_feed.py; the prompt graph a chunk at a time, each chunk's
    last row): ({graph, worst_snr_db, prompt}, what their QDQ graphs take: {"token": {overrides, float
    nodes}, "prompt": ...}); ({built: false, why}, None) where there is none to build."""
    import gc

    import onnx

    from pipeline.graphs.decode_graph import snr_db
    from pipeline.runtimes.genie_feed import GenieFeedDecoder
    from pipeline.sources.tensorfile import share_external_data

    src = export_dir / GENIE_DIR
    if not (src / "io.json").is_file():
        said = export_dir / "genie.json"  # the export's why (stages/export.py GENIE_FACTS)
        why = json.loads(said.read_text()).get("why") if said.is_file() else None
        return {"built": False, "why": f"the export built none: {why}" if why else
                "the export wrote no Genie form (export.genie=false)"}, None
    if embedding is None:
        return {"built": False, "why": "pack.qnn_embedding=graph: Genie feeds inputs_embeds from its LUT, so its "
                                       "form takes the embedding off the graph (pack.qnn_embedding=int8)"}, None
    gio = json.loads((src / "io.json").read_text())
    scaling = float(gio["rope"]["attention_scaling"]) if "rope" in gio else None
    fdir = out / GENIE_DIR / "float"
    fdir.mkdir(parents=True)
    quant = {}
    for role, name in (("token", "model.onnx"), ("prompt", PROMPT_MODEL)):
        if role == "prompt" and "prompt" not in gio:
            continue
        graph, quant[role] = _genie_ready(src, name, C, factor, scaling, cfg)
        onnx.save(graph, str(fdir / name), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=name + ".data", size_threshold=1024)
        del graph
        gc.collect()
    if "prompt" in quant:  # the same weights: read from the token graph's data file
        share_external_data(fdir / "model.onnx", fdir / PROMPT_MODEL)
    (fdir / "io.json").write_text(json.dumps(_phone_io(gio, embedding, "../../"), indent=2) + "\n")
    dec = GenieFeedDecoder(fdir, threads=2, embed=embed)
    worst = min(snr_db(w, dec.step(t)) for w, t in zip(want, check))
    del dec
    facts = {"graph": f"{GENIE_DIR}/float/model.onnx", "worst_snr_db": worst, "steps": len(check)}
    if "prompt" in quant:
        pdec = GenieFeedDecoder(fdir, threads=2, embed=embed, model_file=None, prompt_file=PROMPT_MODEL)
        T = pdec.prompt_tokens
        n = min(T, -(-len(check) // 3))  # at least 3 calls, the last ones reading what the first wrote
        pworst = min(snr_db(want[min(i + n, len(check)) - 1], pdec.prefill(check[i:i + n]))
                     for i in range(0, len(check), n))
        facts["prompt"] = {"graph": f"{GENIE_DIR}/float/{PROMPT_MODEL}", "tokens": T, "worst_snr_db": pworst,
                           "chunks": pdec.calls["prompt"]}
        worst = min(worst, pworst)
        del pdec
    if worst < QNN_CHECK_MIN_SNR_DB:
        raise StageError(f"pack: the QNN-ready Genie-form graphs depart from the export ({worst:.1f} dB at worst "
                         f"over {len(check)} steps, needs {QNN_CHECK_MIN_SNR_DB:g}): a rewrite is wrong")
    return facts, quant


def _genie_boundary(dst: Path, quant: dict, given: dict | None = None, want: dict | None = None) -> dict:
    """The QDQ graph `dst`'s boundary in the codes Genie writes and reads (pipeline/graphs/genie_io.py),
    saved in place (the structure only: its data file is unchanged); the encodings. `given`: the encodings
    the boundary must take (the token graph's, for the prompt graph: Genie's validator wants one
    encoding a tensor name across the graphs), else the inputs Genie writes that only float islands read
    take their quantization's given range; `want`: encodings the boundary is then held to exactly where it
    came out a rounding apart (genie_io.impose)."""
    import onnx

    from pipeline.graphs import genie_io

    structure = onnx.load(str(dst), load_external_data=False)
    inputs = {i.name for i in structure.graph.input}
    if given is None:
        given = {t: genie_io.uint16_encoding(float(o[0]["rmin"]), float(o[0]["rmax"]))
                 for t, o in quant["overrides"].items() if t in GENIE_WRITES and "rmin" in o[0]}
    try:
        structure, enc = genie_io.quantized_boundary(structure, given=given)
        genie_io.tie_kv(structure, enc)
        if want is not None:
            genie_io.impose(structure, enc, want)
        missed = [t for t in GENIE_WRITES if t in inputs and t not in enc]
        if missed:
            raise genie_io.BoundaryError(f"{missed} left float: Genie writes them as codes")
    except genie_io.BoundaryError as err:
        raise StageError(f"pack: the Genie-form graph {dst.name}'s boundary: {err}") from None
    onnx.save(structure, str(dst))
    return enc


def _genie_mix(out: Path, gdir: Path, name: str, mix: dict) -> None:
    """<gdir>/mixed/`name`: the Genie-form graph `name` assembled from its w8a16 and w4a16 QDQ graphs
    (<gdir>/<precision>/, one calibration) by the deployed mix's groups and head, as ours was
    (parts.assemble; `mix`: the pack's graphs["mixed"] entry)."""
    import onnx

    from pipeline.graphs import parts

    src = {q: gdir / q / name for q in ("w8a16", "w4a16")}
    dst = gdir / "mixed" / name
    models = {q: onnx.load(str(f)) for q, f in src.items()}
    try:
        bounds = parts.boundaries(models["w8a16"], onnx.load(str(out / GENIE_DIR / "float" / name),
                                                             load_external_data=False))
        m = parts.assemble(models, [(g["layers"][0], g["layers"][1], g["precision"]) for g in mix["groups"]], bounds,
                           head=mix.get("head"))
    except parts.PartsError as err:
        raise StageError(f"pack: the Genie-form {name} at the per-part mix: {err}") from None
    del models
    onnx.save(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=True, location=name + ".data",
              size_threshold=1024)


def _genie_qdq(ctx, out: Path, p: str, float_facts: dict, quant: dict, seqs: list, stride: int,
               cal_dir: Path, mix: dict | None = None, made: dict | None = None) -> dict:
    """The deployed precision's graphs in Genie's form: the QNN-ready float graphs (_genie_float) quantized
    as ours were (_genie_graphs: their own calibration, fed as Genie feeds them; the deployed graph's weight
    codes, checked; `p` mixed: at w8a16 and w4a16 over that one calibration, assembled by the deployed mix's
    groups `mix`, _genie_mix; then their boundary in the types Genie writes and reads, _genie_boundary:
    uint16 inputs and KV outputs, each KV pair one encoding, the prompt graph's the token graph's), kept in
    the stage's journal once made (~30 minutes at 1.75B), then run on the CPU EP fed as Genie feeds them
    against our QDQ graph of the same precision (the prompt graph against the Genie token graph):
    genie/<p>/model.onnx (and prompt.onnx), genie/io.json (with the boundary's encodings); its facts.
    `made`: {precision: the codes our graphs made, by checkpoint name} (qnn.requantize_weights), taken
    rather than made again."""
    import numpy as np

    from pipeline.graphs import qnn
    from pipeline.graphs.decode_graph import snr_db
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    built = ctx.remembered_files(
        f"genie-{p}", out / GENIE_DIR,
        lambda gdir: _genie_graphs(ctx, out, gdir, p, quant, seqs, stride, cal_dir, mix, made),
        f"the {p} graphs in Genie's form")
    facts, enc, prompt = built["quantize"], built["boundary"], built["prompt"]
    # what the Genie form computes against our deployed graph, both on the CPU EP's QDQ arithmetic, over
    # the first calibration sequence's first steps
    steps = seqs[0][:QNN_CHECK_STEPS]
    ours = qnn.cpu_qdq_decoder(out, f"{p}/model.onnx")
    a = [ours.step(t) for t in steps]
    del ours
    genie = GenieFeedDecoder(out / GENIE_DIR, threads=2, model_file=f"{p}/model.onnx", config=qnn.CPU_QDQ_CONFIG)
    b = [genie.step(t) for t in steps]
    del genie
    agree = float(np.mean([int(np.argmax(x)) == int(np.argmax(y)) for x, y in zip(a, b)]))
    snr = snr_db(np.stack(a), np.stack(b))
    ctx.log(f"Genie form ({p}): the boundary uint16 ({len(enc)} tensors), against our {p} graph over "
            f"{len(steps)} steps: {snr:.1f} dB, top-1 {agree:.3f}")
    if prompt is not None:  # its prompt graph a chunk at a time against its token graph step by step
        pdec = GenieFeedDecoder(out / GENIE_DIR, threads=2, model_file=None, prompt_file=f"{p}/{PROMPT_MODEL}",
                                config=qnn.CPU_QDQ_CONFIG)
        T = pdec.prompt_tokens
        ends = list(range(T, len(steps) + 1, T)) or [len(steps)]
        got = [pdec.prefill(steps[e - min(T, e):e]) for e in ends]
        prompt["against_token_graph"] = {"chunk_ends": len(ends), "snr_db": snr_db(np.stack([b[e - 1] for e in ends]),
                                                                                 np.stack(got)),
                                         "top1_agreement": float(np.mean([int(np.argmax(b[e - 1])) == int(np.argmax(g))
                                                                          for e, g in zip(ends, got)]))}
        del pdec
        ctx.log(f"Genie form ({p}), its prompt graph ({T} tokens a call) against its token graph at "
                f"{len(ends)} chunk end(s): {prompt['against_token_graph']['snr_db']:.1f} dB")
    return {"built": True, "precision": p, "graph": f"{GENIE_DIR}/{p}/model.onnx", "io": f"{GENIE_DIR}/io.json",
            "float": float_facts, "quantize": facts, "boundary": enc,
            "against_ours": {"precision": p, "steps": len(steps), "snr_db": snr, "top1_agreement": agree,
                             "feed": "as Genie's engine feeds it (pipeline/runtimes/genie_feed.py), CPU EP QDQ"},
            "prompt": prompt or "not built (no prompt graph exported): Genie runs a prompt through the token "
                                "graph, a token a call"}


def _genie_graphs(ctx, out: Path, gdir: Path, p: str, quant: dict, seqs: list, stride: int, cal_dir: Path,
                  mix: dict | None, made: dict | None) -> dict:
    """_genie_qdq's graphs, written into `gdir` (genie/'s place: its journal folder while made, then linked
    into genie/): <p>/model.onnx (and prompt.onnx) and io.json, from genie/float/ and our <p> graph. Its
    facts: the quantizer's, the boundary's encodings, the prompt graph's (or None)."""
    import gc
    import shutil

    from pipeline.graphs import qnn
    from pipeline.runtimes.genie_feed import GenieFeedDecoder
    from pipeline.sources.tensorfile import share_external_data

    fdir = out / GENIE_DIR / "float"
    dst = gdir / p
    sources = ("w8a16", "w4a16") if p == "mixed" else (p,)  # the precisions quantized
    for q in {p, *sources}:
        (gdir / q).mkdir()
    gio = json.loads((fdir / "io.json").read_text())
    spill = gdir / ".calibration_samples"
    facts = {}
    try:
        dec = GenieFeedDecoder(fdir, threads=2)
        with ctx.progress(sum(len(q) for q in seqs), "Genie form: QDQ calibration, decode steps fed as Genie "
                                                     "feeds them") as bar:
            paths = qnn.spill_samples(qnn.decode_samples(dec, seqs, stride, advance=bar.advance), spill)
        del dec
        gc.collect()
        for q in sources:
            facts[q] = _qdq_graph(ctx, q, fdir / "model.onnx", gdir / q / "model.onnx", paths,
                                  quant["token"]["overrides"], quant["token"]["float_nodes"], cal_dir,
                                  what="Genie's form", made=(made or {}).get(q))
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    if p == "mixed":
        _genie_mix(out, gdir, "model.onnx", mix)
        facts = {**facts, "groups": mix["groups"], "head": mix.get("head")}
    else:
        facts = facts[p]
    differ = qnn.same_weights(out / p / "model.onnx", out / "float" / "model.onnx", dst / "model.onnx",
                              fdir / "model.onnx")
    if differ:
        raise StageError(f"pack: the Genie-form {p} graph's weights are not the deployed graph's ({len(differ)} "
                         f"differ, first {differ[0]})")
    enc = _genie_boundary(dst / "model.onnx", quant["token"])
    prompt = None
    if "prompt" in quant:
        prompt = _genie_prompt_qdq(ctx, out, gdir, p, quant["prompt"], enc, seqs, cal_dir, mix, made)
        share_external_data(dst / "model.onnx", dst / PROMPT_MODEL)
    for q in set(sources) - {p}:  # the mix's sources, assembled
        shutil.rmtree(gdir / q)
    for spec in [gio] + ([gio["prompt"]] if "prompt" in gio else []):
        for v in spec["inputs"] + spec["outputs"]:
            if v["name"] in enc:
                v["dtype"] = enc[v["name"]]["dtype"]
    if prompt is None:
        gio.pop("prompt", None)
    # one folder up from genie/float/: the embedding model's path one ../ shorter
    gio = {**gio, "boundary": enc,
           "embedding": {**gio["embedding"], "model": gio["embedding"]["model"].removeprefix("../")}}
    (gdir / "io.json").write_text(json.dumps(gio, indent=2) + "\n")
    return {"quantize": facts, "boundary": enc, "prompt": prompt}


def _genie_prompt_qdq(ctx, out: Path, gdir: Path, p: str, quant: dict, enc: dict, seqs: list, cal_dir: Path,
                      mix: dict | None = None, made: dict | None = None) -> dict:
    """The Genie-form prompt graph at precision `p`: calibrated on its own chunks (fed as Genie feeds
    them), every boundary tensor held at the token graph's encoding `enc` (quantization overrides of the
    exact scale and zero point; Genie's validator wants one encoding a tensor name across the graphs, and
    the two share the KV buffers), the token graph's weight codes (checked; `p` mixed: at w8a16 and w4a16,
    each checked against that precision's token graph, then assembled by `mix` as the token graph was);
    genie/<p>/prompt.onnx."""
    import gc
    import shutil

    import numpy as np

    from pipeline.graphs import qnn
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    fdir, dst = out / GENIE_DIR / "float", gdir / p
    spill = gdir / ".calibration_samples"
    exact = {name: [{"scale": np.asarray(e["scale"], np.float32), "zero_point": np.asarray(-e["offset"], e["dtype"])}]
             for name, e in enc.items() if name != "logits"}
    try:
        dec = GenieFeedDecoder(fdir, threads=2, model_file=None, prompt_file=PROMPT_MODEL)
        with ctx.progress(sum(len(q) for q in seqs), "Genie form: the prompt graph's calibration chunks") as bar:
            paths = qnn.spill_samples(qnn.prompt_samples(dec, seqs, advance=bar.advance), spill)
        del dec
        gc.collect()
        for q in (("w8a16", "w4a16") if p == "mixed" else (p,)):
            src = gdir / q
            facts = _qdq_graph(ctx, q, fdir / PROMPT_MODEL, src / PROMPT_MODEL, paths, {**quant["overrides"], **exact},
                               quant["float_nodes"], cal_dir, what="Genie's form, the prompt graph",
                               made=(made or {}).get(q))
            differ = qnn.same_weights(src / "model.onnx", fdir / "model.onnx", src / PROMPT_MODEL, fdir / PROMPT_MODEL)
            if differ:
                raise StageError(f"pack: the Genie-form {q} prompt graph's weights are not its token graph's "
                                 f"({len(differ)} differ, first {differ[0]})")
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    if p == "mixed":
        _genie_mix(out, gdir, PROMPT_MODEL, mix)
    penc = _genie_boundary(dst / PROMPT_MODEL, quant, given={k: enc[k] for k in GENIE_WRITES if k in enc}, want=enc)
    apart = [k for k in penc if k in enc and penc[k] != enc[k]]
    if apart:
        raise StageError(f"pack: the Genie-form {p} prompt graph's {apart[0]} is encoded apart from the token "
                         f"graph's ({penc[apart[0]]} / {enc[apart[0]]}): Genie's validator wants them alike")
    return {"graph": f"{GENIE_DIR}/{p}/{PROMPT_MODEL}", "tokens": int(json.loads((fdir / "io.json").read_text())
                                                                      ["prompt"]["tokens"]),
            "samples": facts["samples"]}


def _phone_io(io: dict, embedding: dict | None, up: str = "") -> dict:
    """The export's io.json for a phone graph: with the embedding off the graph, `input_ids` is
    replaced by `inputs_embeds` and "embedding" names the lookup's model (relative to the io.json)."""
    if embedding is None:
        return io
    from pipeline.graphs.qnn import EMBED_DIR

    def embeds_for_ids(inputs: list[dict]) -> list[dict]:
        ids = next(i for i in inputs if i["name"] == "input_ids")
        embeds = {"name": embedding["output"], "shape": list(ids["shape"]) + [embedding["hidden"]],
                  "dtype": "float32"}
        return [embeds if i["name"] == "input_ids" else i for i in inputs]

    phone = {**io, "inputs": embeds_for_ids(io["inputs"]),
             "embedding": {"model": f"{up}{EMBED_DIR}/{embedding['model']}", "input": embedding["input"],
                           "output": embedding["output"], "bits": embedding["bits"],
                           "block_size": embedding["block_size"]}}
    if "prompt" in io:
        phone["prompt"] = {**io["prompt"], "inputs": embeds_for_ids(io["prompt"]["inputs"])}
    return phone


def _write_qnn(ctx, export_dir: Path, cal_dir: Path) -> dict:
    """The export made QNN-ready, and its calibrated QDQ variants (module docstring)."""
    import gc
    import shutil

    import onnx

    from pipeline.quant import gptq
    from pipeline.graphs import npu_rewrite, qnn
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.graphs.decode_graph import snr_db
    from pipeline.sources.tensorfile import load_onnx, share_external_data

    cfg = ctx.cfg.pack
    precisions = [str(p) for p in cfg.qnn_precisions]
    io = json.loads((export_dir / "io.json").read_text())
    C = int(io["context_length"])
    out = Path(ctx.out)
    float_dir = out / "float"
    float_dir.mkdir()
    try:
        prepared, rewrites = npu_rewrite.prepare(load_onnx(export_dir / "model.onnx"),
                                                 position="position", context_length=C)
    except npu_rewrite.RewriteError as err:
        raise StageError(f"pack: the exported graph cannot be made QNN-ready: {err}") from None
    qdq = [p for p in precisions if p != "fp16"]
    weights = str(cfg.qnn_weights)
    block = int(cfg.qnn_weight_block) if weights == "per_block" else None  # w8a16's, see _qdq_graph
    if "w8a16" in qdq and block is not None:
        try:
            qnn.check_weight_block(prepared, block)
        except qnn.QnnError as err:
            raise StageError(f"pack: {err}") from None
    overrides = npu_rewrite.embedding_ranges(prepared) if qdq else {}  # before the save moves the data out
    float_nodes, residual, attention = _float_islands(prepared, cfg)
    table, embedding = None, None
    if str(cfg.qnn_embedding) != "graph":
        # The lookup leaves the graph (npu_rewrite.embedding_input says why): the binaries take
        # inputs_embeds, and embed/model.onnx, an 8- or 4-bit GatherBlockQuantized, runs on the CPU.
        try:
            prepared, cut = _embedding_out(prepared, overrides)
        except npu_rewrite.RewriteError as err:
            raise StageError(f"pack: pack.qnn_embedding={cfg.qnn_embedding}: {err} (pack.qnn_embedding=graph "
                             "keeps the lookup in the binary)") from None
        table = cut["table"]
        with ctx.progress(None, f"embedding: {table.shape[0]} x {table.shape[1]} table, {cfg.qnn_embedding} "
                                f"blocks of {gptq.EMBED_BLOCK} for the CPU"):
            embedding = qnn.write_embedding(table, out / qnn.EMBED_DIR, int(str(cfg.qnn_embedding)[3:]),
                                             cut["ids_dims"])
        options = embedding["options"]
        ctx.log(f"embedding off the HTP: {embedding['bytes'] / 1e6:.1f} MB {cfg.qnn_embedding} "
                f"(table SNR {embedding['snr_db']:.1f} dB; " + ", ".join(
                    f"{k} {v['bytes'] / 1e6:.1f} MB {v['snr_db']:.1f} dB" for k, v in options.items()) + ")")
    # External data: ONNX Runtime's QNN quantization config loads the graph without it and runs ONNX shape
    # inference on what it loaded; with the weights inline that one call held ~4 copies of the 1.7 GB
    # graph (8.5 GiB on Gemma 3 270M), without them it is the graph's structure only.
    onnx.save(prepared, str(float_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    io_phone = _phone_io(io, embedding)
    (float_dir / "io.json").write_text(json.dumps(_phone_io(io, embedding, "../"), indent=2) + "\n")
    ctx.log(f"QNN-ready float graph: {rewrites['sanitize']}, {rewrites['rope_tables']} rotary tables, "
            f"{rewrites['rms_norms_fused']} RMSNorms fused")
    # Memory: from here on the graph lives in the sessions only. On Gemma 3
    # 270M each copy is 1.7 GB (the in-memory graph, the export's decoder, the
    # float decoder, then the quantizer's model and augmented session): the
    # graph and the export's decoder are dropped before calibration.
    del prepared
    gc.collect()

    seqs = _calibration_sequences(cal_dir, C, int(cfg.qnn_calibration_sequences))
    if not seqs:
        raise StageError("pack: the calibration windows hold fewer than 2 tokens: nothing to calibrate on")
    # The rewrites must not change what the graph computes: both decode the
    # first calibration sequence, compared step by step. Memory: one decoder at
    # a time (each session holds the whole graph, 8.2 GB of weights on a 1.75B
    # model, so the two together passed the 16 GB stage bound); the export's
    # logits are kept between them (QNN_CHECK_STEPS x vocabulary floats).
    # Led by the BOS, as every prompt is: the attention sink's activations are the stream's largest (the
    # calibration windows hold none).
    bos = io.get("bos_token_id")
    # At most the context: the BOS takes a position of its own (a 64-position export held 65 steps).
    lead = [] if bos is None else [int(bos)]
    check = lead + seqs[0][:min(QNN_CHECK_STEPS, C) - len(lead)]
    ref = OnnxDecoder(export_dir, threads=2)
    want = [ref.step(t) for t in check]
    del ref
    gc.collect()
    # the rewrites checked with the float table's rows; the same steps (the BOS first) measure the
    # residual stream's range, which the HTP carries in fp16 (npu_rewrite.scale_residual says why)
    embed = None if table is None else table.__getitem__
    worst, stream_max = _check_and_probe_stream(float_dir, want, check, embed)
    factor = npu_rewrite.residual_scale_factor(stream_max)
    scaled = {"factor": 1, "muls": [], "norms": 0}
    if factor > 1:
        structure = onnx.load(str(float_dir / "model.onnx"), load_external_data=False)
        try:
            scaled = npu_rewrite.scale_residual(structure, factor)
        except npu_rewrite.RewriteError as err:
            raise StageError(f"pack: the residual stream reaches {stream_max:,.0f}, past fp16's 65,504 on the "
                             f"HTP, and cannot be scaled: {err}") from None
        onnx.save(structure, str(float_dir / "model.onnx"))  # the structure only: the weights are untouched
        del structure
        new = OnnxDecoder(float_dir, threads=2, embed=embed)
        worst = min(snr_db(w, new.step(t)) for w, t in zip(want, check))
        del new
        if str(cfg.qnn_residual) == "fp16":
            float_nodes += scaled["muls"]
    ctx.log(f"residual stream: largest entry {stream_max:,.0f} over {len(check)} steps"
            + (" from the BOS; " if bos is not None else "; ")
            + (f"carried divided by {factor} for the HTP's fp16 (largest 65,504)" if factor > 1
               else "within fp16 as it is"))
    if worst < QNN_CHECK_MIN_SNR_DB:
        raise StageError(f"pack: the QNN-ready graph departs from the export ({worst:.1f} dB at worst over "
                         f"{len(check)} steps, needs {QNN_CHECK_MIN_SNR_DB:g}): a rewrite is wrong")
    ctx.log(f"QNN-ready graph matches the export: worst step {worst:.1f} dB over {len(check)} steps")
    prompt = None
    if "prompt" in io:  # the same rewrites on the prompt graph, checked against the same steps
        with ctx.progress(None, f"the prompt graph ({io['prompt']['tokens']} tokens a call) made QNN-ready"):
            prompt, prompt_quant = _prompt_float(export_dir, float_dir, C, table is not None, scaled["factor"],
                                                 want, check, embed, cfg)
        if prompt["worst_snr_db"] < QNN_CHECK_MIN_SNR_DB:
            raise StageError(f"pack: the QNN-ready prompt graph departs from the export's decode steps "
                             f"({prompt['worst_snr_db']:.1f} dB at worst over {prompt['chunks']} calls, needs "
                             f"{QNN_CHECK_MIN_SNR_DB:g}): a rewrite is wrong")
        ctx.log(f"QNN-ready prompt graph matches the export's decode steps: worst chunk end "
                f"{prompt['worst_snr_db']:.1f} dB over {prompt['chunks']} calls of at most {io['prompt']['tokens']} tokens")
    genie_float, genie_quant = ({"built": False, "why": "no QDQ precision asked (pack.qnn_precisions): Genie writes "
                                                        "a quantized inputs_embeds"}, None)
    if qdq:
        with ctx.progress(None, "the Genie-form token graph made QNN-ready"):
            genie_float, genie_quant = _genie_float(export_dir, out, C, scaled["factor"], want, check, embed,
                                                    embedding, cfg)
        if genie_quant is not None:
            ctx.log(f"QNN-ready Genie-form graph matches the export: worst step {genie_float['worst_snr_db']:.1f} dB "
                    f"over {len(check)} steps, fed as Genie feeds it")
    # The calibration sees what the device will feed: the shipped lookup's rows.
    del want, table, embed
    gc.collect()
    new = OnnxDecoder(float_dir, threads=2)

    graphs = {}
    calibration = None
    copy_side_files(export_dir, out)
    (out / "io.json").write_text(json.dumps(io_phone, indent=2) + "\n")
    chosen = _Selection(ctx, out, export_dir, Path(ctx.inputs["untie_head"]), cal_dir, precisions, bos)
    stride = int(cfg.qnn_calibration_stride)
    # Time: every calibration token is a decode step of the float graph, and
    # every stride-th one also a run of the calibrator's augmented graph. On
    # Gemma 3 270M (262k-vocab head) a step costs ~0.1-0.16 s, so the old
    # 4 sequences x 1024 positions = 4096 steps took 5-10 minutes. The steps
    # are bounded by pack.qnn_calibration_steps (null: QNN_CALIBRATION_STEPS);
    # the sequences stay whole contexts (positions 0..C-1, the sliding
    # window's ring past its wrap included), fewer of them: one on Gemma
    # (1024 steps, 256 samples), all four on a context of 256 or less.
    # Memory: the samples are spilled to disk and read back one at a time (qnn.spill_samples).
    budget = ctx.cfg.pack.get("qnn_calibration_steps", None)
    budget = QNN_CALIBRATION_STEPS if budget is None else int(budget)
    seqs = seqs[:qnn.calibration_plan(C, len(seqs), budget)]
    if qdq:
        steps = sum(len(s) for s in seqs)
        calibration = {"sequences": len(seqs), "tokens": steps, "stride": stride,
                       "samples": sum((len(s) + stride - 1) // stride for s in seqs), "step_budget": budget,
                       "max_position": max(len(s) for s in seqs) - 1,
                       "data": "calibrate/token_ids.npy (held-out windows), joined into context-length sequences"}
    spill = out / ".calibration_samples"
    codes_made = {}  # w8a16's GPTQ codes by checkpoint name, for the Genie form's graphs (made once)
    try:
        paths = []
        if qdq:
            # Memory: the samples are made first and spilled to disk (qnn.spill_samples), then the float
            # decoder is dropped, so its session (the model's weights) is never held beside the
            # quantizer's two copies; one sample is in memory at a time, and every precision reads them.
            try:  # before the decode steps, not after minutes of them with the disk full
                need = qnn.spill_space(calibration["samples"], new.feed, out)
            except qnn.QnnError as err:
                raise StageError(f"pack: {err}: free space there or "
                                 f"{qnn.spill_fix(len(seqs), C, budget, stride)}") from None
            ctx.log(f"QDQ calibration: {calibration['samples']} samples over {len(seqs)} sequence(s) of "
                    f"{calibration['max_position'] + 1} positions, {need / 1e9:.1f} GB spilled to disk")
            with ctx.progress(calibration["tokens"], "QDQ calibration: decode steps of the float graph") as bar:
                paths = qnn.spill_samples(qnn.decode_samples(new, seqs, stride, advance=bar.advance), spill)
        del new
        gc.collect()
        prompt_paths = []
        if qdq and prompt is not None:  # the prompt graph's own samples: the same sequences, a chunk a sample
            pdec = OnnxDecoder(float_dir, threads=2, model_file=None, prompt_file=PROMPT_MODEL)
            with ctx.progress(calibration["tokens"], "QDQ calibration: the same tokens through the prompt graph") as bar:
                prompt_paths = qnn.spill_samples(qnn.prompt_samples(pdec, seqs, advance=bar.advance), spill / "prompt")
            del pdec
            gc.collect()
            calibration["prompt_samples"] = len(prompt_paths)
        for p in precisions:
            if not chosen.wants(p):
                continue
            if p == "fp16":
                graphs[p] = {"graph": "float/model.onnx", "math": "fp16 on the HTP (enable_htp_fp16_precision)"}
                if prompt is not None:
                    graphs[p]["prompt_graph"] = f"float/{PROMPT_MODEL}"
                chosen.measure(p)
                continue
            # the token graph's codes, for its prompt graph and the Genie form's graphs (w8a16's GPTQ codes: made
            # once; w4a16's are the quantize stage's, read again)
            made = {} if prompt_paths or (genie_quant is not None and p == "w8a16") else None

            def qdq_graphs(d: Path, p=p, made=made) -> dict:
                """p's token graph (and prompt graph) into `d`; their facts, graphs[p]."""
                facts = _qdq_graph(ctx, p, float_dir / "model.onnx", d / "model.onnx", paths, overrides,
                                   float_nodes, cal_dir, made=made)
                entry = {"graph": f"{p}/model.onnx", **facts,
                         "residual_stream": {"math": str(cfg.qnn_residual), "adds": len(residual["adds"]),
                                             "norms": len(residual["norms"]),
                                             "writers": len(residual["writers"])},
                         "attention": {"math": str(cfg.qnn_attention),
                                       **{k: len(v) for k, v in attention.items()}}}
                if prompt_paths:  # its prompt graph: calibrated on its own samples, the token graph's weights
                    # and the token graph's ranges for the head (calibrated there on every step; the prompt
                    # graph's head sees one row a chunk: qnn.head_ranges)
                    try:
                        heads = qnn.head_ranges(d / "model.onnx", float_dir / "model.onnx", float_dir / PROMPT_MODEL)
                    except qnn.QnnError as err:
                        raise StageError(f"pack: the {p} prompt graph: {err}") from None
                    _qdq_graph(ctx, p, float_dir / PROMPT_MODEL, d / PROMPT_MODEL, prompt_paths,
                               {**prompt_quant["overrides"], **heads}, prompt_quant["float_nodes"], cal_dir,
                               what="the prompt graph", made=made)
                    differ = qnn.same_weights(d / "model.onnx", float_dir / "model.onnx", d / PROMPT_MODEL,
                                              float_dir / PROMPT_MODEL)
                    if differ:
                        raise StageError(f"pack: the {p} prompt graph's weights are not the token graph's "
                                         f"({len(differ)} differ, first {differ[0]}): both must read the same codes")
                    shared = share_external_data(d / "model.onnx", d / PROMPT_MODEL)
                    ctx.log(f"{p} prompt graph: {shared['shared']} tensors ({shared['shared_bytes'] / 1e6:.1f} MB) "
                            f"read from the token graph's data file, {shared['own_bytes'] / 1e6:.1f} MB of its own")
                    entry["prompt_graph"] = f"{p}/{PROMPT_MODEL}"
                    entry["prompt_graph_head_ranges"] = {"from": "the token graph's", "tensors": sorted(heads)}
                return entry

            # kept in the stage's journal once made (at 1.75B the quantizer and the codes are most of an
            # hour a precision): a pack stopped later links them back (w8a16's codes for the Genie form are
            # then made again, not kept: `made` lives in memory)
            graphs[p] = ctx.remembered_files(f"qdq-{p}", out / p, qdq_graphs, f"the {p} QDQ graphs")
            if genie_quant is not None and p == "w8a16":
                codes_made[p] = made
            del made
            chosen.measure(p)
        chosen.mix(graphs, float_dir)
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    selection = chosen.result()
    for p in selection["dropped"]:  # measured and missed: recorded with its figures, not kept
        if p in graphs:
            shutil.rmtree(out / p)
            del graphs[p]
    precisions = selection["kept"]
    deployed = selection["deployed"]
    genie = genie_float
    if genie_quant is not None and deployed in ("w8a16", "w4a16", "mixed"):
        genie = _genie_qdq(ctx, out, deployed, genie_float, genie_quant, seqs, stride, cal_dir,
                           mix=graphs[deployed] if deployed == "mixed" else None, made=codes_made)
    elif genie_quant is not None:
        shutil.rmtree(out / GENIE_DIR)  # its float graph, made for nothing
        genie = {"built": False, "why": f"{deployed} ships, whose Genie form is not built: Genie writes a "
                                        "quantized inputs_embeds"}
    codes_made.clear()
    if not genie["built"]:
        ctx.log(f"Genie form not built: {genie['why']}")
    info = {"format": "edgekiln-qnn-pack/1", "precisions": precisions, "deployed": selection["deployed"],
            "selection": selection,
            "graphs": graphs, "rewrites": rewrites, "rewrite_check": {"steps": len(check), "worst_snr_db": worst},
            "residual_scale": {"stream_max_abs": stream_max, "factor": scaled["factor"], "muls": len(scaled["muls"]),
                               "norms": scaled["norms"], "limit": npu_rewrite.FP16_STREAM_LIMIT,
                               "measured_over": f"the rewrite check's {len(check)} steps"
                                                + (", the BOS first" if bos is not None else "")},
            "calibration": calibration, "context_length": C,
            "prompt_graph": prompt and {
                **prompt, "precisions": [p for p in precisions if "prompt_graph" in graphs[p]],
                "not_yet": [p for p in precisions if "prompt_graph" not in graphs[p]],
                "weights": "each QDQ precision's prompt graph holds its token graph's weights (checked: the same "
                           "codes, scales and zero points), calibrated on its own samples (a chunk each), the head's "
                           "input and output at the token graph's ranges (qnn.head_ranges)",
                "note": "two graphs, two binaries: no weight sharing in one context yet (on disk, each prompt "
                        "graph reads its weights from its token graph's data file)"},
            "embedding": embedding or {"in_graph": True, "note": "pack.qnn_embedding=graph: the table is in the "
                                                                  "binaries, a Gather the HTP runs"},
            "genie": genie}
    (out / "npu.json").write_text(json.dumps(info, indent=2, default=float) + "\n")
    size = sum(f.stat().st_size for f in out.rglob("*.onnx*"))
    return {**info, "bytes": size}


def _write_gguf(ctx, untied: Path, quant_dir: Path, meta: dict, layers: dict) -> dict:
    """Our GPTQ codes as GGUF Q4_0 in llama.cpp's own conversion of the checkpoint (module docstring)."""
    from pipeline.toolchains import converter
    from pipeline.quant import gguf_q4
    from pipeline.toolchains import llamacpp
    from pipeline.quant.gguf_q4 import GGUF_FILE

    try:
        gguf_q4.check_q4_0(layers, meta)
    except gguf_q4.GgufQ4Error as err:
        raise StageError(f"pack: {err} (the llama.cpp device classes pick quantize=q4_0, which is that)") from None
    tree = converter.find()
    if tree is None:
        raise StageError(f"pack: {converter.missing_message()}")
    out = Path(ctx.out)
    with ctx.progress(None, f"GGUF: llama.cpp's converter ({tree}), then our codes as Q4_0 / Q8_0 blocks"):
        try:
            report = gguf_q4.build_q4_0(untied, quant_dir, out / GGUF_FILE, src=str(tree),
                                        others=str(ctx.cfg.pack.gguf_token_embedding))
            checked = gguf_q4.verify_file(out / GGUF_FILE, quant_dir, report, untied)
        except (gguf_q4.GgufQ4Error, llamacpp.LlamaCppUnavailable) as err:
            raise StageError(f"pack: {err}") from None
    ctx.log(f"GGUF: {checked} tensors read back bit-for-bit as the quantize stage's weights; "
            f"tensor types {report['tensor_types']}; token embedding {report['token_embedding']}")
    info = {
        "format": "edgekiln-gguf/1", "file": GGUF_FILE, "file_type": report["file_type"],
        "layers": report["layers"], "permuted": report["permuted"], "row_order": report["row_order"],
        "tensor_types": report["tensor_types"], "token_embedding": report["token_embedding"],
        "rounded": report["rounded"],
        **({"embedding_codes": report["embedding_codes"]} if "embedding_codes" in report else {}),
        "checked_bit_exact": checked, "converter": {"identity": converter.identity(str(tree)),
                                                    "source": _converter_source(tree)},
    }
    (out / "gguf.json").write_text(json.dumps(info, indent=2) + "\n")
    # config and tokenizer travel along: parity and `generate` tokenize with the checkpoint's own files
    copy_side_files(untied, out)
    return {**{k: v for k, v in info.items() if k not in ("layers", "row_order")},
            "bytes": (out / GGUF_FILE).stat().st_size}


def _converter_source(tree: Path) -> str:
    stamp = tree / "SOURCE"
    return stamp.read_text().strip() if stamp.is_file() else str(tree)


def run(ctx: StageContext) -> dict:
    from omegaconf import OmegaConf

    from pipeline.quant import weight_path
    from pipeline.runtimes.tinygemm import PREFILL_MODES
    from pipeline.quant.codes import PackError, read_quant

    cfg = ctx.cfg.pack
    prefill = str(cfg.tinygemm_prefill)
    if prefill not in PREFILL_MODES:
        raise StageError(f"pack.tinygemm_prefill must be one of {PREFILL_MODES}, got {prefill!r}")
    level = int(cfg.ort_accuracy_level)
    if level not in (0, 1, 2, 3, 4):
        raise StageError(f"pack.ort_accuracy_level must be 0..4, got {level}")
    kv_dtype = str(cfg.ort_kv_dtype)
    if kv_dtype not in ("float16", "float32"):
        raise StageError(f"pack.ort_kv_dtype must be float16 or float32, got {kv_dtype!r}")
    threshold = int(cfg.prefill_threshold)
    if threshold < 1:
        raise StageError(f"pack.prefill_threshold must be >= 1, got {threshold}")

    device = OmegaConf.to_container(ctx.cfg.device, resolve=True)
    try:  # the model too: a path whose runtime cannot run its family falls back (weight_path.FAMILY_GAPS)
        sel = weight_path.select(device, str(ctx.cfg.priority.name),
                                 weight_path.model_config(ctx.inputs["untie_head"]))
    except ValueError as err:
        raise StageError(f"pack: {err}") from None
    out = Path(ctx.out)
    (out / "weight_path.json").write_text(json.dumps(sel, indent=2) + "\n")
    if "fallback" in sel:
        ctx.log(f"warning: {sel['fallback']['from']} cannot run a {sel['fallback']['family']} model "
                f"({sel['fallback']['reason']}): {sel['path']} instead")
    ctx.log(f"weight path {sel['path']} ({'verified' if sel['verified'] else 'unverified'}): {sel['kernel']}")
    if sel["path"] == "qnn_graph":
        detail = _write_qnn(ctx, Path(ctx.inputs["export"]), Path(ctx.inputs["calibrate"]))
        return {"weight_path": sel, "pack": detail,
                "metrics": {"path": sel["path"], "precisions": len(detail["graphs"]), "bytes": detail["bytes"]}}
    if sel["path"] == "model_dtype":
        reason = f"{sel['path']}: no 4-bit CPU weight layout for device {device.get('name')!r}"
        return {"applies": False, "reason": reason, "weight_path": sel,
                "metrics": {"path": sel["path"], "layers": 0, "bytes": 0}}

    quant_dir = Path(ctx.inputs["quantize"])
    try:
        # ORT's MatMulNBits and GGUF (Q8_0) take 8-bit blocks too (an 8-bit head); the others 4-bit only
        meta, layers = read_quant(quant_dir, bits=(4, 8) if sel["path"] in ("w4_ort_matmulnbits", "gguf_q4_0")
                                  else (4,), mixed_rows=sel["path"] == "w4_ort_matmulnbits")  # head_rows8
    except PackError as err:
        raise StageError(f"pack: {err}") from None
    src = Path(ctx.inputs["untie_head"])
    n_layers = len(layers)
    if sel["path"] == "w4_ort_matmulnbits":
        # build_gqa_graph reads the codes itself, a layer's at a time into the graph; holding this
        # copy through it too cost 0.28 GiB of the stage's peak on Gemma 3 270M
        layers = None
    if sel["path"] == "w4a8_gptq_vllm":
        detail = _write_gptq(ctx, meta, layers, src)
    elif sel["path"] == "w4a16_tinygemm":
        detail = _write_tinygemm(ctx, meta, layers, src, prefill, threshold)
    elif sel["path"] == "w4_ort_matmulnbits":
        detail = _write_ort(ctx, src, Path(ctx.inputs["export"]), quant_dir, level, "genai",
                            int(device["threads"]), kv_dtype)
    elif sel["path"] == "gguf_q4_0":
        detail = _write_gguf(ctx, src, quant_dir, meta, layers)
    else:  # pragma: no cover - select() returns only the paths above
        raise StageError(f"pack: unknown weight path {sel['path']!r}")
    ctx.log(f"{sel['path']}: {n_layers} layers, {detail['bytes'] / 1e6:.1f} MB")
    return {"weight_path": sel, "pack": detail,
            "metrics": {"path": sel["path"], "layers": n_layers, "bytes": detail["bytes"]}}
