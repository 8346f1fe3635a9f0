"""`python -m pipeline generate`: text streamed from a built artifact, through
its deploy profile, refused in one line when the build is missing, tampered
with, or runs on a runtime this host does not have."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import venv_env

pytestmark = pytest.mark.slow
BUILD = "x86_avx512-embedded-speed"


def gen(repo, *args):
    return subprocess.run([sys.executable, "-m", "pipeline", "generate", *args], cwd=repo,
                          capture_output=True, text=True, env=venv_env(), timeout=300)


def test_generate_streams_the_greedy_continuation_of_the_artifact(built_repo):
    repo, _ = built_repo
    proc = gen(repo, BUILD, "def read", "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def read")  # the tiny test model's continuation may be whitespace
    assert "w4_ort_matmulnbits on onnxruntime" in proc.stderr and "12 new at" in proc.stderr, proc.stderr
    # Greedy is deterministic, and is the packed artifact's own greedy decode.
    again = gen(repo, BUILD, "def read", "--max-new-tokens", "12")
    assert again.stdout == proc.stdout
    sys.path.insert(0, str(repo))
    from pipeline.runtimes.open import open_runtime
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(repo / "artifacts" / BUILD / "untie_head"))
    dec = open_runtime("ort_int4", str(repo / "artifacts" / BUILD / "pack"), 1)
    ids = tok("def read")["input_ids"]
    expected = tok.decode(dec.generate_greedy(ids, 12), skip_special_tokens=True)
    assert proc.stdout == "def read" + expected + "\n"  # the streamed pieces, then a newline


def test_speculative_generation_streams_greedy_text(built_repo):
    """--speculate streams the text of greedy decoding (here on a prompt whose continuation repeats it) and
    says what it drafted; with sampling it is refused in one line. The tokens: generate()'s own, plain
    against speculative, are greedy's (or part at a near-tie: tests/test_speculative.py)."""
    repo, _ = built_repo
    prompt = 'def read(path):\n    """Return the text of the file."""\n    return open(path).read()\n\n\ndef read'
    spec = gen(repo, BUILD, prompt, "--max-new-tokens", "24", "--speculate")
    assert spec.returncode == 0 and spec.stdout.startswith(prompt), spec.stderr
    assert "(speculative: " in spec.stderr and " calls, " in spec.stderr, spec.stderr
    bad = gen(repo, BUILD, prompt, "--speculate", "--temperature", "0.7")
    assert bad.returncode == 1 and "needs --temperature 0" in bad.stderr and "Traceback" not in bad.stderr
    sys.path.insert(0, str(repo))
    from transformers import AutoTokenizer

    from pipeline.runtimes.generate import generate, prompt_ids
    from pipeline.runtimes.open import open_runtime
    from tests.test_speculative import greedy_or_near_tie

    tok = AutoTokenizer.from_pretrained(str(repo / "artifacts" / BUILD / "untie_head"))
    dec = open_runtime("ort_int4", str(repo / "artifacts" / BUILD / "pack"), 2)
    plain = generate(dec, tok, prompt, 24)
    fast = generate(dec, tok, prompt, 24, speculate=True)
    assert "speculative" in fast["decode_how"]
    greedy_or_near_tie(dec, prompt_ids(tok, prompt), plain["ids"], fast["ids"])


def test_generate_samples_reproducibly_with_a_seed(built_repo):
    repo, _ = built_repo
    a = gen(repo, BUILD, "The", "--max-new-tokens", "10", "--temperature", "1.0", "--seed", "3")
    b = gen(repo, BUILD, "The", "--max-new-tokens", "10", "--temperature", "1.0", "--seed", "3")
    assert a.returncode == 0 and a.stdout == b.stdout, a.stderr


@pytest.mark.parametrize("args, words", [
    (["no-such-build", "x"], "no build 'no-such-build'"),
    (["../etc", "x"], "is not a build name"),
    ([BUILD, "x", "--max-new-tokens", "0"], "--max-new-tokens must be"),
])
def test_bad_requests_are_one_line(built_repo, args, words):
    repo, _ = built_repo
    proc = gen(repo, *args)
    assert proc.returncode != 0 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_missing_build_lists_the_builds_there_are(built_repo):
    repo, _ = built_repo
    proc = gen(repo, "no-such-build", "x")
    listed = proc.stderr.split("(built: ", 1)[1].split(")", 1)[0].split(", ")
    assert BUILD in listed and "deploy_profile" not in listed, proc.stderr


def test_a_tampered_artifact_is_refused_before_it_runs(built_repo):
    repo, _ = built_repo
    target = repo / "artifacts" / BUILD / "pack" / "io.json"
    original = target.read_bytes()
    try:
        target.write_bytes(original + b" ")  # one byte more: still valid JSON, not the file the manifest hashed
        proc = gen(repo, BUILD, "x")
        assert proc.returncode == 1 and str(target) in proc.stderr and "sha256" in proc.stderr, proc.stderr
    finally:
        target.write_bytes(original)


def test_the_chat_template_option_renders_one_user_turn():
    """--chat-template: the prompt goes in as one user message through the tokenizer's own template, the
    assistant's turn opened; without a template it is a one-line error; plain prompts are unchanged."""
    from pipeline.runtimes.generate import GenerateError, prompt_ids

    class Tok:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1] + [ord(c) for c in text]}

        def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
            assert tokenize and add_generation_prompt and messages == [{"role": "user", "content": "hi"}]
            return {"input_ids": [1, 7, ord("h"), ord("i"), 8, 9]}

    tok = Tok()
    assert prompt_ids(tok, "hi") == [1, ord("h"), ord("i")]
    with pytest.raises(GenerateError, match="no chat template"):
        prompt_ids(tok, "hi", chat_template=True)
    tok.chat_template = "{{ messages }}"
    assert prompt_ids(tok, "hi", chat_template=True) == [1, 7, ord("h"), ord("i"), 8, 9]
