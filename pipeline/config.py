"""Compose and validate a build's config; every failure is one line naming file and key.

Hydra does the composition (defaults list, group options, overrides) on top of
the typed schema. Its own errors are multi-line and name the Python type
(`DeviceConfig`), not the file a user edits, so they are translated here.
After composition the result is validated again, strictly, against a fresh
copy of the schema, which closes the two gaps the notes found: `+key=value`
force-adding an unknown key, and a `???` value that passes composition.
"""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from pathlib import Path

from .layout import BUILD_NAME, RESERVED_BUILD_NAMES, ROOT

CONF_DIR = ROOT / "conf"
GROUPS = ("device", "model", "priority", "parity", "benchmark", "calibrate", "quantize", "pack")

# Sanity bounds: an absurd value fails here, not an hour into a build.
LIMITS = {
    "export.context_length": (8, 131072),
    "export.opset": (17, 23),
    "benchmark.prompt_length": (1, 131072),
    "benchmark.decode_tokens": (1, 131072),
    "benchmark.passes": (1, 100),
    "benchmark.warmup_tokens": (0, 1024),
    "benchmark.threads": (0, 1024),
    "parity.decode_tokens": (1, 131072),
    "parity.min_greedy_match": (0, 10_000),
    "device.cores": (0, 4096),
    "device.threads": (0, 4096),
}


class ConfigError(Exception):
    """One line, naming the file or override and the key."""


def _group_choice(overrides: list[str], group: str) -> str:
    for o in overrides:
        m = re.fullmatch(rf"\+?{group}=([\w.-]+)", o)
        if m:
            return m.group(1)
    defaults = (CONF_DIR / "config.yaml").read_text()
    m = re.search(rf"^\s*-\s*{group}:\s*(\S+)", defaults, re.M)
    return m.group(1) if m else "?"


def _where(key: str, overrides: list[str]) -> str:
    """The file or override a key came from, for the error message."""
    for o in overrides:
        lhs = o.split("=", 1)[0].lstrip("+~")
        if lhs in GROUPS:
            continue  # a group choice: the key comes from that option's file
        if lhs == key or key.startswith(lhs + "."):
            return f"command-line override '{o}'"
    section = key.split(".", 1)[0]
    if section in GROUPS:
        return f"conf/{section}/{_group_choice(overrides, section)}.yaml"
    return "conf/config.yaml"


def _schema_keys(section: str) -> list[str]:
    from .schema import BuildConfig

    for f in fields(BuildConfig):
        if f.name == section and is_dataclass(f.default_factory()):
            return [g.name for g in fields(f.default_factory())]
    return []


def _translate(exc: Exception, overrides: list[str]) -> ConfigError:
    # Hydra wraps the OmegaConf error that names the key: read both.
    text = str(exc) + ("\n" + str(exc.__cause__) if exc.__cause__ else "")
    first = text.strip().splitlines()[0] if text.strip() else exc.__class__.__name__
    m = re.search(r"Could not find '(\w+)/([^']*)'", text)
    if m:
        group, name = m.groups()
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return ConfigError(f"unknown {group} {name!r}: choose one of {', '.join(options)}")
    m = re.search(r"full_key: ([\w.\[\]]+)", text)
    full_key = m.group(1) if m else None
    if "not in" in text and full_key:
        section, _, leaf = full_key.partition(".")
        valid = _schema_keys(section)
        hint = f" (valid keys: {', '.join(valid)})" if valid else ""
        return ConfigError(f"{_where(full_key, overrides)}: unknown key '{full_key}'{hint}")
    if "Could not override" in text and "not in" in text and full_key:
        section = full_key.split(".", 1)[0]
        valid = _schema_keys(section)
        return ConfigError(
            f"command-line override for '{full_key}': no such key (valid keys of {section}: {', '.join(valid)})"
        )
    if ("could not be converted" in text or "Invalid type" in text or "Value '" in text) and full_key:
        detail = next((l for l in text.splitlines() if "could not be converted" in l or "Value '" in l), first)
        return ConfigError(f"{_where(full_key, overrides)}: {full_key}: {detail.strip()}")
    if "Could not override" in text or "Could not append" in text:
        m = re.search(r"Could not (?:override|append to) '([^']+)'", text)
        key = m.group(1) if m else "?"
        return ConfigError(f"command-line override for '{key}': no such key in the schema")
    if "Error parsing override" in text or "mismatched input" in text or "no viable alternative" in text:
        bad = next((o for o in overrides if o in text), " ".join(overrides))
        return ConfigError(f"malformed override '{bad}': write key=value, e.g. device=x86_avx512")
    if full_key:
        return ConfigError(f"{_where(full_key, overrides)}: {full_key}: {first}")
    return ConfigError(first)


def compose(overrides: list[str]):
    """Hydra composition of conf/ with the overrides; raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import OmegaConfBaseException

    from .schema import register

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
    except (OmegaConfBaseException, Exception) as e:  # Hydra raises several unrelated types
        raise _translate(e, list(overrides)) from None
    return cfg


def validate(cfg, overrides: list[str] = (), source: str | None = None) -> dict:
    """Strict check of a composed (or loaded) config; returns the resolved dict."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from .schema import BuildConfig

    overrides = list(overrides)
    where = (lambda key: source) if source else (lambda key: _where(key, overrides))
    try:
        container = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
        strict = OmegaConf.merge(OmegaConf.structured(BuildConfig), container)
    except OmegaConfBaseException as e:
        err = _translate(e, overrides)
        raise ConfigError(f"{source}: {err}" if source else str(err)) from None
    missing = sorted(OmegaConf.missing_keys(strict))
    # A device's qnn block is optional, but when present all of it is required.
    if missing:
        key = missing[0]
        raise ConfigError(f"{where(key)}: {key} is required but not set (???): set {key}=...")
    resolved = OmegaConf.to_container(strict, resolve=True)
    _check(resolved, where)
    return resolved


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d[part]
    return d


def _check(c: dict, where) -> None:
    name = c["build"]["name"]
    if not BUILD_NAME.fullmatch(name) or name in RESERVED_BUILD_NAMES or ".." in name:
        raise ConfigError(
            f"{where('build.name')}: build.name {name!r} must match {BUILD_NAME.pattern} "
            f"(no '/', no '..', not {sorted(RESERVED_BUILD_NAMES)}): it names a folder under artifacts/"
        )
    for key, (lo, hi) in LIMITS.items():
        v = _get(c, key)
        if not lo <= v <= hi:
            raise ConfigError(f"{where(key)}: {key}={v} is outside [{lo}, {hi}]")
    ctx = c["export"]["context_length"]
    b = c["benchmark"]
    if b["prompt_length"] + b["decode_tokens"] + b["warmup_tokens"] > ctx:
        raise ConfigError(
            f"{where('benchmark.prompt_length')}: benchmark.prompt_length + decode_tokens + warmup_tokens "
            f"= {b['prompt_length'] + b['decode_tokens'] + b['warmup_tokens']} exceeds export.context_length={ctx}"
        )
    p = c["parity"]
    if not p["prompts"]:
        raise ConfigError(f"{where('parity.prompts')}: parity.prompts is empty: parity needs prompts")
    if p["min_greedy_match"] > len(p["prompts"]):
        raise ConfigError(
            f"{where('parity.min_greedy_match')}: parity.min_greedy_match={p['min_greedy_match']} "
            f"exceeds the {len(p['prompts'])} prompts"
        )
    m = c["model"]
    if m["source"] not in ("embedded", "hf"):
        raise ConfigError(f"{where('model.source')}: model.source must be 'embedded' or 'hf', not {m['source']!r}")
    if m["source"] == "hf":
        path = Path(str(m["path"])).expanduser()
        if not path.is_absolute():
            raise ConfigError(f"{where('model.path')}: model.path must be an absolute directory, got {m['path']!r}")
    if c["priority"]["name"] not in ("speed", "fidelity"):
        raise ConfigError(f"{where('priority.name')}: priority must be speed or fidelity")


def load_build_file(path: Path) -> dict:
    """A registered build (builds/<name>.yaml or params.yaml), validated."""
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ConfigError(f"{path}: no such build file: register the build with `python -m pipeline ...`")
    try:
        raw = OmegaConf.load(path)
    except Exception as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return validate(raw, source=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
