"""Writing a file whole or not at all: the one pattern the engine and the registry share.

Written by hand because it is four lines of the standard library (a temp file beside the target, fsync,
`os.replace`), but copies of it had drifted apart (some fsynced, some left their temp file behind on a
failed write). Two keep their own: the device agent (pipeline/fleet/agent.py), which runs on a device
without this project installed, and the corpus memo (pipeline/sources/corpus.py), since sources/ imports
no other part (tests/test_architecture.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TextIO


def write_whole(path: Path, write: Callable[[TextIO], object] | str) -> None:
    """`write(file)` (or the text itself) into a hidden temp file beside `path`, fsynced, then renamed over
    it: a kill or a full disk at any point leaves the previous whole file or the new one, never half of
    one, and no temp file. Makes the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fd:
            fd.write(write) if isinstance(write, str) else write(fd)
            fd.flush()
            os.fsync(fd.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
