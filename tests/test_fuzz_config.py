"""Property-based fuzzing of config overrides (Hypothesis).

Every input either composes and validates into a config, or fails with a
ConfigError whose message is one line: never another exception type, never a
traceback. Inputs: real keys with values of every type and size, typo'd keys,
random group options, Hydra prefixes, interpolations, malformed strings,
unicode. The module prints how many inputs it tried and how they ended.

EDGEKILN_FUZZ_EXAMPLES scales the number of examples per property (default 40;
each costs one Hydra composition, about 0.1 s here).
"""

from __future__ import annotations

import os
import string
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.engine.config import GROUPS, ConfigError, compose, validate
from tests.conftest import ROOT, report_line, venv_env

INPUTS: Counter = Counter()
EXAMPLES = int(os.environ.get("EDGEKILN_FUZZ_EXAMPLES", "40"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(scope="module", autouse=True)
def report_counts(request):
    yield
    total = sum(INPUTS.values())
    report_line(request.config, f"config fuzzing: {total} override lists tried "
                f"({', '.join(f'{k} {v}' for k, v in sorted(INPUTS.items()))})")


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.append(key)
        if isinstance(v, dict):
            out += _leaves(v, key + ".")
    return out


DEFAULT = validate(compose([]))
KEYS = sorted(_leaves(DEFAULT))
OPTIONS = {g: sorted(p.stem for p in (ROOT / "conf" / g).glob("*.yaml")) for g in GROUPS}


def check(overrides: list[str], kind: str) -> None:
    """The property: a config, or one ConfigError line."""
    try:
        cfg = validate(compose(overrides), overrides)
    except ConfigError as e:
        msg = str(e)
        assert msg.strip() and "\n" not in msg, (overrides, msg)
        for jargon in ("Traceback", "NoneType", "object has no attribute", "Exception:"):
            assert jargon not in msg, (overrides, msg)
        INPUTS[f"{kind} refused"] += 1
        return
    assert isinstance(cfg, dict) and cfg["build"]["name"], overrides
    INPUTS[f"{kind} built"] += 1


# ---- values of every type, rendered in Hydra's override syntax

HUGE = st.sampled_from([0, -1, 1, 2, 31, 32, 33, 127, 128, 256, 512, 10**9, 2**31, 2**63, -(2**63), 10**30, 10**400])
INTS = st.one_of(st.integers(), HUGE).map(str)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e309", "1e-320", "0.0", "-0.0", "1.5", ".5", "1_000"]),
)
BOOLS = st.sampled_from(["true", "false", "True", "FALSE", "yes", "on", "null", "~"])
TEXT = st.text(max_size=30)
SAFE_TEXT = st.text(alphabet=string.ascii_letters + string.digits + "_-./ ", max_size=30)
QUOTED = TEXT.map(lambda t: "'" + t.replace("\\", "\\\\").replace("'", "\\'") + "'")
PATHS = st.sampled_from(
    ["/", "/tmp", "/nonexistent/ckpt", "relative/ckpt", "~/ckpt", "~nosuchuser/ckpt", "../../etc", "/tmp/../etc",
     f"{ROOT}/artifacts", f"{ROOT}/artifacts/_models/x", f"{ROOT}/artifacts/../conf", "", "''", "/dev/null", "\u00e9/\u4e2d"]
)
INTERPOLATIONS = st.sampled_from(
    ["${device.name}", "${nonexistent.key}", "${oc.env:HOME}", "${oc.env:EDGEKILN_NO_SUCH_VAR}", "${export.context_length}",
     "${oc.decode:'[1,2]'}", "${", "$", "${build.name}", "${oc.select:x,1}"]
)
SCALARS = st.one_of(INTS, FLOATS, BOOLS, SAFE_TEXT, QUOTED, TEXT, PATHS, INTERPOLATIONS)
LISTS = st.lists(st.one_of(INTS, FLOATS, SAFE_TEXT, BOOLS), max_size=5).map(lambda xs: "[" + ",".join(xs) + "]")
DICTS = st.dictionaries(st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6), st.one_of(INTS, SAFE_TEXT), max_size=3).map(
    lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"
)
VALUES = st.one_of(SCALARS, LISTS, DICTS)
PREFIX = st.sampled_from(["", "", "", "+", "++", "~"])


def _typo(key: str, draw) -> str:
    i = draw(st.integers(0, len(key) - 1))
    how = draw(st.sampled_from(["drop", "dup", "swap", "replace", "case"]))
    if how == "drop":
        return key[:i] + key[i + 1 :] or "x"
    if how == "dup":
        return key[:i] + key[i] + key[i:]
    if how == "swap" and i + 1 < len(key):
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    if how == "case":
        return key.upper()
    return key[:i] + draw(st.sampled_from(string.ascii_lowercase + "._-")) + key[i + 1 :]


@st.composite
def valid_key_overrides(draw):
    n = draw(st.integers(1, 3))
    return [f"{draw(PREFIX)}{draw(st.sampled_from(KEYS))}={draw(VALUES)}" for _ in range(n)]


@st.composite
def typo_overrides(draw):
    key = draw(st.sampled_from(KEYS))
    return [f"{draw(PREFIX)}{_typo(key, draw)}={draw(VALUES)}"]


@st.composite
def group_overrides(draw):
    out = []
    for g in draw(st.lists(st.sampled_from(GROUPS), min_size=1, max_size=3)):
        option = draw(st.one_of(st.sampled_from(OPTIONS[g]), SAFE_TEXT, TEXT))
        out.append(f"{draw(PREFIX)}{g}={option}")
    if draw(st.booleans()):
        out += draw(valid_key_overrides())
    return out


MALFORMED = st.one_of(
    TEXT,
    st.sampled_from(["=", "==", "=1", "a=", "device", "device=", ".=1", "a..b=1", "device.=1", "+=1", "~", "~device",
                     "device=x86_avx2=1", "device==x86", "[", "{", "'", "\"", "\\", "\0", "device=\0", " ", "\t=\n",
                     "model=hf model.path=/x", "hydra.run.dir=/tmp/x", "hydra/launcher=basic", "+hydra.x=1",
                     "export.context_length=1e9", "export.context_length=0x10", "quantize.group_size=0"]),
    st.builds(lambda a, b: f"{a}={b}", TEXT, TEXT),
)


@FUZZ
@given(valid_key_overrides())
def test_real_keys_with_any_value(overrides):
    check(overrides, "value")


@FUZZ
@given(typo_overrides())
def test_typod_keys(overrides):
    check(overrides, "typo")


@FUZZ
@given(group_overrides())
def test_group_options(overrides):
    check(overrides, "group")


@FUZZ
@given(st.lists(MALFORMED, min_size=1, max_size=3))
def test_malformed_overrides(overrides):
    check(overrides, "malformed")


@FUZZ
@given(st.sampled_from(["model=hf"]).flatmap(lambda g: st.tuples(st.just(g), PATHS)))
def test_checkpoint_paths(case):
    group, path = case
    check([group, f"model.path={path}"], "model.path")


# Absurd sizes and the new sections' bounds: each is refused, by key, in one line.
@pytest.mark.parametrize(
    "override, key",
    [
        ("export.context_length=1000000000", "export.context_length"),
        ("quantize.group_size=0", "quantize.group_size"),
        ("quantize.group_size=-128", "quantize.group_size"),
        ("quantize.group_size=48", "quantize.group_size"),
        ("quantize.group_size=1024", "quantize.group_size"),
        ("quantize.bits=8", "quantize.bits"),
        ("quantize.method=awq", "quantize.method"),
        ("quantize.damp=1.0", "quantize.damp"),
        ("quantize.block_size=0", "quantize.block_size"),
        ("quantize.group_fallback=nearest", "quantize.group_fallback"),
        ("calibrate.samples=0", "calibrate.samples"),
        ("calibrate.samples=1000000000", "calibrate.samples"),
        ("calibrate.min_samples=65", "calibrate.min_samples"),
        ("calibrate.min_samples=0", "calibrate.min_samples"),
        ("calibrate.seq_len=1", "calibrate.seq_len"),
        ("calibrate.dataset=wikitext", "calibrate.dataset"),
        ("calibrate.seed=-1", "calibrate.seed"),
        ("pack.ort_accuracy_level=5", "pack.ort_accuracy_level"),
        ("pack.prefill_threshold=0", "pack.prefill_threshold"),
        ("pack.tinygemm_prefill=fast", "pack.tinygemm_prefill"),
        ("benchmark.context_points=[8,8]", "benchmark.context_points"),
        ("benchmark.context_points=[0]", "benchmark.context_points"),
        ("benchmark.noise_floor=1.5", "benchmark.noise_floor"),
        ("benchmark.llamacpp=yes", "benchmark.llamacpp"),
        ("benchmark.context_decode_tokens=0", "benchmark.context_decode_tokens"),
        ("parity.min_top1_agreement=nan", "parity.min_top1_agreement is NaN"),
        ("parity.min_top5_agreement=1.5", "parity.min_top5_agreement"),
        ("device.memory_gib=-5", "device.memory_gib"),
        ("model.train=null", "null is not allowed"),
        ("parity=null", "parity needs an option"),
        ("device=~", "malformed override"),
        ("device.qnn={soc_model:x}", "section that is null"),
    ],
)
def test_absurd_values_are_refused_by_key(override, key):
    with pytest.raises(ConfigError) as e:
        validate(compose([override]), [override])
    msg = str(e.value)
    assert key in msg and f"override '{override}'" in msg and "\n" not in msg, msg
    INPUTS["bounds refused"] += 1


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model=hf", f"model.path={ROOT}/artifacts/_models/x"], ["model.path", "inside artifacts/"]),
        (["model=hf", f"model.path={ROOT}/artifacts"], ["model.path", "inside artifacts/"]),
        (["model=hf", "model.path=/tmp/../etc"], ["model.path", "'..'"]),
        (["model=hf", "model.path=relative/ckpt"], ["model.path", "absolute"]),
        (["model=hf", "model.path=''"], ["model.path", "empty"]),
        (["build.name=ok", "model.name=../x"], ["model.name", "artifacts/_models/"]),
        (["build.name=ok", "model.name=a/b"], ["model.name", "artifacts/_models/"]),
    ],
)
def test_paths_cannot_escape_or_read_artifacts(overrides, words):
    with pytest.raises(ConfigError) as e:
        validate(compose(overrides), overrides)
    for w in words:
        assert w in str(e.value), str(e.value)
    INPUTS["paths refused"] += 1


def test_group_sizes_match_the_kernels():
    from pipeline.engine import config
    from pipeline.quant.int4_layouts import TINYGEMM_GROUP_SIZES

    assert tuple(config.GROUP_SIZES) == tuple(TINYGEMM_GROUP_SIZES)
    assert all(g >= 16 and g & (g - 1) == 0 for g in config.GROUP_SIZES)  # MatMulNBits: powers of two >= 16
    for g in config.GROUP_SIZES:
        validate(compose([f"quantize.group_size={g}"]))


# The CLI end to end (a few inputs: each is a Python start-up): exit 0 or 2, one stderr line, no traceback.
CLI_CASES = [
    ["--cfg", "device=x86_avx2", "quantize.group_size=64"],
    ["--cfg", "quantize.group_size=0"],
    ["--cfg", "device=pixel9"],
    ["--cfg", "export.context_length=1000000000"],
    ["--cfg", "device.corse=3", "calibrate.samples=\u00e9\u4e2d"],
    ["--cfg", "model=hf", "model.path=/tmp/../etc"],
    ["--cfg", "a=b=c", "=="],
]


def test_cli_answers_every_input_in_one_line():
    for argv in CLI_CASES:
        proc = subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=ROOT, capture_output=True, text=True,
                              env=venv_env(), timeout=120)
        assert "Traceback" not in proc.stderr, (argv, proc.stderr)
        if proc.returncode == 0:
            assert proc.stdout.startswith("build:"), (argv, proc.stdout[:200])
            INPUTS["cli built"] += 1
        else:
            lines = [l for l in proc.stderr.splitlines() if l.strip()]
            assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, proc.stderr)
            INPUTS["cli refused"] += 1
