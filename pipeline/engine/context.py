"""What a stage's `run` receives: its declared config, its inputs, its output folder.

The contract every `stages/<name>.py` follows:

    READS = ("model", "export")   # config sections it reads (or a part: "parity.artifact")
    INPUTS = ("untie_head",)      # upstream stages whose artifacts it reads
    TOOLCHAIN = ("torch", "onnx") # distributions whose versions shape its output

    def run(ctx: StageContext) -> dict:
        ...write files under ctx.out...
        return {"metrics": {...}}   # recorded in the output's manifest.json

`ctx.cfg` holds only the sections named in READS: a stage cannot read what its
cache key leaves out. Two pseudo-sections come from the probe rather than the
config files: `device` (the resolved device spec: for device=auto the probed
class) and `host` (the builder's facts, for stages that measure).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from pipeline.engine.files import write_whole


class StageError(Exception):
    """A failure the user can act on: printed as one line, no traceback."""


@dataclass
class StageContext:
    stage: str
    build: str
    cfg: DictConfig
    inputs: dict[str, Path]
    out: Path
    extras: dict[str, Any] = field(default_factory=dict)
    journal: Path | None = None  # run_stage's `.<stage>.journal-<config hash>`; None: nothing kept

    def log(self, message: str) -> None:
        print(f"[{self.stage}] {message}", file=sys.stderr, flush=True)

    def progress(self, total: int | None, description: str):
        """A progress bar on stderr for work that takes more than a few seconds."""
        return progress_bar(self.stage, total, description)

    def remembered(self, name: str, compute: Callable[[], Any], what: str | None = None) -> Any:
        """compute() once per cache key: its JSON-able result is kept in the stage's journal as soon as it
        is made, so a run killed later (a session's end, the OOM killer, Ctrl-C) resumes past it rather than
        redoing it; the journal's name holds the stage's config hash (code, config, toolchain, inputs), so a
        result is only ever read back by a run that would have computed it again. For pieces that take
        minutes (an HTP emulation run of a 1.75B binary: hours); not a cache between builds."""
        if self.journal is None:
            return compute()
        path = self.journal / f"{name}.json"
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        else:
            self.log(f"{what or name}: kept by the run that stopped before this one, not redone "
                     f"({self.journal.name}/{path.name})")
            return value
        text = json.dumps(compute(), default=_plain)
        write_whole(path, text)  # whole or absent: a kill mid-write leaves no half record
        return json.loads(text)  # as a resumed run reads it back: both runs go on from the same values

    def remembered_files(self, name: str, dest: Path, compute: Callable[[Path], Any],
                         what: str | None = None) -> Any:
        """remembered() for a piece that writes files (a context binary compiled for minutes, at 1.75B for
        an hour): compute(folder) writes them into a folder of the journal and returns JSON-able facts
        (paths in them relative to the folder); the folder is renamed into place whole, then its facts
        recorded, and its files are linked into `dest`. A resumed run links the kept files and reads the
        facts back; a folder without its facts (killed between the two) is made again."""
        if self.journal is None:
            dest.mkdir(parents=True, exist_ok=True)  # compute gets an existing folder either way
            return compute(dest)
        kept = self.journal / name

        def make():
            shutil.rmtree(kept, ignore_errors=True)  # made, but its facts never recorded: not trusted
            part = self.journal / f".{name}.{os.getpid()}"
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir(parents=True)
            try:
                facts = compute(part)
            except BaseException:
                shutil.rmtree(part, ignore_errors=True)
                raise
            os.replace(part, kept)
            return facts

        facts = self.remembered(name, make, what)
        # linked, not copied: the journal is removed once the output is installed, and the files stay
        shutil.copytree(kept, dest, copy_function=_link_or_copy, dirs_exist_ok=True)
        return facts


def _plain(value):
    """JSON for numpy's scalars and arrays (a measure's figures), which json does not know."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON: StageContext.remembered keeps JSON-able results")


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the two paths share a file system (the journal sits beside the output), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def progress_bar(stage: str, total: int | None, description: str) -> "_Bar":
    """`[stage] description` with a bar on stderr (the engine's own work before and after a stage
    uses it too: hashing large inputs and outputs)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if not console.is_terminal:
        # A log file, CI's or a pipe (DVC's `dvc exp run` output, `nohup`): rich draws nothing there
        # until the bar ends, so a 20-minute stage said nothing for 20 minutes. Plain lines instead.
        return _Lines(stage, total, description)
    # Literal text: as rich markup, "[calibrate]" would be taken for a style and vanish,
    # and a brace in the description for a format field.
    label = f"[{stage}] {description}".replace("{", "{{").replace("}", "}}")
    return _Bar(
        Progress(
            TextColumn(label, markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=False,
        ),
        total,
    )


class _Bar:
    """`with ctx.progress(n, "training") as bar: bar.advance()`."""

    def __init__(self, progress, total):
        self._progress = progress
        self._total = total
        self._task = None

    def __enter__(self):
        self._progress.__enter__()
        self._task = self._progress.add_task("", total=self._total, info="")
        return self

    def advance(self, n: int = 1, **fields: Any) -> None:
        """Advance by n; keyword fields (loss=...) are shown after the bar."""
        info = " ".join(f"{k} {v}" for k, v in fields.items())
        self._progress.update(self._task, advance=n, **({"info": info} if fields else {}))

    def __exit__(self, *exc):
        if exc[0] is None and self._total is None:  # work of unknown size, done: shown as such, not "0/?"
            done = max(1, int(self._progress.tasks[0].completed))
            self._progress.update(self._task, total=done, completed=done)
        return self._progress.__exit__(*exc)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class _Lines:
    """The bar's plain-text form where stderr is not a terminal: a line when the work starts, one at most
    every EDGEKILN_PROGRESS_SECONDS (30) with its count, elapsed and the time left at its rate so far,
    and one when it ends."""

    def __init__(self, stage: str, total: int | None, description: str):
        import os

        self._label = f"[{stage}] {description}"
        self._total = total
        self._every = float(os.environ.get("EDGEKILN_PROGRESS_SECONDS") or 30)
        self._done = 0
        self._info = ""

    def _line(self, end: str = "") -> None:
        import time

        elapsed = time.monotonic() - self._t0
        count = f"{self._done}/{self._total}" if self._total else f"{self._done}"
        left = ""
        if self._total and 0 < self._done < self._total and not end:
            left = f", ~{_clock(elapsed * (self._total - self._done) / self._done)} left"
        info = f" {self._info}" if self._info else ""
        print(f"{self._label}: {count}, {_clock(elapsed)}{left}{end}{info}", file=sys.stderr, flush=True)
        self._last = time.monotonic()

    def __enter__(self):
        import time

        self._t0 = self._last = time.monotonic()
        print(f"{self._label}: started" + (f", {self._total} to do" if self._total else ""),
              file=sys.stderr, flush=True)
        return self

    def advance(self, n: int = 1, **fields: Any) -> None:
        import time

        self._done += n
        if fields:
            self._info = " ".join(f"{k} {v}" for k, v in fields.items())
        if time.monotonic() - self._last >= self._every:
            self._line()

    def __exit__(self, *exc):
        if exc[0] is None:
            if self._total is None:  # work of unknown size, done: shown as such (the bar's rule)
                self._total = self._done = max(1, self._done)
            self._line(", done")
        return False
