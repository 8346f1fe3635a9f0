"""The quantize stage's wall time and peak memory on a real checkpoint, outside DVC.

    python benchmarks/quantize_cost.py prepare --model /tmp/gemma-hf --work /tmp/q-work
    python benchmarks/quantize_cost.py quantize --work /tmp/q-work --out /tmp/q-work/quantize \
        [--device x86_avx512] [--set eight_bit_budget=0.1 ...]

`prepare` runs untie_head and calibrate (seq_len / samples as given: Gemma 3's window makes them
~528 / 16) into WORK; `quantize` runs the quantize stage on them in this process alone, so the peak
RSS printed (getrusage ru_maxrss) is the stage's own, with the model load and the 8-bit pass.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from pipeline.engine.context import StageContext  # noqa: E402


def _ctx(stage: str, out: Path, cfg: dict, inputs: dict) -> StageContext:
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage=stage, build="bench", cfg=OmegaConf.create(cfg), inputs=inputs, out=out)


def _value(text: str):
    import yaml

    return yaml.safe_load(text)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("prepare", "quantize"))
    p.add_argument("--model", type=Path)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path)
    p.add_argument("--seq-len", type=int, default=528)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--device", default="x86_avx512")
    p.add_argument("--priority", default="speed")
    p.add_argument("--set", action="append", default=[], help="quantize.KEY=VALUE")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--per-window", help="write the 8-bit pass's per-window errors to this JSON file")
    a = p.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    if a.what == "prepare":
        from stages import calibrate, untie_head

        untie_head.run(_ctx("untie_head", a.work / "untie_head", {"model": {}}, {"model": a.model}))
        cal = {"dataset": "stdlib_docstrings_heldout", "samples": a.samples, "seq_len": a.seq_len,
               "min_samples": a.samples, "seed": 0}
        calibrate.run(_ctx("calibrate", a.work / "calibrate", {"calibrate": cal},
                           {"untie_head": a.work / "untie_head"}))
    else:
        from pipeline.engine import devices
        from stages import quantize

        q = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf/quantize/default.yaml"))
        for kv in a.set:
            k, v = kv.split("=", 1)
            q[k] = _value(v)
        cfg = {"quantize": q, "device": devices.spec_sheet(a.device), "priority": {"name": a.priority}}
        out = a.out or a.work / "quantize"
        if a.per_window:  # keep measure()'s per-window errors, to see the choice a subset of windows makes
            from pipeline.quant import bit_alloc

            inner = bit_alloc.measure

            def keep(*args, **kw):
                found = inner(*args, **kw)
                Path(a.per_window).write_text(json.dumps(found["per_window"], indent=1))
                return found

            bit_alloc.measure = keep
        result = quantize.run(_ctx("quantize", out, cfg, {"untie_head": a.work / "untie_head",
                                                          "calibrate": a.work / "calibrate"}))
        meta = json.loads((out / "quant.json").read_text())
        eb = meta.get("eight_bit")
        if eb:
            print(json.dumps({k: eb[k] for k in ("chosen", "snr_db_all_4bit", "snr_db", "extra_bytes",
                                                 "budget_bytes") if k in eb}, indent=1))
        print(json.dumps(result["metrics"]))
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds beside the wall time: on a shared host the wall time depends on the neighbours
    print(f"{a.what}: {wall:.1f} s wall, {ru.ru_utime + ru.ru_stime:.1f} s CPU, peak RSS {ru.ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
