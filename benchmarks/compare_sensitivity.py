"""Two quantize runs' 8-bit choices side by side: the exact sensitivities against the first-order ones.

    python benchmarks/quantize_cost.py prepare --model /tmp/gemma-hf --work /tmp/q-work
    python benchmarks/quantize_cost.py quantize --work /tmp/q-work --out /tmp/q-work/exact --set sensitivity=exact
    python benchmarks/quantize_cost.py quantize --work /tmp/q-work --out /tmp/q-work/first --set sensitivity=first_order
    python benchmarks/compare_sensitivity.py /tmp/q-work/exact /tmp/q-work/first

Prints, from the two quant.json files: how each measured (measured_by), the rank correlation of the
units' gains (Spearman), how many of the units one run chose the other chose too, and the calibration
logits' SNR each choice reached (both measured exactly, after the choice) against every linear at 4
bits. The stage times are quantize_cost.py's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties broken by position: the gains are continuous)."""
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def compare(a: dict, b: dict) -> dict:
    ea, eb = a["eight_bit"], b["eight_bit"]
    units = [u for u in ea["units"] if u in eb["units"]]
    ga = [ea["units"][u]["gain"] for u in units]
    gb = [eb["units"][u]["gain"] for u in units]
    top = max(len(ea["chosen"]), 1)
    best_a = sorted(units, key=lambda u: -ea["units"][u]["gain"])[:top]
    best_b = sorted(units, key=lambda u: -eb["units"][u]["gain"])[:top]
    return {
        "measured_by": [ea["measured_by"], eb["measured_by"]],
        "units": len(units),
        "spearman": round(spearman(ga, gb), 3),
        "top_units_shared": f"{len(set(best_a) & set(best_b))} of {top}",
        "chosen_shared": f"{len(set(ea['chosen']) & set(eb['chosen']))} of {len(ea['chosen'])} / {len(eb['chosen'])}",
        "snr_db_all_4bit": [ea["snr_db_all_4bit"], eb["snr_db_all_4bit"]],
        "snr_db_chosen": [ea["snr_db"], eb["snr_db"]],
        "exact_runs": [ea.get("exact_runs"), eb.get("exact_runs")],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path, help="a quantize output folder (quant.json)")
    p.add_argument("second", type=Path)
    a = p.parse_args(argv)
    metas = [json.loads((d / "quant.json").read_text()) for d in (a.first, a.second)]
    if not all(m.get("eight_bit") for m in metas):
        print("error: both runs need an 8-bit budget (quant.json's eight_bit record)", file=sys.stderr)
        return 2
    print(json.dumps(compare(*metas), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
