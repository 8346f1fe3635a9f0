"""Real builds of other families through DVC, as a user runs them: `python -m pipeline model=hf
model.path=DIR device=...` on a tiny random checkpoint of the family (tests/test_families.py's
`tiny_config` geometry, 4 layers, hidden 64-128) with a SentencePiece tokenizer trained here in
seconds. Qwen2 (q/k/v biases, an unused window in config.json), Phi-3 (fused q|k|v and gate|up,
LongRoPE, partial rotary 0.75, a 262,144-token window on every layer that never binds) and Gemma 2
(both softcaps, alternating sliding layers): the families whose graphs differ most from the three
the tool was shaped on. Random weights: the parity gate checks the graph, not fidelity.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from tests.conftest import FAST_RUN, repo_copy, run_cli, stage_lines, variants

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def family_repo(tmp_path_factory):
    return repo_copy(tmp_path_factory.mktemp("famrepo"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A 512-piece SentencePiece tokenizer trained on the stdlib docstrings (the embedded model's recipe)."""
    from pipeline.sources import corpus
    from stages.model import _hf_tokenizer, _train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    docs, _ = corpus.stdlib_docstrings()
    with tempfile.TemporaryDirectory() as work:
        _hf_tokenizer(_train_tokenizer(docs[:3000], 512, Path(work)), out, 1024)
    return out


def _checkpoint(family: str, tokenizer: Path, out: Path) -> Path:
    import shutil

    from tests.test_families import tiny_model

    over = {"sliding_window": 16} if family in ("qwen2", "gemma2") else {}
    model = tiny_model(family, **over)
    model.config.vocab_size = 512
    model.resize_token_embeddings(512)
    model.config.update({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "max_position_embeddings": 1024})
    model.save_pretrained(out)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(tokenizer / name, out / name)
    return out


# Phi-3 departs most from the three families the tool was shaped on; EDGEKILN_TEST_ALL=1 builds Qwen2 and
# Gemma 2 as well (a minute or more each; tests/test_family_paths.py runs every family's stages and weight
# paths without DVC).
@pytest.mark.parametrize("family", variants(("qwen2", "phi3", "gemma2"), ("phi3",), "a {} DVC build"))
def test_a_family_builds_for_x86_avx512_and_passes_its_parity_gate(family_repo, tokenizer_dir, tmp_path, family):
    ckpt = _checkpoint(family, tokenizer_dir, tmp_path / family)
    arch = json.loads((ckpt / "config.json").read_text())["architectures"][0]
    proc = run_cli(family_repo, "model=hf", f"model.path={ckpt}", "device=x86_avx512", f"build.name={family}-tiny",
                   "parity.peers=off", *FAST_RUN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    ran = [name for name, how in stage_lines(out) if how == "ran"]
    for stage in ("untie_head", "calibrate", "quantize", "export", "pack", "verify_parity", "benchmark"):
        assert f"{family}-tiny--{stage}" in ran, (stage, ran)
    art = family_repo / "artifacts" / f"{family}-tiny"
    io = json.loads((art / "pack" / "io.json").read_text())
    assert io["family"] == {"gemma2": "gemma2", "qwen2": "qwen2", "phi3": "phi3"}[family]
    report = json.loads((art / "verify_parity" / "report.json").read_text())
    assert report["passed"] is True, report["metrics"]
    # the exported fp32 decode step against transformers' own eager model of the family
    assert report["metrics"]["logits_snr_db"] > 100.0 and report["metrics"]["top1_agreement"] == 1.0
    assert json.loads((art / "untie_head" / "config.json").read_text())["architectures"] == [arch]
