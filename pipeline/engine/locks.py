"""Build locks: runs of one build queue; builds of different devices run side by side.

All are flocks under `artifacts/.locks/`, which the kernel releases when the
holder exits, SIGKILL included: there is never a stale lock to clean up.

- `<build>`: held by `python -m pipeline` from registering the build until its
  last stage, so a second run of the same build prints one line saying it
  waits, then runs against what the first left (usually: nothing to do).
- `_registry`: a short lock around rewriting builds/ and the generated
  dvc.yaml, so two builds registering at once cannot drop each other's stages.
- `_model_<hash>` and `_model_<hash>_use`, per shared model: DVC does not wait
  on its per-output read/write lock (a `dvc repro` that needs an output another
  one holds fails with "... is busy", seen here), and the one output builds of
  different devices share is the model they were built from. So one build at
  a time brings the model up to date (`_model_<hash>`, exclusive, seconds when
  nothing changed), every build reads it under `_model_<hash>_use` held
  shared, and the model is only rewritten under that lock held exclusive,
  after the builds reading the old one have finished. Everything else a build
  writes or reads is its own (its own probe included: pipeline/engine/layout.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from pipeline.engine.layout import ARTIFACTS, BUILD_NAME, ROOT

LOCK_DIR = f"{ARTIFACTS}/.locks"
REGISTRY = "_registry"
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
    shared: bool = False,
    what: str | None = None,
    waits_for: str = "another run of it to finish",
) -> Iterator[Path]:
    """Hold the lock of `name` for the `with` block: exclusive, or `shared`
    with other shared holders.

    Waits for a conflicting holder (forever when `timeout` is None), telling
    `say` once that it waits (`<what>: waiting for <waits_for>`) and once when
    it got the lock. Raises LockError (one line) on a timeout, an interrupt
    while waiting, or a lock file that cannot be created (read-only or full
    disk).
    """
    path = lock_path(name, root)
    what = what or ("the build registry" if name == REGISTRY else f"build {name}")
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise LockError(f"cannot create the lock of {what} ({path}): {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.monotonic()
            if say:
                say(f"{what}: waiting for {waits_for}{_holder(fd)}; lock {path}")
            try:
                _wait(fd, timeout, poll, mode)
            except KeyboardInterrupt:
                raise LockError(f"{what}: interrupted while waiting for its lock; nothing was built") from None
            if say:
                say(f"{what}: lock acquired after {time.monotonic() - t0:.1f} s")
        try:
            if not shared:  # shared holders are many: none of them is "the" holder
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode(), 0)
        except OSError:
            pass  # the holder note is informative only; the flock is what locks
        yield path
    finally:
        os.close(fd)  # releases the flock


def _wait(fd: int, timeout: float | None, poll: float, mode: int = fcntl.LOCK_EX) -> None:
    if timeout is None:
        fcntl.flock(fd, mode)
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
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
                say(f"waiting for another DVC command in this checkout{_holder(fd)} "
                    f"(DVC holds its repository lock for seconds between stages)")
            return True
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def model_locks(mid: str) -> tuple[str, str]:
    """(refresh, use) lock names of a shared model: a model id may hold
    characters a lock name may not, so the names carry a hash of it."""
    import hashlib

    tag = hashlib.sha256(mid.encode()).hexdigest()[:16]
    return f"_model_{tag}", f"_model_{tag}_use"


def fd_name(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
