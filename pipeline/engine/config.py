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

from pipeline.engine.layout import BUILD_NAME, RESERVED_BUILD_NAMES, ROOT

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
    "parity.max_prompts": (1, 10_000),
    "parity.qnn_prompts": (1, 10_000),
    "device.cores": (0, 4096),
    "device.threads": (0, 4096),
    "device.memory_gib": (0, 1 << 20),  # 0: auto, filled by the probe
    "parity.min_top1_agreement": (0, 1),
    "parity.min_top5_agreement": (0, 1),
    "benchmark.context_decode_tokens": (1, 131072),
    "calibrate.samples": (1, 100_000),
    "calibrate.seq_len": (2, 131072),
    "calibrate.min_samples": (1, 100_000),
    "calibrate.seed": (0, 2**32 - 1),
    "quantize.block_size": (1, 65536),
    "pack.ort_accuracy_level": (0, 4),  # MatMulNBits accuracy_level
    "pack.prefill_threshold": (1, 131072),
    "pack.qnn_calibration_sequences": (1, 10_000),
    "pack.qnn_calibration_stride": (1, 131072),
}

# Closed vocabularies of the stages' settings (kept here, not imported, so that
# this module's import closure, part of every stage's cache key, stays small).
CHOICES = {
    "quantize.method": ("gptq", "rtn"),  # pipeline/quant/gptq.py METHODS
    "quantize.group_fallback": ("error", "divisor"),  # stages/quantize.py FALLBACKS
    "pack.tinygemm_prefill": ("dequant_packed", "deinterleave_once"),  # pipeline/runtimes/tinygemm.py PREFILL_MODES
    "benchmark.llamacpp": ("auto", "off"),
    "parity.peers": ("auto", "off"),
    "benchmark.ortgenai": ("auto", "off"),
    "benchmark.vllm": ("auto", "off"),
    "parity.vllm": ("auto", "off"),
    "benchmark.huge_pages": ("auto", "off"),
    "benchmark.speculative": ("auto", "off"),
    "quantize.scale_dtype": ("fp32", "fp16"),  # pipeline/quant/gptq.py SCALE_DTYPES
    "pack.gguf_token_embedding": ("auto", "shared", "keep", "q8_0", "q4_0"),  # pipeline/quant/gguf_q4.py OTHERS
    "pack.qnn_weights": ("per_block", "per_channel", "per_tensor"),  # pipeline/graphs/qnn.py WEIGHT_GRANULARITIES
    "pack.qnn_residual": ("fp16", "uint16"),  # pipeline/graphs/npu_rewrite.py residual_stream
    "pack.qnn_attention": ("fp16", "uint16"),  # pipeline/graphs/npu_rewrite.py attention_cores
    "pack.qnn_embedding": ("int8", "int4", "graph"),  # pipeline/graphs/qnn.py EMBEDDING_CHOICES
    "pack.qnn_weight_method": ("gptq", "rtn"),  # pipeline/graphs/qnn.py WEIGHT_METHODS
    "pack.qnn_select": ("measured", "first"),  # stages/pack.py _select_precision
}
# Phone NPU precisions (pipeline/graphs/qnn.py PRECISIONS); no uncalibrated option.
QNN_PRECISIONS = ("fp16", "w8a16", "w4a16")
# Group sizes every 4-bit kernel takes: tinygemm's (pipeline/quant/int4_layouts.py
# TINYGEMM_GROUP_SIZES), all powers of two >= 16 as MatMulNBits requires.
GROUP_SIZES = (32, 64, 128, 256)
# What a model's name may be: it names a folder under artifacts/_models/.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,79}$")
MODEL_SOURCES = ("embedded", "hf", "gguf")  # stages/model.py SOURCES


class ConfigError(Exception):
    """One line, naming the file or override and the key."""

    def __init__(self, message: object = ""):
        # A user's override is echoed back: its control characters (a newline
        # would break the one-line contract) are shown escaped.
        text = str(message)
        super().__init__("".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text))


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
    from pipeline.engine.schema import BuildConfig

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
    m = re.search(r"Missing mandatory value: ([\w.]+)", text)
    if m:  # a ??? reached through an interpolation (build.name -> model.name -> model.path)
        key = m.group(1)
        return ConfigError(f"{_where(key, overrides)}: {key} is required but not set (???): set {key}=...")
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
    if ("Error parsing override" in text or "mismatched input" in text or "no viable alternative" in text
            or "NoViableAlt" in text or "token recognition error" in text):
        bad = next((o for o in overrides if o in text), " ".join(overrides))
        return ConfigError(f"malformed override '{bad}': write key=value, e.g. device=x86_avx512")
    if "Config group override must be" in text:  # group=null
        bad = next((o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GROUPS and "=" in o
                    and o.split("=", 1)[1].strip() in ("", "null", "~")), " ".join(overrides))
        group = bad.split("=", 1)[0].lstrip("+~")
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return ConfigError(f"command-line override '{bad}': {group} needs an option: choose one of {', '.join(options)}")
    if first.startswith("Error merging override") and exc.__cause__ is not None and str(exc.__cause__).strip():
        first = str(exc.__cause__).strip().splitlines()[0]  # the reason, not Hydra's wrapper
        if "is not Optional" in first:
            first += ": null is not allowed here"
    if "'NoneType' object has no attribute" in first:
        first = "cannot set keys inside a section that is null here"
    if "Incompatible key type" in first:  # a mapping key written as null / a number ({null: 0})
        first = "a mapping's keys must be names (a key was null or not text)"
    if full_key:
        return ConfigError(f"{_where(full_key, overrides)}: {full_key}: {first}")
    return ConfigError(first)


def compose(overrides: list[str]):
    """Hydra composition of conf/ with the overrides; raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.engine.schema import register

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

    from pipeline.engine.schema import BuildConfig

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
    _check_model(resolved["model"], where)
    # A registered build file (source given) holds its derived values already, and
    # was checked against the model when it was registered.
    facts = _model_defaults(resolved, where, refuse=source is None)
    _device_defaults(resolved)
    _check(resolved, where)
    if facts is not None:
        _refuse_unexercised(resolved, facts, where)
    return resolved


# The settings whose null default follows the model (pipeline/sources/model_facts.py derive()).
MODEL_DERIVED = ("export.context_length", "parity.decode_tokens", "calibrate.seq_len", "calibrate.samples",
                 "calibrate.min_samples", "parity.qnn_prompts", "parity.max_prompts")


def _model_defaults(c: dict, where, refuse: bool):
    """Fill the null model-derived settings from the checkpoint's facts (returned
    when `refuse`: the explicit settings are then checked against them)."""
    from pipeline.sources import model_facts

    unset = [k for k in MODEL_DERIVED if _get(c, k) is None]
    if not unset and not refuse:
        return None
    try:
        facts = _facts(c)
        derived = model_facts.derive(facts, *_device_memory(c))
    except model_facts.FactsError as e:
        named = re.match(r"(model\.train\.\w+)=", str(e))  # the embedded model's own setting, named by the error
        key = (named.group(1) if named
               else "model.package" if c["model"].get("package") else "model.path")
        raise ConfigError(f"{where(key)}: {e}") from None
    for key in unset:
        section, leaf = key.split(".")
        c[section][leaf] = derived[key]
    if "calibrate.min_samples" in unset:  # null: every window asked for
        c["calibrate"]["min_samples"] = c["calibrate"]["samples"]
    return facts if refuse else None


def _device_defaults(c: dict) -> None:
    """The null settings that follow the device: export.prompt_tokens, a phone's qnn.prompt_tokens (at most
    the context: a chunk longer than the context could never be filled); export.genie, true on a phone."""
    if c["export"].get("prompt_tokens") is None:
        qnn = c["device"].get("qnn") or {}
        tokens = int(qnn.get("prompt_tokens") or 0) if c["device"].get("accelerator") == "qnn_htp" else 0
        c["export"]["prompt_tokens"] = min(tokens, int(c["export"]["context_length"]))
    if c["export"].get("genie", None) is None:
        c["export"]["genie"] = c["device"].get("accelerator") == "qnn_htp"


def _facts(c: dict):
    """The checkpoint's facts as the device's runtime computes the model (model_facts.on_runtime)."""
    from pipeline.sources import model_facts

    return model_facts.on_runtime(model_facts.of(c["model"]), (c.get("device") or {}).get("runtime"))


def _device_memory(c: dict) -> tuple[float, str, str]:
    """(GiB, device name, accelerator) the default context is sized for: the device's spec sheet, or for
    device=auto this host's memory (what the probe stage will find)."""
    from pipeline.engine.devices import host_memory_gib

    device = c["device"]
    accelerator = str(device.get("accelerator") or "")
    if device.get("name") == "auto":
        return host_memory_gib(), "this host", accelerator
    return float(device.get("memory_gib") or 0), str(device.get("name") or ""), accelerator


def context_note(c: dict) -> str | None:
    """One line saying which context the build has and why, where it is the derived default; None where
    export.context_length was set (or the checkpoint cannot be read: validate said so already)."""
    from pipeline.sources import model_facts

    try:
        facts = _facts(c)
    except model_facts.FactsError:
        return None
    context, why = model_facts.default_context(facts, *_device_memory(c))
    return why if context == c["export"]["context_length"] else None


def _refuse_unexercised(c: dict, facts, where) -> None:
    """An explicit setting that cannot exercise the model fails here, before any stage."""
    from pipeline.sources import model_facts

    shortest = min((len(p.encode()) + 1 for p in c["parity"]["prompts"]), default=1)
    memory, _, accelerator = _device_memory(c)
    for key, reason in model_facts.refusals(facts, c, shortest, memory, accelerator):
        raise ConfigError(f"{where(key)}: {reason}")


def _first_nan(d, prefix: str = "") -> str | None:
    """The first key holding a float NaN (a threshold of NaN passes everything)."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix and isinstance(k, str) else f"{prefix}[{k}]" if prefix else str(k)
        if isinstance(v, float) and v != v:
            return key
        found = _first_nan(v, key)
        if found is not None:
            return found
    return None


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
    nan = _first_nan(c)
    if nan is not None:
        raise ConfigError(f"{where(nan)}: {nan} is NaN: every comparison with it is false, so it would disable a check")
    for key, (lo, hi) in LIMITS.items():
        v = _get(c, key)
        if isinstance(v, bool) or not lo <= v <= hi:
            raise ConfigError(f"{where(key)}: {key}={v} is outside [{lo}, {hi}]")
    for key, options in CHOICES.items():
        v = _get(c, key)
        if v not in options:
            raise ConfigError(f"{where(key)}: {key}={v!r} is not one of: {', '.join(options)}")
    _check_text_sources(c, where)
    q = c["quantize"]
    if q["bits"] != 4:  # pipeline/quant/gptq.py BITS
        raise ConfigError(f"{where('quantize.bits')}: quantize.bits={q['bits']}: only 4-bit is supported")
    if q.get("group_size") is not None and q["group_size"] not in GROUP_SIZES:
        raise ConfigError(
            f"{where('quantize.group_size')}: quantize.group_size={q['group_size']} is not supported: "
            f"choose one of {', '.join(map(str, GROUP_SIZES))} (what the 4-bit kernels take) or null"
        )
    if q.get("head_group_size") is not None and q["head_group_size"] not in GROUP_SIZES:
        raise ConfigError(
            f"{where('quantize.head_group_size')}: quantize.head_group_size={q['head_group_size']} is not "
            f"supported: choose one of {', '.join(map(str, GROUP_SIZES))} or null"
        )
    if q.get("head_bits") is not None and q["head_bits"] not in (4, 8):  # pipeline/quant/gptq.py LAYER_BITS
        raise ConfigError(f"{where('quantize.head_bits')}: quantize.head_bits={q['head_bits']} is not "
                          f"supported: 4, 8 or null")
    if q.get("head_rows8") is not None and q["head_rows8"] < 0:
        raise ConfigError(f"{where('quantize.head_rows8')}: quantize.head_rows8={q['head_rows8']} is a count of "
                          f"the head's rows: 0 (one width), N, or null (measured)")
    if q.get("eight_bit_budget") is not None and not 0 <= q["eight_bit_budget"] <= 1:
        raise ConfigError(f"{where('quantize.eight_bit_budget')}: quantize.eight_bit_budget="
                          f"{q['eight_bit_budget']} is a fraction of the 4-bit code bytes: 0 to 1, or null")
    if q.get("sensitivity_windows") is not None and q["sensitivity_windows"] < 1:
        raise ConfigError(f"{where('quantize.sensitivity_windows')}: quantize.sensitivity_windows="
                          f"{q['sensitivity_windows']} must be at least 1")
    if q.get("sensitivity", "auto") not in ("auto", "exact", "first_order"):  # pipeline/quant/bit_alloc.py SENSITIVITIES
        raise ConfigError(f"{where('quantize.sensitivity')}: quantize.sensitivity={q['sensitivity']!r}: "
                          f"use auto, exact or first_order")
    if not 0 <= q["damp"] < 1:
        raise ConfigError(f"{where('quantize.damp')}: quantize.damp={q['damp']} must be in [0, 1)")
    precisions = c["pack"]["qnn_precisions"]
    bad_p = [x for x in precisions if x not in QNN_PRECISIONS]
    if not precisions or bad_p or len(set(precisions)) != len(precisions):
        what = f"{bad_p[0]!r} is not one of: {', '.join(QNN_PRECISIONS)}" if bad_p else \
            ("is empty" if not precisions else f"{precisions} has duplicates")
        raise ConfigError(f"{where('pack.qnn_precisions')}: pack.qnn_precisions {what}")
    if int(c["pack"].get("qnn_select_windows", 1)) < 1:
        raise ConfigError(f"{where('pack.qnn_select_windows')}: pack.qnn_select_windows="
                          f"{c['pack']['qnn_select_windows']} must be at least 1")
    cal = c["calibrate"]
    if cal["min_samples"] > cal["samples"]:
        raise ConfigError(
            f"{where('calibrate.min_samples')}: calibrate.min_samples={cal['min_samples']} "
            f"exceeds calibrate.samples={cal['samples']}"
        )
    bp = c["benchmark"].get("baseline_passes")
    if bp is not None and bp < 1:  # above benchmark.passes it is every pass
        raise ConfigError(f"{where('benchmark.baseline_passes')}: benchmark.baseline_passes={bp} must be at "
                          f"least 1 (or null: every pass)")
    for key in ("parity.qnn_steps", "parity.qnn_short_steps", "pack.qnn_calibration_steps"):
        v = _get(c, key)
        if v is not None and (isinstance(v, bool) or v < 2):
            raise ConfigError(f"{where(key)}: {key}={v} must be at least 2 (or null: derived)")
    noise = c["benchmark"]["noise_floor"]
    if not 0 <= noise < 1:
        raise ConfigError(f"{where('benchmark.noise_floor')}: benchmark.noise_floor={noise} must be in [0, 1)")
    ctx = c["export"]["context_length"]
    pt = c["export"]["prompt_tokens"]
    if pt < 0 or pt == 1 or pt > ctx:
        derived = c["device"].get("qnn") and not where("export.prompt_tokens").startswith("command-line")
        key = "device.qnn.prompt_tokens" if derived else "export.prompt_tokens"
        raise ConfigError(f"{where(key)}: {key}={pt} must be 0 (no prompt graph) or 2 up to export.context_length "
                          f"({ctx}): the prompt graph's tokens a call")
    b = c["benchmark"]
    if b["prompt_length"] + b["decode_tokens"] + b["warmup_tokens"] > ctx:
        raise ConfigError(
            f"{where('benchmark.prompt_length')}: benchmark.prompt_length + decode_tokens + warmup_tokens "
            f"= {b['prompt_length'] + b['decode_tokens'] + b['warmup_tokens']} exceeds export.context_length={ctx}"
        )
    limit = ctx - b["context_decode_tokens"] - b["warmup_tokens"]
    points = b["context_points"]
    bad = next((x for x in points if not 1 <= x <= limit), None)
    if bad is not None or len(set(points)) != len(points):
        what = f"{bad} must be in [1, {limit}]" if bad is not None else f"{points} has duplicates"
        raise ConfigError(
            f"{where('benchmark.context_points')}: benchmark.context_points: {what} (export.context_length {ctx} "
            f"- context_decode_tokens {b['context_decode_tokens']} - warmup_tokens {b['warmup_tokens']})"
        )
    p = c["parity"]
    if not p["prompts"]:
        raise ConfigError(f"{where('parity.prompts')}: parity.prompts is empty: parity needs prompts")
    run = min(len(p["prompts"]), p["max_prompts"])
    if p["min_greedy_match"] is not None and p["min_greedy_match"] < 0:
        raise ConfigError(f"{where('parity.min_greedy_match')}: parity.min_greedy_match={p['min_greedy_match']} "
                          f"must be at least 0 (or null: every prompt run)")
    if p["min_greedy_match"] is not None and p["min_greedy_match"] > run:
        raise ConfigError(
            f"{where('parity.min_greedy_match')}: parity.min_greedy_match={p['min_greedy_match']} "
            f"exceeds the {run} prompts parity runs (parity.max_prompts={p['max_prompts']})"
        )
    if c["priority"]["name"] not in ("speed", "fidelity"):
        raise ConfigError(f"{where('priority.name')}: priority must be speed or fidelity")


def _check_model(m: dict, where) -> None:
    """The model section, before anything reads the checkpoint's facts."""
    if m["source"] not in MODEL_SOURCES:
        raise ConfigError(f"{where('model.source')}: model.source must be one of {', '.join(MODEL_SOURCES)}, "
                          f"not {m['source']!r}")
    if not MODEL_NAME.fullmatch(str(m["name"])) or ".." in str(m["name"]):
        raise ConfigError(
            f"{where('model.name')}: model.name {m['name']!r} must match {MODEL_NAME.pattern} "
            f"(no '/', no '..'): it names a folder under artifacts/_models/"
        )
    if m["source"] == "hf":
        _check_model_path(m["path"], where)
    if m["source"] == "gguf":
        if m.get("package"):
            from pipeline.sources.model_facts import FactsError, package_module

            try:
                package_module(str(m["package"]))
            except FactsError as e:
                raise ConfigError(f"{where('model.package')}: model {m['name']}: {e}") from None
        else:
            if m.get("path") is None:
                raise ConfigError(f"{where('model.path')}: model.path is not set: source=gguf needs a .gguf file "
                                  f"(model.path=/abs/FILE.gguf) or model.package")
            _check_model_path(m["path"], where, kind="file")
    digest = m.get("sha256")
    if digest is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", str(digest)):
        raise ConfigError(f"{where('model.sha256')}: model.sha256 must be 64 hex digits (the file's sha256)")


def _check_model_path(raw, where, kind: str = "directory", key: str = "model.path") -> None:
    """An absolute checkpoint directory outside this repository's artifacts/:
    the model stage reads it, and a path into artifacts/ would read (and key
    on) another build's output, or a folder a stage is writing. `key`: the
    setting it came from (a text source, calibrate.dataset, is checked alike)."""
    text = str(raw)
    if not text.strip():
        raise ConfigError(f"{where(key)}: {key} is empty: give the checkpoint's absolute {kind}")
    if "\x00" in text:
        raise ConfigError(f"{where(key)}: {key} contains a NUL byte")
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # ~user that does not exist
        raise ConfigError(f"{where(key)}: {key} {raw!r}: cannot expand '~'") from None
    if not path.is_absolute():
        raise ConfigError(f"{where(key)}: {key} must be an absolute {kind}, got {raw!r}")
    if ".." in path.parts:
        raise ConfigError(f"{where(key)}: {key} {raw!r} contains '..': give the plain absolute {kind}")
    artifacts = (ROOT / "artifacts").resolve()
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        raise ConfigError(f"{where(key)}: {key} {raw!r} cannot be resolved (symlink loop?)") from None
    if real == artifacts or real.is_relative_to(artifacts):
        raise ConfigError(
            f"{where(key)}: {key} {raw!r} is inside artifacts/: a checkpoint must live outside "
            f"the pipeline's outputs (copy it elsewhere)"
        )


def _check_text_sources(c, where) -> None:
    """calibrate.dataset and parity.eval_text: the built-in corpus or a user's local text (pipeline/sources/textdata.py),
    checked before any stage runs: an absolute path outside artifacts/ holding text files."""
    from pipeline.sources.textdata import BUILTIN, TextDataError, files_of

    for key in ("calibrate.dataset", "parity.eval_text", "parity.prompts_file"):
        raw = _get(c, key)
        if raw is None or str(raw) == BUILTIN:
            continue
        _check_model_path(raw, where, "text file or folder", key=key)
        try:
            files_of(raw)
        except TextDataError as err:
            raise ConfigError(f"{where(key)}: {key}: {err}") from None


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
