"""Quantizers and weight formats: GPTQ (gptq, layerwise calibration), the 8-bit
sensitivity pass (bit_alloc), packed int4 layouts, GGUF Q4 files, and which weight path a
device takes (weight_path). Imports pipeline.sources, pipeline.engine.context and
llama.cpp's converter (pipeline.toolchains.llamacpp) for the GGUF files."""
