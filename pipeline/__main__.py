"""python -m pipeline [OVERRIDE ...]: compose, validate, register and build.

    python -m pipeline                         # device=auto: this machine, embedded model
    python -m pipeline device=galaxy_s25       # a cross-build for another device class
    python -m pipeline model=hf model.path=/abs/ckpt device=x86_avx512
    python -m pipeline model=gguf model.path=/abs/model.gguf   # a GGUF file, dequantized to fp32
    python -m pipeline model=gemma3_270m       # Gemma 3 270M (pip install -e '.[models]')
    python -m pipeline --cfg                   # print the composed config, build nothing
    python -m pipeline -v device=x86_avx512    # DVC's own lines and advice shown too
    python -m pipeline -m device=xeon_amx,x86_avx512,galaxy_s25   # a sweep, built in parallel
    python -m pipeline generate BUILD "prompt" # stream text from a built artifact
    python -m pipeline serve BUILD [--port N]  # vLLM's server from a vLLM build's deploy profile
    python -m pipeline --help

Overrides are Hydra's (`group=option`, `section.key=value`). Settings left null
follow the model (context length, parity and calibration lengths: past its
sliding window); an explicit one that cannot exercise it is refused before any
stage runs. The build is registered as builds/<build.name>.yaml, dvc.yaml is
regenerated, and DVC runs what is out of date: nothing, when nothing changed.
A build has the stages its device needs (compile_qnn only for a phone). Each says
one line: ran, up to date, or restored from the run-cache, with the time and peak
memory of the run that made its output. DVC's own lines and advice (git add
dvc.lock, autostage, dvc push), its command lines and libraries' FutureWarnings and
tqdm bars are shown with `-v` only. The summary lists each stage's time and peak.
"""

from __future__ import annotations

import json
import os
import sys

from pipeline.engine.build import build, register
from pipeline.engine.narrate import VERBOSE_ENV
from pipeline.engine.config import GROUPS, CONF_DIR, ConfigError, compose, context_note, validate
from pipeline.engine.layout import (
    ARTIFACTS,
    BUILDS,
    ROOT,
    STAGES,
    declaration,
    output_dir,
    stage_applies,
)


def _help() -> str:
    lines = [__doc__.strip(), "", "Config groups (conf/<group>/<option>.yaml):"]
    for g in GROUPS:
        opts = sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml"))
        lines.append(f"  {g:<10} {', '.join(opts)}")
    lines += [
        "",
        "Stages: " + " -> ".join(STAGES) + " (compile_qnn only in a build for a QNN HTP phone)",
        "",
        "llama.cpp devices (x86_llamacpp, arm64_llamacpp) build a GGUF with llama.cpp's own converter,",
        "which no wheel ships: fetch it once with `python -m pipeline.toolchains.converter fetch`.",
        "",
        "Fleet builds: `python -m pipeline -m device=xeon_amx,x86_avx512,galaxy_s25` builds a",
        "sweep (Hydra multirun syntax) in parallel: hydra/launcher=local (joblib, the default),",
        "ray_cluster or slurm (conf/hydra/launcher/); every build is registered before the fan-out and",
        "a table of each build's result closes the run (exit 1 if any failed).",
        "EDGEKILN_CACHE_REMOTE=<dvc remote> shares stage results between builders through that",
        "remote's run-cache. `python -m pipeline.fleet.runners set BUILD ssh://...` runs the build's",
        "parity and benchmark stages on the device itself.",
        "",
        "Through DVC: `dvc exp run -S device=X` composes the same config into params.yaml",
        "(the `exp` build; DVC 3 has no `dvc repro -S`). Plain `dvc repro` brings every",
        "registered build (builds/*.yaml) up to date.",
    ]
    return "\n".join(lines)


def summary(name: str) -> None:
    """The build's parity and speed, read back from its artifacts' manifests,
    then each stage's cost as its manifest recorded it."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rows = []
    for stage in ("verify_parity", "benchmark"):
        if stage not in STAGES:
            continue
        mf = ROOT / output_dir(stage, name) / "manifest.json"
        if mf.is_file():
            rows.append((stage, json.loads(mf.read_text()).get("result", {})))
    console = Console(width=110)
    table = Table(title=f"build {name}", show_lines=False)
    table.add_column("stage")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for stage, result in rows:
        for k, v in (result.get("summary") or result.get("metrics") or {}).items():
            table.add_row(stage, escape(k), escape(f"{v:.4g}" if isinstance(v, float) else str(v)))
    console.print(table)

    import yaml

    from pipeline.engine.layout import params_file

    try:  # the shared model's folder is named by the build's model section
        registered = yaml.safe_load((ROOT / params_file(name)).read_text()) or {}
    except (OSError, yaml.YAMLError):
        registered = {}
    model, device = registered.get("model"), registered.get("device")
    # When each stage last ran, not this build: one DVC restored or found up to
    # date shows the run that made its output (which it was is not known here).
    cost = Table(title=f"build {name}: each stage's cost, as recorded when it ran", show_lines=False)
    cost.add_column("stage")
    cost.add_column("ran at")
    cost.add_column("seconds", justify="right")
    cost.add_column("peak resident", justify="right")
    cost.add_column("largest subprocess", justify="right")  # "-": none, or not recorded
    mib = lambda b: f"{b / 2**20:,.0f} MiB" if isinstance(b, (int, float)) else "-"  # noqa: E731
    for stage in STAGES:
        if (declaration(stage).scope == "model" and not model) or not stage_applies(stage, device):
            continue
        try:
            mf = ROOT / output_dir(stage, name, model) / "manifest.json"
            t = json.loads(mf.read_text()).get("timings") or {}
        except (OSError, ValueError, KeyError):
            continue  # not built (yet), or unreadable: verify says which when a stage reads it
        secs = t.get("seconds")
        cost.add_row(stage, escape(str(t.get("started", "-"))),
                     f"{secs:,.1f}" if isinstance(secs, (int, float)) else "-",
                     mib(t.get("peak_rss_bytes")), mib(t.get("peak_rss_children_bytes") or None))
    if cost.row_count:
        console.print(cost)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        from pipeline.runtimes.vllm import serve_main

        return serve_main(argv[1:])
    if argv[:1] == ["generate"]:
        from pipeline.runtimes.generate import main as generate_main

        return generate_main(argv[1:])
    if any(a in ("-h", "--help") for a in argv):
        print(_help())
        return 0
    if "-m" in argv or "--multirun" in argv:
        from pipeline.fleet.sweep import main as fleet_main

        return fleet_main([a for a in argv if a not in ("-m", "--multirun")])
    show_cfg = "--cfg" in argv
    if any(a in ("-v", "--verbose") for a in argv):
        os.environ[VERBOSE_ENV] = "1"  # DVC's own narration and advice shown (the stage workers inherit it)
    overrides = [a for a in argv if a not in ("--cfg", "-v", "--verbose")]
    bad = [a for a in overrides if a.startswith("-")]
    if bad:
        print(f"error: unknown option {bad[0]} (see --help)", file=sys.stderr)
        return 2
    try:
        cfg = validate(compose(overrides), overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if show_cfg:
        import yaml

        print(yaml.safe_dump(cfg, sort_keys=False), end="")
        return 0
    name = cfg["build"]["name"]
    from pipeline.engine import locks, stopping

    note = context_note(cfg)

    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        # SIGTERM, SIGINT or SIGHUP stop the running stage, then the build (pipeline/engine/stopping.py).
        with stopping.stoppable():
            # One run of a build at a time (a second waits, then finds it built);
            # registry rewrites are serialized across builds (pipeline/engine/locks.py).
            with locks.hold(name, say=say):
                is_new, path = not (ROOT / BUILDS / f"{name}.yaml").exists(), None
                try:
                    with locks.hold(locks.REGISTRY, say=say):
                        path = register(cfg)
                    print(f"build {name}: {path.relative_to(ROOT)} -> {ARTIFACTS}/{name}/", file=sys.stderr)
                    if note:
                        print(f"build {name}: {note}", file=sys.stderr)
                    rc = build(name, cfg, say)
                except stopping.Stopped:
                    rc = 1
                if rc != 0:
                    if is_new and path is not None:
                        # A build that never succeeded is not left in the registry, where
                        # every later plain `dvc repro` would trip over it.
                        from pipeline.engine import dvcgen

                        with locks.hold(locks.REGISTRY, say=say):
                            path.unlink(missing_ok=True)
                            dvcgen.write()
                    unregistered = "; the new build was not registered" if is_new and path is not None else ""
                    if stopping.requested():
                        print(stopping.line(f"build {name}") + unregistered, file=sys.stderr)
                        return 128 + stopping.requested()
                    print(f"error: build {name} failed (the stage's error is above); nothing failed was cached"
                          + unregistered, file=sys.stderr)
                    return rc
    except locks.LockError as e:
        if stopping.requested():  # interrupted while waiting for a lock: nothing of the build ran
            print(stopping.line(f"build {name}"), file=sys.stderr)
            return 128 + stopping.requested()
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary(name)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m pipeline --help | head`: the reader left, not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
