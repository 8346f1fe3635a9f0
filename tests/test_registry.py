"""The artifact registry (pipeline/fleet/registry.py).

Fast: the gates (parity, speed against stable within the noise floor), channel
histories and rollback, the index and records, the CLI's exit codes and JSON,
on a registry written by hand in tmp_path.

Slow (end to end, through DVC, on a copy of the session's tiny build): publish
-> promote canary -> promote stable -> a regressed build refused (then forced
with a recorded reason) -> rollback -> pull on a fresh `git clone` with a
local-path DVC remote, plus `dvc repro --pull` there restoring every output
with no build stage run; a tampered or truncated blob on the remote refused at
pull, naming the file; a build without a passing parity report refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.fleet import registry as reg
from tests.conftest import git, ran_stages, run_cli, venv_env

BUILD = "x86_avx512-embedded-speed"
SLOW = "x86_avx512-embedded-slowcopy"
DEVICE = "x86_avx512"


# ---------------------------------------------------------------- fast: gates


def _parity_report(**over):
    r = {
        "passed": True,
        "metrics": {"logits_snr_db": 120.0, "top1_agreement": 1.0, "top5_agreement": 1.0, "greedy_match": 12},
        "thresholds": {"logits_snr_db": 60.0, "top1_agreement": 1.0, "top5_agreement": 0.95, "greedy_match": 12},
        "artifact": {"applies": True, "metrics": {"logits_snr_db": 50.0, "kl_nats": 0.01},
                     "thresholds": {"logits_snr_db": ">= 10", "kl_nats": "<= 0.25"}},
    }
    r.update(over)
    return r


def test_parity_gate_passes_a_passing_report():
    out = reg.parity_gate(_parity_report())
    assert out["passed"] is True and out["metrics"]["greedy_match"] == 12
    kld = _parity_report(artifact={"applies": True, "metrics": {"kl_nats": 0.01}, "kld": {"kld_mean": 0.1},
                                   "thresholds": {"kl_nats": "<= 0.25", "kld_mean": "<= 0.25"}})
    assert reg.parity_gate(kld)["passed"] is True


@pytest.mark.parametrize("report, words", [
    (None, "failed parity"),
    (_parity_report(passed=False), "passed"),
    (_parity_report(metrics={"logits_snr_db": 59.0, "top1_agreement": 1.0, "top5_agreement": 1.0,
                             "greedy_match": 12}), "logits_snr_db"),
    (_parity_report(artifact={"applies": True, "metrics": {"kl_nats": 0.5}, "thresholds": {"kl_nats": "<= 0.25"}}),
     "artifact kl_nats"),
    # the gates in llama.cpp's units read the artifact's evaluation statistics ("kld")
    (_parity_report(artifact={"applies": True, "metrics": {"kl_nats": 0.01}, "kld": {"kld_mean": 0.4},
                              "thresholds": {"kl_nats": "<= 0.25", "kld_mean": "<= 0.25"}}), "artifact kld_mean 0.4"),
])
def test_parity_gate_refuses(report, words):
    with pytest.raises(reg.GateRefused, match=words):
        reg.parity_gate(report)


def _bench(passes, floor=0.08, host="AMD EPYC"):
    return {"decode_tok_s_passes": passes, "decode_tok_s": reg.spread(passes), "noise_floor": floor,
            "on_target": True, "measured_on": host, "artifact_arm": "ort_int4"}


@pytest.mark.parametrize("cand, stable, refused, verdict", [
    ([100.0, 101.0, 99.0], None, False, "no current stable"),
    ([95.0, 96.0, 94.0], [100.0, 101.0, 99.0], False, "no difference"),   # -5%: inside the 8% floor
    ([80.0, 81.0, 79.0], [100.0, 101.0, 99.0], True, "worse"),            # -20%
    ([130.0, 131.0, 129.0], [100.0, 101.0, 99.0], False, "better"),
])
def test_stable_gate_uses_medians_and_the_noise_floor(cand, stable, refused, verdict):
    c = {"version": "v2", "benchmark": _bench(cand)}
    s = {"version": "v1", "benchmark": _bench(stable)} if stable else None
    out = reg.stable_gate(c, s)
    assert out["refused"] is refused and out["verdict"] == verdict


def test_stable_gate_uses_the_candidates_noise_floor_and_notes_other_hosts():
    c = {"version": "v2", "benchmark": _bench([85.0], floor=0.2, host="other")}
    out = reg.stable_gate(c, {"version": "v1", "benchmark": _bench([100.0])})
    assert out["refused"] is False and out["noise_floor"] == 0.2 and "different hosts" in out["note"]


def test_a_bundle_holds_the_stages_its_device_has():
    """A phone's bundle carries its context binaries (compile_qnn); a CPU build has no such stage."""
    phone, cpu = {"name": "galaxy_s25", "accelerator": "qnn_htp"}, {"name": "x86_avx512", "accelerator": "none"}
    assert reg.bundle_stages(phone) == reg.BUNDLE_STAGES
    assert reg.bundle_stages(cpu) == tuple(s for s in reg.BUNDLE_STAGES if s != "compile_qnn")


def test_channel_stack_replays_promotions_and_rollbacks():
    ch = {"history": [{"action": "publish", "version": "v1"}, {"action": "promote", "version": "v2"},
                      {"action": "promote", "version": "v3"}, {"action": "rollback", "version": "v2"},
                      {"action": "rollback", "version": "v1"}]}
    assert reg.channel_stack(ch) == ["v1"] and reg.channel_current(ch) == "v1"
    assert reg.channel_current({"history": []}) is None


# ---------------------------------------------------------------- fast: index on a hand-written registry


def _add_version(root: Path, passes: list[float], *, device=DEVICE, model="embedded", tag="a", parity=True,
                 toolchain=None) -> str:
    """Write a version record and its index entry as publish would (no DVC)."""
    files = {}
    for rel in ("pack/model.onnx", "pack/manifest.json", "benchmark/report.json"):
        data = f"{rel} {tag}".encode()
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "md5": hashlib.md5(data).hexdigest(),
                      "bytes": len(data)}
    index = reg.load_index(root)
    entry = index["devices"].setdefault(device, {}).setdefault(model, {"versions": [], "channels": {}})
    version = f"v{len(entry['versions']) + 1}"
    bundle = reg.bundle_sha256(files)
    record = {
        "format": reg.FORMAT, "bundle_sha256": bundle, "version": version, "build": f"build-{tag}",
        "device": device, "model": model, "published_at": "2026-01-01T00:00:00+00:00",
        "lineage": {"model": model, "model_id": f"{model}-x", "model_sha256": "m" * 64, "device_class": device,
                    "config_sha256": hashlib.sha256(tag.encode()).hexdigest(),
                    "toolchain": toolchain or {"onnxruntime": "1.32.0"},
                    "source_commit": "c" * 40, "source_dirty": False},
        "parity": {"passed": parity, "metrics": {"logits_snr_db": 120.0, "greedy_match": 12}},
        "benchmark": _bench(passes), "config": {"build": {"name": f"build-{tag}"}, "benchmark": {"passes": len(passes)}},
        "files": files,
    }
    (root / reg.VERSIONS).mkdir(parents=True, exist_ok=True)
    (root / reg.VERSIONS / f"{bundle}.json").write_text(json.dumps(record))
    entry["versions"].append({"version": version, "bundle_sha256": bundle, "build": f"build-{tag}",
                              "published_at": record["published_at"], "parity": {"logits_snr_db": 120.0},
                              "decode_tok_s": reg.spread(passes)})
    entry["channels"].setdefault("dev", {"history": []})["history"].append(
        {"action": "publish", "version": version, "at": "t", "by": "test"})
    reg.save_index(root, index)
    return version


def _cli(root: Path, *args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = reg.main(list(args), root=root)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def test_promotion_order_gates_force_and_rollback(tmp_path):
    v1 = _add_version(tmp_path, [100.0, 102.0, 98.0], tag="a")
    v2 = _add_version(tmp_path, [70.0, 71.0, 69.0], tag="b")      # 30% slower
    rc, _, err = _cli(tmp_path, "promote", DEVICE, v1, "stable")
    assert rc == 3 and "never on canary" in err
    assert _cli(tmp_path, "promote", DEVICE, v1, "canary")[0] == 0
    assert _cli(tmp_path, "promote", DEVICE, v1, "stable")[0] == 0
    assert _cli(tmp_path, "promote", DEVICE, v2, "canary")[0] == 0
    rc, _, err = _cli(tmp_path, "promote", DEVICE, v2, "stable")
    assert rc == 3 and "regresses against stable v1" in err and "noise floor" in err and len(err.splitlines()) == 1
    rc, _, err = _cli(tmp_path, "promote", DEVICE, v2, "stable", "--force")
    assert rc == 1 and "--reason" in err
    rc, out, _ = _cli(tmp_path, "promote", DEVICE, "canary", "stable", "--force", "--reason", "hotfix, speed later")
    assert rc == 0 and "FORCED" in out
    stable = reg.load_index(tmp_path)["devices"][DEVICE]["embedded"]["channels"]["stable"]
    assert stable["current"] == v2
    last = stable["history"][-1]
    assert last["reason"] == "hotfix, speed later" and last["gate"]["verdict"] == "worse" and last["forced"]
    rc, out, _ = _cli(tmp_path, "rollback", DEVICE, "stable")
    assert rc == 0 and f"{v2} -> {v1}" in out
    assert reg.load_index(tmp_path)["devices"][DEVICE]["embedded"]["channels"]["stable"]["current"] == v1
    rc, _, err = _cli(tmp_path, "rollback", DEVICE, "stable")
    assert rc == 1 and "no previous version" in err


def test_failed_parity_version_cannot_reach_any_channel(tmp_path):
    v = _add_version(tmp_path, [100.0], parity=False)
    rc, _, err = _cli(tmp_path, "promote", DEVICE, v, "canary", "--force", "--reason", "x")
    assert rc == 3 and "parity" in err


def test_list_show_diff_json_and_errors(tmp_path):
    v1 = _add_version(tmp_path, [100.0, 101.0], tag="a")
    v2 = _add_version(tmp_path, [150.0, 151.0], tag="b", toolchain={"onnxruntime": "1.33.0"})
    _add_version(tmp_path, [10.0], device="galaxy_s25", tag="c")
    rc, out, _ = _cli(tmp_path, "list", "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["device"], r["version"]) for r in rows] == [("galaxy_s25", "v1"), (DEVICE, v1), (DEVICE, v2)]
    assert rows[2]["channels"] == ["dev"]
    rc, out, _ = _cli(tmp_path, "show", DEVICE, "dev", "--json")
    assert rc == 0 and json.loads(out)["version"] == v2
    rc, out, _ = _cli(tmp_path, "diff", DEVICE, v1, v2, "--json")
    d = json.loads(out)
    assert d["toolchain"] == {"onnxruntime": ["1.32.0", "1.33.0"]}
    assert d["config"]["build.name"] == ["build-a", "build-b"] and d["speed"]["b_vs_a"]["verdict"] == "better"
    for args in (("show", DEVICE), ("show", DEVICE, v1), ("diff", DEVICE, v1, v2), ("list",)):
        rc, out, err = _cli(tmp_path, *args)
        assert rc == 0 and out and not err, args
    rc, _, err = _cli(tmp_path, "show", "nope")
    assert rc == 1 and err.startswith("error: no versions for device class 'nope'") and len(err.splitlines()) == 1
    rc, _, err = _cli(tmp_path, "show", DEVICE, "v9")
    assert rc == 1 and "no version 'v9'" in err
    rc, _, err = _cli(tmp_path, "promote", DEVICE, v1, "prod")
    assert rc == 2
    assert _cli(tmp_path, "--help")[0] == 0


def test_an_edited_record_is_refused(tmp_path):
    v = _add_version(tmp_path, [100.0])
    bundle = reg.load_index(tmp_path)["devices"][DEVICE]["embedded"]["versions"][0]["bundle_sha256"]
    path = tmp_path / reg.VERSIONS / f"{bundle}.json"
    rec = json.loads(path.read_text())
    rec["files"]["pack/model.onnx"]["sha256"] = "0" * 64
    path.write_text(json.dumps(rec))
    rc, _, err = _cli(tmp_path, "show", DEVICE, v)
    assert rc == 4 and "edited record" in err


# ---------------------------------------------------------------- slow: end to end through DVC


def _dvc(repo: Path, *args: str, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True,
                          env=venv_env(), timeout=timeout)


def _registry(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli(repo, *args, module="pipeline.fleet.registry", timeout=600)


def _slower_copy(repo: Path, src: str, dst: str, factor: float) -> None:
    """A second build whose benchmark is `factor` times the first's: a COPY of
    the finished build with its benchmark report (and manifest) rewritten, then
    recorded in dvc.lock with `dvc commit` (no stage runs). The regressed
    figures are derived, not measured: a real slower build would cost a second
    tiny build and its speed on a shared 2-core builder is not predictable."""
    from pipeline.engine import manifest

    art = repo / "artifacts"
    shutil.copytree(art / src, art / dst)
    cfg = yaml.safe_load((repo / "builds" / f"{src}.yaml").read_text())
    cfg["build"]["name"] = dst
    (repo / "builds" / f"{dst}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    bench = art / dst / "benchmark"
    report = json.loads((bench / "report.json").read_text())
    for p in report["passes"][report["artifact_arm"]]:
        p["decode_tok_s"] *= factor
    (bench / "report.json").write_text(json.dumps(report, indent=2))
    m = manifest.read(bench)
    m["result"]["metrics"]["decode_tok_s"] *= factor
    (bench / "manifest.json").unlink()
    manifest.write(bench, stage="benchmark", build=dst, key=m["key"], result=m["result"], timings=m["timings"])
    subprocess.run([sys.executable, "-m", "pipeline.engine.dvcgen"], cwd=repo, check=True, capture_output=True, env=venv_env())
    stages = [s for s in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"] if s.startswith(f"{dst}--")]
    proc = _dvc(repo, "commit", "-f", *stages)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _build_stages(repo: Path, build: str) -> list[str]:
    return [s for s in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"] if s.startswith(f"{build}--")]


def _commit(repo: Path, msg: str) -> None:
    git(repo, "add", "-A")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", msg)


@pytest.fixture(scope="module")
def fleet(built_repo, tmp_path_factory):
    """A private copy of the session's built repository (other tests keep
    using theirs) with a local-path DVC remote as its default."""
    src, _ = built_repo
    base = tmp_path_factory.mktemp("fleet")
    repo = base / "repo"
    shutil.copytree(src, repo, symlinks=True)
    remote = base / "remote"
    proc = _registry(repo, "remote", "add", "local", str(remote))
    assert proc.returncode == 0, proc.stderr
    _slower_copy(repo, BUILD, SLOW, 0.5)
    _commit(repo, "slower copy, remote")
    return repo, remote, base


def _record(repo: Path, version: str) -> dict:
    index = yaml.safe_load((repo / "registry/index.yaml").read_text())
    v = next(v for v in index["devices"][DEVICE]["embedded"]["versions"] if v["version"] == version)
    return json.loads((repo / "registry/versions" / f"{v['bundle_sha256']}.json").read_text())


@pytest.mark.slow
def test_publish_promote_refuse_rollback_and_pull_on_a_fresh_clone(fleet, genai_python):
    repo, remote, base = fleet
    t0 = time.perf_counter()
    proc = _registry(repo, "publish", BUILD)
    assert proc.returncode == 0, proc.stderr
    assert "as v1 on dev" in proc.stdout
    t_publish = time.perf_counter() - t0
    rec = _record(repo, "v1")
    assert rec["lineage"]["device_class"] == DEVICE and len(rec["lineage"]["model_sha256"]) == 64
    assert len(rec["bundle_sha256"]) == 64 and all(len(f["sha256"]) == 64 for f in rec["files"].values())
    assert {"pack/model.onnx", "deploy_profile/profile.json", "verify_parity/report.json",
            "benchmark/report.json", "pack/manifest.json", "deploy_profile/health_check.py"} <= set(rec["files"])
    # The health check the device's agent runs once the version is installed: the profile's command, the tokens
    # verify_parity recorded (16, fewer only at an end-of-sequence token), genai's decode speed where the
    # benchmark measured the target (this builder is another CPU class: then null), the build's noise floor.
    health = rec["health"]
    assert health["command"][0] == "{python}" and health["command"][1] == "deploy_profile/health_check.py"
    expect = json.loads((repo / "artifacts" / BUILD / "verify_parity" / "report.json").read_text())["health"]
    assert health["tokens"] == expect["tokens"] and health["prompt_ids"] == expect["prompt_ids"]
    eos = json.loads((repo / "artifacts" / BUILD / "pack" / "io.json").read_text())["eos_token_id"]
    assert len(health["tokens"]) == 16 or health["tokens"][-1] in eos, health["tokens"]
    assert health["noise_floor"] == 0.08 and health["timeout_s"] == 300
    bench = json.loads((repo / "artifacts" / BUILD / "benchmark" / "report.json").read_text())
    genai = [p["decode_tok_s"] for p in bench["passes"].get("ort_int4_genai", [])]
    if genai and bench["on_target"]:
        import statistics

        assert health["decode_tok_s"] == statistics.median(genai)
    else:
        assert health["decode_tok_s"] is None and health["decode_tok_s_from"].startswith("null: "), health
    # Blobs are on the remote, content-addressed; git holds no weights.
    onnx = rec["files"]["pack/model.onnx"]
    assert (remote / "files/md5" / onnx["md5"][:2] / onnx["md5"][2:]).is_file()
    assert not any(p.suffix in (".onnx", ".safetensors") for p in (repo / "registry").rglob("*"))
    # Republishing the same content is a no-op.
    again = _registry(repo, "publish", BUILD)
    assert again.returncode == 0 and "already published as v1" in again.stdout

    assert _registry(repo, "promote", DEVICE, "v1", "canary").returncode == 0
    assert _registry(repo, "promote", DEVICE, "v1", "stable").returncode == 0

    # The regressed build (half the decode speed) goes through dev and canary...
    assert _registry(repo, "publish", SLOW).returncode == 0
    assert _registry(repo, "promote", DEVICE, "v2", "canary").returncode == 0
    # ...and is refused on stable, in one line, exit 3.
    refused = _registry(repo, "promote", DEVICE, "v2", "stable")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "regresses against stable v1" in refused.stderr and "Traceback" not in refused.stderr
    # Forced with a recorded reason, then rolled back in one command.
    forced = _registry(repo, "promote", DEVICE, "v2", "stable", "--force", "--reason", "needs the tokenizer fix")
    assert forced.returncode == 0, forced.stderr
    rb = _registry(repo, "rollback", DEVICE, "stable")
    assert rb.returncode == 0 and "v2 -> v1" in rb.stdout, rb.stderr
    shown = json.loads(_registry(repo, "show", DEVICE, "--json").stdout)
    stable = shown["channels"]["stable"]
    assert stable["current"] == "v1" and stable["history"][1]["reason"] == "needs the tokenizer fix"
    assert shown["channels"]["canary"]["current"] == "v2"
    d = json.loads(_registry(repo, "diff", DEVICE, "v1", "v2", "--json").stdout)
    assert d["speed"]["b_vs_a"]["verdict"] == "worse" and d["config"]["build.name"] == [BUILD, SLOW]
    print(_registry(repo, "list").stdout)

    # A fresh clone with access to the remote: pull for the device class.
    _commit(repo, "publish + rollout")
    clone = base / "clone"
    git(base, "clone", "-q", str(repo), str(clone))
    t0 = time.perf_counter()
    pulled = _registry(clone, "pull", DEVICE, "--dest", str(base / "device"))
    t_pull = time.perf_counter() - t0
    assert pulled.returncode == 0, pulled.stderr
    release = json.loads((base / "device" / "RELEASE.json").read_text())
    assert release["version"] == "v1" and release["bundle_sha256"] == rec["bundle_sha256"]
    from pipeline.engine.manifest import verify

    assert reg.record_stages(rec) == ("pack", "deploy_profile", "verify_parity", "benchmark")  # a CPU: no compile_qnn
    for stage in reg.record_stages(rec):
        verify(base / "device" / stage, expect_stage=stage)
    assert not (base / "device" / "compile_qnn").exists()
    # The device runs what it pulled with onnxruntime-genai alone: the profile's own command, from its folder.
    on_device = json.loads((base / "device" / "deploy_profile" / "profile.json").read_text())["on_device"]
    assert on_device["runtime"] == "onnxruntime-genai" and on_device["needs_this_project"] is False
    py, _ = genai_python
    ran = subprocess.run(f"{py} -I {on_device['command'][len('python '):]}", shell=True, capture_output=True,
                         text=True, cwd=base / "device" / "deploy_profile", timeout=600)
    assert ran.returncode == 0 and ran.stdout.startswith("def read_file(path):"), ran.stderr[-2000:]
    # ...and the record's health check, from the version folder it pulled, as the agent runs it
    checked = subprocess.run([str(py) if a == "{python}" else a for a in health["command"]], capture_output=True,
                             text=True, cwd=base / "device", timeout=health["timeout_s"])
    assert checked.returncode == 0, checked.stderr[-2000:]
    said = json.loads(checked.stdout.strip().splitlines()[-1])
    assert said["tokens"] == health["tokens"] and said["decode_tok_s"] > 0, said
    pinned = _registry(clone, "pull", DEVICE, "--version", "v2", "--dest", str(base / "device-v2"))
    assert pinned.returncode == 0 and json.loads((base / "device-v2/RELEASE.json").read_text())["version"] == "v2"

    # ...and `dvc repro --pull` restores every output of the build without running a build stage.
    t0 = time.perf_counter()
    repro = _dvc(clone, "repro", "--pull", *_build_stages(clone, BUILD))
    t_repro = time.perf_counter() - t0
    assert repro.returncode == 0, repro.stdout + repro.stderr
    # Only the probes run (always: they record the host); every other output is pulled.
    assert all(r.startswith("probe--") or r.endswith("--probe") for r in ran_stages(repro.stdout)), repro.stdout
    for stage in ("untie_head", "calibrate", "quantize", "export", "pack", "deploy_profile", "verify_parity", "benchmark"):
        verify(clone / "artifacts" / BUILD / stage, expect_stage=stage)
    status = _dvc(clone, "status", *_build_stages(clone, BUILD))
    assert "changed" not in status.stdout.replace("always changed", ""), status.stdout
    print(f"publish {t_publish:.1f} s, pull {t_pull:.1f} s, dvc repro --pull {t_repro:.1f} s")


@pytest.mark.slow
def test_a_rollout_of_the_real_build_reaches_devices_running_genai_alone(fleet, genai_python, tmp_path):
    """The operator's commands and the device's agent on the real (tiny) build: `rollout start` through the
    registry's gates, three agents (`python -m pipeline.fleet.agent --once`, processes) fetching from the
    DVC remote itself, each running the record's health check with onnxruntime-genai alone."""
    pytest.importorskip("fastapi", reason="the rollout service needs edgekiln[rollout]")
    from tests.test_fleet_rollout import Service

    repo, remote, base = fleet
    for build in (BUILD, SLOW):   # published by the scenario above when it ran: a no-op then
        assert _registry(repo, "publish", build).returncode == 0
    good, slow = _version_of(repo, BUILD), _version_of(repo, SLOW)
    if json.loads(_registry(repo, "show", DEVICE, "--json").stdout)["channels"].get("stable", {}).get("current") != good:
        _registry(repo, "promote", DEVICE, good, "canary")
        assert _registry(repo, "promote", DEVICE, good, "stable").returncode == 0
    _registry(repo, "promote", DEVICE, slow, "canary")   # (already there after the scenario)
    py, _ = genai_python
    svc = Service(f"sqlite:///{tmp_path / 'fleet.db'}", tmp_path)
    svc.start()
    env = {**venv_env(), "EDGEKILN_FLEET_URL": svc.url, "EDGEKILN_FLEET_ADMIN_TOKEN": svc.token}

    def rollout(*args):
        return subprocess.run([sys.executable, "-m", "pipeline.fleet.rollout", *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=300)

    def agent(dev):
        (tmp_path / f"{dev}.token").write_text(tokens[dev] + "\n")
        return subprocess.run(
            [sys.executable, "-m", "pipeline.fleet.agent", "--service", svc.url, "--token-file",
             str(tmp_path / f"{dev}.token"), "--device-id", dev, "--device-class", DEVICE, "--model", "embedded",
             "--store", str(remote), "--root", str(tmp_path / "devices" / dev), "--python", str(py), "--once"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    try:
        enrolled = rollout("enroll", "edge-1", "edge-2", "edge-3", "--class", DEVICE, "--model", "embedded")
        assert enrolled.returncode == 0, enrolled.stderr
        tokens = dict(line.split() for line in enrolled.stdout.splitlines())
        # The slower copy is refused by the registry's speed gate before any device hears of it.
        refused = rollout("start", DEVICE, slow, "--stages", "100")
        assert refused.returncode == 3 and f"regresses against stable {good}" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) == 1
        assert json.loads(rollout("status", "--json").stdout) == []
        # The stable version to the three devices in one stage: each fetches it, checks it, reports.
        started = rollout("start", DEVICE, good, "--stages", "100")
        assert started.returncode == 0, started.stderr
        rid = int(re.search(r"rollout (\d+):", started.stdout).group(1))
        for r in [agent(d) for d in tokens]:
            assert r.returncode == 0, r.stdout + r.stderr
            assert f"running {good}" in r.stdout and "tokens match" in r.stdout, r.stdout
        st = json.loads(rollout("status", str(rid), "--json").stdout)
        assert st["state"] == "completed" and st["counts"]["healthy"] == 3, st
        bundle = _record(repo, good)["bundle_sha256"]
        for d in tokens:
            release = json.loads((tmp_path / "devices" / d / "current" / "RELEASE.json").read_text())
            assert release["bundle_sha256"] == bundle
        print(rollout("status").stdout)
    finally:
        svc.stop()


def _version_of(repo: Path, build: str) -> str:
    index = yaml.safe_load((repo / "registry/index.yaml").read_text())
    return next(v["version"] for v in index["devices"][DEVICE]["embedded"]["versions"] if v["build"] == build)


@pytest.mark.slow
def test_a_tampered_or_truncated_blob_is_refused_at_pull(fleet):
    repo, remote, base = fleet
    proc = _registry(repo, "publish", BUILD)   # v1 (or already published by the scenario)
    assert proc.returncode == 0, proc.stderr
    version = "v1"
    onnx = _record(repo, version)["files"]["pack/model.onnx"]
    blob = remote / "files/md5" / onnx["md5"][:2] / onnx["md5"][2:]
    original = blob.read_bytes()
    dest = base / "tampered-device"
    try:
        os.chmod(blob, 0o644)
        data = bytearray(original)
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        bad = _registry(repo, "pull", DEVICE, "--version", version, "--dest", str(dest))
        assert bad.returncode == 4, bad.stdout + bad.stderr
        assert "pack/model.onnx" in bad.stderr and "sha256" in bad.stderr and len(bad.stderr.splitlines()) == 1
        assert not dest.exists() and not list(base.glob(f".{dest.name}.pull-*"))
        blob.write_bytes(original[: len(original) // 3])
        bad = _registry(repo, "pull", DEVICE, "--version", version, "--dest", str(dest))
        assert bad.returncode == 4 and "pack/model.onnx" in bad.stderr and "truncated" in bad.stderr
        assert not dest.exists()
    finally:
        blob.write_bytes(original)
        os.chmod(blob, 0o444)
    ok = _registry(repo, "pull", DEVICE, "--version", version, "--dest", str(dest))
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
def test_a_build_without_a_passing_parity_report_is_not_published(fleet):
    repo, _, _ = fleet
    name = "x86_avx512-embedded-noparity"
    shutil.copytree(repo / "artifacts" / BUILD, repo / "artifacts" / name)
    shutil.rmtree(repo / "artifacts" / name / "verify_parity")   # what a failed parity stage leaves: nothing
    cfg = yaml.safe_load((repo / "builds" / f"{BUILD}.yaml").read_text())
    cfg["build"]["name"] = name
    (repo / "builds" / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    try:
        proc = _registry(repo, "publish", name)
        assert proc.returncode == 3 and "parity" in proc.stderr, proc.stdout + proc.stderr
        assert name not in (repo / "registry/index.yaml").read_text() if (repo / "registry/index.yaml").exists() else True
    finally:
        shutil.rmtree(repo / "artifacts" / name)
        (repo / "builds" / f"{name}.yaml").unlink()
