"""Benchmark statistics: interleaved passes, spread, and the noise-floor rule.

The field notes retracted five conclusions, all measurement errors. The host's
throughput swings ~30%, so: arms are measured in interleaved passes (A B A B),
every figure is reported as min / median / max, and a difference whose median
ratio is within the noise floor (8% by default) is reported as no difference.
"""

from __future__ import annotations

import statistics


def interleave(arms: list[str], passes: int) -> list[tuple[int, str]]:
    """A B A B ...: each pass runs every arm once, so drift hits all arms alike."""
    if passes < 1 or not arms:
        raise ValueError("need at least one pass and one arm")
    return [(p, arm) for p in range(passes) for arm in arms]


def spread(values: list[float]) -> dict:
    if not values:
        raise ValueError("no values")
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "n": len(values),
    }


def compare(a: list[float], b: list[float], noise_floor: float, higher_is_better: bool = True) -> dict:
    """How arm a's figure compares to arm b's, by the ratio of medians.

    Within the noise floor the verdict is "no difference", whatever the sign.
    """
    ma, mb = statistics.median(a), statistics.median(b)
    if mb == 0:
        raise ValueError("baseline median is zero")
    ratio = ma / mb
    if abs(ratio - 1.0) < noise_floor:
        verdict = "no difference"
    elif (ratio > 1.0) == higher_is_better:
        verdict = "better"
    else:
        verdict = "worse"
    return {"ratio": ratio, "verdict": verdict, "noise_floor": noise_floor}


def fmt(s: dict, digits: int = 1) -> str:
    """'median [min-max]' for a spread dict."""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"
