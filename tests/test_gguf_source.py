"""GGUF as a model source: the model stage dequantizes a GGUF file (here a tiny
one the test writes with the `gguf` package) into a checkpoint with the same
logits and a tokenizer that adds BOS as the file says; the header reader gives
the facts the derived defaults need; a model package that is absent fails in
one line naming the install command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.sources import model_facts
from pipeline.engine.context import StageContext, StageError
from stages import model as stage

from tests import gguf_fixture


def _ctx(tmp_path: Path, model: dict) -> StageContext:
    out = tmp_path / "out"
    out.mkdir()
    cfg = OmegaConf.create({"model": {"name": "g", "source": "gguf", "path": None, "package": None,
                                      "sha256": None, "trust_remote_code": False, **model}})
    return StageContext(stage="model", build="t", cfg=cfg, inputs={}, out=out)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf"
    model = gguf_fixture.write(path)
    return path, model


def test_header_facts(tiny_gguf):
    path, _ = tiny_gguf
    meta = model_facts.gguf_metadata([path])
    assert meta["general.architecture"] == "gemma3"
    assert meta["tokenizer.ggml.add_bos_token"] is True
    facts = model_facts.of({"source": "gguf", "name": "g", "path": str(path)})
    assert (facts.sliding_window, facts.max_positions) == (16, 128)


def test_header_read_across_chunks(tiny_gguf, tmp_path):
    """A model package's chunks are the file cut in pieces: the header reads across them."""
    path, _ = tiny_gguf
    data = path.read_bytes()
    cuts = [0, 7, 300, 1000, len(data)]
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        parts.append(tmp_path / f"part{i:02d}")
        parts[-1].write_bytes(data[a:b])
    assert model_facts.gguf_metadata(parts) == model_facts.gguf_metadata([path])


def test_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(model_facts.FactsError, match="not a GGUF file"):
        model_facts.gguf_metadata([bad])


def test_stage_dequantizes_to_the_same_model(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, original = tiny_gguf
    ctx = _ctx(tmp_path, {"path": str(path)})
    result = stage.run(ctx)
    assert result["model"]["architecture"] == "Gemma3ForCausalLM"
    assert result["model"]["tied_embeddings"] is True
    assert result["gguf"]["add_bos_token"] is True
    assert len(result["gguf"]["sha256"]) == 64
    out = Path(ctx.out)
    assert sorted(p.suffix for p in out.glob("*.safetensors")) == [".safetensors"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The function returns a list")["input_ids"]
    assert ids[0] == 2, "BOS (tokenizer.ggml.add_bos_token) must be added"
    assert len(ids) > 2
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.tensor([ids + ids])
    with torch.no_grad():
        a = reloaded(input_ids=x).logits
        b = original(input_ids=x).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


def test_stage_no_bos_when_the_file_says_none(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "nobos.gguf"
    gguf_fixture.write(path, add_bos=False)
    ctx = _ctx(tmp_path, {"path": str(path)})
    assert stage.run(ctx)["gguf"]["add_bos_token"] is False
    assert AutoTokenizer.from_pretrained(ctx.out)("The cat")["input_ids"][0] != 2


def test_stage_refuses_a_wrong_sha256(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    ctx = _ctx(tmp_path, {"path": str(path), "sha256": "0" * 64})
    with pytest.raises(StageError, match="sha256"):
        stage.run(ctx)


def test_absent_package_is_one_line_with_the_install_command():
    with pytest.raises(model_facts.FactsError) as err:
        model_facts.package_module("edgekiln-no-such-model-package")
    text = str(err.value)
    assert "\n" not in text and "pip install -e '.[models]'" in text


def test_package_source_assembles_its_chunks(tiny_gguf, tmp_path, monkeypatch):
    """model.package: the stage assembles the package's file and checks model.sha256."""
    import sys
    import types

    from pipeline.engine.manifest import sha256_file

    path, _ = tiny_gguf
    data = path.read_bytes()
    chunks = [tmp_path / "c0", tmp_path / "c1"]
    chunks[0].write_bytes(data[:500])
    chunks[1].write_bytes(data[500:])
    fake = types.ModuleType("edgekiln_fake_model_pkg")
    fake.MODEL_NAME = "fake.gguf"
    fake.chunk_paths = lambda: chunks

    def assemble(target):
        Path(target).write_bytes(b"".join(c.read_bytes() for c in chunks))
        return Path(target)

    fake.assemble = assemble
    monkeypatch.setitem(sys.modules, "edgekiln_fake_model_pkg", fake)
    facts = model_facts.of({"source": "gguf", "name": "g", "package": "edgekiln-fake-model-pkg"})
    assert facts.sliding_window == 16
    ctx = _ctx(tmp_path, {"package": "edgekiln-fake-model-pkg", "sha256": sha256_file(path)})
    assert stage.run(ctx)["gguf"]["sha256"] == sha256_file(path)
    assert not list(tmp_path.glob(".gguf-*")), "the assembled file is removed after"
