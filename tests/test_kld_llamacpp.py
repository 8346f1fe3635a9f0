"""pipeline/measure/kld.py against llama.cpp's own `llama-perplexity --kl-divergence` on the same text and windows.

A tiny random Llama checkpoint (SentencePiece tokenizer), converted by llama.cpp's converter to an f32 GGUF
(the base) and quantized by llama.cpp to Q4_0 (the arm). llama-perplexity computes its statistics over the
first CHUNKS chunks of N_CTX tokens of a text; here the same text is tokenized by llama.cpp (llama-cpp-python),
cut by kld.windows, both files are run through llama-cpp-python a token at a time, and kld.Accumulator
computes the statistics. They must agree within what separates the two runs:
- llama-perplexity evaluates each chunk as one batch, llama-cpp-python here a token at a time: the CPU
  kernels sum in another order (and round activations to Q8_0 in other blocks), so logits differ in their
  last bits;
- llama-perplexity stores the base log-probabilities in 16 bits (a step of 16/65535 nats near the top) and
  skips vocabulary entries 16 nats below the maximum.
Seen (the head sharpened so that Q4_0's damage is measurable): PPL(base) 3994.315 against 3994.371, PPL(Q)
3970.07 against 3965.84 (the Q4_0 kernels batched and stepped), mean KLD 0.025159 against 0.025139, median
0.02391 / 0.02422, p90 0.03708 / 0.03741, same top-1 80.65% both, RMS dp 0.074 / 0.076 points. Tolerances:
PPL(base) 0.01%, PPL(Q) 0.3%, mean KLD 1%, the median and 90th percentile 3%, same top-1 within one token of
the scored ones, RMS dp 0.01 points.

Needs the converter, llama-cpp-python and the llama-perplexity binary ($EDGEKILN_LLAMA_PERPLEXITY or on
PATH; benchmarks/build_llama_perplexity.sh builds it from the llama.cpp llama-cpp-python vendors); skipped
with the reason otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.measure import kld
from pipeline.toolchains import llamacpp
from pipeline.runtimes.llamacpp import LlamaCppDecoder

N_CTX, CHUNKS = 64, 4


@pytest.mark.optional
def test_our_statistics_are_llama_perplexitys(tmp_path):
    from pipeline.toolchains import converter

    tool = llamacpp.perplexity_tool()
    if tool is None:
        pytest.skip(f"llama-perplexity not found (set ${llamacpp.PERPLEXITY_ENV} or put it on PATH; "
                    "benchmarks/build_llama_perplexity.sh builds it)")
    ok, reason = llamacpp.available()
    if not ok:
        pytest.skip(reason)
    if converter.find() is None:
        pytest.skip(converter.missing_message())
    from tests.test_gguf_q4 import _tiny, _tokenizer

    hf = _tiny("llama", tmp_path / "hf", _tokenizer(tmp_path), seed=4)
    _sharpen(hf)
    base = llamacpp.convert(hf, tmp_path / "base-f32.gguf", outtype="f32", src=str(converter.find()))
    q = llamacpp.quantize(base, tmp_path / "q4_0.gguf", ftype=llamacpp.Q4_0)
    import argparse
    import collections
    import json
    import textwrap

    text = "\n\n".join(m.__doc__ for m in (argparse, collections, json, textwrap) if m.__doc__)
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)

    theirs = llamacpp.perplexity_kld(tool, base, q, text_file, N_CTX, CHUNKS, tmp_path)

    import llama_cpp

    vocab_llm = llama_cpp.Llama(model_path=str(base), n_ctx=N_CTX, vocab_only=True, verbose=False)
    ids = vocab_llm.tokenize(text.encode(), add_bos=True)
    bos = vocab_llm.token_bos() if ids and ids[0] == vocab_llm.token_bos() else None
    windows = kld.windows(ids, N_CTX, bos, max_windows=CHUNKS)
    assert len(windows) == CHUNKS
    rows = {}
    for name, path in (("base", base), ("q", q)):
        dec = LlamaCppDecoder(str(path), threads=1, n_ctx=N_CTX)
        rows[name] = []
        for w in windows:
            dec.reset()
            rows[name].append(np.stack([dec.step(t) for t in w[:-1]]))
    acc = kld.Accumulator()
    pos = kld.scored_positions(N_CTX)
    for w, b, o in zip(windows, rows["base"], rows["q"]):
        acc.add(b[pos.start:pos.stop], o[pos.start:pos.stop], w[pos.start + 1:pos.stop + 1])
    ours = acc.summary()

    assert ours["tokens"] == CHUNKS * (N_CTX - 1 - N_CTX // 2)
    assert ours["ppl_base"] == pytest.approx(theirs["ppl_base"], rel=1e-4)  # f32: the same logits to ~1e-5
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=3e-3)  # Q4_0: batched vs stepped, ~1e-3 seen
    assert ours["kld_mean"] == pytest.approx(theirs["kld_mean"], rel=0.01)
    for k in ("kld_median", "kld_p90"):
        assert ours[k] == pytest.approx(theirs[k], rel=0.03), k
    assert abs(ours["same_top1_pct"] - theirs["same_top1_pct"]) <= 100.0 / ours["tokens"] + 1e-9
    assert ours["rms_dp_pct"] == pytest.approx(theirs["rms_dp_pct"], abs=0.01)
    assert ours["kld_mean"] > 5e-3  # the arm differs from its base: the agreement is not 0 == 0


def _sharpen(hf):
    """A random tiny model's logits are nearly flat (PPL ~ its vocabulary), so any two builds agree to
    1e-4 nats; a head 12x larger makes them peaked and Q4_0's damage measurable (mean KLD ~1e-2)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.save_pretrained(hf)


def test_the_report_parser_reads_llama_perplexitys_summary():
    text = """====== Perplexity statistics ======
Mean PPL(Q)                   :   2.107592 ±   0.225714
Mean PPL(base)                :   2.100000 ±   0.220000
Cor(ln(PPL(Q)), ln(PPL(base))):  99.50%
Mean ln(PPL(Q)/PPL(base))     :   0.003600 ±   0.001000

====== KL divergence statistics ======
Mean    KLD:   0.017475 ±   0.000763
Maximum KLD:  11.152802
99.9%   KLD:   1.098822
99.0%   KLD:   0.221226
95.0%   KLD:   0.055542
90.0%   KLD:   0.029520
Median  KLD:   0.004062
Minimum KLD:  -0.000423

====== Token probability statistics ======
RMS Δp    :  4.126 ± 0.140 %
Same top p: 93.213 ± 0.225 %
"""
    got = llamacpp.parse_kld_report(text)
    assert got["ppl"] == 2.107592 and got["ppl_err"] == 0.225714 and got["ppl_base"] == 2.1
    assert got["ln_ppl_ratio"] == 0.0036 and got["kld_mean"] == 0.017475 and got["kld_mean_err"] == 0.000763
    assert got["kld_max"] == 11.152802 and got["kld_p99_9"] == 1.098822 and got["kld_p99"] == 0.221226
    assert got["kld_median"] == 0.004062 and got["kld_min"] == -0.000423
    assert got["rms_dp_pct"] == 4.126 and got["rms_dp_pct_err"] == 0.14
    assert got["same_top1_pct"] == 93.213 and got["same_top1_pct_err"] == 0.225
