"""What each QNN rewrite buys a calibrated w8a16 build: an ablation on a phone build.

    python benchmarks/qnn_rewrites.py --build galaxy_s25-embedded-speed [--prompts 4] [--htp]

From the build's own export, calibration windows and parity prompts, it builds
the w8a16 QDQ graph (the pack stage's recipe: pipeline/graphs/qnn.py qdq_quantize, the
same calibration samples for every variant) after cumulative sets of rewrites
(pipeline/graphs/npu_rewrite.py):

- sanitize: only what QNN needs to compile at all;
- + embedding ranges: the lookup's quantization range from the whole table;
- + rotary tables: cos/sin gathered from tables, no in-graph angle;
- + RMSNorm fused: the pack stage's graph before per-channel weights;
- + per-channel MatMul weights, rounded (`pack.qnn_weights`; before it, ONNX
  Runtime's QNN config quantized every MatMul weight with one scale). The pack
  stage has since gone further (float residual stream and attention cores,
  GPTQ codes in blocks of 32: docs/phone-fidelity.md); this ablation stops here.

`--only 3,4` runs just those variants (a real model's QDQ pass and CPU-EP
parity cost minutes each).

Each is compared with the eager fp32 model by the verify_parity stage's own
code (teacher-forced logits SNR, top-1, greedy outcome read off the fed run),
on ONNX Runtime's CPU EP, which runs QDQ with the HTP's quantization
arithmetic (the unfixed build measured 6.6 dB on both); `--htp` also compiles
each variant and runs it on the HTP backend (tenths of a second per step), and
runs the float graph in the HTP's fp16 before and after the rewrites.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class _Ctx:
    """The slice of StageContext verify_parity's helpers use (progress and log)."""

    def progress(self, total, what):
        from contextlib import nullcontext

        class Bar:
            def advance(self, *a, **k):
                pass

        print(f"  {what} ({total})", file=sys.stderr)
        return nullcontext(Bar())

    def log(self, line):
        print(f"  {line}", file=sys.stderr)


def main(argv=None) -> int:
    import numpy as np
    import onnx
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pipeline.graphs import npu_rewrite, qnn
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.runtimes.reference import TorchReference
    from pipeline.sources.tensorfile import load_onnx
    from stages import pack as pack_stage
    from stages import verify_parity as vp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--htp", action="store_true", help="also run each variant on the HTP backend")
    ap.add_argument("--random-prompts", type=int, default=0,
                    help="also compare on N prompts of random token ids (seeded): tokens the calibration text "
                         "may never have held, where a clipped range shows")
    ap.add_argument("--only", help="comma-separated variant numbers (0-4) to run; default all")
    ap.add_argument("--keep", type=Path, help="build the variants in this folder and keep them (for "
                                             "python -m pipeline.measure.graph_diff); default a temporary one")
    ap.add_argument("--no-parity", action="store_true", help="build the variants only (with --keep)")
    ap.add_argument("--range-margin", type=float, default=1.0,
                    help="scale every calibrated activation range by this (qnn.widen; the pack uses 1)")
    ap.add_argument("--decode", type=int, help="continuation tokens a prompt (default the build's "
                                               "parity.decode_tokens; Gemma 3 270M's ~540 cost minutes a variant)")
    a = ap.parse_args(argv)

    base = ROOT / "artifacts" / a.build
    cfg = OmegaConf.load(ROOT / "builds" / f"{a.build}.yaml")
    export_dir, hf_dir = base / "export", base / "untie_head"
    io = json.loads((export_dir / "io.json").read_text())
    C = int(io["context_length"])
    pc = cfg.parity
    prompts = [str(p) for p in pc.prompts][: a.prompts]
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    bos = tok.bos_token_id if tok.bos_token_id is not None else io.get("bos_token_id")
    encoded = [vp._prompt_ids(tok, t, bos, str(io.get("model_type", ""))) for t in prompts]
    ctx = _Ctx()
    decode = int(a.decode or pc.decode_tokens)
    ref = TorchReference(hf_dir, threads=1)
    sets = {} if a.no_parity else {"parity prompts": (prompts, encoded, vp._teacher(ref, encoded, decode, ctx))}
    if a.random_prompts and not a.no_parity:
        rng = np.random.default_rng(0)
        r_enc = [[int(bos)] + rng.integers(3, int(io["vocab_size"]), 8).tolist() for _ in range(a.random_prompts)]
        r_txt = [f"random ids #{k}" for k in range(a.random_prompts)]
        sets["random-token prompts"] = (r_txt, r_enc, vp._teacher(ref, r_enc, decode, ctx))

    # Calibration samples: the graph inputs of decode steps over the build's
    # calibration windows, exactly as the pack stage draws them.
    seqs = qnn.calibration_sequences(np.load(base / "calibrate" / "token_ids.npy"), C,
                                     int(cfg.pack.qnn_calibration_sequences))
    budget = cfg.pack.get("qnn_calibration_steps", None)  # the pack stage's bound on the calibration's decode steps
    seqs = seqs[:qnn.calibration_plan(C, len(seqs), pack_stage.QNN_CALIBRATION_STEPS if budget is None else int(budget))]
    samples = qnn.decode_samples(OnnxDecoder(export_dir, threads=2), seqs, int(cfg.pack.qnn_calibration_stride))
    work = a.keep or Path(tempfile.mkdtemp(prefix="edgekiln-qnn-ablation-"))
    work.mkdir(parents=True, exist_ok=True)
    # Spilled once, read by every variant: the samples are a one-pass stream (qnn.qdq_quantize).
    sample_paths = qnn.spill_samples(samples, work / "samples")

    export = load_onnx(export_dir / "model.onnx")
    clean, _ = npu_rewrite.sanitize(export)
    tabled, _ = npu_rewrite.rope_tables(clean, "position", C)
    fused, _ = npu_rewrite.fuse_rms_norm(tabled)
    variants = [
        ("sanitize only", clean, False, "per_tensor"),
        ("+ embedding ranges", clean, True, "per_tensor"),
        ("+ rotary tables", tabled, True, "per_tensor"),
        ("+ RMSNorm fused", fused, True, "per_tensor"),
        ("+ per-channel MatMul weights (rounded; the pack now goes further: docs/phone-fidelity.md)", fused, True,
         "per_channel"),
    ]
    chosen = {int(k) for k in a.only.split(",")} if a.only else set(range(len(variants)))
    rows = []
    try:
        for k, (name, graph, ranges, weights) in enumerate(variants):
            if k not in chosen:
                continue
            d = work / str(k)
            d.mkdir()
            onnx.save(graph, str(d / "float.onnx"), save_as_external_data=True, location="float.onnx.data")
            shutil.copy2(export_dir / "io.json", d / "io.json")
            overrides = npu_rewrite.embedding_ranges(graph) if ranges else {}
            qnn.qdq_quantize(d / "float.onnx", d / "model.onnx", qnn.read_samples(sample_paths), "w8a16",
                             overrides, weights, a.range_margin)
            arms = {} if a.no_parity else {"cpu_qdq": qnn.cpu_qdq_decoder(d, "model.onnx")}
            if a.htp and not a.no_parity:
                target = OmegaConf.to_container(cfg.device.qnn)
                qnn.compile_context(d / "model.onnx", d / "ctx", target, "w8a16")
                arms["htp"] = OnnxDecoder(d, session=qnn.htp_session(d / "ctx" / qnn.CONTEXT_MODEL, target, "w8a16"))
            for arm, decoder in arms.items():
                for what, (texts, enc, teacher) in sets.items():
                    if arm == "htp" and what != "parity prompts":
                        continue  # the emulation is slow; CPU QDQ shows the same arithmetic
                    m, _ = vp._compare(teacher, decoder, texts, enc, decode, ctx,
                                       f"{name} {arm}", free_decode=False)
                    rows.append((name, arm, what, m, len(texts)))
                    print(f"{name:<44} {arm:<8} {what:<22} SNR {m['logits_snr_db']:6.1f} dB  "
                          f"top1 {m['top1_agreement']:.3f}  greedy {m['greedy_match']}/{len(texts)}", flush=True)
        if a.htp and not a.no_parity:  # fp16 numerics exist only on the HTP: the float graph before and after the rewrites
            target = OmegaConf.to_container(cfg.device.qnn)
            texts, enc, teacher = sets["parity prompts"]
            for k, (name, graph) in enumerate((("sanitize only", clean), ("all rewrites (the pack stage's graph)",
                                                                           fused))):
                d = work / f"fp16_{k}"
                d.mkdir()
                onnx.save(graph, str(d / "model.onnx"))
                shutil.copy2(export_dir / "io.json", d / "io.json")
                qnn.compile_context(d / "model.onnx", d / "ctx", target, "fp16")
                dec16 = OnnxDecoder(d, session=qnn.htp_session(d / "ctx" / qnn.CONTEXT_MODEL, target, "fp16"))
                m, _ = vp._compare(teacher, dec16, texts, enc, decode, ctx, f"fp16 {name}",
                                   free_decode=False)
                rows.append((f"fp16: {name}", "htp", "parity prompts", m, len(texts)))
                print(f"fp16 {name:<40} htp SNR {m['logits_snr_db']:6.1f} dB (worst step "
                      f"{m['worst_step_snr_db']:.1f})", flush=True)
    finally:
        if a.keep:
            shutil.rmtree(work / "samples", ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| rewrites | runs on | prompts | logits SNR dB | top-1 | greedy |\n|---|---|---|---|---|---|")
    for name, arm, what, m, n in rows:
        print(f"| {name} | {arm} | {what} | {m['logits_snr_db']:.1f} | {m['top1_agreement']:.3f} | "
              f"{m['greedy_match']}/{n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
