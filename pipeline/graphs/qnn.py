"""onnxruntime-qnn: QDQ quantization for the HTP, offline context binaries, and
running them on the HTP backend of this host.

What the field notes established, and this module encodes:
- `onnxruntime-qnn` (2.x) is a plugin execution provider: it is registered
  with `register_execution_provider_library` and added per session with
  `add_provider_for_devices` (backend_path, htp_arch, soc_model). The older
  `providers=[...]` form silently runs on the CPU.
- With `ep.context_enable=1` the session writes an HTP context binary offline;
  the x86 wheel's HTP backend also executes context binaries (an emulation:
  its timings mean nothing, its numerics are the HTP's).
- A graph part QNN cannot take would fall back to the CPU EP silently:
  `session.disable_cpu_ep_fallback=1` makes that a failure, and the compiled
  model is checked to hold nothing but EPContext nodes.
- A context binary is tied to the QNN SDK it was built with: `sdk_version()`
  (read from the wheel's metadata file, never by importing it) is part of the
  compile stage's toolchain key.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

EP_NAME = "QNNExecutionProvider"
PRECISIONS = ("fp16", "w8a16", "w4a16")
INSTALL = "pip install -e '.[qnn]' (onnxruntime-qnn 2.7.0, which bundles the QNN SDK's HTP libraries)"
CONTEXT_MODEL = "model_ctx.onnx"


# ONNX Runtime's CPU EP fuses DequantizeLinear(int8 or int4 weight, per channel or per block) + MatMul
# into MatMulNBits and, at its default accuracy level (4), quantizes the MatMul's input to int8 per
# block of K: arithmetic the HTP never does (it multiplies the 16-bit activations exactly, or in fp16
# against block-quantized weights). `session.disable_quant_qdq` turns ONNX Runtime's QDQ fusions off,
# so its constant folding dequantizes each weight once into an fp32 initializer and every activation
# Q/DQ pair runs as written: the graph's arithmetic as its Q/DQ pairs say. (MatMulNBits at accuracy
# level 1 is as exact but took ~2.9 s a step on Gemma 3 270M's graph against ~0.25 s this way.)
# Measured: one MatMul whose input has an outlier channel, 39 dB with the fusion and exact without
# (tests/test_qnn.py); docs/phone-fidelity.md finding 7 for Gemma 3 270M.
CPU_QDQ_CONFIG = {"session.disable_quant_qdq": "1"}


def cpu_qdq_decoder(artifact_dir: Path, model_file: str, threads: int = 2):
    """A QDQ graph (`model_file` beside io.json) on the CPU EP: the HTP's quantization arithmetic, on this host."""
    from pipeline.runtimes.onnx import OnnxDecoder

    return OnnxDecoder(artifact_dir, model_file=model_file, threads=threads, config=CPU_QDQ_CONFIG)


class QnnError(RuntimeError):
    """The QNN toolchain is absent, or refused a graph (user-facing)."""


def missing() -> str | None:
    """Why the QNN toolchain cannot run here, or None when it can."""
    try:
        metadata.version("onnxruntime-qnn")
    except metadata.PackageNotFoundError:
        return f"onnxruntime-qnn is not installed: {INSTALL}"
    return None


def compiled_for_htp(comp_dir: Path) -> tuple[dict, dict]:
    """A compile_qnn folder's qnn.json and io.json, to run its binaries on this host's HTP backend
    (parity, benchmark); QnnError first when there is no backend to run them on."""
    reason = missing()
    if reason:
        raise QnnError(f"cannot run the context binaries on the HTP backend: {reason}")
    return json.loads((comp_dir / "qnn.json").read_text()), json.loads((comp_dir / "io.json").read_text())


def sdk_version() -> str:
    """The QNN SDK the installed onnxruntime-qnn bundles ('absent' without it)."""
    from pipeline.toolchains.toolchain import qnn_sdk_version

    return qnn_sdk_version()


def _module():
    reason = missing()
    if reason:
        raise QnnError(reason)
    import onnxruntime as ort
    import onnxruntime_qnn

    if EP_NAME not in {d.ep_name for d in ort.get_ep_devices()}:
        ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
    return ort, onnxruntime_qnn


def provider_options(target: dict, precision: str) -> dict[str, str]:
    """The QNN EP's options for an HTP target {soc_model, htp_arch, soc_id}."""
    _, q = _module()
    arch = str(target["htp_arch"]).lstrip("vV")
    # fp16 math for every float node: the whole fp16 graph, and a QDQ graph's float islands (its residual
    # stream, npu_rewrite.residual_stream); a fully quantized graph has none for it to touch.
    return {"backend_path": q.get_qnn_htp_path(), "htp_arch": arch, "soc_model": str(int(target["soc_id"])),
            "enable_htp_fp16_precision": "1"}


# The prompt graph's compile: QNN's graph finalization at its highest optimization mode (3, as Qualcomm's
# own LLM exports compile). At the default mode Gemma 3 270M's w8a16 prompt graph (128 tokens a call) fails
# to finalize with QNN_COMMON_ERROR_MEM_ALLOC, every part of it alike; at 3 it compiles (295.3 MB in 58.5 s).
PROMPT_COMPILE_OPTIONS = {"htp_graph_finalization_optimization_mode": "3"}


def session_options(target: dict, precision: str, *, context_file: Path | None = None, options: dict | None = None):
    """QNN-only session options: CPU fallback disabled; with `context_file`,
    the session writes the context binary there (a separate .bin beside it); `options`: more provider
    options (PROMPT_COMPILE_OPTIONS)."""
    ort, _ = _module()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise QnnError("onnxruntime-qnn is installed but exposes no QNN device to ONNX Runtime")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_provider_for_devices(devices, {**provider_options(target, precision), **(options or {})})
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if context_file is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(context_file))
        so.add_session_config_entry("ep.context_embed_mode", "0")
    return so


def compile_context(model: Path, out_dir: Path, target: dict, precision: str,
                    options: dict | None = None) -> dict[str, Any]:
    """Compile `model` offline into out_dir/model_ctx.onnx + its context binary (`options`: more provider
    options for the compile)."""
    ort, _ = _module()
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx_model = out_dir / CONTEXT_MODEL
    t0 = time.perf_counter()
    try:
        ort.InferenceSession(str(model), sess_options=session_options(target, precision, context_file=ctx_model,
                                                                      options=options))
    except Exception as err:  # noqa: BLE001 - ORT raises its own pybind types
        raise QnnError(f"QNN HTP ({target['soc_model']}, {target['htp_arch']}) refused the {precision} graph: "
                       f"{str(err).strip().splitlines()[-1][:400]}") from None
    seconds = time.perf_counter() - t0
    import onnx

    m = onnx.load(str(ctx_model), load_external_data=False)
    ops = sorted({n.op_type for n in m.graph.node})
    if ops != ["EPContext"]:
        raise QnnError(f"the compiled {precision} model holds {ops}, not only EPContext nodes: part of the "
                       "graph would run outside the HTP")
    bins = sorted(p.name for p in out_dir.iterdir() if p.suffix == ".bin")
    if not bins:
        raise QnnError(f"compiling the {precision} graph wrote no context binary into {out_dir}")
    return {"context_model": CONTEXT_MODEL, "binaries": bins, "compile_s": round(seconds, 3),
            "bytes": sum((out_dir / b).stat().st_size for b in bins)}


# The share of device.qnn.max_graph_bytes a part's weights may take; the rest is the context's headroom
# for activations, spill-fill and I/O (pipeline/graphs/parts.py).
PART_WEIGHT_SHARE = 0.9


def compile_parts(graph: Path, float_graph: Path, out_dir: Path, target: dict, precision: str,
                  progress=lambda _: None, options: dict | None = None,
                  ranges: list | None = None) -> dict[str, Any]:
    """Compile `graph` into context binaries under out_dir: one (out_dir/model_ctx.onnx, as compile_context)
    where its weights fit PART_WEIGHT_SHARE of the target's max_graph_bytes, else one per part cut between
    layers (out_dir/part<k>/, pipeline/graphs/parts.py; the layer boundaries found on `float_graph`, the
    graph a QDQ graph was quantized from). `ranges`: the parts' layer ranges [first, last) where the pack
    stage chose them (a mixed graph's, one precision a part), else the plan's. The facts name every part
    in order: its layers, inputs, outputs, the stream tensors it reads and writes, its binaries (relative
    to out_dir) and their bytes."""
    import shutil
    import tempfile

    import onnx

    from pipeline.graphs import parts

    budget = int(PART_WEIGHT_SHARE * int(target.get("max_graph_bytes") or 2**31))
    model = onnx.load(str(graph), load_external_data=False)
    width = 2 if precision == "fp16" else None  # the HTP holds an fp16 graph's float32 weights as fp16
    whole = parts.weight_bytes(model, width)
    if whole <= budget and not (ranges and len(ranges) > 1):
        facts = compile_context(graph, out_dir, target, precision, options)
        progress(1)
        return {**facts, "weight_bytes": whole, "budget_bytes": budget,
                "parts": [{"dir": ".", "layers": None, "stream_in": None, "stream_out": None,
                           "weight_bytes": whole, **{k: facts[k] for k in ("context_model", "binaries", "bytes",
                                                                           "compile_s")}}]}
    float_model = model if float_graph == graph else onnx.load(str(float_graph), load_external_data=False)
    try:
        bounds = parts.boundaries(model, float_model)
        if ranges and len(ranges) > 1:
            ranges = [tuple(r) for r in ranges]
            over = [r for r in ranges if parts.part_bytes(model, r[0], r[1], bounds, width) > budget]
            if over:
                raise parts.PartsError(f"the pack stage's part of layers {over[0][0]}..{over[0][1] - 1} is over it")
        else:
            ranges = parts.plan(model, budget, bounds, width)
    except parts.PartsError as err:
        raise QnnError(f"the {precision} graph ({whole / 2**20:.0f} MiB of weights) is over the HTP's per-graph "
                       f"budget ({budget / 2**20:.0f} MiB, {PART_WEIGHT_SHARE:.0%} of device.qnn.max_graph_bytes) and "
                       f"cannot be cut into parts: {err}") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".parts-", dir=out_dir) as tmp:
        parts.link_data(model, graph.parent, Path(tmp))
        cut = parts.split(model, ranges, bounds, Path(tmp), float_itemsize=width)
        del model, float_model
        done = []
        for k, part in enumerate(cut):
            facts = compile_context(Path(tmp) / part.pop("file"), out_dir / f"part{k}", target, precision, options)
            done.append({"dir": f"part{k}", **part, **facts})
            progress(1)
    return {"context_model": None, "binaries": [f"{d['dir']}/{b}" for d in done for b in d["binaries"]],
            "compile_s": round(sum(d["compile_s"] for d in done), 3), "bytes": sum(d["bytes"] for d in done),
            "weight_bytes": whole, "budget_bytes": budget, "parts": done}


def compiled_parts(entry: dict) -> list[dict]:
    """A qnn.json `compiled` entry's parts in order, each with its folder (relative to the entry's) and
    context model; a qnn.json from before parts: its one binary, in the entry's folder itself."""
    return entry.get("parts") or [{"dir": ".", "context_model": entry.get("context_model") or CONTEXT_MODEL,
                                   "layers": None}]


def open_htp(comp_dir: Path, info: dict, precision: str, prompt: bool = False):
    """A session over a compile_qnn folder's binaries of one precision on the HTP backend: the one
    binary's, or its parts' in order behind one session (parts.PartsSession); with `prompt`, its prompt
    graph's (None where that precision has none)."""
    c = info["compiled"][precision]
    if prompt:
        c = c.get("prompt")
        if c is None:
            return None
    return open_entry(comp_dir, c, info["target"], precision)


def open_entry(comp_dir: Path, entry: dict, target: dict, precision: str):
    """A session over one compiled entry's binaries (a qnn.json `compiled` entry, its prompt graph's, or
    the Genie form's, each with its `dir` relative to `comp_dir`) on the HTP backend: the one binary's, or
    its parts' in order behind one session (parts.PartsSession)."""
    from pipeline.graphs.parts import PartsSession

    ps = compiled_parts(entry)
    sessions = [htp_session(comp_dir / entry["dir"] / p["dir"] / p["context_model"], target, precision) for p in ps]
    return sessions[0] if len(sessions) == 1 else PartsSession(sessions, ps)


def htp_session(ctx_model: Path, target: dict, precision: str):
    """A session that runs a compiled context binary on the HTP backend."""
    ort, _ = _module()
    return ort.InferenceSession(str(ctx_model), sess_options=session_options(target, precision))


# --------------------------------------------------------------------------
# QDQ quantization
# --------------------------------------------------------------------------


# How a QDQ graph's MatMul weights are quantized (pack.qnn_weights).
WEIGHT_GRANULARITIES = ("per_block", "per_channel", "per_tensor")


def matmul_weights(model: Path) -> dict[str, list[int]]:
    """Every MatMul weight of `model` (a constant [K, N] second input) -> its dims, read without its data."""
    import onnx

    m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model), load_external_data=False)
    inits = {i.name: list(i.dims) for i in m.graph.initializer}
    return {n.input[1]: inits[n.input[1]] for n in m.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]]) == 2}


def check_weight_block(model, block: int) -> None:
    """QnnError unless `block` suits every MatMul weight of `model` (a path or ModelProto) for
    pack.qnn_weights=per_block: a multiple of 4 (the HTP's 8-bit block quantization) dividing each
    weight's inputs K. Checked before the calibration, not after it."""
    if block <= 0 or block % 4:
        raise QnnError(f"pack.qnn_weight_block={block}: use a positive multiple of 4 (32: GGUF's Q8_0 block)")
    misfit = {name: dims for name, dims in matmul_weights(model).items() if dims[0] % block}
    if misfit:
        name, dims = next(iter(misfit.items()))
        raise QnnError(f"pack.qnn_weight_block={block} does not divide the inputs of {len(misfit)} MatMul "
                       f"weight(s) (first: {name}, [K, N] = {dims}): pick a block dividing them, or "
                       "pack.qnn_weights=per_channel")


def weight_overrides(model: Path, precision: str, granularity: str) -> dict[str, list[dict]]:
    """ONNX Runtime `init_overrides` for the MatMul weights: symmetric signed 8- or 4-bit, one scale per
    output channel (axis 1 of the [K, N] weight) for `per_channel`; {} for `per_tensor`.

    Why: `get_qnn_qdq_config(per_channel=True)` quantizes Conv weights per channel but gives every MatMul
    weight without an override ONE scale ("QNN does not support per-channel MatMul", written for older QNN
    EPs), so a phone build's linear layers were 8-bit per tensor: on Gemma 3 270M's decoder weights that is
    30.4 dB mean (20.9 worst, a down_proj whose largest weight is 34 standard deviations out) against 41.0
    per channel, and 25.7 against 34.5 on its 262k-row head. onnxruntime-qnn 2.7.0's HTP backend compiles
    and runs per-channel MatMul weights (FullyConnected with per-axis encodings), int8 and int4 alike,
    within about a dB of the CPU EP's QDQ or above it (tests/test_qnn.py)."""
    from onnxruntime.quantization import QuantType

    if granularity not in WEIGHT_GRANULARITIES:
        raise ValueError(f"pack.qnn_weights must be one of {', '.join(WEIGHT_GRANULARITIES)}, not {granularity!r}")
    if granularity == "per_tensor":
        return {}
    qtype = QuantType.QInt8 if precision == "w8a16" else QuantType.QInt4
    return {name: [{"quant_type": qtype, "symmetric": True, "axis": 1}] for name in matmul_weights(model)}


def weight_scales(model: Path) -> dict[str, int]:
    """Each quantized MatMul weight of a QDQ graph -> how many scales its DequantizeLinear carries."""
    import onnx

    m = onnx.load(str(model), load_external_data=False)
    inits = {i.name: i for i in m.graph.initializer}
    dq = {n.output[0]: n for n in m.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for n in m.graph.node:
        if n.op_type == "MatMul" and n.input[1] in dq and dq[n.input[1]].input[0] in inits:
            scale = inits[dq[n.input[1]].input[1]]
            out[dq[n.input[1]].input[0]] = int(np.prod(scale.dims)) if scale.dims else 1
    return out


def qdq_quantize(model: Path, out: Path, samples: Iterable[dict[str, np.ndarray]], precision: str,
                 overrides: dict[str, list[dict]], weights: str = "per_channel",
                 range_margin: float = 1.0, float_nodes: Iterable[str] = ()) -> dict[str, Any]:
    """Calibrated QDQ for the HTP with ONNX Runtime's QNN quantization config:
    16-bit activations (asymmetric uint16), symmetric 8- or 4-bit MatMul
    weights with one scale per output channel (`weights`: weight_overrides
    says why ORT's own config does not give that), min/max ranges from
    `samples` (real decode-step inputs). `float_nodes` are left out of the
    quantization (float islands: the HTP runs them in fp16, provider_options).

    `samples` is consumed lazily, one at a time, as the calibrator asks for it
    (pass a generator: decode_samples). Holding them would not fit: a sample
    is the step's whole input, every layer's KV cache included, e.g. Gemma 3
    270M at 1024 positions (15 sliding layers x 511 + 3 full x 1024, K and V,
    256 floats) ~ 22 MB a sample, x 1024 samples ~ 22 GB. ONNX Runtime's
    MinMax calibrator (the method get_qnn_qdq_config picks) keeps per sample
    only the ReduceMin/ReduceMax scalars it adds to the graph (the model's own
    outputs are dropped as None), so streaming bounds the calibration's memory
    to one sample plus its session (`_calibrate`); quantize_static then reads
    the ranges from a calibration cache. (Its CalibMaxIntermediateOutputs
    option is no help: in onnxruntime 1.32 it clears the collected outputs
    without folding them into the ranges.)"""
    import tempfile

    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    if precision not in ("w8a16", "w4a16"):
        raise ValueError(f"no QDQ recipe for precision {precision!r}")
    it = iter(samples)
    first = next(it, None)
    if first is None:
        raise QnnError("QDQ calibration got no samples")
    count = [0]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._first = first

        def get_next(self):
            if self._first is not None:
                feed, self._first = self._first, None
            else:
                feed = next(it, None)
            if feed is not None:
                count[0] += 1
            return feed

    weight = QuantType.QUInt8 if precision == "w8a16" else QuantType.QInt4
    for_weights = weight_overrides(model, precision, weights)
    ranges = sorted(overrides)
    overrides = {**for_weights, **overrides}
    float_nodes = sorted(float_nodes)
    cfg = get_qnn_qdq_config(str(model), Reader(), activation_type=QuantType.QUInt16, weight_type=weight,
                             per_channel=True, init_overrides=overrides, nodes_to_exclude=float_nodes or None)
    t0 = time.perf_counter()
    # ONNX Runtime's quantizer logs a root-level "consider pre-processing"
    # warning meant for image models; its shape pre-processing changes
    # nothing in this static-shaped graph (qnn_preprocess_model reports no change).
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix=".qdq-", dir=Path(out).parent) as tmp:
            cache = Path(tmp) / "ranges.json"
            _calibrate(model, cfg, Path(tmp), cache, range_margin)
            # the ranges from the cache: quantize_static then loads the model once and calibrates nothing
            quantize_static(str(model), str(out), None, calibrate_method=cfg.calibrate_method,
                            quant_format=cfg.quant_format, activation_type=cfg.activation_type,
                            weight_type=cfg.weight_type, op_types_to_quantize=cfg.op_types_to_quantize,
                            nodes_to_quantize=cfg.nodes_to_quantize, nodes_to_exclude=cfg.nodes_to_exclude,
                            per_channel=cfg.per_channel, reduce_range=cfg.reduce_range,
                            use_external_data_format=cfg.use_external_data_format,
                            calibration_providers=cfg.calibration_providers, extra_options=cfg.extra_options,
                            calibration_cache_path=str(cache))
    finally:
        root.setLevel(level)
    scales = weight_scales(out)
    per_tensor = sorted(name for name, k in scales.items() if k == 1)
    if weights == "per_channel" and per_tensor:  # ORT would otherwise change its mind silently
        raise QnnError(f"the {precision} QDQ graph quantized {len(per_tensor)} MatMul weight(s) per tensor "
                       f"although per-channel was asked (first: {per_tensor[0]})")
    matmul_type = ("int8" if precision == "w8a16" else "int4") if weights == "per_channel" else weight.name.lower()
    return {"activation_type": "uint16", "weight_type": weight.name.lower(),
            "matmul_weights": {"granularity": weights, "type": matmul_type, "symmetric": weights == "per_channel",
                               "count": len(scales), "scales": sum(scales.values())},
            "float_nodes": len(float_nodes),
            "calibration_method": "MinMax", "range_margin": range_margin, "samples": count[0], "streamed": True,
            "range_overrides": ranges,
            "quantize_s": round(time.perf_counter() - t0, 3)}


WEIGHT_METHODS = ("gptq", "rtn")  # pack.qnn_weight_method


def requantize_weights(qdq_model: Path, float_model: Path, checkpoint: Path, calibration: Path, *,
                       method: str = "gptq", block: int | None = None, advance=lambda: None,
                       codes_from: Path | None = None, made: dict | None = None) -> dict[str, Any]:
    """Each per-channel int8 MatMul weight of a w8a16 QDQ graph, as ONNX Runtime's quantizer rounded it,
    given new codes in place: `method` gptq (GPTQ from the calibrate stage's Hessians) or rtn; on the same
    grid (symmetric, one scale per output channel), or with `block` on a finer one: one scale per `block`
    inputs of each output channel, a blockwise DequantizeLinear (axis 0, ONNX's block quantization, which
    the QNN EP lowers to the HTP's block-quantized MatMul), GPTQ's groups the blocks.

    Why (docs/phone-fidelity.md): on Gemma 3 270M, weights alone rounded to the nearest int8 step cost
    the logits 30.7 dB SNR against fp32 (activations exact); GPTQ's codes on the same grid cost 36.7 dB,
    KL 0.0012 -> 0.0004 (finding 3). The weights were still most of the w8a16 graph's error: GPTQ in
    blocks of 32 took its logits from 30.75 to 32.88 dB (finding 6). ONNX Runtime's quantizer only rounds,
    per channel at finest; its activation ranges are kept.
    A graph weight is matched to its checkpoint linear by content (the export keeps the weights
    bit-exact, transposed [K, N], under its own names); a weight with no calibrated linear keeps its
    rounded codes, and the count says so.

    `codes_from` (a w4a16 graph): the quantize stage's folder; each weight then takes that stage's own codes
    (GPTQ at 4 bits by default, in its groups: the codes every CPU path packs) instead of new ones, as INT4
    in blocks of the layer's group size (a layer the stage kept at 8 bits as INT8), so the phone's 4-bit
    weights are the build's 4-bit weights. Symmetric codes only (quantize.sym=true).

    `made` (a dict, empty on the first call): each linear's codes as this call makes them, by checkpoint
    name; a later call over a graph of the same weights (a token graph's prompt graph) takes them from
    there instead of making them again: the same inputs give the same codes (the pack checks that both
    graphs hold the same, qnn.same_weights), and on Gemma 3 270M making them again took 61 s of its
    pack's 356 s. Held as uint8 codes, a byte a weight, until the caller drops the dict."""
    if codes_from is not None:
        method = "quantize"
    elif method not in WEIGHT_METHODS:
        raise ValueError(f"pack.qnn_weight_method must be one of {', '.join(WEIGHT_METHODS)}, not {method!r}")
    import hashlib

    import onnx
    import torch
    from onnx import numpy_helper
    from safetensors import safe_open

    from pipeline.quant import gptq
    from pipeline.sources.checkpoint_files import weight_map
    from pipeline.sources.tensorfile import load_onnx, onnx_initializers

    layers = json.loads((calibration / "calibration.json").read_text())["layers"]
    where = weight_map(checkpoint)
    stage_codes, stage_meta = {}, {"layers": {}}
    if codes_from is not None:
        from pipeline.quant.codes import PackError, read_quant

        try:
            stage_meta, stage_codes = read_quant(codes_from, bits=(4, 8))
        except PackError as err:
            raise QnnError(f"w4a16 from the quantize stage's codes: {err}") from None

    def hf_weight(name: str) -> torch.Tensor:
        with safe_open(str(checkpoint / where[f"{name}.weight"]), framework="pt") as f:
            return f.get_tensor(f"{name}.weight").float()

    model = load_onnx(qdq_model)
    inits = {i.name: i for i in model.graph.initializer}
    dq = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    per_channel = {}  # the float weight's name -> (codes init, scale init, zero init)
    dq_of = {}  # codes init name -> its DequantizeLinear
    orphans = set()  # per-channel zero points a blockwise DequantizeLinear no longer reads
    for n in model.graph.node:
        if n.op_type == "MatMul" and n.input[1] in dq:
            d = dq[n.input[1]]
            if d.input[0].endswith("_quantized") and list(inits[d.input[1]].dims) not in ([], [1]):
                per_channel[d.input[0][: -len("_quantized")]] = (
                    inits[d.input[0]], inits[d.input[1]], inits[d.input[2]] if len(d.input) > 2 else None)
                dq_of[d.input[0]] = d
    # sha256 of each float [K, N] weight, read one at a time -> its quantized initializers
    targets = {hashlib.sha256(a.tobytes()).hexdigest(): per_channel[name]
               for name, a in onnx_initializers(float_model, per_channel)}
    done, errors, h_key, h, groups = 0, [], None, None, set()
    for name, info in layers.items():
        if f"{name}.weight" not in where:
            continue
        w = hf_weight(name)
        hit = targets.get(hashlib.sha256(w.T.contiguous().numpy().tobytes()).hexdigest())
        if hit is None:
            continue
        codes_init, scale_init, zero_init = hit
        if made is not None and name in made:
            q, bits, group, err = made[name]
        else:
            if info["hessian"] != h_key:
                with safe_open(str(calibration / "hessians.safetensors"), framework="pt") as f:
                    h_key, h = info["hessian"], f.get_tensor(info["hessian"]).double()
            group = w.shape[1] if block is None else int(block)  # a block not dividing K: gptq's own check
            bits = 8
            if codes_from is not None:
                if name not in stage_codes:
                    continue
                qw, sc, zs, group = stage_codes[name]
                bits = int(stage_meta["layers"][name].get("bits", 4))  # quant.json's width for it (read_quant's)
                if not (zs == (1 << (bits - 1))).all():
                    raise QnnError(f"w4a16 from the quantize stage's codes: layer {name} is asymmetric (zero points "
                                   "other than the midpoint); the HTP's block-quantized weights are symmetric: build "
                                   "with quantize.sym=true")
                q = gptq.Quantized(torch.from_numpy(qw), torch.from_numpy(sc), torch.from_numpy(zs), int(group))
            elif method == "gptq":
                q = gptq.gptq_quantize(w, h, group_size=group, sym=True, scale_search=False, bits=8, name=name)
            else:
                q = gptq.rtn_quantize(w, None, group_size=group, sym=True, scale_search=False, bits=8, name=name)
            rtn = torch.from_numpy(numpy_helper.to_array(codes_init).astype(np.float32).T.copy()) * \
                torch.from_numpy(numpy_helper.to_array(scale_init).astype(np.float32))[:, None]
            err = (gptq.errors(w, q, h)["out_rel_err_h"], gptq.errors(w, rtn, h)["out_rel_err_h"])
            if made is not None:
                made[name] = (q, bits, group, err)
        errors.append(err)
        codes = (q.qweight.to(torch.int16) - (1 << (bits - 1))).to(torch.int8).T.contiguous().numpy()
        if bits == 4:  # ONNX's INT4: two to a byte, the first in the low nibble; raw, so it can go external
            nib = (codes.reshape(-1) & 0x0F).astype(np.uint8)
            nib = np.concatenate([nib, np.zeros(len(nib) % 2, np.uint8)])
            codes_init.CopyFrom(onnx.helper.make_tensor(codes_init.name, onnx.TensorProto.INT4, codes.shape,
                                                        (nib[0::2] | (nib[1::2] << 4)).tobytes(), raw=True))
        else:
            codes_init.CopyFrom(numpy_helper.from_array(codes, codes_init.name))
        blk = group if codes_from is not None else block
        groups.add(int(group))
        if blk is None:
            scale_init.CopyFrom(numpy_helper.from_array(q.scales[:, 0].numpy().astype(np.float32), scale_init.name))
            if zero_init is not None:
                zero_init.CopyFrom(numpy_helper.from_array(np.zeros(codes.shape[1], np.int8), zero_init.name))
        else:  # [K / block, N] scales, block along K; no zero point (symmetric: ONNX's default 0)
            scale_init.CopyFrom(numpy_helper.from_array(q.scales.T.contiguous().numpy().astype(np.float32),
                                                        scale_init.name))
            node = dq_of[codes_init.name]
            if zero_init is not None:
                orphans.add(zero_init.name)
            del node.input[2:]
            kept = [a for a in node.attribute if a.name not in ("axis", "block_size")]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("axis", 0),
                                          onnx.helper.make_attribute("block_size", group)])
        done += 1
        advance()
    used = {i for n in model.graph.node for i in n.input}
    keep = [i for i in model.graph.initializer if i.name not in orphans or i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    # Saved beside, then moved over: onnx.save appends external data to a file of that name that exists,
    # so saving in place left the rounded codes' bytes as dead weight ahead of GPTQ's (Gemma 3 270M's
    # w8a16 data file was 542.6 MB, of which 270.3 MB unreferenced).
    data = f"{qdq_model.name}.data"
    tmp = qdq_model.parent / f".{qdq_model.name}.gptq"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    onnx.save(model, str(tmp / qdq_model.name), save_as_external_data=True, all_tensors_to_one_file=True,
              location=data, size_threshold=1024)
    if (tmp / data).is_file():  # none where every tensor is under the threshold
        (tmp / data).replace(qdq_model.parent / data)
    (tmp / qdq_model.name).replace(qdq_model)
    tmp.rmdir()
    gain = [10 * np.log10(r / g) for g, r in errors if g > 0 and r > 0]
    return {"method": method, "weights": done, "rounded": len(targets) - done,
            **({"granularity": "per_block", "block": int(block), "scales": sum(weight_scales(qdq_model).values())}
               if block is not None else {}),
            **({"granularity": "per_block", "blocks": sorted(groups), "source": str(codes_from.name),
                "scales": sum(weight_scales(qdq_model).values())} if codes_from is not None else {}),
            "output_error_db_gain": {"median": round(float(np.median(gain)), 2), "min": round(float(min(gain)), 2)}
            if gain else None}


# quantize_static's own mapping of extra_options to the calibrator's options
_CALIB_OPTIONS = (("CalibTensorRangeSymmetric", "symmetric"), ("CalibMovingAverage", "moving_average"),
                  ("CalibMovingAverageConstant", "averaging_constant"),
                  ("CalibMaxIntermediateOutputs", "max_intermediate_outputs"), ("CalibPercentile", "percentile"))


def widen(ranges, margin: float):
    """Each calibrated [lowest, highest] (a TensorsData) scaled by `margin` about zero (which every range
    holds), in place.

    The trial against clipped spikes (docs/phone-fidelity.md): Gemma 3 270M's layer-2 down_proj reaches
    14.2 over its calibration sequence, 9.6 at the calibrated (every 4th) steps and 20.4 on a parity
    prompt's line-start token, and the stream downstream of the clip fell to ~10 dB. Widening every range
    lost more than it saved (float residual: margin 1 28.1 dB, 2 27.2, 4 24.4), so the pack calibrates
    at margin 1; `benchmarks/qnn_rewrites.py --range-margin` repeats the trial."""
    if margin == 1:
        return ranges
    for name in list(ranges.keys()):
        td = ranges[name]
        lo, hi = td.range_value
        ranges[name] = type(td)(lowest=(np.asarray(lo) * margin).astype(np.asarray(lo).dtype),
                                highest=(np.asarray(hi) * margin).astype(np.asarray(hi).dtype))
    return ranges


def _release_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Why: a dropped graph's weights can stay in the heap as free chunks (glibc keeps those under its
    mmap threshold); called where the calibrator lets its loaded graph go (_calibrate). On Gemma 3
    270M's graph the calibrator's resident set before its data collection: 0.67 GB without, 0.33 with."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def _calibrate(model: Path, cfg, tmp: Path, cache: Path, margin: float = 1.0) -> None:
    """The activation ranges of `cfg` (a get_qnn_qdq_config) over its reader's samples, written to
    `cache` (ONNX Runtime's calibration cache, which quantize_static reads instead of calibrating).

    Why not quantize_static's own calibration: it holds the loaded model, a deep copy of it when it raises
    the opset (uint16 activations), the calibrator's loaded model and the augmented session at once: on
    Gemma 3 270M's 1.7 GB float graph the pack stage peaked at 8.4 GiB in it. Here only the calibrator
    runs, its augmented graph saved with external data, and its loaded model's initializers are dropped
    once its session holds them (the calibrator reads nothing from them after augment_graph).

    And the session neither prepacks its MatMul weights nor is created beside the loaded model's: ONNX
    Runtime's own (create_calibrator) held the loaded model, the initializers its session read and their
    prepacked copies at once, 2.9x the graph's weights (Gemma 3 270M's 1.07 GB: 3.09 GB). Clearing the
    loaded model's initializers freed nothing (protobuf keeps them in the message's arena: the 1.75B phone
    build's calibration held 8.6 GB of it, 16.45 GB in all). Here the loaded model is let go before the
    session is made, and the session reads its weights from the augmented graph's data file as it runs:
    Gemma 3 270M's calibration peak 2.03 GB (docs/large-models.md)."""
    import gc

    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import CalibrationMethod, MinMaxCalibrater, save_tensors_data

    class LeanMinMax(MinMaxCalibrater):
        def create_inference_session(self):
            # The loaded graph's weights freed: protobuf keeps a message's memory in its root's arena, so
            # the structure is copied into a new message and the old one, weights and all, let go.
            self.model.graph.ClearField("initializer")
            structure = onnx.ModelProto()
            structure.CopyFrom(self.model)
            self.model = structure
            gc.collect()
            _release_freed_heap()
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as ORT's own
            so.add_session_config_entry("session.disable_prepacking", "1")
            self.infer_session = ort.InferenceSession(self.augmented_model_path, sess_options=so,
                                                      providers=self.execution_providers)

    if cfg.calibrate_method != CalibrationMethod.MinMax:  # get_qnn_qdq_config's; the others hold histograms
        raise QnnError(f"the QDQ calibration runs MinMax only, not {cfg.calibrate_method}")
    extra = {key: cfg.extra_options[name] for name, key in _CALIB_OPTIONS if name in cfg.extra_options}
    # create_calibrator's MinMax branch, with the session above
    calibrator = LeanMinMax(Path(model), cfg.op_types_to_quantize, str(tmp / "augmented_model.onnx"),
                            use_external_data_format=True, symmetric=extra.get("symmetric", False),
                            moving_average=extra.get("moving_average", False),
                            averaging_constant=extra.get("averaging_constant", 0.01),
                            max_intermediate_outputs=extra.get("max_intermediate_outputs", None),
                            per_channel=extra.get("per_channel", False))
    calibrator.augment_graph()
    if cfg.calibration_providers:
        calibrator.execution_providers = cfg.calibration_providers
    calibrator.create_inference_session()
    calibrator.collect_data(cfg.calibration_data_reader)
    ranges = widen(calibrator.compute_data(), margin)
    del calibrator
    save_tensors_data(ranges, cache)


def calibration_sequences(token_ids: np.ndarray, context_length: int, n: int) -> list[list[int]]:
    """The calibration windows joined end to end and cut into at most `n`
    sequences of context_length tokens, so calibration reaches the positions
    (and the full-attention history) the graph serves.

    They hold no BOS (the windows are cut from running text), although every
    prompt starts with one. Leading each sequence with it was tried and
    measured worse: the BOS's activations (the attention sink's, Gemma 3
    270M's largest) widened the ranges for every other token, and the CPU-EP
    bulk went from KLD mean 0.0048 to 0.0139, logits SNR 28.5 to 24.0 dB
    (docs/phone-fidelity.md, finding 5)."""
    flat = np.asarray(token_ids, dtype=np.int64).ravel().tolist()
    seqs = [flat[i:i + context_length] for i in range(0, len(flat), context_length)][:n]
    return [s for s in seqs if len(s) >= 2]


def calibration_plan(context_length: int, sequences: int, step_budget: int) -> int:
    """How many context-length calibration sequences to decode: at most
    `sequences`, at most `step_budget` decode steps in all, never fewer than
    one. Each sequence runs the whole context, so positions past a sliding
    window (the ring's wrap) are calibrated whatever the budget."""
    return max(1, min(int(sequences), int(step_budget) // max(1, int(context_length))))


def spill_samples(samples: Iterable[dict[str, np.ndarray]], folder: Path) -> list[Path]:
    """Write each sample to `folder` as an uncompressed .npz, one at a time; their paths in order.

    Why: the samples come from decoding with the float graph, whose session
    holds the model's weights (1.7 GB on Gemma 3 270M); ONNX Runtime's
    quantizer then holds two more copies (its model and the calibrator's
    augmented session). Spilled, the decoder is dropped before the quantizer
    starts, the samples serve every QDQ precision, and one is in memory at a
    time (`read_samples`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, feed in enumerate(samples):
        path = folder / f"sample_{i:05d}.npz"
        np.savez(path, **feed)
        paths.append(path)
    return paths


def spill_space(samples: int, feed: dict[str, np.ndarray], folder: Path) -> int:
    """The bytes `samples` spilled samples shaped like `feed` take (the KV caches are most of them: ~73 MB a
    sample on a 1.75B Gemma 3 at 1024 positions, 256 samples ~19 GB); QnnError when `folder`'s file
    system has less free."""
    need = int(samples) * sum(int(a.nbytes) for a in feed.values())
    free = shutil.disk_usage(folder).free
    if need > free:
        raise QnnError(f"the QDQ calibration spills {need / 1e9:.1f} GB of samples to {folder}, "
                       f"{free / 1e9:.1f} GB free")
    return need


def spill_fix(sequences: int, context_length: int, step_budget: int, stride: int) -> str:
    """What lowers the spill, for the error that says it does not fit: fewer sequences while there are
    several; with one, a wider stride or a shorter context (the step budget never goes below one
    whole-context sequence, calibration_plan)."""
    if sequences > 1:
        return (f"lower pack.qnn_calibration_steps (now {step_budget}: {sequences} sequences of "
                f"{context_length} positions; each sequence fewer spills 1/{sequences} less)")
    return (f"raise pack.qnn_calibration_stride (now {stride}: a sample every {stride} steps of the one "
            f"{context_length}-position sequence, the least pack.qnn_calibration_steps gives) or build a "
            "shorter context (export.context_length)")


def read_samples(paths: list[Path]) -> Iterator[dict[str, np.ndarray]]:
    """The spilled samples back, one at a time (`spill_samples`)."""
    for path in paths:
        with np.load(path) as f:
            yield {k: f[k] for k in f.files}


def decode_samples(decoder, sequences: list[list[int]], stride: int, advance=lambda: None) -> Iterator[dict]:
    """QDQ calibration samples, yielded one at a time (see qdq_quantize):
    `decoder` (an OnnxDecoder) decodes each sequence; the inputs of every
    `stride`-th step are a sample."""
    for seq in sequences:
        decoder.reset()
        for pos, tok in enumerate(seq):
            if pos % stride == 0:
                yield decoder.next_inputs(tok)
            decoder.step(tok)
            advance()


def prompt_samples(decoder, sequences: list[list[int]], advance=lambda n: None) -> Iterator[dict]:
    """The prompt graph's calibration samples, one a chunk: `decoder` (an OnnxDecoder with a prompt graph)
    runs each sequence through it a chunk at a time, each chunk's inputs a sample (the KV it reads
    written by the chunks before it)."""
    T = decoder.prompt_tokens
    for seq in sequences:
        decoder.reset()
        for i in range(0, len(seq), T):
            chunk = seq[i:i + T]
            yield decoder.next_prompt_inputs(chunk)
            decoder.prefill(chunk)
            advance(len(chunk))


def _head_chain(model) -> list[str]:
    """The tensors from the head MatMul's activation input to the graph's first output (the logits), in
    order, and the op types between them: [input, op, tensor, op, ..., logits]. The head is the last
    MatMul on the way back from the output (Gemma 2's soft-capping puts Div, Tanh and Mul after it)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}
    t = model.graph.output[0].name
    chain = [t]
    while True:
        n = producers.get(t)
        if n is None or len(chain) > 16:
            raise QnnError(f"no head MatMul found on the way back from the graph output {chain[0]!r}")
        acts = [i for i in n.input if i and i not in inits]
        if n.op_type == "MatMul":
            return [acts[0], n.op_type] + chain
        if len(acts) != 1:
            raise QnnError(f"the graph output {chain[0]!r} is computed by {n.op_type} {n.name!r} from "
                           f"{len(acts)} activations, not from the head MatMul's output alone")
        t = acts[0]
        chain = [t, n.op_type] + chain


def head_ranges(token_qdq: Path, token_float: Path, prompt_float: Path) -> dict[str, list[dict]]:
    """The token graph's quantization ranges for the head's input, output and what follows it to the
    logits, as range overrides (ONNX Runtime's init_overrides) for the prompt graph's same tensors.

    Why (docs/phone-fidelity.md): the prompt graph computes its logits for a chunk's last row only (a
    Slice of the final norm's output before the head), so those tensors were calibrated on one row a
    calibration chunk: on Gemma 3 270M 32 rows, against the token graph's every step for the same
    tensors. At a parity prompt's 32nd token the head's input held 70.2, clipped at the calibrated
    [-62.4, 56.0]: 18.3 dB on that tensor, the logits 19.4 dB where the token graph's had 46.5; and the
    logits' own range clipped the top logits of other rows (KL up to 1.6 nats at 40 dB). The head is the
    same function in both graphs; with the token graph's ranges, the prompt graph's chunk-end logits are
    quantized as the token graph's are (Qualcomm's LLM exports share one set of encodings likewise)."""
    import onnx
    from onnx import numpy_helper

    # the structure only (no weights read): which tensors, and the token graph's scales and zero points
    token, prompt = (_head_chain(onnx.load(str(f), load_external_data=False)) for f in (token_float, prompt_float))
    if token[1::2] != prompt[1::2]:
        raise QnnError(f"the prompt graph's head ({' -> '.join(prompt[1::2])}) is not the token graph's "
                       f"({' -> '.join(token[1::2])})")
    qdq = onnx.load(str(token_qdq), load_external_data=False)
    inits = {i.name: i for i in qdq.graph.initializer}
    quant = {n.input[0]: n for n in qdq.graph.node if n.op_type == "QuantizeLinear"}
    out: dict[str, list[dict]] = {}
    for t, p in zip(token[::2], prompt[::2]):
        q = quant.get(t) or quant.get(f"{t}_QuantizeLinear_Input")  # a graph output's Q reads it renamed
        if q is None:
            continue  # left float in the token graph: nothing to match
        scale = numpy_helper.to_array(inits[q.input[1]]).astype(np.float64)
        zp = numpy_helper.to_array(inits[q.input[2]])
        info = np.iinfo(zp.dtype)
        lo, hi = (info.min - zp.astype(np.float64)) * scale, (info.max - zp.astype(np.float64)) * scale
        out[p] = [{"rmin": np.float32(lo), "rmax": np.float32(hi)}]
    return out


def same_weights(a: Path, a_float: Path, b: Path, b_float: Path) -> list[str]:
    """The MatMul weights two QDQ graphs (`a`, `b`, each quantized from its float graph) quantize
    differently: the codes, scales, zero points and DequantizeLinear attributes each MatMul reads its
    weight through, matched by the float weight's content (the exports name the same weight differently,
    `val_<n>`, as requantize_weights matches them), or that one of them lacks. [] when the prompt graph's
    weights are the token graph's; else the differing weights' names in `a` (or `b`)."""
    import hashlib

    from onnx import numpy_helper

    from pipeline.sources.tensorfile import load_onnx, onnx_initializers

    def weights(path: Path, float_path: Path) -> dict[str, tuple[str, tuple]]:
        m = load_onnx(path)
        inits = {i.name: i for i in m.graph.initializer}
        dq = {n.output[0]: n for n in m.graph.node if n.op_type == "DequantizeLinear"}
        quantized = {}  # the float weight's name -> what the MatMul reads
        for n in m.graph.node:
            if n.op_type == "MatMul" and n.input[1] in dq and dq[n.input[1]].input[0].endswith("_quantized"):
                d = dq[n.input[1]]
                quantized[d.input[0][: -len("_quantized")]] = tuple(
                    [(inits[x].data_type, tuple(inits[x].dims), numpy_helper.to_array(inits[x]).tobytes())
                     for x in d.input if x in inits] + [a.SerializeToString() for a in d.attribute])
        del m, inits
        return {hashlib.sha256(w.tobytes()).hexdigest(): (name, quantized[name])
                for name, w in onnx_initializers(float_path, quantized)}

    wa, wb = weights(a, a_float), weights(b, b_float)
    return sorted((wa.get(k) or wb[k])[0] for k in set(wa) | set(wb)
                  if k not in wa or k not in wb or wa[k][1] != wb[k][1])


# --------------------------------------------------------------------------
# The token embedding, off the HTP
# --------------------------------------------------------------------------

EMBED_DIR = "embed"  # <pack>/embed/model.onnx: the lookup the phone runs on the CPU (npu_rewrite.embedding_input)
EMBEDDING_CHOICES = ("int8", "int4", "graph")  # pack.qnn_embedding; graph: the table stays in the context binary
def _block_codes(table: np.ndarray, bits: int, block: int):
    """Symmetric block-wise codes of the [V, H] table in MatMulNBits' layout: (B, scales fp16 [V, H/bs]),
    and the table the lookup returns (its fp16 arithmetic included): gptq.embedding_codes, the rounding
    the quantize stage and the CPU packers use for an embedding table."""
    from pipeline.quant import gptq
    from pipeline.quant.int4_layouts import to_matmulnbits

    q = gptq.embedding_codes(np.ascontiguousarray(table, np.float32), bits, block)
    b, scales, _ = to_matmulnbits(q.qweight.numpy(), q.scales.numpy(), q.zeros.numpy(), block, sym=True, bits=bits)
    s16 = scales.astype(np.float16)
    # The rows as GatherBlockQuantized makes them: (code - zero) * scale, one fp16 product (then cast).
    codes = q.qweight.numpy().astype(np.int16) - 2 ** (bits - 1)
    del q
    deq = (codes.astype(np.float16) * np.repeat(s16, block, axis=1)).astype(np.float32)
    return b, s16, deq


# Rows of the embedding table coded at a time (write_embedding): 8192 x 2048 floats are 64 MB in float32.
EMBED_CHUNK_ROWS = 8192


def write_embedding(table: np.ndarray, out_dir: Path, bits: int, ids_dims: list[int],
                    output: str = "inputs_embeds", block: int | None = None) -> dict[str, Any]:
    """out_dir/model.onnx (+ model.onnx.data): input_ids -> the table's rows as float32 `output`, one
    com.microsoft GatherBlockQuantized over symmetric `bits`-bit codes in blocks of `block` (fp16
    scales; ORT's default zero points), then a Reshape and a Cast. ONNX Runtime's own op, run on its
    CPU EP; the graph is a few nodes, so it is written here rather than exported."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.quant import gptq
    from pipeline.graphs.decode_graph import snr_from_sums

    block = gptq.EMBED_BLOCK if block is None else int(block)
    v, k = (int(d) for d in table.shape)
    if k % block:
        raise QnnError(f"the embedding's width {k} is not a multiple of its block {block}")
    # Both widths are measured (bytes, and the lookup's SNR against the float table), so the choice
    # is recorded beside its alternative. A row's codes depend on that row alone, so the table is
    # coded EMBED_CHUNK_ROWS rows at a time and the SNR summed over the chunks: at once, the SNR's
    # float64 copies of the whole table added 4.46 GB on a 151,936 x 2048 table (the 1.75B phone
    # build's pack peaked at 19.9 GB around this step).
    widths = (8, 4)
    sig, err, nbytes, chosen = 0.0, dict.fromkeys(widths, 0.0), dict.fromkeys(widths, 0), []
    for start in range(0, v, EMBED_CHUNK_ROWS):
        chunk = table[start:start + EMBED_CHUNK_ROWS]
        rows = np.asarray(chunk, np.float64)
        sig += float(np.einsum("ij,ij->", rows, rows))
        for w in widths:
            b, s16, deq = _block_codes(chunk, w, block)
            d = rows - deq
            err[w] += float(np.einsum("ij,ij->", d, d))
            nbytes[w] += int(b.nbytes + s16.nbytes)
            if w == bits:
                chosen.append((b, s16))
            del b, s16, deq, d
    options = {f"int{w}": {"bytes": nbytes[w], "snr_db": round(snr_from_sums(sig, err[w]), 2)} for w in widths}
    b = np.concatenate([c[0] for c in chosen])
    scales = np.concatenate([c[1] for c in chosen])
    del chosen
    inits = [numpy_helper.from_array(b, "embed.B"),
             numpy_helper.from_array(scales.reshape(v, k // block, 1), "embed.scales"),
             numpy_helper.from_array(np.asarray([0, 0, k], np.int64), "embed.shape")]
    nodes = [helper.make_node("GatherBlockQuantized", ["embed.B", "input_ids", "embed.scales"], ["rows"],
                              name="embed", domain="com.microsoft", bits=bits, block_size=block,
                              gather_axis=0, quantize_axis=2),
             helper.make_node("Reshape", ["rows", "embed.shape"], ["rows16"], name="embed_rows"),
             helper.make_node("Cast", ["rows16"], [output], name="embed_cast", to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "edgekiln_embedding",
                              [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ids_dims)],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, ids_dims + [k])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out_dir / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    files = sorted(p.name for p in out_dir.iterdir())
    return {"model": "model.onnx", "files": files, "bits": bits, "block_size": block, "scale_dtype": "float16",
            "symmetric": True, "vocab": v, "hidden": k, "bytes": sum((out_dir / f).stat().st_size for f in files),
            "snr_db": options[f"int{bits}"]["snr_db"], "options": options, "input": "input_ids", "output": output,
            "op": "com.microsoft.GatherBlockQuantized on ONNX Runtime's CPU EP"}
