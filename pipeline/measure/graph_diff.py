"""First divergence between two graphs of one computation, tensor by tensor.

    python -m pipeline.measure.graph_diff REF.onnx TEST.onnx --io DIR/io.json [--tokens 2,100,200] [--step 1]
        [--below 30] [--show 8]
    python -m pipeline.measure.graph_diff REF.onnx QDQ.onnx --io DIR/io.json --htp galaxy_s25 [--tokens ...]

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
pipeline/graphs/npu_rewrite.py now fixes.

`--htp DEVICE` adds the HTP itself: TEST (a QDQ graph) is compiled for that
device's HTP with every tensor it quantizes (and every float-island tensor)
as an extra output, run on onnxruntime-qnn's HTP backend (the x86 emulation:
the HTP's numerics) on the same inputs, and each tensor is printed three ways:
REF against TEST on the CPU EP, REF against TEST on the HTP, and the CPU EP
against the HTP. The first tensor where the last drops is where the HTP stops
computing what the CPU EP stands in for. A probe is a DequantizeLinear of the
tensor's own QuantizeLinear output (the graph's own node units are left as they
are), so it reads exactly what the HTP hands the tensor's consumers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
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
    from pipeline.runtimes.onnx import OnnxDecoder

    dec = OnnxDecoder(ref_dir, model_file=model_file)
    for t in tokens[:-1]:
        dec.step(t)
    return dec.next_inputs(tokens[-1])


def htp_probes(model) -> tuple["onnx.ModelProto", dict[str, str]]:  # noqa: F821
    """`model` (a QDQ graph) with probes the HTP can output: {probe output -> the tensor it reads}.

    A quantized tensor X (QuantizeLinear(X) -> Xq) gets DequantizeLinear(Xq) as an output of its
    own: the quantized node units stay whole, which QNN needs to take them. A float-island tensor
    (an op output that some non-QuantizeLinear node reads: the residual stream's Adds and norms)
    is output as it is. A quantized op's own float output, read only by its QuantizeLinear, is
    not probed: as a graph output it would split the node unit the HTP fuses."""
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    consts = {i.name for i in m.graph.initializer}
    consumers: dict[str, list] = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    outputs = {o.name for o in m.graph.output}
    probes: dict[str, str] = {}
    for n in list(m.graph.node):
        if n.op_type == "QuantizeLinear" and n.input[0] not in consts:
            probe = f"{n.input[0]}__probe"
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"}
            m.graph.node.append(helper.make_node("DequantizeLinear", [n.output[0], *n.input[1:]], [probe],
                                                 name=f"{n.name}__probe", **attrs))
            probes[probe] = n.input[0]
        elif n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            for o in n.output:
                if o and o not in outputs and any(c.op_type != "QuantizeLinear" for c in consumers.get(o, [])):
                    probes[o] = o
    return m, probes


def compare_htp(ref_model, test_model, feeds: dict[str, np.ndarray], target: dict, work: Path) -> list[dict]:
    """Every tensor TEST quantizes or keeps float, in TEST's order: REF (CPU EP), TEST on the CPU EP
    and TEST compiled for `target`'s HTP, on the same feeds (module docstring)."""
    import onnx
    from onnx import TensorProto, helper

    from pipeline.graphs import qnn

    probed, probes = htp_probes(test_model)
    names = list(probes)
    cpu_out = dict(zip(names, _session(_with_all_outputs(probed, names)).run(names, feeds)))
    ref_names = {o for n in ref_model.graph.node for o in n.output}
    suffix = "_QuantizeLinear_Input"  # ONNX Runtime's name for a graph output's tensor before its Q/DQ
    probes = {p: t[: -len(suffix)] if t.endswith(suffix) and t[: -len(suffix)] in ref_names else t
              for p, t in probes.items()}
    ref_want = sorted({probes[p] for p in names if probes[p] in ref_names})
    ref_out = dict(zip(ref_want, _session(_with_all_outputs(ref_model, ref_want)).run(ref_want, feeds)))
    keep = [p for p in names if cpu_out[p].dtype == np.float32]
    # The HTP's outputs need their types and static shapes: taken from the CPU EP's run.
    del probed.graph.output[len(test_model.graph.output):]
    probed.graph.output.extend(helper.make_tensor_value_info(p, TensorProto.FLOAT, list(cpu_out[p].shape))
                               for p in keep)
    work.mkdir(parents=True, exist_ok=True)
    src = work / "probed.onnx"
    onnx.save(probed, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
              location="probed.onnx.data", size_threshold=1024)
    del probed
    qnn.compile_context(src, work / "ctx", target, "w8a16")
    sess = qnn.htp_session(work / "ctx" / qnn.CONTEXT_MODEL, target, "w8a16")
    want = {i.name for i in sess.get_inputs()}
    htp_out = dict(zip(keep, sess.run(keep, {k: v for k, v in feeds.items() if k in want})))
    rows = []
    for p in keep:
        x, c, h = ref_out.get(probes[p]), cpu_out[p], htp_out[p]
        rows.append({"tensor": probes[p], "quantized": p.endswith("__probe"),
                     "ref_cpu_db": snr(x, c) if x is not None and x.shape == c.shape else None,
                     "ref_htp_db": snr(x, h) if x is not None and x.shape == h.shape else None,
                     "cpu_htp_db": snr(c, h), "cpu_range": [float(c.min()), float(c.max())] if c.size else None,
                     "htp_range": [float(h.min()), float(h.max())] if h.size else None})
    return rows


def _device_target(name: str) -> dict:
    from omegaconf import OmegaConf

    path = Path(__file__).resolve().parents[2] / "conf" / "device" / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"graph_diff: --htp {name}: no conf/device/{name}.yaml")
    target = OmegaConf.to_container(OmegaConf.load(path)).get("qnn")
    if not target:
        raise SystemExit(f"graph_diff: --htp {name}: conf/device/{name}.yaml has no qnn target (an HTP device "
                         "such as galaxy_s25)")
    return target


def main(argv: list[str] | None = None) -> int:
    from pipeline.sources.tensorfile import load_onnx

    ap = argparse.ArgumentParser(prog="python -m pipeline.measure.graph_diff", description=__doc__.split("\n\n")[0])
    ap.add_argument("ref", type=Path, help="the reference graph (e.g. the fp32 export)")
    ap.add_argument("test", type=Path, help="the graph under test (e.g. its QDQ variant)")
    ap.add_argument("--io", type=Path, required=True, help="io.json of the decode step both graphs implement")
    ap.add_argument("--tokens", default="2,100,200", help="token ids fed before the compared step (comma-separated)")
    ap.add_argument("--below", type=float, default=30.0, help="report tensors below this SNR (dB)")
    ap.add_argument("--show", type=int, default=8, help="how many tensors below the threshold to print")
    ap.add_argument("--json", action="store_true", help="print every compared tensor as JSON")
    ap.add_argument("--htp", metavar="DEVICE", help="also run TEST (a QDQ graph) compiled for DEVICE's HTP "
                    "(conf/device/DEVICE.yaml, e.g. galaxy_s25) and compare the CPU EP with the HTP")
    ap.add_argument("--work", type=Path, help="--htp: where the probed graph and its context binary go "
                    "(default: a temporary folder)")
    a = ap.parse_args(argv)
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    if not tokens:
        ap.error("--tokens needs at least one token id")
    io_dir = a.io.parent
    ref_rel = Path(a.ref).resolve()
    feeds = decode_feeds(io_dir, tokens, model_file=str(ref_rel))
    if a.htp:
        return _main_htp(a, feeds, tokens)
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


@contextlib.contextmanager
def _native_stdout_to_stderr():
    """The HTP backend's native library writes a banner ("# LIBNATIVE: ...") to file descriptor 1,
    which would corrupt --json: while it runs, descriptor 1 is the process's stderr."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _main_htp(a, feeds: dict, tokens: list[int]) -> int:
    import tempfile

    from pipeline.graphs import qnn
    from pipeline.sources.tensorfile import load_onnx

    reason = qnn.missing()
    if reason:
        raise SystemExit(f"graph_diff: --htp needs onnxruntime-qnn: {reason}")
    target = _device_target(a.htp)
    with tempfile.TemporaryDirectory(prefix="graph-diff-htp-") as tmp, _native_stdout_to_stderr():
        rows = compare_htp(load_onnx(a.ref), load_onnx(a.test), feeds, target, a.work or Path(tmp))
    if a.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    worst = [r for r in rows if r["cpu_htp_db"] < a.below]
    print(f"{len(rows)} tensors at step {len(tokens) - 1} on the CPU EP and on the HTP ({a.htp}); "
          f"{len(worst)} where they differ by more than {a.below:g} dB SNR")
    fmt = lambda v: "    -" if v is None else f"{v:7.2f}"  # noqa: E731
    print(f"  {'tensor':<48} {'ref/cpu':>7} {'ref/htp':>7} {'cpu/htp':>7}  cpu range / htp range")
    for r in worst[: a.show]:
        print(f"  {r['tensor']:<48} {fmt(r['ref_cpu_db'])} {fmt(r['ref_htp_db'])} {fmt(r['cpu_htp_db'])}  "
              f"{r['cpu_range']} / {r['htp_range']}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
