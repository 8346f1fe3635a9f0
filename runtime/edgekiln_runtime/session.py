"""ONNX Runtime session options for one decode stream (GqaDecoder's, and the project's OnnxDecoder's)."""

from __future__ import annotations


def session_options(threads: int, *, spinning: bool | None = None, opt_level: str = "all",
                    profile: str | None = None, config: dict | None = None):
    """ONNX Runtime session options for one decode stream, as both decoders run it:
    `threads` intra-op, one inter-op thread, sequential execution."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt_level]
    if spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    for key, value in (config or {}).items():
        so.add_session_config_entry(str(key), str(value))
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return so
