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
files less the tables a token reads one row of (`read_per_token_mb`: an ONNX
initializer only ever gathered, a GGUF's `token_embd` where the file has its
own `output` head; a tied table is the head's and is read whole), plus the KV
read at the mean position of the timed decode
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


# Where a lookup reads one row of its table: the data input of Gather, and of GatherBlockQuantized its codes,
# scales and zero points (com.microsoft's contrib op, inputs 0, 2, 3).
_GATHERED = {("Gather", 0), ("GatherBlockQuantized", 0), ("GatherBlockQuantized", 2), ("GatherBlockQuantized", 3)}


def _initializer_bytes(t) -> int:
    import math

    from onnx import TensorProto, helper

    ext = {e.key: e.value for e in t.external_data}
    if "length" in ext:
        return int(ext["length"])
    if t.raw_data:
        return len(t.raw_data)
    n = math.prod(int(d) for d in t.dims)
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4):  # two a byte
        return (n + 1) // 2
    return n * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def gathered_only_bytes(path) -> int:
    """Bytes of the tables in an arm's weights that a decoded token reads one row of: in an ONNX graph
    (every model.onnx under a folder), initializers whose every use is a lookup's table (_GATHERED); in a
    GGUF, `token_embd.weight` where an `output.weight` head of its own is there (else the table is tied, the
    head's, and read whole). Read from the graph's structure (onnx, external data not loaded) and the GGUF's
    tensor index (the gguf package), never from names guessed per arm."""
    from pathlib import Path

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader

        sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
        return sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
    if not path.is_dir():
        return 0
    import onnx

    total = 0
    for f in sorted(path.rglob("*.onnx")):
        g = onnx.load(str(f), load_external_data=False).graph
        uses: dict[str, set] = {}
        for node in g.node:
            for i, name in enumerate(node.input):
                uses.setdefault(name, set()).add((node.op_type, i))
        total += sum(_initializer_bytes(t) for t in g.initializer
                     if uses.get(t.name) and uses[t.name] <= _GATHERED)
    return total


def read_per_token_mb(path, weights_mb: float | None) -> float | None:
    """MB of an arm's weight files (`weights_mb`, stages/benchmark.py) that one decoded token reads: all of
    them but the tables it reads one row of (gathered_only_bytes; the row itself is left out, < 0.01 MB)."""
    if weights_mb is None:
        return None
    return round(max(weights_mb - gathered_only_bytes(path) / 1e6, 0.0), 1)


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
