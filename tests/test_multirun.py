"""Fleet builds end to end (`python -m pipeline -m ...`), in a throwaway copy of
the repository with the tiny model: a sweep over three device classes through
the joblib launcher with the shared cache on, one worker killed mid-stage,
the sweep re-run; the cache restored in a second clone; the same sweep through
a local Ray instance."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from pipeline.engine import cache_remote, manifest
from tests.conftest import FAST_RUN, TINY_MODEL, git, ran_stages, repo_copy, restored_stages, venv_env

pytestmark = pytest.mark.slow

DEVICES = ("x86_avx512", "x86_avx2", "xeon_amx")
BUILDS = [f"{d}-embedded-speed" for d in DEVICES]
# Fewer calibration windows and parity prompts than FAST_RUN: three builds must
# fit the test budget. The peers' baselines are off (no converter tree here).
LEAN = ["calibrate.samples=8", "calibrate.min_samples=8", "calibrate.seq_len=32",
        "parity.prompts=['The function returns','This module provides']", "parity.min_greedy_match=2",
        "benchmark.llamacpp=off", "benchmark.ortgenai=off"]
BUILD_ARGS = (*TINY_MODEL, *FAST_RUN, *LEAN)
SWEEP = ("-m", "device=" + ",".join(DEVICES), *BUILD_ARGS)
VICTIM, VICTIM_STAGE = "x86_avx2-embedded-speed", "export"


def fleet_env(**extra) -> dict:
    env = venv_env()
    env.update(extra)
    return env


def results(sweep_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep_dir.glob("*/edgekiln-result.json"))]


def own(ran: list[str]) -> list[str]:
    return [r for r in ran if not (r.startswith("probe--") or r.endswith("--probe"))]


def kill_tree(pid: int) -> list[int]:
    import psutil

    proc = psutil.Process(pid)
    victims = [proc, *proc.children(recursive=True)]
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in victims]


def worker_of(stage_pid: int, sweep_pid: int) -> int:
    """The launcher's worker process running this stage: its ancestor whose parent is the sweep."""
    import psutil

    proc = psutil.Process(stage_pid)
    while proc.ppid() != sweep_pid:
        proc = proc.parent()
        assert proc is not None, "the stage does not run under the sweep"
    return proc.pid


def visible_outputs(repo: Path) -> list[Path]:
    return [d for b in BUILDS for d in sorted((repo / "artifacts" / b).glob("*"))
            if d.is_dir() and not d.name.startswith(".")]


def locked_stages(repo: Path) -> set[str]:
    lock = repo / "dvc.lock"
    return set(yaml.safe_load(lock.read_text())["stages"]) if lock.exists() else set()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Repository A: sweep 1 (a worker killed mid-stage), then sweep 2 (the re-run)."""
    base = tmp_path_factory.mktemp("fleet")
    repo, store = repo_copy(base / "a"), base / "store"
    store.mkdir()
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "shared", str(store)], cwd=repo, check=True,
                   env=venv_env())
    env = fleet_env(**{cache_remote.ENV: "shared"})
    out1, err1 = base / "sweep1.out", base / "sweep1.err"
    t0 = time.monotonic()
    with open(out1, "w") as o, open(err1, "w") as e:
        sweep = subprocess.Popen([sys.executable, "-m", "pipeline", *SWEEP, f"hydra.sweep.dir={base / 'sweep1'}"],
                                 cwd=repo, stdout=o, stderr=e, env=env)
    killed, deadline = None, time.monotonic() + 600
    while sweep.poll() is None and time.monotonic() < deadline:
        tmp = list((repo / "artifacts" / VICTIM).glob(f".{VICTIM_STAGE}.tmp-*"))
        if tmp:
            stage_pid = int(tmp[0].name.rsplit("-", 1)[1])
            time.sleep(1.0)  # well inside the stage (it writes for seconds)
            killed = kill_tree(worker_of(stage_pid, sweep.pid))
            break
        time.sleep(0.05)
    rc1 = sweep.wait(timeout=600)
    t1 = time.monotonic()
    after_kill = {
        "outputs": visible_outputs(repo),
        "hidden": sorted(p.name for b in BUILDS for p in (repo / "artifacts" / b).glob(".*")),
        "locked": locked_stages(repo),
    }
    proc2 = subprocess.run([sys.executable, "-m", "pipeline", *SWEEP, f"hydra.sweep.dir={base / 'sweep2'}"],
                           cwd=repo, capture_output=True, text=True, env=env, timeout=900)
    t2 = time.monotonic()
    print(f"\nfleet: sweep with a worker killed {t1 - t0:.1f} s, re-run {t2 - t1:.1f} s")
    return {
        "repo": repo, "store": store, "base": base, "killed": killed, "rc1": rc1,
        "out1": out1.read_text(), "err1": err1.read_text(), "after_kill": after_kill, "proc2": proc2,
    }


def test_a_worker_killed_mid_stage_leaves_nothing_half_written(fleet):
    assert fleet["killed"], "the victim's stage never started:\n" + fleet["err1"][-3000:]
    assert fleet["rc1"] == 1, fleet["err1"][-3000:]
    # The summary table names what did not finish and why.
    assert "sweep:" in fleet["out1"] and "builds ok" in fleet["out1"], fleet["out1"][-3000:]
    assert VICTIM in fleet["out1"] and ("lost" in fleet["out1"] or "error" in fleet["out1"])
    victim_out = fleet["repo"] / "artifacts" / VICTIM / VICTIM_STAGE
    assert victim_out not in fleet["after_kill"]["outputs"]
    # Every output folder a reader can see is whole: its manifest re-hashes.
    for folder in fleet["after_kill"]["outputs"]:
        manifest.verify(folder)
    # What the killed stage had written is only in its hidden temporary folder.
    assert any(h.startswith(f".{VICTIM_STAGE}.tmp-") for h in fleet["after_kill"]["hidden"])


def test_rerunning_the_sweep_finishes_only_what_is_missing(fleet):
    proc = fleet["proc2"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = own(ran_stages(proc.stdout + proc.stderr))
    recorded = fleet["after_kill"]["locked"]
    assert f"{VICTIM}--{VICTIM_STAGE}" in ran, ran
    redone = sorted(set(ran) & recorded)
    assert not redone, f"stages DVC had recorded before the kill ran again: {redone}"
    assert not any(r.startswith("model--") for r in ran) or not any(
        s.startswith("model--") for s in recorded), "the shared model was retrained"
    # the killed stage's leftovers are cleaned by its next run
    assert not list((fleet["repo"] / "artifacts" / VICTIM).glob(".*"))


def test_three_device_classes_built_in_parallel_by_the_joblib_launcher(fleet):
    repo, proc = fleet["repo"], fleet["proc2"]
    assert "sweep: 3 of 3 builds ok" in proc.stdout, proc.stdout[-3000:]
    rows = results(fleet["base"] / "sweep2")
    assert sorted(r["build"] for r in rows) == sorted(BUILDS)
    assert all(r["status"] == "ok" and r["rc"] == 0 for r in rows), rows
    dvc_yaml = (repo / "dvc.yaml").read_text()
    for b in BUILDS:
        assert (repo / "builds" / f"{b}.yaml").is_file() and f"{b}--benchmark:" in dvc_yaml
        for stage in ("pack", "verify_parity", "benchmark"):
            manifest.verify(repo / "artifacts" / b / stage, expect_stage=stage)
    # The model was trained once for the three builds, over both sweeps.
    both = ran_stages(fleet["out1"] + fleet["err1"]) + ran_stages(proc.stdout + proc.stderr)
    assert sum(r.startswith("model--") for r in both) == 1, both
    # The builds ran side by side: stages of different builds overlapped in time,
    # in different worker processes of the launcher.
    spans = []
    for b in BUILDS:
        for m in (repo / "artifacts" / b).glob("*/manifest.json"):
            t = json.loads(m.read_text())["timings"]
            start = datetime.fromisoformat(t["started"]).timestamp()
            spans.append((b, start, start + t["seconds"]))
    overlapping = [(a[0], c[0]) for a in spans for c in spans if a[0] < c[0] and a[1] < c[2] and c[1] < a[2]]
    assert overlapping, "no two builds ever ran a stage at the same time"
    workers = {r["pid"] for r in results(fleet["base"] / "sweep1")} | {r["pid"] for r in rows}
    assert len(workers) >= 2


def test_the_shared_cache_restores_every_stage_in_a_second_clone(fleet, tmp_path):
    """Clone B (of A's commit: the same code), same DVC remote: the build A computed is restored, not run."""
    repo_b = tmp_path / "b"
    git(tmp_path, "clone", "-q", str(fleet["repo"]), str(repo_b))
    subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "shared", str(fleet["store"])], cwd=repo_b,
                   check=True, env=venv_env())
    proc = subprocess.run([sys.executable, "-m", "pipeline", "device=x86_avx512", *BUILD_ARGS], cwd=repo_b,
                          capture_output=True, text=True, timeout=900, env=fleet_env(**{cache_remote.ENV: "shared"}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert own(ran_stages(proc.stdout + proc.stderr)) == [], proc.stdout
    cached = restored_stages(proc.stdout + proc.stderr)
    assert any(s.startswith("model--") for s in cached) and any(s.endswith("--benchmark") for s in cached), proc.stderr
    a = fleet["repo"] / "artifacts" / "x86_avx512-embedded-speed" / "benchmark" / "manifest.json"
    b = repo_b / "artifacts" / "x86_avx512-embedded-speed" / "benchmark" / "manifest.json"
    assert b.read_bytes() == a.read_bytes()


def _ray_missing() -> str | None:
    try:
        import hydra_plugins.hydra_ray_launcher  # noqa: F401
        import ray  # noqa: F401
    except ImportError as e:
        return (f"Ray is not installed ({e.name}): `pip install -e '.[ray]'` (ray 2.60, ~70 MB with its "
                f"dependencies, kept out of the test extra) runs this test against a local Ray instance")
    return None


@pytest.mark.skipif(_ray_missing() is not None, reason=str(_ray_missing()))
def test_the_same_sweep_through_a_local_ray_instance(fleet, tmp_path):
    repo = fleet["repo"]
    env = fleet_env(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
    env.pop("RAY_ADDRESS", None)  # a local instance, never a cluster the environment points at
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", *SWEEP, "hydra/launcher=ray_cluster",
         "+hydra.launcher.ray.init._node_ip_address=127.0.0.1", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=repo, capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Started a local Ray instance" in out and "Ray Launcher is launching 3 jobs" in out, out[-4000:]
    rows = results(tmp_path / "sweep")
    assert sorted(r["build"] for r in rows) == sorted(BUILDS)
    assert all(r["status"] == "ok" and r.get("ray_node") for r in rows), rows
    # Each job ran in a Ray worker process (Ray prefixes their lines with the pid).
    assert all(f"pid={r['pid']})" in out for r in rows)
    # Everything was built by the sweeps before: no stage but the probes ran.
    ran = ran_stages(out)
    assert own(ran) == [] and any(r.endswith("--probe") for r in ran), ran  # the probes' lines were read
