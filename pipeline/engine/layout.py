"""Where everything lives, and which stage reads what: the one source of truth.

`dvc.yaml` is generated from this module (pipeline/engine/dvcgen.py) and every stage
run (pipeline/engine/run_stage.py) resolves its params, inputs and output folder here,
so the cache key DVC computes and what a stage actually sees cannot drift apart.

Scopes:
- `host`: the probe (the builder's ISA facts and toolchain). It runs once per
  consumer: one instance per shared model (artifacts/_probe/<model id>/, read
  by the model stage) and one per build (artifacts/<build>/probe/, read by that
  build's stages). No output is written by two builds, so builds of different
  devices run side by side without tripping DVC's per-output lock (a probe
  shared by all builds would be rewritten by one while another reads it).
- `model`: one per distinct `model` section, shared by every registered build of
  that model (training the embedded model once, not once per device).
- `build`: one per build, under artifacts/<build>/<stage>/.

Builds: each registered build is `builds/<name>.yaml` (git-tracked, written by
`python -m pipeline`). The DVC-experiment build `exp` reads `params.yaml`, which
`dvc exp run -S ...` composes from conf/ through Hydra.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable

from pipeline.sources import user_cache  # noqa: F401  (the per-user folder, for the parts above sources)

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = "artifacts"
BUILDS = "builds"
EXP_BUILD = "exp"
EXP_PARAMS = "params.yaml"
MODEL_PROBES = f"{ARTIFACTS}/_probe"

# The pipeline, in order. Each name is a module in stages/.
STAGES: tuple[str, ...] = (
    "probe",
    "model",
    "untie_head",
    "calibrate",
    "quantize",
    "export",
    "pack",
    "compile_qnn",
    "deploy_profile",
    "verify_parity",
    "benchmark",
)

# Sections a stage may read that are not plain config: they come from the probe.
PROBED_SECTIONS = ("device", "host")

BUILD_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,79}$")
RESERVED_BUILD_NAMES = {EXP_BUILD}


@dataclass(frozen=True)
class StageDecl:
    name: str
    reads: tuple[str, ...]
    inputs: tuple[str, ...]
    toolchain: tuple[str, ...]
    scope: str  # host | model | build
    module: ModuleType
    applies: Callable[[dict], bool] | None = None  # the stage's `applies(device)`; None: every device

    @property
    def source(self) -> str:
        return f"stages/{self.name}.py"


@lru_cache(maxsize=None)
def declaration(stage: str) -> StageDecl:
    if stage not in STAGES:
        raise KeyError(f"unknown stage {stage!r}; stages are: {', '.join(STAGES)}")
    module = importlib.import_module(f"stages.{stage}")
    return StageDecl(
        name=stage,
        reads=tuple(getattr(module, "READS")),
        inputs=tuple(getattr(module, "INPUTS")),
        toolchain=tuple(getattr(module, "TOOLCHAIN", ())),
        scope=getattr(module, "SCOPE", "build"),
        module=module,
        applies=getattr(module, "applies", None),
    )


def declarations() -> list[StageDecl]:
    return [declaration(s) for s in STAGES]


def stage_applies(stage: str, device: dict | None) -> bool:
    """Is `stage` part of a build for this device (the build file's `device` section)?

    A stage that fits only some devices says so with `applies(device)` (compile_qnn:
    a QNN HTP); a build for another device has no such stage in dvc.yaml and its
    consumers do not read it. `device` None: not known when dvc.yaml is written
    (the `exp` build, whose params.yaml `dvc exp run -S` composes), so every stage
    is there, and one that does not fit says so in its manifest."""
    decl = declaration(stage)
    return device is None or decl.applies is None or bool(decl.applies(device))


def stage_inputs(stage: str, device: dict | None) -> tuple[str, ...]:
    """The input stages `stage` reads in a build for this device (see stage_applies)."""
    return tuple(name for name in declaration(stage).inputs if stage_applies(name, device))


def build_stages(device: dict | None) -> list[str]:
    """A build's own stages for this device, in pipeline order (its probe first; the
    shared model's stages are the model's)."""
    return [s for s in STAGES if declaration(s).scope in ("host", "build") and stage_applies(s, device)]


def build_device(build: str) -> dict | None:
    """The `device` section of a registered build's file; None for the exp build."""
    if build == EXP_BUILD:
        return None
    import yaml

    return (yaml.safe_load((ROOT / params_file(build)).read_text()) or {}).get("device")


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def model_id(model_section: dict) -> str:
    """A model's identity: its name plus the hash of everything in its section.

    Two builds share the model stage only when their whole `model` section is
    identical (source, path, dtype, training recipe...).
    """
    digest = sha256_text(canonical_json(model_section))
    return f"{model_section['name']}-{digest[:16]}"


def params_file(build: str) -> str:
    return EXP_PARAMS if build == EXP_BUILD else f"{BUILDS}/{build}.yaml"


def model_params_file(mid: str) -> str:
    return f"{BUILDS}/_models/{mid}.yaml"


def probe_dir(build: str | None, model_section: dict | None = None) -> str:
    """The probe instance of a build (`build` given) or of a shared model."""
    if build is not None:
        return f"{ARTIFACTS}/{build}/probe"
    assert model_section is not None
    return f"{MODEL_PROBES}/{model_id(model_section)}"


def _serving_probe(stage: str, build: str | None, model_section: dict | None) -> str:
    """The probe instance whose files `stage` of this build (or model) depends on."""
    if build is None or (declaration(stage).scope == "model" and build != EXP_BUILD):
        return probe_dir(None, model_section)
    return probe_dir(build)


def toolchain_file(stage: str, build: str | None, model_section: dict | None = None) -> str:
    return f"{_serving_probe(stage, build, model_section)}/toolchain/{stage}.json"


def host_file(build: str) -> str:
    return f"{probe_dir(build)}/host.json"


def output_dir(stage: str, build: str | None, model_section: dict | None = None) -> str:
    """The artifact folder of `stage` for `build` (repo-relative)."""
    scope = declaration(stage).scope
    if scope == "host":
        return probe_dir(build, model_section)
    if scope == "model" and build != EXP_BUILD:
        assert model_section is not None
        return f"{ARTIFACTS}/_models/{model_id(model_section)}"
    return f"{ARTIFACTS}/{build}/{stage}"


def depends_on_host(stage: str, build: str, device_name: str | None) -> bool:
    """Does this stage of this build read probed host facts?

    `host` always does. `device` does when the device is `auto` (resolved by
    the probe) and for the DVC-experiment build, whose device is only known
    when `dvc exp run` composes params.yaml.
    """
    reads = declaration(stage).reads
    if "host" in reads:
        return True
    if "device" in reads:
        return build == EXP_BUILD or device_name == "auto"
    return False


def stage_ref(build: str, stage: str) -> str:
    """DVC stage name. DVC allows only letters, digits, '_' and '-' in names."""
    return f"{build.replace('.', '_')}--{stage}"


def model_stage_ref(stage: str, model_section: dict) -> str:
    """DVC name of a shared model's stage (`model--<id>`) or its probe (`probe--<id>`).

    No clash with `<build>--<stage>`: a model id ends in a 16-hex-digit hash,
    never a stage name."""
    return f"{stage}--{model_id(model_section).replace('.', '_')}"


# Builds whose parity and benchmark run on a device (pipeline/fleet/runners.py
# sets them): the generated dvc.yaml depends on this file, so the engine reads it here.
RUNNERS_DIR = f"{BUILDS}/_runners"


def runner_file(build: str) -> str:
    return f"{RUNNERS_DIR}/{build}.yaml"


def runner_of(build: str) -> dict | None:
    """The build's runner (builds/_runners/<build>.yaml), or None: the builder runs everything."""
    import yaml

    path = ROOT / runner_file(build)
    return yaml.safe_load(path.read_text()) if path.is_file() else None
