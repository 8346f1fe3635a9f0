"""Run one function in a fresh Python process and hand back its result: for work whose library keeps
what it made after it returns.

The case that needs it: torch.onnx.export (dynamo) leaves its last trace reachable from module globals
(make_fx's fake-tensor-to-node map, the RNG decomposition's state tracker, the fake mode's memo), and
through the trace the model and every parameter it was traced from, until the next trace starts. The
export stage loads the model a second time for Genie's form, so at the 1.75B geometry it held two fp32
models at once: 19.5 GB peak, past the 16 GB a stage may use. Measured on a 0.5B cut of that geometry
(4 layers): the Genie-form export alone 2.47 GB resident, after the first export in the same process
4.32 GB. Clearing those globals by hand would chase a private, moving target in torch; a process that
exits returns everything.

The child is spawned (not forked: a fork would copy the parent's torch threads' state and its memory
map), dies with the parent (PR_SET_PDEATHSIG on Linux), and writes to the parent's stdout and stderr.
Its peak resident set is the kernel's RUSAGE_CHILDREN figure, which the stage's manifest records as
`peak_rss_children_bytes` (pipeline/engine/run_stage.py) and the stage's summary line shows.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from typing import Any, Callable


class ChildDied(RuntimeError):
    """The child ended without a result: killed (by the kernel's OOM killer, a signal) or exited."""

    def __init__(self, what: str, exitcode: int | None):
        self.exitcode = exitcode
        if exitcode is not None and exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
            how = f"was killed by {name}" + (" (out of memory?)" if exitcode == -signal.SIGKILL else "")
        else:
            how = f"exited with {exitcode} before its result"
        super().__init__(f"{what}: its process {how}")


def _die_with_parent() -> None:
    if sys.platform != "linux":
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # no libc by that name: the child may outlive a killed parent, nothing worse
        pass


def _main(send, fn: Callable, args: tuple, kwargs: dict) -> None:
    _die_with_parent()
    try:
        result = (True, fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        result = (False, err)
    try:
        send.send(result)
    except Exception as err:  # noqa: BLE001 - an unpicklable result or exception: its text goes back
        send.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}" if not result[0]
                                       else f"the result could not be sent back: {err}")))
    finally:
        send.close()


def run_in_child(fn: Callable, *args: Any, what: str = "the child", **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a spawned process: its return value, or the exception it raised, raised
    here; ChildDied where the process ended without either. fn, its arguments and its result must pickle
    (fn a module-level function)."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_main, args=(send, fn, args, kwargs), name=what)
    proc.start()
    send.close()  # the child holds the only writer: its death is EOF here
    try:
        ok, value = recv.recv()
    except EOFError:
        proc.join()
        raise ChildDied(what, proc.exitcode) from None
    except BaseException:  # interrupted here (Ctrl-C): the child goes too, not left running alone
        proc.kill()
        proc.join()
        raise
    finally:
        recv.close()
    proc.join()
    if ok:
        return value
    raise value
