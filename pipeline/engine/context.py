"""What a stage's `run` receives: its declared config, its inputs, its output folder.

The contract every `stages/<name>.py` follows:

    READS = ("model", "export")   # top-level config sections it reads
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

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


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

    def log(self, message: str) -> None:
        print(f"[{self.stage}] {message}", file=sys.stderr, flush=True)

    def progress(self, total: int | None, description: str):
        """A progress bar on stderr for work that takes more than a few seconds."""
        return progress_bar(self.stage, total, description)


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
            console=Console(stderr=True),
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
