"""python -m pipeline -m OVERRIDE ...: a sweep of builds, fanned out through a Hydra launcher.

    python -m pipeline -m device=xeon_amx,x86_avx512,galaxy_s25                     # joblib, this machine
    python -m pipeline -m device=xeon_amx,x86_avx512 hydra/launcher=ray_cluster           # Ray
    python -m pipeline -m device=xeon_amx,x86_avx512 hydra/launcher=slurm hydra.launcher.partition=cpu

Hydra's multirun syntax (`key=a,b`, `glob(...)`, `range(...)`) expands into one
job per combination, exactly as Hydra's own sweeper does (its split_arguments
is called here, then the sweeper runs it again for the launch). Before anything
is launched, every job's config is composed and validated and every build is
registered (builds/<name>.yaml, dvc.yaml regenerated) under the registry lock:
a bad override or two jobs naming the same build stop the sweep before any
build starts, and the parallel jobs never write shared files. Each job then
runs only `build()` (pipeline/engine/build.py) for its build, under its build lock;
the layout gives each build its own outputs and the model locks serialize the
shared model.

Every job returns a result (status, exit code, seconds, the host and process
that ran it) that is also written into the job's Hydra output folder, so a sweep
whose launcher died (a worker killed) still reports what finished. The summary
table closes the run; the exit status is 0 only when every build succeeded.
Builds registered by this sweep that did not succeed are unregistered, as a
single failed `python -m pipeline` does; re-running the sweep registers them
again and DVC redoes only what it had not recorded.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import time
from pathlib import Path

from pipeline.engine.config import CONF_DIR, ConfigError, compose, validate
from pipeline.engine.layout import BUILDS, ROOT, output_dir

DEFAULT_LAUNCHER = "local"  # conf/hydra/launcher/local.yaml (joblib)
RESULT_FILE = "edgekiln-result.json"
STOP_FILE = "edgekiln-stopped"  # in the sweep's folder, once the sweep was stopped


def _is_hydra_override(arg: str) -> bool:
    return arg.lstrip("+~").startswith(("hydra/", "hydra."))


def expand(overrides: list[str]) -> list[list[str]]:
    """One override list per job, in the order Hydra's basic sweeper launches them."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        (jobs,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    except HydraException as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise ConfigError(f"malformed sweep: {first}") from None
    return [list(job) for job in jobs]


def plan(overrides: list[str]) -> list[tuple[list[str], dict]]:
    """(overrides, validated config) of every job; ConfigError naming the job otherwise."""
    jobs = []
    for i, job in enumerate(expand(overrides)):
        try:
            jobs.append((job, validate(compose(job), job)))
        except ConfigError as e:
            raise ConfigError(f"job #{i} ({' '.join(job) or 'defaults'}): {e}") from None
    names = [cfg["build"]["name"] for _, cfg in jobs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(
            f"jobs {', '.join('#' + str(i) for i, n in enumerate(names) if n == dupes[0])} all build {dupes[0]!r}: "
            f"two jobs would write the same outputs; give them build.name=... apart or drop the duplicate"
        )
    return jobs


def job(cfg, *, root: str, cache_remote: str | None, launcher_pid: int | None = None) -> dict:
    """One sweep job, in whatever worker the launcher chose: build one registered build.

    Never raises: the launcher would turn an exception into a lost job for the
    whole batch; every outcome is a result instead."""
    t0 = time.monotonic()
    result: dict = {"build": None, "status": "error", "rc": None, "seconds": None,
                    "host": socket.gethostname(), "pid": os.getpid(), "detail": ""}
    out_dir = None
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        out_dir = Path(hc.runtime.output_dir)
        result["job"] = hc.job.num
        if Path(root).resolve() != ROOT:
            raise RuntimeError(f"this worker runs the checkout at {ROOT}, the sweep's is {root}: "
                               f"check the project out at the same path on every worker")
        os.chdir(ROOT)  # DVC works in the repository of the working directory
        if cache_remote:
            from pipeline.engine import cache_remote as shared

            os.environ[shared.ENV] = cache_remote
        overrides = list(hc.overrides.task)
        resolved = validate(cfg, overrides)
        name = resolved["build"]["name"]
        result["build"] = name
        from pipeline.engine import locks, stopping
        from pipeline.engine.build import build, register

        say = lambda line: print(f"[{name}] {line}", file=sys.stderr, flush=True)  # noqa: E731
        stop_file = out_dir.parent / STOP_FILE  # written by the launcher's handler (stopping_workers)
        not_started = dict(status="stopped", detail="the sweep was stopped before this build started")
        if stopping.job_stopped(stop_file):
            result.update(not_started)
            return result
        if os.getpid() != launcher_pid:
            # A worker whose launcher was SIGKILLed stops its build; the launcher's signals stop it
            # too. Not the launcher itself (one job at a time runs in its process): its own parent
            # (a shell that started it with nohup) may go and leave it running.
            stopping.watch_parent()
        try:
            with stopping.stoppable(worker=True):
                if stopping.job_stopped(stop_file):
                    result.update(not_started)
                    return result
                with locks.hold(name, say=say):
                    # A no-op where the sweep registered it (same checkout); a worker with
                    # its own checkout (Ray, Slurm) registers it there.
                    with locks.hold(locks.REGISTRY, say=say):
                        register(resolved)
                    rc = build(name, resolved, say)
        except (stopping.Stopped, locks.LockError):
            if not stopping.requested():
                raise
            rc = 128 + stopping.requested()
        if stopping.requested():
            line = stopping.line(f"build {name}")
            say(line)
            result.update(status="stopped", rc=rc, detail=line.partition(": ")[2].partition(": ")[2])
            return result
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():  # which Ray node ran it
            result["ray_node"] = ray.get_runtime_context().get_node_id()
        result.update(status="ok" if rc == 0 else "failed", rc=rc,
                      detail="" if rc == 0 else "a stage failed (its error is in the log above)")
    except BaseException as e:  # noqa: BLE001 - reported, not raised (see the docstring)
        result.update(status="error", detail=f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if isinstance(e, KeyboardInterrupt):
            result["status"] = "interrupted"
    finally:
        result["seconds"] = round(time.monotonic() - t0, 1)
        if out_dir is not None:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / RESULT_FILE).write_text(json.dumps(result) + "\n")
            except OSError:
                pass  # the return value still carries it
    return result


def _launch(overrides: list[str], task) -> list:
    """Hydra's multirun (sweeper + the chosen launcher) on conf/, returning the
    JobReturns. Hydra's public entry point, @hydra.main, parses sys.argv and
    discards the sweep's results; this is the call it makes underneath."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    from pipeline.engine.schema import register

    register()
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="edgekiln", config_search_path=create_config_search_path(str(CONF_DIR)))
    try:
        batches = hydra.multirun(config_name="config", task_function=task, overrides=overrides)
    finally:
        GlobalHydra.instance().clear()
    return [r for batch in batches for r in batch]


def _figures(name: str) -> tuple[str, str]:
    """(parity logits SNR dB, decode tok/s) from the build's manifests, '-' when absent."""
    out = []
    for stage, key in (("verify_parity", "logits_snr_db"), ("benchmark", "decode_tok_s")):
        try:
            m = json.loads((ROOT / output_dir(stage, name) / "manifest.json").read_text())
            v = m["result"]["metrics"][key]
            out.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        except (OSError, KeyError, TypeError, ValueError):
            out.append("-")
    return out[0], out[1]


def print_summary(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    ok = sum(r["status"] == "ok" for r in rows)
    table = Table(title=f"sweep: {ok} of {len(rows)} builds ok")
    for col, just in (("job", "right"), ("build", "left"), ("status", "left"), ("s", "right"),
                      ("worker", "left"), ("parity SNR dB", "right"), ("decode tok/s", "right"), ("detail", "left")):
        table.add_column(col, justify=just)
    for r in rows:
        snr, tps = _figures(r["build"]) if r["status"] == "ok" else ("-", "-")
        worker = f"{r['host']}:{r['pid']}" if r.get("host") else "-"
        table.add_row(str(r["job"]), escape(r["build"] or "?"), r["status"],
                      "-" if r.get("seconds") is None else f"{r['seconds']:.1f}", escape(worker), snr, tps,
                      escape(r.get("detail") or ""))
    Console(width=160, file=sys.stdout).print(table)


def main(args: list[str]) -> int:
    """`python -m pipeline -m ARGS` (the `-m` already taken off)."""
    hydra_args = [a for a in args if _is_hydra_override(a)]
    build_args = [a for a in args if not _is_hydra_override(a)]
    try:
        jobs = plan(build_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not any(a.lstrip("+").startswith("hydra/launcher=") for a in hydra_args):
        hydra_args.append(f"hydra/launcher={DEFAULT_LAUNCHER}")
    local = _launcher(hydra_args) == "joblib (local)"
    if local and not any(a.lstrip("+").startswith("hydra.launcher.n_jobs=") for a in hydra_args):
        # One worker per core, but no more than there are jobs: a worker that never gets one
        # only idles (loky keeps it 5 minutes), and outlives a launcher that was SIGKILLed.
        hydra_args.append(f"hydra.launcher.n_jobs={min(os.cpu_count() or 1, len(jobs))}")
    if not any(a.lstrip("+").startswith("hydra.sweep.dir=") for a in hydra_args):
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
        hydra_args.append(f"hydra.sweep.dir={Path(os.environ.get('TMPDIR', '/tmp')) / 'edgekiln-multirun' / stamp}")
    # Hydra's job logging would reconfigure the worker's root logger; DVC's own
    # lines are what a user reads, so leave logging as DVC set it up.
    hydra_args.append("hydra/job_logging=none")

    from pipeline.engine import cache_remote, dvcgen, locks
    from pipeline.engine.build import register

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    names = [cfg["build"]["name"] for _, cfg in jobs]
    try:
        with locks.hold(locks.REGISTRY, say=say):
            new = {n for n in names if not (ROOT / BUILDS / f"{n}.yaml").exists()}
            for _, cfg in jobs:
                register(cfg)
    except locks.LockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    say(f"sweep: {len(jobs)} builds registered ({', '.join(names)}); launching through {_launcher(hydra_args)}")
    # Workers (loky processes, a local Ray instance's) import this checkout's
    # code, not whatever `pipeline` the venv's editable install points at.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    task = functools.partial(job, root=str(ROOT), cache_remote=cache_remote.remote(), launcher_pid=os.getpid())
    sweep_dir = Path(next(a for a in hydra_args if a.startswith("hydra.sweep.dir=")).split("=", 1)[1])
    results: list[dict | None] = [None] * len(jobs)
    launch_error = None
    from pipeline.engine import stopping

    try:
        # SIGTERM, SIGINT or SIGHUP stop every worker's build; their results still come back.
        with stopping.stopping_workers(sweep_dir / STOP_FILE):
            for ret in _launch(build_args + hydra_args, task):
                value = ret.return_value
                results[ret.hydra_cfg.hydra.job.num] = value
    except Exception as e:  # noqa: BLE001 - a launcher failure (a worker killed, Ray down): summarized below
        text = str(e).strip().splitlines()
        launch_error = f"{e.__class__.__name__}: {text[0] if text else ''}"
        say(f"error: the launcher failed: {launch_error}")
    rows = []
    for i, (overrides, cfg) in enumerate(jobs):
        r = results[i] or _result_file(sweep_dir / str(i))
        if r is None:
            r = {"build": cfg["build"]["name"], "status": "lost", "rc": None, "seconds": None, "host": None,
                 "pid": None, "detail": f"no result: {launch_error or 'the job never reported'}"}
        r["job"] = i
        rows.append(r)
    failed_new = [r["build"] for r in rows if r["status"] != "ok" and r["build"] in new]
    if failed_new:
        with locks.hold(locks.REGISTRY, say=say):
            for n in failed_new:
                (ROOT / BUILDS / f"{n}.yaml").unlink(missing_ok=True)
            dvcgen.write()
        say(f"unregistered the new builds that did not succeed: {', '.join(failed_new)} (re-run the sweep to finish them)")
    print_summary(rows)
    if stopping.requested():
        stopped = [f"{r['build']} ({r['detail']})" for r in rows if r["status"] == "stopped" and r.get("rc")]
        print(f"error: sweep: stopped by {stopping.signal_name(stopping.requested())}"
              + (f": {', '.join(stopped)}" if stopped else ""), file=sys.stderr)
        return 128 + stopping.requested()
    return 0 if all(r["status"] == "ok" for r in rows) else 1


def _launcher(hydra_args: list[str]) -> str:
    choice = [a.split("=", 1)[1] for a in hydra_args if a.lstrip("+").startswith("hydra/launcher=")][-1]
    return {"local": "joblib (local)", "ray_cluster": "Ray", "slurm": "Slurm (submitit)"}.get(choice, choice)


def _result_file(folder: Path) -> dict | None:
    try:
        return json.loads((folder / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
