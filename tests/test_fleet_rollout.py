"""Fleet rollouts end to end: the real rollout service (a process, on SQLite and PostgreSQL) and 200
real device agents (pipeline/fleet/agent.py, as threads) checking in over loopback, fetching from
an HTTP store in DVC's layout, running each version's health check and rolling themselves back.

What issue 43 asks to see: a good version reaches 100% through its stages; a bad one (its health
check fails on the device) is halted in its first stage with every device that took it back on the
previous version; the service SIGKILLed mid-rollout and started again on the same database goes on
with nothing lost; a wrong token and a tampered blob are refused by name.

The versions are small synthetic bundles (a blob and a health check script that prints the tokens
its version was built to give), not model builds: this is the rollout machinery at fleet scale.
A real build's health check in onnxruntime-genai alone is tests/test_genai_artifact.py's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the rollout service needs edgekiln[rollout] (fastapi, uvicorn, sqlalchemy)")

from pipeline.engine.manifest import content_hash  # noqa: E402
from pipeline.fleet import agent as ag  # noqa: E402
from pipeline.fleet import policy  # noqa: E402
from pipeline.fleet.rollout import Client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLEET = {"x86_avx512": 100, "galaxy_s25": 60, "arm64_cpu": 40}
GOOD = [11, 7, 42, 3]
HEALTH = "import json; print(json.dumps({'tokens': %s, 'decode_tok_s': None}))\n"


def make_version(store: Path, n: int, device: str, *, tokens=GOOD) -> tuple[str, dict]:
    """A version's blobs into the store (files/md5/xx/...) and its registry-style record (text, parsed)."""
    contents = {"pack/model.bin": secrets.token_bytes(2048) + f"{device} v{n}".encode(),
                "deploy_profile/health_check.py": (HEALTH % tokens).encode()}
    files = {}
    for rel, data in contents.items():
        md5 = hashlib.md5(data).hexdigest()
        blob = store / "files" / "md5" / md5[:2] / md5[2:]
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "md5": md5, "bytes": len(data)}
    record = {"format": "edgekiln-registry/1", "bundle_sha256": content_hash(files), "device": device, "model": "m",
              "version": f"v{n}", "files": files,
              "health": {"command": ["{python}", "-I", "-S", "deploy_profile/health_check.py"], "tokens": GOOD,
                         "decode_tok_s": None, "noise_floor": 0.08, "timeout_s": 60}}
    return json.dumps(record, indent=2, sort_keys=True) + "\n", record


class Service:
    """`python -m pipeline.fleet.rollout serve` as a process; kill() and start() again on the same database."""

    def __init__(self, db_url: str, work: Path):
        self.db_url, self.work, self.port, self.proc = db_url, work, 0, None
        self.token = secrets.token_urlsafe(16)

    def start(self) -> str:
        env = {**os.environ, "EDGEKILN_FLEET_ADMIN_TOKEN": self.token}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.fleet.rollout", "serve", "--db", self.db_url, "--port", str(self.port),
             "--tick", "0.3", "--interval", "60"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=open(self.work / "service.log", "a"), text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, f"the service did not start: {line!r}; log: {(self.work / 'service.log').read_text()[-2000:]}"
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = Client(self.url, self.token)
        return self.url

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture
def store(tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    handler = functools.partial(type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None}),
                                directory=str(folder))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _round(agents: list[ag.Agent]) -> list[dict]:
    def one(a):
        try:
            return a.step()
        except ag.AgentError as e:  # a refusal or a transfer error: the test looks at it
            return {"device_id": a.device_id, "error": str(e)}
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, agents))


def _status(svc: Service, rid: int) -> dict:
    return svc.client.call("GET", f"/v1/admin/rollouts/{rid}")


def _start(svc, device, target, baseline, stages):
    return svc.client.call("POST", "/v1/admin/rollouts", {
        "device_class": device, "model": "m", "target": target, "baseline": baseline,
        "stages": policy.stages_json(policy.parse_stages(stages)), "failure_threshold": 0.1, "min_reports": 3,
        "success_threshold": 0.9})["id"]


def test_200_devices_a_good_version_completes_a_bad_one_halts_and_the_service_survives_a_kill(
        fleet_db_url, store, tmp_path):
    folder, store_url = store
    svc = Service(fleet_db_url, tmp_path)
    svc.start()
    try:
        tokens = {}
        for device, n in FLEET.items():
            for d in svc.client.call("POST", "/v1/admin/devices", {"devices": [
                    {"device_id": f"{device}-{i:03d}", "device_class": device, "model": "m"} for i in range(n)]})["devices"]:
                tokens[d["device_id"]] = d["token"]
        assert len(tokens) == 200
        agents = {d: ag.Agent(service=svc.url, device_id=d, device_class=d.rsplit("-", 1)[0], model="m",
                              store=store_url, root=str(tmp_path / "devices" / d), token=t)
                  for d, t in tokens.items()}
        versions = {}

        def add(n, device, **kw):
            text, rec = make_version(folder, n, device, **kw)
            versions[(device, n)] = {**svc.client.call("POST", "/v1/admin/versions", {"record": text}), "rec": rec}
            return versions[(device, n)]["record_sha256"]

        def current(device):
            return {agents[d]._link("current") for d in agents if d.startswith(device)}

        # Every class on its v1 first (one stage of 100%).
        first = {dev: _start(svc, dev, add(1, dev), None, "100") for dev in FLEET}
        _round(list(agents.values()))
        assert {dev: _status(svc, rid)["state"] for dev, rid in first.items()} == dict.fromkeys(FLEET, "completed")
        v1 = {dev: versions[(dev, 1)]["bundle_sha256"] for dev in FLEET}
        assert all(current(dev) == {v1[dev]} for dev in FLEET)

        # x86: a good v2 in three stages; galaxy_s25: a bad v2 (its health check gives other tokens);
        # arm64_cpu: a good v2 the service is killed in the middle of.
        good = _start(svc, "x86_avx512", add(2, "x86_avx512"), versions[("x86_avx512", 1)]["record_sha256"],
                      "10:3,50,100")
        bad = _start(svc, "galaxy_s25", add(2, "galaxy_s25", tokens=[11, 7, 41, 3]),
                     versions[("galaxy_s25", 1)]["record_sha256"], "10:3,50,100")
        arm = _start(svc, "arm64_cpu", add(2, "arm64_cpu"), versions[("arm64_cpu", 1)]["record_sha256"], "25:3,100")
        bad_cutoff = _status(svc, bad)["cutoff"]
        took_bad = set()
        results = _round(list(agents.values()))
        took_bad |= {r["device_id"] for r in results if r.get("device_id", "").startswith("galaxy")
                     and (r.get("assigned") or {}).get("version") == "v2"}

        # Killed mid-rollout, started again on the same database and port: the same state, nothing lost.
        before = {rid: _status(svc, rid) for rid in (good, bad, arm)}
        svc.kill()
        svc.start()
        after = {rid: _status(svc, rid) for rid in (good, bad, arm)}
        for rid in before:
            keep = ("state", "stage", "cutoff", "stage_started_at", "decisions")
            assert {k: after[rid][k] for k in keep} == {k: before[rid][k] for k in keep}
            assert {k: after[rid]["counts"][k] for k in ("in_stage", "healthy", "failed")} == \
                {k: before[rid]["counts"][k] for k in ("in_stage", "healthy", "failed")}
        assert before[arm]["state"] == "running" and before[arm]["stage"] == 1  # stage 1 had passed before the kill

        for _ in range(8):
            if _status(svc, good)["state"] == "completed" and _status(svc, arm)["state"] == "completed":
                break
            results = _round(list(agents.values()))
            took_bad |= {r["device_id"] for r in results if r.get("device_id", "").startswith("galaxy")
                         and (r.get("assigned") or {}).get("version") == "v2"}
        _round(list(agents.values()))  # the halted class's devices check in once more

        g = _status(svc, good)
        assert g["state"] == "completed"
        assert [(d["action"], d["by"]) for d in g["decisions"]] == [
            ("start", "operator"), ("advance", "service"), ("advance", "service"), ("complete", "service")]
        assert current("x86_avx512") == {versions[("x86_avx512", 2)]["bundle_sha256"]}
        assert _status(svc, arm)["state"] == "completed"
        assert current("arm64_cpu") == {versions[("arm64_cpu", 2)]["bundle_sha256"]}

        b = _status(svc, bad)
        assert b["state"] == "halted" and b["stage"] == 0, b["decisions"]
        halt = b["decisions"][-1]
        assert halt["action"] == "halt" and halt["by"] == "service" and halt["numbers"]["failed"] >= 3
        assert halt["numbers"]["failure_rate"] > 0.1
        assert current("galaxy_s25") == {v1["galaxy_s25"]}            # every device back on (or still on) v1
        assert took_bad and all(policy.bucket(d) < bad_cutoff for d in took_bad)   # only the first stage took it
        assert len(took_bad) < FLEET["galaxy_s25"] * 0.5

        # Nothing lost: every report the agents sent is in the database.
        fleet = svc.client.call("GET", "/v1/fleet")
        by = {gr["device_class"]: gr["by_version"] for gr in fleet["groups"]}
        assert by["x86_avx512"]["v2"]["devices"] == 100 and by["x86_avx512"]["v2"]["health"] == {"healthy": 100}
        assert by["galaxy_s25"]["v1"]["devices"] == 60
        assert by["galaxy_s25"]["v1"]["health"].get("rolled_back") == len(took_bad)

        # A wrong token is refused by name; a tampered blob is refused by name, and halts its rollout.
        bogus = ag.Agent(service=svc.url, device_id="x86_avx512-000", device_class="x86_avx512", model="m",
                         store=store_url, root=str(tmp_path / "bogus"), token="not-the-token")
        with pytest.raises(ag.ServiceRefused, match="device x86_avx512-000: token refused"):
            bogus.step()
        t3 = add(3, "x86_avx512")
        blob = versions[("x86_avx512", 3)]["rec"]["files"]["pack/model.bin"]["md5"]
        (folder / "files" / "md5" / blob[:2] / blob[2:]).write_bytes(b"tampered on the store")
        tampered = _start(svc, "x86_avx512", t3, versions[("x86_avx512", 2)]["record_sha256"], "10:3,100")
        results = _round([a for d, a in agents.items() if d.startswith("x86")])
        refused = [r for r in results if (r.get("assigned") or {}).get("version") == "v3"]
        assert refused and all(r["outcome"] == "failed" and "pack/model.bin" in r["detail"]
                               and r["detail"].startswith("integrity") for r in refused)
        assert _status(svc, tampered)["state"] == "halted"
        assert current("x86_avx512") == {versions[("x86_avx512", 2)]["bundle_sha256"]}
    finally:
        svc.stop()
