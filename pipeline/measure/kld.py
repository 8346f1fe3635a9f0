"""Perplexity and KL-divergence statistics in llama.cpp's units (`llama-perplexity --kl-divergence`).

A quantized arm Q is compared with the base model (fp32) on the same scored
tokens: at every scored position both arms' full-vocabulary logits and the
text's next token. Per token:

- nll = -log softmax(logits)[next token], for Q and for the base;
- kld = sum_v p_base(v) * (log p_base(v) - log p_q(v)) (natural log);
- same_top1 = argmax(Q) == argmax(base);
- dp = p_q(next token) - p_base(next token).

`Accumulator.add` takes chunks of positions (a few at a time, so a 262k
vocabulary never needs more than the chunk's rows) and keeps those six floats
per token; `Accumulator.summary` returns what llama.cpp prints, with its
definitions (tools/perplexity/perplexity.cpp, `kl_divergence`, read in the
llama.cpp that llama-cpp-python 0.3.36 vendors):

- PPL = exp(mean nll), its uncertainty PPL * stderr(nll);
- mean ln(PPL(Q)/PPL(base)) = mean(nll_q) - mean(nll_base), its uncertainty
  sqrt(e_q^2 + e_base^2 - 2 cov) with cov = (mean(nll_q nll_base) -
  mean(nll_q) mean(nll_base)) / (n - 1); the ratio exp() of it; the
  correlation cov / (e_q e_base);
- KLD: mean with its uncertainty, median (the middle two averaged), the
  90/95/99/99.9th percentiles, min and max (percentiles by linear
  interpolation between sorted values: llama.cpp's `percentile` lambda,
  numpy's default);
- "same top p": the percentage of tokens whose top-1 agrees, with the binomial
  error sqrt(p (1 - p) / (n - 1));
- RMS dp: sqrt(mean dp^2), in percent, its uncertainty 0.5 / RMS x the
  uncertainty of mean dp^2; the largest |dp|.

Uncertainties are llama.cpp's `mean_and_uncertainty`: sqrt(var / (n - 1)) with
var the population variance, and 0 for 10 tokens or fewer.

One difference, on purpose: llama.cpp stores the base model's log-probabilities
in 16 bits and skips vocabulary entries below max - 16 nats in the KLD sum;
here the base is in memory in float64 and every entry counts (the difference
is below 1e-7 nats a token: e^-16 of probability mass).

Windows (`windows`): the evaluation text's token ids are cut into consecutive
chunks of `n_ctx` tokens, the first token of each replaced by BOS where the
model uses one (llama-perplexity's framing); only the second half of each
window is scored (its first tokens have too little context to say anything
about the model), so a window of n_ctx scores n_ctx - n_ctx // 2 - 1
next-token predictions.

Written by hand, and why: these are a few lines of numpy, and the point is to
speak llama.cpp's definitions exactly; neither torch nor scipy has them.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

PERCENTILES = (90.0, 95.0, 99.0, 99.9)
DISTRIBUTION = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 100)  # percentiles kept for the report's plot
UNCERTAIN_BELOW = 11  # llama.cpp reports an uncertainty of 0 for 10 tokens or fewer


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _mean_err(x: np.ndarray) -> tuple[float, float]:
    """(mean, uncertainty) as llama.cpp's mean_and_uncertainty: sqrt(var / (n - 1)), 0 for n <= 10."""
    n = x.size
    if n == 0:
        return 0.0, 0.0
    mean = float(x.mean())
    var = float((x * x).mean() - mean * mean)
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n >= UNCERTAIN_BELOW else 0.0


class Accumulator:
    """Per-token statistics of one arm against the base, fed a chunk of positions at a time."""

    def __init__(self):
        self._parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                                     ("nll_q", "nll_base", "kld", "same_top1", "p_q", "p_base")}

    def add(self, base_logits, q_logits, next_tokens) -> None:
        """`base_logits`, `q_logits`: [n, vocab]; `next_tokens`: [n] (the token that followed each position)."""
        lb, lq = log_softmax(base_logits), log_softmax(q_logits)
        if lb.shape != lq.shape or lb.ndim != 2:
            raise ValueError(f"logits shapes {lb.shape} and {lq.shape}: expected two equal [n, vocab]")
        tok = np.asarray(next_tokens, dtype=np.int64).reshape(-1)
        if tok.size != lb.shape[0]:
            raise ValueError(f"{tok.size} next tokens for {lb.shape[0]} positions")
        rows = np.arange(tok.size)
        pb = np.exp(lb)
        self._parts["kld"].append((pb * (lb - lq)).sum(-1))
        self._parts["nll_base"].append(-lb[rows, tok])
        self._parts["nll_q"].append(-lq[rows, tok])
        self._parts["same_top1"].append((lb.argmax(-1) == lq.argmax(-1)).astype(np.float64))
        self._parts["p_base"].append(pb[rows, tok])
        self._parts["p_q"].append(np.exp(lq[rows, tok]))

    def values(self) -> dict[str, np.ndarray]:
        return {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in self._parts.items()}

    @property
    def tokens(self) -> int:
        return int(sum(a.size for a in self._parts["kld"]))

    def summary(self) -> dict:
        return summarize(**self.values())


def summarize(nll_q, nll_base, kld, same_top1, p_q, p_base) -> dict:
    """llama.cpp's KL-divergence report from the per-token values (module docstring)."""
    nll_q, nll_base, kld = (np.asarray(a, dtype=np.float64) for a in (nll_q, nll_base, kld))
    same, p_q, p_base = (np.asarray(a, dtype=np.float64) for a in (same_top1, p_q, p_base))
    n = int(kld.size)
    if n == 0:
        raise ValueError("no scored tokens")
    mq, eq = _mean_err(nll_q)
    mb, eb = _mean_err(nll_base)
    cov = float((nll_q * nll_base).mean() - mq * mb) / (n - 1) if n >= 10 else 0.0
    ratio = mq - mb
    ratio_err = math.sqrt(max(eq * eq + eb * eb - 2 * cov, 0.0))
    kmean, kerr = _mean_err(kld)
    top = float(same.mean())
    dp = p_q - p_base
    dp2, dp2_err = _mean_err(dp * dp)
    rms = math.sqrt(dp2)
    cor = cov / (eq * eb) if eq > 0 and eb > 0 else math.nan
    return {
        "tokens": n,
        "ppl": math.exp(mq), "ppl_err": math.exp(mq) * eq,
        "ppl_base": math.exp(mb), "ppl_base_err": math.exp(mb) * eb,
        "ln_ppl_ratio": ratio, "ln_ppl_ratio_err": ratio_err,
        "ppl_ratio": math.exp(ratio), "ppl_ratio_err": math.exp(ratio) * ratio_err,
        "ln_ppl_correlation": cor,
        "kld_mean": kmean, "kld_mean_err": kerr,
        "kld_median": float(np.median(kld)),
        **{f"kld_p{_pct(p)}": float(np.percentile(kld, p)) for p in PERCENTILES},
        "kld_min": float(kld.min()), "kld_max": float(kld.max()),
        "same_top1_pct": 100.0 * top,
        "same_top1_pct_err": 100.0 * math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0,
        "dp_mean_pct": 100.0 * float(dp.mean()),
        "dp_max_abs_pct": 100.0 * float(np.abs(dp).max()),
        "rms_dp_pct": 100.0 * rms,
        "rms_dp_pct_err": 100.0 * 0.5 * dp2_err / rms if rms > 0 else 0.0,
        # the distribution, for the report's plot: percent -> KLD at that percentile
        "kld_distribution": {f"{q:g}": float(np.percentile(kld, q)) for q in DISTRIBUTION},
    }


def _pct(p: float) -> str:
    """99.9 -> "99_9", 90.0 -> "90" (a JSON / DVC metric key)."""
    return f"{p:g}".replace(".", "_")


def windows(ids: Sequence[int], n_ctx: int, bos_id: int | None, max_windows: int | None = None) -> list[list[int]]:
    """The evaluation text cut into llama-perplexity's chunks: consecutive runs of `n_ctx` tokens, the first
    of each replaced by BOS where the model uses one (`bos_id` not None); at most `max_windows`; a shorter
    tail is dropped."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx={n_ctx}: a window needs at least 4 tokens")
    out = []
    for start in range(0, len(ids) - n_ctx + 1, n_ctx):
        w = [int(t) for t in ids[start:start + n_ctx]]
        if bos_id is not None:
            w[0] = int(bos_id)
        out.append(w)
        if max_windows is not None and len(out) >= max_windows:
            break
    return out


def heldout_windows(src, tokenizer, calibration: Sequence[int], n_ctx: int, bos_id: int | None,
                    n: int) -> tuple[list[list[int]], dict]:
    """The first `n` windows (`windows`) of the embedded corpus's held-out tail (textdata.heldout) that
    share no textdata.OVERLAP_TOKENS-token run with the `calibration` ids, and facts to record. The tail
    holds the calibration windows too (calibrate cuts them from it): those are skipped. Fewer than `n`
    is the caller's to refuse."""
    from pipeline.sources import textdata

    stream_ids, facts = textdata.heldout(src, tokenizer)
    candidates = windows(stream_ids, n_ctx, bos_id)
    shared = textdata.overlaps(candidates, calibration)
    return [w for w, hit in zip(candidates, shared) if hit == 0][:n], facts


def scored_positions(n_ctx: int) -> range:
    """The positions of a window whose next-token prediction is scored: the second half (llama.cpp's
    `first = n_ctx / 2`), each predicting the token after it."""
    return range(n_ctx // 2, n_ctx - 1)


def scored_logits(dec, window: Sequence[int], advance=None) -> np.ndarray:
    """`dec`'s logits at `window`'s scored positions, one float32 row each: the window up to the first
    scored position prefilled in one call (a decoder without a prompt graph steps through it), then a
    step a token. `advance(n)` is told of each row."""
    pos = scored_positions(len(window))
    dec.reset()
    rows = [np.asarray(dec.prefill(list(window[:pos.start + 1])), dtype=np.float32)]
    if advance is not None:
        advance(1)
    for j in pos[1:]:
        rows.append(np.asarray(dec.step(int(window[j])), dtype=np.float32))
        if advance is not None:
            advance(1)
    return np.stack(rows)


# parity.artifact.<path>'s floors in this module's units: (the figure, its direction, how to read it off a
# summary). KL is the mean per-token KLD (the same quantity verify_parity calls kl_nats); greedy match needs
# free decoding, not windows: not here.
FLOORS = {
    "min_logits_snr_db": ("logits_snr_db", ">=", lambda s: s["logits_snr_db"]),
    "min_top1_agreement": ("same_top1", ">=", lambda s: s["same_top1_pct"] / 100.0),
    "max_kl_nats": ("kl_nats", "<=", lambda s: s["kld_mean"]),
    "max_kld_mean": ("kld_mean", "<=", lambda s: s["kld_mean"]),
    "max_kld_p99": ("kld_p99", "<=", lambda s: s["kld_p99"]),
    "max_ppl_ratio": ("ppl_ratio", "<=", lambda s: s["ppl_ratio"]),
}


def below_floors(summary: dict, limits) -> list[str]:
    """Which of `limits` (a parity.artifact.<path> mapping; a null limit is not checked) `summary` (this
    module's summary, with `logits_snr_db` beside it) misses, each as 'figure value (needs op limit)'."""
    missed = []
    for key, (name, op, read) in FLOORS.items():
        limit = limits.get(key) if hasattr(limits, "get") else None
        if limit is None:
            continue
        value, limit = float(read(summary)), float(limit)
        if not (value >= limit if op == ">=" else value <= limit):
            missed.append(f"{name} {value:.4g} (needs {op} {limit:g})")
    return missed
