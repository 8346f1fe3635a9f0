"""Where everything lives, and which stage reads what: the one source of truth.

`dvc.yaml` is generated from this module (pipeline/dvcgen.py) and every stage
run (pipeline/run_stage.py) resolves its params, inputs and output folder here,
so the cache key DVC computes and what a stage actually sees cannot drift apart.

Scopes:
- `host`: one per repository (the probe: the builder's ISA facts and toolchain).
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

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = "artifacts"
BUILDS = "builds"
EXP_BUILD = "exp"
EXP_PARAMS = "params.yaml"
PROBE_DIR = f"{ARTIFACTS}/_probe"
HOST_FILE = f"{PROBE_DIR}/host.json"

# The pipeline, in order. Each name is a module in stages/.
STAGES: tuple[str, ...] = (
    "probe",
    "model",
    "untie_head",
    "calibrate",
    "quantize",
    "export",
    "pack",
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
    )


def declarations() -> list[StageDecl]:
    return [declaration(s) for s in STAGES]


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


def toolchain_file(stage: str) -> str:
    return f"{PROBE_DIR}/toolchain/{stage}.json"


def output_dir(stage: str, build: str | None, model_section: dict | None = None) -> str:
    """The artifact folder of `stage` for `build` (repo-relative)."""
    scope = declaration(stage).scope
    if scope == "host":
        return PROBE_DIR
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
