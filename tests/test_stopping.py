"""The driver's side of stopping a build (pipeline/engine/stopping.py), in this process:
DVC's stage runner as `stoppable()` swaps it in, a real subprocess for the stage's
command, real signals. The whole build stopped end to end: tests/test_stop_build.py."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.engine import stopping


@pytest.fixture(autouse=True)
def dvc_patched():
    """DVC's stage runner swapped, as the build does before it calls DVC."""
    stopping.patch_dvc()

# The stage's command: says which signal reached it, and when it started.
STAGE_CMD = (
    "import signal, sys, time, pathlib\n"
    "out = pathlib.Path(sys.argv[1])\n"
    "def got(s, f):\n"
    "    out.write_text(signal.Signals(s).name); sys.exit(128 + s)\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(s, got)\n"
    "out.with_suffix('.started').write_text('')\n"
    "time.sleep(60)\n"
)


def run_stage_cmd(tmp_path: Path, sig: int):
    """DVC's `_run` (as swapped in) of the command, `sig` sent to this process once it runs."""
    from dvc.stage import run as dvc_run

    got = tmp_path / "got"

    def send():
        deadline = time.monotonic() + 60
        while not got.with_suffix(".started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()
    cmd = f"{sys.executable} -c \"$STAGE_CODE\" {got}"
    env = {**os.environ, "STAGE_CODE": STAGE_CMD, "DVC_STAGE": "b--verify_parity"}
    dvc_run._run("/bin/sh", cmd, env=env, close_fds=True)
    return got


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "sigint", "sighup"])
def test_a_signal_to_the_driver_reaches_the_running_stage_once(tmp_path, sig):
    """SIGINT too, which DVC's own runner ignores while a stage runs."""
    from dvc.stage.exceptions import StageCmdFailedError

    with stopping.stoppable():
        with pytest.raises(StageCmdFailedError) as failed:
            run_stage_cmd(tmp_path, sig)
        assert stopping.requested() == sig
        assert stopping.line("build b") == f"error: build b: stopped by {signal.Signals(sig).name} during verify_parity"
    # /bin/sh (dash here) stays the command's parent rather than exec it: the shell may die of
    # the signal first (DVC says "exited with -N"); the command got it too, from the driver.
    assert "exited with" in str(failed.value)
    got = tmp_path / "got"
    deadline = time.monotonic() + 10
    while not got.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got.read_text() == signal.Signals(sig).name
    assert signal.getsignal(sig) is not stopping._on_signal  # handlers put back


def test_no_stage_starts_once_the_build_was_stopped(tmp_path):
    from dvc.stage import run as dvc_run
    from dvc.stage.exceptions import StageCmdFailedError

    with stopping.stoppable():
        with pytest.raises(StageCmdFailedError):
            run_stage_cmd(tmp_path, signal.SIGTERM)
        started = tmp_path / "second"
        with pytest.raises(StageCmdFailedError):
            dvc_run._run("/bin/sh", f"touch {started}", env={**os.environ, "DVC_STAGE": "b--benchmark"}, close_fds=True)
        assert not started.exists()
        assert stopping.line("build b").endswith("during verify_parity")


def test_a_stop_while_no_stage_runs_unwinds_the_build():
    with stopping.stoppable():
        with pytest.raises(stopping.Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler raises here
        assert stopped.value.signum == signal.SIGHUP
        assert stopping.line("build b") == "error: build b: stopped by SIGHUP before its first stage started"
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal while it unwinds changes nothing
    assert stopping.requested() == signal.SIGHUP


def test_a_stop_that_lands_in_a_finalizer_unwinds_the_build_after_it(monkeypatch):
    """Python swallows an exception raised in __del__ (printing "Exception ignored ... Traceback"):
    a stop that lands in one (dulwich closes its packs in __del__ while DVC hashes) is raised
    just after it instead (seen on CI: tests/test_stop_build.py's sweep stopped by SIGTERM)."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    class Closing:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs here, inside the finalizer
                pass

    with stopping.stoppable():
        with pytest.raises(stopping.Stopped) as stopped:
            Closing()
            time.sleep(5)  # delivered again here
        assert stopped.value.signum == signal.SIGTERM
    assert unraisable == []


def test_a_stop_as_the_stage_starts_reaches_it(tmp_path, monkeypatch):
    """The signal lands after DVC started the command but before its pid was recorded:
    not raised there (the new process would run on behind the unwinding build), the
    command is signalled once its pid is known."""
    from dvc.stage import run as dvc_run
    from dvc.stage.exceptions import StageCmdFailedError

    real = stopping.subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        proc = real(*args, **kwargs)
        stopping._on_signal(signal.SIGTERM, None)  # the handler, as the signal would run it here
        return proc

    monkeypatch.setattr(stopping.subprocess, "Popen", popen_then_signal)
    env = {**os.environ, "STAGE_CODE": STAGE_CMD, "DVC_STAGE": "b--export"}
    t0 = time.monotonic()
    with stopping.stoppable():
        with pytest.raises(StageCmdFailedError):
            dvc_run._run("/bin/sh", f"exec {sys.executable} -c \"$STAGE_CODE\" {tmp_path / 'got'}",
                         env=env, close_fds=True)
        assert stopping.line("build b") == "error: build b: stopped by SIGTERM during export"
    assert time.monotonic() - t0 < 30  # the command's 60 s sleep was cut short
