"""How many device check-ins per second the rollout service holds, on SQLite and PostgreSQL.

    python benchmarks/fleet_load.py                                  # SQLite: 2,000 devices, 3 passes of 20 s
    python benchmarks/fleet_load.py --db postgresql://edgekiln:edgekiln@127.0.0.1/edgekiln_load
    python benchmarks/fleet_load.py --devices 5000 --seconds 30 --passes 3 --json out.json

The service runs as users run it (`python -m pipeline.fleet.rollout serve`,
its own process, one uvicorn worker) with a rollout running, so every
check-in does the real work: the device's token checked, its rollout looked
up, its assignment computed, its row updated; every 20th carries a health
report (a second write, and a policy evaluation). A load process on the same
host (loopback) keeps `--clients` persistent HTTP connections busy, each
checking in devices round-robin, for `--seconds` per pass. Per pass: check-ins
per second, p50 and p99 latency, errors. Nothing lost: the service's own
count (the sum of every device's `checkins` column) must equal the check-ins
the clients had answered 200, or the benchmark fails.

What it means for a fleet: devices checking in every I seconds make N/I
check-ins per second; the figure printed is the largest N one service process
on this database holds at I = 300 s. The load process shares the host's cores
with the service, so the figure is a floor for a service host of its own.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _client(url: str, devices: list[tuple[str, str]], seconds: float, report_every: int, bundle: str, q) -> None:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    lat, ok, errors, i = [], 0, 0, 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        dev, tok = devices[i % len(devices)]
        i += 1
        report = {"bundle_sha256": bundle, "outcome": "healthy", "detail": "load"} if i % report_every == 0 else None
        body = json.dumps({"device_id": dev, "device_class": "x86_avx512", "model": "load", "current": bundle,
                           "report": report})
        t0 = time.perf_counter()
        try:
            conn.request("POST", "/v1/checkin", body, {"Authorization": f"Bearer {tok}",
                                                       "Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status == 200:
                ok += 1
                lat.append(time.perf_counter() - t0)
            else:
                errors += 1
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    q.put({"ok": ok, "errors": errors, "lat": lat})


def _record(n: int) -> str:
    b = f"{n:064x}"
    return json.dumps({"bundle_sha256": b, "device": "x86_avx512", "model": "load", "version": f"v{n}",
                       "files": {"pack/model.onnx": {"sha256": b, "md5": b[:32], "bytes": 1}}})


def run(db: str, devices: int, seconds: float, passes: int, clients: int) -> dict:
    from pipeline.fleet.rollout import Client

    work = Path(tempfile.mkdtemp(prefix="edgekiln-fleet-load-"))
    if db == "sqlite":
        db = f"sqlite:///{work / 'fleet.db'}"
    env = {**os.environ, "EDGEKILN_FLEET_ADMIN_TOKEN": secrets.token_urlsafe(16)}
    svc = subprocess.Popen([sys.executable, "-m", "pipeline.fleet.rollout", "serve", "--db", db, "--port", "0",
                            "--tick", "5"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        line = svc.stdout.readline()
        while line and "rollout service:" not in line:
            line = svc.stdout.readline()
        m = re.search(r"http://[\d.]+:\d+", line or "")
        if not m:
            raise SystemExit(f"error: fleet_load: the service did not start: {line!r}")
        url = m.group(0)
        c = Client(url, env["EDGEKILN_FLEET_ADMIN_TOKEN"])
        toks = []
        for k in range(0, devices, 500):
            toks += [(d["device_id"], d["token"]) for d in c.call("POST", "/v1/admin/devices", {"devices": [
                {"device_id": f"load-{i:06d}", "device_class": "x86_avx512", "model": "load"}
                for i in range(k, min(devices, k + 500))]})["devices"]]
        a = c.call("POST", "/v1/admin/versions", {"record": _record(1)})["record_sha256"]
        b = c.call("POST", "/v1/admin/versions", {"record": _record(2)})["record_sha256"]
        c.call("POST", "/v1/admin/rollouts", {"device_class": "x86_avx512", "model": "load", "target": b,
                                              "baseline": a, "stages": [{"percent": 50, "min_devices": devices,
                                                                         "min_wait_s": 0},
                                                                        {"percent": 100, "min_devices": 1,
                                                                         "min_wait_s": 0}]})
        rows, answered = [], 0
        for p in range(passes):
            q = mp.Queue()
            share = [toks[i::clients] for i in range(clients)]
            procs = [mp.Process(target=_client, args=(url, share[i], seconds, 20, f"{2:064x}", q))
                     for i in range(clients)]
            t0 = time.perf_counter()
            for pr in procs:
                pr.start()
            got = [q.get() for _ in procs]
            for pr in procs:
                pr.join()
            wall = time.perf_counter() - t0
            lat = sorted(x for g in got for x in g["lat"])
            ok = sum(g["ok"] for g in got)
            answered += ok
            rows.append({"pass": p + 1, "checkins_per_s": ok / seconds, "ok": ok,
                         "errors": sum(g["errors"] for g in got),
                         "p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                         "p99_ms": 1000 * lat[int(len(lat) * 0.99)] if lat else None, "wall_s": wall})
            print(f"  pass {p + 1}: {rows[-1]['checkins_per_s']:.0f} check-ins/s, p50 {rows[-1]['p50_ms']:.1f} ms, "
                  f"p99 {rows[-1]['p99_ms']:.1f} ms, {rows[-1]['errors']} errors", flush=True)
        fleet = c.call("GET", "/v1/admin/rollouts")
        from pipeline.fleet.db import open_db
        import sqlalchemy as sa

        eng, t, _ = open_db(db)
        with eng.connect() as conn:
            counted = int(conn.execute(sa.select(sa.func.sum(t.devices.c.checkins))).scalar_one())
        eng.dispose()
        rates = [r["checkins_per_s"] for r in rows]
        out = {"db": db.split("@")[-1], "devices": devices, "clients": clients, "seconds": seconds, "passes": rows,
               "checkins_per_s": {"min": min(rates), "median": statistics.median(rates), "max": max(rates)},
               "p50_ms_median": statistics.median(r["p50_ms"] for r in rows),
               "p99_ms_max": max(r["p99_ms"] for r in rows),
               "answered": answered, "counted_by_service": counted, "lost": answered - counted,
               "fleet_at_300s": int(statistics.median(rates) * 300),
               "rollout_state": fleet["rollouts"][0]["state"]}
        if out["lost"] != 0:
            raise SystemExit(f"error: fleet_load: {answered} check-ins answered, the database counted {counted}")
        return out
    finally:
        svc.terminate()
        svc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="sqlite", help="sqlite (a fresh file) or a postgresql:// URL (an empty database)")
    ap.add_argument("--devices", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4, help="load processes, one connection each")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = run(a.db, a.devices, a.seconds, a.passes, a.clients)
    r = out["checkins_per_s"]
    print(f"{out['db']}: {r['median']:.0f} check-ins/s [{r['min']:.0f}-{r['max']:.0f}] over {a.passes} passes of "
          f"{a.seconds:g} s, p50 {out['p50_ms_median']:.1f} ms, p99 <= {out['p99_ms_max']:.1f} ms, "
          f"{out['answered']} answered = {out['counted_by_service']} counted (none lost); at one check-in per "
          f"device every 300 s that is a fleet of {out['fleet_at_300s']:,} devices per service process")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
