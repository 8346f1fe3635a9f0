"""One benchmark pass of one arm, in a process of its own.

    python -m pipeline.bench_arm --arm onnx_fp32 --artifact DIR --prompt-length 32 \
        --decode-tokens 64 --warmup-tokens 4 --threads 2

A fresh process per pass, because peak RSS and resident pages are per process
(arms measured in one process would share, and hide, each other's memory),
and because a cold start is only cold once. Prints one JSON line.

Figures: load seconds (imports excluded, cold start includes them), time to
first token, prefill and decode tokens/s, peak RSS (ru_maxrss) and resident
memory at the end (Rss from /proc/self/smaps_rollup: resident, not allocated).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

T_PROCESS = time.perf_counter()


def resident_mib() -> float:
    """Resident set from smaps_rollup: pages actually in memory now."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Rss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


ARMS = {
    "onnx_fp32": "ONNX Runtime, the exported fp32 decode step",
    "torch_eager_fp32": "PyTorch eager fp32, the Hugging Face model (baseline)",
    "ort_int4": "ONNX Runtime, the decode step with MatMulNBits 4-bit weights (packed artifact)",
    "tinygemm_w4a16": "PyTorch eager with tinygemm int4 linears, bf16 activations (packed artifact)",
}


def make_decoder(arm: str, artifact: str, threads: int):
    from pipeline.decode_graph import OnnxDecoder, TorchReference

    if arm in ("onnx_fp32", "ort_int4"):
        return OnnxDecoder(artifact, threads=threads)
    if arm == "torch_eager_fp32":
        return TorchReference(artifact, threads=threads)
    if arm == "tinygemm_w4a16":
        from pipeline.int4_runtime import load_tinygemm_model

        return TorchReference(load_tinygemm_model(artifact, artifact), threads=threads)
    raise SystemExit(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")


def measure(arm: str, artifact: str, prompt_length: int, decode_tokens: int, warmup: int, threads: int, seed: int) -> dict:
    import numpy as np

    t_imports = time.perf_counter()
    dec = make_decoder(arm, artifact, threads)
    t_loaded = time.perf_counter()
    vocab = dec.vocab_size
    # Speed does not depend on which tokens: a seeded, valid, explicit-length prompt.
    prompt = np.random.default_rng(seed).integers(4, vocab, size=prompt_length).tolist()

    if warmup:
        dec.reset()
        for t in prompt[:warmup]:
            dec.step(t)
    dec.reset()
    t0 = time.perf_counter()
    logits = None
    if hasattr(dec, "prefill"):
        logits = dec.prefill(prompt)
    else:
        for t in prompt:
            logits = dec.step(t)
    t1 = time.perf_counter()
    token = int(np.argmax(logits))
    for _ in range(decode_tokens):
        token = int(np.argmax(dec.step(token)))
    t2 = time.perf_counter()
    return {
        "arm": arm,
        "prefill_tok_s": prompt_length / (t1 - t0),
        "decode_tok_s": decode_tokens / (t2 - t1),
        "ttft_ms": (t1 - t0) * 1000,
        "load_s": t_loaded - t_imports,
        "cold_start_s": t_loaded - T_PROCESS,
        "peak_rss_mib": peak_rss_mib(),
        "resident_mib": resident_mib(),
        "prefill_mode": "batched forward" if hasattr(dec, "prefill") else "token by token through the decode step",
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.bench_arm", description=__doc__.splitlines()[0])
    p.add_argument("--arm", required=True, choices=sorted(ARMS))
    p.add_argument("--artifact", required=True)
    p.add_argument("--prompt-length", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    result = measure(a.arm, a.artifact, a.prompt_length, a.decode_tokens, a.warmup_tokens, a.threads, a.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
