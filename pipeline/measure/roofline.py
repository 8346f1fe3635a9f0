"""The roofline column: bytes read per decoded token x tokens/s against the host's read bandwidth.

    python -m pipeline.measure.roofline --threads 2 [--mib 1024] [--passes 5]   # one JSON line

Decode at batch 1 reads every weight once a token and the KV cache once a
token; at 1-2B both llama.cpp and this project's artifact sit near the
memory-bandwidth limit (docs/large-models.md), so how close an arm is to that
limit says what is left to gain. The host's figure is a read of a buffer far
larger than the last-level cache, split over the benchmark's threads, in a
process of its own like every arm (its gigabyte stays out of the stage's own
peak). Written by hand: no library of the toolchain measures read bandwidth
(STREAM is C and measures copy/triad, not a read); numpy's sum releases the
GIL, so `threads` threads each read their share at once.

Bytes per token per arm (stages/benchmark.py `roofline`): the arm's weight
files (an upper bound: an untied embedding table is read one row a token),
plus the KV read at the mean position of the timed decode
(pipeline/sources/kv_budget.py `kv_read_bytes`), in the arm's own KV dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# The KV cache's width per arm, bytes an entry: what each runtime holds (the artifact's own is io.json's).
KV_BYTES = {"ort_int4": 2, "ort_int4_genai": 2, "llamacpp_q4_k_m": 2, "llamacpp_q4_0": 2, "gguf_q4_0": 2,
            "ortgenai_int4": 4, "onnx_fp32": 4, "torch_eager_fp32": 4, "tinygemm_w4a16": 2, "vllm_gptq": 2}


def read_bandwidth(threads: int, mib: int = 1024, passes: int = 5) -> list[float]:
    """GB/s (1e9 bytes) of each timed pass reading a `mib` MiB float32 buffer with `threads` threads,
    after one untimed pass (the pages touched, the threads started)."""
    import numpy as np

    buf = np.ones(mib * 1024 * 1024 // 4, dtype=np.float32)
    parts = np.array_split(buf, threads)
    out = []
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))
        for _ in range(passes):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            out.append(buf.nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def arm_roofline(weights_mb: float | None, kv_bytes: int, tok_s: float, host_gb_s: float) -> dict | None:
    """{mb_per_token, gb_s, of_host}: what one decoded token reads, at the arm's speed, against the host."""
    if weights_mb is None or not tok_s:
        return None
    mb = weights_mb + kv_bytes / 1e6
    gb_s = mb * tok_s / 1e3
    return {"mb_per_token": round(mb, 1), "gb_s": round(gb_s, 2), "of_host": round(gb_s / host_gb_s, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--passes", type=int, default=5)
    a = ap.parse_args(argv)
    print(json.dumps({"threads": a.threads, "mib": a.mib, "gb_s": read_bandwidth(a.threads, a.mib, a.passes)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
