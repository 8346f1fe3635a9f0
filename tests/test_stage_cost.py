"""Every stage's cost in its manifest, and one line when the kernel kills a stage.

The runner's supervisor (pipeline/engine/run_stage.py `supervise`) runs here, in the
test's process; its child is a real subprocess that sets up the same fake stage
(tests/test_faults.py `fake_stage`) before running the stage, so what is
measured is a real process tree: the kernel's peaks, a real SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.engine import manifest, run_stage
from pipeline.engine.context import StageError
from tests.test_faults import STAGE, fake_stage, good_run, leftovers

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
ARGV = [STAGE, "--build", "b"]
SETTINGS = {"export": {"context_length": 1024}, "parity": {"decode_tokens": 520}}
MEMORY_KEYS = ("export.context_length", "parity.decode_tokens")

# The child: this module's stage function `fn` as the fake stage, then the runner's own entry point.
CHILD = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
import pytest
from pipeline.engine import run_stage
from tests import test_stage_cost as t
from tests.test_faults import fake_stage
fake_stage(pytest.MonkeyPatch(), Path({tmp!r}), getattr(t, {fn!r}))
sys.exit(run_stage.entry(sys.argv[1:]))
"""


# Fake stages (module level: the child looks them up by name).

def allocate_and_write(ctx):
    held = b"\1" * (120 * MiB)  # touched, so resident
    good_run(ctx)
    return {"held": len(held)}


def sigkilled_after_200mb(ctx):
    held = b"\1" * (200 * MiB)
    (ctx.out / "half.bin").write_bytes(b"x" * 100)
    os.kill(os.getpid(), signal.SIGKILL)
    return {"held": len(held)}  # not reached


def segfaults_mid_progress_bar(ctx):
    with ctx.progress(10, "native work") as bar:
        bar.advance()
        os.kill(os.getpid(), signal.SIGSEGV)  # as llama.cpp's AMX kernels did in a prefill


def spawns_a_300mb_subprocess(ctx):
    subprocess.run([sys.executable, "-c", f"x = b'1' * ({300 * MiB}); import time; time.sleep(0.3)"], check=True)
    return good_run(ctx)


def fails_with_a_stage_error(ctx):
    raise StageError("calibrate.samples=9 is below calibrate.min_samples=64")


def sleeps(ctx):
    (ctx.out / "half.bin").write_bytes(b"x" * 100)
    time.sleep(120)  # the signal ends it long before: a loaded host can take tens of seconds to start the child


def sleeps_with_a_grandchild(ctx):
    """A stage that started a subprocess of its own (a converter, a server) and then runs on."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (ctx.out / "grandchild.pid").write_text(str(child.pid))
    (ctx.out / "half.bin").write_bytes(b"x" * 100)
    time.sleep(120)


def ignores_sigterm(ctx):
    """A stage whose code swallows the stop (a library catching every exception, a native call)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (ctx.out / "half.bin").write_bytes(b"x" * 100)
    time.sleep(120)


def supervised(tmp_path, monkeypatch, fn: str) -> int:
    """Run the fake stage `fn` the way dvc.yaml's command does: supervised, in a child."""
    module = fake_stage(monkeypatch, tmp_path, globals()[fn])
    module.MEMORY_KEYS = MEMORY_KEYS
    monkeypatch.setattr(run_stage, "stage_params", lambda *a: (SETTINGS, None))
    code = CHILD.format(root=str(ROOT), tmp=str(tmp_path), fn=fn)
    return run_stage.supervise(ARGV, child=[sys.executable, "-c", code])


def error_lines(capfd) -> list[str]:
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    return [l for l in err.splitlines() if l.strip()]


def host_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))


# --------------------------------------------------------------------------


def test_the_manifest_records_time_and_peak_memory(tmp_path, monkeypatch, capfd):
    assert supervised(tmp_path, monkeypatch, "allocate_and_write") == 0
    final = tmp_path / "artifacts" / "b" / STAGE
    m = manifest.verify(final)
    t = m["timings"]
    assert set(t) >= {"started", "seconds", "cpu_seconds", "peak_rss_bytes", "peak_rss_children_bytes"}, t
    datetime.fromisoformat(t["started"])
    assert 0 < t["seconds"] < 60 and 0 < t["cpu_seconds"] < 60, t
    # The stage held 120 MiB on top of the interpreter; no more than the host has.
    assert 120 * MiB <= t["peak_rss_bytes"] < host_bytes(), t
    assert 0 <= t["peak_rss_children_bytes"] < host_bytes(), t
    assert leftovers(final.parent) == [STAGE]
    [line] = error_lines(capfd)
    assert line.startswith(f"{STAGE} [b]: ran in ") and " MiB -> " in line and line.endswith(f" -> artifacts/b/{STAGE}"), line


def test_the_cost_is_in_neither_hash(tmp_path, monkeypatch):
    """Two runs of the same stage cost differently but are the same artifact, same key."""
    fake_stage(monkeypatch, tmp_path, good_run)
    final = tmp_path / "artifacts" / "b" / STAGE
    run_stage.run(STAGE, "b")
    first = manifest.verify(final)
    held = b"\1" * (64 * MiB)  # noqa: F841 - a higher peak for the second run
    time.sleep(0.01)
    run_stage.run(STAGE, "b")
    second = manifest.verify(final)
    assert second["timings"]["peak_rss_bytes"] >= 64 * MiB
    assert first["content_sha256"] == second["content_sha256"]
    assert first["config_hash"] == second["config_hash"] == manifest.config_hash(second["key"])
    assert "timings" not in json.dumps(second["key"]) and "peak_rss" not in json.dumps(second["key"])


def test_a_subprocess_memory_is_counted(tmp_path, monkeypatch, capfd):
    assert supervised(tmp_path, monkeypatch, "spawns_a_300mb_subprocess") == 0
    t = manifest.verify(tmp_path / "artifacts" / "b" / STAGE)["timings"]
    assert t["peak_rss_children_bytes"] >= 300 * MiB, t
    assert t["peak_rss_bytes"] < 300 * MiB, t  # the stage's own process did not hold it


def test_a_stage_the_kernel_kills_is_one_line_naming_its_memory_and_settings(tmp_path, monkeypatch, capfd):
    assert supervised(tmp_path, monkeypatch, "sigkilled_after_200mb") == 1
    lines = error_lines(capfd)
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"error: {STAGE} [b]: killed by the kernel (SIGKILL"), line
    assert "export.context_length=1024, parity.decode_tokens=520" in line and "lower them" in line, line
    m = re.search(r"at ([\d.]+) (MiB|GiB) resident \(this host has ", line)
    assert m, line
    reached = float(m.group(1)) * (MiB if m.group(2) == "MiB" else 1024 * MiB)
    assert 200 * MiB <= reached < host_bytes(), line
    # Its temp folder went with it: nothing is left where a reader (or the next run) looks.
    assert leftovers(tmp_path / "artifacts" / "b") == []


@pytest.mark.parametrize("terminal", [False, True])
def test_a_native_crash_is_one_line_on_a_line_of_its_own(tmp_path, monkeypatch, capfd, terminal):
    """A crash in native code names its signal and the memory reached; on a terminal the line
    after a bar the crash left open starts a line of its own, the cursor the bar hid shown again."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    assert supervised(tmp_path, monkeypatch, "segfaults_mid_progress_bar") == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith(f"error: {STAGE} [b]: the stage's process died of SIGSEGV at "), line
    assert "a crash in native code" in line and "nothing was written" in line, line
    assert ("\x1b[?25h\nerror: " in err) is terminal
    assert leftovers(tmp_path / "artifacts" / "b") == []


def test_a_killed_stage_that_was_replacing_an_output_leaves_the_old_one_whole(tmp_path, monkeypatch, capfd):
    fake_stage(monkeypatch, tmp_path, good_run)
    final = tmp_path / "artifacts" / "b" / STAGE
    run_stage.run(STAGE, "b")
    before = manifest.verify(final)["files"]
    assert supervised(tmp_path, monkeypatch, "sigkilled_after_200mb") == 1
    assert manifest.verify(final)["files"] == before
    assert leftovers(final.parent) == [STAGE]


def test_a_stage_error_still_passes_through_as_one_line(tmp_path, monkeypatch, capfd):
    assert supervised(tmp_path, monkeypatch, "fails_with_a_stage_error") == 1
    assert error_lines(capfd) == [f"error: {STAGE} [b]: calibrate.samples=9 is below calibrate.min_samples=64"]
    assert leftovers(tmp_path / "artifacts" / "b") == []


@pytest.mark.parametrize("sig, rc, words", [
    (signal.SIGINT, 130, "interrupted; nothing was written"),
    (signal.SIGTERM, 128 + signal.SIGTERM, "stopped by SIGTERM; nothing was written"),
], ids=["sigint", "sigterm"])
def test_signals_reach_the_stage(tmp_path, monkeypatch, capfd, sig, rc, words):
    """Ctrl-C (SIGINT) and a sweep launcher's SIGTERM, sent to the command, reach the stage once."""
    parent = tmp_path / "artifacts" / "b"

    sent = []

    def send_when_running():  # once the stage has written its first file (the child has started)
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            if parent.exists() and any((parent / n / "half.bin").exists() for n in leftovers(parent)
                                       if n.startswith(f".{STAGE}.tmp-")):
                sent.append(time.monotonic())
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.05)

    sender = threading.Thread(target=send_when_running, daemon=True)
    sender.start()
    assert supervised(tmp_path, monkeypatch, "sleeps") == rc
    sender.join(5)
    assert sent and time.monotonic() - sent[0] < 30  # the signal ended the stage, not its sleep
    assert error_lines(capfd) == [f"error: {STAGE} [b]: {words}"]
    assert leftovers(parent) == []


def test_the_build_summary_shows_each_stages_time_and_peak(tmp_path, monkeypatch, capsys):
    """The table after a build: every stage with a manifest, the shared model's included."""
    import yaml

    import pipeline.__main__ as cli
    from pipeline.engine.layout import output_dir

    model = {"name": "tiny", "source": "embedded"}
    (tmp_path / "builds").mkdir()
    (tmp_path / "builds" / "b.yaml").write_text(yaml.safe_dump({"model": model}))
    recorded = {"model": (12.3, 700 * MiB, 0), "untie_head": (0.4, 90 * MiB, 0),
                "benchmark": (61.0, 2048 * MiB, 350 * MiB)}
    for stage, (secs, peak, kids) in recorded.items():
        folder = tmp_path / output_dir(stage, "b", model)
        folder.mkdir(parents=True)
        manifest.write(folder, stage=stage, build="b", key={}, result={}, timings={
            "started": "2026-01-02T03:04:05+00:00", "seconds": secs, "peak_rss_bytes": peak,
            "peak_rss_children_bytes": kids})
    old = tmp_path / output_dir("calibrate", "b")
    old.mkdir(parents=True)  # a manifest from before the cost was recorded
    manifest.write(old, stage="calibrate", build="b", key={}, result={}, timings={"started": "x", "seconds": 1.5})
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    cli.summary("b")
    out = capsys.readouterr().out
    rows = {l.split()[1]: l for l in out.splitlines() if l.startswith("│") and l.split()[1] in recorded.keys() | {"calibrate"}}
    assert set(rows) == {"model", "untie_head", "calibrate", "benchmark"}, out
    assert "12.3" in rows["model"] and "700 MiB" in rows["model"], rows["model"]
    assert "61.0" in rows["benchmark"] and "2,048 MiB" in rows["benchmark"] and "350 MiB" in rows["benchmark"]
    assert "1.5" in rows["calibrate"] and rows["calibrate"].count(" - ") >= 2, rows["calibrate"]


# The supervisor in a process of its own, under a "driver" process, as DVC runs it.
SUPERVISOR = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
import pytest
from pipeline.engine import run_stage
from tests import test_stage_cost as t
from tests.test_faults import fake_stage
mp = pytest.MonkeyPatch()
fake_stage(mp, Path({tmp!r}), getattr(t, {fn!r}))
mp.setattr(run_stage, "stage_params", lambda *a: (t.SETTINGS, None))
code = t.CHILD.format(root={root!r}, tmp={tmp!r}, fn={fn!r})
sys.exit(run_stage.supervise(t.ARGV, child=[sys.executable, "-c", code]))
"""
DRIVER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1]]))"


def writing(parent: Path, name: str = "half.bin") -> Path | None:
    """The stage's temp folder once `name` is in it."""
    for n in leftovers(parent):
        if n.startswith(f".{STAGE}.tmp-") and (parent / n / name).exists():
            return parent / n
    return None


def wait_for(predicate, seconds: float = 100):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("how", ["sigterm", "driver_sigkilled"])
def test_a_stopped_stage_leaves_no_process_and_no_temp_folder(tmp_path, how):
    """SIGTERM to the stage's command, or its parent SIGKILLed (nobody forwards anything): the
    stage, the subprocess it started and its temp folder are all gone within seconds."""
    import psutil

    code = SUPERVISOR.format(root=str(ROOT), tmp=str(tmp_path), fn="sleeps_with_a_grandchild")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, code], stderr=subprocess.PIPE, text=True)
    parent = tmp_path / "artifacts" / "b"
    tmp = wait_for(lambda: writing(parent, "grandchild.pid"))
    grandchild = int(wait_for(lambda: (tmp / "grandchild.pid").read_text()))
    tree = [driver.pid, *(p.pid for p in psutil.Process(driver.pid).children(recursive=True))]
    assert grandchild in tree and len(tree) == 4, tree  # driver, supervisor, stage, its subprocess
    t0 = time.monotonic()
    if how == "sigterm":
        os.kill(tree[1], signal.SIGTERM)  # the supervisor: what DVC runs
    else:
        driver.kill()
    err = driver.communicate(timeout=60)[1]  # EOF: every holder of the pipe is gone
    wait_for(lambda: not any(alive(p) for p in tree[1:]), 10)
    gone = time.monotonic() - t0
    assert "Traceback" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    if how == "sigterm":
        assert driver.returncode == 128 + signal.SIGTERM
        assert lines == [f"error: {STAGE} [b]: stopped by SIGTERM; nothing was written"], err
    else:
        assert lines == [f"error: {STAGE} [b]: stopped: its parent process is gone (the build was stopped "
                         f"or killed); nothing was written"], err
    assert leftovers(parent) == []
    assert gone < 8, gone
    print(f"{how}: the stage, its subprocess and its temp folder gone in {gone:.2f} s")


def test_a_stage_that_ignores_the_stop_is_killed_after_the_grace(tmp_path, monkeypatch, capfd):
    """The stop's grace (run_stage.STOP_GRACE_SECONDS), then SIGKILL: the stage ends anyway."""
    monkeypatch.setattr(run_stage, "STOP_GRACE_SECONDS", 1.0)
    parent = tmp_path / "artifacts" / "b"
    sent = []

    def send_when_running():
        wait_for(lambda: writing(parent))
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_when_running, daemon=True).start()
    assert supervised(tmp_path, monkeypatch, "ignores_sigterm") == 128 + signal.SIGTERM
    took = time.monotonic() - sent[0]
    assert 1.0 <= took < 10, took
    assert error_lines(capfd) == [f"error: {STAGE} [b]: stopped by SIGTERM; nothing was written"]
    assert leftovers(parent) == []


def test_a_stage_whose_parent_is_already_gone_does_not_start(tmp_path, monkeypatch, capfd):
    """The parent died while the command was starting (before its watch was on): nothing runs."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(run_stage, "_parents_watched", lambda: {dead.pid: None})
    assert supervised(tmp_path, monkeypatch, "allocate_and_write") == 128 + signal.SIGTERM
    assert error_lines(capfd) == [f"error: {STAGE} [b]: not started: its parent process is gone "
                                  f"(the build was stopped or killed)"]
    assert leftovers(tmp_path / "artifacts" / "b") == []
