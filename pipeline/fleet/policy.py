"""Rollout policy: which devices a stage holds and when a stage advances or halts.

Pure functions of numbers, no I/O: the rollout service (pipeline/fleet/service.py)
counts from its database and asks here; the tests drive the rules directly.

- A device's place in a rollout is `bucket(device_id)`, a number in [0, 100)
  from a sha256 of its id: stable (a device that is in a stage stays in as the
  percentage grows), uniform, and the same on every service replica, so no
  coordinator decides it (Mender's and AWS IoT Jobs' phased rollouts, with
  the device set a function of the id rather than a random draw kept in a table).
- A stage is a percentage with a minimum number of healthy reports and a
  minimum wait (Mender's "5% -> 15% -> 80%, days apart", hawkBit's group
  success threshold). It advances when its devices' healthy share reaches the
  success threshold and both minimums are met.
- A rollout halts, at any stage, once at least `min_reports` devices reported
  on the version and the failed share is above `failure_threshold` (AWS IoT
  Jobs' abort config: a failure percentage after a minimum number of devices;
  Azure Device Update's failed count or percentage). A halted rollout assigns
  every device the baseline again: devices that took the version go back.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

STATES = ("running", "paused", "halted", "completed")
OK_OUTCOMES = ("healthy", "unchecked")


def bucket(device_id: str) -> float:
    """The device's fixed position in [0, 100) for every rollout."""
    return int(hashlib.sha256(device_id.encode()).hexdigest()[:13], 16) / 16**13 * 100.0


@dataclass(frozen=True)
class Stage:
    percent: float
    min_devices: int = 1
    min_wait_s: float = 0.0


def parse_stages(spec: str, *, min_devices: int = 1, min_wait_s: float = 0.0) -> list[Stage]:
    """'5,15,80,100' (or '5:3:600,...': percent[:min_devices[:min_wait_s]]) -> stages.

    Percentages must rise strictly and end at 100: a rollout that stops short of
    the fleet is a pause, not a plan."""
    stages = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        bits = part.split(":")
        try:
            pct = float(bits[0].rstrip("%"))
            n = int(bits[1]) if len(bits) > 1 and bits[1] else min_devices
            wait = float(bits[2]) if len(bits) > 2 and bits[2] else min_wait_s
        except ValueError:
            raise ValueError(f"stage {part!r}: expected percent[:min_devices[:min_wait_s]], e.g. 5:3:600")
        stages.append(Stage(pct, n, wait))
    check_stages(stages)
    return stages


def check_stages(stages: list[Stage]) -> None:
    if not stages:
        raise ValueError("a rollout needs at least one stage, e.g. --stages 5,15,80,100")
    last = 0.0
    for s in stages:
        if not 0 < s.percent <= 100 or s.percent <= last:
            raise ValueError(f"stage percentages must rise strictly within (0, 100]: {[x.percent for x in stages]}")
        if s.min_devices < 0 or s.min_wait_s < 0:
            raise ValueError("a stage's min_devices and min_wait_s cannot be negative")
        last = s.percent
    if last != 100:
        raise ValueError(f"the last stage must be 100%, not {last:g}% (pause a rollout to hold it short of the fleet)")


def stages_json(stages: list[Stage]) -> list[dict]:
    return [asdict(s) for s in stages]


def stages_from(rows: list[dict]) -> list[Stage]:
    return [Stage(**r) for r in rows]


def cutoff(percent: float, min_devices: int, buckets_sorted: list[float]) -> float:
    """The bucket below which devices are in a stage: its percentage, widened to
    hold at least min_devices of the enrolled devices (5% of a 20-device lab is one
    device, or none: the stage would wait forever for its minimum)."""
    if min_devices <= 0 or len([b for b in buckets_sorted[:min_devices] if b < percent]) >= min_devices:
        return percent
    k = min(min_devices, len(buckets_sorted))
    return max(percent, min(100.0, buckets_sorted[k - 1] + 1e-9)) if k else percent


def in_rollout(device_bucket: float, state: str, stage_cutoff: float) -> bool:
    """Whether a device runs the rollout's version (else the baseline)."""
    if state == "completed":
        return True
    if state == "halted":
        return False
    return device_bucket < stage_cutoff


@dataclass(frozen=True)
class Counts:
    """What the service counted for the rollout's version, over its devices so far."""
    in_stage: int      # enrolled devices inside the current stage (offline ones too: the threshold allows for them)
    healthy: int       # of those, reported healthy (or unchecked) on the version
    failed: int        # devices that reported the version failed (rolled back), any stage so far
    waited_s: float    # time since the current stage started


@dataclass(frozen=True)
class Decision:
    action: str        # "halt", "advance", "complete"
    numbers: dict
    reason: str


def evaluate(*, state: str, stages: list[Stage], stage: int, counts: Counts,
             failure_threshold: float, min_reports: int, success_threshold: float) -> Decision | None:
    """The automatic decision for a running rollout now, with the numbers behind it; None: wait."""
    if state != "running":
        return None
    s = stages[stage]
    reported = counts.healthy + counts.failed
    failure_rate = counts.failed / reported if reported else 0.0
    success_rate = counts.healthy / counts.in_stage if counts.in_stage else 0.0
    numbers = {"stage": stage, "percent": s.percent, "in_stage": counts.in_stage, "healthy": counts.healthy,
               "failed": counts.failed, "failure_rate": round(failure_rate, 4),
               "failure_threshold": failure_threshold, "min_reports": min_reports,
               "success_rate": round(success_rate, 4), "success_threshold": success_threshold,
               "min_devices": s.min_devices, "waited_s": round(counts.waited_s, 1), "min_wait_s": s.min_wait_s}
    if reported >= min_reports and failure_rate > failure_threshold:
        return Decision("halt", numbers, f"{counts.failed} of {reported} devices failed the version "
                        f"({failure_rate:.0%} > {failure_threshold:.0%} after at least {min_reports})")
    if (counts.in_stage and success_rate >= success_threshold and counts.healthy >= s.min_devices
            and counts.waited_s >= s.min_wait_s):
        why = (f"{counts.healthy} of {counts.in_stage} devices in the {s.percent:g}% stage healthy "
               f"({success_rate:.0%} >= {success_threshold:.0%}), waited {counts.waited_s:.0f} s of {s.min_wait_s:g}")
        return Decision("complete" if stage == len(stages) - 1 else "advance", numbers, why)
    return None
