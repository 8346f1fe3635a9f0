"""A Genie-form QDQ graph's boundary in the types Genie's engine reads and writes.

Genie (Qualcomm's LLM runtime) writes a quantized graph's inputs as codes and copies the
KV outputs' bytes into the KV inputs itself (nsp-model.cpp: quantizeInput, setupAttentionMask,
the rotary tables quantized with the tensor's own scale and offset, the KV manager's copies;
its validator refuses a past_*_in and its past_*_out whose scale or offset differ). A QDQ graph
from ONNX Runtime's quantizer has float inputs each read by a QuantizeLinear, and float
outputs each made by a DequantizeLinear: `quantized_boundary` takes those nodes out, so the
graph's inputs and outputs are the uint16 codes themselves (QNN's ufixed16 tensors once
compiled, with the encoding of the DequantizeLinear / QuantizeLinear they replace), and says
each boundary tensor's encoding in QNN's convention (value = (code + offset) x scale).

Written over the ONNX protobuf: two node patterns, exact (npu_rewrite.py says why by hand).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

# Logits stay float: Genie dequantizes a quantized logits tensor and reads a float one as it is, and a
# 16-bit code of a logit would add a rounding the parity stage then has to tell apart.
KEEP_FLOAT = ("logits",)


class BoundaryError(ValueError):
    """A graph whose boundary is not the quantizer's Q / DQ pattern (user-facing)."""


def _scalar(inits: dict, name: str):
    return numpy_helper.to_array(inits[name]).reshape(-1)


def uint16_encoding(rmin: float, rmax: float) -> dict:
    """ONNX Runtime's asymmetric uint16 encoding of [rmin, rmax] (0 inside), in QNN's convention."""
    lo, hi = min(float(rmin), 0.0), max(float(rmax), 0.0)
    scale = np.float32((hi - lo) / 65535 or 1.0)
    return {"dtype": "uint16", "scale": float(scale), "offset": -int(np.clip(round(-lo / float(scale)), 0, 65535))}


def quantized_boundary(model: onnx.ModelProto, keep_float=KEEP_FLOAT,
                       given: dict | None = None) -> tuple[onnx.ModelProto, dict]:
    """In place: every graph input read by a QuantizeLinear becomes that node's code (its dtype, the same
    name; a reader of the float, a float island such as the residual stream, then reads its codes
    dequantized; an input read by float islands only, given an encoding in `given` {name: encoding, e.g.
    uint16_encoding(min, max)}, takes codes in it, dequantized for them), every graph output made by a DequantizeLinear becomes the DequantizeLinear's input (the
    same name; the float stays for readers inside the graph), except the names in `keep_float`. Returns the model and
    {name: {"dtype", "scale", "offset"}} (QNN's offset = -zero_point) for each tensor turned."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    producer = {o: n for n in g.node for o in n.output}
    encodings, drop = {}, []

    def encoding(node, dtype) -> dict:
        scale, zp = _scalar(inits, node.input[1]), _scalar(inits, node.input[2])
        if scale.size != 1:
            raise BoundaryError(f"{node.name}: a per-axis encoding at the graph's boundary")
        return {"dtype": np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype)).name, "scale": float(scale[0]),
                "offset": -int(zp[0])}

    for vi in g.input:
        if vi.name in keep_float or vi.name in inits:
            continue
        users = readers.get(vi.name, [])
        qs = [n for n in users if n.op_type == "QuantizeLinear"]
        if not qs and vi.name in (given or {}):  # read by float islands only (the residual stream's first Add
            # and norm read the embeddings): codes in the given encoding, dequantized for those readers
            enc = dict(given[vi.name])
            scale, zp = f"{vi.name}__scale", f"{vi.name}__zero_point"
            g.initializer.extend([numpy_helper.from_array(np.asarray(enc["scale"], np.float32), scale),
                                  numpy_helper.from_array(np.asarray(-enc["offset"], np.uint16), zp)])
            inner = f"{vi.name}__dequantized"
            g.node.insert(0, onnx.helper.make_node("DequantizeLinear", [vi.name, scale, zp], [inner],
                                                   name=f"{vi.name}__dequantize"))
            for n in users:
                n.input[:] = [inner if i == vi.name else i for i in n.input]
            vi.type.tensor_type.elem_type = onnx.TensorProto.UINT16
            encodings[vi.name] = enc
            continue
        if len(qs) != 1:
            continue
        q = qs[0]
        dtype = inits[q.input[2]].data_type
        encodings[vi.name] = encoding(q, dtype)
        code = q.output[0]
        for n in readers.get(code, []):  # the code's readers read the input itself
            n.input[:] = [vi.name if i == code else i for i in n.input]
        vi.type.tensor_type.elem_type = dtype
        drop.append(q)
        floats = [n for n in users if n is not q]
        if floats:  # readers of the float (a float island: the residual stream) read its dequantized codes
            inner = f"{vi.name}__dequantized"
            g.node.insert(0, onnx.helper.make_node("DequantizeLinear", [vi.name, q.input[1], q.input[2]], [inner],
                                                   name=f"{vi.name}__dequantize"))
            for n in floats:
                n.input[:] = [inner if i == vi.name else i for i in n.input]
    for vo in g.output:
        if vo.name in keep_float:
            continue
        dq = producer.get(vo.name)
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        code = dq.input[0]
        dtype = inits[dq.input[2]].data_type
        encodings[vo.name] = encoding(dq, dtype)
        if readers.get(vo.name):  # read inside too (a new key, also attended to): they keep the float
            inner = f"{vo.name}__dequantized"
            for n in readers[vo.name]:
                n.input[:] = [inner if i == vo.name else i for i in n.input]
            dq.output[:] = [inner]
        else:
            drop.append(dq)
        for n in readers.get(code, []):
            n.input[:] = [vo.name if i == code else i for i in n.input]
        producer[code].output[:] = [vo.name if o == code else o for o in producer[code].output]
        vo.type.tensor_type.elem_type = dtype
    for n in drop:
        g.node.remove(n)
    return model, encodings


def kv_pairs(encodings: dict) -> list[str]:
    """The KV tensors (without their _in / _out) whose in and out both have an encoding: past_key_i, and the
    sliding layers' cache group's swa_key_i (decode_graph, "Genie's form"), in name order."""
    return sorted(n[:-3] for n in encodings if n.endswith("_in") and ("key" in n or "value" in n)
                  and n[:-3] + "_out" in encodings)


def tie_kv(model: onnx.ModelProto, encodings: dict) -> int:
    """In place: each KV pair's *_in and *_out given one encoding, over the union of the two
    calibrated ranges, since Genie's validator refuses a pair whose scale or offset differ at all (its engine
    copies the out codes into the in buffer). The quantizer calibrates them apart: the new entry's range and
    the cache's, often one shared through the Concat that joins them but rounded apart, sometimes not shared
    (a tiny Llama's layer 3 key: scale 1.756e-05 in, 1.781e-05 out). A wider range quantizes the same
    values, never clips them. Returns the pairs changed."""
    changed = 0
    for kv in kv_pairs(encodings):
        names = (f"{kv}_in", f"{kv}_out")
        a, b = (encodings[n] for n in names)
        if a == b:
            continue
        if a["dtype"] != b["dtype"]:
            raise BoundaryError(f"{kv}: in {a['dtype']}, out {b['dtype']}")
        top = np.iinfo(a["dtype"]).max
        (a_lo, a_hi), (b_lo, b_hi) = _ends(a), _ends(b)
        lo, hi = min(a_lo, b_lo, 0.0), max(a_hi, b_hi, 0.0)
        scale = np.float32((hi - lo) / top)
        offset = int(round(lo / float(scale)))
        tied = {"dtype": a["dtype"], "scale": float(scale), "offset": offset}
        for name in names:
            _set(model, name, tied)
            encodings[name] = dict(tied)
        changed += 1
    return changed


def _set(model: onnx.ModelProto, name: str, enc: dict) -> None:
    """Every Q / DQ of boundary tensor `name` (its code's producer and readers) given encoding `enc`."""
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and (name in n.output or n.input[0] == name):
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(np.asarray(enc["scale"], np.float32), n.input[1]))
            zp = numpy_helper.to_array(inits[n.input[2]])
            inits[n.input[2]].CopyFrom(numpy_helper.from_array(np.asarray(-enc["offset"], zp.dtype), n.input[2]))


def impose(model: onnx.ModelProto, encodings: dict, want: dict, codes: int = 2) -> int:
    """In place: each boundary tensor of `encodings` that `want` also names given `want`'s encoding exactly,
    where the two ranges' ends lie within `codes` steps of each other (float rounding, not a different
    range): a prompt graph quantized with the token graph's encodings as overrides comes out a step apart
    here and there (a KV pair's union computed anew, the quantizer's range rounded to its codes and back:
    Gemma 3 270M's swa_key_1_in at scale 5.874917e-4 against 5.874843e-4, one uint16 step over the range),
    and Genie's validator compares them exactly. BoundaryError where they differ in earnest. Returns the
    tensors changed."""
    changed = 0
    for name, e in encodings.items():
        w = want.get(name)
        if w is None or e == w:
            continue
        if e["dtype"] != w["dtype"] or max(abs(a - b) for a, b in zip(_ends(e), _ends(w))) > codes * w["scale"]:
            raise BoundaryError(f"{name}: {e}, where {w} is wanted")
        _set(model, name, w)
        encodings[name] = dict(w)
        changed += 1
    return changed


def _ends(enc: dict) -> tuple[float, float]:
    """The float range an encoding's codes span (QNN's convention: value = (code + offset) * scale)."""
    return enc["offset"] * enc["scale"], (int(np.iinfo(enc["dtype"]).max) + enc["offset"]) * enc["scale"]


def untied(encodings: dict) -> list[str]:
    """The KV pairs whose in and out encodings differ (what Genie's validator refuses)."""
    return [kv for kv in kv_pairs(encodings) if encodings[f"{kv}_in"] != encodings[f"{kv}_out"]]


def quantize(x: np.ndarray, enc: dict) -> np.ndarray:
    """Codes of `x` in encoding `enc` (QNN's convention), rounded to nearest and clipped to the dtype (how
    the LUT is written; Genie's engine truncates where it quantizes itself)."""
    info = np.iinfo(enc["dtype"])
    return np.clip(np.rint(x / enc["scale"]) - enc["offset"], info.min, info.max).astype(enc["dtype"])


def dequantize(codes: np.ndarray, enc: dict) -> np.ndarray:
    return ((codes.astype(np.float64) + enc["offset"]) * enc["scale"]).astype(np.float32)
