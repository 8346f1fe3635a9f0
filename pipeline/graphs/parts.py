"""A phone graph in parts under the HTP's per-graph budget, cut between decoder layers.

Why: the Hexagon NPU maps one graph's context into a 32-bit address space, so a graph past about
2 GiB does not compile or load ("estimated allocation of 2347229 KB, limit is 2097152 KB": Qualcomm
ai-hub-models issue 129; "address space limitation of the Hexagon", issue 100). Qualcomm's own LLM
exports split the model into parts of whole layers (Llama-3.2-1B: 3 parts of 8 layers; Qwen2.5-1.5B:
4 parts) and run them in order, each part's hidden state the next one's input. The budget is a
device-config figure (`device.qnn.max_graph_bytes`, conf/device/galaxy_s2*.yaml).

The rule (`plan`): the fewest parts, layers spread as evenly as they go, such that every part's
weights (its initializers' bytes: what its context binary holds) fit the budget; the final norm and
the head go with the last layer, the embedding lookup is off the graph already (npu_rewrite).
`split` cuts a graph at the residual stream's tensor between two layers (npu_rewrite.residual_tensors):
part k reads the stream where part k-1 left it, each layer's past K/V and the position inputs it
needs (a computation that depends only on graph inputs, such as the rope tables' lookups, is repeated
in every part that uses it), and writes the stream and its layers' present K/V; the last writes the
logits. `PartsSession` runs the parts in order behind the one-session API OnnxDecoder calls.

Hand-written, not onnx.utils.Extractor: the extractor keeps only the inputs it is given (a part
needs graph inputs found by walking back from its outputs) and loads external data, which at 1-2B
is gigabytes; this walks the node list and copies initializers as references to the same data file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

import onnx

from pipeline.graphs.npu_rewrite import residual_tensors

# A layer's K/V outputs: the decode step's new_key_i / new_value_i (pipeline/graphs/decode_graph.py), Genie's
# form's past_key_i_out / past_value_i_out (swa_key_i_out / swa_value_i_out: its sliding layers' cache group),
# or present_key_i / present_value_i.
_PRESENT = re.compile(r"^(?:(?:new|present)_(?:key|value)_(\d+)|(?:past|swa)_(?:key|value)_(\d+)_out)$")


class PartsError(ValueError):
    """A graph that cannot be cut into parts under the budget (user-facing)."""


def _tensor_bytes(t: onnx.TensorProto, float_itemsize: int | None = None) -> int:
    """Bytes of an initializer, as stored; with `float_itemsize`, its float32 values counted at that width
    (the HTP holds an fp16 graph's float32 weights as fp16: 2)."""
    n = math.prod(t.dims) if t.dims else 1
    if float_itemsize and t.data_type == onnx.TensorProto.FLOAT:
        return n * float_itemsize
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
    if t.raw_data:
        return len(t.raw_data)
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):  # two to a byte (numpy holds one)
        return (n + 1) // 2
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def weight_bytes(model: onnx.ModelProto, float_itemsize: int | None = None) -> int:
    """The graph's weights: its initializers' bytes (float32 ones at `float_itemsize` where given)."""
    return sum(_tensor_bytes(t, float_itemsize) for t in model.graph.initializer)


def _part_nodes(model: onnx.ModelProto, outputs: Sequence[str], stop: str | None) -> list[int]:
    """Indices (graph order) of the nodes that compute `outputs`, walking back until `stop` (the stream
    tensor the part reads), graph inputs and initializers."""
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output}
    need, seen = list(outputs), set()
    while need:
        t = need.pop()
        if t == stop or t not in producer:
            continue
        i = producer[t]
        if i in seen:
            continue
        seen.add(i)
        need.extend(x for x in model.graph.node[i].input if x)
    return sorted(seen)


def _outputs_of(model: onnx.ModelProto, first: int, last: int, n_layers: int) -> list[str]:
    """The graph outputs a part over layers [first, last) writes: its layers' present K/V, and, for the
    last part, the rest (the logits)."""
    outs = []
    for o in model.graph.output:
        m = _PRESENT.match(o.name)
        if m:
            if first <= int(m.group(1) or m.group(2)) < last:
                outs.append(o.name)
        elif last == n_layers:
            outs.append(o.name)
    return outs


def boundaries(model: onnx.ModelProto, float_model: onnx.ModelProto | None = None) -> list[str]:
    """The stream tensor before each layer, and after the last (index = layer): the residual stream's
    embedding tensor and every second Add's output (npu_rewrite.residual_tensors). A QDQ graph's stream
    is found on the float graph it was quantized from (`float_model`; its Adds keep their names and
    float outputs there, npu_rewrite.residual_stream), then checked to be computed in the QDQ graph."""
    tensors = residual_tensors(float_model if float_model is not None else model)
    if len(tensors) < 3 or (len(tensors) - 1) % 2:
        raise PartsError(f"the graph's residual stream has {len(tensors)} tensors, not 1 + 2 per layer: "
                         "no layer boundaries to cut at (a QDQ graph: pass the float graph it came from)")
    bounds = tensors[0::2]
    known = {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}
    lost = [b for b in bounds if b not in known]
    if lost:
        raise PartsError(f"the layer boundaries {lost[:3]} are not tensors of this graph")
    return bounds


def _part(model: onnx.ModelProto, first: int, last: int, bounds: Sequence[str]) -> tuple[list[str], list[int]]:
    """(the outputs, the node indices) of the part over layers [first, last): its layers' K/V, the stream
    where it leaves it (the logits for the last part), and the nodes back to the stream it reads."""
    n = len(bounds) - 1
    outs = _outputs_of(model, first, last, n) + ([bounds[last]] if last < n else [])
    return outs, _part_nodes(model, outs, bounds[first] if first else None)


def _used_initializers(model: onnx.ModelProto, nodes: Sequence[int]) -> set[str]:
    inits = {t.name for t in model.graph.initializer}
    return {x for i in nodes for x in model.graph.node[i].input if x in inits}


def part_bytes(model: onnx.ModelProto, first: int, last: int, bounds: Sequence[str],
               float_itemsize: int | None = None) -> int:
    """The weights (initializer bytes, `_tensor_bytes`) of the part over layers [first, last) (`bounds`:
    `boundaries`)."""
    _, nodes = _part(model, first, last, bounds)
    inits = {t.name: t for t in model.graph.initializer}
    return sum(_tensor_bytes(inits[x], float_itemsize) for x in _used_initializers(model, nodes))


def plan(model: onnx.ModelProto, budget: int, bounds: Sequence[str],
         float_itemsize: int | None = None) -> list[tuple[int, int]]:
    """Layer ranges [first, last) of the fewest parts, as even as they go, each part's weights within
    `budget` bytes. One part where the whole graph fits."""
    n = len(bounds) - 1
    for count in range(1, n + 1):
        cuts = [round(k * n / count) for k in range(count + 1)]
        ranges = list(zip(cuts[:-1], cuts[1:]))
        if max(part_bytes(model, a, b, bounds, float_itemsize) for a, b in ranges) <= budget:
            return ranges
    size = {i: part_bytes(model, i, i + 1, bounds, float_itemsize) for i in range(n)}
    worst = max(size, key=size.get)
    raise PartsError(f"layer {worst} alone holds {size[worst] / 2**20:.0f} MiB of weights, "
                     f"over the per-graph budget of {budget / 2**20:.0f} MiB (device.qnn.max_graph_bytes): "
                     "no cut between layers fits it")


def _value_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    for vi in inferred.graph.value_info:
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi
    raise PartsError(f"the stream tensor {name!r} has no known type or shape to cut the graph at")


def split(model: onnx.ModelProto, ranges: Sequence[tuple[int, int]], bounds: Sequence[str], out_dir: Path,
          stem: str = "part", float_itemsize: int | None = None) -> list[dict[str, Any]]:
    """Write one graph per layer range into out_dir/<stem><k>.onnx; initializers are copied as they are
    (external ones keep their location, so out_dir must hold the data files the source graph names).
    Returns each part's file, layers, inputs, outputs and the stream tensors it reads and writes."""
    n = len(bounds) - 1
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != n or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise PartsError(f"parts {list(ranges)} do not cover layers 0..{n} in order")
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {i.name: i for i in g.input}
    graph_outputs = {o.name: o for o in g.output}
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, owner = [], {}
    for k, (first, last) in enumerate(ranges):
        stream_in = bounds[first] if first else None
        stream_out = bounds[last] if last < n else None
        outs, idx = _part(model, first, last, bounds)
        nodes = [g.node[i] for i in idx]
        used = {x for nd in nodes for x in nd.input if x}
        produced = {o for nd in nodes for o in nd.output}
        inputs = ([_value_info(model, stream_in)] if stream_in else []) + [
            graph_inputs[x] for x in graph_inputs if x in used and x not in inits]
        missing = sorted(x for x in used if x not in produced and x not in inits and x not in graph_inputs
                         and x != stream_in)
        if missing:
            raise PartsError(f"part {k} (layers {first}..{last - 1}) reads {missing[:3]}, computed in another part: "
                             "the graph cannot be cut at this layer")
        for i in idx:  # a node that reads the stream belongs to one part only
            if i in owner and any(x in bounds for x in g.node[i].input):
                raise PartsError(f"node {g.node[i].name!r} would run in parts {owner[i]} and {k}")
            owner.setdefault(i, k)
        outputs = [graph_outputs[o] if o in graph_outputs else _value_info(model, o) for o in outs]
        weights = sorted(_used_initializers(model, idx))
        part_graph = onnx.helper.make_graph(nodes, f"{g.name}_{stem}{k}", inputs, outputs,
                                            [inits[x] for x in weights])
        part = onnx.helper.make_model(part_graph, opset_imports=list(model.opset_import),
                                      ir_version=model.ir_version, producer_name="edgekiln parts")
        path = out_dir / f"{stem}{k}.onnx"
        onnx.save(part, str(path))
        parts.append({"file": path.name, "layers": [first, last], "inputs": [i.name for i in inputs],
                      "outputs": list(outs), "stream_in": stream_in, "stream_out": stream_out,
                      "weight_bytes": sum(_tensor_bytes(inits[x], float_itemsize) for x in weights)})
    return parts


def link_data(model: onnx.ModelProto, src_dir: Path, out_dir: Path) -> list[str]:
    """The data files `model`'s external initializers name, hard-linked from src_dir into out_dir (copied
    where the two are on different file systems), so that parts written there find them: ONNX Runtime
    refuses an external data path that resolves outside the model's folder, a symlink's target included."""
    import os
    import shutil

    names = sorted({e.value for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                    for e in t.external_data if e.key == "location"})
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        dst = out_dir / name
        if not dst.exists():
            try:
                os.link(src_dir / name, dst)
            except OSError:
                shutil.copy2(src_dir / name, dst)
    return names


class PartsSession:
    """Sessions of a graph's parts, run in order behind one session's `run(output_names, feed)`: each
    part gets the feed's entries it takes and the stream its predecessor wrote (pipeline/runtimes/onnx.py
    OnnxDecoder runs a phone build through it as through the whole graph's session)."""

    def __init__(self, sessions: Sequence[Any], parts: Sequence[dict]):
        if len(sessions) != len(parts) or not parts:
            raise ValueError("one session per part, at least one")
        self.sessions, self.parts = list(sessions), list(parts)

    def run(self, output_names, feed: dict) -> list:
        values: dict = {}
        stream = None
        for sess, part in zip(self.sessions, self.parts):
            f = {x: feed[x] for x in part["inputs"] if x in feed}
            if part["stream_in"]:
                f[part["stream_in"]] = stream
            res = sess.run(part["outputs"], f)
            values.update(zip(part["outputs"], res))
            stream = values.get(part["stream_out"]) if part["stream_out"] else None
        names = output_names or [o for p in self.parts for o in p["outputs"] if o != p["stream_out"]]
        return [values[x] for x in names]


def assemble(models: dict[str, onnx.ModelProto], choice: Sequence[tuple[int, int, str]], bounds: Sequence[str],
             head: str | None = None, name: str = "mixed") -> onnx.ModelProto:
    """One graph whose layers [first, last) are taken from `models[key]` for each (first, last, key) of
    `choice` (covering every layer in order), and, with `head`, the final norm and head (every node after
    the last layer's stream) from `models[head]`, else from the last range's: a phone graph with 4-bit
    weights in some parts and 8-bit in the rest. The models are QDQ graphs of the same float graph (the
    same nodes and tensor names, the weights' codes, scales and DequantizeLinear attributes apart);
    `bounds` their layer boundaries (`boundaries`). Each range's nodes are the ones `split` would give its
    part, kept in graph order, a node whose outputs an earlier range already computes (a lookup of graph
    inputs repeated per part) taken once. An initializer both sources use must be the same in both (the
    activations' scales are: one calibration), else the graph cannot be assembled (PartsError).
    Initializers are copied with their data: load the models with it."""
    import numpy as np
    from onnx import numpy_helper

    n = len(bounds) - 1
    ranges = [(a, b) for a, b, _ in choice]
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != n or any(x[1] != y[0] for x, y in zip(ranges, ranges[1:])):
        raise PartsError(f"ranges {ranges} do not cover layers 0..{n} in order")
    base = models[choice[0][2]]

    def units():  # (source, its nodes) in graph order: each range, then the head where it is apart
        for first, last, key in choice:
            model = models[key]
            if head is None or last < n:
                yield key, _part(model, first, last, bounds)[1]
            else:  # the last range up to the stream the head reads
                outs = [o for o in _outputs_of(model, first, last, n) if _PRESENT.match(o)] + [bounds[n]]
                yield key, _part_nodes(model, outs, bounds[first] if first else None)
        if head is not None:
            model = models[head]
            yield head, _part_nodes(model, [o.name for o in model.graph.output if not _PRESENT.match(o.name)], bounds[n])

    nodes, inits, produced, infos = [], {}, set(), []
    for key, idx in units():
        model = models[key]
        table = {t.name: t for t in model.graph.initializer}
        known = {vi.name: vi for vi in model.graph.value_info}
        for i in idx:
            node = model.graph.node[i]
            repeated = all(o in produced for o in node.output if o)  # computed by an earlier range: checked, not kept
            if not repeated:
                produced.update(o for o in node.output if o)
                nodes.append(node)
                # the quantizer's shapes and types: the QNN EP refuses a MatMul or Reshape it cannot shape
                infos.extend(known[o] for o in node.output if o in known)
            for x in node.input:
                if x not in table:
                    continue
                if x in inits:
                    if inits[x] is not table[x] and not np.array_equal(numpy_helper.to_array(inits[x]),
                                                                        numpy_helper.to_array(table[x])):
                        raise PartsError(f"{x!r} differs between the graphs assembled ({key!r}'s and another's): "
                                         "they were not quantized from one calibration")
                    continue
                if not repeated:
                    inits[x] = table[x]
    missing = sorted({o.name for o in base.graph.output} - produced)
    if missing:
        raise PartsError(f"the assembled graph computes none of {missing[:3]}")
    graph = onnx.helper.make_graph(nodes, f"{base.graph.name}_{name}", list(base.graph.input),
                                   list(base.graph.output), list(inits.values()), value_info=infos)
    return onnx.helper.make_model(graph, opset_imports=list(base.opset_import), ir_version=base.ir_version,
                                  producer_name="edgekiln parts")
