"""The build's own runner on a device, without the build toolchain: the edgekiln-runtime package
(runtime/: GqaDecoder, the pack folder's tokenizer through `tokenizers`, `python -m edgekiln_runtime`).

What the package may import is checked from its source (the standard library and its three declared
dependencies, nothing of `pipeline` or `stages`). Then a fresh venv holding `pip install ./runtime`
alone (tests/conftest.py `runtime_python`) generates from the tiny x86_avx512 build's pack folder
(tests/conftest.py `built_repo`) over every parity prompt: its prompt ids must be the parity stage's
framing, its tokens GqaDecoder's in the build's venv (prompt prefilled, then greedy) and the fp32
reference's continuation wherever the parity report says the artifact's greedy decode matched it; the
deploy profile's own command for it runs from deploy_profile/ as a user would.
"""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_speculative import greedy_or_near_tie
from tests.conftest import check_against_parity, report_line

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "runtime" / "edgekiln_runtime"
BUILD = "x86_avx512-embedded-speed"
# import name of each distribution runtime/pyproject.toml declares
IMPORT_NAME = {"onnxruntime": "onnxruntime", "numpy": "numpy", "tokenizers": "tokenizers"}


def _declared() -> set[str]:
    deps = tomllib.loads((ROOT / "runtime" / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps}
    assert names == set(IMPORT_NAME), names  # a new dependency needs its import name here
    return {IMPORT_NAME[n] for n in names}


def test_the_runtime_package_imports_only_the_standard_library_and_its_declared_dependencies():
    allowed = set(sys.stdlib_module_names) | _declared() | {"edgekiln_runtime", "__future__"}
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(path.name)
    assert {"onnxruntime", "numpy", "tokenizers"} <= set(found)  # the check reads the imports at all
    strays = {m: sorted(f) for m, f in found.items() if m not in allowed}
    assert strays == {}, f"edgekiln_runtime imports outside its declared dependencies: {strays}"


@pytest.mark.slow
def test_the_pack_folder_generates_in_edgekiln_runtime_alone(built_repo, runtime_python, tmp_path, request):
    from transformers import AutoTokenizer

    from edgekiln_runtime.gqa import GqaDecoder
    from stages.verify_parity import _prompt_ids

    repo, _ = built_repo
    art = repo / "artifacts" / BUILD
    pack = art / "pack"
    py, size_mib = runtime_python
    where = subprocess.run([str(py), "-I", "-c", "import importlib.util as u, edgekiln_runtime as e; "
                            "print(e.__file__, [n for n in ('pipeline', 'stages', 'transformers', 'torch') "
                            "if u.find_spec(n)])"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert str(ROOT) not in where.stdout and where.stdout.strip().endswith("[]"), where.stdout  # its own copy, alone

    report = json.loads((art / "verify_parity" / "report.json").read_text())
    per_prompt = report["artifact"]["per_prompt"]
    n = len(per_prompt[0]["reference_continuation"])
    tok = AutoTokenizer.from_pretrained(str(pack))
    io = json.loads((pack / "io.json").read_text())
    eos = set(io["eos_token_id"])
    dec = GqaDecoder(pack, threads=2)
    agreed = 0
    for want in per_prompt:
        ran = subprocess.run([str(py), "-I", "-m", "edgekiln_runtime", str(pack), want["prompt"], "-n", str(n),
                              "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
        got = json.loads(ran.stdout.strip().splitlines()[-1])
        ids = _prompt_ids(tok, want["prompt"], tok.bos_token_id, str(io.get("family", "")))
        agreed += check_against_parity(dec, want, ids, got, n, eos)
        tokens = got["tokens"]
        assert got["text"] == tok.decode(tokens, skip_special_tokens=True)
        # the threads came from the deploy profile beside the pack folder
        assert got["threads"] == json.loads((art / "deploy_profile" / "onnxruntime.json").read_text())[
            "intra_op_num_threads"]
    assert agreed > 0, "no prompt's greedy decode matched the reference: the comparison shows nothing"

    # --speculate (prompt lookup) in the runtime alone: the same tokens, fewer calls where the text repeats
    spec = subprocess.run([str(py), "-I", "-m", "edgekiln_runtime", str(pack), want["prompt"], "-n", str(n),
                           "--json", "--speculate"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert spec.returncode == 0, spec.stderr[-3000:]
    spec = json.loads(spec.stdout.strip().splitlines()[-1])
    assert spec["speculative"]["calls"] <= len(spec["tokens"]) - 1
    greedy_or_near_tie(dec, got["prompt_ids"], got["tokens"], spec["tokens"])

    # the profile's own command, from deploy_profile/ with the runtime venv's python: text out
    command = json.loads((art / "deploy_profile" / "profile.json").read_text())["on_device"]["alternative"]["command"]
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "edgekiln_runtime"]
    user = subprocess.run([str(py), "-I", *argv[1:]], cwd=art / "deploy_profile", capture_output=True, text=True,
                          timeout=600)
    assert user.returncode == 0, user.stderr[-3000:]
    assert user.stdout.strip("\n") != "" or user.stdout.count("\n") > 1, user.stdout

    # a folder that is not a pack folder: one line naming it and what to point at, exit 2
    bad = subprocess.run([str(py), "-I", "-m", "edgekiln_runtime", str(art), "hello"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == "", (bad.returncode, bad.stdout)
    line = bad.stderr.strip()
    assert "\n" not in line and line.startswith("edgekiln-runtime: ") and "pack folder" in line, bad.stderr
    report_line(request.config, f"test_device_runtime: edgekiln-runtime alone ({size_mib:.0f} MiB venv) generated "
                                f"{len(per_prompt)} prompts x {n} tokens: GqaDecoder's tokens on every one, the fp32 "
                                f"reference's on the {agreed} parity matched")
