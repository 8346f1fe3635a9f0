"""Artifact registry and fleet rollouts: which build each device class runs now.

    python -m pipeline.fleet.registry publish BUILD                 # verify, push blobs, record version (on dev)
    python -m pipeline.fleet.registry promote DEVICE VERSION canary # then stable (gated on speed)
    python -m pipeline.fleet.registry rollback DEVICE stable        # the channel's previous version
    python -m pipeline.fleet.registry pull DEVICE --dest DIR        # fetch, re-hash every file, then hand over
    python -m pipeline.fleet.registry list | show | diff ... [--json]

Design, and why (the choice the issue asks to justify)
------------------------------------------------------
Blobs: DVC, unchanged. Every build stage's output is already a DVC output
(dvc.yaml is generated from the stage declarations) and sits in DVC's
content-addressed cache after `dvc repro`. `publish` runs `dvc push
--with-deps` on the build's stages, so the remote (a local path by default; S3,
SSH, GCS or Azure: whatever `dvc remote add` configured) holds every output of
the build, the shared model included, and a fresh clone with the remote
restores them with `dvc repro --pull` without running a stage. The registry
never copies a weight into git: git holds only `registry/`, a few KiB of YAML
and JSON.

Integrity: DVC's own pull does not re-hash what it downloads (the remote's
`verify` setting defaults to false), and DVC's md5 is not the sha256 the
stage manifests carry. So `publish` records, for every file of the bundle,
its full sha256, its size and its DVC address (md5), and checks first that the
md5s are exactly the ones dvc.lock's directory objects list (the bytes pushed
are the bytes recorded). `pull` fetches each blob from the remote through
DVC's remote object store (any remote type DVC supports), into a hidden staging
folder, checks size and sha256 of every file, then re-verifies each stage's
manifest and the bundle's sha256, and only then renames the folder into place.
A tampered or truncated blob is refused by name and nothing is handed over.
The local DVC cache is never trusted for this (a device pulls from the remote).

Index: `registry/index.yaml`, git-tracked, written by this module, readable by
a person (and by `--json` for scripts): per device class and model, the
versions (v1, v2, ...) with their bundle sha256, build, lineage summary,
parity and speed, and per channel (dev, canary, stable) an append-only history
of publish / promote / rollback events, each with who, when, and for a forced
promotion the reason. Each version's full record (every file's hashes, the
resolved build config, toolchain, lineage) is `registry/versions/<bundle
sha256>.json`: content-addressed, so republishing identical content is a
no-op. Commit `registry/` (and builds/, dvc.yaml, dvc.lock) to share a rollout.

Why not GTO and `dvc artifacts get`: GTO records versions and stage
assignments as git tags (`name@v1.0.0`, `name#stable#3`), which (a) makes every
publish and promotion a commit + tag pushed to the git remote, so a rollout
needs git write access and a gate's evidence (parity, the speed comparison, a
forced promotion's reason) can only live in a free-text tag message; (b) has no
gates at all, so the parity and noise-floor rules would be a wrapper anyway;
(c) wants each artifact declared in dvc.yaml's `artifacts:` section, but
dvc.yaml here is generated from the stage declarations (pipeline/engine/dvcgen.py)
and one artifact path per device class does not fit a registry where many
builds of one device class coexist under artifacts/<build>/. `dvc artifacts
get` downloads by md5 without re-hashing against a sha256 list, the
integrity check this registry exists for. What is kept from both: DVC remotes
and push for the blobs, GTO's vocabulary (versions; stages called channels,
promotion, rollback as "the previous assignment"), and its rule that the
version history is data in git, not in a server.

Gates:
- publish: every bundle stage's manifest must verify (re-hashed), and the
  parity report must say passed with every metric at or above its recorded
  threshold. A build that failed parity has no verify_parity output at all
  (the stage fails, nothing is cached), so it is refused here and, since
  every channel assignment starts from a published version, can reach none.
- promote to stable: the candidate's artifact decode tok/s passes against the
  current stable's (same device class and model), by the ratio of medians
  (pipeline/stats.compare) with the candidate build's benchmark.noise_floor
  (0.08 by default). "worse" beyond the floor is refused unless --force
  --reason "...", which the channel history records.
- promotion goes dev -> canary -> stable: a version must have been on the
  channel before (in its history) to be promoted; --force --reason skips it.
- rollback: each channel's history is replayed as a stack (publish/promote
  push, rollback pops); rollback pops the current version, restoring the one
  before it, and refuses when there is none.

Exit codes: 0 ok, 1 error, 2 usage, 3 refused by a gate, 4 integrity failure
(pull found a blob that does not match its recorded hash).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import getpass
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.engine.files import write_whole
from pipeline.engine.layout import ARTIFACTS, BUILDS, ROOT, canonical_json, model_id, sha256_text, stage_applies, stage_ref
from pipeline.engine.manifest import content_hash, verify
from pipeline.measure.stats import compare, spread

REGISTRY = "registry"
INDEX = f"{REGISTRY}/index.yaml"
VERSIONS = f"{REGISTRY}/versions"
FORMAT = "edgekiln-registry/1"
CHANNELS = ("dev", "canary", "stable")
# What a device gets: the artifact, its deploy profile, and the evidence.
BUNDLE_STAGES = ("pack", "compile_qnn", "deploy_profile", "verify_parity", "benchmark")
DEFAULT_NOISE_FLOOR = 0.08
RELEASE_FILE = "RELEASE.json"
_CHUNK = 1 << 20


class RegistryError(Exception):
    """A one-line error; exit 1."""

    code = 1


class GateRefused(RegistryError):
    code = 3


class IntegrityError(RegistryError):
    code = 4


# ---------------------------------------------------------------- hashing


def _hashes(path: Path) -> tuple[str, str, int]:
    """sha256 and md5 (DVC's address) of a file, in one read."""
    s, m = hashlib.sha256(), hashlib.md5()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            s.update(chunk)
            m.update(chunk)
            n += len(chunk)
    return s.hexdigest(), m.hexdigest(), n


def bundle_stages(device: dict) -> tuple[str, ...]:
    """The bundle's stages a build for this device has (no compile_qnn for a CPU)."""
    return tuple(s for s in BUNDLE_STAGES if stage_applies(s, device))


def record_stages(record: dict) -> tuple[str, ...]:
    """The stages a published version holds, as its lineage names them, in pipeline
    order (a stored record's keys come back sorted)."""
    held = record["lineage"]["stage_content_sha256"]
    return tuple(s for s in BUNDLE_STAGES if s in held) + tuple(sorted(set(held) - set(BUNDLE_STAGES)))


def bundle_files(folder: Path, stages=BUNDLE_STAGES) -> dict[str, dict]:
    """Every file under folder/<stage>/ (manifest.json included): sha256, md5, bytes."""
    files = {}
    for stage in stages:
        base = folder / stage
        for root, dirs, names in os.walk(base):
            dirs.sort()
            for n in sorted(names):
                p = Path(root) / n
                sha, md5, size = _hashes(p)
                files[p.relative_to(folder).as_posix()] = {"sha256": sha, "md5": md5, "bytes": size}
    return files


def bundle_sha256(files: dict[str, dict]) -> str:
    """The version's content address: sha256 over every file's path and sha256
    (the same rule as an artifact manifest's content_sha256)."""
    return content_hash(files)


# ---------------------------------------------------------------- gates (pure)


def _meets(value, rule: str) -> bool:
    """'>= 10' / '<= 0.25' (the parity report's artifact thresholds)."""
    op, _, bound = str(rule).partition(" ")
    if not isinstance(value, (int, float)):
        return False
    return value >= float(bound) if op == ">=" else value <= float(bound) if op == "<=" else False


def parity_gate(report: dict | None, summary_metrics: dict | None = None) -> dict:
    """Did the build pass parity (graph and packed artifact)? Raises GateRefused with the reason if not."""
    if not report:
        raise GateRefused("no parity report (verify_parity did not pass): a build that failed parity cannot be published")
    if report.get("passed") is not True:
        raise GateRefused("parity report does not say passed: refusing to publish")
    metrics, thresholds = report.get("metrics", {}), report.get("thresholds", {})
    if not thresholds:
        raise GateRefused("parity report has no thresholds: refusing to publish")
    low = [f"{k} {metrics.get(k)} < {v}" for k, v in thresholds.items()
           if not isinstance(metrics.get(k), (int, float)) or metrics[k] < v]
    art = report.get("artifact") or {}
    if art.get("applies"):
        am = {**(art.get("metrics") or {}), **(art.get("kld") or {})}  # the KLD gates check its statistics
        low += [f"artifact {k} {am.get(k)} not {rule}" for k, rule in (art.get("thresholds") or {}).items()
                if not _meets(am.get(k), rule)]
    if low:
        raise GateRefused("parity below thresholds: " + "; ".join(low))
    source = summary_metrics or metrics
    keep = ("logits_snr_db", "top1_agreement", "top5_agreement", "greedy_match", "prompts", "steps",
            "artifact_logits_snr_db", "artifact_top1_agreement", "artifact_kl_nats", "artifact_greedy_match",
            "artifact_kld_mean", "artifact_kld_p99", "artifact_ppl_ratio", "fp32_ppl")
    return {"passed": True, "thresholds": thresholds, "artifact_thresholds": art.get("thresholds"),
            "metrics": {k: source[k] for k in keep if k in source}}


def benchmark_summary(report: dict, noise_floor: float) -> dict:
    arm = report.get("artifact_arm")
    passes = (report.get("passes") or {}).get(arm) or []
    values = [float(p["decode_tok_s"]) for p in passes if p.get("decode_tok_s")]
    if not values:
        raise RegistryError(f"benchmark report has no decode_tok_s passes for the artifact arm {arm!r}")
    host = report.get("host") or {}
    return {
        "artifact_arm": arm,
        "decode_tok_s_passes": values,
        "decode_tok_s": spread(values),
        "noise_floor": noise_floor,
        "on_target": report.get("on_target"),
        "measured_on": host.get("cpu_model") or host.get("device_class"),
    }


def stable_gate(candidate: dict, stable: dict | None) -> dict:
    """Candidate vs the current stable of the same device class and model.

    Returns the comparison; `refused` is True when the candidate is slower
    beyond the noise floor (the candidate build's benchmark.noise_floor).
    """
    if stable is None:
        return {"refused": False, "verdict": "no current stable", "ratio": None}
    cb, sb = candidate["benchmark"], stable["benchmark"]
    floor = float(cb.get("noise_floor", DEFAULT_NOISE_FLOOR))
    cmp = compare(cb["decode_tok_s_passes"], sb["decode_tok_s_passes"], noise_floor=floor)
    out = {
        **cmp,
        "refused": cmp["verdict"] == "worse",
        "against": stable["version"],
        "candidate_median": statistics.median(cb["decode_tok_s_passes"]),
        "stable_median": statistics.median(sb["decode_tok_s_passes"]),
    }
    if cb.get("measured_on") != sb.get("measured_on") or cb.get("on_target") != sb.get("on_target"):
        out["note"] = (f"measured on different hosts ({cb.get('measured_on')}, on_target={cb.get('on_target')} vs "
                       f"{sb.get('measured_on')}, on_target={sb.get('on_target')})")
    return out


# ---------------------------------------------------------------- index


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _who() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in a container
        return "unknown"


def load_index(root: Path) -> dict:
    path = root / INDEX
    if not path.is_file():
        return {"format": FORMAT, "channels": list(CHANNELS), "devices": {}}
    try:
        index = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise RegistryError(f"{INDEX}: unreadable ({e.__class__.__name__})")
    if index.get("format") != FORMAT:
        raise RegistryError(f"{INDEX}: format {index.get('format')!r}, expected {FORMAT!r}")
    index.setdefault("devices", {})
    return index


def save_index(root: Path, index: dict) -> None:
    for models in index["devices"].values():
        for entry in models.values():
            for name, ch in entry.get("channels", {}).items():
                ch["current"] = channel_current(ch)
    header = ("# edgekiln artifact registry: written by `python -m pipeline.fleet.registry`; commit it.\n"
              "# Full records (every file's sha256): registry/versions/<bundle_sha256>.json\n")
    write_whole(root / INDEX, header + yaml.safe_dump(index, sort_keys=False, width=120))


def load_record(root: Path, bundle: str) -> dict:
    path = root / VERSIONS / f"{bundle}.json"
    if not path.is_file():
        raise RegistryError(f"{path.relative_to(root)}: version record missing (registry/ not fully committed?)")
    record = json.loads(path.read_text())
    if bundle_sha256(record["files"]) != bundle or record.get("bundle_sha256") != bundle:
        raise IntegrityError(f"{path.relative_to(root)}: record does not hash to its name (edited record)")
    return record


def channel_stack(channel: dict) -> list[str]:
    """Replay a channel's history: publish/promote push a version, rollback pops."""
    stack: list[str] = []
    for ev in channel.get("history", []):
        if ev["action"] == "rollback":
            if stack:
                stack.pop()
        else:
            stack.append(ev["version"])
    return stack


def channel_current(channel: dict) -> str | None:
    stack = channel_stack(channel)
    return stack[-1] if stack else None


def _entry(index: dict, device: str, model: str | None) -> tuple[str, dict]:
    models = index["devices"].get(device)
    if not models:
        known = ", ".join(sorted(index["devices"])) or "none"
        raise RegistryError(f"no versions for device class {device!r} (published: {known})")
    if model is None:
        if len(models) > 1:
            raise RegistryError(f"device class {device!r} has several models ({', '.join(sorted(models))}): pass --model")
        model = next(iter(models))
    if model not in models:
        raise RegistryError(f"no versions of model {model!r} for {device!r} (models: {', '.join(sorted(models))})")
    return model, models[model]


def _version(entry: dict, ref: str) -> dict:
    """A version by name (v3), by channel (stable: its current), or by bundle sha256 prefix."""
    if ref in CHANNELS:
        cur = channel_current(entry.get("channels", {}).get(ref, {}))
        if cur is None:
            raise RegistryError(f"channel {ref!r} has no version")
        ref = cur
    hits = [v for v in entry["versions"] if v["version"] == ref]
    if not hits and len(ref) >= 8:
        hits = [v for v in entry["versions"] if v["bundle_sha256"].startswith(ref)]
    if len(hits) != 1:
        known = ", ".join(v["version"] for v in entry["versions"])
        raise RegistryError(f"no version {ref!r} (versions: {known}; or a channel: {', '.join(CHANNELS)})")
    return hits[0]


def _check_channel(name: str) -> None:
    if name not in CHANNELS:
        raise RegistryError(f"unknown channel {name!r}; channels are: {', '.join(CHANNELS)}")


# ---------------------------------------------------------------- DVC plumbing


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True, env=env)


def _repo(root: Path):
    from dvc.repo import Repo

    try:
        return Repo(str(root))
    except Exception as e:  # noqa: BLE001 - DVC raises many kinds
        raise RegistryError(f"{root}: not a DVC repository ({e})")


def _remote_odb(repo, remote: str | None):
    try:
        return repo.cloud.get_remote_odb(remote, "pull")
    except Exception as e:  # noqa: BLE001
        msg = str(e).splitlines()[0]
        raise RegistryError(f"DVC remote: {msg} (add one: python -m pipeline.fleet.registry remote add NAME URL)")


def _lock_dir_md5s(root: Path, repo, build: str, stage: str) -> dict[str, str]:
    """relpath -> md5 of artifacts/<build>/<stage> as dvc.lock records it."""
    lock_path = root / "dvc.lock"
    if not lock_path.is_file():
        raise RegistryError("no dvc.lock: build first (python -m pipeline ...)")
    lock = yaml.safe_load(lock_path.read_text()) or {}
    out_path = f"{ARTIFACTS}/{build}/{stage}"
    st = (lock.get("stages") or {}).get(stage_ref(build, stage)) or {}
    outs = [o for o in st.get("outs", []) if o.get("path") == out_path]
    if not outs:
        raise RegistryError(f"dvc.lock has no output {out_path}: build {build} is not up to date (rerun it)")
    oid = outs[0]["md5"]
    dir_obj = Path(repo.cache.local.oid_to_path(oid))
    if not dir_obj.is_file():
        raise RegistryError(f"{out_path}: DVC cache lacks its directory object {oid} (run dvc pull or rebuild)")
    return {e["relpath"]: e["md5"] for e in json.loads(dir_obj.read_text())}


# ---------------------------------------------------------------- publish


def _git(root: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return ""


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def collect(root: Path, build: str) -> dict:
    """Everything a version records about a finished build, gates applied (no I/O to the remote)."""
    from pipeline.engine.context import StageError

    cfg_path = root / BUILDS / f"{build}.yaml"
    if not cfg_path.is_file():
        raise RegistryError(f"no registered build {build!r} ({BUILDS}/{build}.yaml)")
    cfg = yaml.safe_load(cfg_path.read_text())
    base = root / ARTIFACTS / build
    if not (base / "verify_parity" / "manifest.json").is_file():
        raise GateRefused(f"{build}: no verify_parity output: the build failed parity (or never ran it); "
                          "a build that failed parity cannot be published")
    stages = bundle_stages(cfg["device"])
    manifests = {}
    for stage in stages:
        try:
            manifests[stage] = verify(base / stage, expect_stage=stage)
        except StageError as e:
            raise RegistryError(f"{build}: {e}")
    parity = parity_gate(_read_json(base / "verify_parity" / "report.json"),
                         manifests["verify_parity"]["result"].get("metrics"))
    parity["artifact_weight_path"] = manifests["verify_parity"]["result"].get("weight_path")
    noise_floor = float((cfg.get("benchmark") or {}).get("noise_floor", DEFAULT_NOISE_FLOOR))
    bench_report = _read_json(base / "benchmark" / "report.json")
    if not bench_report:
        raise RegistryError(f"{build}: benchmark/report.json unreadable")
    bench = benchmark_summary(bench_report, noise_floor)
    bench["metrics"] = manifests["benchmark"]["result"].get("metrics", {})

    # The health check a device runs on this version once installed (its agent fails and rolls back the version
    # on a non-zero exit, other tokens, or decode_tok_s below decode_tok_s x (1 - noise_floor)): the deploy
    # profile's command (`{python}`: the device's runtime interpreter; cwd: the version folder), the tokens
    # verify_parity decoded from the same ids with the artifact's runtime, and the benchmark's decode speed of
    # the artifact in genai's own loop (the ort_int4_genai arm's median) where it measured the target device
    # class; a cross-measured figure is another CPU's, so null (the agent then checks the tokens alone).
    # A weight path whose profile names no health check gets no `health` key (the agent reports "unchecked").
    health = None
    spec = ((_read_json(base / "deploy_profile" / "profile.json") or {}).get("on_device") or {}).get("health")
    if spec and spec.get("command"):
        expect = (_read_json(base / "verify_parity" / "report.json") or {}).get("health") or {}
        if not expect.get("tokens"):
            raise RegistryError(f"{build}: the deploy profile names a health check but verify_parity/report.json "
                                "records no tokens for it (rerun python -m pipeline for the build)")
        if [int(t) for t in expect.get("prompt_ids") or []] != [int(t) for t in spec["prompt_ids"]]:
            raise RegistryError(f"{build}: verify_parity's health tokens are for ids {expect.get('prompt_ids')}, "
                                f"the deploy profile's command for {spec['prompt_ids']}")
        arm = "ort_int4_genai"
        speeds = [float(p["decode_tok_s"]) for p in (bench_report.get("passes") or {}).get(arm) or []
                  if p.get("decode_tok_s")]
        if not speeds:
            decode, source = None, f"null: the benchmark ran no {arm} arm (onnxruntime-genai not installed there)"
        elif not bench_report.get("on_target"):
            decode = None
            source = (f"null: the benchmark's {arm} arm was cross-measured on {bench['measured_on']} "
                      f"({(bench_report.get('host') or {}).get('device_class')}), not a {cfg['device']['name']}: "
                      "no figure of the device")
        else:
            decode = statistics.median(speeds)
            source = (f"the benchmark's {arm} arm: the median of {len(speeds)} passes on "
                      f"{bench['measured_on']} (prompt {(bench_report.get('settings') or {}).get('prompt_length')}, "
                      f"{(bench_report.get('settings') or {}).get('decode_tokens')} tokens decoded)")
        health = {
            "command": list(spec["command"]),
            "tokens": [int(t) for t in expect["tokens"]],
            "decode_tok_s": decode,
            "noise_floor": noise_floor,
            "timeout_s": int(spec.get("timeout_s") or 300),
            "prompt": spec.get("prompt"),
            "prompt_ids": [int(t) for t in spec["prompt_ids"]],
            "new_tokens": int(spec["new_tokens"]),
            "decode_tok_s_from": source,
            "tokens_from": f"verify_parity: {expect.get('runtime')}, {expect.get('how')}",
        }

    device = ((manifests["benchmark"]["key"].get("params") or {}).get("device") or {}).get("name") \
        or cfg["device"]["name"]
    toolchain: dict = {}
    for stage in stages:
        toolchain.update(manifests[stage]["key"].get("toolchain") or {})
    uh = _read_json(base / "untie_head" / "manifest.json") or {}
    files = bundle_files(base, stages)
    commit = _git(root, "rev-parse", "HEAD")
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", "pipeline", "stages", "conf"))
    lineage = {
        "model": cfg["model"]["name"],
        "model_id": model_id(cfg["model"]),
        "model_sha256": (uh.get("key") or {}).get("inputs", {}).get("model"),
        "device_class": device,
        "config_sha256": sha256_text(canonical_json(cfg)),
        "stage_config_sha256": {s: manifests[s]["config_hash"] for s in stages},
        "stage_content_sha256": {s: manifests[s]["content_sha256"] for s in stages},
        "toolchain": dict(sorted(toolchain.items())),
        "source_commit": commit or None,
        "source_dirty": dirty,
    }
    return {
        "format": FORMAT,
        "bundle_sha256": bundle_sha256(files),
        "build": build,
        "device": device,
        "model": cfg["model"]["name"],
        "lineage": lineage,
        "parity": parity,
        "benchmark": bench,
        "config": cfg,
        "files": files,
        **({"health": health} if health else {}),
    }


def publish(root: Path, build: str, *, channel: str = "dev", remote: str | None = None, push: bool = True) -> dict:
    _check_channel(channel)
    record = collect(root, build)
    repo = _repo(root)
    try:
        # The bytes recorded are the bytes DVC tracks (and pushes).
        for stage in record_stages(record):
            tracked = _lock_dir_md5s(root, repo, build, stage)
            mine = {k.split("/", 1)[1]: v["md5"] for k, v in record["files"].items() if k.startswith(stage + "/")}
            if tracked != mine:
                bad = sorted(set(tracked.items()) ^ set(mine.items()))[0][0]
                raise RegistryError(f"{ARTIFACTS}/{build}/{stage}/{bad}: differs from dvc.lock: the build is not up "
                                    "to date with DVC (rerun python -m pipeline for it)")
        if push:
            odb = _remote_odb(repo, remote)
            prefix = stage_ref(build, "")
            dvc_yaml = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
            targets = [s for s in (dvc_yaml.get("stages") or {}) if s.startswith(prefix)]
            proc = _dvc(root, "push", "--with-deps", *(["-r", remote] if remote else []), *targets)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()
                raise RegistryError(f"dvc push failed: {tail[-1] if tail else proc.returncode}")
            for rel, meta in record["files"].items():
                if not odb.fs.exists(odb.oid_to_path(meta["md5"])):
                    raise RegistryError(f"{rel}: not on the remote after dvc push")
    finally:
        repo.close()

    index = load_index(root)
    models = index["devices"].setdefault(record["device"], {})
    entry = models.setdefault(record["model"], {"versions": [], "channels": {}})
    for v in entry["versions"]:
        if v["bundle_sha256"] == record["bundle_sha256"]:
            return {**v, "already_published": True}
    version = f"v{len(entry['versions']) + 1}"
    record["version"] = version
    record["published_at"] = _now()
    write_whole(root / VERSIONS / f"{record['bundle_sha256']}.json",
                  json.dumps(record, indent=2, sort_keys=True) + "\n")
    summary = {
        "version": version,
        "bundle_sha256": record["bundle_sha256"],
        "build": build,
        "published_at": record["published_at"],
        "model_sha256": record["lineage"]["model_sha256"],
        "config_sha256": record["lineage"]["config_sha256"],
        "source_commit": record["lineage"]["source_commit"],
        "parity": {k: record["parity"]["metrics"].get(k) for k in ("logits_snr_db", "greedy_match", "artifact_logits_snr_db")},
        "decode_tok_s": record["benchmark"]["decode_tok_s"],
    }
    entry["versions"].append(summary)
    ch = entry["channels"].setdefault(channel, {"history": []})
    ch["history"].append({"action": "publish", "version": version, "at": _now(), "by": _who()})
    save_index(root, index)
    return summary


# ---------------------------------------------------------------- promote / rollback


def promote(root: Path, device: str, ref: str, channel: str, *, model: str | None = None,
            force: bool = False, reason: str | None = None) -> dict:
    _check_channel(channel)
    if force and not (reason and reason.strip()):
        raise RegistryError("--force needs --reason \"...\" (it is recorded in the channel history)")
    index = load_index(root)
    model, entry = _entry(index, device, model)
    v = _version(entry, ref)
    record = load_record(root, v["bundle_sha256"])
    if not record["parity"].get("passed"):
        raise GateRefused(f"{v['version']}: failed parity; it cannot be on any channel")
    channels = entry.setdefault("channels", {})
    ch = channels.setdefault(channel, {"history": []})
    if channel_current(ch) == v["version"]:
        raise RegistryError(f"{v['version']} is already current on {channel}")
    event = {"action": "promote", "version": v["version"], "at": _now(), "by": _who()}
    forced = []
    pos = CHANNELS.index(channel)
    if pos > 0:
        before = CHANNELS[pos - 1]
        seen = [e["version"] for e in channels.get(before, {}).get("history", [])]
        if v["version"] not in seen:
            if not force:
                raise GateRefused(f"{v['version']} was never on {before}: promote it there first "
                                  f"(or --force --reason)")
            forced.append(f"skipped {before}")
    gate = None
    if channel == "stable":
        cur = channel_current(ch)
        stable = load_record(root, _version(entry, cur)["bundle_sha256"]) if cur else None
        gate = stable_gate(record, stable)
        event["gate"] = {k: gate[k] for k in ("verdict", "ratio", "noise_floor", "against", "note") if k in gate}
        if gate["refused"]:
            if not force:
                raise GateRefused(
                    f"{v['version']} regresses against stable {gate['against']}: decode {gate['candidate_median']:.1f} "
                    f"vs {gate['stable_median']:.1f} tok/s (ratio {gate['ratio']:.3f}, beyond the "
                    f"{gate['noise_floor']:.0%} noise floor); promote with --force --reason \"...\" to override")
            forced.append(f"speed regression ratio {gate['ratio']:.3f}")
    if force:
        event["forced"] = forced or ["nothing to override"]
        event["reason"] = reason.strip()
    ch["history"].append(event)
    save_index(root, index)
    return {"device": device, "model": model, "channel": channel, **event}


def rollback(root: Path, device: str, channel: str, *, model: str | None = None, reason: str | None = None) -> dict:
    _check_channel(channel)
    index = load_index(root)
    model, entry = _entry(index, device, model)
    ch = entry.get("channels", {}).get(channel, {"history": []})
    stack = channel_stack(ch)
    if len(stack) < 2:
        raise RegistryError(f"{device}/{model} {channel}: no previous version to roll back to "
                            f"(current: {stack[-1] if stack else 'none'})")
    event = {"action": "rollback", "version": stack[-2], "from": stack[-1], "at": _now(), "by": _who()}
    if reason:
        event["reason"] = reason
    entry["channels"].setdefault(channel, ch)["history"].append(event)
    save_index(root, index)
    return {"device": device, "model": model, "channel": channel, **event}


# ---------------------------------------------------------------- pull


def pull(root: Path, device: str, dest: Path, *, model: str | None = None, channel: str | None = None,
         version: str | None = None, remote: str | None = None, force: bool = False) -> dict:
    """Fetch a version's blobs from the remote; hand over only what re-hashes right."""
    from pipeline.engine.context import StageError

    if channel and version:
        raise RegistryError("pass --channel or --version, not both")
    ref = version or channel or "stable"
    if channel:
        _check_channel(channel)
    index = load_index(root)
    model, entry = _entry(index, device, model)
    v = _version(entry, ref)
    record = load_record(root, v["bundle_sha256"])
    dest = dest.resolve()
    if dest.exists() and not force:
        raise RegistryError(f"{dest}: exists (pass --force to replace it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.parent / f".{dest.name}.pull-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    repo = _repo(root)
    try:
        odb = _remote_odb(repo, remote)
        for rel, meta in sorted(record["files"].items()):
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            src = odb.oid_to_path(meta["md5"])
            try:
                odb.fs.get_file(src, str(target))
            except FileNotFoundError:
                raise IntegrityError(f"{rel}: blob {meta['md5']} is not on the remote")
            except Exception as e:  # noqa: BLE001 - remote filesystems raise their own kinds
                raise RegistryError(f"{rel}: fetching blob {meta['md5']}: {e}")
            sha, _, size = _hashes(target)
            if size != meta["bytes"]:
                raise IntegrityError(f"{rel}: refused: {size} bytes on the remote, {meta['bytes']} recorded "
                                     f"(truncated or replaced blob {src})")
            if sha != meta["sha256"]:
                raise IntegrityError(f"{rel}: refused: sha256 {sha[:16]}... does not match the recorded "
                                     f"{meta['sha256'][:16]}... (tampered blob {src})")
        for stage in record_stages(record):
            try:
                verify(staging / stage, expect_stage=stage)
            except StageError as e:
                raise IntegrityError(f"refused: {e}")
        if bundle_sha256(bundle_files(staging, record_stages(record))) != record["bundle_sha256"]:
            raise IntegrityError("refused: the fetched bundle does not hash to the version's bundle sha256")
        release = {k: record[k] for k in ("version", "bundle_sha256", "build", "device", "model", "lineage", "published_at")}
        release["pulled_as"] = ref
        release["pulled_at"] = _now()
        (staging / RELEASE_FILE).write_text(json.dumps(release, indent=2, sort_keys=True) + "\n")
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.rename(dest, old)
            os.rename(staging, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, dest)
    finally:
        repo.close()
        shutil.rmtree(staging, ignore_errors=True)
    return {"device": device, "model": model, "version": v["version"], "bundle_sha256": v["bundle_sha256"],
            "dest": str(dest), "files": len(record["files"])}


# ---------------------------------------------------------------- read side


def listing(root: Path, device: str | None = None, model: str | None = None) -> list[dict]:
    index = load_index(root)
    rows = []
    for dev, models in sorted(index["devices"].items()):
        if device and dev != device:
            continue
        for mod, entry in sorted(models.items()):
            if model and mod != model:
                continue
            current = {c: channel_current(entry.get("channels", {}).get(c, {})) for c in CHANNELS}
            for v in entry["versions"]:
                rows.append({"device": dev, "model": mod, **v,
                             "channels": [c for c in CHANNELS if current[c] == v["version"]]})
    if device and not rows:
        raise RegistryError(f"no versions for device class {device!r}")
    return rows


def show(root: Path, device: str, ref: str | None = None, model: str | None = None) -> dict:
    index = load_index(root)
    model, entry = _entry(index, device, model)
    if ref is None:
        return {"device": device, "model": model, "versions": entry["versions"],
                "channels": {c: {"current": channel_current(ch), "history": ch.get("history", [])}
                             for c, ch in entry.get("channels", {}).items()}}
    v = _version(entry, ref)
    record = load_record(root, v["bundle_sha256"])
    record["channels"] = [c for c in CHANNELS if channel_current(entry.get("channels", {}).get(c, {})) == v["version"]]
    return record


def _flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _changes(a: dict, b: dict) -> dict:
    fa, fb = _flatten(a), _flatten(b)
    return {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def diff(root: Path, device: str, a: str, b: str, model: str | None = None) -> dict:
    index = load_index(root)
    model, entry = _entry(index, device, model)
    ra = load_record(root, _version(entry, a)["bundle_sha256"])
    rb = load_record(root, _version(entry, b)["bundle_sha256"])
    floor = float(rb["benchmark"].get("noise_floor", DEFAULT_NOISE_FLOOR))
    speed = compare(rb["benchmark"]["decode_tok_s_passes"], ra["benchmark"]["decode_tok_s_passes"], noise_floor=floor)
    return {
        "device": device, "model": model, "a": ra["version"], "b": rb["version"],
        "builds": [ra["build"], rb["build"]],
        "config": _changes(ra["config"], rb["config"]),
        "toolchain": _changes(ra["lineage"]["toolchain"], rb["lineage"]["toolchain"]),
        "lineage": _changes({k: v for k, v in ra["lineage"].items() if k != "toolchain"},
                            {k: v for k, v in rb["lineage"].items() if k != "toolchain"}),
        "parity": {k: [ra["parity"]["metrics"].get(k), rb["parity"]["metrics"].get(k)]
                   for k in sorted(set(ra["parity"]["metrics"]) | set(rb["parity"]["metrics"]))},
        "speed": {"decode_tok_s": [ra["benchmark"]["decode_tok_s"], rb["benchmark"]["decode_tok_s"]],
                  "b_vs_a": speed},
        "files_changed": sorted(k for k in set(ra["files"]) | set(rb["files"])
                                if (ra["files"].get(k) or {}).get("sha256") != (rb["files"].get(k) or {}).get("sha256")),
    }


# ---------------------------------------------------------------- remote


def remote_cmd(root: Path, action: str | None, name: str | None, url: str | None) -> str:
    if action is None or action == "list":
        proc = _dvc(root, "remote", "list")
        default = _dvc(root, "remote", "default").stdout.strip()
        text = proc.stdout.strip() or "(no DVC remote: python -m pipeline.fleet.registry remote add NAME URL)"
        return text + (f"\ndefault: {default}" if default else "")
    if action == "add":
        if not (name and url):
            raise RegistryError("remote add needs NAME URL (a local path, s3://, ssh://, gs://, azure://)")
        proc = _dvc(root, "remote", "add", "--force", "-d", name, url)
        if proc.returncode != 0:
            raise RegistryError(f"dvc remote add: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}")
        return f"remote {name} -> {url} (default; recorded in .dvc/config: commit it)"
    raise RegistryError(f"unknown remote action {action!r}: list or add")


# ---------------------------------------------------------------- CLI


def _fmt_tok(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}] n={s['n']}"


def _print_list(rows: list[dict]) -> None:
    if not rows:
        print("(registry is empty: python -m pipeline.fleet.registry publish BUILD)")
        return
    head = ("device", "model", "version", "channels", "decode tok/s", "snr dB", "bundle", "build", "published")
    table = [head] + [(r["device"], r["model"], r["version"], ",".join(r["channels"]) or "-",
                       _fmt_tok(r.get("decode_tok_s")), f"{(r.get('parity') or {}).get('logits_snr_db') or 0:.1f}",
                       r["bundle_sha256"][:12], r["build"], r["published_at"]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def _print_show(d: dict) -> None:
    if "versions" in d and "files" not in d:
        _print_list(listing_from_show(d))
        for c, ch in d["channels"].items():
            print(f"\n{c}: current {ch['current'] or '-'}")
            for ev in ch["history"]:
                extra = "".join(f" {k}={ev[k]!r}" for k in ("from", "reason", "forced") if k in ev)
                gate = ev.get("gate")
                if gate:
                    extra += f" gate={gate['verdict']}" + (f" ratio={gate['ratio']:.3f}" if gate.get("ratio") else "")
                print(f"  {ev['at']}  {ev['action']:<8} {ev['version']:<5} by {ev['by']}{extra}")
        return
    lin = d["lineage"]
    print(f"{d['device']}/{d['model']} {d['version']}  (channels: {', '.join(d['channels']) or '-'})")
    print(f"  bundle sha256   {d['bundle_sha256']}")
    print(f"  build           {d['build']}  published {d['published_at']}")
    print(f"  model           {lin['model_id']}  sha256 {lin['model_sha256']}")
    print(f"  config sha256   {lin['config_sha256']}")
    print(f"  source commit   {lin['source_commit']}{' (dirty)' if lin['source_dirty'] else ''}")
    print(f"  toolchain       {', '.join(f'{k} {v}' for k, v in lin['toolchain'].items())}")
    print(f"  parity          {', '.join(f'{k} {v:.4g}' for k, v in d['parity']['metrics'].items())}")
    b = d["benchmark"]
    print(f"  decode tok/s    {_fmt_tok(b['decode_tok_s'])} ({b['artifact_arm']}, on_target={b['on_target']}, "
          f"noise floor {b['noise_floor']:.0%})")
    print(f"  files           {len(d['files'])}, {sum(f['bytes'] for f in d['files'].values())} bytes")


def listing_from_show(d: dict) -> list[dict]:
    current = {c: ch["current"] for c, ch in d["channels"].items()}
    return [{"device": d["device"], "model": d["model"], **v,
             "channels": [c for c in CHANNELS if current.get(c) == v["version"]]} for v in d["versions"]]


def _print_diff(d: dict) -> None:
    print(f"{d['device']}/{d['model']}: {d['a']} ({d['builds'][0]}) -> {d['b']} ({d['builds'][1]})")
    for section in ("config", "toolchain", "lineage"):
        print(f"{section}:" + ("" if d[section] else " same"))
        for k, (x, y) in d[section].items():
            print(f"  {k}: {x!r} -> {y!r}")
    print("parity:")
    for k, (x, y) in d["parity"].items():
        print(f"  {k}: {x} -> {y}")
    s = d["speed"]
    print(f"speed: decode tok/s {_fmt_tok(s['decode_tok_s'][0])} -> {_fmt_tok(s['decode_tok_s'][1])}: "
          f"{s['b_vs_a']['verdict']} (ratio {s['b_vs_a']['ratio']:.3f}, noise floor {s['b_vs_a']['noise_floor']:.0%})")
    print(f"files changed: {len(d['files_changed'])}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.fleet.registry",
        description="Artifact registry: publish finished builds, promote them through channels "
                    f"({' -> '.join(CHANNELS)}) per device class, roll back, and pull with every hash checked.",
        epilog="Exit codes: 0 ok, 1 error, 2 usage, 3 refused by a gate, 4 integrity failure at pull.",
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    pub = sub.add_parser("publish", help="record a finished build as a version and push its blobs")
    pub.add_argument("build", help="a registered build (builds/<build>.yaml)")
    pub.add_argument("--channel", default="dev", help="channel it lands on (default: dev)")
    pub.add_argument("-r", "--remote", help="DVC remote (default: the repository's default remote)")

    ls = sub.add_parser("list", help="versions and which channels point at them")
    ls.add_argument("device", nargs="?")
    ls.add_argument("--model")
    ls.add_argument("--json", action="store_true")

    sh = sub.add_parser("show", help="a device class's versions and channel history, or one version in full")
    sh.add_argument("device")
    sh.add_argument("ref", nargs="?", help="version (v3), channel (stable) or bundle sha256 prefix")
    sh.add_argument("--model")
    sh.add_argument("--json", action="store_true")

    df = sub.add_parser("diff", help="two versions: config, toolchain, lineage, parity, speed")
    df.add_argument("device")
    df.add_argument("a")
    df.add_argument("b")
    df.add_argument("--model")
    df.add_argument("--json", action="store_true")

    pr = sub.add_parser("promote", help="make a version current on a channel (stable is gated on speed)")
    pr.add_argument("device")
    pr.add_argument("version", help="version (v3), channel (its current version) or bundle sha256 prefix")
    pr.add_argument("channel", choices=CHANNELS)
    pr.add_argument("--model")
    pr.add_argument("--force", action="store_true", help="override a refused gate (needs --reason)")
    pr.add_argument("--reason", help="why (recorded in the channel history)")

    rb = sub.add_parser("rollback", help="restore a channel's previous version")
    rb.add_argument("device")
    rb.add_argument("channel", choices=CHANNELS)
    rb.add_argument("--model")
    rb.add_argument("--reason")

    pl = sub.add_parser("pull", help="fetch a version for a device class; every file re-hashed before hand-over")
    pl.add_argument("device")
    pl.add_argument("--dest", required=True, type=Path, help="folder to create with the bundle")
    pl.add_argument("--channel", choices=CHANNELS, help="default: stable")
    pl.add_argument("--version", help="pin a version (v3 or bundle sha256 prefix)")
    pl.add_argument("--model")
    pl.add_argument("-r", "--remote")
    pl.add_argument("--force", action="store_true", help="replace --dest if it exists")

    rm = sub.add_parser("remote", help="show the DVC remotes, or add one as the default")
    rm.add_argument("action", nargs="?", choices=("list", "add"))
    rm.add_argument("name", nargs="?")
    rm.add_argument("url", nargs="?")
    return p


def main(argv: list[str] | None = None, root: Path | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(root or ROOT)
    as_json = getattr(args, "json", False)
    try:
        if args.cmd == "publish":
            v = publish(root, args.build, channel=args.channel, remote=args.remote)
            if v.get("already_published"):
                print(f"{args.build}: already published as {v['version']} (bundle {v['bundle_sha256'][:12]}); nothing to do")
            else:
                print(f"published {args.build} as {v['version']} on {args.channel} "
                      f"(bundle sha256 {v['bundle_sha256']}); commit registry/ to share it")
        elif args.cmd == "list":
            rows = listing(root, args.device, args.model)
            print(json.dumps(rows, indent=2)) if as_json else _print_list(rows)
        elif args.cmd == "show":
            d = show(root, args.device, args.ref, args.model)
            print(json.dumps(d, indent=2, sort_keys=True)) if as_json else _print_show(d)
        elif args.cmd == "diff":
            d = diff(root, args.device, args.a, args.b, args.model)
            print(json.dumps(d, indent=2, sort_keys=True)) if as_json else _print_diff(d)
        elif args.cmd == "promote":
            ev = promote(root, args.device, args.version, args.channel, model=args.model,
                         force=args.force, reason=args.reason)
            gate = ev.get("gate")
            extra = f" (speed vs {gate['against']}: {gate['verdict']}, ratio {gate['ratio']:.3f})" \
                if gate and gate.get("ratio") else ""
            forced = f" FORCED: {ev['reason']}" if "reason" in ev else ""
            print(f"{args.device}/{ev['model']} {args.channel} -> {ev['version']}{extra}{forced}")
        elif args.cmd == "rollback":
            ev = rollback(root, args.device, args.channel, model=args.model, reason=args.reason)
            print(f"{args.device}/{ev['model']} {args.channel}: rolled back {ev['from']} -> {ev['version']}")
        elif args.cmd == "pull":
            r = pull(root, args.device, args.dest, model=args.model, channel=args.channel, version=args.version,
                     remote=args.remote, force=args.force)
            print(f"pulled {args.device}/{r['model']} {r['version']} ({r['files']} files, every sha256 verified) "
                  f"-> {r['dest']}")
        elif args.cmd == "remote":
            print(remote_cmd(root, args.action, args.name, args.url))
    except RegistryError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
