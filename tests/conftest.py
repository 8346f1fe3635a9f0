"""Shared fixtures: a throwaway copy of the repository for builds through DVC."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A model small enough that a whole build runs in well under a minute here,
# still with the embedded family's shape: sliding + full layers, GQA, tied head.
TINY_MODEL = [
    "model.train.vocab_size=512",
    "model.train.hidden_size=128",
    "model.train.intermediate_size=256",
    "model.train.num_hidden_layers=4",
    "model.train.num_attention_heads=2",
    "model.train.num_key_value_heads=1",
    "model.train.sliding_window=16",
    "model.train.full_attention_every=2",
    "model.train.steps=30",
    "model.train.batch_size=8",
    "model.train.seq_len=64",
]
FAST_RUN = [
    "export.context_length=64",
    "parity.decode_tokens=24",
    "benchmark.passes=1",
    "benchmark.prompt_length=8",
    "benchmark.decode_tokens=8",
    "benchmark.warmup_tokens=2",
    "benchmark.context_points=[8,16]",
    "benchmark.context_decode_tokens=8",
]


# CI runs one or two of each family of variants (signals, model families) within its time;
# EDGEKILN_TEST_ALL=1 runs every one (each a real build or a vLLM start: a minute or more).
TEST_ALL = bool(os.environ.get("EDGEKILN_TEST_ALL"))


def variants(values, in_ci, what: str, ids=None) -> list:
    """`values` for a parametrize, those not in `in_ci` skipped (saying what each is and how to run it)
    unless EDGEKILN_TEST_ALL=1. `ids`: the test ids of `values`, where they are not their str();
    a tuple value fills a parametrize of several names."""
    ids = list(ids) if ids is not None else [str(v) for v in values]
    skip = [] if TEST_ALL else [pytest.mark.skip(reason=f"{what.format(i)}: EDGEKILN_TEST_ALL=1 runs it")
                                for i in ids]
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i,
                         marks=() if TEST_ALL or i in in_ci else skip[n])
            for n, (v, i) in enumerate(zip(values, ids))]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def repo_copy(dest: Path) -> Path:
    """A clean checkout of the working tree (tracked + untracked-not-ignored
    files), with an empty build registry: builds registered in the developer's
    own checkout must not leak into (and be rebuilt by) the test's DVC runs."""
    files = git(ROOT, "ls-files", "-co", "--exclude-standard", "-z").split("\0")
    for rel in filter(None, files):
        if rel.startswith("builds/") or rel in ("dvc.lock", "dvc.yaml"):
            continue
        src = ROOT / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    subprocess.run([sys.executable, "-m", "pipeline.engine.dvcgen"], cwd=dest, check=True, capture_output=True, env=venv_env())
    git(dest, "init", "-q")
    git(dest, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    git(dest, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "copy")
    return dest


def venv_env() -> dict:
    """The environment of a user who activated the venv (`python` is the venv's)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.pop("PYTHONPATH", None)
    return env


def run_cli(repo: Path, *args: str, module: str = "pipeline", timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=repo, capture_output=True, text=True, env=venv_env(), timeout=timeout
    )


# A stage's one line under `python -m pipeline` (pipeline/engine/narrate.py): "pack [b]: ran in ...",
# "export [b]: up to date (...)", "quantize [b]: restored from the run-cache (...)", found anywhere
# in a line (a sweep's worker, Ray and a runner put their own prefix before it).
def _stage_line():
    from pipeline.engine.layout import STAGES

    return re.compile(r"(?:^|[\s\])])(?P<stage>" + "|".join(STAGES) + r") \[(?P<owner>[^\]\s]+)\]: "
                      r"(?P<how>ran\b|up to date|restored from the run-cache)")


_MODEL_ID = re.compile(r".+-[0-9a-f]{16}")


def stage_lines(output: str) -> list[tuple[str, str]]:
    """(dvc.yaml stage name, how) for each stage's one line: ran, up to date, restored from the run-cache."""
    found, pattern = [], _stage_line()
    for line in output.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        stage, owner = m["stage"], m["owner"]
        shared = stage == "model" or (stage == "probe" and _MODEL_ID.fullmatch(owner))
        found.append((f"{stage}--{owner}" if shared else f"{owner}--{stage}", m["how"]))
    return found


def ran_stages(output: str) -> list[str]:
    """Which stages actually executed: DVC's 'Running stage' lines where DVC narrates
    (a plain `dvc repro`, or `-v`), else the stages' own 'ran' lines (`python -m pipeline`)."""
    dvc = [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]
    return dvc or [name for name, how in stage_lines(output) if how == "ran"]


def restored_stages(output: str) -> list[str]:
    """The stages restored from DVC's run-cache (DVC's line, or the stage's own under `python -m pipeline`)."""
    dvc = [line.split("'")[1] for line in output.splitlines() if "is cached - skipping run" in line]
    return dvc or [name for name, how in stage_lines(output) if how == "restored from the run-cache"]


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for the module (deterministic reductions, and the
    other tests' processes keep the second core)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory):
    """One repository copy with a tiny x86_avx512 build done, shared by the e2e tests."""
    repo = repo_copy(tmp_path_factory.mktemp("repo"))
    proc = run_cli(repo, "device=x86_avx512", *TINY_MODEL, *FAST_RUN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return repo, proc


# The tiny phone build of tests/test_qnn.py's end-to-end test: 32 HTP steps a prompt (the tiny model's runs
# are longer, so both HTP parts, cold and past the window, run). A per-graph limit of 500 kB (a phone's is
# 2 GiB) makes compile_qnn cut both precisions' graphs into parts between layers, as a 1-2B model's are:
# parity, the benchmark, the deploy profile and generate then run the parts in order.
PHONE_ARGS = ["device=galaxy_s25", *TINY_MODEL, *FAST_RUN, "parity.qnn_prompts=2", "parity.qnn_steps=32",
              "device.qnn.max_graph_bytes=500000", "device.qnn.prompt_tokens=16"]


@pytest.fixture(scope="session")
def phone_build(tmp_path_factory):
    """One repository copy with the tiny galaxy_s25 build done (needs onnxruntime-qnn: only tests that
    check for it ask), shared by the phone tests: (repo, the first run's process)."""
    repo = repo_copy(tmp_path_factory.mktemp("phone") / "repo")
    proc = run_cli(repo, *PHONE_ARGS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo, proc


def report_line(config, line: str) -> None:
    """A line in pytest's own output (not captured), e.g. how many faults were tried. In a pytest-xdist
    worker (the README's command runs the suite in one per core) it travels back with the worker's
    output and the controller writes it when the worker finishes (`pytest_testnodedown` below)."""
    if hasattr(config, "workeroutput"):
        config.workeroutput.setdefault("report_lines", []).append(line)
        return
    tr = config.pluginmanager.get_plugin("terminalreporter")
    capman = config.pluginmanager.get_plugin("capturemanager")
    if tr is None or capman is None:  # pragma: no cover
        print(line)
        return
    with capman.global_and_fixture_disabled():
        tr.write_line("")
        tr.write_line(line)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: the report lines a worker collected (report_line), written now."""
    for line in getattr(node, "workeroutput", {}).get("report_lines", []):
        report_line(node.config, line)


def needs_genai(fn):
    """The `optional` marker; skipped with the reason when onnxruntime-genai is absent."""
    from pipeline.runtimes import ortgenai

    ok, reason = ortgenai.available()
    return pytest.mark.optional(pytest.mark.skipif(not ok, reason=f"onnxruntime-genai: {reason}")(fn))


def save_tiny_qwen3(path: Path) -> Path:
    """A 2-layer Qwen3 checkpoint (random weights, seed 0) saved at `path`: one onnxruntime-genai's builder takes."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    return path


class StepClock:
    """A stand-in for pipeline.measure.tune's `time` (monkeypatch it in), advanced only by fake decoders'
    steps: their speeds are exact on any host load (sleep-timed fakes once flaked on a loaded CI)."""

    now = 0.0

    @staticmethod
    def perf_counter() -> float:
        return StepClock.now


# --------------------------------------------------------------------------
# onnxruntime-genai alone: a device that runs the artifact with nothing of this project
# --------------------------------------------------------------------------

def _fresh_venv(root: Path, version: str) -> tuple[Path | None, str]:
    """(the python of a new venv holding onnxruntime-genai==version and its dependencies only, or None;
    what happened)."""
    venv = root / "genai-only"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        return None, f"python -m venv failed: {made.stderr.strip().splitlines()[-1:]}"
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", f"onnxruntime-genai=={version}"],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        lines = [x for x in pip.stderr.splitlines() if x.strip()]
        return None, f"pip install onnxruntime-genai=={version} failed ({lines[-1] if lines else pip.returncode})"
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    return py, "fresh venv: " + ", ".join(sorted(listed.stdout.split()))


@pytest.fixture(scope="session")
def genai_python(tmp_path_factory, request):
    """(python, guard): the python of a fresh venv holding onnxruntime-genai alone (the release the genai route
    is checked with) and no guard; where pip cannot install it, the project's own python, behind an import
    guard the caller applies; skipped, saying so, where neither has genai."""
    import importlib.util

    from pipeline.runtimes.ortgenai import CHECKED  # the peers extra's pin (tests/test_deploy_profile.py)

    py, how = _fresh_venv(tmp_path_factory.mktemp("genai-venv"), CHECKED.split("==", 1)[1])
    if py is None:
        if importlib.util.find_spec("onnxruntime_genai") is None:
            pytest.skip(f"onnxruntime-genai: {how}, and the project's venv has none (pip install -e '.[peers]')")
        report_line(request.config, f"genai_python: {how}; running in the project's venv with "
                                    f"the project taken off the import path instead")
        return Path(sys.executable), True
    report_line(request.config, f"genai_python: {how}")
    return py, False


@pytest.fixture(scope="session")
def runtime_python(tmp_path_factory, request):
    """The python of a fresh venv holding the device-side package alone (`pip install ./runtime`, not editable:
    the venv has its own copy and nothing of the build toolchain) and its size in MiB; skipped, saying so,
    where pip cannot install it (no package registry)."""
    root = tmp_path_factory.mktemp("runtime-venv")
    venv = root / "runtime-only"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"edgekiln-runtime: python -m venv failed: {made.stderr.strip().splitlines()[-1:]}")
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", str(ROOT / "runtime")], cwd=root,
                         capture_output=True, text=True, timeout=900)
    if pip.returncode != 0:
        lines = [x for x in pip.stderr.splitlines() if x.strip()]
        pytest.skip(f"edgekiln-runtime: pip install ./runtime failed ({lines[-1] if lines else pip.returncode})")
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True)
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20
    report_line(request.config, f"runtime_python: fresh venv {size:.0f} MiB: " + ", ".join(sorted(listed.stdout.split())))
    return py, size


def check_against_parity(dec, want: dict, ids: list, got: dict, n: int, eos: set) -> bool:
    """A runtime's greedy run of one parity prompt (`got`: its prompt_ids and tokens, at most `n`) against the
    build: the prompt framed as the parity stage framed it (`ids`), `n` tokens or fewer ending at an
    end-of-sequence token, GqaDecoder's own tokens (`dec`, the prompt prefilled then greedy: the order genai
    and the device runtime run), and the fp32 reference's continuation as far as the parity report found
    the artifact's greedy decode agreed with it. True where parity found them matching all the way."""
    assert got["prompt_ids"] == ids, want["prompt"]
    tokens = got["tokens"]
    assert len(tokens) == n or (0 < len(tokens) < n and tokens[-1] in eos), (want["prompt"], tokens)
    assert tokens == dec.generate_greedy(ids, len(tokens), prefilled=True), want["prompt"]
    ref = want["reference_continuation"]
    agree = len(ref) if want["greedy_match"] else int(want["greedy_first_divergence"])
    k = min(agree, len(tokens))
    assert tokens[:k] == ref[:k], (want["prompt"], tokens, ref)
    return bool(want["greedy_match"])


def _pg_database(base_url: str):
    """A fresh PostgreSQL database on the test server (the base URL's role needs CREATEDB); dropped afterwards."""
    import secrets

    import sqlalchemy as sa

    from pipeline.fleet.db import engine_for

    name = f"edgekiln_t_{secrets.token_hex(4)}"
    admin = engine_for(base_url).execution_options(isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = base_url.rsplit("/", 1)[0] + "/" + name

    def drop():
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
    return url, drop


@pytest.fixture(params=["sqlite", "postgresql"])
def fleet_db_url(request, tmp_path):
    """The rollout service's database: a SQLite file, and PostgreSQL where EDGEKILN_TEST_PG_URL names a server
    (.ci/run starts Debian's PostgreSQL and sets it; skipped, saying so, elsewhere)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fleet.db'}"
        return
    base = os.environ.get("EDGEKILN_TEST_PG_URL")
    if not base:
        pytest.skip("PostgreSQL: EDGEKILN_TEST_PG_URL is not set (.ci/run starts Debian's postgresql and sets it)")
    url, drop = _pg_database(base)
    yield url
    drop()


def matmul_weight_codes(model, nodes) -> set[int]:
    """The ONNX data types of the codes behind the MatMul weights among `nodes` (indices into `model`'s
    node list) of a QDQ graph: each weight a DequantizeLinear of an initializer (INT4, INT8, UINT8, ...)."""
    inits = {t.name: t.data_type for t in model.graph.initializer}
    producer = {o: nd for nd in model.graph.node for o in nd.output}
    dqs = [producer[model.graph.node[i].input[1]] for i in nodes
           if model.graph.node[i].op_type == "MatMul" and model.graph.node[i].input[1] in producer]
    return {inits[d.input[0]] for d in dqs if d.op_type == "DequantizeLinear" and d.input[0] in inits}
