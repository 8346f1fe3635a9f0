"""The shared cache (pipeline/engine/cache_remote.py): a stage computed in one clone is
restored in another through a local-directory DVC remote, without running.

A tiny DVC repository, not a pipeline build: the stage appends a line to a
marker file outside both clones each time its command really runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.engine import cache_remote
from tests.conftest import git, venv_env

STAGE = "make"


def dvc_in(repo: Path, log: list[tuple[list[str], str]]):
    """A `run_dvc` for cache_remote.repro that runs DVC in `repo` and keeps (args, output)."""
    def run(args: list[str]) -> int:
        proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True,
                              env=venv_env(), timeout=300)
        log.append((args, proc.stdout + proc.stderr))
        return proc.returncode
    return run


@pytest.fixture
def two_clones(tmp_path):
    a, b, store, marker = tmp_path / "a", tmp_path / "b", tmp_path / "store", tmp_path / "ran.log"
    a.mkdir()
    store.mkdir()
    git(a, "init", "-q")
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=a, check=True, env=venv_env())
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "shared", str(store)], cwd=a, check=True, env=venv_env())
    (a / "in.txt").write_text("seven\n")
    code = (f"import pathlib; pathlib.Path('out.txt').write_text(pathlib.Path('in.txt').read_text().upper()); "
            f"open({str(marker)!r}, 'a').write('ran\\n')")
    (a / "dvc.yaml").write_text(
        f"stages:\n  {STAGE}:\n    cmd: python -c \"{code}\"\n    deps: [in.txt]\n    outs: [out.txt]\n")
    git(a, "add", "-A")
    git(a, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "tiny")
    git(tmp_path, "clone", "-q", str(a), str(b))
    return a, b, store, marker


def test_a_stage_computed_in_one_clone_is_restored_in_another(two_clones, monkeypatch, caplog):
    a, b, store, marker = two_clones
    monkeypatch.setenv(cache_remote.ENV, "shared")
    monkeypatch.chdir(a)
    log_a: list = []
    assert cache_remote.repro([STAGE], dvc_in(a, log_a)) == 0, log_a
    assert marker.read_text() == "ran\n"
    assert (store / "runs").is_dir(), "the run-cache was not pushed to the remote"
    assert not (b / "out.txt").exists()

    monkeypatch.chdir(b)
    caplog.clear()
    log_b: list = []
    assert cache_remote.repro([STAGE], dvc_in(b, log_b)) == 0, log_b
    out = caplog.text  # DVC's own lines, through its logger
    assert marker.read_text() == "ran\n", "the stage ran again in the second clone:\n" + out
    assert f"Stage '{STAGE}' is cached - skipping run" in out and "Running stage" not in out, out
    assert (b / "out.txt").read_text() == "SEVEN\n"
    # reproduced through DVC's API with the remote as its default (pulled), then pushed
    assert [args for args, _ in log_b] == [["--wait-for-lock", "push", "--run-cache", "-r", "shared", STAGE]]


def test_without_the_setting_nothing_is_shared(two_clones, monkeypatch):
    a, b, store, marker = two_clones
    monkeypatch.delenv(cache_remote.ENV, raising=False)
    log: list = []
    assert cache_remote.repro([STAGE], dvc_in(a, log)) == 0, log
    assert [args for args, _ in log] == [["--wait-for-lock", "repro", "--single-item", STAGE]]
    assert not (store / "runs").exists()
    assert marker.read_text() == "ran\n"
