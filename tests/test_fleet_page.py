"""pipeline/fleet/page.py: the rollout service's fleet page, from a hand-made dict and in a real browser.

The browser tests start the real service (`python -m pipeline.fleet.rollout serve`, a
temporary SQLite database), enroll devices, run rollouts by checking devices in the way
pipeline/fleet/agent.py does, and load `GET /` in Debian's headless Chromium
(/usr/bin/chromium) driven by Playwright: Playwright's own browsers are never downloaded.

EDGEKILN_SCREENSHOT=1 also builds a realistic fleet (3 device classes, 60 devices: one
rollout completed, one halted, one running at stage 2) and saves docs/img/fleet-page.png.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pipeline.fleet import page, policy
from tests.conftest import ROOT, venv_env

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT = ROOT / "docs" / "img" / "fleet-page.png"
ADMIN = "test-admin-token"
EVIL = '<script>window.__pwned=1</script>"&\''


def _browser_missing() -> str | None:
    if not CHROMIUM.is_file():
        return f"no {CHROMIUM}: the fleet page's browser test drives Debian's chromium (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]'): it drives /usr/bin/chromium, downloads none"
    for mod in ("fastapi", "uvicorn"):
        try:
            __import__(mod)
        except ImportError:
            return f"{mod} is not installed: the rollout service needs it"
    return None


needs_browser = pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing()))


# ---------------------------------------------------------------- render() on hand-made dicts


AT = "2026-12-05T10:00:00.000+00:00"


def _rollout(**over) -> dict:
    ro = {"id": 3, "device_class": "galaxy_s25", "model": "embedded", "channel": "stable", "state": "halted",
          "stage": 0, "stage_started_at": "2026-12-05T09:58:00.000+00:00",
          "created_at": "2026-12-05T09:58:00.000+00:00",
          "created_by": "alice", "failure_threshold": 0.1, "min_reports": 3, "success_threshold": 0.9,
          "stages": [{"percent": 5, "min_devices": 3, "min_wait_s": 0.0}, {"percent": 100, "min_devices": 1,
                                                                           "min_wait_s": 600.0}],
          "percent": 5, "cutoff": 21.7, "target": {"version": "v8", "bundle_sha256": "b" * 64},
          "baseline": {"version": "v7", "bundle_sha256": "a" * 64},
          "counts": {"in_stage": 3, "healthy": 0, "failed": 3, "waited_s": 12.5},
          "decisions": [
              {"id": 1, "rollout_id": 3, "at": "2026-12-05T09:58:00.000+00:00", "action": "start", "stage": 0,
               "by": "alice", "reason": "ship it",
               "numbers": {"stages": [{"percent": 5, "min_devices": 3, "min_wait_s": 0.0},
                                      {"percent": 100, "min_devices": 1, "min_wait_s": 600.0}],
                           "failure_threshold": 0.1, "min_reports": 3, "success_threshold": 0.9}},
              {"id": 2, "rollout_id": 3, "at": "2026-12-05T09:59:00.000+00:00", "action": "halt", "stage": 0,
               "by": "service", "reason": "3 of 3 devices failed the version (100% > 10% after at least 3)",
               "numbers": {"stage": 0, "percent": 5, "in_stage": 3, "healthy": 0, "failed": 3, "failure_rate": 1.0,
                           "failure_threshold": 0.1, "min_reports": 3, "success_rate": 0.0,
                           "success_threshold": 0.9, "min_devices": 3, "waited_s": 60.0, "min_wait_s": 0.0}}]}
    ro.update(over)
    return ro


def _group(**over) -> dict:
    g = {"device_class": "galaxy_s25", "model": "embedded", "devices": 6, "channels": {"stable": 5, "beta": 1},
         "by_version": {"v7": {"devices": 6, "health": {"failed": 3, "not reported": 2, "healthy": 1},
                               "last_seen": "2026-12-05T09:59:30.000+00:00"}},
         "rollouts": [_rollout()]}
    g.update(over)
    return g


class _Tags(HTMLParser):
    """Every start tag and its attributes, as a browser's tokenizer would see them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _Tags:
    p = _Tags()
    p.feed(text)
    p.close()
    return p


def test_an_empty_fleet_says_how_to_start():
    out = page.render({"groups": [], "at": AT})
    assert out.startswith("<!doctype html>")
    assert '<meta http-equiv="refresh" content="10">' in out
    assert 'id="empty"' in out
    assert "python -m pipeline.fleet.rollout enroll" in out and "python -m pipeline.fleet.rollout start" in out
    tags = _parse(out).tags
    assert not [t for t, a in tags if t in ("script", "img", "iframe", "object")]  # self-contained, no JS
    assert [a.get("href") for t, a in tags if t == "link"] == ["data:,"]  # no favicon request either
    assert not [a for _, a in tags if any(str(v).startswith(("http:", "https:", "//")) for v in a.values())]


def test_a_halted_rollout_shows_its_state_stage_and_failure_numbers():
    out = page.render({"groups": [_group()], "at": AT})
    tags = _parse(out).tags
    (art,) = [a for t, a in tags if t == "article"]
    assert art["data-rollout-id"] == "3" and art["data-state"] == "halted"
    assert (art["data-stage"], art["data-stages"]) == ("1", "2")
    assert "stage 1 of 2 at 5%" in out and "cutoff 21.7 (widened from 5% to hold 3 devices)" in out
    assert "failed 3/3 = 100% &gt; 10% (min 3 reports)" in out  # the numbers behind the halt
    assert "healthy 0/3 = 0% &lt; 90%" in out
    assert "stages 5% (\u22653 dev) \u2192 100% (wait 10 min)" in out  # the start's plan
    row = [a for t, a in tags if t == "tr" and a.get("data-version") == "v7"]
    assert row and row[0]["data-devices"] == "6"
    assert "python -m pipeline.fleet.registry rollback galaxy_s25 stable --model embedded" in out


def test_rollouts_are_newest_first():
    out = page.render({"groups": [_group(rollouts=[_rollout(id=1, state="completed", stage=1),
                                                   _rollout(id=4, state="running")])], "at": AT})
    ids = [a["data-rollout-id"] for t, a in _parse(out).tags if t == "article"]
    assert ids == ["4", "1"]


def test_every_value_is_escaped():
    evil_ro = _rollout(channel=EVIL, created_by=EVIL, target={"version": EVIL, "bundle_sha256": "c" * 64})
    evil_ro["decisions"][0]["reason"] = EVIL
    evil_ro["decisions"][1]["by"] = EVIL
    g = _group(device_class=EVIL, model=EVIL, channels={EVIL: 6}, rollouts=[evil_ro],
               by_version={EVIL: {"devices": 6, "health": {EVIL: 6}, "last_seen": EVIL}})
    out = page.render({"groups": [g], "at": AT})
    parsed = _parse(out)
    assert not [t for t, _ in parsed.tags if t == "script"]
    # Attribute values come back exactly (the quotes did not end them) ...
    (sec,) = [a for t, a in parsed.tags if t == "section"]
    assert sec["data-device-class"] == EVIL and sec["data-model"] == EVIL
    assert [a["data-version"] for t, a in parsed.tags if t == "tr" and "data-version" in a] == [EVIL]
    assert [a["data-channel"] for t, a in parsed.tags if t == "span" and "data-channel" in a] == [EVIL]
    # ... and so does the text.
    text = "".join(parsed.text)
    assert text.count(EVIL) >= 6
    assert "<script>" not in out and html.escape(EVIL) in out


# ---------------------------------------------------------------- the real service


class Device:
    def __init__(self, device_id: str, device_class: str, model: str, channel: str = "stable"):
        self.id, self.device_class, self.model, self.channel = device_id, device_class, model, channel
        self.token: str | None = None
        self.current: str | None = None  # the bundle it runs
        self.failed: list[str] = []     # the versions it reported failed


def _record(device_class: str, model: str, version: str) -> tuple[str, str]:
    """A registry record's text (what `rollout start` sends) and its bundle sha256."""
    bundle = hashlib.sha256(f"{device_class}/{model}/{version}".encode()).hexdigest()
    rec = {"bundle_sha256": bundle, "device": device_class, "model": model, "version": version,
           "files": {"model.onnx": hashlib.sha256(bundle.encode()).hexdigest()}}
    return json.dumps(rec, indent=2, sort_keys=True), bundle


class Service:
    """`python -m pipeline.fleet.rollout serve` on a free port, its database in `folder`."""

    def __init__(self, folder: Path, tick_s: float = 0.5):
        from pipeline.fleet.rollout import Client

        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "service.log"
        out = folder / "service.out"
        env = {**venv_env(), "EDGEKILN_FLEET_ADMIN_TOKEN": ADMIN}
        with open(out, "w") as o, open(self.log, "w") as e:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.fleet.rollout", "serve", "--db", f"sqlite:///{folder / 'fleet.db'}",
                 "--port", "0", "--tick", str(tick_s)], cwd=ROOT, env=env, stdout=o, stderr=e)
        deadline = time.monotonic() + 30
        self.url = None
        while self.url is None:
            line = out.read_text()
            if "rollout service: http://" in line:
                self.url = line.split("rollout service: ", 1)[1].split()[0]
            elif self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the rollout service did not start:\n{out.read_text()}\n{self.log.read_text()[-3000:]}")
            else:
                time.sleep(0.05)
        while True:  # the line is printed before uvicorn listens
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=5):
                    break
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"the rollout service never answered /healthz:\n{self.log.read_text()[-3000:]}")
                time.sleep(0.05)
        self.client = Client(self.url, ADMIN)
        self.versions: dict[tuple, dict] = {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # ------------------------------------------------------------ operator

    def enroll(self, devices: list[Device]) -> None:
        got = self.client.call("POST", "/v1/admin/devices", {"devices": [
            {"device_id": d.id, "device_class": d.device_class, "model": d.model, "channel": d.channel}
            for d in devices]})["devices"]
        tokens = {x["device_id"]: x["token"] for x in got}
        for d in devices:
            d.token = tokens[d.id]

    def version(self, device_class: str, model: str, version: str) -> dict:
        text, bundle = _record(device_class, model, version)
        v = self.client.call("POST", "/v1/admin/versions", {"record": text})
        assert v["bundle_sha256"] == bundle
        self.versions[(device_class, model, version)] = v
        return v

    def start(self, device_class: str, model: str, target: str, baseline: str, stages: list[dict],
              **kw) -> dict:
        return self.client.call("POST", "/v1/admin/rollouts", {
            "device_class": device_class, "model": model, "target": self.versions[(device_class, model, target)][
                "record_sha256"], "baseline": self.versions[(device_class, model, baseline)]["record_sha256"],
            "stages": stages, **kw})

    def state(self, rollout_id: int) -> dict:
        return self.client.call("GET", f"/v1/admin/rollouts/{rollout_id}")

    # ------------------------------------------------------------ devices

    def checkin(self, d: Device, report: dict | None = None) -> dict:
        body = {"device_id": d.id, "device_class": d.device_class, "model": d.model, "current": d.current,
                "report": report}
        req = urllib.request.Request(self.url + "/v1/checkin", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {d.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def step(self, d: Device, outcome) -> None:
        """One check-in as the agent does it: install what it is assigned, check it, report."""
        got = self.checkin(d)
        a = got["assigned"]
        if not a or a["bundle_sha256"] == d.current:
            return
        how = outcome(d, a["version"])
        if how == "failed":  # the health check failed: the agent rolled back and says so
            d.failed.append(a["version"])
            self.checkin(d, {"bundle_sha256": a["bundle_sha256"], "outcome": "failed", "rolled_back_to": d.current,
                             "detail": "health check: 0 of 4 prompts matched the reference"})
        else:
            d.current = a["bundle_sha256"]
            self.checkin(d, {"bundle_sha256": a["bundle_sha256"], "outcome": how, "detail": f"{how} on {a['version']}"})

    def drive(self, devices: list[Device], outcome, *, until=None, rounds: int = 8) -> None:
        """Rounds of check-ins of every device until `until()` (or `rounds` rounds)."""
        for _ in range(rounds):
            for d in devices:
                self.step(d, outcome)
            if until is not None and until():
                return
        if until is not None:
            deadline = time.monotonic() + 5  # the tick thread may still be deciding
            while not until():
                assert time.monotonic() < deadline, f"never reached: {until.__doc__ or until}"
                time.sleep(0.1)


def _on(service: Service, devices: list[Device], version: str) -> None:
    """The devices run `version` (their first check-in says so)."""
    for d in devices:
        d.current = service.versions[(d.device_class, d.model, version)]["bundle_sha256"]


def _healthy(_d, _v):
    return "healthy"


def _failing(_d, _v):
    return "failed"


@pytest.fixture(scope="module")
def browser():
    why = _browser_missing()
    if why:
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A service with 14 devices: x86_avx512 completes v2, galaxy_s25 halts v2, and a third group
    (a model named with a script tag) has a paused rollout."""
    if _browser_missing():
        pytest.skip(_browser_missing())
    svc = Service(tmp_path_factory.mktemp("fleet-page"))
    try:
        x86 = [Device(f"x86-{i:02d}", "x86_avx512", "embedded") for i in range(6)]
        phones = [Device(f"s25-{i:02d}", "galaxy_s25", "embedded") for i in range(6)]
        evil = [Device(f"lab-{i}", "x86_avx512", "tiny" + EVIL) for i in range(2)]
        svc.enroll(x86 + phones + evil)
        for cls, model, group in (("x86_avx512", "embedded", x86), ("galaxy_s25", "embedded", phones),
                                  ("x86_avx512", "tiny" + EVIL, evil)):
            svc.version(cls, model, "v1")
            svc.version(cls, model, "v2")
            _on(svc, group, "v1")
        stages = [{"percent": 34, "min_devices": 3}, {"percent": 100}]
        ok = svc.start("x86_avx512", "embedded", "v2", "v1", stages, reason="parity passed")
        bad = svc.start("galaxy_s25", "embedded", "v2", "v1", stages, min_reports=3, failure_threshold=0.1)
        held = svc.start("x86_avx512", "tiny" + EVIL, "v2", "v1", stages, reason="canary " + EVIL)
        svc.client.call("POST", f"/v1/admin/rollouts/{held['id']}/pause", {"reason": "hold " + EVIL})

        def completed():
            return svc.state(ok["id"])["state"] == "completed"

        def halted():
            return svc.state(bad["id"])["state"] == "halted"

        svc.drive(x86, _healthy, until=completed)
        svc.drive(phones, _failing, until=halted)
        yield {"svc": svc, "x86": x86, "phones": phones, "evil": evil, "ok": ok["id"], "bad": bad["id"],
               "held": held["id"]}
    finally:
        svc.stop()


def _text(loc) -> str:
    return " ".join(loc.inner_text().split())


@needs_browser
def test_the_fleet_page_in_chromium(browser, fleet):
    svc, phones = fleet["svc"], fleet["phones"]
    failed = [d for d in phones if d.failed]
    assert len(failed) >= 3  # min_reports
    pg = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    requests: list[str] = []
    pg.on("request", lambda req: requests.append(req.url))
    pg.goto(svc.url + "/", wait_until="load")
    assert pg.title() == "edgekiln fleet"
    assert pg.get_attribute('meta[http-equiv="refresh"]', "content") == "10"
    assert pg.get_attribute("#summary", "data-devices") == "14"

    # The halted rollout: its state, its failure numbers, the decision that halted it.
    s25 = pg.locator('section.group[data-device-class="galaxy_s25"][data-model="embedded"]')
    ro = s25.locator(f'article[data-rollout-id="{fleet["bad"]}"]')
    assert ro.get_attribute("data-state") == "halted"
    assert "halted" in _text(ro.locator(".badge"))
    assert _text(ro.locator('[data-count="failed"] dd')) == str(len(failed))
    assert _text(ro.locator('[data-count="failure_rate"] dd')).startswith("100% > 10%")
    halt = ro.locator('tr.decision[data-action="halt"]')
    assert _text(halt.locator(".by")) == "service"
    assert f"{len(failed)} of {len(failed)} devices failed the version" in _text(halt.locator(".reason"))
    assert f"failed {len(failed)}/{len(failed)} = 100% > 10% (min 3 reports)" in _text(halt.locator(".numbers"))
    assert "pipeline.fleet.registry rollback galaxy_s25 stable" in _text(ro)

    # The completed one: every stage done, advanced by the service and completed.
    x86 = pg.locator('section.group[data-device-class="x86_avx512"][data-model="embedded"]')
    done = x86.locator(f'article[data-rollout-id="{fleet["ok"]}"]')
    assert done.get_attribute("data-state") == "completed"
    assert done.get_attribute("data-stage") == done.get_attribute("data-stages") == "2"
    assert done.locator('tr.decision[data-action="advance"] .stage').inner_text() == "1 \u2192 2"
    assert done.locator('tr.decision[data-action="complete"]').count() == 1
    assert done.locator(".seg.done").count() == 2
    # ... and the states look different, not only read differently.
    colour = "el => getComputedStyle(el).backgroundColor"
    assert ro.locator(".badge").evaluate(colour) != done.locator(".badge").evaluate(colour)

    # Devices by version and health.
    row = x86.locator('tr[data-version="v2"]')
    assert [_text(row.locator(f'[data-col="{c}"]')) for c in ("devices", "healthy", "failed")] == ["6", "6", "0"]
    assert x86.locator("tr[data-version]").count() == 1
    v1 = s25.locator('tr[data-version="v1"]')
    quiet = 6 - len(failed)
    # the devices that failed v2 went back to v1: there they are "rolled back", not "failed"
    assert [_text(v1.locator(f'[data-col="{c}"]')) for c in ("devices", "healthy", "rolled_back", "failed",
                                                             "not-reported")] == \
        ["6", "0", str(len(failed)), "0", str(quiet)]
    assert s25.locator('.chip[data-channel="stable"]').get_attribute("data-devices") == "6"

    # Escaped: the model and the reasons are text, no script ran or exists.
    lab = pg.locator("section.group").filter(has_text="tiny<script>")
    assert lab.count() == 1
    assert _text(lab.locator("h2 .model")) == " ".join(("tiny" + EVIL).split())
    assert lab.get_attribute("data-model") == "tiny" + EVIL
    held = lab.locator(f'article[data-rollout-id="{fleet["held"]}"]')
    assert held.get_attribute("data-state") == "paused"
    assert _text(held.locator('tr.decision[data-action="pause"] .reason')) == "hold " + EVIL
    assert _text(held.locator('tr.decision[data-action="start"] .reason')) == "canary " + EVIL
    assert pg.locator("script").count() == 0
    assert pg.evaluate("() => window.__pwned === undefined")

    # Another check-in, a reload: the page follows.
    quiet_phone = next(d for d in phones if not d.failed)
    svc.checkin(quiet_phone, {"bundle_sha256": quiet_phone.current, "outcome": "healthy", "detail": "still fine"})
    pg.reload(wait_until="load")
    v1 = pg.locator('section.group[data-device-class="galaxy_s25"] tr[data-version="v1"]')
    assert [_text(v1.locator(f'[data-col="{c}"]')) for c in ("healthy", "not-reported")] == ["1", str(quiet - 1)]
    assert not errors, errors
    assert requests == [svc.url + "/"] * 2, requests  # the page and its reload: no asset, script or favicon
    pg.close()


# ---------------------------------------------------------------- the committed screenshot


@needs_browser
@pytest.mark.skipif(not os.environ.get("EDGEKILN_SCREENSHOT"),
                    reason=f"EDGEKILN_SCREENSHOT=1 rebuilds {SCREENSHOT.relative_to(ROOT)} from a realistic fleet")
def test_screenshot_of_a_realistic_fleet(browser, tmp_path, monkeypatch):
    """3 device classes, 60 devices: one rollout completed, one halted, one running at stage 2."""
    svc = Service(tmp_path / "fleet")
    try:
        x86 = [Device(f"x86-lab-{i:02d}", "x86_avx512", "embedded") for i in range(24)]
        phones = [Device(f"s25-{i:03d}", "galaxy_s25", "embedded", "beta" if i < 4 else "stable") for i in range(20)]
        orin = [Device(f"orin-{i:02d}", "jetson_orin", "qwen3-0.6b") for i in range(16)]
        svc.enroll(x86 + phones + orin)
        for cls, model, old, new, group in (("x86_avx512", "embedded", "v3", "v4", x86),
                                            ("galaxy_s25", "embedded", "v7", "v8", phones),
                                            ("jetson_orin", "qwen3-0.6b", "v1", "v2", orin)):
            svc.version(cls, model, old)
            svc.version(cls, model, new)
            _on(svc, group, old)
        monkeypatch.setenv("USER", "alice")
        a = svc.start("x86_avx512", "embedded", "v4", "v3", [{"percent": 5, "min_devices": 2}, {"percent": 25},
                                                              {"percent": 100}], reason="int4 layout, parity passed")
        svc.drive(x86, lambda d, v: "unchecked" if d.id.endswith("7") else "healthy",
                  until=lambda: svc.state(a["id"])["state"] == "completed")

        stable = [d for d in phones if d.channel == "stable"]
        beta = [d for d in phones if d.channel == "beta"]
        _on(svc, beta, "v8")
        for d in beta:  # beta took v8 earlier, by hand
            svc.checkin(d, {"bundle_sha256": d.current, "outcome": "healthy", "detail": "beta"})
        b = svc.start("galaxy_s25", "embedded", "v8", "v7", [{"percent": 5, "min_devices": 3}, {"percent": 25},
                                                             {"percent": 100}], reason="QNN context binaries v2.7")
        svc.drive(stable, _failing, until=lambda: svc.state(b["id"])["state"] == "halted")

        # Stage 2 waits 10 minutes: the rollout stays there, most of its devices healthy, two never seen.
        far = sorted(orin, key=lambda d: policy.bucket(d.id))[-2:]
        c = svc.start("jetson_orin", "qwen3-0.6b", "v2", "v1", [{"percent": 10, "min_devices": 2},
                                                               {"percent": 50, "min_wait_s": 600}, {"percent": 100}])
        svc.client.call("POST", f"/v1/admin/rollouts/{c['id']}/pause", {"reason": "thermal check on orin-03 first"})
        svc.client.call("POST", f"/v1/admin/rollouts/{c['id']}/resume", {"reason": "thermals fine"})
        online = [d for d in orin if d not in far]
        svc.drive(online, _healthy, until=lambda: svc.state(c["id"])["stage"] == 1)
        svc.drive(online[: len(online) * 2 // 3], lambda d, v: "unchecked" if d.id == "orin-05" else "healthy",
                  rounds=1)  # a third of the fleet has not checked in since the stage began
        got = svc.state(c["id"])
        assert got["state"] == "running" and got["stage"] == 1 and got["counts"]["healthy"] < got["counts"]["in_stage"]

        pg = browser.new_page(viewport={"width": 1280, "height": 900})
        pg.goto(svc.url + "/", wait_until="load")
        assert pg.locator("article.rollout").count() == 3
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(SCREENSHOT), full_page=True)
        pg.close()
        assert SCREENSHOT.stat().st_size > 10_000
    finally:
        svc.stop()
