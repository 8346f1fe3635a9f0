"""A runtime for a kind of artifact, by name (the benchmark's arms, `generate`'s builds)."""

from __future__ import annotations

from pathlib import Path

from pipeline.runtimes.contract import Runtime


# The kinds of runtime, by the name the benchmark's arms and `generate` use, and what each runs.
KINDS = {
    "onnx_fp32": "ONNX Runtime, the exported fp32 decode step",
    "torch_eager_fp32": "PyTorch eager fp32, the Hugging Face model (baseline)",
    "ort_int4": "ONNX Runtime, GroupQueryAttention + MatMulNBits 4-bit graph, IO-bound KV (packed artifact)",
    "tinygemm_w4a16": "PyTorch eager with tinygemm int4 linears, bf16 activations (packed artifact)",
    "llamacpp_q4_k_m": "llama.cpp Q4_K_M through llama-cpp-python, GGUF from its bundled converter (baseline)",
    "llamacpp_q4_0": "llama.cpp's own Q4_0 (round to nearest) through llama-cpp-python (baseline)",
    "gguf_q4_0": "llama.cpp through llama-cpp-python, our GPTQ weights as GGUF Q4_0 (packed artifact)",
    "ort_int4_genai": "the packed artifact's folder as it is, decoded by onnxruntime-genai's own generator loop "
                      "(the deploy profile's onnxruntime-genai route; packed artifact, second runtime)",
    "ortgenai_int4": "onnxruntime-genai int4 from its own model builder (round-to-nearest, block 32, "
                     "GroupQueryAttention), decoded by its own generator loop (baseline)",
}


LLAMA_ARMS = ("llamacpp_q4_k_m", "llamacpp_q4_0", "gguf_q4_0")


def open_runtime(arm: str, artifact: str, threads: int, n_ctx: int = 0, session: dict | None = None) -> Runtime:
    """The runtime of one kind of artifact (one of KINDS);
    `session`: GqaDecoder settings (spinning, huge pages) from a deploy profile."""
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.runtimes.reference import TorchReference

    if arm == "ort_int4":
        from edgekiln_runtime.gqa import GqaDecoder

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
    if arm in ("ortgenai_int4", "ort_int4_genai"):
        from pipeline.runtimes.ortgenai import GenaiDecoder

        return GenaiDecoder(artifact, threads=threads, n_ctx=n_ctx)
    raise SystemExit(f"unknown runtime {arm!r}: one of {', '.join(KINDS)}")
