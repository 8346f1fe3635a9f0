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
    HOST_FILE,
    ROOT,
    declaration,
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
    if decl.scope == "host":
        return {}, None
    if model is not None:
        from omegaconf import OmegaConf

        path = ROOT / model_params_file(model)
        if not path.is_file():
            raise StageError(f"{path}: model params missing: re-register a build of this model")
        section = OmegaConf.to_container(OmegaConf.load(path), resolve=True)["model"]
        return {"model": section}, section
    full = load_build_file(ROOT / params_file(build))
    host = lambda: _load_json(ROOT / HOST_FILE, "host facts")  # noqa: E731
    return visible_params(stage, full, build, host), full["model"]


def cache_key(stage: str, params: dict, inputs: dict[str, dict]) -> dict:
    """Everything that shapes the output; its sha256 is the manifest's config_hash."""
    code = {p: manifest.sha256_file(ROOT / p) for p in stage_code(stage)}
    tc_path = ROOT / toolchain_file(stage)
    toolchain = json.loads(tc_path.read_text()) if stage != "probe" else {}
    return {
        "stage": stage,
        "params": params,
        "toolchain": toolchain,
        "code": code,
        "inputs": {name: m["content_sha256"] for name, m in sorted(inputs.items())},
    }


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
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed run
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    key = cache_key(stage, params, input_manifests)
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
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


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
        out = run(args.stage, args.build, args.model)
    except (StageError, ConfigError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"error: {label}: {msg}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {label}: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except MemoryError:
        print(f"error: {label}: out of memory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"error: {label}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: keep the traceback, but out of the way
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"edgekiln-{args.stage}-{os.getpid()}.log"
        log.write_text(traceback.format_exc())
        print(f"error: {label}: internal error {e.__class__.__name__}: {e} (traceback: {log})", file=sys.stderr)
        return 1
    print(f"{label}: wrote {out.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
