"""A stage's journal (StageContext.remembered, run_stage._journal): a long stage's finished pieces kept
across a run that is killed, read back only by a run with the same cache key, gone once the output is in."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.engine import run_stage
from pipeline.engine.context import StageContext


def _ctx(tmp_path, journal) -> StageContext:
    return StageContext(stage="verify_parity", build="b", cfg=OmegaConf.create({}), inputs={},
                        out=tmp_path / "out", journal=journal)


def test_a_piece_is_computed_once_and_read_back_by_the_next_run_with_the_same_key(tmp_path, capsys):
    journal = tmp_path / ".verify_parity.journal-abc"
    calls = []

    def htp_run():
        calls.append(1)
        return ({"logits_snr_db": np.float32(19.25), "steps": np.int64(24)}, [np.arange(3)])

    first = _ctx(tmp_path, journal).remembered("qnn_mixed_cold", htp_run, "the mixed binary's cold run")
    again = _ctx(tmp_path, journal).remembered("qnn_mixed_cold", htp_run, "the mixed binary's cold run")
    assert calls == [1]
    # as JSON gives it back, made now or kept: both runs go on from the same values
    assert first == again == [{"logits_snr_db": 19.25, "steps": 24}, [[0, 1, 2]]]
    assert "the mixed binary's cold run: kept by the run that stopped before this one" in capsys.readouterr().err
    assert sorted(p.name for p in journal.iterdir()) == ["qnn_mixed_cold.json"]  # no half-written file beside


def test_a_piece_that_fails_is_not_kept_and_no_journal_keeps_nothing(tmp_path):
    journal = tmp_path / ".verify_parity.journal-abc"

    def broken():
        raise RuntimeError("the HTP backend went away")

    with pytest.raises(RuntimeError):
        _ctx(tmp_path, journal).remembered("qnn_mixed_cold", broken)
    assert not (journal / "qnn_mixed_cold.json").exists()
    calls = []
    for _ in range(2):
        _ctx(tmp_path, None).remembered("x", lambda: calls.append(1) or 1)
    assert calls == [1, 1]
    with pytest.raises(TypeError, match="JSON-able"):
        _ctx(tmp_path, journal).remembered("odd", lambda: object())


def test_files_a_piece_wrote_are_kept_whole_and_linked_into_the_next_runs_output(tmp_path, capsys):
    """remembered_files (compile_qnn's binaries): what compute wrote lands in dest; the next run with the
    same key links the kept files (the same inode: nothing copied) and reads the facts back; a failed
    piece keeps nothing, and a folder whose facts were never recorded is made again."""
    journal = tmp_path / ".compile_qnn.journal-abc"
    calls = []

    def compile_into(folder):
        calls.append(folder)
        (folder / "prompt").mkdir()
        (folder / "model_ctx.onnx").write_bytes(b"ctx")
        (folder / "prompt" / "model_ctx_qnn.bin").write_bytes(b"binary")
        return {"binaries": ["prompt/model_ctx_qnn.bin"], "bytes": 6}

    first_out = tmp_path / "run1" / "w4a16"
    facts = _ctx(tmp_path, journal).remembered_files("w4a16", first_out, compile_into, "the w4a16 binary")
    assert facts == {"binaries": ["prompt/model_ctx_qnn.bin"], "bytes": 6}
    assert (first_out / "prompt" / "model_ctx_qnn.bin").read_bytes() == b"binary"
    assert calls[0] != first_out and calls[0].parent == journal  # written in the journal, not the output

    def must_not_run(folder):
        raise AssertionError("compiled twice")

    second_out = tmp_path / "run2" / "w4a16"
    again = _ctx(tmp_path, journal).remembered_files("w4a16", second_out, must_not_run, "the w4a16 binary")
    assert again == facts and len(calls) == 1
    assert (second_out / "model_ctx.onnx").read_bytes() == b"ctx"
    assert os.path.samefile(second_out / "prompt" / "model_ctx_qnn.bin", journal / "w4a16" / "prompt" /
                            "model_ctx_qnn.bin")
    assert "the w4a16 binary: kept by the run that stopped before this one" in capsys.readouterr().err

    def refused(folder):
        (folder / "half.bin").write_bytes(b"x")
        raise RuntimeError("QNN_COMMON_ERROR_MEM_ALLOC")

    with pytest.raises(RuntimeError):
        _ctx(tmp_path, journal).remembered_files("fp16", tmp_path / "run3", refused)
    assert sorted(p.name for p in journal.iterdir()) == ["w4a16", "w4a16.json"]  # nothing of the failed one

    (journal / "fp16").mkdir()  # a run killed after the rename, before the facts: not trusted
    (journal / "fp16" / "stale.bin").write_bytes(b"old")
    out = tmp_path / "run4" / "fp16"
    _ctx(tmp_path, journal).remembered_files("fp16", out, compile_into)
    assert len(calls) == 2 and not (out / "stale.bin").exists() and (out / "model_ctx.onnx").is_file()

    without = tmp_path / "nojournal"  # no journal: compute writes straight into dest
    _ctx(tmp_path, None).remembered_files("w4a16", without, compile_into)
    assert calls[-1] == without and (without / "model_ctx.onnx").is_file()


def test_another_cache_key_never_reads_a_journal_and_removes_the_stale_one(tmp_path):
    final = tmp_path / "artifacts" / "b" / "verify_parity"
    final.parent.mkdir(parents=True)
    mine = run_stage._journal(final, "a" * 64)
    mine.mkdir()
    (mine / "qnn_mixed_cold.json").write_text(json.dumps({"value": 1, "seconds": 2.0}))
    assert run_stage._journal(final, "a" * 64) == mine and mine.is_dir()  # the same key: kept
    theirs = run_stage._journal(final, "b" * 64)  # code, config, toolchain or an input changed
    assert theirs != mine and not mine.exists()


def _stage_that_dies(ctx):
    ctx.remembered("first_hour", lambda: {"done": os.getpid()})
    if os.environ.get("EDGEKILN_TEST_DIE"):
        os.kill(os.getpid(), signal.SIGKILL)
    return {"metrics": {"first_hour_by": ctx.remembered("first_hour", lambda: {"done": -1})["done"]}}


def test_a_killed_stage_resumes_from_its_journal_and_clears_it_once_installed(tmp_path, monkeypatch):
    """run_stage.run, end to end on a stand-in stage: a run killed after a piece, then the rerun that
    reads the piece back, installs, and leaves no journal behind."""
    import multiprocessing

    from pipeline.engine import layout

    declared = layout.declaration("verify_parity")
    monkeypatch.setattr(run_stage, "ROOT", tmp_path)
    monkeypatch.setattr(run_stage, "stage_params", lambda stage, build, model: ({"parity": {}}, None))
    monkeypatch.setattr(run_stage, "cache_key", lambda *a, **k: {"stage": "verify_parity", "same": True})
    monkeypatch.setattr(run_stage, "declaration", lambda stage: type(declared)(
        **{**declared.__dict__, "inputs": (), "module": type("M", (), {"run": staticmethod(_stage_that_dies)})}))
    monkeypatch.setattr(run_stage, "output_dir", lambda stage, build, model: f"artifacts/{build}/{stage}")

    proc = multiprocessing.get_context("fork").Process(target=_die_in_stage, args=())
    monkeypatch.setenv("EDGEKILN_TEST_DIE", "1")
    proc.start()
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    journals = list((tmp_path / "artifacts" / "b").glob(".verify_parity.journal-*"))
    assert len(journals) == 1 and json.loads((journals[0] / "first_hour.json").read_text())["done"] == proc.pid
    monkeypatch.delenv("EDGEKILN_TEST_DIE")
    final = run_stage.run("verify_parity", "b")
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["result"]["metrics"]["first_hour_by"] == proc.pid  # the killed run's piece, not redone
    assert not list(final.parent.glob(".verify_parity.journal-*"))


def _die_in_stage():
    run_stage.run("verify_parity", "b")


def test_write_whole_leaves_the_old_file_or_the_new_one_and_no_temp_file(tmp_path):
    """pipeline/engine/files.write_whole (the journal's records, builds/*.yaml, dvc.lock, the registry's
    index): a write that fails midway leaves the previous file whole and nothing beside it."""
    from pipeline.engine.files import write_whole

    path = tmp_path / "deep" / "index.yaml"
    write_whole(path, "old: 1\n")
    assert path.read_text() == "old: 1\n"

    def dies(fd):
        fd.write("new: ")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_whole(path, dies)
    assert path.read_text() == "old: 1\n" and [p.name for p in path.parent.iterdir()] == ["index.yaml"]
    write_whole(path, lambda fd: fd.write("new: 2\n"))
    assert path.read_text() == "new: 2\n"
