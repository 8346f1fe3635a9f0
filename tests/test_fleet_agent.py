"""The device agent of fleet rollouts (pipeline/fleet/agent.py), against a fake rollout service.

Fast, and nothing of the project's build: a fake service (http.server on 127.0.0.1, port 0) that
assigns versions, serves their records and keeps every check-in; a store folder in DVC 3's md5 layout
holding a few small blobs per version; a health check script shipped in each version. Covered: a
full install, switch and healthy report; a second and third version (previous kept, older pruned,
the previous one switched back to without a fetch); a tampered, truncated or missing blob refused by
name with nothing switched; a record whose bytes are not the pinned sha256 (or that names another
bundle) refused; failing health checks (exit status, other tokens, too slow, timeout) rolled back and
reported; 401/403 -> exit 5 with the service's message; stores over HTTP, unsigned S3 (path-style)
and signed S3 against moto (skipped without it); SigV4 against AWS's published example; the lone
file under `python -I -S`; the bundle hash equal to pipeline's; a report kept across a lost
check-in, and a switch finished after the agent was killed during its health check; 200 agents as
threads in one process; the daemon loop's backoff.
"""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.engine.manifest import content_hash
from pipeline.fleet import agent as ag

ROOT = Path(__file__).resolve().parent.parent
DEV, TOKEN, OTHER_TOKEN = "phone-007", "tok-phone-007", "tok-phone-008"
TOKENS = [17, 4, 99, 250, 3, 3, 41, 8]

# The health check each version ships (deploy_profile/health_check.py): it does what the version's
# deploy_profile/behaviour.json says, and checks that it runs in the version folder named by {dir}.
HEALTH_PY = r'''
import json, os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
b = json.load(open(os.path.join(here, "behaviour.json")))
if sys.argv[1:] != ["--dir", os.getcwd()] or os.path.realpath(os.getcwd()) != os.path.realpath(os.path.dirname(here)):
    print(f"health_check: run from {os.getcwd()} with {sys.argv[1:]}", file=sys.stderr)
    sys.exit(2)
if "EDGEKILN_DEVICE_TOKEN" in os.environ or "AWS_SECRET_ACCESS_KEY" in os.environ:
    print("health_check: the agent passed its credentials on", file=sys.stderr)
    sys.exit(2)
marker = b.get("kill_agent_once")
if marker and not os.path.exists(marker):
    open(marker, "w").close()
    os.kill(os.getppid(), signal.SIGKILL)
time.sleep(b.get("sleep", 0))
print("loading pack/model.onnx")
if b.get("exit"):
    print("Traceback (most recent call last):", file=sys.stderr)
    print(b.get("stderr", "RuntimeError: boom"), file=sys.stderr)
    sys.exit(b["exit"])
if b.get("garbage"):
    print("done, no JSON today")
    sys.exit(0)
print(json.dumps({"tokens": b.get("tokens", %r), "decode_tok_s": b.get("decode_tok_s", 812.0)}))
print("   ")
''' % (TOKENS,)


def health_spec(**over) -> dict:
    spec = {"command": ["{python}", "deploy_profile/health_check.py", "--dir", "{dir}"], "tokens": TOKENS,
            "decode_tok_s": 800.0, "noise_floor": 0.08, "timeout_s": 30}
    spec.update(over)
    return spec


# ---------------------------------------------------------------- fakes


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 512  # 200 agents connect at once (socketserver's default backlog is 5; uvicorn's 2048)


class FakeService:
    """The rollout service's two device endpoints, as pipeline/fleet/service.py answers them."""

    def __init__(self):
        self.tokens = {TOKEN: DEV, OTHER_TOKEN: "phone-008"}
        self.records: dict[str, bytes] = {}
        self.assign: dict[str, dict | None] = {}
        self.default: dict | None = None
        self.rollout = {"id": 4, "stage": 1, "state": "running"}
        self.interval_s = 60
        self.checkins: list[dict] = []
        self.record_gets: list[str] = []
        self.fail_checkins: set[int] = set()  # 1-based numbers of check-ins answered 500
        self.on_checkin = None
        self.lock = threading.Lock()
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, msg: str):
                self._send(code, json.dumps({"error": msg}).encode())

            def _device(self) -> str | None:
                h = self.headers.get("Authorization") or ""
                return svc.tokens.get(h[7:]) if h.startswith("Bearer ") else None

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/v1/checkin":
                    return self._error(404, "no such endpoint")
                dev = self._device()
                if dev is None:
                    return self._error(401, f"device {body.get('device_id')}: token refused")
                if dev != body.get("device_id"):
                    return self._error(403, f"token of {dev}, checked in as {body.get('device_id')}")
                with svc.lock:
                    n = len(svc.checkins) + 1
                    if n in svc.fail_checkins:
                        svc.fail_checkins.discard(n)
                        svc.checkins.append({"failed": True, **body})
                        return self._error(500, "database is locked")
                    svc.checkins.append(body)
                    assigned = svc.assign.get(dev, svc.default)
                if svc.on_checkin:
                    svc.on_checkin(body)
                self._send(200, json.dumps({"assigned": assigned, "rollout": svc.rollout if assigned else None,
                                            "interval_s": svc.interval_s}).encode())

            def do_GET(self):
                if self._device() is None:
                    return self._error(401, "token refused")
                sha = self.path.rsplit("/", 1)[-1]
                with svc.lock:
                    svc.record_gets.append(sha)
                if not self.path.startswith("/v1/records/") or sha not in svc.records:
                    return self._error(404, f"no record {sha}")
                self._send(200, svc.records[sha])

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def reports(self) -> list[dict]:
        return [c["report"] for c in self.checkins if c.get("report") and not c.get("failed")]


def put_blob(store: Path, data: bytes) -> str:
    md5 = hashlib.md5(data).hexdigest()
    p = store / "files" / "md5" / md5[:2] / md5[2:]
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return md5


def blob_path(store: Path, md5: str) -> Path:
    return store / "files" / "md5" / md5[:2] / md5[2:]


class Fleet(SimpleNamespace):
    def version(self, name: str, *, health: dict | None | bool = True, behaviour: dict | None = None,
                extra: dict | None = None) -> dict:
        """A published version: blobs on the store, the record served by the service; the assignment."""
        files = {
            "pack/model.onnx": f"onnx weights of {name} ".encode() * 40,
            "pack/genai_config.json": json.dumps({"model": name}).encode(),
            "deploy_profile/profile.json": json.dumps({"runtime": "onnxruntime", "v": name}).encode(),
            "deploy_profile/behaviour.json": json.dumps(behaviour or {}).encode(),
            "deploy_profile/health_check.py": HEALTH_PY.encode(),
            "verify_parity/manifest.json": json.dumps({"stage": "verify_parity", "v": name}).encode(),
            **(extra or {}),
        }
        entries = {}
        for rel, data in files.items():
            entries[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "md5": put_blob(self.store, data),
                            "bytes": len(data)}
        record = {"format": "edgekiln-registry/1", "bundle_sha256": content_hash(entries), "version": name,
                  "device": "galaxy_s25", "model": "embedded", "build": f"galaxy_s25-embedded-{name}",
                  "files": entries}
        if health:
            record["health"] = health_spec() if health is True else health
        raw = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        rsha = hashlib.sha256(raw).hexdigest()
        self.service.records[rsha] = raw
        a = {"bundle_sha256": record["bundle_sha256"], "version": name, "record_sha256": rsha}
        self.records[name] = record
        return a

    def agent(self, **kw) -> ag.Agent:
        args = dict(service=self.service.url, token=TOKEN, device_id=DEV, device_class="galaxy_s25",
                    model="embedded", store=str(self.store), root=str(self.root))
        args.update(kw)
        return ag.Agent(**args)

    def cli(self, *extra: str, store: str | None = None) -> list[str]:
        return ["--service", self.service.url, "--device-id", DEV, "--device-class", "galaxy_s25",
                "--model", "embedded", "--store", store or str(self.store), "--root", str(self.root), *extra]

    def link(self, name: str) -> str | None:
        p = self.root / name
        return os.readlink(p) if os.path.islink(p) else None

    def state(self) -> dict:
        return json.loads((self.root / "agent.json").read_text())

    def installed(self) -> set[str]:
        return {p.name for p in (self.root / "versions").iterdir()}


@pytest.fixture
def fleet(tmp_path):
    service = FakeService()
    f = Fleet(service=service, store=tmp_path / "store", root=tmp_path / "device", tmp=tmp_path, records={})
    f.store.mkdir()
    yield f
    service.close()


def assert_no_leftovers(root: Path):
    left = [n for n in os.listdir(root) if n.startswith((".staging-", ".trash-")) or ".tmp-" in n]
    assert not left, left


# ---------------------------------------------------------------- stdlib only, and the same hash


def test_agent_imports_only_the_standard_library():
    tree = ast.parse(Path(ag.__file__).read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert mods - {"__future__"} <= set(sys.stdlib_module_names), mods - set(sys.stdlib_module_names)
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


def test_bundle_hash_equals_pipelines(tmp_path):
    from pipeline.fleet import registry

    for rel, data in {"pack/model.onnx": b"\x00\x01" * 999, "pack/sub/dir/x.bin": b"x",
                      "deploy_profile/profile.json": b'{"a": "\\u00e9"}', "deploy_profile/manifest.json": b"{}",
                      "verify_parity/report.json": b"[]", "benchmark/report.json": "é".encode()}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    files = registry.bundle_files(tmp_path)
    assert len(files) == 6
    assert ag.content_hash(files) == registry.bundle_sha256(files) == content_hash(files)
    assert ag.canonical_json(files) == json.dumps(files, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


# ---------------------------------------------------------------- install, switch, report


def test_install_switch_and_healthy_report(fleet):
    v1 = fleet.service.default = fleet.version("v1")
    res = fleet.agent().step()
    sha = v1["bundle_sha256"]
    assert res["installed"] and res["fetched_files"] == 6 and res["outcome"] == "healthy" and res["code"] == 0
    assert res["current"] == sha and res["reported"] is True
    assert fleet.link("current") == f"versions/{sha}" and fleet.link("previous") is None
    vdir = fleet.root / "versions" / sha
    assert (vdir / "pack/model.onnx").read_bytes() == b"onnx weights of v1 " * 40
    rel = json.loads((vdir / "RELEASE.json").read_text())
    assert {k: rel[k] for k in ("version", "bundle_sha256", "record_sha256")} == {
        "version": "v1", "bundle_sha256": sha, "record_sha256": v1["record_sha256"]}
    assert rel["installed_at"] and rel["health"]["tokens"] == TOKENS
    # two check-ins: the first with nothing running, the second delivering the report
    first, second = fleet.service.checkins
    assert first["current"] is None and first["report"] is None and first["agent"] == "edgekiln-agent/1"
    assert (first["device_id"], first["device_class"], first["model"]) == (DEV, "galaxy_s25", "embedded")
    rep = second["report"]
    assert second["current"] == sha and rep["bundle_sha256"] == sha and rep["outcome"] == "healthy"
    assert rep["decode_tok_s"] == 812.0 and rep["rolled_back_to"] is None
    assert dt.datetime.fromisoformat(rep["at"]).tzinfo is not None
    assert "8/8 tokens match" in rep["detail"] and "decode 812 tok/s (build 800, floor 8%)" in rep["detail"]
    assert res["line"] == (f"agent {DEV}: assigned v1 ({sha[:8]}) by rollout 4 stage 1; fetched 6 files, "
                           f"{ag._size(res['fetched_bytes'])}; health: 8/8 tokens match, decode 812 tok/s "
                           "(build 800, floor 8%); running v1; report delivered")
    assert fleet.state()["pending_report"] is None and fleet.state()["in_progress"] is None
    assert_no_leftovers(fleet.root)

    # again: up to date, nothing fetched, no report
    gets = len(fleet.service.record_gets)
    res = fleet.agent().step()
    assert res["outcome"] is None and not res["installed"] and len(fleet.service.record_gets) == gets
    assert fleet.service.checkins[-1]["report"] is None
    assert res["line"] == f"agent {DEV}: running v1 ({sha[:8]}); up to date"


def test_unchecked_without_a_health_spec_and_nothing_assigned(fleet):
    res = fleet.agent().step()
    assert res["checked_in"] and res["current"] is None and res["line"] == f"agent {DEV}: no version running; nothing assigned"
    v1 = fleet.service.default = fleet.version("v1", health=None)
    res = fleet.agent().step()
    assert res["outcome"] == "unchecked" and res["current"] == v1["bundle_sha256"]
    rep = fleet.service.reports()[-1]
    assert rep["outcome"] == "unchecked" and rep["detail"] == "no health check was recorded for this build"
    assert "health: not checked (no health check was recorded for this build)" in res["line"]


def test_second_version_keeps_the_previous_and_switches_back_without_fetching(fleet):
    v1 = fleet.service.default = fleet.version("v1")
    a = fleet.agent()
    a.step()
    v2 = fleet.service.default = fleet.version("v2")
    res = a.step()
    assert res["outcome"] == "healthy" and res["current"] == v2["bundle_sha256"]
    assert fleet.link("current") == f"versions/{v2['bundle_sha256']}"
    assert fleet.link("previous") == f"versions/{v1['bundle_sha256']}"
    assert fleet.service.checkins[-2]["current"] == v1["bundle_sha256"]  # checked in while on v1
    v3 = fleet.service.default = fleet.version("v3")
    a.step()
    assert fleet.installed() == {v3["bundle_sha256"], v2["bundle_sha256"]}  # v1 pruned
    # the service goes back to v2: a switch without a fetch, the health check run again
    fleet.service.default = v2
    gets = len(fleet.service.record_gets)
    res = a.step()
    assert not res["installed"] and res["outcome"] == "healthy" and len(fleet.service.record_gets) == gets
    assert "already installed, nothing fetched" in res["line"]
    assert fleet.link("current") == f"versions/{v2['bundle_sha256']}"
    assert fleet.link("previous") == f"versions/{v3['bundle_sha256']}"
    assert_no_leftovers(fleet.root)


# ---------------------------------------------------------------- integrity


@pytest.mark.parametrize("how", ["tampered", "truncated", "longer", "missing"])
def test_a_bad_blob_is_refused_by_name_and_nothing_switches(fleet, how, capsys):
    v1 = fleet.service.default = fleet.version("v1")
    fleet.agent().step()
    v2 = fleet.service.default = fleet.version("v2")
    meta = fleet.records["v2"]["files"]["pack/model.onnx"]
    blob = blob_path(fleet.store, meta["md5"])
    data = blob.read_bytes()
    if how == "tampered":
        blob.write_bytes(data[:-1] + b"X")
    elif how == "truncated":
        blob.write_bytes(data[:100])
    elif how == "longer":
        blob.write_bytes(data + b"more")
    else:
        blob.unlink()
    code = ag.main(fleet.cli("--token", TOKEN, "--once"))
    out = capsys.readouterr().out
    assert code == 4
    rep = fleet.service.reports()[-1]
    assert rep["outcome"] == "failed" and rep["bundle_sha256"] == v2["bundle_sha256"]
    assert rep["detail"].startswith("integrity: pack/model.onnx: ") and str(blob) in rep["detail"]
    words = {"tampered": f"sha256 {hashlib.sha256(data[:-1] + b'X').hexdigest()[:16]}... does not match the "
                         f"recorded {meta['sha256'][:16]}...",
             "truncated": f"100 bytes on the store, {meta['bytes']} recorded",
             "longer": f"more than the recorded {meta['bytes']} bytes",
             "missing": f"blob {blob} is not on the store"}[how]
    assert words in rep["detail"]
    assert f"refused v2: pack/model.onnx: {words}" in out and f"running v1 ({v1['bundle_sha256'][:8]})" in out
    assert fleet.link("current") == f"versions/{v1['bundle_sha256']}" and fleet.link("previous") is None
    assert fleet.installed() == {v1["bundle_sha256"]}
    assert_no_leftovers(fleet.root)


def test_a_record_that_is_not_the_pinned_one_is_refused(fleet):
    v1 = fleet.service.default = fleet.version("v1")
    fleet.agent().step()
    v2 = fleet.service.default = fleet.version("v2")
    raw = fleet.service.records[v2["record_sha256"]]
    fleet.service.records[v2["record_sha256"]] = raw.replace(b'"version": "v2"', b'"version": "v9"')
    res = fleet.agent().step()
    assert res["code"] == 4 and res["outcome"] == "failed"
    got = hashlib.sha256(fleet.service.records[v2["record_sha256"]]).hexdigest()
    assert res["detail"] == (f"integrity: record of v2: its bytes hash to {got[:16]}..., not the record_sha256 "
                             f"{v2['record_sha256'][:16]}... the service pinned")
    assert fleet.service.reports()[-1]["detail"] == res["detail"]
    assert res["current"] == v1["bundle_sha256"] and fleet.installed() == {v1["bundle_sha256"]}
    # a record pinned right that names another bundle (a service mix-up) is refused too
    v3 = fleet.version("v3")
    fleet.service.default = {**v3, "bundle_sha256": v2["bundle_sha256"]}
    res = fleet.agent().step()
    assert res["code"] == 4 and "names bundle" in res["detail"] and res["current"] == v1["bundle_sha256"]


def test_a_record_with_an_unsafe_path_is_refused(fleet):
    record = {"bundle_sha256": None, "version": "v1",
              "files": {"../../etc/cron.d/x": {"sha256": "0" * 64, "md5": "0" * 32, "bytes": 1}}}
    record["bundle_sha256"] = content_hash(record["files"])
    raw = json.dumps(record).encode()
    fleet.service.records[hashlib.sha256(raw).hexdigest()] = raw
    fleet.service.default = {"bundle_sha256": record["bundle_sha256"], "version": "v1",
                             "record_sha256": hashlib.sha256(raw).hexdigest()}
    res = fleet.agent().step()
    assert res["code"] == 4 and "unsafe file path '../../etc/cron.d/x'" in res["detail"]


# ---------------------------------------------------------------- health check and rollback


@pytest.mark.parametrize("case", ["exit", "tokens", "slow", "timeout", "garbage"])
def test_a_failing_health_check_rolls_back(fleet, case):
    v1 = fleet.service.default = fleet.version("v1")
    a = fleet.agent()
    a.step()
    behaviour, health = {
        "exit": ({"exit": 1, "stderr": "RuntimeError: QNN context binary rejected"}, health_spec()),
        "tokens": ({"tokens": TOKENS[:5] + [7] + TOKENS[6:]}, health_spec()),
        "slow": ({"decode_tok_s": 700.0}, health_spec()),  # floor: 800 x 0.92 = 736
        "timeout": ({"sleep": 30}, health_spec(timeout_s=0.5)),
        "garbage": ({"garbage": True}, health_spec()),
    }[case]
    v2 = fleet.service.default = fleet.version("v2", behaviour=behaviour, health=health)
    t0 = time.monotonic()
    res = a.step()
    assert time.monotonic() - t0 < 10
    detail = {
        "exit": "health: exit status 1: RuntimeError: QNN context binary rejected",
        "tokens": "health: tokens differ at position 5: recorded 3, got 7 (5/8 match before it)",
        "slow": "health: decode 700 tok/s below the floor 736 (build 800, floor 8%)",
        "timeout": "health: timed out after 0.5 s",
        "garbage": "health: the last stdout line is not the JSON",
    }[case]
    assert res["detail"].startswith(detail), res["detail"]
    assert res["outcome"] == "failed" and res["code"] == 3 and res["rolled_back_to"] == v1["bundle_sha256"]
    assert fleet.link("current") == f"versions/{v1['bundle_sha256']}" and fleet.link("previous") is None
    rep = fleet.service.reports()[-1]
    assert (rep["bundle_sha256"], rep["outcome"], rep["rolled_back_to"]) == (v2["bundle_sha256"], "failed",
                                                                           v1["bundle_sha256"])
    assert rep["detail"] == res["detail"] and fleet.service.checkins[-1]["current"] == v1["bundle_sha256"]
    assert fleet.installed() == {v1["bundle_sha256"]}
    assert f"rolled back to v1 ({v1['bundle_sha256'][:8]})" in res["line"]
    assert_no_leftovers(fleet.root)
    # still assigned: not fetched nor switched again (for an hour), nothing reported again
    gets, n = len(fleet.service.record_gets), len(fleet.service.reports())
    res = a.step()
    assert res["outcome"] == "held" and res["code"] == 0 and len(fleet.service.record_gets) == gets
    assert len(fleet.service.reports()) == n and res["current"] == v1["bundle_sha256"]
    assert "not tried again: it failed here" in res["line"]


def test_a_failing_first_version_leaves_nothing_running_and_is_retried_later(fleet):
    v1 = fleet.service.default = fleet.version("v1", behaviour={"exit": 3})
    res = fleet.agent(retry_failed_after_s=0).step()
    assert res["code"] == 3 and res["current"] is None and fleet.link("current") is None
    assert res["rolled_back_to"] is None and "no version to roll back to" in res["line"]
    assert fleet.installed() == set()
    res = fleet.agent(retry_failed_after_s=0).step()  # the hold is over: tried (and failing) again
    assert res["installed"] and res["code"] == 3 and fleet.service.reports()[-1]["bundle_sha256"] == v1["bundle_sha256"]


# ---------------------------------------------------------------- the service refuses


@pytest.mark.parametrize("token, status, words", [
    ("nope", 401, "device phone-007: token refused"),
    (OTHER_TOKEN, 403, "token of phone-008, checked in as phone-007"),
])
def test_refused_by_the_service_exits_5_with_its_message(fleet, token, status, words):
    fleet.service.default = fleet.version("v1")
    proc = subprocess.run([sys.executable, "-m", "pipeline.fleet.agent", *fleet.cli("--once")], cwd=ROOT,
                          env={**os.environ, "EDGEKILN_DEVICE_TOKEN": token}, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 5, proc.stderr
    assert proc.stderr.strip() == (f"error: agent: check-in: the service refused device {DEV} ({status}): {words}")
    assert proc.stdout == "" and not (fleet.root / "current").exists()


def test_cli_usage_and_token_file(fleet, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        ag.main(fleet.cli("--once"))  # no token anywhere
    assert e.value.code == 2 and "no device token" in capsys.readouterr().err
    tf = tmp_path / "token"
    tf.write_text(TOKEN + "\n")
    v1 = fleet.service.default = fleet.version("v1")
    assert ag.main(fleet.cli("--token-file", str(tf), "--once")) == 0
    assert "running v1; report delivered" in capsys.readouterr().out
    tf.write_text("rotated-and-wrong")  # re-read at each check-in
    assert ag.main(fleet.cli("--token-file", str(tf), "--once")) == 5
    assert fleet.link("current") == f"versions/{v1['bundle_sha256']}"
    assert ag.main(fleet.cli("--token", TOKEN, "--once", store="ftp://x/y")) == 1
    assert "unsupported scheme ftp://" in capsys.readouterr().err


# ---------------------------------------------------------------- stores


def _serve(directory: Path, seen: list | None = None):
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if seen is not None:
                seen.append((self.path, dict(self.headers)))
            super().do_GET()

    srv = _Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def test_http_store(fleet):
    v1 = fleet.service.default = fleet.version("v1")
    srv, url = _serve(fleet.store)
    try:
        res = fleet.agent(store=url + "/").step()
        assert res["outcome"] == "healthy" and res["current"] == v1["bundle_sha256"]
        v2 = fleet.service.default = fleet.version("v2")
        md5 = fleet.records["v2"]["files"]["deploy_profile/profile.json"]["md5"]
        blob_path(fleet.store, md5).unlink()
        res = fleet.agent(store=url).step()
        assert res["code"] == 4 and res["detail"] == (f"integrity: deploy_profile/profile.json: blob "
                                                      f"{url}/files/md5/{md5[:2]}/{md5[2:]} is not on the store")
        assert res["current"] == v1["bundle_sha256"] and v2["bundle_sha256"] not in fleet.installed()
    finally:
        srv.shutdown()
        srv.server_close()


def test_s3_store_unsigned_is_path_style_on_an_endpoint(fleet, tmp_path):
    v1 = fleet.service.default = fleet.version("v1")
    bucket = tmp_path / "s3" / "fleet-store" / "edge kiln"
    shutil.copytree(fleet.store, bucket)
    seen = []
    srv, url = _serve(tmp_path / "s3", seen)
    try:
        res = fleet.agent(store="s3://fleet-store/edge kiln", env={"AWS_ENDPOINT_URL": url}).step()
    finally:
        srv.shutdown()
        srv.server_close()
    assert res["outcome"] == "healthy" and res["current"] == v1["bundle_sha256"]
    assert len(seen) == 6 and all(p.startswith("/fleet-store/edge%20kiln/files/md5/") for p, _ in seen)
    assert not any("Authorization" in h for _, h in seen)
    store = ag.open_store("s3://b/p/", {"AWS_REGION": "eu-west-1"})
    assert store.http_url("ab" * 16) == f"https://b.s3.eu-west-1.amazonaws.com/p/files/md5/ab/{'ab' * 15}"
    assert ag.open_store("s3://my.bucket", {}).http_url("ab" * 16).startswith(
        "https://s3.us-east-1.amazonaws.com/my.bucket/files/md5/ab/")


def test_sigv4_matches_awss_published_example():
    # docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html, "Example: GET Object"
    h = ag.sigv4_headers("GET", "https://examplebucket.s3.amazonaws.com/test.txt", region="us-east-1",
                         access_key="AKIAIOSFODNN7EXAMPLE", secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                         headers={"Range": "bytes=0-9"}, now=dt.datetime(2013, 5, 24, tzinfo=dt.timezone.utc))
    assert h["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
    assert h["Host"] == "examplebucket.s3.amazonaws.com" and h["x-amz-date"] == "20130524T000000Z"


@pytest.mark.skipif(importlib.util.find_spec("botocore") is None, reason="botocore not installed (comes with moto)")
def test_sigv4_matches_botocore_with_a_session_token():
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    url = "http://127.0.0.1:9000/fleet-store/edge%20kiln/files/md5/ab/cdef?versionId=3&a=b"
    req = AWSRequest(method="GET", url=url, headers={"x-amz-content-sha256": ag.EMPTY_SHA256})
    S3SigV4Auth(Credentials("AK", "SK", "SESSION"), "s3", "eu-west-1").add_auth(req)
    now = dt.datetime.strptime(req.headers["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    mine = ag.sigv4_headers("GET", url, region="eu-west-1", access_key="AK", secret_key="SK",
                            session_token="SESSION", now=now)
    assert mine["Authorization"] == req.headers["Authorization"]


@pytest.fixture
def moto_s3(fleet):
    """moto's S3 server on 127.0.0.1 (in a thread), with signature checking on: an IAM user that may
    GetObject, the store's blobs uploaded with boto3 under s3://fleet-store/edgekiln."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"

    def auth(count: str):
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=count.encode(),
                                                      headers={"Content-Type": "text/plain"}, method="POST"),
                               timeout=10).read()

    try:
        kw = dict(endpoint_url=endpoint, region_name="eu-west-1", aws_access_key_id="admin",
                  aws_secret_access_key="admin")
        iam = boto3.client("iam", **kw)
        iam.create_user(UserName="device")
        key = iam.create_access_key(UserName="device")["AccessKey"]
        iam.put_user_policy(UserName="device", PolicyName="read", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}))
        s3 = boto3.client("s3", **kw)
        s3.create_bucket(Bucket="fleet-store", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})

        def upload():
            for p in sorted((fleet.store / "files").rglob("*")):
                if p.is_file():
                    s3.put_object(Bucket="fleet-store", Key=f"edgekiln/{p.relative_to(fleet.store).as_posix()}",
                                  Body=p.read_bytes())

        yield SimpleNamespace(endpoint=endpoint, key=key, upload=upload, auth=auth)
    finally:
        with contextlib.suppress(Exception):
            auth("inf")
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"),
                                   timeout=10).read()
        server.stop()


@pytest.mark.skipif(importlib.util.find_spec("moto") is None or importlib.util.find_spec("boto3") is None,
                    reason="moto[server] not installed: the S3 store against a real S3 implementation "
                           "(pip install 'moto[server]': ~15 s, ~145 MB with boto3/botocore)")
def test_s3_store_signed_against_moto(fleet, moto_s3):
    v1 = fleet.service.default = fleet.version("v1")
    moto_s3.upload()
    moto_s3.auth("0")  # from here on moto checks every request's signature and the user's policy
    env = {"AWS_ACCESS_KEY_ID": moto_s3.key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": moto_s3.key["SecretAccessKey"],
           "AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": moto_s3.endpoint}
    res = fleet.agent(store="s3://fleet-store/edgekiln", env=env).step()
    assert res["outcome"] == "healthy" and res["current"] == v1["bundle_sha256"] and res["fetched_files"] == 6
    # a wrong secret: S3 refuses the signature, the agent says so and switches nothing
    fleet.service.default = fleet.version("v2")
    moto_s3.auth("inf")
    moto_s3.upload()
    moto_s3.auth("0")
    with pytest.raises(ag.AgentError, match=r"store: GET s3://fleet-store/edgekiln/files/md5/.*: HTTP 403: "
                                            r"SignatureDoesNotMatch"):
        fleet.agent(store="s3://fleet-store/edgekiln", env={**env, "AWS_SECRET_ACCESS_KEY": "wrong"}).step()
    assert fleet.link("current") == f"versions/{v1['bundle_sha256']}"
    assert_no_leftovers(fleet.root)


# ---------------------------------------------------------------- the lone file


def _python39() -> str | None:
    """A Python 3.9 (the oldest the agent supports), if this machine has one."""
    found = [shutil.which("python3.9")] + sorted(
        str(p) for p in Path(os.environ.get("PYENV_ROOT", "~/.pyenv")).expanduser().glob("versions/3.9*/bin/python"))
    for exe in filter(None, found):
        try:
            if subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 9)"],
                              capture_output=True, timeout=20).returncode == 0:
                return exe
        except (OSError, subprocess.SubprocessError):
            pass
    return None


@pytest.mark.parametrize("python", ["this", "3.9"])
def test_the_lone_file_runs_isolated_without_site_packages(fleet, tmp_path, python):
    exe = sys.executable if python == "this" else _python39()
    if exe is None:
        pytest.skip("no Python 3.9 on this machine (python3.9 on PATH or under pyenv): the oldest the agent supports")
    v1 = fleet.service.default = fleet.version("v1")
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ag.__file__, alone / "agent.py")
    proc = subprocess.run([exe, "-I", "-S", "agent.py", *fleet.cli(
        "--token", TOKEN, "--once", store=(fleet.store).as_uri())], cwd=alone, capture_output=True, text=True,
        timeout=60, env={"PATH": os.environ.get("PATH", "")})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"agent {DEV}: assigned v1 ({v1['bundle_sha256'][:8]}) by rollout 4 stage 1; "
                                  "fetched 6 files") and proc.stdout.rstrip().endswith("running v1; report delivered")
    assert fleet.service.reports()[-1]["outcome"] == "healthy" and os.listdir(alone) == ["agent.py"]


# ---------------------------------------------------------------- nothing lost


def test_the_pending_report_survives_a_lost_check_in(fleet):
    v1 = fleet.service.default = fleet.version("v1")
    fleet.service.fail_checkins = {2}  # the check-in that delivers the report
    res = fleet.agent().step()
    assert res["outcome"] == "healthy" and res["reported"] is False and res["current"] == v1["bundle_sha256"]
    assert "report kept for the next check-in (check-in: HTTP 500" in res["line"] and "database is locked" in res["line"]
    pending = fleet.state()["pending_report"]
    assert pending["outcome"] == "healthy" and pending["bundle_sha256"] == v1["bundle_sha256"]
    assert fleet.service.reports() == []
    # a new agent (the old one died) delivers it with its first check-in
    res = fleet.agent().step()
    assert fleet.service.reports() == [pending] and fleet.state()["pending_report"] is None
    assert res["line"] == (f"agent {DEV}: delivered the report kept from before (healthy on "
                           f"{v1['bundle_sha256'][:8]}); running v1 ({v1['bundle_sha256'][:8]}); up to date")


def test_a_switch_interrupted_by_a_killed_agent_is_finished_on_the_next_start(fleet, tmp_path):
    v1 = fleet.service.default = fleet.version("v1")
    fleet.agent().step()
    marker = tmp_path / "killed-once"
    v2 = fleet.service.default = fleet.version("v2", behaviour={"kill_agent_once": str(marker)})
    proc = subprocess.run([sys.executable, ag.__file__, *fleet.cli("--once")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EDGEKILN_DEVICE_TOKEN": TOKEN,
                                           "AWS_SECRET_ACCESS_KEY": "not for the health check"})
    assert proc.returncode == -9 and marker.exists()  # SIGKILLed by the health check, mid-switch
    assert fleet.link("current") == f"versions/{v2['bundle_sha256']}"
    assert fleet.state()["in_progress"]["bundle_sha256"] == v2["bundle_sha256"]
    n = len(fleet.service.reports())
    with pytest.MonkeyPatch.context() as mp:  # the credentials stay out of the health check here too
        mp.setenv("EDGEKILN_DEVICE_TOKEN", TOKEN)
        res = fleet.agent().step()
    assert res["resumed"] == v2["bundle_sha256"] and res["outcome"] == "healthy" and res["reported"] is True
    assert fleet.service.reports()[n:][0]["bundle_sha256"] == v2["bundle_sha256"]
    assert fleet.link("previous") == f"versions/{v1['bundle_sha256']}"
    assert res["line"].startswith(f"agent {DEV}: finished the interrupted switch to v2 ({v2['bundle_sha256'][:8]}); "
                                  "health: 8/8 tokens match")
    assert fleet.state()["in_progress"] is None


def test_an_unreadable_state_file_is_kept_aside(fleet):
    v1 = fleet.service.default = fleet.version("v1", health=None)
    fleet.root.mkdir()
    (fleet.root / "agent.json").write_text("{half a file")
    res = fleet.agent().step()
    assert res["current"] == v1["bundle_sha256"] and res["line"].startswith(f"agent {DEV}: agent.json unreadable (")
    assert len(list(fleet.root.glob("agent.json.corrupt-*"))) == 1 and fleet.state()["pending_report"] is None


def test_one_agent_per_root(fleet):
    fleet.service.default = fleet.version("v1")
    (fleet.root / "versions").mkdir(parents=True)
    import fcntl

    with open(fleet.root / ".agent.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(ag.AgentError, match="another agent is working in"):
            fleet.agent().step()
    assert fleet.agent().step()["outcome"] == "healthy"


# ---------------------------------------------------------------- many agents, the loop


def test_200_agents_as_threads(fleet):
    n = 200
    for i in range(n):
        fleet.service.tokens[f"tok-{i}"] = f"dev-{i}"
    v1 = fleet.service.default = fleet.version("v1", health=None)
    agents = [fleet.agent(token=f"tok-{i}", device_id=f"dev-{i}", root=str(fleet.tmp / "fleet" / f"dev-{i}"))
              for i in range(n)]
    results, errors = [None] * n, []

    def go(i):
        try:
            results[i] = agents[i].step()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert all(r["outcome"] == "unchecked" and r["current"] == v1["bundle_sha256"] for r in results)
    assert sorted(c["device_id"] for c in fleet.service.checkins if c["report"]) == sorted(f"dev-{i}" for i in range(n))
    assert len(fleet.service.checkins) == 2 * n


def test_the_loop_logs_a_failed_check_in_and_retries(fleet):
    v1 = fleet.service.default = fleet.version("v1", health=None)
    fleet.service.fail_checkins = {1}
    stop = threading.Event()
    fleet.service.on_checkin = lambda body: stop.set() if body.get("report") else None
    out, err = _Lines(), _Lines()
    t = threading.Thread(target=lambda: ag.run(fleet.agent(), interval=0.05, stdout=out, stderr=err, stop=stop,
                                               backoff_s=0.01))
    t.start()
    t.join(20)
    assert not t.is_alive()
    assert err.text.startswith("error: agent: check-in: HTTP 500 from ") and "retrying in 0 s" in err.text
    assert "Traceback" not in err.text + out.text
    assert out.text.startswith(f"agent {DEV}: assigned v1") and fleet.link("current") == f"versions/{v1['bundle_sha256']}"


class _Lines:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass
