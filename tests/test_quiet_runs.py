"""A build's output: DVC's advice and command lines hidden unless `-v`; which stage ran,
was cached or did not change, and DVC's errors, still shown."""

from __future__ import annotations

import logging

from pipeline.engine import build


def test_dvc_advice_is_hidden_and_its_errors_are_not(caplog):
    from dvc.ui import ui

    build.quiet_dvc()
    build.quiet_dvc()  # once per process: a second call changes nothing
    with caplog.at_level(logging.INFO, logger="dvc"):
        logging.getLogger("dvc.repo.scm_context").info("\nTo track the changes with git, run:\n\n%s", "git add dvc.lock")
        logging.getLogger("dvc.dvcfile").info("Updating lock file '%s'", "dvc.lock")
        run = logging.getLogger("dvc.stage.run")
        run.info("Running stage '%s':", "b--pack")
        run.info("%s %s", ">", "python -m pipeline.engine.run_stage pack --build b")
        logging.getLogger("dvc.stage").info("Stage '%s' didn't change, skipping", "b--export")
        logging.getLogger("dvc.repo.scm_context").error("failed to track %s", "dvc.lock")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Running stage 'b--pack':", "Stage 'b--export' didn't change, skipping",
                    "failed to track dvc.lock"], said
    import io

    buf = io.StringIO()
    ui.write("Use `dvc push` to send your updates to remote storage.", file=buf, force=True)
    ui.write("Data and pipelines are up to date.", file=buf, force=True)
    assert buf.getvalue() == "Data and pipelines are up to date.\n", buf.getvalue()


def test_verbose_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(build.VERBOSE_ENV, raising=False)
    assert not build.verbose()
    monkeypatch.setenv(build.VERBOSE_ENV, "1")
    assert build.verbose()
