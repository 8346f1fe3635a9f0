"""The rollout service's fleet page: `GET /` renders `render(Fleet.fleet())`.

One self-contained HTML page, rendered on the server: no scripts, no external
assets, a little inline CSS, and a `<meta http-equiv="refresh">` so an open
page follows a rollout as devices check in. Every value from the fleet (device
classes, models, versions, operators' reasons, device details) goes through
`html.escape`, attributes included: a model named `<script>` is text here.

Per device class and model, a section with:

- the channels and their device counts;
- each rollout, newest first: target and baseline versions, its state
  (running, paused, halted, completed; a badge, a colour and a border each),
  the current stage of N with its percentage and cutoff, the counts (in the
  stage, healthy, failed, the failure and success rates against their
  thresholds), a bar of the stages, and its decisions (time, action, stage,
  by, reason, and the numbers behind each one, compactly);
- the devices by version and health (healthy, unchecked, failed, not
  reported) with when the last of them checked in.

Stable hooks for tests and scripts: `section.group[data-device-class][data-model]`,
`.chip[data-channel][data-devices]`,
`article.rollout[data-rollout-id][data-state][data-stage][data-stages]` (the stage counted from 1),
`[data-count=in_stage|healthy|failed]`, `tr.decision[data-action]`,
`tr[data-version]` with `td[data-col=devices|healthy|unchecked|failed|not-reported]`,
and `#empty` for a fleet with nothing in it yet.
"""

from __future__ import annotations

import datetime as _dt
import html
import json

REFRESH_S = 10
STATES = ("running", "paused", "halted", "completed")
HEALTH = ("healthy", "unchecked", "rolled_back", "failed", "not reported")
_BADGE = {"running": "\u25b6 running", "paused": "\u2016 paused", "halted": "\u25a0 halted",
          "completed": "\u2713 completed"}

CSS = """
:root { --ink:#1d2330; --muted:#5d6778; --line:#d9dee7; --bg:#f5f7fa; --card:#fff;
  --run:#1f6feb; --pause:#b7791f; --halt:#c62828; --done:#2e7d32; --unchk:#7c8db5; --none:#c9ced8; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 "DejaVu Sans", "Liberation Sans", system-ui, sans-serif; color: var(--ink);
  background: var(--bg); }
header { padding: 14px 24px; background: #1d2330; color: #fff; }
header h1 { margin: 0; font-size: 20px; font-weight: 600; }
header .sub { margin: 2px 0 0; color: #c3cad6; font-size: 13px; }
header .sub b { color: #fff; }
main { padding: 16px 24px 32px; max-width: 1200px; }
code, .mono { font-family: "DejaVu Sans Mono", "Liberation Mono", monospace; font-size: 12.5px; }
section.group { background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px;
  margin: 0 0 18px; }
section.group > h2 { margin: 0 0 4px; font-size: 17px; }
section.group > h2 .sep { color: var(--muted); font-weight: 400; padding: 0 4px; }
section.group h3 { margin: 14px 0 6px; font-size: 13px; text-transform: uppercase; letter-spacing: .04em;
  color: var(--muted); }
.meta { color: var(--muted); font-size: 13px; }
.chip { display: inline-block; padding: 0 8px; margin: 0 4px 0 0; border: 1px solid var(--line);
  border-radius: 10px; background: #f0f2f6; font-size: 12.5px; }
.rollout { border: 1px solid var(--line); border-left: 6px solid var(--muted); border-radius: 6px;
  padding: 10px 14px; margin: 0 0 10px; }
.rollout.state-running { border-left-color: var(--run); }
.rollout.state-paused { border-left-color: var(--pause); border-left-style: double; background: #fffaf0; }
.rollout.state-halted { border-left-color: var(--halt); background: #fff5f5; }
.rollout.state-completed { border-left-color: var(--done); }
.rollout .head { display: flex; flex-wrap: wrap; gap: 4px 12px; align-items: baseline; }
.badge { display: inline-block; padding: 1px 9px; border-radius: 4px; color: #fff; font-weight: 600;
  font-size: 12.5px; }
.badge.running { background: var(--run); }
.badge.paused { background: var(--pause); }
.badge.halted { background: var(--halt); }
.badge.completed { background: var(--done); }
.ver { font-weight: 600; }
.counts { display: flex; flex-wrap: wrap; gap: 4px 22px; margin: 8px 0 6px; }
.counts div { min-width: 70px; }
.counts dt { color: var(--muted); font-size: 12px; }
.counts dd { margin: 0; font-size: 16px; font-weight: 600; }
.counts dd small { font-size: 12px; font-weight: 400; color: var(--muted); }
.counts .bad dd { color: var(--halt); }
.bar { display: flex; gap: 2px; height: 18px; margin: 6px 0 2px; }
.seg { position: relative; background: #e8ebf0; border-radius: 3px; overflow: hidden; min-width: 28px; }
.seg .fill { position: absolute; inset: 0 auto 0 0; background: var(--run); opacity: .85; }
.seg.done .fill { background: var(--done); }
.seg.halted .fill { background: var(--halt); }
.seg.paused .fill { background: var(--pause); }
.seg span { position: relative; display: block; text-align: center; font-size: 11px; line-height: 18px;
  color: #1d2330; }
.seg.current { outline: 2px solid var(--ink); outline-offset: -2px; }
table { border-collapse: collapse; width: 100%; margin: 4px 0; }
th, td { text-align: left; padding: 4px 10px 4px 0; border-bottom: 1px solid var(--line); vertical-align: top; }
th { font-size: 12px; color: var(--muted); font-weight: 600; }
td.num, th.num { text-align: right; padding-right: 16px; font-variant-numeric: tabular-nums; }
table.decisions { font-size: 12.5px; margin-top: 8px; }
table.decisions td.numbers { color: var(--muted); }
table.decisions td.at { white-space: nowrap; }
tr.decision[data-action=halt] td.action { color: var(--halt); font-weight: 600; }
tr.decision[data-action=complete] td.action, tr.decision[data-action=advance] td.action { color: var(--done); }
.hbar { display: inline-flex; width: 120px; height: 9px; border-radius: 2px; overflow: hidden;
  vertical-align: middle; background: #eef0f4; }
.hbar i { display: block; height: 100%; }
.h-healthy { background: var(--done); } .h-unchecked { background: var(--unchk); }
.h-failed { background: var(--halt); } .h-rolled_back { background: #e0a030; } .h-not-reported { background: var(--none); }
td.failed.some { color: var(--halt); font-weight: 600; }
.tag { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 8px; margin-left: 6px;
  background: #e6edfb; color: #234; font-weight: 400; }
.tag.baseline { background: #eef0f4; }
#empty ol li { margin: 6px 0; }
.empty { color: var(--muted); font-style: italic; }
p.note { margin: -2px 0 4px; font-size: 12px; }
"""


def e(value) -> str:
    """A value as escaped text (attributes too: quotes are escaped)."""
    return html.escape("" if value is None else str(value), quote=True)


def _num(x, digits: int = 1) -> str:
    """12 -> '12', 0.25 -> '0.2' (digits after the point, trailing zeros dropped)."""
    try:
        s = f"{float(x):.{digits}f}"
    except (TypeError, ValueError):
        return str(x)
    return s.rstrip("0").rstrip(".") if "." in s else s


def _pct(fraction) -> str:
    try:
        return _num(float(fraction) * 100, 1) + "%"
    except (TypeError, ValueError):
        return str(fraction)


def _when(iso) -> _dt.datetime | None:
    try:
        t = _dt.datetime.fromisoformat(str(iso))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=_dt.timezone.utc)


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 90:
        return f"{s} s ago"
    if s < 90 * 60:
        return f"{s // 60} min ago"
    if s < 48 * 3600:
        return f"{s // 3600} h ago"
    return f"{s // 86400} d ago"


def _time(iso, now: _dt.datetime | None = None, *, date: bool = False) -> str:
    """<time> with the ISO stamp as its datetime and a short UTC reading (and how long ago, given now)."""
    if not iso:
        return '<span class="meta">never</span>'
    t = _when(iso)
    if t is None:
        return e(iso)
    t = t.astimezone(_dt.timezone.utc)
    shown = t.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S") + " UTC"
    if now is not None and not date:
        shown += f" ({_ago((now - t).total_seconds())})"
    return f'<time datetime="{e(iso)}" title="{e(iso)}">{e(shown)}</time>'


def _duration(s) -> str:
    try:
        s = float(s)
    except (TypeError, ValueError):
        return str(s)
    if s < 120:
        return f"{_num(s)} s"
    if s < 7200:
        return f"{_num(s / 60)} min"
    return f"{_num(s / 3600)} h"


# ---------------------------------------------------------------- rollouts


def _stage_label(st: dict) -> str:
    out = f"{_num(st.get('percent'))}%"
    extra = []
    if (st.get("min_devices") or 0) > 1:
        extra.append(f"\u2265{st['min_devices']} dev")
    if st.get("min_wait_s"):
        extra.append(f"wait {_duration(st['min_wait_s'])}")
    return out + (f" ({', '.join(extra)})" if extra else "")


def _decision_numbers(d: dict) -> str:
    """The numbers behind a decision, compactly (escaped)."""
    n = d.get("numbers") or {}
    if not isinstance(n, dict):
        return e(n)
    parts: list[str] = []
    if "stages" in n:  # a start: the plan and its thresholds
        stages = n.get("stages") or []
        parts.append("stages " + " \u2192 ".join(_stage_label(s) for s in stages if isinstance(s, dict)))
        if "failure_threshold" in n:
            parts.append(f"halt above {_pct(n['failure_threshold'])} failed after {n.get('min_reports', '?')} reports")
        if "success_threshold" in n:
            parts.append(f"advance at \u2265 {_pct(n['success_threshold'])} healthy")
        return e("; ".join(parts))
    if "failure_rate" in n:  # the policy's evaluation
        reported = (n.get("healthy") or 0) + (n.get("failed") or 0)
        cmp = ">" if (n.get("failure_rate") or 0) > (n.get("failure_threshold") or 0) else "\u2264"
        parts.append(f"failed {n.get('failed')}/{reported} = {_pct(n['failure_rate'])} "
                     f"{cmp} {_pct(n.get('failure_threshold'))} (min {n.get('min_reports')} reports)")
        if "success_rate" in n:
            cmp = "\u2265" if (n.get("success_rate") or 0) >= (n.get("success_threshold") or 0) else "<"
            parts.append(f"healthy {n.get('healthy')}/{n.get('in_stage')} = {_pct(n['success_rate'])} "
                         f"{cmp} {_pct(n.get('success_threshold'))}")
        if "waited_s" in n:
            parts.append(f"waited {_duration(n['waited_s'])} of {_duration(n.get('min_wait_s') or 0)}")
        return e(" \u00b7 ".join(parts))
    if "in_stage" in n:  # an operator's action: the counts when it was taken
        parts.append(f"in stage {n.get('in_stage')}, healthy {n.get('healthy')}, failed {n.get('failed')}")
        if "waited_s" in n:
            parts.append(f"waited {_duration(n['waited_s'])}")
        if "from_state" in n:
            stage = n.get("from_stage")
            parts.append(f"was {n['from_state']}" + (f" at stage {stage + 1}" if isinstance(stage, int) else ""))
        return e(" \u00b7 ".join(parts))
    return e(", ".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in sorted(n.items())))


def _decision_stage(d: dict) -> str:
    n = d.get("numbers") if isinstance(d.get("numbers"), dict) else {}
    stage = d.get("stage")
    if not isinstance(stage, int):
        return e(stage)
    before = n.get("stage", n.get("from_stage"))
    if d.get("action") == "advance" and isinstance(before, int) and before != stage:
        return e(f"{before + 1} \u2192 {stage + 1}")
    return e(stage + 1)


def _decisions(ro: dict) -> str:
    rows = []
    for d in sorted(ro.get("decisions") or [], key=lambda d: (str(d.get("at")), d.get("id") or 0), reverse=True):
        rows.append(
            f'<tr class="decision" data-action="{e(d.get("action"))}" data-decision-id="{e(d.get("id"))}">'
            f'<td class="at">{_time(d.get("at"), date=True)}</td><td class="action">{e(d.get("action"))}</td>'
            f'<td class="num stage">{_decision_stage(d)}</td><td class="by">{e(d.get("by"))}</td>'
            f'<td class="reason">{e(d.get("reason") or "")}</td>'
            f'<td class="numbers">{_decision_numbers(d)}</td></tr>')
    if not rows:
        return '<p class="empty">no decisions yet</p>'
    return ('<table class="decisions"><thead><tr><th>time</th><th>action</th><th class="num">stage</th><th>by</th>'
            '<th>reason</th><th>numbers</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>")


def _bar(ro: dict) -> str:
    """One segment per stage, as wide as the share of the fleet it adds; the current one filled by its healthy share."""
    stages = ro.get("stages") or []
    state, cur = ro.get("state"), ro.get("stage") or 0
    c = ro.get("counts") or {}
    in_stage, healthy, failed = c.get("in_stage") or 0, c.get("healthy") or 0, c.get("failed") or 0
    segs, last = [], 0.0
    for i, st in enumerate(stages):
        pct = float(st.get("percent") or 0)
        width = max(pct - last, 0.5)
        last = pct
        if state == "completed" or i < cur:
            cls, fill = "done", 100.0
        elif i == cur:
            cls = {"halted": "halted", "paused": "paused"}.get(state, "current-fill")
            share = (failed if state == "halted" else healthy) / in_stage if in_stage else 0.0
            fill = min(100.0, share * 100)
        else:
            cls, fill = "todo", 0.0
        current = " current" if i == cur and state != "completed" else ""
        segs.append(f'<div class="seg {cls}{current}" data-stage-index="{i}" style="flex-grow:{_num(width, 3)}" '
                    f'title="stage {i + 1}: {e(_stage_label(st))}"><div class="fill" style="width:{_num(fill, 1)}%">'
                    f'</div><span>{e(_num(pct))}%</span></div>')
    return f'<div class="bar" role="img" aria-label="stages of rollout {e(ro.get("id"))}">{"".join(segs)}</div>'


def _rollout(ro: dict) -> str:
    state = ro.get("state") or "?"
    stages = ro.get("stages") or []
    stage = ro.get("stage") or 0
    c = ro.get("counts") or {}
    in_stage, healthy, failed = c.get("in_stage") or 0, c.get("healthy") or 0, c.get("failed") or 0
    reported = healthy + failed
    failure_rate = failed / reported if reported else 0.0
    success_rate = healthy / in_stage if in_stage else 0.0
    ft, st = ro.get("failure_threshold"), ro.get("success_threshold")
    target = (ro.get("target") or {}).get("version")
    base = (ro.get("baseline") or {}).get("version")
    pct = ro.get("percent")
    cutoff = ro.get("cutoff")
    cut = f"cutoff {_num(cutoff)}"
    try:
        if float(cutoff) > float(pct) + 1e-6:
            cut += f" (widened from {_num(pct)}% to hold {stages[stage].get('min_devices')} devices)"
    except (TypeError, ValueError, IndexError, AttributeError):
        pass
    over = failure_rate > (ft or 0)
    waited = ""
    if state in ("running", "paused") and stages and stage < len(stages):
        waited = (f'<div data-count="waited"><dt>waited in this stage</dt><dd>{e(_duration(c.get("waited_s") or 0))} '
                  f'<small>of {e(_duration(stages[stage].get("min_wait_s") or 0))}</small></dd></div>')
    note = ""
    if state == "halted":
        note = (f'<p class="meta">halted: every device is back on <b>{e(base or "nothing")}</b> (the baseline); '
                f'<code>python -m pipeline.fleet.registry rollback {e(ro.get("device_class"))} '
                f'{e(ro.get("channel"))} --model {e(ro.get("model"))}</code> makes the registry say so</p>')
    elif state == "paused":
        note = f'<p class="meta">paused: <code>python -m pipeline.fleet.rollout resume {e(ro.get("id"))}</code></p>'
    return f"""
<article class="rollout state-{e(state)}" id="rollout-{e(ro.get('id'))}" data-rollout-id="{e(ro.get('id'))}"
 data-state="{e(state)}" data-stage="{e(stage + 1)}" data-stages="{e(len(stages))}"
 data-channel="{e(ro.get('channel'))}"
 data-target="{e(target)}" data-baseline="{e(base or '')}">
<div class="head"><span class="badge {e(state)}">{e(_BADGE.get(state, state))}</span>
<b>rollout {e(ro.get('id'))}</b>
<span>{e(ro.get('channel'))}: <span class="ver" data-role="target">{e(target)}</span>
from <span class="ver" data-role="baseline">{e(base or 'nothing')}</span></span>
<span class="meta stage-of">stage {e(stage + 1)} of {e(len(stages))} at {e(_num(pct))}% &middot; {e(cut)}</span>
<span class="meta">started {_time(ro.get('created_at'), date=True)} by {e(ro.get('created_by'))}</span></div>
{_bar(ro)}
<dl class="counts">
<div data-count="in_stage"><dt>in stage</dt><dd>{e(in_stage)}</dd></div>
<div data-count="healthy"><dt>healthy</dt><dd>{e(healthy)}</dd></div>
<div data-count="failed" class="{'bad' if failed else ''}"><dt>failed</dt><dd>{e(failed)}</dd></div>
<div data-count="failure_rate" class="{'bad' if over else ''}"><dt>failure rate</dt>
<dd>{e(_pct(failure_rate))} <small>{'&gt;' if over else '&le;'} {e(_pct(ft))} limit
(min {e(ro.get('min_reports'))} reports)</small></dd></div>
<div data-count="success_rate"><dt>healthy share</dt>
<dd>{e(_pct(success_rate))} <small>{'&ge;' if success_rate >= (st or 0) else '&lt;'} {e(_pct(st))}
to advance</small></dd></div>
{waited}
</dl>
{note}
{_decisions(ro)}
</article>"""


# ---------------------------------------------------------------- devices


def _versions(g: dict, now: _dt.datetime | None) -> str:
    by = g.get("by_version") or {}
    if not by:
        return '<p class="empty">no devices enrolled for this model</p>'
    latest = max(g.get("rollouts") or [], key=lambda r: r.get("id") or 0, default=None)
    roles = {}
    if latest:
        roles[(latest.get("target") or {}).get("version")] = "target"
        if latest.get("baseline"):
            roles.setdefault(latest["baseline"].get("version"), "baseline")
    rows = []
    for ver, slot in sorted(by.items(), key=lambda kv: (kv[0] == "none", -(kv[1].get("devices") or 0), str(kv[0]))):
        n = slot.get("devices") or 0
        health = slot.get("health") or {}
        counts = {h: health.get(h, 0) for h in HEALTH}
        counts["not reported"] += sum(v for k, v in health.items() if k not in HEALTH)  # an outcome this page predates
        bar = "".join(f'<i class="h-{h.replace(" ", "-")}" style="width:{_num(100 * counts[h] / n, 2)}%" '
                      f'title="{e(h)}: {e(counts[h])}"></i>' for h in HEALTH if n and counts[h])
        role = roles.get(ver)
        tag = f'<span class="tag {role}">{role}</span>' if role else ""
        cells = "".join(f'<td class="num {h.replace(" ", "-")}{" some" if counts[h] else ""}" '
                        f'data-col="{h.replace(" ", "-")}">{e(counts[h])}</td>' for h in HEALTH)
        rows.append(f'<tr data-version="{e(ver)}" data-devices="{e(n)}"><td class="ver">{e(ver)}{tag}</td>'
                    f'<td class="num" data-col="devices">{e(n)}</td><td><span class="hbar">{bar}</span></td>{cells}'
                    f'<td class="seen">{_time(slot.get("last_seen"), now)}</td></tr>')
    return ('<table class="versions"><thead><tr><th>version</th><th class="num">devices</th><th>health</th>'
            + "".join(f'<th class="num">{h.replace("_", " ")}</th>' for h in HEALTH)
            + "<th>last seen</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _group(i: int, g: dict, now: _dt.datetime | None) -> str:
    channels = g.get("channels") or {}
    chips = "".join(f'<span class="chip" data-channel="{e(ch)}" data-devices="{e(n)}">{e(ch)}: {e(n)}</span>'
                    for ch, n in sorted(channels.items()))
    rollouts = sorted(g.get("rollouts") or [], key=lambda r: r.get("id") or 0, reverse=True)
    if rollouts:
        body = "".join(_rollout(ro) for ro in rollouts)
    else:
        body = (f'<p class="empty">no rollout yet: <code>python -m pipeline.fleet.rollout start '
                f'{e(g.get("device_class"))} VERSION --model {e(g.get("model"))} --stages 5,15,80,100</code></p>')
    return f"""
<section class="group" id="group-{i}" data-device-class="{e(g.get('device_class'))}" data-model="{e(g.get('model'))}"
 data-devices="{e(g.get('devices') or 0)}">
<h2><span class="device-class">{e(g.get('device_class'))}</span><span class="sep">/</span><span
 class="model">{e(g.get('model'))}</span></h2>
<div class="meta">{e(g.get('devices') or 0)} devices &middot;
channels {chips or '<span class="empty">none</span>'}</div>
<h3>Rollouts</h3>
{body}
<h3>Devices by version and health</h3>
<p class="meta note">version: what each device last said it runs; health: its last report (rolled back: it failed
a newer version's health check and went back to this one)</p>
{_versions(g, now)}
</section>"""


EMPTY = """
<section class="group" id="empty">
<h2>No devices and no rollouts yet</h2>
<p>This page fills in as the fleet does:</p>
<ol>
<li>Enroll devices (each gets a token; only its sha256 is kept):
<br><code>python -m pipeline.fleet.rollout enroll phone-001 phone-002 --class galaxy_s25 --model embedded</code></li>
<li>Run the agent on each device (<code>pipeline/fleet/agent.py</code>, standard library only) with its token:
it checks in here, installs the version it is assigned, checks its health and reports how that went.
<br><code>python3 agent.py --service URL --token-file TOKEN_FILE --device-id phone-001 --device-class galaxy_s25
--model embedded --store STORE --root /opt/edgekiln</code></li>
<li>Start a staged rollout of a registry version:
<br><code>python -m pipeline.fleet.rollout start galaxy_s25 v2 --stages 5,15,80,100</code></li>
<li>Follow it here (the page reloads every {refresh} s)
or with <code>python -m pipeline.fleet.rollout status</code>.</li>
</ol>
</section>"""


def render(fleet: dict) -> str:
    """The fleet page for `Fleet.fleet()`'s dict: {"groups": [...], "at": ISO time}."""
    groups = list(fleet.get("groups") or [])
    at = fleet.get("at")
    now = _when(at) if at else None
    devices = sum(g.get("devices") or 0 for g in groups)
    states: dict[str, int] = {}
    for g in groups:
        for ro in g.get("rollouts") or []:
            states[ro.get("state")] = states.get(ro.get("state"), 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(states.items(), key=lambda kv: (
        STATES.index(kv[0]) if kv[0] in STATES else 99, str(kv[0]))))
    body = "".join(_group(i, g, now) for i, g in enumerate(groups)) if groups else \
        EMPTY.replace("{refresh}", str(REFRESH_S))
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_S}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>edgekiln fleet</title>
<style>{CSS}</style>
</head>
<body>
<header><h1>edgekiln fleet</h1>
<p class="sub" id="summary" data-devices="{e(devices)}" data-groups="{e(len(groups))}"><b>{e(devices)}</b> devices in
<b>{e(len(groups))}</b> device class/model groups &middot; rollouts: {e(summary or 'none')} &middot;
as of {_time(at, date=True) if at else 'now'} &middot; reloads every {REFRESH_S} s</p></header>
<main>
{body}
</main>
</body>
</html>
"""
