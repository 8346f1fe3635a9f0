"""Per-build locks: two runs of the same build wait for each other, one at a time.

`python -m pipeline` holds `artifacts/.locks/<build>.lock` (an flock, which
the kernel releases when its holder exits, SIGKILL included: no stale lock to
clean up) from registering the build until its `dvc repro` ends, so a second
run of the same build prints one line saying it waits, then runs against what
the first left (usually: nothing to do). The build registry (builds/ and the
generated dvc.yaml) is rewritten under its own short lock, `_registry`, so two
builds registering at once cannot drop each other's stages.

Builds of different names share outputs (the probe's host facts, a model
trained once for all its builds), and DVC does not wait on the per-output
read/write lock of a running `dvc repro`: a second one fails with "... is
busy" (seen here). So every `dvc repro` of this checkout runs under one more
lock, `_repro`: builds of different devices queue, one after the other, with
a line saying so. Builds that must run side by side need separate checkouts
(or separate CI jobs sharing a DVC remote).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from .layout import ARTIFACTS, BUILD_NAME, ROOT

LOCK_DIR = f"{ARTIFACTS}/.locks"
REGISTRY = "_registry"
REPRO = "_repro"
_INTERNAL = re.compile(r"^_[a-z0-9_]{1,40}$")


class LockError(Exception):
    """One line: why the lock could not be taken."""


def lock_path(name: str, root: Path | None = None) -> Path:
    if not (BUILD_NAME.fullmatch(name) and ".." not in name) and not _INTERNAL.fullmatch(name):
        raise LockError(f"build name {name!r} cannot name a lock file under {LOCK_DIR}/")
    return Path(root or ROOT) / LOCK_DIR / f"{name}.lock"


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    return f" (pid {text.split()[0]})" if text else ""


@contextlib.contextmanager
def hold(
    name: str,
    *,
    root: Path | None = None,
    timeout: float | None = None,
    say: Callable[[str], None] | None = None,
    poll: float = 0.1,
) -> Iterator[Path]:
    """Hold the exclusive lock of `name` for the `with` block.

    Waits for another holder (forever when `timeout` is None), telling `say`
    once that it waits and once when it got the lock. Raises LockError (one
    line) on a timeout, an interrupt while waiting, or a lock file that
    cannot be created (read-only or full disk).
    """
    path = lock_path(name, root)
    what = "the build registry" if name == REGISTRY else f"build {name}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise LockError(f"cannot create the lock of {what} ({path}): {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.monotonic()
            if say:
                say(f"{what}: waiting for another run of it to finish{_holder(fd)}; lock {path}")
            try:
                _wait(fd, timeout, poll)
            except KeyboardInterrupt:
                raise LockError(f"{what}: interrupted while waiting for its lock; nothing was built") from None
            if say:
                say(f"{what}: lock acquired after {time.monotonic() - t0:.1f} s")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
        except OSError:
            pass  # the holder note is informative only; the flock is what locks
        yield path
    finally:
        os.close(fd)  # releases the flock


def _wait(fd: int, timeout: float | None, poll: float) -> None:
    if timeout is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LockError(
                    f"gave up after {timeout:g} s waiting for the lock {fd_name(fd)}: another run still holds it"
                ) from None
            time.sleep(poll)


def note_dvc_lock(root: Path | None = None, say: Callable[[str], None] | None = None) -> bool:
    """Say (once) when another DVC command holds this checkout's repository lock,
    which `dvc --wait-for-lock` will queue behind. Informative only: probed
    with a non-blocking flock (what zc.lockfile, DVC's backend, uses) that is
    released at once. True when it is held."""
    path = Path(root or ROOT) / ".dvc" / "tmp" / "lock"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if say:
                say(f"waiting for another DVC command in this checkout{_holder(fd)} to finish "
                    f"(builds of one checkout run one after the other)")
            return True
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
