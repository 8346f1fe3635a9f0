"""Fault injection: kills at every stage boundary and mid-write, full and read-only
disks, a missing toolchain, every artifact kind corrupted, concurrent builds.

Everything runs on fake, instant stages in temporary folders (the runner's
module lookups are monkeypatched, as in test_manifest.py), so the suite costs
seconds. Each test adds to FAULTS; the module prints how many it injected.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing
import os
import re
import signal
import subprocess
import time
import types
from collections import Counter
from pathlib import Path

import pytest

from pipeline.engine import locks, manifest, run_stage
from pipeline.engine.context import StageError
from pipeline.engine.layout import StageDecl
from tests.conftest import report_line

FAULTS: Counter = Counter()
STAGE = "untie_head"
FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module", autouse=True)
def report_counts(request):
    yield
    report_line(request.config, f"fault injection: {sum(FAULTS.values())} faults tried "
           f"({', '.join(f'{k} {v}' for k, v in sorted(FAULTS.items()))})")


def fake_stage(monkeypatch, root: Path, run, stage: str = STAGE, inputs: tuple[str, ...] = ()):
    """Point the runner at a fake stage module writing under `root`/artifacts/b/."""
    module = types.SimpleNamespace(run=run)
    decl = StageDecl(stage, (), tuple(inputs), (), "build", module)
    other = lambda s: StageDecl(s, (), (), (), "build", None)  # noqa: E731
    monkeypatch.setattr(run_stage, "declaration", lambda s: decl if s == stage else other(s))
    monkeypatch.setattr(run_stage, "ROOT", root)
    monkeypatch.setattr(run_stage, "output_dir", lambda s, *a: f"artifacts/b/{s}")
    monkeypatch.setattr(run_stage, "stage_params", lambda *a: ({}, None))
    monkeypatch.setattr(run_stage, "cache_key", lambda s, *a: {"stage": s})
    monkeypatch.setattr(run_stage, "_quiet_libraries", lambda: None)
    monkeypatch.setenv("TMPDIR", str(root))
    return module


def good_run(ctx):
    (ctx.out / "model.safetensors").write_bytes(b"w" * 8192)
    (ctx.out / "config.json").write_text('{"ok": true}')
    return {"ok": 1}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"error: {STAGE} [b]: "), lines[0]
    return lines[0]


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


# --------------------------------------------------------------------------
# Disk full, read-only output, missing toolchain: one line saying what to do


def test_disk_full_is_one_line_naming_the_output(tmp_path, monkeypatch, capsys):
    def fill_disk(ctx):
        (ctx.out / "half.bin").write_bytes(b"x" * 100)
        if os.path.exists("/dev/full"):  # the kernel's own ENOSPC, with no file name, as a real write gets
            with open("/dev/full", "wb") as f:
                f.write(b"x" * (1 << 16))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    fake_stage(monkeypatch, tmp_path, fill_disk)
    assert run_stage.main([STAGE, "--build", "b"]) == 1
    line = one_error_line(capsys)
    final = tmp_path / "artifacts" / "b" / STAGE
    assert "disk full while writing" in line and str(final) in line and "free space and re-run" in line, line
    assert leftovers(final.parent) == []  # the half-written output is gone
    FAULTS["disk full"] += 1


@pytest.mark.parametrize(
    "err, words",
    [
        (OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/artifacts/b"), ["read-only file system", "/ro/artifacts/b", "writable"]),
        (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/x/artifacts/b"), ["permission denied", "/x/artifacts/b", "writable"]),
        (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), ["disk quota exceeded", "free space"]),
    ],
    ids=["erofs", "eacces", "edquot"],
)
def test_unwritable_output_is_one_line(tmp_path, monkeypatch, capsys, err, words):
    def fail(ctx):
        raise err

    fake_stage(monkeypatch, tmp_path, fail)
    assert run_stage.main([STAGE, "--build", "b"]) == 1
    line = one_error_line(capsys)
    for w in words:
        assert w in line, line
    assert leftovers(tmp_path / "artifacts" / "b") == []
    FAULTS["unwritable output"] += 1


def test_uncreatable_output_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """The output's parent cannot be created (a real error from mkdir: chmod does
    not stop root, which CI often is), one line naming it."""
    fake_stage(monkeypatch, tmp_path, good_run)
    (tmp_path / "artifacts").write_text("not a folder")  # mkdir under it fails, root or not
    assert run_stage.main([STAGE, "--build", "b"]) == 1
    line = one_error_line(capsys)
    assert "artifacts/b" in line, line
    FAULTS["unwritable output"] += 1


@contextlib.contextmanager
def _tmpfs(where: Path, options: str):
    """A real tmpfs mounted at `where` (root in a VM or container that allows it);
    the test is skipped, saying why, where mounting is not allowed."""
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to make a real {options} file system "
                    f"({(proc.stderr or proc.stdout).strip()[:120] or 'mount failed'}); the simulated errors above still run")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_real_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A 256 KiB file system, a stage writing 1 MiB: the kernel's own ENOSPC."""
    with _tmpfs(tmp_path / "small", "size=256k") as root:
        def write_a_lot(ctx):
            (ctx.out / "weights.bin").write_bytes(b"w" * (1 << 20))
            return {}

        fake_stage(monkeypatch, root, write_a_lot)
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        assert run_stage.main([STAGE, "--build", "b"]) == 1
        line = one_error_line(capsys)
        assert "disk full while writing" in line and str(root / "artifacts" / "b" / STAGE) in line, line
        assert leftovers(root / "artifacts" / "b") == []
        FAULTS["disk full (real)"] += 1


def test_a_real_read_only_file_system_is_one_line(tmp_path, monkeypatch, capsys):
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as root:
        fake_stage(monkeypatch, root, good_run)
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        assert run_stage.main([STAGE, "--build", "b"]) == 1
        line = one_error_line(capsys)
        assert "read-only file system" in line and str(root / "artifacts") in line and "writable" in line, line
        FAULTS["read-only output (real)"] += 1


@pytest.mark.parametrize(
    "body, words",
    [
        ("import edgekiln_absent_toolchain_pkg", ["edgekiln-absent-toolchain-pkg is not installed", "pip install -e ."]),
        ("import onnxruntime", ["onnxruntime is not installed", "pip install -e ."]),
        ("import llama_cpp.llama", ["llama-cpp-python is not installed", "benchmark.llamacpp=off"]),
        ("from json import no_such_name", ["json is installed but broken or the wrong version", "no_such_name"]),
    ],
    ids=["absent", "onnxruntime", "optional", "wrong-version"],
)
def test_missing_toolchain_is_one_line(tmp_path, monkeypatch, capsys, body, words):
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)  # as if not installed
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)

    def needs_toolchain(ctx):
        exec(body, {})

    fake_stage(monkeypatch, tmp_path, needs_toolchain)
    assert run_stage.main([STAGE, "--build", "b"]) == 1
    line = one_error_line(capsys)
    for w in words:
        assert w in line, line
    assert "internal error" not in line
    assert leftovers(tmp_path / "artifacts" / "b") == []
    FAULTS["missing toolchain"] += 1


def test_broken_project_import_stays_an_internal_error(tmp_path, monkeypatch, capsys):
    """An import of the project's own code failing is a bug: one line plus a traceback file."""

    def buggy(ctx):
        import pipeline.no_such_module  # noqa: F401

    fake_stage(monkeypatch, tmp_path, buggy)
    assert run_stage.main([STAGE, "--build", "b"]) == 1
    line = one_error_line(capsys)
    assert "internal error ModuleNotFoundError" in line
    log = Path(re.search(r"traceback: (\S+)\)", line).group(1))
    assert "pipeline.no_such_module" in log.read_text()
    FAULTS["internal error"] += 1


# --------------------------------------------------------------------------
# SIGKILL at every boundary: nothing partial where a reader looks; the next run recovers

HIDDEN = re.compile(rf"^\.{STAGE}\.(tmp|old)-\d+$")
# (kill point, an output already there before the run)
KILL_POINTS = [
    ("stage_start", False),
    ("mid_write", False),
    ("after_write", False),
    ("mid_manifest", False),
    ("after_manifest", False),
    ("mid_write", True),
    ("after_manifest", True),
    ("old_moved_aside", True),
    ("after_swap", True),
]


def _child(point: str, ready) -> None:
    """Runs in a forked process, the parent's monkeypatches in place."""

    def pause():
        ready.set()
        time.sleep(120)

    def stage_run(ctx):
        if point == "stage_start":
            pause()
        with open(ctx.out / "model.safetensors", "wb") as f:
            f.write(b"n" * 4096)
            f.flush()
            if point == "mid_write":
                pause()
            f.write(b"n" * 4096)
        (ctx.out / "config.json").write_text('{"new": true}')
        if point == "after_write":
            pause()
        return {"new": 1}

    run_stage.declaration(STAGE).module.run = stage_run
    real_write, real_rename = manifest.write, os.rename

    def write(folder, **kw):
        if point == "mid_manifest":
            (folder / manifest.NAME).write_text('{"format": "edgekiln-manif')
            pause()
        out = real_write(folder, **kw)
        if point == "after_manifest":
            pause()
        return out

    def rename(src, dst):
        real_rename(src, dst)
        if point == "old_moved_aside" and ".old-" in str(dst):
            pause()
        if point == "after_swap" and Path(dst).name == STAGE:
            pause()

    manifest.write = write
    os.rename = rename
    run_stage.run(STAGE, "b")
    os._exit(0)  # not reached when killed


@pytest.mark.parametrize("point, existing", KILL_POINTS, ids=[f"{p}{'-replacing' if e else ''}" for p, e in KILL_POINTS])
def test_sigkill_leaves_nothing_partial_and_the_next_run_recovers(tmp_path, monkeypatch, point, existing):
    module = fake_stage(monkeypatch, tmp_path, good_run)
    final = tmp_path / "artifacts" / "b" / STAGE
    if existing:
        run_stage.run(STAGE, "b")
        old_files = manifest.verify(final)["files"]

    ready = FORK.Event()
    child = FORK.Process(target=_child, args=(point, ready))
    child.start()
    try:
        assert ready.wait(20), f"the child never reached {point} (exit code {child.exitcode})"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(20)
    assert child.exitcode == -signal.SIGKILL
    FAULTS[f"SIGKILL {point}"] += 1

    names = leftovers(final.parent)
    assert all(n == STAGE or HIDDEN.match(n) for n in names), names
    if final.exists():
        # A reader finds a whole output (the old one, or the new one after the swap), never part of one.
        assert existing and point in ("mid_write", "after_manifest", "after_swap"), names
        files = manifest.verify(final)["files"]
        assert files == old_files or "config.json" in files and json.loads((final / "config.json").read_text()) == {"new": True}
    else:
        assert not existing or point == "old_moved_aside", names
        with pytest.raises(StageError, match="no manifest.json"):
            manifest.verify(final)  # what a downstream stage does: refused, never read half-written

    # The next run (what `dvc repro` reruns: this stage only) cleans up and produces the output.
    module.run = good_run
    out = run_stage.run(STAGE, "b")
    assert out == final and manifest.verify(final)["result"] == {"ok": 1}
    assert leftovers(final.parent) == [STAGE]


def test_stale_temp_of_a_live_process_is_left_alone(tmp_path, monkeypatch):
    """Cleanup removes a dead run's temp folder, never one a running process still writes."""
    fake_stage(monkeypatch, tmp_path, good_run)
    parent = tmp_path / "artifacts" / "b"
    parent.mkdir(parents=True)
    live = parent / f".{STAGE}.tmp-1"  # pid 1 is always alive
    live.mkdir()
    dead_pid = FORK.Process(target=os._exit, args=(0,))
    dead_pid.start()
    dead_pid.join()
    dead = parent / f".{STAGE}.tmp-{dead_pid.pid}"
    dead.mkdir()
    run_stage.run(STAGE, "b")
    assert live.exists() and not dead.exists()
    FAULTS["stale temp"] += 1


# --------------------------------------------------------------------------
# Corrupt every artifact kind: refused by hash, the error names the file

ARTIFACT_KINDS = {
    "probe": ["host.json", "toolchain/model.json", "toolchain/export.json"],
    "model": ["config.json", "model.safetensors", "tokenizer.model", "tokenizer.json", "training_report.json"],
    "untie_head": ["config.json", "model-body.safetensors", "model-lm_head.safetensors", "model.safetensors.index.json"],
    "calibrate": ["calibration.json", "hessians.safetensors"],
    "quantize": ["quant.json", "quantized.safetensors"],
    "export": ["model.onnx", "io.json", "config.json", "tokenizer.json"],
    "pack": ["model.safetensors", "tinygemm.json", "tinygemm.safetensors", "weight_path.json"],
    "deploy_profile": ["profile.json", "torch.json"],
    "verify_parity": ["report.json", "metrics.json"],
    "benchmark": ["metrics.json", "report.json", "report.html", "plots/resident_mib.json"],
}


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "flip_byte": (_flip, "sha256 does not match"),
    "truncate": (lambda p: p.write_bytes(p.read_bytes()[:-7]), "sha256 does not match"),
    "empty": (lambda p: p.write_bytes(b""), "sha256 does not match"),
    "append": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "sha256 does not match"),
    "delete": (lambda p: p.unlink(), "missing"),
    "swap_for_symlink": (lambda p: (p.unlink(), p.symlink_to("/dev/null")), "sha256 does not match"),
}


def make_kind(folder: Path, stage: str) -> dict:
    folder.mkdir(parents=True)
    for i, rel in enumerate(ARTIFACT_KINDS[stage]):
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(64 + 37 * i))
    return manifest.write(folder, stage=stage, build="b", key={"stage": stage}, result={}, timings={})


@pytest.mark.parametrize("stage", sorted(ARTIFACT_KINDS))
def test_every_corruption_of_every_artifact_kind_is_named(tmp_path, stage):
    tried = 0
    for rel in ARTIFACT_KINDS[stage]:
        for how, (corrupt, words) in CORRUPTIONS.items():
            folder = tmp_path / f"{how}-{rel.replace('/', '_')}"
            make_kind(folder, stage)
            corrupt(folder / rel)
            with pytest.raises(StageError) as e:
                manifest.verify(folder, expect_stage=stage)
            msg = str(e.value)
            assert str(folder / rel) in msg and words in msg and "\n" not in msg, (stage, rel, how, msg)
            tried += 1
    # Whole-folder tampering: an extra file (top level and nested), an edited or unreadable manifest.
    for how, tamper, words in [
        ("extra", lambda f: (f / "evil.bin").write_bytes(b"x"), ["evil.bin", "not in the manifest"]),
        ("extra_nested", lambda f: ((f / "sub").mkdir(), (f / "sub" / "x.py").write_text("")), ["sub/x.py", "not in the manifest"]),
        ("manifest_garbled", lambda f: (f / "manifest.json").write_text("{"), ["manifest.json", "unreadable"]),
        ("manifest_deleted", lambda f: (f / "manifest.json").unlink(), ["no manifest.json"]),
        ("manifest_other_stage", lambda f: _edit_manifest(f, stage="evil"), ["expected"]),
        ("manifest_rehashed", _rehash_one_file, ["edited manifest"]),
    ]:
        folder = tmp_path / f"whole-{how}"
        make_kind(folder, stage)
        tamper(folder)
        with pytest.raises(StageError) as e:
            manifest.verify(folder, expect_stage=stage)
        for w in words:
            assert w in str(e.value), (stage, how, str(e.value))
        tried += 1
    FAULTS["corrupted artifact"] += tried


def _edit_manifest(folder: Path, **changes) -> None:
    mf = folder / manifest.NAME
    doc = json.loads(mf.read_text())
    doc.update(changes)
    mf.write_text(json.dumps(doc))


def _rehash_one_file(folder: Path) -> None:
    """A tamperer who also fixes the file's own hash in the manifest."""
    mf = folder / manifest.NAME
    doc = json.loads(mf.read_text())
    rel = sorted(doc["files"])[0]
    (folder / rel).write_bytes(b"evil")
    doc["files"][rel] = {"sha256": manifest.sha256_file(folder / rel), "bytes": 4}
    mf.write_text(json.dumps(doc))


def test_a_corrupted_input_is_refused_before_the_stage_runs(tmp_path, monkeypatch, capsys):
    ran = []
    fake_stage(monkeypatch, tmp_path, lambda ctx: ran.append(1), stage=STAGE, inputs=("quantize",))
    src = tmp_path / "artifacts" / "b" / "quantize"
    make_kind(src, "quantize")
    _flip(src / "quantized.safetensors")
    assert run_stage.main([STAGE, "--build", "b"]) == 1
    line = one_error_line(capsys)
    assert str(src / "quantized.safetensors") in line and "sha256" in line, line
    assert ran == [] and not (tmp_path / "artifacts" / "b" / STAGE).exists()
    FAULTS["corrupted input"] += 1


# --------------------------------------------------------------------------
# Locks: one run of a build at a time; different builds do not wait here


def _hold(name, root, seconds, log, ready=None):
    lines = []
    with locks.hold(name, root=root, say=lines.append):
        t0 = time.time()
        if ready is not None:
            ready.set()
        time.sleep(seconds)
        t1 = time.time()
    with open(log, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "start": t0, "end": t1, "said": lines}) + "\n")
    os._exit(0)


def _spans(log: Path) -> list[dict]:
    return sorted((json.loads(l) for l in log.read_text().splitlines()), key=lambda d: d["start"])


@pytest.mark.parametrize("same", [True, False], ids=["same-build", "different-builds"])
def test_same_build_serializes_different_builds_do_not(tmp_path, same):
    log = tmp_path / "log.jsonl"
    ready = FORK.Event()
    first = FORK.Process(target=_hold, args=("x86_avx2-a", tmp_path, 0.8, log, ready))
    first.start()
    assert ready.wait(20)
    second = FORK.Process(target=_hold, args=("x86_avx2-a" if same else "galaxy_s25-a", tmp_path, 0.1, log))
    second.start()
    first.join(20), second.join(20)
    a, b = _spans(log)
    if same:
        assert b["start"] >= a["end"], (a, b)
        assert any("waiting for another run" in s for s in b["said"]), b
        assert any("lock acquired after" in s for s in b["said"]), b
    else:
        assert b["start"] < a["end"] and b["said"] == [], (a, b)
    assert (tmp_path / "artifacts" / ".locks" / "x86_avx2-a.lock").is_file()
    FAULTS["concurrent builds"] += 1


def test_a_killed_holder_releases_the_lock(tmp_path):
    ready = FORK.Event()
    holder = FORK.Process(target=_hold, args=("b1", tmp_path, 120, tmp_path / "log", ready))
    holder.start()
    assert ready.wait(20)
    with pytest.raises(locks.LockError, match="gave up after 0.2 s"):
        with locks.hold("b1", root=tmp_path, timeout=0.2):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(20)
    t0 = time.monotonic()
    with locks.hold("b1", root=tmp_path, timeout=5):
        assert time.monotonic() - t0 < 2
    FAULTS["SIGKILL lock holder"] += 1


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "..", ".locks", "x" * 200])
def test_lock_names_cannot_escape(tmp_path, name):
    with pytest.raises(locks.LockError, match="cannot name a lock file"):
        with locks.hold(name, root=tmp_path):
            pass
    assert not (tmp_path / "artifacts").exists()
    FAULTS["bad lock name"] += 1


def test_unwritable_lock_folder_is_one_line(tmp_path):
    (tmp_path / "artifacts").write_text("a file where the folder goes")
    with pytest.raises(locks.LockError) as e:
        with locks.hold("b1", root=tmp_path):
            pass
    assert "cannot create the lock of build b1" in str(e.value) and "\n" not in str(e.value)
    FAULTS["unwritable output"] += 1


def _cli_child(root, log, overrides, stale=False, seconds=0.8):
    """`python -m pipeline` with registration and DVC replaced by timed sleeps.

    The fake `dvc repro` of the build's own stages sleeps `seconds`; the model
    is `stale` (must be rebuilt) or up to date, as DVC would say."""
    import sys

    import pipeline.__main__ as cli

    def fake_dvc(args):
        t0 = time.time()
        own = not any(a.startswith(("model--", "probe--")) for a in args)
        time.sleep(seconds if own else 0.05)
        with open(log, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "start": t0, "end": time.time(), "args": args,
                                "own": own}) + "\n")
        return 0

    def fake_register(cfg):
        p = Path(root) / "builds" / f"{cfg['build']['name']}.yaml"
        p.parent.mkdir(exist_ok=True)
        p.write_text("x")
        return p

    from pipeline.engine import build

    cli.ROOT, build.ROOT, locks.ROOT = Path(root), Path(root), Path(root)
    build._run_dvc, cli.register, cli.summary = fake_dvc, fake_register, lambda name: None
    build._stale = lambda ref: stale
    sys.stderr = open(Path(root) / f"stderr-{os.getpid()}.txt", "w")
    rc = cli.main(list(overrides))
    sys.stderr.flush()
    os._exit(rc)


def test_cli_runs_of_the_same_build_queue(tmp_path):
    """The lock wiring in `python -m pipeline`: the second run of a build waits, says so, then runs."""
    log = tmp_path / "dvc.jsonl"
    procs = [FORK.Process(target=_cli_child, args=(tmp_path, log, ["device=x86_avx2"])) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    a, b = [s for s in _spans(log) if s["own"]]
    assert b["start"] >= a["end"], (a, b)
    assert a["args"][:3] == ["--wait-for-lock", "repro", "--single-item"]
    said = "".join(p.read_text() for p in tmp_path.glob("stderr-*.txt"))
    assert "build x86_avx2-embedded-speed: waiting for another run of it to finish" in said, said
    FAULTS["concurrent builds"] += 1


def test_cli_builds_of_different_devices_run_side_by_side(tmp_path):
    """Same model, two devices: each brings the model up to date in turn (a
    short step), then their own stages run at the same time."""
    log = tmp_path / "dvc.jsonl"
    procs = [FORK.Process(target=_cli_child, args=(tmp_path, log, [f"device={d}"], False, 2.0))
             for d in ("x86_avx2", "galaxy_s25")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    spans = _spans(log)
    a, b = [s for s in spans if s["own"]]
    assert b["start"] < a["end"], (a, b)  # overlapping: neither waited for the other
    assert {x["args"][-1] for x in (a, b)} == {"x86_avx2-embedded-speed--benchmark",
                                               "galaxy_s25-embedded-speed--benchmark"}
    assert all(x["args"][3].endswith("--probe") for x in (a, b))  # each build runs its own probe
    model_steps = [s for s in spans if not s["own"]]
    assert [s["args"][-1].split("--")[0] for s in model_steps] == ["probe", "probe"]  # up to date: no rebuild
    FAULTS["concurrent builds"] += 1


def test_a_stale_model_is_rewritten_only_after_its_readers_finish(tmp_path):
    """A build whose model must be rebuilt waits, saying so, for the builds
    still reading the current model; their stages never see it change."""
    log = tmp_path / "dvc.jsonl"
    reader = FORK.Process(target=_cli_child, args=(tmp_path, log, ["device=x86_avx2"], False, 2.0))
    reader.start()
    deadline = time.time() + 30
    while time.time() < deadline and not (log.exists() and "probe--" in log.read_text()):
        time.sleep(0.02)
    time.sleep(0.3)  # the reader is in its own stages, holding the model shared
    writer = FORK.Process(target=_cli_child, args=(tmp_path, log, ["device=galaxy_s25"], True, 0.1))
    writer.start()
    reader.join(60), writer.join(60)
    assert [reader.exitcode, writer.exitcode] == [0, 0]
    spans = _spans(log)
    read = next(s for s in spans if s["own"] and s["pid"] == reader.pid)
    rebuild = next(s for s in spans if s["args"][-1].startswith("model--"))
    assert rebuild["pid"] == writer.pid and rebuild["start"] >= read["end"], (read, rebuild)
    said = (tmp_path / f"stderr-{writer.pid}.txt").read_text()
    assert "waiting for the builds reading its previous version to finish" in said, said
    FAULTS["concurrent builds"] += 1


def _hold_dvc_lock(root, ready):
    import zc.lockfile

    lock = zc.lockfile.LockFile(str(Path(root) / ".dvc" / "tmp" / "lock"))  # what DVC's repo lock is
    ready.set()
    time.sleep(120)
    lock.close()


def test_another_builds_dvc_run_is_announced(tmp_path):
    """Builds of one checkout queue on DVC's repository lock; the CLI says so before waiting."""
    (tmp_path / ".dvc" / "tmp").mkdir(parents=True)
    said = []
    assert locks.note_dvc_lock(tmp_path, said.append) is False  # no lock file yet
    ready = FORK.Event()
    holder = FORK.Process(target=_hold_dvc_lock, args=(tmp_path, ready))
    holder.start()
    try:
        assert ready.wait(20)
        assert locks.note_dvc_lock(tmp_path, said.append) is True
        assert len(said) == 1 and f"(pid {holder.pid})" in said[0] and "waiting for another DVC command" in said[0]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(20)
    assert locks.note_dvc_lock(tmp_path, said.append) is False and len(said) == 1
    FAULTS["concurrent builds"] += 1


def test_dvc_files_are_written_by_rename_so_a_failed_write_leaves_the_whole_old_one(tmp_path):
    """dvc.lock is every build's record in a checkout: a DVC process killed while writing it (a sweep's
    launcher tears all workers down when one dies) must leave the previous file, never a truncated one."""
    import yaml
    from dvc.utils.serialize import modify_yaml

    from pipeline.engine.build import atomic_dvc_files

    lock = tmp_path / "dvc.lock"
    before = "schema: '2.0'\nstages:\n  a:\n    cmd: x\n"
    lock.write_text(before)
    atomic_dvc_files()
    with pytest.raises(Exception):  # ruamel cannot represent an object(): the dump fails part-way
        with modify_yaml(lock) as data:
            data["stages"]["b"] = object()
    assert lock.read_text() == before
    assert not list(tmp_path.glob(".dvc.lock.tmp-*"))
    with modify_yaml(lock) as data:  # DVC's own read-modify-write, through the same function
        data["stages"]["b"] = {"cmd": "y"}
    assert yaml.safe_load(lock.read_text())["stages"] == {"a": {"cmd": "x"}, "b": {"cmd": "y"}}


def test_dvc_rwlock_is_written_by_rename_so_a_failed_write_leaves_the_whole_old_one(tmp_path, monkeypatch):
    """.dvc/tmp/rwlock says which build holds which output: a sweep worker killed while DVC rewrote
    it in place left it empty, and every later build failed reading it (seen in CI). A write that
    fails part-way now leaves the previous file; DVC's own lock calls still read and write it."""
    import json

    from dvc import rwlock
    from dvc.fs import localfs

    from pipeline.engine.build import atomic_dvc_files

    atomic_dvc_files()
    assert getattr(rwlock._edit_rwlock, "edgekiln_atomic", False)
    lock_dir = tmp_path / "tmp"
    lock_dir.mkdir()
    with rwlock._edit_rwlock(str(lock_dir), localfs, False) as lock:
        lock["write"]["/a/out"] = {"pid": 1, "cmd": "first"}
    before = (lock_dir / "rwlock").read_text()
    assert json.loads(before)["write"]["/a/out"]["cmd"] == "first"

    def half_then_die(obj, fobj, **kw):
        fobj.write('{"read": {}, "wri')
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(json, "dump", half_then_die)
    with pytest.raises(KeyboardInterrupt):
        with rwlock._edit_rwlock(str(lock_dir), localfs, False) as lock:
            lock["write"]["/b/out"] = {"pid": 2, "cmd": "second"}
    assert (lock_dir / "rwlock").read_text() == before
    assert not list(lock_dir.glob(".rwlock.tmp-*"))
    FAULTS["killed mid_write"] += 1
