"""User text for calibration and evaluation (pipeline/sources/textdata.py), and what it changes in the cache."""

from __future__ import annotations

import json

import pytest

from pipeline.sources import textdata


class _Tok:
    """A character-level tokenizer with the HF call shape the module uses (BOS 1, EOS 2)."""

    bos_token_id, eos_token_id = 1, 2
    chat_template = None

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [3 + (ord(c) % 200) for c in text]}

    def apply_chat_template(self, chat, tokenize=True, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}" for m in chat)
        return [1] + self(text)["input_ids"]


def test_a_text_file_is_one_framed_document(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("abc")
    docs = textdata.documents(_Tok(), f)
    assert docs == [[1, 3 + ord("a"), 3 + ord("b"), 3 + ord("c"), 2]]


def test_jsonl_records_by_field_and_a_folder_in_name_order(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "xy"}) + "\n\n" + json.dumps({"body": "z"}) + "\n")
    (tmp_path / "a.txt").write_text("q")
    (tmp_path / "skip.bin").write_bytes(b"\0")
    docs = textdata.documents(_Tok(), tmp_path, field="body")
    assert [len(d) for d in docs] == [3, 4, 3]  # a.txt, then the two records
    ids, facts = textdata.stream(_Tok(), tmp_path, field="body")
    assert ids == [t for d in docs for t in d] and facts["documents"] == 3 and len(facts["files"]) == 2
    assert facts["ids_sha256"] == textdata.ids_sha256(ids)


def test_chat_records_go_through_the_checkpoints_template(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "yo"}]}) + "\n")
    tok = _Tok()
    with pytest.raises(textdata.TextDataError, match="no chat template"):
        textdata.documents(tok, f, field="messages", chat_template=True)
    tok.chat_template = "{{ messages }}"
    (doc,) = textdata.documents(tok, f, field="messages", chat_template=True)
    assert doc == tok.apply_chat_template([{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "yo"}]) + [2]
    with pytest.raises(textdata.TextDataError, match="not text .*chat_template=true"):
        textdata.documents(tok, f, field="messages")


@pytest.mark.parametrize("content, match", [
    ('{"text": "a"}\nnot json\n', r"bad\.jsonl:2: not JSON"),
    ('{"other": "a"}\n', r"bad\.jsonl:1: no field 'text'"),
])
def test_bad_records_are_one_line_errors_naming_the_line(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(textdata.TextDataError, match=match) as exc:
        textdata.documents(_Tok(), tmp_path / "bad.jsonl")
    assert "\n" not in str(exc.value)


def test_missing_sources_are_refused(tmp_path):
    with pytest.raises(textdata.TextDataError, match="no such file or folder"):
        textdata.files_of(tmp_path / "nope.txt")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(textdata.TextDataError, match="not a text file"):
        textdata.files_of(tmp_path / "x.csv")
    with pytest.raises(textdata.TextDataError, match="no .* files in the folder"):
        textdata.files_of(_empty(tmp_path))


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_overlap_counts_shared_runs_only():
    a = list(range(100))
    assert textdata.overlap(a, list(range(1000, 1100)), n=8) == 0
    assert textdata.overlap(a, list(range(50, 60)), n=8) == 3  # 50..57, 51..58, 52..59
    assert textdata.overlap(a, list(range(50, 56)), n=8) == 0  # shorter than a run
    assert textdata.overlap(a[:5], a, n=8) == 0


def test_a_user_calibration_text_rekeys_calibrate_and_nothing_upstream(tmp_path):
    """calibrate.dataset=FILE: the config is checked before any stage runs, calibrate's DVC entry gains the
    file as a dependency (an edit reruns it) and its params change; the stages upstream of it are the same
    entries; the quantize stage reads calibrate's output, so it reruns when the data change."""
    from pipeline.engine import dvcgen
    from pipeline.engine.config import ConfigError, compose, validate

    text = tmp_path / "mine.txt"
    text.write_text("def f(x):\n    return x\n" * 50)
    base = validate(compose(["device=x86_avx512", "build.name=b"]))
    mine = validate(compose(["device=x86_avx512", "build.name=b", f"calibrate.dataset={text}"]))
    a, b = dvcgen.generate({"b": base}, with_exp=False)["stages"], dvcgen.generate({"b": mine}, with_exp=False)["stages"]
    cal = next(k for k in a if k.endswith("--calibrate"))
    assert str(text) in b[cal]["deps"] and str(text) not in a[cal]["deps"]
    upstream = [k for k in a if k.endswith(("--probe", "--untie_head")) or k.startswith(("model--", "probe--"))]
    assert len(upstream) == 4 and all(a[k] == b[k] for k in upstream)
    quant = next(k for k in a if k.endswith("--quantize"))
    assert any(d.endswith("/calibrate") for d in a[quant]["deps"])
    with pytest.raises(ConfigError, match=r"calibrate\.dataset: .*no such file"):
        validate(compose(["device=x86_avx512", f"calibrate.dataset={tmp_path / 'missing.txt'}"]))
    with pytest.raises(ConfigError, match=r"calibrate\.dataset must be an absolute"):
        validate(compose(["device=x86_avx512", "calibrate.dataset=relative.txt"]))


def test_parity_prompts_from_a_users_file(tmp_path):
    """parity.prompts_file: a .txt file's non-empty lines, or a .jsonl's field per record (newlines kept);
    checked before any stage runs; verify_parity's DVC entry gains the file as a dependency."""
    from pipeline.engine import dvcgen
    from pipeline.engine.config import ConfigError, compose, validate

    txt = tmp_path / "prompts.txt"
    txt.write_text("def read(path):\n\n   class Foo:  \n")
    assert textdata.prompts(txt) == ["def read(path):", "class Foo:"]
    jl = tmp_path / "prompts.jsonl"
    jl.write_text(json.dumps({"q": "line one\nline two"}) + "\n")
    assert textdata.prompts(jl, field="q") == ["line one\nline two"]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(textdata.TextDataError, match="no prompts"):
        textdata.prompts(tmp_path / "empty.txt")
    cfg = validate(compose(["device=x86_avx512", "build.name=b", f"parity.prompts_file={txt}"]))
    stages = dvcgen.generate({"b": cfg}, with_exp=False)["stages"]
    assert str(txt) in stages["b--verify_parity"]["deps"]
    with pytest.raises(ConfigError, match=r"parity\.prompts_file: .*no such file"):
        validate(compose(["device=x86_avx512", f"parity.prompts_file={tmp_path / 'nope.txt'}"]))


def test_an_evaluation_text_that_overlaps_the_calibration_is_refused_in_one_line(tmp_path):
    """verify_parity's evaluation windows from a user's text: refused (one line, naming the setting) where
    the text shares a 32-token run with the calibration windows; accepted, cut into llama-perplexity's
    chunks, where it shares none."""
    import numpy as np
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageError
    from stages import verify_parity

    tok = _Tok()
    calib_text = "".join(chr(65 + (i * 7) % 50) for i in range(400))
    cal = tmp_path / "calibrate"
    cal.mkdir()
    ids = tok(calib_text)["input_ids"]
    np.save(cal / "token_ids.npy", np.asarray(ids[:320], np.int32).reshape(10, 32))

    class Ctx:
        inputs = {"calibrate": cal}

        def __init__(self, text):
            self.cfg = OmegaConf.create({"parity": {"eval_text": str(text), "eval_windows": 2, "eval_n_ctx": 64}})

    overlapping = tmp_path / "eval.txt"
    overlapping.write_text("some words first " + calib_text[40:200])
    with pytest.raises(StageError, match=r"parity\.eval_text .* shares \d+ runs of 32 tokens") as exc:
        verify_parity._evaluation(Ctx(overlapping), tok, tmp_path, 1, 256)
    assert "\n" not in str(exc.value)
    clean = tmp_path / "clean.txt"
    clean.write_text("".join(chr(97 + (i * 3) % 26) for i in range(300)))
    ev = verify_parity._evaluation(Ctx(clean), tok, tmp_path, 1, 256)
    assert len(ev.windows) == 2 and all(len(w) == 64 and w[0] == 1 for w in ev.windows)
    assert ev.facts["scored_tokens"] == 2 * (64 - 32 - 1) and ev.facts["text"] == str(clean)
