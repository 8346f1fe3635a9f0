"""The x86_avx512 artifact as an onnxruntime-genai model, run with nothing of this project.

The tiny embedded build (tests/conftest.py `built_repo`) packs its graph in
onnxruntime-genai's layout with genai_config.json and the tokenizer beside it.
A fresh virtual environment holding only onnxruntime-genai (and the onnxruntime
it pulls in) loads that pack folder with og.Model / og.Tokenizer and generates
greedily from every parity prompt. Its prompt ids must be the parity stage's,
its tokens GqaDecoder's own (prompt prefilled, then greedy: what genai runs),
and the fp32 reference's continuation wherever the parity report says the
artifact's greedy decode matched it.

The venv (tests/conftest.py `genai_python`, shared with the registry test,
which runs the profile's command on a build it pulled) holds the release the
`peers` extra pins, so the test runs where the project's venv has no
onnxruntime-genai (CI's). Where pip
cannot install it (no registry), the script runs in the project's venv
behind an import guard that removes the project from sys.path and fails
unless `pipeline` and `stages` are then unimportable; where genai is absent
there too, the test is skipped, saying so. It says which it did.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import check_against_parity, report_line

pytestmark = pytest.mark.slow
BUILD = "x86_avx512-embedded-speed"

# What a user of the folder runs: argv = pack folder, JSON list of prompts, new tokens per prompt.
SCRIPT = r'''
import importlib.util, json, os, sys
if {guard!r}:  # the project's venv: take any checkout of the project off the import path, editable installs too
    sys.path[:] = [p for p in sys.path
                   if not any(os.path.isdir(os.path.join(p or ".", d)) for d in ("pipeline", "stages"))]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in ("pipeline", "stages"):
    if importlib.util.find_spec(name) is not None:
        raise SystemExit(f"{{name}} is importable: the check would not show the folder runs on its own")
import onnxruntime_genai as og
folder, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = og.Model(folder)
tok = og.Tokenizer(model)
tok.update_options(add_special_tokens="true")  # as the profile's command: a raw prompt framed as parity frames it
out = []
for prompt in prompts:
    ids = [int(t) for t in tok.encode(prompt)]
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + n)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    seq = [int(t) for t in gen.get_sequence(0)]
    out.append({{"prompt": prompt, "prompt_ids": ids, "tokens": seq[len(ids):], "text": tok.decode(seq[len(ids):])}})
print(json.dumps({{"onnxruntime_genai": og.__version__, "python": sys.executable, "results": out}}))
'''




def test_the_pack_folder_generates_in_onnxruntime_genai_alone(built_repo, genai_python, tmp_path, request):
    from transformers import AutoTokenizer

    from edgekiln_runtime.gqa import GqaDecoder
    from stages.verify_parity import _prompt_ids

    repo, _ = built_repo
    art = repo / "artifacts" / BUILD
    pack = art / "pack"
    # the folder as pack wrote it: genai's config, the graph, the tokenizer with its special tokens
    for name in ("genai_config.json", "model.onnx", "tokenizer.json", "tokenizer_config.json"):
        assert (pack / name).is_file(), name
    cfg = json.loads((pack / "genai_config.json").read_text())
    assert cfg["model"]["type"] == "decoder" and cfg["search"]["past_present_share_buffer"] is True
    assert cfg["model"]["decoder"]["sliding_window"]["layers"]  # the tiny model's window binds in its context
    report = json.loads((art / "verify_parity" / "report.json").read_text())
    per_prompt = report["artifact"]["per_prompt"]
    prompts = [p["prompt"] for p in per_prompt]
    n = len(per_prompt[0]["reference_continuation"])
    profile = json.loads((art / "deploy_profile" / "onnxruntime.json").read_text())
    assert profile["onnxruntime_genai"]["model"] == "../pack"

    py, guard = genai_python
    script = tmp_path / "run_genai.py"
    script.write_text(SCRIPT.format(guard=guard))
    proc = subprocess.run([str(py), "-I", str(script), str(pack), json.dumps(prompts), str(n)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(ran["python"]).resolve() == py.resolve()

    tok = AutoTokenizer.from_pretrained(str(pack))
    io = json.loads((pack / "io.json").read_text())
    eos = set(io["eos_token_id"])
    dec = GqaDecoder(pack, threads=2)
    agreed = 0
    for want, got in zip(per_prompt, ran["results"]):
        ids = _prompt_ids(tok, want["prompt"], tok.bos_token_id, str(io.get("family", "")))
        # genai's tokenizer frames the prompt as parity did, stops at an end-of-sequence token, gives
        # GqaDecoder's tokens exactly and the reference's where parity found the artifact matched it
        agreed += check_against_parity(dec, want, ids, got, n, eos)
    # the profile's own command, as a user runs it from deploy_profile/ with that python: the prompt and more text
    command = profile["onnxruntime_genai"]["command"]
    assert command.startswith("python -c ")
    user = subprocess.run(f"{py} -I {command[len('python '):]}", shell=True, cwd=art / "deploy_profile",
                          capture_output=True, text=True, timeout=600)
    assert user.returncode == 0, user.stderr[-3000:]
    said = user.stdout  # the tiny model continues that prompt with newlines: kept, not stripped
    assert said.startswith("def read_file(path):") and len(said) > len("def read_file(path):\n"), said
    assert agreed > 0, "no prompt's greedy decode matched the reference: the comparison shows nothing"
    report_line(request.config, f"test_genai_artifact: onnxruntime-genai {ran['onnxruntime_genai']} generated "
                                f"{len(prompts)} prompts x {n} tokens, GqaDecoder's tokens on every one, the fp32 "
                                f"reference's on the {agreed} parity matched (and up to the divergence on the rest)")


def test_the_recorded_health_check_runs_in_onnxruntime_genai_alone(built_repo, genai_python, request):
    """The health check a fleet device runs on a freshly installed version, as its agent runs it: the deploy
    profile's `on_device.health.command` with `{python}` the genai-only venv's, from the build's stage outputs
    (pack/ and deploy_profile/ side by side, as a version folder holds them). Its last line's tokens are the
    ones verify_parity recorded (the artifact's GqaDecoder on the same ids, prefilled then greedy), and its
    decode speed is a positive number. The prompt ids are the ones genai's own tokenizer gives the profile's
    prompt with add_special_tokens (what the route's command sets)."""
    import os

    repo, _ = built_repo
    art = repo / "artifacts" / BUILD
    health = json.loads((art / "deploy_profile" / "profile.json").read_text())["on_device"]["health"]
    assert health["command"][:2] == ["{python}", "deploy_profile/health_check.py"] and health["new_tokens"] == 16
    expect = json.loads((art / "verify_parity" / "report.json").read_text())["health"]
    assert expect["checked"] is True and expect["prompt_ids"] == health["prompt_ids"]
    io = json.loads((art / "pack" / "io.json").read_text())
    tokens = expect["tokens"]
    # 16 tokens, or fewer ending at an end-of-sequence token (where genai stops)
    assert len(tokens) == 16 or (0 < len(tokens) < 16 and tokens[-1] in io["eos_token_id"]), tokens

    py, guard = genai_python
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    framed = subprocess.run(
        [str(py), "-I", "-c", "import json, sys, onnxruntime_genai as og; t = og.Tokenizer(og.Model('pack')); "
                              "t.update_options(add_special_tokens='true'); print(json.dumps([int(i) for i in "
                              "t.encode(sys.argv[1])]))", health["prompt"]],
        cwd=art, capture_output=True, text=True, timeout=300, env=env)
    assert framed.returncode == 0, framed.stderr[-3000:]
    assert json.loads(framed.stdout.strip().splitlines()[-1]) == health["prompt_ids"]

    argv = [str(py) if a == "{python}" else a for a in health["command"]]
    ran = subprocess.run(argv, cwd=art, capture_output=True, text=True, timeout=health["timeout_s"], env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = json.loads(ran.stdout.strip().splitlines()[-1])
    assert said["tokens"] == tokens, (said, tokens)
    assert isinstance(said["decode_tok_s"], float) and said["decode_tok_s"] > 0, said
    where = "the project's venv" if guard else "the genai-only venv"
    report_line(request.config, f"test_genai_artifact: the health check ({where}) decoded verify_parity's "
                                f"{len(tokens)} tokens at {said['decode_tok_s']:.0f} tok/s (median of "
                                f"{len(said['decode_tok_s_runs'])} runs)")
