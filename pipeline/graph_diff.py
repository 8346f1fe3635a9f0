"""First divergence between two graphs of one computation, tensor by tensor.

    python -m pipeline.graph_diff REF.onnx TEST.onnx --io DIR/io.json [--tokens 2,100,200] [--step 1]
        [--below 30] [--show 8]

Both graphs run on ONNX Runtime's CPU EP with every intermediate tensor made a
graph output, on identical inputs: a decode step's inputs after feeding
`--tokens` through the REFERENCE graph (so both see the same history). Tensors
are walked in the reference's topological order and compared by SNR; the
first ones below `--below` dB are printed with their op, ranges and inputs.

A QDQ graph (TEST quantized from REF) renames nothing: a tensor X that was
quantized reaches its consumers as DequantizeLinear(QuantizeLinear(X)), and
that dequantized tensor is what is compared with the reference's X, so a
clipping range shows up at the tensor it clips. ONNX Runtime's CPU EP runs
QDQ with the HTP's quantization arithmetic (a prototype w8a16 build measured
6.6 dB on both), so the tensor-by-tensor walk runs here, fast; that build's
first divergence was the embedding lookup clipped by its calibrated range,
then the decomposed RMSNorm's intermediates, which is what
pipeline/npu_rewrite.py now fixes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np


def _with_all_outputs(model, names):
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names if n not in have)
    return m


def _session(model):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    # Fusions would remove the very intermediates compared here.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def dequantized_alias(model) -> dict[str, str]:
    """X -> the DequantizeLinear output its consumers read, for every X a QDQ pass quantized."""
    quantized = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    return {quantized[n.input[0]]: n.output[0] for n in model.graph.node
            if n.op_type == "DequantizeLinear" and n.input[0] in quantized}


def snr(ref: np.ndarray, test: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    err = float(((ref - test.astype(np.float64)) ** 2).sum())
    sig = float((ref ** 2).sum())
    if err == 0:
        return math.inf
    return 10 * math.log10(sig / err) if sig > 0 else -math.inf


def compare(ref_model, test_model, feeds: dict[str, np.ndarray]) -> list[dict]:
    """Every float tensor the two graphs share, in the reference's order, with its SNR."""
    alias = dequantized_alias(test_model)
    test_names = {o for n in test_model.graph.node for o in n.output}
    producer = {o: n for n in ref_model.graph.node for o in n.output if o}
    pairs = [(o, alias.get(o, o)) for n in ref_model.graph.node for o in n.output
             if o and alias.get(o, o) in test_names]
    if not pairs:
        raise ValueError("the two graphs share no tensor name: not two graphs of one computation")
    ref_s = _session(_with_all_outputs(ref_model, [a for a, _ in pairs]))
    test_s = _session(_with_all_outputs(test_model, [b for _, b in pairs]))
    ref_out = dict(zip([a for a, _ in pairs], ref_s.run([a for a, _ in pairs], feeds)))
    test_out = dict(zip([b for _, b in pairs], test_s.run([b for _, b in pairs], feeds)))
    rows = []
    for a, b in pairs:
        x, y = ref_out[a], test_out[b]
        if x.dtype.kind != "f" or x.shape != y.shape:
            continue
        node = producer[a]
        rows.append({"tensor": a, "op": node.op_type, "inputs": list(node.input), "snr_db": snr(x, y),
                     "ref_range": [float(x.min()), float(x.max())] if x.size else None,
                     "test_range": [float(y.min()), float(y.max())] if y.size else None,
                     "quantized": b != a})
    return rows


def first_divergence(rows: list[dict], below_db: float) -> dict | None:
    return next((r for r in rows if r["snr_db"] < below_db), None)


def decode_feeds(ref_dir: Path, tokens: list[int], model_file: str = "model.onnx") -> dict[str, np.ndarray]:
    """The inputs of the step after `tokens`, as the reference graph's own decode leaves them."""
    from pipeline.decode_graph import OnnxDecoder

    dec = OnnxDecoder(ref_dir, model_file=model_file)
    for t in tokens[:-1]:
        dec.step(t)
    return dec.next_inputs(tokens[-1])


def main(argv: list[str] | None = None) -> int:
    from pipeline.tensorfile import load_onnx

    ap = argparse.ArgumentParser(prog="python -m pipeline.graph_diff", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", type=Path, help="the reference graph (e.g. the fp32 export)")
    ap.add_argument("test", type=Path, help="the graph under test (e.g. its QDQ variant)")
    ap.add_argument("--io", type=Path, required=True, help="io.json of the decode step both graphs implement")
    ap.add_argument("--tokens", default="2,100,200", help="token ids fed before the compared step (comma-separated)")
    ap.add_argument("--below", type=float, default=30.0, help="report tensors below this SNR (dB)")
    ap.add_argument("--show", type=int, default=8, help="how many tensors below the threshold to print")
    ap.add_argument("--json", action="store_true", help="print every compared tensor as JSON")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    if not tokens:
        ap.error("--tokens needs at least one token id")
    io_dir = a.io.parent
    ref_rel = Path(a.ref).resolve()
    feeds = decode_feeds(io_dir, tokens, model_file=str(ref_rel))
    rows = compare(load_onnx(a.ref), load_onnx(a.test), feeds)
    if a.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    worst = [r for r in rows if r["snr_db"] < a.below]
    print(f"{len(rows)} tensors compared at step {len(tokens) - 1}; {len(worst)} below {a.below:g} dB")
    for r in worst[: a.show]:
        q = " (quantized)" if r["quantized"] else ""
        print(f"  {r['tensor']:<36} {r['op']:<28} {r['snr_db']:7.2f} dB  ref {r['ref_range']}  "
              f"test {r['test_range']}{q}  <- {r['inputs']}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
