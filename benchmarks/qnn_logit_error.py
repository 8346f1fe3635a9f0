"""Where a phone build's logit error goes: the part softmax cannot see (one offset per step) and the rest.

    python benchmarks/qnn_logit_error.py --build /tmp/smol-phone/artifacts/galaxy_s25-...-speed [--steps 40]

The phone path's gate has been logit SNR (10 log10 of sum ref^2 over sum (ref - test)^2, over every
vocabulary entry of every step). Softmax ignores a constant added to a step's logits, so an offset the
same for every entry costs SNR and nothing the model outputs. Per step this splits the error energy
sum (ref - test)^2 = V * mean(d)^2 + sum (d - mean(d))^2 (d = test - ref) into that offset and the
rest, and reports, over the parity prompts teacher-forced along the fp32 export's greedy tokens:
raw SNR (the gate's), centred SNR (each step's mean removed from both: what softmax sees), the
offset's share of the error, SNR over the reference's top-64 entries, KL(ref || test) and top-1.
The reference is the build's fp32 export (tested at 115+ dB against eager PyTorch); the test is
each QDQ graph in the pack on ONNX Runtime's CPU EP (the HTP's quantization arithmetic), and with
`--htp PRECISION` that precision's compiled context binary on the HTP backend (onnxruntime-qnn's x86
emulation: seconds a step; fp16 has no CPU stand-in, so this is its only measure).

`--htp-unscaled` also compiles the pack's float graph for the HTP's fp16 with the residual stream
carried as it is (npu_rewrite.scale_residual's factor set to 1; the norms keep their epsilon / f^2,
which moves nothing beside rows of magnitude ~1), the overflow at the BOS that docs/phone-fidelity.md
finding 5 found: does a gate in the field's units (KLD mean and p99) still catch it?
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _db(sig: float, err: float) -> float:
    return float(10 * np.log10(sig / err)) if err > 0 else float("inf")


def _unscaled_fp16(float_dir: Path, tmp: Path, target: dict):
    """The pack's float graph with its residual stream carried as it is, compiled for the HTP's fp16, as a
    session: the structure rewritten in `tmp`, the weights read from the pack's data file (a hard link)."""
    import onnx
    from onnx import numpy_helper

    from pipeline.graphs import qnn

    m = onnx.load(str(float_dir / "model.onnx"), load_external_data=False)
    scale = next((t for t in m.graph.initializer if t.name == "residual_stream_scale"), None)
    if scale is None:
        raise SystemExit(f"{float_dir}: the stream is not scaled in this build (npu.json residual_scale): "
                         "nothing to undo")
    print(f"the stream carried divided by {1 / float(numpy_helper.to_array(scale)):g} in the build; compiling "
          "the fp16 graph with it undivided", flush=True)
    scale.CopyFrom(numpy_helper.from_array(np.array(1.0, dtype=np.float32), scale.name))
    onnx.save(m, str(tmp / "model.onnx"))
    for data in float_dir.glob("*.data"):  # a hard link (ONNX Runtime refuses data a symlink takes outside)
        try:
            os.link(data, tmp / data.name)
        except OSError:  # another file system
            shutil.copyfile(data, tmp / data.name)
    qnn.compile_context(tmp / "model.onnx", tmp / "ctx", target, "fp16")
    return qnn.htp_session(tmp / "ctx" / qnn.CONTEXT_MODEL, target, "fp16")


def main() -> int:
    import yaml
    from transformers import AutoTokenizer

    from pipeline.graphs import qnn
    from pipeline.runtimes.onnx import OnnxDecoder
    from stages.verify_parity import _log_softmax, _prompt_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, type=Path, help="artifacts/<build> of a galaxy_s25 build")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per prompt (teacher-forced)")
    ap.add_argument("--htp", action="append", default=[], metavar="PRECISION",
                    help="also this precision's context binary on the HTP backend (compile_qnn; repeatable)")
    ap.add_argument("--htp-unscaled", action="store_true",
                    help="also the fp16 graph with the residual stream unscaled, compiled here (finding 5's overflow)")
    ap.add_argument("--no-cpu", action="store_true", help="skip the QDQ graphs on the CPU EP")
    ap.add_argument("--json")
    a = ap.parse_args()
    art = a.build
    registered = art.parent.parent / "builds" / f"{art.name}.yaml"  # a failed build's is not kept
    parity = yaml.safe_load(registered.read_text())["parity"] if registered.is_file() else \
        yaml.safe_load((ROOT / "conf" / "parity" / "default.yaml").read_text())
    prompts = parity["prompts"][: a.prompts]
    hf = next((art.parent / "_models").glob("*/config.json"), None)
    tok_dir = art / "untie_head" if (art / "untie_head" / "tokenizer.json").is_file() else hf.parent
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    model_cfg = json.loads((tok_dir / "config.json").read_text())
    bos = tokenizer.bos_token_id
    ref = OnnxDecoder(art / "export", threads=2)
    tests = {p.name: qnn.cpu_qdq_decoder(art / "pack", f"{p.name}/model.onnx")
             for p in sorted((art / "pack").iterdir())
             if not a.no_cpu and (p / "model.onnx").is_file() and p.name not in ("fp16", "embed", "float")}
    if a.htp or a.htp_unscaled:
        info, _ = qnn.compiled_for_htp(art / "compile_qnn")
        for p in a.htp:
            tests[f"{p} (HTP)"] = OnnxDecoder(art / "compile_qnn", session=qnn.open_htp(art / "compile_qnn", info, p))
    if a.htp_unscaled:
        tests["fp16, stream unscaled (HTP)"] = OnnxDecoder(
            art / "compile_qnn", session=_unscaled_fp16(art / "pack" / "float", Path(tempfile.mkdtemp()), info["target"]))
    rows = {name: [] for name in tests}
    for text in prompts:
        ids = _prompt_ids(tokenizer, text, bos, str(model_cfg.get("model_type", "")))
        ref.reset()
        for t in tests.values():
            t.reset()
        feed = list(ids)
        for k in range(len(ids) + a.steps):
            tokn = feed[k]
            r = ref.step(tokn).astype(np.float64)
            if k + 1 >= len(ids):
                feed.append(int(np.argmax(r)))
            for name, t in tests.items():
                o = t.step(tokn).astype(np.float64)
                if k + 1 < len(ids):
                    continue
                d = o - r
                off = d.mean()
                rc, dc = r - r.mean(), d - off
                top = np.argpartition(-r, 64)[:64]
                lr, pr = _log_softmax(r)  # the parity stage's own (it shifts by the max, as here)
                lo, _ = _log_softmax(o)
                rows[name].append({"sig": float(r @ r), "err": float(d @ d), "sig_c": float(rc @ rc),
                                   "err_c": float(dc @ dc), "offset_err": float(len(d) * off * off),
                                   "sig_top": float(r[top] @ r[top]), "err_top": float(d[top] @ d[top]),
                                   "offset": float(off), "kl": float((pr * (lr - lo)).sum()),
                                   "top1": bool(np.argmax(o) == np.argmax(r))})
    out = {}
    for name, rs in rows.items():
        s = {k: sum(x[k] for x in rs) for k in ("sig", "err", "sig_c", "err_c", "offset_err", "sig_top", "err_top")}
        out[name] = {
            "steps": len(rs),
            "raw_snr_db": _db(s["sig"], s["err"]),
            "centred_snr_db": _db(s["sig_c"], s["err_c"]),
            "top64_snr_db": _db(s["sig_top"], s["err_top"]),
            "offset_share_of_error": s["offset_err"] / s["err"] if s["err"] else 0.0,
            "offset_mean": float(np.mean([x["offset"] for x in rs])),
            "offset_spread": [float(np.min([x["offset"] for x in rs])), float(np.max([x["offset"] for x in rs]))],
            "kl_nats_mean": float(np.mean([x["kl"] for x in rs])),
            "kld_p99": float(np.percentile([x["kl"] for x in rs], 99)),
            "kld_max": float(np.max([x["kl"] for x in rs])),
            "top1": float(np.mean([x["top1"] for x in rs])),
        }
        o = out[name]
        print(f"{name}: {o['steps']} steps; raw SNR {o['raw_snr_db']:.2f} dB, centred {o['centred_snr_db']:.2f} dB, "
              f"top-64 {o['top64_snr_db']:.2f} dB; the per-step offset is {o['offset_share_of_error']:.1%} of the "
              f"error energy (offset mean {o['offset_mean']:+.3f}, range {o['offset_spread'][0]:+.3f}.."
              f"{o['offset_spread'][1]:+.3f}); KL {o['kl_nats_mean']:.4f} nats (p99 {o['kld_p99']:.4f}, max "
              f"{o['kld_max']:.4f}), top-1 {o['top1']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
