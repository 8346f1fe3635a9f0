"""What a build prints: one line per stage, DVC's advice hidden unless asked.

Each stage of a `python -m pipeline` build says one line, in DVC's order:

    pack [b]: ran in 5.4 s, peak 1,947 MiB -> artifacts/b/pack
    export [b]: up to date (ran in 27.8 s, peak 2,162 MiB at 2026-12-04T03:10:00+00:00) -> artifacts/b/export
    quantize [b]: restored from the run-cache (ran in 95.6 s, peak 3,808 MiB at ...) -> artifacts/b/quantize

The stage prints the first kind itself (pipeline/engine/run_stage.py, also under a
plain `dvc repro`); the other two replace DVC's "Stage 'b--export' didn't change,
skipping" and "Stage 'b--quantize' is cached - skipping run, checking out outputs",
their figures read from the output's manifest (the run that made it). DVC's
"Running stage", its command lines, the blank line between stages and its advice
("git add dvc.lock", "dvc config core.autostage true", "Use `dvc push`") are shown
with `-v` (EDGEKILN_VERBOSE) only; every WARNING and ERROR always is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

VERBOSE_ENV = "EDGEKILN_VERBOSE"  # set by `python -m pipeline -v`


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def _timings(out: Path) -> dict:
    try:
        return json.loads((out / "manifest.json").read_text()).get("timings") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def figures(out: Path, on: str | None = None) -> str:
    """'ran [on HOST] in N s, peak M MiB' from the manifest in `out` (the run that made it), with
    ', a subprocess K MiB' where one the stage waited for peaked higher than the stage's own process
    (the export's graphs are traced in one: pipeline/engine/child.py)."""
    t = _timings(out)
    where = f" on {on}" if on else ""
    try:
        line = f"ran{where} in {t['seconds']:,.1f} s, peak {t['peak_rss_bytes'] / 2**20:,.0f} MiB"
    except (KeyError, TypeError):
        return f"ran{where}"
    kids = t.get("peak_rss_children_bytes")
    if isinstance(kids, (int, float)) and kids > t["peak_rss_bytes"]:
        line += f", a subprocess {kids / 2**20:,.0f} MiB"
    return line


def label(stage: str, owner: str) -> str:
    """`pack [b]`: the stage and the build (or shared model) it is of."""
    return f"{stage} [{owner}]"


def label_of(address: str) -> str:
    """dvc.yaml's stage name (`b--pack`, `model--<id>`, `probe--<id>`) as a label."""
    from pipeline.engine.layout import STAGES

    first, _, rest = address.partition("--")
    return label(first, rest) if first in STAGES else label(rest, first)


def _where(out: Path, root: Path | None = None) -> str:
    from pipeline.engine.layout import ROOT

    try:
        return str(out.resolve().relative_to((root or ROOT).resolve()))
    except ValueError:
        return str(out)


def ran_line(stage_label: str, out: Path, on: str | None = None, root: Path | None = None) -> str:
    """The line of a stage that ran (`on` a runner's device, or here) into `out`, under `root`."""
    return f"{stage_label}: {figures(out, on)} -> {_where(out, root)}"


def kept_line(stage_label: str, how: str, out: Path) -> str:
    """A stage DVC did not run: `how` it has its output, and the run that made it."""
    started = _timings(out).get("started")
    return f"{stage_label}: {how} ({figures(out)}{f' at {started}' if started else ''}) -> {_where(out)}"


# DVC's per-stage narration, by (logger, message format), and what it means.
_NARRATION = {
    ("dvc.stage.run", "Running stage '%s':"): "ran",  # the stage prints its own line
    ("dvc.stage", "Stage '%s' didn't change, skipping"): "up to date",
    ("dvc.stage.cache", "Stage '%s' is cached - skipping run, checking out outputs"): "restored from the run-cache",
}
# Loggers whose INFO is advice a user of this tool never acts on: "To track the
# changes with git, run: git add dvc.lock", "dvc config core.autostage true",
# "Updating lock file 'dvc.lock'".
_ADVICE = ("dvc.repo.scm_context", "dvc.dvcfile")


_HEARD: dict[str, str] = {}  # dvc.yaml stage name -> what DVC said of it, until its line is said
_KEPT = ("up to date", "restored from the run-cache")


class _Narration:
    """Drops DVC's per-stage INFO lines (noting what each said) and its command lines."""

    def __init__(self, logger: str):
        self.logger = logger

    def filter(self, record) -> bool:
        if record.levelno > 20:
            return True  # WARNING and ERROR always print
        how = _NARRATION.get((self.logger, record.msg))
        if how and record.args:
            _HEARD[str(record.args[0])] = how
            return False
        if record.msg == "%s %s" and record.args and record.args[0] == ">":
            return False  # "> python -m pipeline.engine.run_stage ...": the command line
        if self.logger == "dvc.repo.reproduce" and record.msg == "":
            return False  # the blank line DVC puts between stages
        return True


def line_after(stage) -> str | None:
    """The line for a DVC stage just reproduced that did not run (None when it ran:
    it said its own line), read from its output's manifest, now in place."""
    how = _HEARD.pop(stage.addressing, None)
    if how not in _KEPT or not stage.outs:
        return None
    return kept_line(label_of(stage.addressing), how, Path(stage.outs[0].fs_path))


def quiet_dvc(say=None) -> None:
    """One line per stage, DVC's advice hidden (shown with `-v`). Written by hand
    because DVC's own `-q` also hides its ERROR lines and has no per-stage summary:
    the advising loggers raised to WARNING, the narration filtered, and
    dvc.stage.Stage.reproduce wrapped so that a stage DVC did not run says so with
    its figures once its output is in place (a run-cache restore checks it out
    after DVC's line). The CLI's closing `ui.write("Use `dvc push` ...")` is dropped.
    Once per process."""
    import logging

    from dvc.stage import Stage
    from dvc.ui import ui

    if getattr(Stage.reproduce, "edgekiln_quiet", False):
        return
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    for name in _ADVICE:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("dvc.stage.run", "dvc.stage", "dvc.stage.cache", "dvc.repo.reproduce"):
        logging.getLogger(name).addFilter(_Narration(name))

    reproduce = Stage.reproduce

    def reproduce_and_say(self, *args, **kw):
        ret = reproduce(self, *args, **kw)
        line = None if kw.get("dry") else line_after(self)
        if line:
            say(line)
        return ret

    reproduce_and_say.edgekiln_quiet = True
    Stage.reproduce = reproduce_and_say

    write = ui.write

    def write_but_advice(*objects, **kw):
        if objects and isinstance(objects[0], str) and objects[0].startswith("Use `dvc push`"):
            return None
        return write(*objects, **kw)

    ui.write = write_but_advice
