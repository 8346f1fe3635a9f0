"""Everything that runs a built artifact, behind one contract (pipeline/runtimes/contract.py):
the fp32 ONNX step on ONNX Runtime, eager PyTorch (the reference), tinygemm, llama.cpp,
onnxruntime-genai and the QNN HTP binary; Genie's bundle; and `generate`, which streams text from any
of them. The GQA graph's runtime (GqaDecoder), the contract's base class and huge pages live in the
device-side package, runtime/edgekiln_runtime, which installs without the build toolchain."""
