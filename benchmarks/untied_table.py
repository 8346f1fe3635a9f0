"""An untied checkpoint's ORT artifact with the table the quantize stage chose (its int8 / int4 block codes)
against the same graph holding the fp32 table, on the same weights: each graph's bytes, and both graphs'
logits against the fp32 model over one sequence of calibration tokens (teacher-forced steps).

    python benchmarks/untied_table.py artifacts/x86_avx512-<model>-speed [--steps 256] [--threads 2]

The build must be a w4_ort_matmulnbits one of an untied checkpoint (its quant.json records an "embedding"
choice); the fp32-table graph is written beside it, under <build>/untied_table/, once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build", type=Path, help="the build's artifacts folder")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)

    import numpy as np

    from pipeline.runtimes.reference import TorchReference

    from pipeline.graphs.decode_graph import load_hf_model, snr_db
    from edgekiln_runtime.gqa import GqaDecoder
    from pipeline.graphs.gqa_graph import build_gqa_graph

    b = a.build
    chosen = (json.loads((b / "quantize" / "quant.json").read_text()).get("embedding") or {}).get("chosen")
    if chosen not in ("int8", "int4"):
        print(f"error: {b}/quantize/quant.json chose {chosen!r} for the table: nothing to compare", file=sys.stderr)
        return 2
    built = json.loads((b / "pack" / "manifest.json").read_text())["result"]["pack"]["facts"]
    out = b / "untied_table"
    if not (out / "io.json").is_file():
        facts = build_gqa_graph(b / "untie_head", b / "quantize", out, max_len=built["max_len"],
                                accuracy_level=built["accuracy_level"], embedding="fp32")
    else:
        facts = {"bytes": sum(f.stat().st_size for f in out.glob("model.onnx*")), "weight_bytes": {}}
    print(f"graph bytes: {chosen} table {built['bytes']:,} (table {built['weight_bytes']['embedding']:,}); "
          f"fp32 table {facts['bytes']:,}")
    windows = np.load(b / "calibrate" / "token_ids.npy")
    ids = windows[::-1].reshape(-1)[: a.steps].tolist()

    def steps(runtime):
        runtime.reset()
        return np.stack([np.asarray(runtime.step(t), np.float64) for t in ids])

    t0 = time.perf_counter()
    ref = steps(TorchReference(load_hf_model(b / "untie_head"), threads=a.threads))
    ours = steps(GqaDecoder(b / "pack", threads=a.threads))
    table = steps(GqaDecoder(out, threads=a.threads))

    def top1(x, y):
        return float((x.argmax(-1) == y.argmax(-1)).mean())

    print(f"{len(ids)} steps ({time.perf_counter() - t0:.0f} s), against the fp32 model: {chosen} table "
          f"{snr_db(ref, ours):.2f} dB (top-1 {top1(ref, ours):.3f}), fp32 table {snr_db(ref, table):.2f} dB "
          f"(top-1 {top1(ref, table):.3f}); the two graphs against each other {snr_db(table, ours):.2f} dB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
