"""Several builds' benchmark figures side by side, with their spreads.

    python benchmarks/compare_builds.py                       # every build with a benchmark
    python benchmarks/compare_builds.py auto-embedded-speed x86_avx2-embedded-speed

Reads artifacts/<build>/benchmark/{manifest.json,report.json} (never re-runs
anything). Figures are median [min-max] over the build's passes; the last
column compares each build's artifact decode speed with the first build's, by
the same noise-floor rule as the benchmark stage (pipeline/measure/stats.py): builds
measured in different runs were not interleaved, so treat that column as a
hint, and re-run them in one benchmark when the answer matters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def load(build: str, root: Path = ROOT) -> dict | None:
    d = root / "artifacts" / build / "benchmark"
    if not (d / "report.json").is_file():
        return None
    report = json.loads((d / "report.json").read_text())
    manifest = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").is_file() else {}
    return {"report": report, "manifest": manifest}


def main(argv=None) -> int:
    from rich.console import Console
    from rich.table import Table

    from pipeline.measure.stats import compare, fmt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="*")
    p.add_argument("--noise-floor", type=float, default=0.08)
    p.add_argument("--root", type=Path, default=ROOT, help="the repository whose artifacts/ to read")
    p.add_argument("--all-arms", action="store_true", help="also list every baseline arm of every build")
    a = p.parse_args(argv)
    builds = a.builds or sorted(q.parent.parent.name for q in (a.root / "artifacts").glob("*/benchmark/report.json"))
    data = {b: load(b, a.root) for b in builds}
    missing = [b for b, d in data.items() if d is None]
    if missing:
        print(f"error: no benchmark report for {', '.join(missing)} (build it with python -m pipeline ...)", file=sys.stderr)
        return 1
    if not data:
        print("no builds with a benchmark report under artifacts/", file=sys.stderr)
        return 1
    t = Table(title="builds side by side: median [min-max]")
    for col in ("build", "arm", "decode tok/s", "prefill tok/s", "TTFT ms", "resident MiB", "peak MiB",
                "warm start s", "measured", "decode vs first"):
        t.add_column(col, justify="left" if col in ("build", "arm", "measured") else "right")
    first = None
    for b, d in data.items():
        r = d["report"]
        head = r["artifact_arm"]
        passes = [x["decode_tok_s"] for x in r["passes"][head]]
        if first is None:
            first, vs = passes, "-"
        else:
            c = compare(passes, first, a.noise_floor)
            vs = f"{c['ratio']:.2f}x ({c['verdict']})"
        arms = [head] + ([x for x in r["arms"] if x != head] if a.all_arms else [])
        for arm in arms:
            f = r["arms"][arm]
            where = "target" if r.get("on_target") else f"cross ({r['host'].get('device_class')})"
            t.add_row(b if arm == head else "", arm, fmt(f["decode_tok_s"]), fmt(f["prefill_tok_s"]),
                      fmt(f["ttft_ms"]), fmt(f["resident_mib"], 0), fmt(f["peak_rss_mib"], 0),
                      fmt(f["warm_start_s"], 2) if "warm_start_s" in f else "-", where,
                      vs if arm == head else "")
    Console(width=160).print(t)
    for b, d in data.items():
        s = d["report"]["settings"]
        print(f"{b}: prompt {s['prompt_length']}, decode {s['decode_tokens']}, context {s['context_length']}, "
              f"{s['threads']} threads, {s['passes']} passes; weight path {d['report']['weight_path'].get('path')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
