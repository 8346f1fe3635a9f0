"""The layout is the architecture: stages import nothing from each other, and
each stage's code dependencies are complete."""

from __future__ import annotations

import pytest

from pipeline.engine.codedeps import imported_modules, stage_code
from pipeline.engine.layout import ROOT, STAGES, declaration


@pytest.mark.parametrize("stage", STAGES)
def test_stage_imports_no_other_stage(stage):
    mods = imported_modules(ROOT / "stages" / f"{stage}.py")
    others = sorted(m for m in mods if m.startswith("stages"))
    assert not others, f"stages/{stage}.py imports {others}: shared code belongs in pipeline/"


@pytest.mark.parametrize("stage", STAGES)
def test_stage_declares_its_contract(stage):
    d = declaration(stage)
    assert callable(getattr(d.module, "run"))
    assert d.scope in ("host", "model", "build")
    for name in d.inputs:
        assert name in STAGES and STAGES.index(name) < STAGES.index(stage), f"{stage} reads a later stage {name}"


def test_code_deps_follow_imports_inside_functions():
    code = stage_code("benchmark")
    # bench_arm runs in a subprocess, imported inside a function: still a dependency
    assert "pipeline/measure/bench_arm.py" in code
    assert "pipeline/graphs/decode_graph.py" in code
    assert "pipeline/engine/run_stage.py" in code and "stages/benchmark.py" in code
    assert not any(p.startswith("stages/") and p != "stages/benchmark.py" and p != "stages/__init__.py" for p in code)
