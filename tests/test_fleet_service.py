"""The rollout service's rules and state (pipeline/fleet/policy.py, service.py, db.py), on SQLite and PostgreSQL.

These drive `Fleet` directly (no HTTP); tests/test_fleet_rollout.py runs the
service as users do, with real agents checking in over loopback."""

from __future__ import annotations

import json
import statistics

import pytest

from pipeline.fleet import policy
from pipeline.fleet.service import Fleet, FleetError


# ---------------------------------------------------------------- policy (pure)


def test_a_devices_bucket_is_fixed_and_the_buckets_spread_evenly():
    assert policy.bucket("phone-001") == policy.bucket("phone-001")
    b = [policy.bucket(f"dev-{i}") for i in range(4000)]
    assert all(0 <= x < 100 for x in b)
    assert 45 < statistics.mean(b) < 55
    assert 180 < sum(x < 5 for x in b) < 220  # 5% of 4000 = 200, within sampling spread


def test_stages_rise_to_100_and_say_what_is_wrong():
    s = policy.parse_stages("5:3:600,15,80,100")
    assert s[0] == policy.Stage(5, 3, 600) and s[1] == policy.Stage(15, 1, 0) and s[-1].percent == 100
    for bad, words in [("5,15,80", "last stage must be 100%"), ("15,5,100", "rise strictly"),
                       ("a,100", r"percent\[:min_devices"), ("", "at least one stage")]:
        with pytest.raises(ValueError, match=words):
            policy.parse_stages(bad)


def test_a_stage_holds_at_least_its_minimum_of_devices():
    buckets = [0.7, 3.0, 9.0, 40.0]
    assert policy.cutoff(5, 1, buckets[:1]) == 5              # 5% already holds one device
    c = policy.cutoff(5, 3, buckets[:3])                       # widened to the third-lowest device
    assert 9.0 < c < 9.0001 and sum(b < c for b in buckets) == 3
    assert policy.cutoff(100, 3, buckets[:3]) == 100
    assert policy.in_rollout(2.0, "running", 5) and not policy.in_rollout(6.0, "running", 5)
    assert not policy.in_rollout(2.0, "halted", 5) and policy.in_rollout(99.0, "completed", 5)


def _eval(counts, state="running", stage=0, stages="5:2:60,100"):
    return policy.evaluate(state=state, stages=policy.parse_stages(stages), stage=stage, counts=counts,
                           failure_threshold=0.1, min_reports=3, success_threshold=0.9)


def test_halt_needs_the_minimum_of_reports_and_a_failure_rate_above_the_threshold():
    assert _eval(policy.Counts(in_stage=10, healthy=0, failed=2, waited_s=0)) is None   # 2 < min_reports
    d = _eval(policy.Counts(in_stage=10, healthy=1, failed=2, waited_s=0))
    assert d.action == "halt" and d.numbers["failure_rate"] == pytest.approx(0.6667, abs=1e-4)
    assert "2 of 3 devices failed" in d.reason
    assert _eval(policy.Counts(in_stage=40, healthy=27, failed=3, waited_s=0)) is None  # 10%: not above


def test_advance_needs_the_success_share_the_minimum_devices_and_the_wait():
    assert _eval(policy.Counts(in_stage=10, healthy=9, failed=0, waited_s=10)) is None     # 60 s not waited
    assert _eval(policy.Counts(in_stage=10, healthy=8, failed=0, waited_s=99)) is None     # 80% < 90%
    assert _eval(policy.Counts(in_stage=1, healthy=1, failed=0, waited_s=99)) is None      # 1 < 2 devices
    d = _eval(policy.Counts(in_stage=10, healthy=9, failed=0, waited_s=99))
    assert d.action == "advance" and d.numbers["success_rate"] == 0.9
    assert _eval(policy.Counts(in_stage=10, healthy=10, failed=0, waited_s=0), stage=1).action == "complete"
    assert _eval(policy.Counts(in_stage=10, healthy=10, failed=0, waited_s=99), state="paused") is None


# ---------------------------------------------------------------- the service's state


def record(n: int, device="x86_avx512", model="m") -> str:
    bundle = f"{n:064x}"
    return json.dumps({"bundle_sha256": bundle, "device": device, "model": model, "version": f"v{n}",
                       "files": {"pack/model.onnx": {"sha256": bundle, "md5": bundle[:32], "bytes": n}}},
                      indent=2, sort_keys=True)


@pytest.fixture
def fleet(fleet_db_url):
    f = Fleet(fleet_db_url, interval_s=60)
    yield f
    f.close()


def _fleet_of(fleet, n, device="x86_avx512", model="m", prefix="d"):
    return {d["device_id"]: d["token"] for d in fleet.enroll(
        [{"device_id": f"{prefix}{i:03d}", "device_class": device, "model": model} for i in range(n)])}


def _checkin(fleet, tokens, dev, report=None, current=None, device="x86_avx512"):
    return fleet.checkin(tokens[dev], {"device_id": dev, "device_class": device, "model": "m",
                                       "current": current, "report": report})


def test_the_schema_migrates_once_even_when_services_start_together(fleet_db_url):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:   # four service processes starting at once on one database
        fleets = list(pool.map(lambda _: Fleet(fleet_db_url), range(4)))
    assert {f.revision for f in fleets} == {"0001"}
    assert Fleet(fleet_db_url).revision == "0001"   # a later start finds it current
    for f in fleets:
        f.close()


def test_check_ins_are_refused_by_name_without_the_devices_own_token(fleet):
    tokens = _fleet_of(fleet, 2)
    with pytest.raises(FleetError, match="device d000: token refused") as e:
        fleet.checkin("wrong", {"device_id": "d000"})
    assert e.value.status == 401
    with pytest.raises(FleetError, match="device d000: token refused"):
        fleet.checkin(tokens["d001"], {"device_id": "d000"})      # another device's token
    with pytest.raises(FleetError, match="not enrolled"):
        fleet.checkin(tokens["d000"], {"device_id": "ghost"})
    with pytest.raises(FleetError, match="enrolled as device_class 'x86_avx512', checked in as 'galaxy_s25'") as e:
        fleet.checkin(tokens["d000"], {"device_id": "d000", "device_class": "galaxy_s25"})
    assert e.value.status == 403
    assert _checkin(fleet, tokens, "d000") == {"assigned": None, "rollout": None, "interval_s": 60}
    with pytest.raises(FleetError, match="record: device token refused"):
        fleet.record("wrong", "0" * 64)
    old = tokens["d000"]
    tokens.update(_fleet_of(fleet, 1))                              # re-enrolling rotates the token
    with pytest.raises(FleetError, match="token refused"):
        fleet.checkin(old, {"device_id": "d000"})


def test_a_record_is_served_as_its_exact_bytes_under_its_sha256(fleet):
    import hashlib

    tokens = _fleet_of(fleet, 1)
    text = record(1)
    v = fleet.add_version(text)
    assert v["record_sha256"] == hashlib.sha256(text.encode()).hexdigest() and v["version"] == "v1"
    assert fleet.record(tokens["d000"], v["record_sha256"]) == text.encode()
    assert fleet.add_version(text) == v                              # idempotent
    with pytest.raises(FleetError, match="not a registry record"):
        fleet.add_version('{"no": "files"}')


def _start(fleet, stages="10:2,50,100", **kw):
    a = fleet.add_version(record(1))["record_sha256"]
    b = fleet.add_version(record(2))["record_sha256"]
    ro = fleet.start(device_class="x86_avx512", model="m", channel="stable", target=b, baseline=a,
                     stages=policy.parse_stages(stages), **kw)
    return ro, a, b


def test_a_stage_sends_the_version_to_its_devices_only_and_advances_on_their_reports(fleet):
    tokens = _fleet_of(fleet, 40)
    ro, a, b = _start(fleet)
    assert ro["state"] == "running" and ro["stage"] == 0
    got = {d: _checkin(fleet, tokens, d)["assigned"]["version"] for d in tokens}
    inside = {d for d, v in got.items() if v == "v2"}
    assert inside == {d for d in tokens if policy.bucket(d) < ro["cutoff"]} and len(inside) >= 2
    assert len(inside) < 40
    for d in sorted(inside):
        _checkin(fleet, tokens, d, {"bundle_sha256": f"{2:064x}", "outcome": "healthy"}, f"{2:064x}")
    st = fleet.status(ro["id"])
    assert st["stage"] >= 1, st["decisions"]
    adv = [x for x in st["decisions"] if x["action"] == "advance"][0]
    assert adv["by"] == "service" and adv["numbers"]["healthy"] == len(inside) and adv["numbers"]["stage"] == 0
    # a device that was in stays in
    assert all(_checkin(fleet, tokens, d)["assigned"]["version"] == "v2" for d in inside)


def test_failures_past_the_threshold_halt_it_and_every_device_goes_back_to_the_baseline(fleet):
    tokens = _fleet_of(fleet, 60)
    ro, a, b = _start(fleet, stages="20,100")
    inside = sorted(d for d in tokens if _checkin(fleet, tokens, d)["assigned"]["version"] == "v2")
    assert len(inside) >= 4
    for d in inside[:3]:
        _checkin(fleet, tokens, d, {"bundle_sha256": f"{2:064x}", "outcome": "failed", "detail": "tokens differ",
                                    "rolled_back_to": f"{1:064x}"}, f"{1:064x}")
    st = fleet.status(ro["id"])
    assert st["state"] == "halted"
    halt = st["decisions"][-1]
    assert halt["action"] == "halt" and halt["numbers"]["failed"] == 3 and halt["numbers"]["failure_rate"] == 1.0
    assert "3 of 3 devices failed" in halt["reason"]
    assert {_checkin(fleet, tokens, d)["assigned"]["version"] for d in tokens} == {"v1"}
    with pytest.raises(FleetError, match="needs a reason"):
        fleet.act(ro["id"], "resume")
    fleet.act(ro["id"], "resume", reason="the failing devices were a bad batch")
    # resumed: the devices that failed it are not sent it again; the others in the stage are
    after = {d: _checkin(fleet, tokens, d)["assigned"]["version"] for d in inside}
    assert all(after[d] == "v1" for d in inside[:3]) and all(after[d] == "v2" for d in inside[3:])


def test_the_operator_pauses_advances_and_halts_and_one_rollout_runs_per_fleet(fleet):
    tokens = _fleet_of(fleet, 20)
    ro, a, b = _start(fleet, stages="10,50,100")
    with pytest.raises(FleetError, match=f"rollout {ro['id']} .* is running") as e:
        fleet.start(device_class="x86_avx512", model="m", channel="stable", target=b, baseline=a,
                    stages=policy.parse_stages("100"))
    assert e.value.status == 409
    assert fleet.act(ro["id"], "pause")["state"] == "paused"
    with pytest.raises(FleetError, match="is paused: cannot pause"):
        fleet.act(ro["id"], "pause")
    st = fleet.act(ro["id"], "advance", reason="canary looks fine")
    assert st["stage"] == 1 and st["state"] == "paused" and st["decisions"][-1]["reason"] == "canary looks fine"
    assert fleet.act(ro["id"], "resume")["state"] == "running"
    fleet.act(ro["id"], "advance")
    st = fleet.act(ro["id"], "advance")
    assert st["state"] == "completed" and st["decisions"][-1]["action"] == "complete"
    assert {_checkin(fleet, tokens, d)["assigned"]["version"] for d in tokens} == {"v2"}
    assert [x["action"] for x in st["decisions"]] == ["start", "pause", "advance", "resume", "advance", "complete"]


def test_a_rollout_is_refused_for_unknown_or_foreign_versions(fleet):
    a = fleet.add_version(record(1))["record_sha256"]
    other = fleet.add_version(record(3, device="galaxy_s25"))["record_sha256"]
    with pytest.raises(FleetError, match="was never added"):
        fleet.start(device_class="x86_avx512", model="m", channel="stable", target="f" * 64, baseline=a,
                    stages=policy.parse_stages("100"))
    with pytest.raises(FleetError, match="is a galaxy_s25/m version"):
        fleet.start(device_class="x86_avx512", model="m", channel="stable", target=other, baseline=a,
                    stages=policy.parse_stages("100"))
