"""verify_parity in bounded memory: the figures streamed CHUNK steps at a time equal
the concatenate-everything formulas, the reference's recomputed logits equal its
step-by-step ones, and peak memory does not grow with steps x vocabulary."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pipeline.graphs.decode_graph import DecodeGraphError, snr_db  # noqa: E402

from pipeline.runtimes.reference import ReferenceRun, TorchReference

from pipeline.runtimes.contract import Runtime
from stages import verify_parity  # noqa: E402


class _Bar:
    def __init__(self, log):
        self.log = log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, n: int = 1, **_):
        self.log.append(n)


class _Ctx:
    """The StageContext methods _teacher / _compare / _htp_plan use; records every bar's advances; keeps
    nothing (a StageContext with no journal: tests/test_journal.py has one that keeps)."""

    def __init__(self):
        self.bars = []

    def remembered(self, name, compute, what=None):
        return compute()

    def progress(self, total, description):
        self.bars.append((total, description, []))
        return _Bar(self.bars[-1][2])

    def log(self, message):
        self.logged = [*getattr(self, "logged", []), message]


# --------------------------------------------------------------------------
# A fake reference (numpy head) and a fake decoder: the reference's logits plus noise
# --------------------------------------------------------------------------


def _fake_teacher(prompts, decode, hidden_dim, vocab, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((hidden_dim, vocab)).astype(np.float32)

    def head(h):
        # Row by row: a float32 matrix product's rows depend on how many rows it is given (BLAS
        # blocks them differently; 3e-9 relative on one machine's OpenBLAS), and the figures are
        # compared whole against chunked, so the fake head must give each row alone.
        h = np.asarray(h, dtype=np.float32)
        return np.array([row @ w for row in h], dtype=np.float32).reshape(len(h), vocab)

    runs = []
    for ids in prompts:
        hid = rng.standard_normal((len(ids) + decode, hidden_dim)).astype(np.float32)
        picks = head(hid[len(ids) - 1: len(ids) - 1 + decode]).argmax(-1)
        runs.append(ReferenceRun(ids, [int(t) for t in picks], hid, head))
    return runs


class _FakeDecoder(Runtime):
    """Steps of the prompt starting with token k: the reference's row plus noise[k] x a fixed
    N(0, 1) vector rolled by the position (a scale of 0, or an exact step, gives the row
    itself), and at flips[k] = j the argmax of decode step j moved to another token."""

    def __init__(self, runs, noise, flips=None, exact_steps=()):
        self.runs = {run.prompt[0]: (k, run) for k, run in enumerate(runs)}
        self.noise, self.flips, self.exact = noise, flips or {}, set(exact_steps)
        vocab = runs[0].logits(0, 1).shape[1]
        self.base = np.random.default_rng(1).standard_normal(vocab).astype(np.float32)
        self.reset()

    def reset(self):
        self.first, self.position = None, 0

    def step(self, token_id):
        if self.first is None:
            self.first = int(token_id)
        k, run = self.runs[self.first]
        p = self.position
        row = run.head(run.hidden[p:p + 1])[0]
        if (k, p) not in self.exact:
            row = row + np.float32(self.noise[k]) * np.roll(self.base, 7919 * (p + 1) + k)
        j = self.flips.get(k)
        if j is not None and p == len(run.prompt) - 1 + j:
            row[(int(row.argmax()) + 1) % row.shape[0]] = row.max() + 1.0
        self.position = p + 1
        return row


def _old_figures(runs, dec):
    """The pre-streaming formulas: every step's logits of every prompt concatenated."""
    rs, os_ = [], []
    for run in runs:
        dec.reset()
        seq = run.prompt + run.continuation
        rs.append(run.logits(0, run.steps))
        os_.append(np.stack([dec.step(t) for t in seq]).astype(np.float64))
    r, o = np.concatenate(rs), np.concatenate(os_)
    t5r = np.argpartition(-r, 5, axis=-1)[:, :5]
    t5o = np.argpartition(-o, 5, axis=-1)[:, :5]
    overlap = np.array([len(set(a) & set(b)) for a, b in zip(t5r, t5o)])
    lr = r - r.max(-1, keepdims=True)
    lo = o - o.max(-1, keepdims=True)
    lr = lr - np.log(np.exp(lr).sum(-1, keepdims=True))
    lo = lo - np.log(np.exp(lo).sum(-1, keepdims=True))
    per_step = [[snr_db(a, b) for a, b in zip(x, y)] for x, y in zip(rs, os_)]
    first_div = []
    for run, y in zip(runs, os_):
        picks = y[len(run.prompt) - 1: len(run.prompt) - 1 + len(run.continuation)].argmax(-1)
        first_div.append(next((k for k, (a, b) in enumerate(zip(run.continuation, picks)) if a != int(b)), None))
    return {
        "logits_snr_db": snr_db(r, o),
        "worst_step_snr_db": min(min(s) for s in per_step),
        "top1_agreement": float((r.argmax(-1) == o.argmax(-1)).mean()),
        "top5_agreement": float((overlap == 5).mean()),
        "top5_overlap": float(overlap.mean() / 5),
        "kl_nats": float(np.mean(np.sum(np.exp(lr) * (lr - lo), axis=-1))),
        "steps": int(r.shape[0]),
    }, [(snr_db(x, y), s, d) for x, y, s, d in zip(rs, os_, per_step, first_div)]


PROMPTS = [[3, 10, 11, 12, 13], [4, 40, 41], [5, 60, 61, 62, 63, 64, 65]]
DECODE = 30


@pytest.mark.parametrize("chunk", [1, 7, verify_parity.CHUNK])
def test_streamed_figures_equal_the_concatenated_formulas(monkeypatch, chunk):
    monkeypatch.setattr(verify_parity, "CHUNK", chunk)
    runs = _fake_teacher(PROMPTS, DECODE, hidden_dim=8, vocab=300)
    # Prompt 0 matches, prompt 1 diverges at decode step 4, prompt 2's noise moves some argmaxes
    # and its first step is exact (an infinite step SNR).
    dec = _FakeDecoder(runs, noise=[0.01, 0.01, 1.0], flips={1: 4}, exact_steps=[(2, 0)])
    texts = [f"p{k}" for k in range(len(PROMPTS))]
    ctx = _Ctx()
    metrics, per_prompt = verify_parity._compare(runs, dec, texts, PROMPTS, DECODE, ctx, "fake")
    want, want_per = _old_figures(runs, dec)

    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert metrics["prompts"] == 3
    assert [p["greedy_first_divergence"] for p in per_prompt] == [d for _, _, d in want_per]
    assert [p["greedy_first_divergence"] for p in per_prompt][:2] == [None, 4]
    assert metrics["greedy_match"] == sum(p["greedy_match"] for p in per_prompt) >= 1
    assert [p["greedy_match"] for p in per_prompt] == [d is None for _, _, d in want_per]
    for p, (snr, steps, _) in zip(per_prompt, want_per):
        assert p["logits_snr_db"] == pytest.approx(snr, rel=1e-9)
        assert float(p["worst_step_snr_db"]) == pytest.approx(min(steps), rel=1e-9)
        assert p["step_snr_db"] == [round(x, 2) if math.isfinite(x) else "inf" for x in steps]
    assert per_prompt[2]["step_snr_db"][0] == "inf"
    assert 0 < metrics["top1_agreement"] < 1 and 0 < metrics["kl_nats"]

    # The greedy outcome read off the fed run is the one a free greedy decode gives.
    _, free = verify_parity._compare(runs, dec, texts, PROMPTS, DECODE, _Ctx(), "fake", free_decode=True)
    assert [(p["greedy_match"], p["greedy_first_divergence"]) for p in free] == \
        [(p["greedy_match"], p["greedy_first_divergence"]) for p in per_prompt]

    # The bar counts steps, advancing at least once a chunk.
    (total, _, advances), = ctx.bars
    assert total == sum(advances) == metrics["steps"]
    assert len(advances) == sum(math.ceil((len(ids) + DECODE) / chunk) for ids in PROMPTS)


def _peak_of_compare(steps, vocab):
    runs = _fake_teacher([[7, 8]], steps - 2, hidden_dim=4, vocab=vocab)
    dec = _FakeDecoder(runs, noise=[0.1])
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        metrics, _ = verify_parity._compare(runs, dec, ["p"], [[7, 8]], steps - 2, _Ctx(), "fake")
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert metrics["steps"] == steps
    return peak


def test_peak_memory_does_not_grow_with_steps_times_vocabulary():
    vocab = 100_000
    short, long = _peak_of_compare(50, vocab), _peak_of_compare(400, vocab)
    row = vocab * 8  # one step's float64 logits
    # Eight times the steps: the old concatenation held 2 x 400 rows (640 MB) here.
    assert long < 1.25 * short, (short, long)
    assert long < 12 * verify_parity.CHUNK * row, (long, row)


# --------------------------------------------------------------------------
# The real reference: recomputed logits against its own step-by-step ones
# --------------------------------------------------------------------------

WINDOW = 8


def _gemma3_softcap():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
        query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        final_logit_softcapping=0.5,  # small enough that the cap bends these random-init logits
    )
    return Gemma3ForCausalLM(cfg).eval()


def _qwen3(cls=None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return (cls or Qwen3ForCausalLM)(cfg).eval()


# The first prompt runs past the 8-token window in its one-forward prefill.
REAL_PROMPTS = [[1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1, 50]]
REAL_DECODE = 12


@pytest.mark.parametrize("build", [_gemma3_softcap, _qwen3], ids=["gemma3_softcap", "qwen3"])
def test_reference_logits_recomputed_from_hidden_states_match_its_steps(build, one_torch_thread):
    model = build()
    seq = torch.tensor([REAL_PROMPTS[0] + list(range(30, 40))])
    with torch.inference_mode():
        own = model(input_ids=seq).logits[0].numpy()
        hidden = model.model(input_ids=seq).last_hidden_state[0]
        plain = model.lm_head(hidden).numpy()
    ref = TorchReference(model)
    assert np.array_equal(ref.head(hidden), own)  # HF's head, softcap included, reproduced exactly
    if getattr(model.config, "final_logit_softcapping", None):
        assert not np.allclose(plain, own, atol=1e-3)  # ... and the softcap is exercised

    ctx = _Ctx()
    teacher = verify_parity._teacher(ref, REAL_PROMPTS, REAL_DECODE, ctx)
    (total, _, advances), = ctx.bars
    assert total == sum(advances) == sum(len(p) + REAL_DECODE for p in REAL_PROMPTS)
    stepped = TorchReference(build())
    for ids, run in zip(REAL_PROMPTS, teacher):
        assert tuple(run.hidden.shape) == (len(ids) + REAL_DECODE, model.config.hidden_size)
        stepped.reset()
        logits = [stepped.step(t) for t in ids]
        cont = []
        for _ in range(REAL_DECODE):
            cont.append(int(np.argmax(logits[-1])))
            logits.append(stepped.step(cont[-1]))
        assert run.continuation == cont
        assert snr_db(np.stack(logits), run.logits(0, run.steps)) > 100

    # The same model as the decoder, through _compare: the streamed figures of a match.
    metrics, per_prompt = verify_parity._compare(teacher, TorchReference(build()), ["a", "b"], REAL_PROMPTS,
                                                 REAL_DECODE, _Ctx(), "itself")
    assert metrics["logits_snr_db"] > 100 and metrics["top1_agreement"] == 1.0
    assert metrics["greedy_match"] == 2 and metrics["kl_nats"] < 1e-9


def test_a_head_the_reference_cannot_recompute_is_refused(one_torch_thread):
    from transformers import Qwen3ForCausalLM

    class Scaled(Qwen3ForCausalLM):  # logits scaled after the head, as Granite / Cohere do
        def forward(self, *args, **kw):
            out = super().forward(*args, **kw)
            out.logits = out.logits * 2.0
            return out

    with pytest.raises(DecodeGraphError, match="cannot recompute"):
        TorchReference(_qwen3(Scaled)).greedy_run([1, 5], 3)


@pytest.mark.parametrize("chunk", [1, 5, verify_parity.CHUNK])
def test_evaluation_statistics_stream_over_the_second_half_of_each_window(monkeypatch, chunk):
    """The perplexity / KLD statistics over evaluation windows (verify_parity._Evaluation): fed each window,
    its first half in one prefill and a step a token after, they equal llama.cpp's formulas
    (pipeline/measure/kld.py) over the concatenated rows of the second half of every window, whatever CHUNK."""
    from pipeline.measure import kld

    monkeypatch.setattr(verify_parity, "CHUNK", chunk)
    windows = [[3, *range(20, 39)], [4, *range(50, 69)]]  # 20 tokens each: positions 10..18 scored
    runs = _fake_teacher(windows, 0, 6, 80, seed=5)
    ev = verify_parity._Evaluation(windows, {})
    ev.runs = runs
    dec = _FakeDecoder(runs, noise=[0.3, 0.6])
    ctx = _Ctx()
    got = ev.measure(dec, ctx, "fake")
    acc = kld.Accumulator()
    for w, run in zip(windows, runs):
        dec.reset()
        rows = np.stack([dec.step(t) for t in w[:-1]])
        acc.add(run.logits(10, 19), rows[10:19], w[11:20])
    want = acc.summary()
    assert got["tokens"] == 18 == want["tokens"]
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert ctx.bars[-1][0] == 18 and sum(ctx.bars[-1][2]) == 18


def test_the_gate_in_llama_cpps_units():
    """parity.artifact.<path>.max_kld_mean / max_kld_p99 / max_ppl_ratio gate the evaluation statistics (a
    build above one fails naming it); null is not gated; a limit set with no evaluation run is refused."""
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageError

    metrics = {"logits_snr_db": 20.0, "top1_agreement": 0.9, "greedy_match": 1, "kl_nats": 0.01,
               "top5_agreement": 0.5}
    stats = {"kld_mean": 0.3, "kld_p99": 1.0, "ppl_ratio": 1.1}
    base = {"min_logits_snr_db": 10.0, "min_top1_agreement": 0.75, "min_greedy_match": 0, "max_kl_nats": 0.25}
    limits = OmegaConf.create({**base, "max_kld_mean": None, "max_kld_p99": None, "max_ppl_ratio": None})
    assert "kld_mean" not in verify_parity._gate(_Ctx(), "p", limits, metrics, 2, stats=stats)
    limits = OmegaConf.create({**base, "max_kld_mean": 0.25, "max_kld_p99": 1.5, "max_ppl_ratio": 1.25})
    with pytest.raises(StageError, match=r"kld_mean 0\.3 \(needs <= 0\.25\)") as exc:
        verify_parity._gate(_Ctx(), "p", limits, metrics, 2, stats=stats)
    assert "kld_p99" not in str(exc.value) and "\n" not in str(exc.value)
    checked = verify_parity._gate(_Ctx(), "p", limits, metrics, 2, stats={**stats, "kld_mean": 0.2})
    assert checked["kld_mean"] == "<= 0.25" and checked["ppl_ratio"] == "<= 1.25"
    ctx = _Ctx()
    assert "kld_mean" not in verify_parity._gate(ctx, "p", limits, metrics, 2, stats=None)
    assert any("not checked" in m and "eval_windows=0" in m for m in ctx.logged)


def test_a_prompt_graphs_gate_reads_kl_beside_the_snr():
    """A prompt graph is gated at its chunk ends on parity.artifact.<path>'s SNR floor and KL ceiling
    (verify_parity._prompt_gate): logits clipped at their calibrated range moved distributions (KL 1.6
    nats) at 40 dB (docs/phone-fidelity.md, finding 9), so a high SNR with a high KL fails, naming the
    prompt graph and the token graph's figures; top-1 over a few chunk ends is reported, not gated."""
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageError

    limits = OmegaConf.create({"min_logits_snr_db": 20.0, "min_top1_agreement": 0.95, "min_greedy_match": 0,
                               "max_kl_nats": 0.05})
    token = {"logits_snr_db": 41.2, "kl_nats": 0.0005}
    pm = {"logits_snr_db": 40.0, "logits_snr_centred_db": 41.0, "top1_agreement": 1.0, "kl_nats": 1.6,
          "step_kld_mean": 1.6, "step_kld_p99": 1.6, "step_kld_max": 1.6, "chunk_ends": 1, "tokens_a_call": 128,
          "executions": 1, "tokens": 32}
    with pytest.raises(StageError, match=r"its prompt graph's kl_nats 1\.6 \(needs <= 0\.05\)") as exc:
        verify_parity._prompt_gate(_Ctx(), "qnn_w8a16", limits, pm, "cold", token)
    assert "41.20 dB" in str(exc.value) and "logits_snr_db" not in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(StageError, match=r"logits_snr_db 19\.39 \(needs >= 20\)"):
        verify_parity._prompt_gate(_Ctx(), "qnn_w8a16", limits, {**pm, "logits_snr_db": 19.39, "kl_nats": 0.004},
                                   "cold", token)
    ctx = _Ctx()  # a near tie at the one chunk end: top-1 0.0 at KL 0.0001 passes, and is said
    checked = verify_parity._prompt_gate(ctx, "qnn_w8a16", limits, {**pm, "top1_agreement": 0.0, "kl_nats": 1e-4},
                                         "cold", token)
    assert checked == {"logits_snr_db": ">= 20", "kl_nats": "<= 0.05"}
    assert any("top1 0.000" in m and "1 chunk ends" in m for m in ctx.logged)


def test_a_run_without_evaluation_windows_is_gated_on_its_own_steps_kld():
    """An HTP run (or fp16, which has no CPU stand-in) has no evaluation windows: parity.artifact's KLD mean
    and p99 floors are checked over the run's own steps (each step's KL is the same per-token KLD), the PPL
    ratio said not checked. A run whose mean KL passes but whose worst steps do not fails on the p99."""
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageError

    limits = OmegaConf.create({"min_logits_snr_db": 30.0, "min_top1_agreement": 0.98, "min_greedy_match": 0,
                               "max_kl_nats": 0.01, "max_kld_mean": 0.002, "max_kld_p99": 0.02, "max_ppl_ratio": 1.03})
    metrics = {"logits_snr_db": 38.0, "logits_snr_centred_db": 39.0, "top1_agreement": 1.0, "greedy_match": 1,
               "kl_nats": 0.0015, "top5_agreement": 1.0, "steps": 50, "step_kld_mean": 0.0015,
               "step_kld_p99": 0.05, "step_kld_max": 0.06}
    with pytest.raises(StageError, match=r"step_kld_p99 0\.05 \(needs <= 0\.02 \(max_kld_p99, over the run's steps\)\)"):
        verify_parity._gate(_Ctx(), "qnn_fp16", limits, metrics, 1)
    ctx = _Ctx()
    checked = verify_parity._gate(ctx, "qnn_fp16", limits, {**metrics, "step_kld_p99": 0.01}, 1)
    assert checked["step_kld_mean"].startswith("<= 0.002") and checked["step_kld_p99"].startswith("<= 0.02")
    assert "ppl_ratio" not in checked and any("max_ppl_ratio not checked" in m for m in ctx.logged)
    assert any("centred SNR 39.0 dB" in m and "KLD p99 0.0100" in m for m in ctx.logged)
    # with the windows' statistics the windows' figures are gated, not the steps'
    stats = {"kld_mean": 0.001, "kld_p99": 0.01, "ppl_ratio": 1.0}
    checked = verify_parity._gate(_Ctx(), "qnn_fp16", limits, metrics, 1, stats=stats)
    assert "step_kld_p99" not in checked and checked["kld_p99"] == "<= 0.02"


def test_an_htp_subset_too_short_for_its_top1_floor_stands_on_its_kld():
    """The HTP's confirmation (a subset of steps the CPU stand-in gated in full) gates top-1 only where its
    steps can tolerate one miss (0.95: 20 steps): Gemma 3 270M's w8a16 cold run cut to 16 steps read 0.9375 on
    one near tie at KLD mean 0.0007 / p99 0.0022 and failed the build. Such a run is gated on its KLD, KL and
    SNR and says so; a long enough run, a bulk run, or a floor of 1.0 still fails on top-1."""
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageError

    assert [verify_parity.top1_resolvable(0.95, n) for n in (16, 19, 20)] == [False, False, True]
    assert verify_parity.top1_resolvable(0.98, 50) and not verify_parity.top1_resolvable(0.98, 49)
    assert verify_parity.top1_resolvable(1.0, 1)
    limits = OmegaConf.create({"min_logits_snr_db": 30.0, "min_top1_agreement": 0.95, "min_greedy_match": 0,
                               "max_kl_nats": 0.02, "max_kld_mean": 0.02, "max_kld_p99": 0.2})
    metrics = {"logits_snr_db": 40.6, "logits_snr_centred_db": 41.0, "top1_agreement": 15 / 16, "greedy_match": 0,
               "kl_nats": 0.0007, "top5_agreement": 1.0, "steps": 16, "step_kld_mean": 0.0007,
               "step_kld_p99": 0.0022, "step_kld_max": 0.003}
    with pytest.raises(StageError, match=r"top1_agreement 0\.9375 \(needs >= 0\.95\)"):
        verify_parity._gate(_Ctx(), "qnn_w8a16", limits, metrics, 1)  # a bulk run: gated
    ctx = _Ctx()
    checked = verify_parity._gate(ctx, "qnn_w8a16", limits, metrics, 1, subset=True)
    assert "top1_agreement" not in checked and checked["step_kld_p99"].startswith("<= 0.2")
    assert any("min_top1_agreement not gated" in m and "16 steps" in m and "needs 20" in m for m in ctx.logged)
    with pytest.raises(StageError, match=r"step_kld_mean 0\.05"):  # the KLD still gates the short run
        verify_parity._gate(_Ctx(), "qnn_w8a16", limits, {**metrics, "step_kld_mean": 0.05}, 1, subset=True)
    with pytest.raises(StageError, match=r"top1_agreement 0\.9 "):  # 20 steps resolve 0.95: two misses fail
        verify_parity._gate(_Ctx(), "qnn_w8a16", limits, {**metrics, "steps": 20, "top1_agreement": 0.9}, 1,
                            subset=True)


def test_the_step_figures_see_what_softmax_sees():
    """_Sums.step_figures: an offset added to every logit of a step costs the whole-vocabulary SNR and
    nothing else (the centred SNR is exact, KL 0); the p99 is numpy's percentile of the per-step KLs."""
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((40, 50)) * 3
    shifted = ref + rng.uniform(-1, 1, (40, 1))
    sums = verify_parity._Sums()
    sums.add(verify_parity._rows(ref, shifted))
    fig = sums.step_figures()
    assert sums.snr_db() < 30 and fig["logits_snr_centred_db"] > 150
    assert fig["step_kld_mean"] == pytest.approx(0.0, abs=1e-12) and fig["step_kld_p99"] == pytest.approx(0.0, abs=1e-12)
    noisy = ref + rng.standard_normal((40, 50)) * np.linspace(0.01, 1.0, 40)[:, None]
    a, b = verify_parity._Sums(), verify_parity._Sums()
    a.add(verify_parity._rows(ref[:25], noisy[:25]))
    b.add(verify_parity._rows(ref[25:], noisy[25:]))
    a.merge(b)
    kls = verify_parity._rows(ref, noisy)["kl"]
    fig = a.step_figures()
    assert fig["step_kld_p99"] == pytest.approx(float(np.percentile(kls, 99)))
    assert fig["step_kld_max"] == pytest.approx(float(kls.max())) and fig["step_kld_mean"] == pytest.approx(a.kl / 40)


def test_the_htp_confirmation_is_bounded_in_time():
    """verify_parity._htp_plan: the deployed binary's second step is timed (the first carries its set-up), and a plan that would pass
    parity.qnn_minutes is cut in proportion, never below the steps the gates stand on (32 a prompt, 16 for
    the others); a plan within the bound is left as asked. Either way it is said."""
    import time as _time

    from omegaconf import OmegaConf

    class _Slow:
        def reset(self):
            pass

        def step(self, token):
            _time.sleep(0.05)

    class _Run:
        prompt, continuation, steps = [1, 2, 3], [4, 5], 600

    ctx = _Ctx()
    ctx.cfg = OmegaConf.create({"parity": {"qnn_minutes": 0.01}})  # 0.6 s: 64 + 50 steps at 0.05 s pass it
    budget, short, plan = verify_parity._htp_plan(ctx, _Slow(), [_Run()], 64, 50, 1, True)
    assert (budget, short) == (verify_parity.MIN_HTP_STEPS, verify_parity.MIN_SHORT_STEPS)
    assert plan["steps_asked"] == [64, 50] and plan["s_per_step"] >= 0.05
    assert plan["projected_minutes"] < plan["projected_minutes_asked"]
    assert any("cut from" in m and "parity.qnn_minutes=0.01" in m and "run anyway" in m for m in ctx.logged)
    ctx = _Ctx()
    ctx.cfg = OmegaConf.create({"parity": {"qnn_minutes": None}})  # the default, 20 minutes: left as asked
    budget, short, plan = verify_parity._htp_plan(ctx, _Slow(), [_Run()], 64, 50, 1, False)
    assert (budget, short) == (64, 50) and plan["bound_minutes"] == verify_parity.HTP_MINUTES
    assert any("within parity.qnn_minutes=20" in m for m in ctx.logged)
