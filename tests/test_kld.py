"""pipeline/measure/kld.py: llama.cpp's perplexity / KL-divergence statistics on logits whose answer is known by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.measure import kld


def _logits_of(p):
    """Logits whose softmax is the distribution p (rows)."""
    return np.log(np.asarray(p, dtype=np.float64))


def test_identical_arms_have_zero_divergence_and_equal_perplexity():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 20))
    tok = rng.integers(0, 20, 50)
    acc = kld.Accumulator()
    acc.add(logits, logits.copy(), tok)
    s = acc.summary()
    assert s["tokens"] == 50
    assert s["kld_mean"] == pytest.approx(0, abs=1e-12) and s["kld_max"] == pytest.approx(0, abs=1e-12)
    assert s["ppl"] == pytest.approx(s["ppl_base"]) and s["ln_ppl_ratio"] == pytest.approx(0, abs=1e-12)
    assert s["same_top1_pct"] == 100.0 and s["rms_dp_pct"] == pytest.approx(0, abs=1e-9)
    assert s["ln_ppl_correlation"] == pytest.approx(1.0)


def test_two_tokens_by_hand():
    """Two positions, three-token vocabulary; every figure worked out on paper.

    base: [0.5, 0.25, 0.25] then [0.8, 0.1, 0.1]; Q: [0.25, 0.5, 0.25] then [0.8, 0.1, 0.1];
    next tokens 0 then 1.
    KL(base||Q) at 1: 0.5 ln 2 + 0.25 ln 0.5 + 0 = 0.25 ln 2; at 2: 0.
    nll_base: ln 2, ln 10; nll_q: ln 4, ln 10.  PPL_base = sqrt(20), PPL_q = sqrt(40).
    Same top-1: position 1 argmax 0 vs 1 (differs), position 2 agrees: 50%.
    dp: 0.25 - 0.5 = -0.25, 0.1 - 0.1 = 0: RMS = sqrt(0.03125) = 0.1768.
    """
    base = _logits_of([[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]])
    q = _logits_of([[0.25, 0.5, 0.25], [0.8, 0.1, 0.1]])
    acc = kld.Accumulator()
    acc.add(base[:1], q[:1], [0])  # fed a chunk at a time
    acc.add(base[1:], q[1:], [1])
    s = acc.summary()
    ln2 = math.log(2)
    assert s["kld_mean"] == pytest.approx(0.125 * ln2)
    assert s["kld_max"] == pytest.approx(0.25 * ln2) and s["kld_min"] == pytest.approx(0, abs=1e-12)
    assert s["kld_median"] == pytest.approx(0.125 * ln2)
    # llama.cpp reports no uncertainty for 10 tokens or fewer
    assert s["kld_mean_err"] == 0.0 and s["ppl_err"] == 0.0
    assert s["ppl_base"] == pytest.approx(math.sqrt(20)) and s["ppl"] == pytest.approx(math.sqrt(40))
    assert s["ln_ppl_ratio"] == pytest.approx(0.5 * ln2) and s["ppl_ratio"] == pytest.approx(math.sqrt(2))
    assert s["same_top1_pct"] == 50.0
    assert s["same_top1_pct_err"] == pytest.approx(100 * math.sqrt(0.25 / 1))
    assert s["dp_max_abs_pct"] == pytest.approx(25.0)
    assert s["rms_dp_pct"] == pytest.approx(100 * math.sqrt(0.03125))
    assert s["dp_mean_pct"] == pytest.approx(-12.5)
    # the 90th percentile interpolates linearly between the two sorted values (numpy's / llama.cpp's)
    assert s["kld_p90"] == pytest.approx(0.9 * 0.25 * ln2)


def test_uncertainties_are_llama_cpps():
    """Past 10 tokens: sqrt(population variance / (n - 1)) for a mean; the ratio's from both errors and their
    covariance (equal to the error of the per-token differences); the RMS dp's through the square root."""
    rng = np.random.default_rng(7)
    vals = {"nll_q": rng.random(40) * 3, "nll_base": rng.random(40) * 3, "kld": rng.random(40) * 0.1,
            "same_top1": (rng.random(40) > 0.2).astype(float), "p_q": rng.random(40), "p_base": rng.random(40)}
    s = kld.summarize(**vals)
    k = vals["kld"]
    assert s["kld_mean_err"] == pytest.approx(math.sqrt(k.var() / 39))
    d = vals["nll_q"] - vals["nll_base"]
    assert s["ln_ppl_ratio_err"] == pytest.approx(math.sqrt(d.var() / 39))
    assert s["ln_ppl_correlation"] == pytest.approx(np.corrcoef(vals["nll_q"], vals["nll_base"])[0, 1])
    dp2 = (vals["p_q"] - vals["p_base"]) ** 2
    assert s["rms_dp_pct_err"] == pytest.approx(100 * 0.5 * math.sqrt(dp2.var() / 39) / math.sqrt(dp2.mean()))
    assert s["kld_p95"] == pytest.approx(np.percentile(k, 95))


def test_kld_is_invariant_to_a_logit_shift_and_matches_the_definition():
    rng = np.random.default_rng(3)
    base, q = rng.standard_normal((8, 30)), rng.standard_normal((8, 30))
    tok = rng.integers(0, 30, 8)
    a, b = kld.Accumulator(), kld.Accumulator()
    a.add(base, q, tok)
    b.add(base + 7.0, q - 3.0, tok)  # softmax does not see a constant
    va, vb = a.values(), b.values()
    assert np.allclose(va["kld"], vb["kld"]) and np.allclose(va["nll_q"], vb["nll_q"])
    pb = np.exp(base) / np.exp(base).sum(-1, keepdims=True)
    pq = np.exp(q) / np.exp(q).sum(-1, keepdims=True)
    assert np.allclose(va["kld"], (pb * np.log(pb / pq)).sum(-1))
    assert (va["kld"] > 0).all()


def test_a_huge_vocabulary_row_does_not_overflow():
    base = np.zeros((1, 262144))
    base[0, 5] = 1000.0  # exp(1000) overflows without the max subtraction
    q = base.copy()
    q[0, 6] = 999.0
    acc = kld.Accumulator()
    acc.add(base, q, [5])
    s = acc.summary()
    assert math.isfinite(s["kld_mean"]) and s["kld_mean"] > 0 and math.isfinite(s["ppl"])


def test_windows_and_scored_positions_follow_llama_perplexity():
    ids = list(range(100, 120))  # 20 tokens
    w = kld.windows(ids, 8, bos_id=1)
    # consecutive chunks of 8, the first token of each replaced by BOS (llama-perplexity); the tail of 4 dropped
    assert w == [[1, *range(101, 108)], [1, *range(109, 116)]]
    assert kld.windows(ids, 8, bos_id=None) == [list(range(100, 108)), list(range(108, 116))]
    assert kld.windows(ids, 8, bos_id=1, max_windows=1) == [w[0]]
    # the second half: positions 4..6 of an 8-token window predict tokens 5..7 (n_ctx - n_ctx//2 - 1 of them)
    assert list(kld.scored_positions(8)) == [4, 5, 6]
    with pytest.raises(ValueError, match="at least 4"):
        kld.windows(ids, 3, bos_id=None)


def test_refuses_mismatched_inputs():
    acc = kld.Accumulator()
    with pytest.raises(ValueError, match="equal"):
        acc.add(np.zeros((2, 3)), np.zeros((2, 4)), [0, 1])
    with pytest.raises(ValueError, match="next tokens"):
        acc.add(np.zeros((2, 3)), np.zeros((2, 3)), [0])
    with pytest.raises(ValueError, match="no scored tokens"):
        acc.summary()
