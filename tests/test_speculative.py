"""Greedy-exact speculative decoding (edgekiln_runtime/speculative.py) on the GQA graph: the graph's
row_logits, GqaDecoder's verify / rewind, the window buffers' layout that bounds a verify, and the
decoded tokens against plain greedy decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgekiln_runtime import speculative
from edgekiln_runtime.gqa import GqaDecoder
from edgekiln_runtime.speculative import NgramDrafter
from pipeline.graphs.decode_graph import snr_db
from tests.test_gqa_graph import EMBEDDED, MAX_LEN, WINDOW, _checkpoint, _graph, _seq, _steps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = _checkpoint(tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


def greedy_or_near_tie(dec, prompt, plain_tokens, spec_tokens, lead: float = 0.5) -> None:
    """Speculative tokens are plain greedy's, or differ first where greedy's top two logits were within
    `lead` of each other (accuracy_level 4 rounds a multi-row call otherwise than a step)."""
    if spec_tokens == plain_tokens:
        return
    i = next((k for k, (a, b) in enumerate(zip(spec_tokens, plain_tokens)) if a != b),
             min(len(spec_tokens), len(plain_tokens)))
    assert i < min(len(spec_tokens), len(plain_tokens)), "one stopped early: not a near-tie"
    dec.reset()
    logits = dec.prefill(list(prompt) + list(plain_tokens[:i])) if i else dec.prefill(list(prompt))
    top2 = np.partition(logits, -2)[-2:]
    assert top2[1] - top2[0] < lead, (i, float(top2[1] - top2[0]))


def test_the_drafter_proposes_what_followed_the_latest_earlier_match():
    d = NgramDrafter(draft_max=4, max_ngram=3, min_ngram=2)
    d.extend([5, 1, 2, 3, 4, 6, 2, 3, 7, 1, 2, 3])
    assert d.draft() == [4, 6, 2, 3]  # the 3-gram (1, 2, 3) wins over the later 2-gram (2, 3)
    assert d.draft(limit=2) == [4, 6]
    d.extend([4])
    assert d.draft() == [6, 2, 3, 7]  # (2, 3, 4): its earlier occurrence, not the suffix itself
    d = NgramDrafter(min_ngram=2)
    d.extend([1, 2, 3, 4])
    assert d.draft() == []  # nothing repeats
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


def _start(length: int, c: int, w: int) -> int:
    """The first position a window buffer of c rows (window w) holds at a stream of `length` (verify_room)."""
    return 0 if length <= c else length - w - (length - c - 1) % (c - w + 1)


def _layout(dec: GqaDecoder, full_k: np.ndarray) -> list:
    """The position each row of layer 0's key buffer holds (matched against a max_len buffer's rows)."""
    buf = dec._kv[0][0].numpy()[0, 0]
    return [next((p for p in range(len(full_k)) if np.allclose(row, full_k[p], atol=1e-5)), None) for row in buf]


@pytest.mark.parametrize("slack", [2, 5])
def test_the_window_buffer_layout_is_a_function_of_the_length(ck, slack):
    """What verify_room rests on: ONNX Runtime's GQA keeps a window buffer's rows from start(L) on at
    slot 0, whatever the calls' sizes were (stepping, or chunks crossing compactions)."""
    g = ck("gemma3")
    full = GqaDecoder(_graph(g, 0, "_full", window_cache_slack=None), threads=1)
    ids = _seq(40, seed=2)
    _steps(full, ids)
    full_k = full._kv[0][0].numpy()[0, 0].copy()
    cap = WINDOW + slack
    for chunks in ([1] * 30, [7, 3, 4, 5, 1, 1, 2, 6, 1]):
        dec = GqaDecoder(_graph(g, 0, f"_s{slack}", window_cache_slack=slack), threads=1)
        assert dec._windows == [(cap, WINDOW)]
        for n in chunks:
            p = dec.position
            dec.prefill(ids[p:p + n])
            length = dec.position
            start = _start(length, cap, WINDOW)
            held = min(length - start, cap)
            assert _layout(dec, full_k)[:held] == list(range(start, start + held)), (chunks, length)


@pytest.mark.parametrize("name,options", [("qwen3", {}), ("gemma3", {"window_cache_slack": 2}),
                                          ("gemma3", {"io_layout": "edgekiln"})])
def test_verify_gives_each_rows_step_logits_and_rewind_drops_rows(ck, name, options):
    g = ck(name)
    tag = "_" + "_".join(f"{k}{v}" for k, v in options.items())
    dec = GqaDecoder(_graph(g, 0, tag, **options), threads=1)
    ids = _seq(40, seed=3)
    stepped = _steps(dec, ids)
    dec.reset()
    dec.prefill(ids[:6])
    n = min(8, dec.verify_room())
    assert n >= 4
    rows = dec.verify(ids[6:6 + n])
    assert rows.shape == (n, dec.vocab_size) and dec.position == 6 + n
    assert snr_db(stepped[6:6 + n], rows) > 100.0
    dec.rewind(n - 2)  # keep two rows
    with pytest.raises(ValueError, match="rewind"):
        dec.rewind(1)  # only once, right after a verify
    assert dec.position == 8
    after = np.stack([dec.step(t) for t in ids[8:30]])  # on past the window buffers' compactions
    assert snr_db(stepped[8:30], after) > 100.0
    # the default (row_logits not fed): the last row only, as before
    dec.reset()
    assert snr_db(stepped[9], dec.prefill(ids[:10])) > 100.0


def test_verify_stops_at_a_window_buffers_compaction(ck):
    """A verify may not cross the next compaction of a window buffer (its rewind could not be exact)."""
    g = ck("gemma3")
    dec = GqaDecoder(_graph(g, 0, "_s2", window_cache_slack=2), threads=1)
    cap = WINDOW + 2
    ids = _seq(40, seed=4)
    dec.prefill(ids[:cap - 3])
    assert dec.verify_room() == 3  # up to the buffer's length, no further
    with pytest.raises(ValueError, match="verify_room"):
        dec.verify(ids[cap - 3:cap + 1])
    dec.prefill(ids[cap - 3:cap])  # at C: the next row compacts, and the epoch after it is slack + 1 long
    assert dec.verify_room() == 3
    dec.step(ids[cap])
    assert dec.verify_room() == 2
    # a graph without window buffers: the context is the only bound
    q = GqaDecoder(_graph(ck("qwen3"), 0), threads=1)
    q.prefill(ids[:10])
    assert q.verify_room() == MAX_LEN - 10


@pytest.mark.parametrize("name,options,min_ngram", [("qwen3", {}, 1), ("gemma3", {"window_cache_slack": 2}, 1),
                                                    ("gemma3", {}, 2)])
def test_speculative_tokens_are_greedy_tokens(ck, name, options, min_ngram):
    """Token for token plain greedy decoding's, with drafts accepted and rejected, past the window
    buffers' compactions (slack 2: one every 3 positions)."""
    g = ck(name)
    tag = "_" + "_".join(f"{k}{v}" for k, v in options.items())
    dec = GqaDecoder(_graph(g, 0, tag, **options), threads=1)
    accepted = rejected = 0
    for seed in range(4):
        body = _seq(8, seed=10 + seed)
        prompt = body + body[:5] + body + body[:3]  # repeats the drafter can find
        n = MAX_LEN - len(prompt)
        want = dec.generate_greedy(prompt, n, prefilled=True)
        st = speculative.generate(dec, prompt, n, min_ngram=min_ngram, max_ngram=3)
        assert st.tokens == want, seed
        # every token after the prefill's is a call's own choice or a kept draft token (the last call's
        # own choice is dropped where its kept drafts reached n)
        assert len(want) - 1 <= st.calls + st.accepted <= len(want)
        accepted += st.accepted
        rejected += st.drafted - st.accepted
    assert accepted > 0 and rejected > 0  # both paths ran


def test_an_artifact_without_row_logits_is_refused(ck, tmp_path):
    g = ck("qwen3")
    src = _graph(g, 0)
    io = json.loads((src / "io.json").read_text())
    io.pop("row_logits")
    import shutil

    old = tmp_path / "old"
    shutil.copytree(src, old)
    (old / "io.json").write_text(json.dumps(io))
    dec = GqaDecoder(old, threads=1)
    with pytest.raises(ValueError, match="rebuild the pack stage"):
        speculative.generate(dec, [3, 4, 5], 4)


@pytest.mark.skipif(not (EMBEDDED / "quantize" / "quant.json").is_file(), reason="embedded build artifacts absent")
def test_the_embedded_model_speculates_on_input_grounded_text(tmp_path):
    """The trained embedded model (sliding layers, window buffers) continuing a docstring it was given:
    plain greedy's tokens, with drafts kept. At accuracy_level 0 (fp32 arithmetic: a multi-row call and a
    step agree to ~80 dB); the builds' level 4 rounds int8 activations otherwise in the two, so a near-tie
    can fall the other way (benchmarks/speculative.py measures how often)."""
    from edgekiln_runtime.text import FolderTokenizer
    from pipeline.graphs.gqa_graph import build_gqa_graph

    out = tmp_path / "gqa"
    build_gqa_graph(EMBEDDED / "untie_head", EMBEDDED / "quantize", out, max_len=256, accuracy_level=0)
    for f in (EMBEDDED / "pack").glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    dec = GqaDecoder(out, threads=2)
    doc = ("Return a copy of the string with leading and trailing whitespace removed. If chars is given "
           "and not None, remove characters in chars instead.")
    ids = FolderTokenizer(out, dec.io).prompt_ids(f'"""{doc}"""\n\n"""{doc[:40]}')
    n = 48
    st = speculative.generate(dec, ids, n)
    assert st.tokens == dec.generate_greedy(ids, n, prefilled=True)
    assert st.accepted > 0 and st.calls < n - 1
