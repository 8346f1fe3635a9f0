"""Fleet rollouts from the operator's side: the service, devices, staged rollouts.

    python -m pipeline.fleet.rollout serve [--db sqlite:///fleet.db] [--port 8470]   # the rollout service + fleet page
    python -m pipeline.fleet.rollout enroll phone-001 phone-002 --class galaxy_s25 --model embedded
    python -m pipeline.fleet.rollout start x86_avx512 v2 --stages 5,15,80,100        # promote v2 on stable, in stages
    python -m pipeline.fleet.rollout status [ID] [--json]
    python -m pipeline.fleet.rollout pause|resume|advance|halt ID [--reason "..."]

`start` reads the registry in this checkout (registry/index.yaml and the
version records): it promotes the version on the channel through the
registry's own gates (parity passed, dev -> canary -> stable, the speed gate
against the channel's current version; `--force --reason` as for `promote`),
sends the service both records (the version's and the channel's previous
one, the baseline every device outside the stage keeps or returns to) as
their exact bytes, and starts the rollout. From there the service decides:
devices check in (pipeline/fleet/agent.py, on the device), each stage's
devices take the version, stages advance when their success threshold is met
and halt when failures pass theirs. A halted rollout has every device back on
the baseline; `python -m pipeline.fleet.registry rollback DEVICE CHANNEL`
then makes the registry say so too (status prints the command).

The client talks HTTP to the service (EDGEKILN_FLEET_URL, default
http://127.0.0.1:8470) with the admin token (EDGEKILN_FLEET_ADMIN_TOKEN, or
the file `serve` wrote: .edgekiln-fleet/admin.token beside the database).

Exit codes: 0 ok, 1 error, 2 usage, 3 refused (a gate, or the service: a
rollout already running, a state that does not allow the action), 5 the
admin token was refused.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8470"
DEFAULT_DB = "sqlite:///fleet.db"
STATE_DIR = ".edgekiln-fleet"


class ClientError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _state_dir(db_url: str) -> Path:
    """Beside a SQLite file; in the working folder for PostgreSQL."""
    if db_url.startswith("sqlite:///") and db_url != "sqlite:///:memory:":
        return Path(db_url[len("sqlite:///"):]).resolve().parent / STATE_DIR
    return Path(STATE_DIR).resolve()


class Client:
    def __init__(self, url: str | None = None, token: str | None = None):
        self.url = (url or os.environ.get("EDGEKILN_FLEET_URL") or DEFAULT_URL).rstrip("/")
        self.token = token or os.environ.get("EDGEKILN_FLEET_ADMIN_TOKEN") or self._token_file()

    @staticmethod
    def _token_file() -> str | None:
        p = _state_dir(os.environ.get("EDGEKILN_FLEET_DB", DEFAULT_DB)) / "admin.token"
        return p.read_text().strip() if p.is_file() else None

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.token or ''}",
            "X-Edgekiln-Operator": os.environ.get("USER") or "operator"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                got = json.loads(e.read())
                msg = got.get("error") or json.dumps(got.get("detail")) or e.reason
            except ValueError:
                msg = e.reason
            raise ClientError(f"{msg}", 5 if e.code == 401 else 3 if e.code in (400, 404, 409) else 1)
        except urllib.error.URLError as e:
            raise ClientError(f"the rollout service at {self.url} is not reachable ({e.reason}); "
                              "start it with python -m pipeline.fleet.rollout serve")


# ---------------------------------------------------------------- serve


def serve(db_url: str, host: str, port: int, *, tick_s: float, interval_s: int, ready=None) -> int:
    import logging

    import uvicorn

    from pipeline.fleet.service import Fleet, admin_token_for, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    fleet = Fleet(db_url, interval_s=interval_s)
    token, token_path = admin_token_for(_state_dir(db_url))
    app = create_app(fleet, token, tick_s=tick_s)
    # The socket is bound here, not by uvicorn, so `--port 0` can print the port it got.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit it: without it a keep-alive client waits out the 40 ms delayed ACK on every
    # response after the first (uvicorn writes headers and body apart; measured 42 ms vs 2 ms per check-in).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made before uvicorn's loop runs wait in the backlog, not refused
    bound = sock.getsockname()[1]
    shown = db_url.split("@")[-1] if "@" in db_url else db_url
    print(f"rollout service: http://{host}:{bound} (database {shown}, schema {fleet.revision}); admin token: "
          f"{token_path or 'EDGEKILN_FLEET_ADMIN_TOKEN'}; fleet page: http://{host}:{bound}/", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        fleet.close()
    return 0


# ---------------------------------------------------------------- start


def start_from_registry(client: Client, root: Path, device: str, ref: str, *, model: str | None, channel: str,
                        stages: str, failure_threshold: float, min_reports: int, success_threshold: float,
                        min_wait_s: float, force: bool, reason: str | None) -> dict:
    from pipeline.fleet import policy, registry

    try:
        stage_list = policy.parse_stages(stages, min_wait_s=min_wait_s)
    except ValueError as e:
        raise ClientError(f"--stages: {e}", 2)
    index = registry.load_index(root)
    model, entry = registry._entry(index, device, model)
    target = registry._version(entry, ref)
    current = registry.channel_current(entry.get("channels", {}).get(channel, {"history": []}))
    baseline = registry._version(entry, current) if current and current != target["version"] else None
    texts = {}
    for v in filter(None, (target, baseline)):
        path = root / registry.VERSIONS / f"{v['bundle_sha256']}.json"
        texts[v["version"]] = path.read_text()
    # Reach the service before the registry records a promotion it would not carry out.
    client.call("GET", "/v1/admin/rollouts")
    if current != target["version"]:
        registry.promote(root, device, target["version"], channel, model=model, force=force, reason=reason)
    shas = {k: client.call("POST", "/v1/admin/versions", {"record": t})["record_sha256"] for k, t in texts.items()}
    return client.call("POST", "/v1/admin/rollouts", {
        "device_class": device, "model": model, "channel": channel, "target": shas[target["version"]],
        "baseline": shas[baseline["version"]] if baseline else None, "stages": policy.stages_json(stage_list),
        "failure_threshold": failure_threshold, "min_reports": min_reports, "success_threshold": success_threshold,
        "reason": reason})


# ---------------------------------------------------------------- output


def describe(ro: dict) -> list[str]:
    c = ro["counts"]
    base = ro["baseline"]["version"] if ro["baseline"] else "nothing"
    lines = [f"rollout {ro['id']}: {ro['device_class']}/{ro['model']} {ro['channel']}: {ro['target']['version']} "
             f"(from {base}) {ro['state']}, stage {ro['stage'] + 1} of {len(ro['stages'])} at {ro['percent']:g}%: "
             f"{c['in_stage']} devices in it, {c['healthy']} healthy, {c['failed']} failed"]
    for d in ro["decisions"]:
        why = f": {d['reason']}" if d.get("reason") else ""
        lines.append(f"  {d['at']}  {d['action']:<8} stage {d['stage'] + 1}  by {d['by']}{why}")
    if ro["state"] == "halted":
        lines.append(f"  every device is back on {base}; make the registry say so: python -m pipeline.fleet.registry "
                     f"rollback {ro['device_class']} {ro['channel']} --model {ro['model']}")
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.fleet.rollout", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--service", help=f"the service's URL (EDGEKILN_FLEET_URL; default {DEFAULT_URL})")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the rollout service and the fleet page")
    s.add_argument("--db", default=os.environ.get("EDGEKILN_FLEET_DB", DEFAULT_DB),
                   help="sqlite:///PATH (default fleet.db here) or postgresql://USER:PASS@HOST/DB")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    s.add_argument("--port", type=int, default=8470, help="0 picks a free port (printed)")
    s.add_argument("--tick", type=float, default=5.0, help="seconds between evaluations of running rollouts")
    s.add_argument("--interval", type=int, default=300, help="seconds devices are told to wait between check-ins")
    e = sub.add_parser("enroll", help="enroll devices; prints each one's token (only its sha256 is kept)")
    e.add_argument("device_ids", nargs="+")
    e.add_argument("--class", dest="device_class", required=True)
    e.add_argument("--model", required=True)
    e.add_argument("--channel", default="stable")
    st = sub.add_parser("start", help="promote a registry version on a channel and roll it out in stages")
    st.add_argument("device")
    st.add_argument("version", help="v3, a bundle sha256 prefix, or a channel")
    st.add_argument("--model")
    st.add_argument("--channel", default="stable")
    st.add_argument("--stages", default="5,15,80,100", help="percent[:min_devices[:min_wait_s]],... ending at 100")
    st.add_argument("--min-wait", type=float, default=0.0, help="seconds each stage waits at least (default 0)")
    st.add_argument("--failure-threshold", type=float, default=0.1, help="halt above this failed share (0.1)")
    st.add_argument("--min-reports", type=int, default=3, help="reports needed before a halt (3)")
    st.add_argument("--success-threshold", type=float, default=0.9, help="healthy share to advance a stage (0.9)")
    st.add_argument("--force", action="store_true", help="override the registry's promotion gates (needs --reason)")
    st.add_argument("--reason")
    s2 = sub.add_parser("status", help="rollouts, their stage, counts and decisions")
    s2.add_argument("id", nargs="?", type=int)
    s2.add_argument("--json", action="store_true")
    for a in ("advance", "pause", "resume", "halt"):
        x = sub.add_parser(a, help=f"{a} a rollout")
        x.add_argument("id", type=int)
        x.add_argument("--reason")
    return p


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "serve":
        try:
            return serve(args.db, args.host, args.port, tick_s=args.tick, interval_s=args.interval)
        except OSError as e:
            print(f"error: rollout serve: {e} (another service on port {args.port}? pass --port)", file=sys.stderr)
            return 1
        except Exception as e:  # noqa: BLE001 - a database that cannot be reached or migrated: one line
            print(f"error: rollout serve: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 1
    from pipeline.engine.layout import ROOT
    from pipeline.fleet.registry import RegistryError

    client = Client(args.service)
    try:
        if args.cmd == "enroll":
            out = client.call("POST", "/v1/admin/devices", {"devices": [
                {"device_id": d, "device_class": args.device_class, "model": args.model, "channel": args.channel}
                for d in args.device_ids]})
            for d in out["devices"]:
                print(f"{d['device_id']} {d['token']}")
        elif args.cmd == "start":
            ro = start_from_registry(client, Path(root or ROOT), args.device, args.version, model=args.model,
                                     channel=args.channel, stages=args.stages,
                                     failure_threshold=args.failure_threshold, min_reports=args.min_reports,
                                     success_threshold=args.success_threshold, min_wait_s=args.min_wait,
                                     force=args.force, reason=args.reason)
            print("\n".join(describe(ro)))
        elif args.cmd == "status":
            ros = [client.call("GET", f"/v1/admin/rollouts/{args.id}")] if args.id else \
                client.call("GET", "/v1/admin/rollouts")["rollouts"]
            if args.json:
                print(json.dumps(ros if not args.id else ros[0], indent=2))
            elif not ros:
                print("no rollouts (python -m pipeline.fleet.rollout start DEVICE VERSION)")
            else:
                print("\n".join(line for ro in ros for line in describe(ro)))
        else:
            ro = client.call("POST", f"/v1/admin/rollouts/{args.id}/{args.cmd}", {"reason": args.reason})
            print("\n".join(describe(ro)[:1]))
    except ClientError as e:
        print(f"error: rollout {args.cmd}: {e}", file=sys.stderr)
        return e.code
    except RegistryError as e:
        print(f"error: rollout {args.cmd}: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
