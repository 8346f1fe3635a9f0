"""The rollout service: device check-ins, staged rollouts, automatic halt, the fleet page.

    python -m pipeline.fleet.rollout serve [--db URL] [--host 127.0.0.1] [--port 8470]

One process serves everything over HTTP (FastAPI on uvicorn; loopback by default):

- `POST /v1/checkin` (a device's token): the device says who it is, what it
  runs and how its last install went; the service answers with the version
  it should run and the sha256 of that version's record (the pin: a device
  refuses a record whose bytes hash otherwise). `GET /v1/records/{sha256}`
  serves the record. The device fetches the blobs from the store itself
  (pipeline/fleet/agent.py).
- `/v1/admin/...` (the operator's token): enroll devices (a token each, only
  its sha256 kept), add versions (a registry record, stored as its exact
  bytes), start, advance, pause, resume and halt rollouts, read their status.
- `GET /` (the fleet page) and `GET /v1/fleet` (the same as JSON).

State lives in the database only (pipeline/fleet/db.py), so a service killed
mid-rollout and started again on the same database goes on where it was: a
rollout's stage and the time it started, every device's last check-in and
every report are rows. Decisions (automatic or an operator's) are rows too,
each with the numbers behind it (pipeline/fleet/policy.py decides).

Stage changes are conditional updates (`WHERE stage = s AND state =
'running'`), so two evaluations racing (the tick thread and a check-in, or
two service processes on one PostgreSQL) advance a stage once.
"""


import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import threading
from pathlib import Path

import sqlalchemy as sa

from pipeline.fleet import db, policy

log = logging.getLogger("edgekiln.fleet")

CHECKIN_INTERVAL_S = 300  # what a device is told to wait between check-ins (a fleet-wide setting)


class FleetError(Exception):
    """A refusal the HTTP layer turns into a status code and a one-line error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Fleet:
    """The service's logic over its database; the HTTP layer below is a thin shell."""

    def __init__(self, url: str, *, interval_s: int = CHECKIN_INTERVAL_S):
        self.url = url
        self.engine, self.t, self.revision = db.open_db(url)
        self.interval_s = interval_s
        self._versions: dict[str, dict] = {}  # record sha256 -> row (immutable once added)
        self._eval_lock = threading.Lock()

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ operator side

    def enroll(self, devices: list[dict]) -> list[dict]:
        """Enroll (or re-enroll, rotating the token) devices: [{device_id, device_class, model, channel}]."""
        out, t = [], self.t.devices
        with self.engine.begin() as conn:
            for d in devices:
                for k in ("device_id", "device_class", "model"):
                    if not str(d.get(k) or "").strip():
                        raise FleetError(400, f"enroll: {k} is required")
                token = secrets.token_urlsafe(24)
                values = {"device_id": d["device_id"], "device_class": d["device_class"], "model": d["model"],
                          "channel": d.get("channel") or "stable", "bucket": policy.bucket(d["device_id"]),
                          "token_sha256": token_sha256(token), "enrolled_at": db.now()}
                db.upsert(conn, t, values, ["device_id"],
                          ["device_class", "model", "channel", "token_sha256", "enrolled_at"])
                out.append({"device_id": d["device_id"], "token": token, "bucket": round(values["bucket"], 3)})
        return out

    def add_version(self, record_text: str) -> dict:
        """Store a registry record as its exact bytes; its sha256 is what devices are pinned to."""
        raw = record_text.encode()
        sha = hashlib.sha256(raw).hexdigest()
        try:
            rec = json.loads(raw)
            row = {"record_sha256": sha, "bundle_sha256": rec["bundle_sha256"], "device_class": rec["device"],
                   "model": rec["model"], "version": rec.get("version") or rec["bundle_sha256"][:8],
                   "record": record_text, "added_at": db.now()}
            if not isinstance(rec.get("files"), dict) or not rec["files"]:
                raise KeyError("files")
        except (ValueError, KeyError, TypeError) as e:
            raise FleetError(400, f"version: not a registry record ({e})")
        with self.engine.begin() as conn:
            if conn.execute(sa.select(self.t.versions.c.record_sha256)
                            .where(self.t.versions.c.record_sha256 == sha)).first() is None:
                conn.execute(self.t.versions.insert().values(**row))
        return {k: row[k] for k in ("record_sha256", "bundle_sha256", "device_class", "model", "version")}

    def _version(self, conn, sha: str | None) -> dict | None:
        if sha is None:
            return None
        if sha not in self._versions:
            v = self.t.versions.c
            row = conn.execute(sa.select(v.record_sha256, v.bundle_sha256, v.version, v.device_class, v.model)
                               .where(v.record_sha256 == sha)).mappings().first()
            if row is None:
                return None
            self._versions[sha] = dict(row)
        return self._versions[sha]

    def start(self, *, device_class: str, model: str, channel: str, target: str, baseline: str | None,
              stages: list[policy.Stage], failure_threshold: float = 0.1, min_reports: int = 3,
              success_threshold: float = 0.9, by: str = "operator", reason: str | None = None) -> dict:
        policy.check_stages(stages)
        if not 0 <= failure_threshold < 1 or not 0 < success_threshold <= 1 or min_reports < 1:
            raise FleetError(400, "rollout: failure_threshold in [0, 1), success_threshold in (0, 1], min_reports >= 1")
        r = self.t.rollouts
        with self.engine.begin() as conn:
            for name, sha in (("target", target), ("baseline", baseline)):
                v = self._version(conn, sha)
                if sha is not None and v is None:
                    raise FleetError(404, f"rollout: {name} record {sha[:12]} was never added (POST /v1/admin/versions)")
                if v and (v["device_class"], v["model"]) != (device_class, model):
                    raise FleetError(400, f"rollout: {name} {v['version']} is a {v['device_class']}/{v['model']} "
                                          f"version, not {device_class}/{model}")
            if target == baseline:
                raise FleetError(400, "rollout: the target is the baseline")
            active = conn.execute(sa.select(r.c.id, r.c.state).where(
                r.c.device_class == device_class, r.c.model == model, r.c.channel == channel,
                r.c.state.in_(("running", "paused")))).first()
            if active:
                raise FleetError(409, f"rollout {active.id} for {device_class}/{model} on {channel} is {active.state}: "
                                      "halt it (or let it complete) before starting another")
            at = db.now()
            rid = conn.execute(r.insert().values(
                device_class=device_class, model=model, channel=channel, target_record=target,
                baseline_record=baseline, stages=json.dumps(policy.stages_json(stages)),
                failure_threshold=failure_threshold, min_reports=min_reports, success_threshold=success_threshold,
                state="running", stage=0, cutoff=self._cutoff(conn, device_class, model, channel, stages[0]),
                stage_started_at=at, created_at=at, created_by=by)).inserted_primary_key[0]
            self._decide(conn, rid, "start", 0, {"stages": policy.stages_json(stages),
                                                 "failure_threshold": failure_threshold, "min_reports": min_reports,
                                                 "success_threshold": success_threshold}, by, reason)
        return self.status(rid)

    def act(self, rollout_id: int, action: str, *, by: str = "operator", reason: str | None = None) -> dict:
        """An operator's advance, pause, resume or halt."""
        r = self.t.rollouts
        with self._eval_lock, self.engine.begin() as conn:
            row = conn.execute(sa.select(r).where(r.c.id == rollout_id)).mappings().first()
            if row is None:
                raise FleetError(404, f"no rollout {rollout_id}")
            state, stage = row["state"], row["stage"]
            stages = policy.stages_from(json.loads(row["stages"]))
            allowed = {"pause": ("running",), "resume": ("paused", "halted"), "halt": ("running", "paused"),
                       "advance": ("running", "paused")}
            if action not in allowed:
                raise FleetError(400, f"unknown action {action!r} (advance, pause, resume, halt)")
            if state not in allowed[action]:
                raise FleetError(409, f"rollout {rollout_id} is {state}: cannot {action} it")
            if action == "resume" and state == "halted" and not (reason and reason.strip()):
                raise FleetError(400, f"rollout {rollout_id} was halted: resuming it needs a reason")
            values: dict = {}
            if action == "pause":
                values["state"] = "paused"
            elif action == "resume":
                values = {"state": "running", "stage_started_at": db.now()}
            elif action == "halt":
                values["state"] = "halted"
            elif stage == len(stages) - 1:
                values["state"] = "completed"
            else:
                values = {"stage": stage + 1, "stage_started_at": db.now(),
                          "cutoff": self._cutoff(conn, row["device_class"], row["model"], row["channel"],
                                                 stages[stage + 1])}
            conn.execute(r.update().where(r.c.id == rollout_id).values(**values))
            numbers = {**self._counts(conn, row, stages).__dict__, "from_state": state, "from_stage": stage}
            self._decide(conn, rollout_id, action if action != "advance" or "stage" in values else "complete",
                         values.get("stage", stage), numbers, by, reason)
        return self.status(rollout_id)

    # ------------------------------------------------------------ device side

    def checkin(self, token: str | None, body: dict) -> dict:
        device_id = str(body.get("device_id") or "")
        if not device_id:
            raise FleetError(400, "check-in: device_id is required")
        d, rep = self.t.devices, body.get("report")
        with self.engine.begin() as conn:
            dev = conn.execute(sa.select(d).where(d.c.device_id == device_id)).mappings().first()
            if dev is None:
                raise FleetError(401, f"device {device_id}: not enrolled (python -m pipeline.fleet.rollout enroll)")
            if not token or not hmac.compare_digest(token_sha256(token), dev["token_sha256"]):
                raise FleetError(401, f"device {device_id}: token refused")
            for k in ("device_class", "model"):
                if body.get(k) and body[k] != dev[k]:
                    raise FleetError(403, f"device {device_id}: enrolled as {k} {dev[k]!r}, checked in as {body[k]!r}")
            at = db.now()
            values = {"last_seen": at, "checkins": d.c.checkins + 1, "current_bundle": body.get("current")}
            if rep:
                if rep.get("outcome") not in ("healthy", "unchecked", "failed") or not rep.get("bundle_sha256"):
                    raise FleetError(400, f"device {device_id}: a report needs bundle_sha256 and an outcome "
                                          "(healthy, unchecked, failed)")
                db.upsert(conn, self.t.reports,
                          {"device_id": device_id, "bundle_sha256": rep["bundle_sha256"], "outcome": rep["outcome"],
                           "detail": str(rep.get("detail") or "")[:2000], "decode_tok_s": rep.get("decode_tok_s"),
                           "rolled_back_to": rep.get("rolled_back_to"), "at": rep.get("at") or at},
                          ["device_id", "bundle_sha256"], ["outcome", "detail", "decode_tok_s", "rolled_back_to", "at"])
                # A device that failed a version and went back is running its previous version: "rolled_back"
                # there, not "failed" (the report against the version it failed keeps "failed").
                health = "rolled_back" if rep["outcome"] == "failed" and rep.get("rolled_back_to") else rep["outcome"]
                values.update(health=health, health_detail=str(rep.get("detail") or "")[:2000], health_at=at)
            ro = self._latest_rollout(conn, dev["device_class"], dev["model"], dev["channel"])
            assigned, rollout = None, None
            if ro is not None:
                sha = ro["baseline_record"]
                target = self._version(conn, ro["target_record"])
                if policy.in_rollout(dev["bucket"], ro["state"], ro["cutoff"]) and not self._failed(
                        conn, device_id, target["bundle_sha256"], rep):
                    sha = ro["target_record"]
                v = self._version(conn, sha)
                if v:
                    assigned = {"bundle_sha256": v["bundle_sha256"], "version": v["version"], "record_sha256": sha}
                rollout = {"id": ro["id"], "stage": ro["stage"], "state": ro["state"]}
            values["assigned_bundle"] = assigned["bundle_sha256"] if assigned else None
            conn.execute(d.update().where(d.c.device_id == device_id).values(**values))
        if rep and ro is not None and ro["state"] == "running":
            self.evaluate(ro["id"])
        return {"assigned": assigned, "rollout": rollout, "interval_s": self.interval_s}

    def _failed(self, conn, device_id: str, bundle: str, rep: dict | None) -> bool:
        """A device that failed a version is never sent it again in this rollout."""
        if rep and rep.get("bundle_sha256") == bundle:
            return rep.get("outcome") == "failed"
        p = self.t.reports.c
        out = conn.execute(sa.select(p.outcome).where(p.device_id == device_id, p.bundle_sha256 == bundle)).scalar()
        return out == "failed"

    def _latest_rollout(self, conn, device_class: str, model: str, channel: str):
        r = self.t.rollouts
        return conn.execute(sa.select(r).where(r.c.device_class == device_class, r.c.model == model,
                                               r.c.channel == channel).order_by(r.c.id.desc()).limit(1)).mappings().first()

    def record(self, token: str | None, sha: str) -> bytes:
        """A version's record, to an enrolled device (tokens are random: its sha256 finds the device)."""
        d, v = self.t.devices, self.t.versions
        with self.engine.connect() as conn:
            if not token or conn.execute(sa.select(d.c.device_id).where(
                    d.c.token_sha256 == token_sha256(token))).first() is None:
                raise FleetError(401, "record: device token refused")
            text = conn.execute(sa.select(v.c.record).where(v.c.record_sha256 == sha)).scalar()
        if text is None:
            raise FleetError(404, f"no record {sha[:12]}")
        return text.encode()

    # ------------------------------------------------------------ decisions

    def _cutoff(self, conn, device_class: str, model: str, channel: str, stage: policy.Stage) -> float:
        d = self.t.devices
        lowest = [b for (b,) in conn.execute(sa.select(d.c.bucket).where(
            d.c.device_class == device_class, d.c.model == model, d.c.channel == channel)
            .order_by(d.c.bucket).limit(max(stage.min_devices, 0)))]
        return policy.cutoff(stage.percent, stage.min_devices, lowest)

    def _counts(self, conn, ro, stages: list[policy.Stage]) -> policy.Counts:
        d, p = self.t.devices, self.t.reports
        target = self._version(conn, ro["target_record"])["bundle_sha256"]
        fleet = (d.c.device_class == ro["device_class"], d.c.model == ro["model"], d.c.channel == ro["channel"])
        pct = ro["cutoff"]
        in_stage = conn.execute(sa.select(sa.func.count()).select_from(d).where(
            *fleet, d.c.bucket < pct)).scalar_one()
        joined = d.join(p, p.c.device_id == d.c.device_id)
        healthy = conn.execute(sa.select(sa.func.count()).select_from(joined).where(
            *fleet, d.c.bucket < pct, p.c.bundle_sha256 == target, p.c.outcome.in_(policy.OK_OUTCOMES))).scalar_one()
        failed = conn.execute(sa.select(sa.func.count()).select_from(joined).where(
            *fleet, p.c.bundle_sha256 == target, p.c.outcome == "failed")).scalar_one()
        return policy.Counts(in_stage=in_stage, healthy=healthy, failed=failed,
                             waited_s=max(0.0, db.seconds_since(ro["stage_started_at"])))

    def _decide(self, conn, rollout_id: int, action: str, stage: int, numbers: dict, by: str,
                reason: str | None) -> None:
        conn.execute(self.t.decisions.insert().values(rollout_id=rollout_id, at=db.now(), action=action, stage=stage,
                                                      numbers=json.dumps(numbers, sort_keys=True), by=by,
                                                      reason=reason))
        log.info("rollout %s: %s at stage %s by %s: %s %s", rollout_id, action, stage, by, reason or "",
                 json.dumps(numbers, sort_keys=True))

    def evaluate(self, rollout_id: int) -> policy.Decision | None:
        """Apply the policy's automatic decision for one running rollout (at most one step)."""
        r = self.t.rollouts
        with self._eval_lock, self.engine.begin() as conn:
            ro = conn.execute(sa.select(r).where(r.c.id == rollout_id)).mappings().first()
            if ro is None or ro["state"] != "running":
                return None
            stages = policy.stages_from(json.loads(ro["stages"]))
            dec = policy.evaluate(state=ro["state"], stages=stages, stage=ro["stage"],
                                  counts=self._counts(conn, ro, stages), failure_threshold=ro["failure_threshold"],
                                  min_reports=ro["min_reports"], success_threshold=ro["success_threshold"])
            if dec is None:
                return None
            values = {"halt": {"state": "halted"}, "complete": {"state": "completed"},
                      "advance": {"stage": ro["stage"] + 1, "stage_started_at": db.now()}}[dec.action]
            if dec.action == "advance":
                values["cutoff"] = self._cutoff(conn, ro["device_class"], ro["model"], ro["channel"],
                                                stages[ro["stage"] + 1])
            done = conn.execute(r.update().where(r.c.id == rollout_id, r.c.stage == ro["stage"],
                                                 r.c.state == "running").values(**values)).rowcount
            if done != 1:  # another evaluation (another process) moved it first
                return None
            self._decide(conn, rollout_id, dec.action, values.get("stage", ro["stage"]), dec.numbers, "service",
                         dec.reason)
            return dec

    def tick(self) -> list[tuple[int, policy.Decision]]:
        """Evaluate every running rollout (the service does this every few seconds)."""
        r = self.t.rollouts
        with self.engine.connect() as conn:
            ids = [x for (x,) in conn.execute(sa.select(r.c.id).where(r.c.state == "running"))]
        out = []
        for rid in ids:
            while (dec := self.evaluate(rid)) is not None:  # a stage met at once may advance again
                out.append((rid, dec))
                if dec.action != "advance":
                    break
        return out

    # ------------------------------------------------------------ read side

    def status(self, rollout_id: int) -> dict:
        r, dd = self.t.rollouts, self.t.decisions
        with self.engine.connect() as conn:
            ro = conn.execute(sa.select(r).where(r.c.id == rollout_id)).mappings().first()
            if ro is None:
                raise FleetError(404, f"no rollout {rollout_id}")
            stages = policy.stages_from(json.loads(ro["stages"]))
            counts = self._counts(conn, ro, stages)
            decisions = [{**dict(x), "numbers": json.loads(x["numbers"])} for x in conn.execute(
                sa.select(dd).where(dd.c.rollout_id == rollout_id).order_by(dd.c.id)).mappings()]
            target = self._version(conn, ro["target_record"])
            baseline = self._version(conn, ro["baseline_record"])
        out = {k: ro[k] for k in ("id", "device_class", "model", "channel", "state", "stage", "stage_started_at",
                                  "created_at", "created_by", "failure_threshold", "min_reports", "success_threshold")}
        out.update(stages=policy.stages_json(stages), percent=stages[ro["stage"]].percent, cutoff=ro["cutoff"],
                   target={"version": target["version"], "bundle_sha256": target["bundle_sha256"]},
                   baseline={"version": baseline["version"], "bundle_sha256": baseline["bundle_sha256"]}
                   if baseline else None,
                   counts=counts.__dict__, decisions=decisions)
        return out

    def rollouts(self) -> list[dict]:
        r = self.t.rollouts
        with self.engine.connect() as conn:
            ids = [x for (x,) in conn.execute(sa.select(r.c.id).order_by(r.c.id))]
        return [self.status(i) for i in ids]

    def fleet(self) -> dict:
        """Per device class and model: devices by version and health, the rollouts, the versions."""
        d, v = self.t.devices, self.t.versions
        with self.engine.connect() as conn:
            names = {row.bundle_sha256: row.version for row in conn.execute(sa.select(v.c.bundle_sha256, v.c.version))}
            groups: dict[tuple, dict] = {}

            def group(device_class: str, model: str) -> dict:
                return groups.setdefault((device_class, model), {
                    "device_class": device_class, "model": model, "devices": 0, "channels": {}, "by_version": {},
                    "rollouts": []})

            for row in conn.execute(sa.select(d.c.device_class, d.c.model, d.c.channel, d.c.current_bundle,
                                              d.c.health, sa.func.count().label("n"),
                                              sa.func.max(d.c.last_seen).label("seen"))
                                    .group_by(d.c.device_class, d.c.model, d.c.channel, d.c.current_bundle,
                                              d.c.health)).mappings():
                g = group(row["device_class"], row["model"])
                g["devices"] += row["n"]
                g["channels"][row["channel"]] = g["channels"].get(row["channel"], 0) + row["n"]
                ver = names.get(row["current_bundle"], "none" if row["current_bundle"] is None
                                else row["current_bundle"][:8])
                slot = g["by_version"].setdefault(ver, {"devices": 0, "health": {}, "last_seen": None})
                slot["devices"] += row["n"]
                h = row["health"] or "not reported"
                slot["health"][h] = slot["health"].get(h, 0) + row["n"]
                slot["last_seen"] = max(filter(None, [slot["last_seen"], row["seen"]]), default=None)
        for ro in self.rollouts():
            group(ro["device_class"], ro["model"])["rollouts"].append(ro)
        return {"groups": [groups[k] for k in sorted(groups)], "at": db.now()}


# ---------------------------------------------------------------- HTTP


def create_app(fleet: Fleet, admin_token: str, *, tick_s: float = 5.0):
    """The FastAPI app over a Fleet; a background thread evaluates running rollouts every tick_s."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    stop = threading.Event()

    def ticker():
        while not stop.wait(tick_s):
            try:
                fleet.tick()
            except Exception:  # noqa: BLE001 - a bad tick is logged; the next one tries again
                log.exception("rollout tick failed")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        th = threading.Thread(target=ticker, name="rollout-tick", daemon=True)
        th.start()
        yield
        stop.set()

    app = FastAPI(title="edgekiln rollout service", lifespan=lifespan)
    admin_sha = token_sha256(admin_token)

    def bearer(request: Request) -> str | None:
        h = request.headers.get("authorization") or ""
        return h[7:].strip() if h.lower().startswith("bearer ") else None

    def admin(request: Request) -> str:
        tok = bearer(request)
        if not tok or not hmac.compare_digest(token_sha256(tok), admin_sha):
            raise FleetError(401, "admin token refused")
        return request.headers.get("x-edgekiln-operator") or "operator"

    @app.exception_handler(FleetError)
    async def fleet_error(_request, exc: FleetError):
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.post("/v1/checkin")
    def checkin(request: Request, body: dict):
        return fleet.checkin(bearer(request), body)

    @app.get("/v1/records/{sha}")
    def record(request: Request, sha: str):
        return Response(fleet.record(bearer(request), sha), media_type="application/json")

    @app.post("/v1/admin/devices")
    def enroll(request: Request, body: dict):
        admin(request)
        return {"devices": fleet.enroll(body.get("devices") or [body])}

    @app.post("/v1/admin/versions")
    def add_version(request: Request, body: dict):
        admin(request)
        return fleet.add_version(body.get("record") or "")

    @app.post("/v1/admin/rollouts")
    def start(request: Request, body: dict):
        by = admin(request)
        try:
            stages = policy.stages_from(body["stages"])
            kw = {k: body[k] for k in ("failure_threshold", "min_reports", "success_threshold") if k in body}
            return fleet.start(device_class=body["device_class"], model=body["model"],
                               channel=body.get("channel") or "stable", target=body["target"],
                               baseline=body.get("baseline"), stages=stages, by=by, reason=body.get("reason"), **kw)
        except (KeyError, TypeError, ValueError) as e:
            raise FleetError(400, f"rollout: {e}")

    @app.get("/v1/admin/rollouts")
    def rollouts(request: Request):
        admin(request)
        return {"rollouts": fleet.rollouts()}

    @app.get("/v1/admin/rollouts/{rid}")
    def rollout(request: Request, rid: int):
        admin(request)
        return fleet.status(rid)

    @app.post("/v1/admin/rollouts/{rid}/{action}")
    def act(request: Request, rid: int, action: str, body: dict | None = None):
        by = admin(request)
        return fleet.act(rid, action, by=by, reason=(body or {}).get("reason"))

    @app.get("/v1/fleet")
    def fleet_json():
        return fleet.fleet()

    @app.get("/", response_class=HTMLResponse)
    def page():
        from pipeline.fleet import page as fleet_page

        return fleet_page.render(fleet.fleet())

    @app.get("/healthz")
    def healthz():
        return {"ok": True, "schema": fleet.revision}

    return app


def admin_token_for(state_dir: Path) -> tuple[str, Path | None]:
    """EDGEKILN_FLEET_ADMIN_TOKEN, else the token in state_dir/admin.token (made, 0600, on first start)."""
    import os

    env = os.environ.get("EDGEKILN_FLEET_ADMIN_TOKEN")
    if env:
        return env.strip(), None
    path = state_dir / "admin.token"
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip(), path
