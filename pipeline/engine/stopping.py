"""Stopping a build: SIGTERM, SIGINT or SIGHUP to the process running DVC.

`python -m pipeline` (and a sweep's worker) runs DVC in-process, and DVC runs
each stage's command as a child (`$SHELL -c "python -m pipeline.engine.run_stage
..."`). Left alone, a SIGTERM or SIGHUP ends the driver on the spot and the stage
runs on, re-parented to init, holding the cores; DVC itself ignores SIGINT while
a stage runs (it counts on a terminal sending Ctrl-C to the stage too), so a
`kill -INT` of the driver did nothing. `stoppable()` installs, for the driver:

- a handler for the three signals that sends the first one to the running stage
  (whose supervisor stops the stage's processes and removes its temporary
  output: pipeline/engine/run_stage.py `supervise`) and lets DVC see the stage
  fail, so DVC stops there and releases its locks as after any failed stage;
  with no stage running (DVC hashing, a lock being waited for) it raises `Stopped`;
- DVC's stage runner (dvc/stage/run.py `_run`) swapped (`patch_dvc`, where the
  build calls DVC) for one that, inside `stoppable`, records which stage runs (for
  the handler and the build's last line), does not ignore SIGINT, and starts no
  stage once a stop was asked for.

The build then ends with one line, `error: build NAME: stopped by SIGTERM during
STAGE`. A stage whose driver dies without a signal (SIGKILL) stops by itself: its
supervisor watches its parent (run_stage.py `_parents_watched`).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import subprocess
import threading
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal that came while no stage ran: unwinds the build like Ctrl-C
    (DVC and the build locks already handle an interrupt), carrying the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _State:
    building = False  # inside stoppable()
    watching = False  # watch_parent's thread runs
    signum: int | None = None
    deferred = False  # a stop that landed in a finalizer, delivered again (_on_signal)
    stage: str | None = None  # the stage running when the stop came
    last: str | None = None  # the last stage started, for a stop between stages
    running: dict[int, str] = {}  # pid of a stage's command -> its DVC stage name
    starting: str | None = None  # the stage whose command is being started


_state = _State()


def requested() -> int | None:
    """The signal that stopped this process's build, or None."""
    return _state.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def where() -> str:
    """'during <stage>' (the stage the stop came during, or after the last one started)."""
    if _state.stage:
        return f"during {_stage_name(_state.stage)}"
    if _state.last:
        return f"after {_stage_name(_state.last)}, before the next stage started"
    return "before its first stage started"


def line(what: str) -> str:
    """The build's closing line: `error: build NAME: stopped by SIGTERM during verify_parity`."""
    return f"error: {what}: stopped by {signal_name(_state.signum or signal.SIGTERM)} {where()}"


def _stage_name(dvc_stage: str) -> str:
    """`b--verify_parity` -> verify_parity, `model--<model id>` -> model (dvc.yaml's names)."""
    first, sep, second = dvc_stage.partition("--")
    if not sep:
        return dvc_stage
    from pipeline.engine.layout import STAGES

    return second if second in STAGES else first


def _on_signal(signum, _frame):
    first = _state.signum is None
    if first:
        _state.signum = signum
    if not _state.building:
        return  # a sweep's worker between jobs: its next job sees the stop and builds nothing
    running = dict(_state.running)
    if running:
        if first:
            _state.stage = next(iter(running.values()))
            for pid in running:
                _signal_stage(pid, signum)
        return  # DVC sees the stage exit non-zero and stops there; a later signal changes nothing
    if _state.starting:
        return  # _run_stage_cmd signals it once started
    if not (first or _state.deferred):
        return  # the build is unwinding already
    if _in_finalizer(_frame):
        # Python prints an exception raised in a finalizer ("Exception ignored in ...
        # Traceback") and swallows it: a stop that lands while one runs (dulwich's
        # object store closes its packs in __del__ while DVC hashes) would not unwind the
        # build. The same signal is delivered again in a moment, outside it.
        _state.deferred = True
        threading.Timer(FINALIZER_RETRY_S, _thread.interrupt_main, (signum,)).start()
        return
    _state.deferred = False
    raise Stopped(_state.signum)


FINALIZER_RETRY_S = 0.05


def _in_finalizer(frame) -> bool:
    """Is `frame` (where a signal landed) inside an object's __del__?"""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _signal_stage(pid: int, signum: int) -> None:
    """The signal to the stage's command, `pid` (run_stage's supervisor, which stops the
    stage's whole process group). Where the shell DVC runs the command through did not
    exec it, `pid` is that shell: the signal goes to the shell's children (the supervisor)
    and not to the shell, which would keep a SIGINT to itself until the stage ended and
    die at once of a SIGTERM or SIGHUP, so that DVC saw the stage end, and the build
    printed its last line, while the supervisor was still stopping the stage (its own
    line then came after the build's). The shell ends when its child does."""
    from pipeline.engine.run_stage import _SHELLS, _children

    targets = [pid]
    try:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() in _SHELLS:
                targets = _children(pid) or [pid]
    except OSError:
        pass
    for target in targets:
        try:
            os.kill(target, signum)
        except ProcessLookupError:
            pass


def _run_stage_cmd(executable, cmd, **kwargs):
    """dvc/stage/run.py `_run` (DVC 3.67), recording the stage it runs, without its
    SIGINT ignore (the handler above forwards SIGINT instead), and refusing to start
    a stage once the build was stopped."""
    if not _state.building:  # not a build's driver: DVC's own
        return _dvc_run[0](executable, cmd, **kwargs)
    from dvc.stage import run as dvc_run
    from dvc.stage.exceptions import StageCmdFailedError

    stage = (kwargs.get("env") or {}).get("DVC_STAGE") or cmd
    if _state.signum is not None:
        raise StageCmdFailedError(cmd, 128 + _state.signum)
    # A stop while the command starts (`starting`) is not raised (that would leave the new
    # process running behind the unwinding build): the stage is signalled once its pid is known.
    _state.starting = stage
    try:
        p = subprocess.Popen(dvc_run._make_cmd(executable, cmd), **kwargs)  # noqa: S603 - DVC's own call
        _state.running[p.pid] = stage
    finally:
        _state.starting = None
    _state.last = stage
    try:
        if _state.signum is not None and _state.stage is None:  # the stop came as it started
            _state.stage = stage
            _signal_stage(p.pid, _state.signum)
        p.communicate()
    finally:
        _state.running.pop(p.pid, None)
    if p.returncode != 0:
        raise StageCmdFailedError(cmd, p.returncode)


_run_stage_cmd.edgekiln_stoppable = True


@contextlib.contextmanager
def stoppable(worker: bool = False) -> Iterator[None]:
    """Stop handling for the `with` block (a build's driver). Only the main thread can
    take signals; elsewhere (a launcher running jobs in threads) this does nothing.

    `worker`: a sweep's worker process, which runs one job after another: a stop that
    came before (between jobs) is kept, not forgotten, and the handlers stay on after
    the block, so that a stop between two jobs neither kills the worker (the launcher
    would lose every job it had) nor is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from dvc.stage import run as dvc_run

    if not worker:
        _state.signum = None
    _state.deferred = False
    _state.stage = _state.last = None
    _state.running = {}
    before = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    _state.building = True
    try:
        yield
    finally:
        _state.building = False
        if not worker:
            for s, handler in before.items():
                signal.signal(s, handler)


def patch_dvc() -> None:
    """Swap DVC's stage runner for `_run_stage_cmd` (which is DVC's own outside `stoppable`)
    and quiet DVC's CLI after a stop: done where the build calls DVC (build._repro), not in
    `stoppable`, so that a driver that never reaches DVC does not pay for importing it.
    Once per process."""
    from dvc.stage import run as dvc_run

    if getattr(dvc_run._run, "edgekiln_stoppable", False):
        return
    from dvc.log import logger as dvc_logger

    _dvc_run.append(dvc_run._run)
    dvc_run._run = _run_stage_cmd
    # DVC's CLI says "ERROR: failed to reproduce ...: exited with 143" (or "interrupted by the
    # user") for the stage a stop ended: the stage's line and the build's say it (shown with -v).
    dvc_logger.getChild("dvc.cli").addFilter(_AfterStop())


_dvc_run: list = []  # DVC's own `_run`, once patch_dvc swapped it


class _AfterStop:
    """A logging filter: nothing once the build was stopped (everything with -v)."""

    def filter(self, record) -> bool:
        from pipeline.engine import narrate

        return not (_state.building and _state.signum is not None) or narrate.verbose()


@contextlib.contextmanager
def stopping_workers(stop_file) -> Iterator[None]:
    """For a sweep's launcher (pipeline/fleet/sweep.py): the first SIGTERM, SIGINT or
    SIGHUP is recorded, `stop_file` written (a job that starts later builds nothing:
    `job_stopped`) and the signal sent to this process's children that catch it, the
    launcher's workers that have run a job (each stops its build as `python -m pipeline`
    does: `stoppable(worker=True)`); the launcher then collects their results as usual.
    A child that does not catch it is left alone: a worker that never ran a job would
    die of it and take the launcher's pool down (loky SIGKILLs the other workers then),
    and loky's resource trackers ignore SIGTERM and SIGINT."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.signum = None

    def on_signal(signum, _frame):
        if _state.signum is not None:
            return
        _state.signum = signum
        try:
            stop_file.parent.mkdir(parents=True, exist_ok=True)
            stop_file.write_text(f"{signal_name(signum)}\n")
        except OSError:
            pass  # the workers still get the signal
        from pipeline.engine.run_stage import _children

        for pid in _children(os.getpid()):
            if _catches(pid, signum):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    before = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _catches(pid: int, signum: int) -> bool:
    """Does process `pid` have a handler for `signum` (/proc/PID/status SigCgt)?"""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(l.split()[1], 16) for l in f if l.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caught & (1 << (signum - 1)))


def job_stopped(stop_file) -> bool:
    """A sweep's job: was the sweep stopped (this process told, or the launcher's file written)?
    Asked before the build and again once `stoppable` is on: a stop that came between the
    two found no handler here (`stopping_workers` skipped this worker) but wrote the file."""
    return _state.signum is not None or stop_file.exists()


def watch_parent(interval: float = 0.5) -> None:
    """Stop this process's build (SIGTERM to itself) when its parent is gone, then end
    the process: a sweep's worker whose launcher was SIGKILLed. A polling thread, not
    PR_SET_PDEATHSIG, which fires when the parent *thread* that started this process
    ends (loky starts its workers from a thread of the launcher)."""
    if _state.watching:
        return
    _state.watching = True
    parent = os.getppid()

    def watch():
        import time

        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)  # the build under way stops its stage and ends
        while _state.building:
            time.sleep(interval)
        # Nobody is left to hand a job to it: an idle worker would otherwise wait out the
        # launcher's idle timeout (loky's: minutes). The job's result file is written by now.
        time.sleep(2 * interval)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="edgekiln-parent-watch", daemon=True).start()
