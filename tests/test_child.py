"""pipeline/engine/child.py: a function run in a spawned process, its result or its error handed back,
its memory returned when it ends and counted as the stage's subprocess peak."""

from __future__ import annotations

import os
import resource
import signal

import pytest

from pipeline.engine.child import ChildDied, run_in_child


def _hold(mib: int) -> int:
    """Touch `mib` MiB and keep them until the process ends, as torch.export keeps a traced model."""
    global _KEPT
    _KEPT = bytearray(mib << 20)
    for i in range(0, len(_KEPT), 4096):
        _KEPT[i] = 1
    return os.getpid()


def _fail(message: str):
    raise ValueError(message)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_result_comes_back_and_the_memory_the_child_kept_does_not():
    before = _rss_mib()
    pid = run_in_child(_hold, 300, what="holder")
    assert pid != os.getpid()
    assert _rss_mib() - before < 100  # the 300 MiB stayed in the child, and went with it
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    assert kids >= 300  # what the stage's manifest records as peak_rss_children_bytes


def test_the_childs_error_is_raised_here_as_itself():
    with pytest.raises(ValueError, match="no such graph"):
        run_in_child(_fail, "no such graph")


def test_a_child_killed_says_so_in_one_line():
    with pytest.raises(ChildDied) as err:
        run_in_child(_die, what="export of the decode step")
    assert err.value.exitcode == -signal.SIGKILL
    assert str(err.value) == "export of the decode step: its process was killed by SIGKILL (out of memory?)"
