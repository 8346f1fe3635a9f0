"""Manifests: tampering is caught by hash and named; a failed stage leaves nothing."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pipeline.engine import manifest
from pipeline.engine.context import StageContext, StageError


def make_artifact(folder):
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\x01\x02" * 1000)
    (folder / "sub").mkdir()
    (folder / "sub" / "io.json").write_text('{"a": 1}')
    return manifest.write(folder, stage="export", build="b", key={"params": {"x": 1}}, result={}, timings={})


def test_roundtrip_and_full_sha256(tmp_path):
    m = make_artifact(tmp_path / "a")
    assert len(m["config_hash"]) == 64 and len(m["content_sha256"]) == 64
    assert set(m["files"]) == {"weights.bin", "sub/io.json"}
    assert manifest.verify(tmp_path / "a", expect_stage="export")["config_hash"] == m["config_hash"]


def test_config_hash_changes_with_any_key_part():
    base = {"params": {"x": 1}, "toolchain": {"torch": "2.13.0"}, "code": {"s.py": "aa"}, "inputs": {}}
    h = manifest.config_hash(base)
    for part, value in [("params", {"x": 2}), ("toolchain", {"torch": "2.14.1"}), ("code", {"s.py": "ab"}), ("inputs", {"m": "c"})]:
        assert manifest.config_hash({**base, part: value}) != h


@pytest.mark.parametrize(
    "tamper, words",
    [
        (lambda a: (a / "weights.bin").write_bytes(b"\x01\x03" * 1000), ["weights.bin", "sha256"]),
        (lambda a: (a / "weights.bin").write_bytes(b"\x01\x02" * 999), ["weights.bin"]),
        (lambda a: (a / "sub" / "io.json").unlink(), ["io.json", "missing"]),
        (lambda a: (a / "extra.onnx").write_bytes(b"x"), ["extra.onnx", "not in the manifest"]),
        (lambda a: (a / "manifest.json").write_text("{not json"), ["manifest.json", "unreadable"]),
        (lambda a: (a / "manifest.json").unlink(), ["no manifest.json"]),
    ],
)
def test_tampering_is_refused_by_name(tmp_path, tamper, words):
    make_artifact(tmp_path / "a")
    tamper(tmp_path / "a")
    with pytest.raises(StageError) as e:
        manifest.verify(tmp_path / "a")
    for w in words:
        assert w in str(e.value)


def test_edited_manifest_is_refused(tmp_path):
    make_artifact(tmp_path / "a")
    mf = tmp_path / "a" / "manifest.json"
    doc = json.loads(mf.read_text())
    (tmp_path / "a" / "weights.bin").write_bytes(b"evil")
    doc["files"]["weights.bin"] = {"sha256": manifest.sha256_file(tmp_path / "a" / "weights.bin"), "bytes": 4}
    mf.write_text(json.dumps(doc))
    with pytest.raises(StageError, match="edited manifest"):
        manifest.verify(tmp_path / "a")


def test_wrong_stage_is_refused(tmp_path):
    make_artifact(tmp_path / "a")
    with pytest.raises(StageError, match="expected 'untie_head'"):
        manifest.verify(tmp_path / "a", expect_stage="untie_head")


def test_failed_stage_leaves_nothing(tmp_path, monkeypatch):
    """run_stage writes to a hidden temp folder and renames only on success."""
    from pipeline.engine import run_stage

    final = tmp_path / "artifacts" / "b" / "untie_head"

    class Boom:
        READS, INPUTS, TOOLCHAIN, SCOPE = (), (), (), "build"

        @staticmethod
        def run(ctx):
            (ctx.out / "half.bin").write_bytes(b"x" * 10)
            raise StageError("disk on fire")

    from pipeline.engine.layout import StageDecl

    decl = StageDecl("untie_head", (), (), (), "build", Boom)
    monkeypatch.setattr(run_stage, "declaration", lambda s: decl)
    monkeypatch.setattr(run_stage, "ROOT", tmp_path)
    monkeypatch.setattr(run_stage, "output_dir", lambda *a: "artifacts/b/untie_head")
    monkeypatch.setattr(run_stage, "stage_params", lambda *a: ({}, None))
    monkeypatch.setattr(run_stage, "cache_key", lambda *a: {})
    with pytest.raises(StageError, match="disk on fire"):
        run_stage.run("untie_head", "b")
    assert not final.exists()
    assert list((tmp_path / "artifacts" / "b").iterdir()) == []


def test_context_sees_only_declared_sections():
    ctx = StageContext(stage="s", build="b", cfg=OmegaConf.create({"export": {"opset": 21}}), inputs={}, out=None)
    with pytest.raises(Exception):
        ctx.cfg.model  # noqa: B018 - not declared, not there
