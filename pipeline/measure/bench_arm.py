"""One benchmark pass of one arm, in a process of its own.

    python -m pipeline.measure.bench_arm --arm onnx_fp32 --artifact DIR --prompt-length 32 \
        --decode-tokens 64 --warmup-tokens 4 --threads 2 --context-points 32,128

A fresh process per pass, because peak RSS and resident pages are per process
(arms measured in one process would share, and hide, each other's memory),
and because a cold start is only cold once. Prints one JSON line.

Figures: load seconds (imports excluded, cold start includes them), warm start
(a second load in the same process, after the first was dropped: imports done,
files in the page cache), time to first token, prefill and decode tokens/s at
the explicit prompt length (the headline), decode tokens/s after prefilling to
each context point, peak RSS (VmHWM, taken before the warm reload) and
resident memory (Rss from /proc/self/smaps_rollup: resident, not allocated) by
component: before load, after load, after the run, and the resident pages of
the artifact's own weight files where they are mapped. `kv_bytes` is the KV
the arm actually holds after the headline run (ONNX: the preallocated cache
arrays; eager: the DynamicCache tensors; llama.cpp: its f16 cache of n_ctx).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

from pipeline.runtimes.open import KINDS as ARMS, LLAMA_ARMS, open_runtime
from edgekiln_runtime.pages import smaps_rollup_mib

T_PROCESS = time.perf_counter()
MIB = 1024 * 1024
WEIGHT_SUFFIXES = (".onnx", ".onnx.data", ".safetensors", ".gguf", ".bin")


def memory_snapshot() -> dict[str, float]:
    r = smaps_rollup_mib()
    rss = r.get("Rss", float("nan"))
    anon = r.get("Anonymous", float("nan"))
    return {"rss_mib": rss, "anon_mib": anon, "file_mib": rss - anon,
            "anon_huge_mib": r.get("AnonHugePages", float("nan"))}


def mapped_resident_mib(paths: list[Path]) -> float:
    """Resident pages of mappings of these files (from /proc/self/smaps).

    A runtime that mmaps its weights shows them here; one that reads them into
    its own buffers shows 0 (the weights are then in anonymous memory).
    """
    names = {str(p.resolve()) for p in paths}
    total_kb, current = 0, False
    try:
        for line in open("/proc/self/smaps"):
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and not head[0].endswith(":"):
                current = len(head) >= 6 and head[5] in names
            elif current and head[0] == "Rss:":
                total_kb += int(head[1])
    except OSError:
        return float("nan")
    return total_kb / 1024


def _components(before: dict, after: dict, mapped: float, kv: float) -> dict[str, float]:
    runtime = before["rss_mib"]
    allocated = after["anon_mib"] - before["anon_mib"] - kv
    return {"runtime_mib": runtime, "allocated_mib": allocated, "kv_held_mib": kv,
            "other_mib": after["rss_mib"] - runtime - mapped - allocated - kv}


def weight_files(artifact: str) -> list[Path]:
    p = Path(artifact)
    if p.is_file():
        return [p]
    return sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def peak_rss_mib() -> float:
    """This process's own peak resident set (VmHWM). Not ru_maxrss: that survives fork and exec, so
    every arm started from the benchmark stage reported the stage's own peak (1261 MiB for every arm
    on Gemma 3 270M) wherever it was the larger."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024






def import_runtime(arm: str) -> None:
    """Import the arm's runtime libraries before the clock and the first memory
    snapshot: load_s then excludes imports (cold_start_s includes them), and the
    resident memory before load is interpreter + libraries, the load delta weights
    + session."""
    import numpy  # noqa: F401

    if arm in ("onnx_fp32", "ort_int4"):
        import onnxruntime  # noqa: F401
    elif arm in LLAMA_ARMS:
        import llama_cpp  # noqa: F401
    elif arm in ("ortgenai_int4", "ort_int4_genai"):
        import onnxruntime_genai  # noqa: F401
    else:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401  (lazy module: resolve it now)


def _run(dec, ids, decode_tokens: int) -> tuple[float, float]:
    """Prefill `ids` then decode greedily; (prefill seconds, decode seconds)."""
    dec.reset()
    t0 = time.perf_counter()
    logits = dec.prefill(ids)
    t1 = time.perf_counter()
    dec.decode_greedy(decode_tokens, logits)  # the runtime's own loop where it has one (onnxruntime-genai)
    return t1 - t0, time.perf_counter() - t1


def measure(arm: str, artifact: str, prompt_length: int, decode_tokens: int, warmup: int, threads: int, seed: int,
            context_points: list[int] | None = None, context_decode_tokens: int = 32, n_ctx: int = 0) -> dict:
    import numpy as np

    from edgekiln_runtime import pages

    context_points = list(context_points or [])
    import_runtime(arm)
    mem_before = memory_snapshot()
    t_imports = time.perf_counter()
    dec = open_runtime(arm, artifact, threads, n_ctx)
    t_loaded = time.perf_counter()
    mem_loaded = memory_snapshot()
    vocab = dec.vocab_size
    # Speed does not depend on which tokens: a seeded, valid, explicit-length prompt.
    longest = max([prompt_length, *context_points])
    prompt = np.random.default_rng(seed).integers(4, vocab, size=longest).tolist()

    if warmup:
        dec.reset()
        for t in prompt[:warmup]:
            dec.step(t)
    t_prefill, t_decode = _run(dec, prompt[:prompt_length], decode_tokens)
    kv = dec.kv_bytes()
    mem_run = memory_snapshot()
    files = weight_files(artifact)
    mapped = mapped_resident_mib(files)
    context = []
    for point in context_points:
        tp, td = _run(dec, prompt[:point], context_decode_tokens)
        context.append({"context": point, "prefill_tok_s": point / tp, "decode_tok_s": context_decode_tokens / td,
                        "kv_bytes": dec.kv_bytes()})
    peak = peak_rss_mib()
    resident_end = dec.resident_bytes() / 2**20
    prefill_mode = "batched forward" if dec.batched_prefill else "token by token through the decode step"

    # Warm start: the same load again in this process, the first decoder dropped.
    del dec
    gc.collect()
    t_w0 = time.perf_counter()
    dec = open_runtime(arm, artifact, threads, n_ctx)
    warm = time.perf_counter() - t_w0
    del dec
    return {
        "arm": arm,
        "prefill_tok_s": prompt_length / t_prefill,
        "decode_tok_s": decode_tokens / t_decode,
        "ttft_ms": t_prefill * 1000,
        "load_s": t_loaded - t_imports,
        "cold_start_s": t_loaded - T_PROCESS,
        "warm_start_s": warm,
        "peak_rss_mib": peak,
        "resident_mib": resident_end,
        "kv_bytes": kv,
        "kv_mib": kv / MIB,
        "memory": {
            "before_load_mib": mem_before["rss_mib"],
            "after_load_mib": mem_loaded["rss_mib"],
            "after_run_mib": mem_run["rss_mib"],
            "load_delta_mib": mem_loaded["rss_mib"] - mem_before["rss_mib"],
            "run_delta_mib": mem_run["rss_mib"] - mem_loaded["rss_mib"],
            "anon_after_run_mib": mem_run["anon_mib"],
            "anon_huge_after_run_mib": mem_run["anon_huge_mib"],
            "file_after_run_mib": mem_run["file_mib"],
            "weights_file_mib": sum(f.stat().st_size for f in files) / MIB,
            "weights_mapped_resident_mib": mapped,
            # where the resident MiB go after the headline run (components sum to after_run_mib):
            # the interpreter and libraries before load; the weight files' mapped pages; the memory the
            # runtime allocated for itself (prepacked weight copies, arena, workspaces) less the KV; the KV
            # it holds; anything else (other files' pages read since)
            **_components(mem_before, mem_run, mapped, kv / MIB),
        },
        "context": context,
        "prefill_mode": prefill_mode,
        "huge_pages_asked": pages.in_use(),
        "pid": os.getpid(),
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.measure.bench_arm", description=__doc__.splitlines()[0])
    p.add_argument("--arm", required=True, choices=sorted(ARMS))
    p.add_argument("--artifact", required=True)
    p.add_argument("--prompt-length", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-points", type=_ints, default=[])
    p.add_argument("--context-decode-tokens", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=0, help="context the runtime allocates (llama.cpp)")
    a = p.parse_args(argv)
    result = measure(a.arm, a.artifact, a.prompt_length, a.decode_tokens, a.warmup_tokens, a.threads, a.seed,
                     a.context_points, a.context_decode_tokens, a.n_ctx)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
