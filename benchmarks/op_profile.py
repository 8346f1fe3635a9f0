"""Where a decode step's time goes, per op type, at several prompt lengths (issue 42: decode loses more
speed from a 32- to a 512-token prompt than llama.cpp does).

    python benchmarks/op_profile.py --build artifacts/BUILD/pack --prompts 32,512,1000 --steps 32 --threads 2

For each prompt length, a fresh GqaDecoder with ONNX Runtime's profiler on: the prompt prefilled in one
call (not counted), then `--steps` greedy decode steps. ORT's profile (JSON, one event per node run)
is split by model run; the decode runs' node time is summed per op type (and for the attention op, per
layer kind: full or sliding). Prints a table of ms per step per op type at each prompt length and the
growth from the first length; the profile's own overhead makes the totals larger than an unprofiled
step, so compare shares and growth, not speed. `--json FILE` keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgekiln_runtime.gqa import GqaDecoder  # noqa: E402


def profile_decode(pack: Path, prompt_len: int, steps: int, threads: int) -> dict:
    """{op_type: [ms per decode step, ...]} and the wall time per step, for one prompt length."""
    import time

    with tempfile.TemporaryDirectory(prefix="edgekiln-opprof-") as tmp:
        dec = GqaDecoder(pack, threads=threads, profile=os.path.join(tmp, "ort"))
        rng = np.random.default_rng(prompt_len)
        ids = rng.integers(10, dec.vocab_size - 10, size=prompt_len).tolist()
        logits = dec.prefill(ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = dec.step(int(np.argmax(logits)))
        wall = (time.perf_counter() - t0) / steps
        events = json.loads(Path(dec.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    if len(runs) != steps + 1:
        raise SystemExit(f"expected {steps + 1} model runs in the profile, found {len(runs)}")
    decode_runs = runs[1:]  # the first is the prefill
    per_op: dict = defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        ts = e["ts"]
        if not any(r["ts"] <= ts <= r["ts"] + r["dur"] for r in decode_runs):
            continue
        per_op[e["args"].get("op_name", "?")] += e["dur"] / 1000.0
    run_ms = sum(r["dur"] for r in decode_runs) / 1000.0 / steps
    return {"prompt": prompt_len, "wall_ms_per_step": wall * 1000.0, "profiled_run_ms_per_step": run_ms,
            "ms_per_step": {k: v / steps for k, v in sorted(per_op.items(), key=lambda kv: -kv[1])}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", type=Path, required=True, help="a pack folder (io.json, model.onnx)")
    ap.add_argument("--prompts", default="32,512", help="prompt lengths, comma-separated")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.prompts.split(",")]
    res = [profile_decode(args.build, p, args.steps, args.threads) for p in lengths]
    ops = sorted({op for r in res for op in r["ms_per_step"]}, key=lambda op: -res[-1]["ms_per_step"].get(op, 0.0))
    print(f"{args.build}: decode ms per step by op type (ORT profiler on; {args.steps} steps, {args.threads} threads)")
    print("| op | " + " | ".join(f"@{r['prompt']}" for r in res) + f" | growth @{res[0]['prompt']}->@{res[-1]['prompt']} |")
    print("|---|" + "---|" * (len(res) + 1))
    for op in ops:
        vals = [r["ms_per_step"].get(op, 0.0) for r in res]
        print(f"| {op} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {vals[-1] - vals[0]:+.3f} ms |")
    runs = [r["profiled_run_ms_per_step"] for r in res]
    print("| (profiled run) | " + " | ".join(f"{v:.3f}" for v in runs) + f" | {runs[-1] - runs[0]:+.3f} ms |")
    walls = [r["wall_ms_per_step"] for r in res]
    print("| (wall, profiled) | " + " | ".join(f"{v:.3f}" for v in walls) + f" | {walls[-1] - walls[0]:+.3f} ms |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
