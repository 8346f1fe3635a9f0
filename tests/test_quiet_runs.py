"""A build's output: one line per stage (ran, up to date, or restored from the run-cache,
with the time and peak memory of the run that made its output); DVC's advice, command
lines and narration hidden unless `-v`; DVC's warnings and errors still shown."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipeline.engine import narrate


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """quiet_dvc() changes this process's DVC (its loggers, Stage.reproduce, ui.write):
    undone after each test, so the other tests in this process see DVC as it is."""
    from dvc.stage import Stage
    from dvc.ui import ui

    monkeypatch.setattr(Stage, "reproduce", Stage.reproduce)
    monkeypatch.setattr(ui, "write", ui.write)
    loggers = [logging.getLogger(n) for n in ("dvc.repo.scm_context", "dvc.dvcfile", "dvc.stage.run", "dvc.stage",
                                              "dvc.stage.cache", "dvc.repo.reproduce")]
    for logger in loggers:
        monkeypatch.setattr(logger, "filters", list(logger.filters))
    levels = [logger.level for logger in loggers]
    narrate._HEARD.clear()
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)  # setLevel, not the attribute: it clears logging's enabled-for cache


def _output(tmp_path: Path, seconds: float, peak_mib: int, child_mib: int | None = None) -> Path:
    out = tmp_path / "artifacts" / "b" / "export"
    out.mkdir(parents=True)
    timings = {"started": "2026-12-04T03:10:00+00:00", "seconds": seconds, "peak_rss_bytes": peak_mib * 2**20}
    if child_mib is not None:
        timings["peak_rss_children_bytes"] = child_mib * 2**20
    (out / "manifest.json").write_text(json.dumps({"timings": timings}))
    return out


def test_dvc_narration_and_advice_are_hidden_and_its_errors_are_not(caplog):
    from dvc.ui import ui

    narrate.quiet_dvc(say=lambda line: None)
    narrate.quiet_dvc()  # once per process: a second call changes nothing
    with caplog.at_level(logging.INFO, logger="dvc"):
        logging.getLogger("dvc.repo.scm_context").info("\nTo track the changes with git, run:\n\n%s", "git add dvc.lock")
        logging.getLogger("dvc.dvcfile").info("Updating lock file '%s'", "dvc.lock")
        run = logging.getLogger("dvc.stage.run")
        run.info("Running stage '%s':", "b--pack")
        run.info("%s %s", ">", "python -m pipeline.engine.run_stage pack --build b")
        logging.getLogger("dvc.repo.reproduce").info("")
        logging.getLogger("dvc.stage").info("Stage '%s' didn't change, skipping", "b--export")
        logging.getLogger("dvc.stage.cache").info("Stage '%s' is cached - skipping run, checking out outputs", "b--x")
        logging.getLogger("dvc.stage").info("Pulling data for %s", "b--y")
        logging.getLogger("dvc.repo.scm_context").error("failed to track %s", "dvc.lock")
        logging.getLogger("dvc.stage.run").warning("Running stage '%s': %s", "b--z", "odd")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Pulling data for b--y", "failed to track dvc.lock", "Running stage 'b--z': odd"], said
    import io

    buf = io.StringIO()
    ui.write("Use `dvc push` to send your updates to remote storage.", file=buf, force=True)
    ui.write("Data and pipelines are up to date.", file=buf, force=True)
    assert buf.getvalue() == "Data and pipelines are up to date.\n", buf.getvalue()


def test_each_kind_of_stage_line_carries_the_runs_time_and_peak(tmp_path):
    out = _output(tmp_path, 27.84, 2162)
    assert narrate.ran_line("export [b]", out, root=tmp_path) == \
        "export [b]: ran in 27.8 s, peak 2,162 MiB -> artifacts/b/export"
    assert narrate.ran_line("export [b]", out, on="pi (arm64_cpu, Cortex-A76)", root=tmp_path) == \
        "export [b]: ran on pi (arm64_cpu, Cortex-A76) in 27.8 s, peak 2,162 MiB -> artifacts/b/export"
    assert narrate.kept_line("export [b]", "up to date", out).startswith(
        "export [b]: up to date (ran in 27.8 s, peak 2,162 MiB at 2026-12-04T03:10:00+00:00) -> ")
    assert narrate.ran_line("pack [b]", tmp_path / "absent", root=tmp_path) == "pack [b]: ran -> absent"


def test_a_subprocess_that_peaked_higher_than_the_stage_is_in_its_line(tmp_path):
    """The export traces its graphs in a child process (pipeline/engine/child.py): the stage's own
    peak alone would hide where its memory went."""
    out = _output(tmp_path, 27.84, 900, child_mib=9_876)
    assert narrate.ran_line("export [b]", out, root=tmp_path) == \
        "export [b]: ran in 27.8 s, peak 900 MiB, a subprocess 9,876 MiB -> artifacts/b/export"
    lower = _output(tmp_path / "lower", 27.84, 2162, child_mib=40)
    assert narrate.ran_line("export [b]", lower, root=tmp_path / "lower").endswith("peak 2,162 MiB -> artifacts/b/export")


def test_dvc_stage_names_read_as_labels():
    assert narrate.label_of("x86_avx512-embedded--pack") == "pack [x86_avx512-embedded]"
    assert narrate.label_of("model--embedded-0123456789abcdef") == "model [embedded-0123456789abcdef]"
    assert narrate.label_of("probe--embedded-0123456789abcdef") == "probe [embedded-0123456789abcdef]"
    assert narrate.label_of("b--probe") == "probe [b]"


def test_a_stage_dvc_did_not_run_says_so_once_its_output_is_in_place(tmp_path, caplog):
    """What DVC said of a stage it did not run becomes one line with the figures of the
    run that made its output, said after DVC's reproduce of it returns (Stage.reproduce wrapped)."""
    from dvc.stage import Stage

    narrate.quiet_dvc()
    assert Stage.reproduce.edgekiln_quiet
    out = _output(tmp_path, 5.4, 1947)

    class FakeStage:
        addressing = "b--export"
        outs = [type("Out", (), {"fs_path": str(out)})()]

    with caplog.at_level(logging.INFO, logger="dvc"):
        logging.getLogger("dvc.stage").info("Stage '%s' didn't change, skipping", "b--export")
    line = narrate.line_after(FakeStage())
    assert line.startswith("export [b]: up to date (ran in 5.4 s, peak 1,947 MiB at 2026-12-04T03:10:00"), line
    assert narrate.line_after(FakeStage()) is None  # said once
    with caplog.at_level(logging.INFO, logger="dvc"):
        logging.getLogger("dvc.stage.cache").info("Stage '%s' is cached - skipping run, checking out outputs",
                                                  "b--export")
    assert narrate.line_after(FakeStage()).startswith("export [b]: restored from the run-cache (ran in 5.4 s")
    with caplog.at_level(logging.INFO, logger="dvc"):
        logging.getLogger("dvc.stage.run").info("Running stage '%s':", "b--export")
    assert narrate.line_after(FakeStage()) is None  # it ran: the stage said its own line


def test_a_progress_bar_names_its_stage_and_ends_complete(capsys):
    """The bar's text is literal (as rich markup "[calibrate]" was taken for a style and the
    stage's name vanished), and work of unknown size ends as done, not "0/?"."""
    from pipeline.engine.context import StageContext

    ctx = StageContext.__new__(StageContext)
    ctx.stage = "calibrate"
    with ctx.progress(None, "the text {x}, tokenized [4, 1]"):
        pass
    with ctx.progress(3, "layers") as bar:
        for _ in range(3):
            bar.advance(loss=1.5)
    err = capsys.readouterr().err
    assert "[calibrate] the text {x}, tokenized [4, 1]" in err and "1/1" in err and "0/?" not in err
    assert "[calibrate] layers" in err and "3/3" in err and "loss 1.5" in err


def test_a_bar_in_a_log_file_says_how_far_it_is_every_so_often(capsys, monkeypatch):
    """Where stderr is not a terminal (a log file, CI, `nohup`), rich drew the bar only when it ended:
    a 20-minute calibration said nothing for 20 minutes. Plain lines: a start, one at most every
    EDGEKILN_PROGRESS_SECONDS with the count and the time left, and the end."""
    from pipeline.engine.context import StageContext

    ctx = StageContext.__new__(StageContext)
    ctx.stage = "calibrate"
    monkeypatch.setenv("EDGEKILN_PROGRESS_SECONDS", "0")
    with ctx.progress(4, "calibration, 2 layers x 2 samples") as bar:
        for _ in range(4):
            bar.advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[calibrate] calibration, 2 layers x 2 samples: started, 4 to do"
    assert [l.split(": ", 1)[1].split(",")[0] for l in lines[1:]] == ["1/4", "2/4", "3/4", "4/4", "4/4"]
    assert "left" in lines[1] and lines[-1].endswith(", done")
    monkeypatch.setenv("EDGEKILN_PROGRESS_SECONDS", "3600")  # within the interval: the start and the end only
    with ctx.progress(100, "steps") as bar:
        for _ in range(100):
            bar.advance()
    assert len(capsys.readouterr().err.splitlines()) == 2


@pytest.mark.parametrize("large", [False, True])
def test_large_inputs_and_outputs_are_hashed_under_a_bar(tmp_path, monkeypatch, capsys, large):
    """Re-hashing a stage's inputs against their manifests and hashing its output into its own
    took seconds that printed nothing (Gemma 3 270M's verify_parity reads ~4 GB): past
    HASH_BAR_BYTES each has a bar; a small folder has none."""
    from pipeline.engine import run_stage
    from tests.test_faults import fake_stage, good_run

    if large:
        monkeypatch.setattr(run_stage, "HASH_BAR_BYTES", 4096)  # good_run writes 8 KiB
    fake_stage(monkeypatch, tmp_path, good_run)
    run_stage.run("untie_head", "b")
    fake_stage(monkeypatch, tmp_path, lambda ctx: {"read": sorted(ctx.inputs)}, stage="export", inputs=("untie_head",))
    out = run_stage.run("export", "b")
    assert json.loads((out / "manifest.json").read_text())["result"] == {"read": ["untie_head"]}
    err = capsys.readouterr().err
    bars = ("[untie_head] the output hashed into its manifest", "[export] 1 input(s) re-hashed against their manifests")
    assert all((bar in err) is large for bar in bars), err
