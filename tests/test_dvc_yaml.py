"""dvc.yaml and params.yaml are generated, never hand-edited: both must match."""

from __future__ import annotations

from pipeline.engine import dvcgen
from pipeline.engine.layout import EXP_PARAMS, ROOT


def test_committed_dvc_yaml_matches_the_declarations():
    expected = dvcgen.render(dvcgen.generate(with_exp=(ROOT / EXP_PARAMS).exists()))
    actual = (ROOT / "dvc.yaml").read_text()
    assert actual == expected, "dvc.yaml drifted from the stage declarations: run `python -m pipeline.engine.dvcgen`"


def test_params_yaml_is_a_valid_build_config():
    """params.yaml is the `exp` build's config (rewritten by `dvc exp run -S`):
    whatever it holds must pass the same schema as every registered build."""
    from pipeline.engine.config import load_build_file

    cfg = load_build_file(ROOT / EXP_PARAMS)
    assert set(cfg) >= {"device", "model", "export", "parity", "benchmark"}


def test_dvc_config_enables_hydra_composition():
    text = (ROOT / ".dvc" / "config").read_text()
    for line in ("enabled = true", "config_dir = conf", "config_name = config", "plugins_path = pipeline"):
        assert line in text
