"""Graph builders: the fp32 ONNX decode step (decode_graph), the ORT GQA graph with
MatMulNBits (gqa_graph), the NPU rewrites (npu_rewrite) and the QNN QDQ/context-binary path
(qnn). Imports pipeline.sources, pipeline.quant and the runtimes that check what they build."""
