"""Everything that runs a built artifact, behind one contract (pipeline/runtimes/contract.py):
the fp32 ONNX step and the GQA graph on ONNX Runtime, eager PyTorch (the reference), tinygemm,
llama.cpp, onnxruntime-genai and the QNN HTP binary; plus what a runtime needs sized (huge pages;
the KV planner is pipeline/sources/kv_budget.py, which compose time reads too) and `generate`, which streams text from any of them."""
