"""Stopping a build (docs/design.md, "Stopping a build"): a real build of the tiny
embedded model, in the shared repository copy, is sent SIGTERM, SIGINT or SIGHUP
(or SIGKILL) while its verify_parity stage runs and has begun writing its temporary
output; then no process of the build is left a few seconds later, nothing of the
stage is half-written, the build's last line names the signal and the stage, and
the same build run again completes. The same through `dvc repro`.

Each stop uses its own parity.decode_tokens, so that verify_parity must run (a
value DVC has seen, FAST_RUN's 24 included, would be restored from its run-cache)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST_RUN, TINY_MODEL, ran_stages, run_cli, variants, venv_env

pytestmark = pytest.mark.slow
BUILD = "stop-me"
ARGS = ("device=x86_avx512", f"build.name={BUILD}", *TINY_MODEL, *FAST_RUN)
STAGE = "verify_parity"
GONE_WITHIN = 10.0  # seconds after the driver's exit (the stage's grace is 5)


def build_processes(repo: Path) -> list[str]:
    """'pid: cmdline' of every process of a build in `repo`: its driver, DVC, its stages."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if cwd.startswith(str(repo)) or BUILD in cmd:
            found.append(f"{entry.name}: {cmd.strip()}")
    return found


def temp_outputs(repo: Path) -> list[str]:
    """The build's hidden stage folders: `.<stage>.tmp-<pid>` being written, `.<stage>.old-<pid>` aside."""
    folder = repo / "artifacts" / BUILD
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) if folder.exists() else []


def stage_writing(repo: Path) -> bool:
    """verify_parity's supervised worker runs and its temp folder exists."""
    worker = any("--supervised-by=" in p and f" {STAGE} --build {BUILD}" in p for p in build_processes(repo))
    return worker and any(n.startswith(f".{STAGE}.tmp-") for n in temp_outputs(repo))


def start(repo: Path, cmd: list[str], logs: Path) -> subprocess.Popen:
    """The command with its output in files (a pipe nobody reads until the end could fill and block it)."""
    logs.mkdir(parents=True, exist_ok=True)
    # DVC runs a stage's command through $SHELL -c: /bin/sh (dash on Debian, and CI's $SHELL) keeps
    # itself as the stage's parent instead of exec'ing the command, and dies at once of a SIGTERM or
    # SIGHUP sent to it, which once let the build's last line come before the stage's: the harder case.
    env = venv_env() | {"SHELL": "/bin/sh"}
    with open(logs / "out", "w") as out, open(logs / "err", "w") as err:
        proc = subprocess.Popen(cmd, cwd=repo, stdout=out, stderr=err, env=env)
    proc.logs = logs
    return proc


def stop_while_writing(repo: Path, proc: subprocess.Popen, sig: int) -> tuple[str, str, float]:
    """Send `sig` to `proc` once verify_parity writes; (stdout, stderr, seconds until no process of the build is left)."""
    deadline = time.monotonic() + 600
    while not stage_writing(repo):
        assert proc.poll() is None, "the build ended before verify_parity ran: " + (proc.logs / "err").read_text()
        assert time.monotonic() < deadline, "verify_parity never started"
        time.sleep(0.05)
    proc.send_signal(sig)
    sent = time.monotonic()
    proc.wait(timeout=120)
    left = build_processes(repo)
    while left and time.monotonic() - sent < GONE_WITHIN:
        time.sleep(0.1)
        left = build_processes(repo)
    gone = time.monotonic() - sent
    out, err = (proc.logs / "out").read_text(), (proc.logs / "err").read_text()
    assert left == [], f"left running {GONE_WITHIN} s after {signal.Signals(sig).name}: {left}\n{err}"
    return out, err, gone


def assert_nothing_half_written(repo: Path) -> None:
    assert temp_outputs(repo) == []
    folder = repo / "artifacts" / BUILD / STAGE
    if folder.exists():  # the previous whole output (DVC removes a stage's outputs before running it)
        from pipeline.engine import manifest

        manifest.verify(folder, expect_stage=STAGE)


def rerun_completes(repo: Path, *extra: str) -> None:
    proc = run_cli(repo, *ARGS, *extra)
    assert proc.returncode == 0, proc.stderr
    assert f"{BUILD}--{STAGE}" in ran_stages(proc.stdout + proc.stderr), proc.stderr
    assert temp_outputs(repo) == []
    m = json.loads((repo / "artifacts" / BUILD / STAGE / "manifest.json").read_text())
    assert m["stage"] == STAGE


@pytest.fixture(scope="module")
def stop_repo(built_repo):
    """The shared copy with the build `stop-me` done (the model it shares with the others already is)."""
    repo, _ = built_repo
    proc = run_cli(repo, *ARGS)
    assert proc.returncode == 0, proc.stderr
    return repo


# SIGHUP takes SIGTERM's path through the handler (SIGINT has its own: DVC ignores it); the sweep's and
# `dvc repro`'s SIGKILL take the killed driver's (the stage sees its parent gone): CI runs one of each path.
@pytest.mark.parametrize("sig, tokens", variants([(signal.SIGTERM, 20), (signal.SIGINT, 21), (signal.SIGHUP, 22)],
                                                 ("sigterm", "sigint"), "the build stopped by {}",
                                                 ids=["sigterm", "sigint", "sighup"]))
def test_a_signal_to_the_build_stops_its_stage_and_a_rerun_completes(stop_repo, tmp_path, sig, tokens):
    repo = stop_repo
    extra = (f"parity.decode_tokens={tokens}",)
    t0 = time.monotonic()
    proc = start(repo, [sys.executable, "-m", "pipeline", *ARGS, *extra], tmp_path)
    out, err, gone = stop_while_writing(repo, proc, sig)
    assert proc.returncode == 128 + sig, err
    name = signal.Signals(sig).name
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines[-1] == f"error: build {BUILD}: stopped by {name} during {STAGE}", err
    said = "interrupted" if sig == signal.SIGINT else f"stopped by {name}"
    assert f"error: {STAGE} [{BUILD}]: {said}; nothing was written" in lines, err
    assert "Traceback" not in err and "ERROR: failed to reproduce" not in err, err
    assert_nothing_half_written(repo)
    stopped = time.monotonic() - t0
    rerun_completes(repo, *extra)
    print(f"{name}: stopped and every process gone in {gone:.1f} s; stop + rerun {time.monotonic() - t0:.0f} s "
          f"(the stopped run {stopped:.0f} s)")


def test_a_killed_build_stops_its_stage_by_itself(stop_repo, tmp_path):
    """SIGKILL of the driver: nobody forwards anything; the stage sees its parent gone."""
    repo = stop_repo
    extra = ("parity.decode_tokens=23",)
    proc = start(repo, [sys.executable, "-m", "pipeline", *ARGS, *extra], tmp_path)
    out, err, gone = stop_while_writing(repo, proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert f"error: {STAGE} [{BUILD}]: stopped: its parent process is gone" in err, err
    assert "Traceback" not in err, err
    assert_nothing_half_written(repo)
    rerun_completes(repo, *extra)  # DVC's locks of the killed driver do not block it
    print(f"SIGKILL: the stage stopped by itself, every process gone in {gone:.1f} s")


@pytest.mark.parametrize("sig", variants([signal.SIGTERM, signal.SIGKILL], ("sigterm",), "dvc repro stopped by {}",
                                         ids=["sigterm", "sigkill"]))
def test_dvc_repro_stopped_stops_its_stage(stop_repo, tmp_path, sig):
    """Plain `dvc repro` of the build's stage: DVC dies of the signal (its own default),
    and the stage, its parent gone, stops and removes its temporary output."""
    repo = stop_repo
    import yaml

    path = repo / "builds" / f"{BUILD}.yaml"
    registered = path.read_text()
    # The registered build's parity.decode_tokens changed, as `python -m pipeline parity.decode_tokens=N` registers it.
    cfg = yaml.safe_load(registered)
    cfg["parity"]["decode_tokens"] = 28 if sig == signal.SIGTERM else 29
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        proc = start(repo, [sys.executable, "-m", "dvc", "repro", "--single-item", f"{BUILD}--{STAGE}"], tmp_path)
        out, err, gone = stop_while_writing(repo, proc, sig)
        assert proc.returncode == -sig
        assert f"error: {STAGE} [{BUILD}]: stopped: its parent process is gone" in err, err
        assert_nothing_half_written(repo)
        rerun = subprocess.run([sys.executable, "-m", "dvc", "repro", "--single-item", f"{BUILD}--{STAGE}"],
                               cwd=repo, capture_output=True, text=True, env=venv_env(), timeout=600)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert temp_outputs(repo) == []
        print(f"dvc repro, {signal.Signals(sig).name}: every process gone in {gone:.1f} s")
    finally:
        path.write_text(registered)


def sweep_results(sweep_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/edgekiln-result.json"))]


@pytest.mark.parametrize("sig, tokens", variants([(signal.SIGTERM, 26), (signal.SIGKILL, 27)], ("sigterm",),
                                                 "a sweep stopped by {}", ids=["sigterm", "sigkill"]))
def test_a_stopped_sweep_stops_its_workers_builds(stop_repo, tmp_path, sig, tokens):
    """A sweep of two builds, one per joblib worker process: SIGTERM to the sweep reaches
    both workers, which stop their builds as `python -m pipeline` does; a SIGKILLed
    sweep's workers see their launcher gone, stop their builds and exit."""
    repo = stop_repo
    other = f"{BUILD}-too"
    args = ("-m", "device=x86_avx512", f"build.name={BUILD},{other}", *TINY_MODEL, *FAST_RUN,
            f"parity.decode_tokens={tokens}")
    sweep_dir = tmp_path / "sweep"
    proc = start(repo, [sys.executable, "-m", "pipeline", *args, f"hydra.sweep.dir={sweep_dir}"], tmp_path / "logs")
    out, err, gone = stop_while_writing(repo, proc, sig)
    assert temp_outputs(repo) == [] and not list((repo / "artifacts" / other).glob(".*")), err
    results = {r["build"]: r for r in sweep_results(sweep_dir)}
    assert set(results) == {BUILD, other}, (results, err)
    assert all(r["status"] == "stopped" for r in results.values()), results
    assert results[BUILD]["detail"] == f"stopped by SIGTERM during {STAGE}", results
    assert len({r["pid"] for r in results.values()} | {proc.pid}) == 3  # two workers, not the launcher
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + sig, err
        assert err.splitlines()[-1].startswith("error: sweep: stopped by SIGTERM: "), err
        assert "sweep: 0 of 2 builds ok" in out, out  # the summary table still closes the run
    else:
        assert proc.returncode == -sig
    assert "Traceback" not in err, err
    rerun = run_cli(repo, *args, f"hydra.sweep.dir={tmp_path / 'rerun'}")
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "sweep: 2 of 2 builds ok" in rerun.stdout, rerun.stdout
    assert f"{BUILD}--{STAGE}" in ran_stages(rerun.stdout + rerun.stderr), rerun.stderr
    print(f"sweep, {signal.Signals(sig).name}: every process gone in {gone:.1f} s")
