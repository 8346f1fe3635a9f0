"""A runtime for a kind of artifact, by name (the benchmark's arms, `generate`'s builds)."""

from __future__ import annotations

from pathlib import Path

from pipeline.runtimes.contract import Runtime


# The kinds of runtime, named as the benchmark's arms are.
KINDS = ("onnx_fp32", "torch_eager_fp32", "ort_int4", "tinygemm_w4a16", "llamacpp_q4_k_m", "llamacpp_q4_0",
         "gguf_q4_0", "ortgenai_int4")


LLAMA_ARMS = ("llamacpp_q4_k_m", "llamacpp_q4_0", "gguf_q4_0")


def open_runtime(arm: str, artifact: str, threads: int, n_ctx: int = 0, session: dict | None = None) -> Runtime:
    """The runtime of one kind of artifact (a benchmark arm's name, pipeline/measure/bench_arm.py ARMS);
    `session`: GqaDecoder settings (spinning, huge pages) from a deploy profile."""
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.runtimes.reference import TorchReference

    if arm == "ort_int4":
        from pipeline.runtimes.gqa import GqaDecoder

        return GqaDecoder(artifact, threads=threads, **(session or {}))
    if arm == "onnx_fp32":
        return OnnxDecoder(artifact, threads=threads)
    if arm == "torch_eager_fp32":
        return TorchReference(artifact, threads=threads)
    if arm == "tinygemm_w4a16":
        from pipeline.runtimes.tinygemm import load_tinygemm_model

        return TorchReference(load_tinygemm_model(artifact, artifact), threads=threads)
    if arm in LLAMA_ARMS:
        from pipeline.quant.gguf_q4 import GGUF_FILE
        from pipeline.runtimes.llamacpp import LlamaCppDecoder

        p = Path(artifact)
        return LlamaCppDecoder(str(p / GGUF_FILE if p.is_dir() else p), threads=threads, n_ctx=n_ctx)
    if arm == "ortgenai_int4":
        from pipeline.runtimes.ortgenai import GenaiDecoder

        return GenaiDecoder(artifact, threads=threads, n_ctx=n_ctx)
    raise SystemExit(f"unknown runtime {arm!r}: one of {', '.join(KINDS)}")
