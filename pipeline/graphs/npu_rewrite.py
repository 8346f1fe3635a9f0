"""Graph rewrites that turn the exported decode step into one QNN's HTP backend
compiles and runs accurately, each a pure function ModelProto -> ModelProto
(`prepare` chains them in place on its argument, for memory) that computes
the same thing (tests/test_npu_rewrite.py proves each on a small
graph that contains the pattern).

Written by hand over the ONNX protobuf: the patterns are few and exact, and
onnxscript's rewriter would add a pattern language for five rules. Why each:

- `sanitize` (field notes, "Phone NPU"): what the dynamo exporter may emit and
  QNN's converter rejects.
  * Reshape with allowzero=1: QNN has no allowzero; with static shapes and no
    zero-sized dimension it means the same as allowzero=0.
  * IsNaN/Where guards (`Where(IsNaN(x), c, x)`): the exporter's protection of
    a fully masked softmax row. The decode step's mask is a modest additive
    constant (export.mask_value), never -inf, so no row is ever all-masked and
    the guard is the identity; QNN has no IsNaN.
  * rank-0 axes initializers on Unsqueeze/Squeeze: QNN wants a 1-D axes tensor.
- `rope_tables`: rotary angles computed in the graph as position * inv_freq
  reach context_length radians. In fp16 (the HTP's float) the angle at 255
  has a ulp of 0.125 rad, and under 16-bit activation quantization it is one
  more quantized tensor. Every float tensor that depends on `position` alone
  (cos and sin) becomes a Gather from a precomputed [context, ...] table, whose
  values lie in [-1, 1]: the angle is never materialized on the device.
- `fuse_rms_norm`: the exporter decomposes RMSNorm into Pow, ReduceMean, Add,
  Sqrt, Reciprocal, Mul. Under 16-bit activations each intermediate gets its
  own calibrated range: x^2 and 1/rms span orders of magnitude, an input a
  little outside the calibrated range clips them, and the error is amplified
  into every layer's q/k/v (pipeline/measure/graph_diff.py shows the chain). One
  SimplifiedLayerNormalization (QNN's RmsNorm) keeps those intermediates
  inside the op.
- `embedding_ranges`: the quantization range of the embedding lookup (and of
  its scaling by a constant) from the whole table, not from the tokens the
  calibration text happened to contain.

Measured on the embedded model's w8a16 build (benchmarks/qnn_rewrites.py,
README "Phone NPU builds"): on the parity prompts every variant is near 44-46
dB; on prompts of random token ids (tokens the calibration text may never
hold) the sanitized-only graph falls to 24.3 dB, the embedding ranges lift it
to 34.3 and the fused RMSNorm to 44.0. The notes' 0.5 dB build was not
reproduced with this pipeline's calibration; a prototype calibrated on a
narrower text and fed such tokens ran at 6.6 dB, on the CPU EP's QDQ and the
HTP backend alike, its first divergence the clipped embedding, then the
RMSNorm intermediates (the first graph output below them: layer 0's new K).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper


class RewriteError(ValueError):
    """A graph these rewrites cannot make QNN-ready (user-facing)."""


class _Consts:
    """Name -> the constant's value (initializers, then Constant nodes' `value`,
    as a dict would have it), each converted to numpy only when a rewrite reads
    it: the pattern matchers look at a shape, an exponent, an epsilon, a norm
    weight; the decoder's weights (1.7 GB on Gemma 3 270M) are only ever
    tested for membership. `shape` and `size` read the dims and convert
    nothing. A snapshot of the names at construction, like the dict it replaces."""

    def __init__(self, model: onnx.ModelProto):
        self._t: dict[str, onnx.TensorProto] = {i.name: i for i in model.graph.initializer}
        for n in model.graph.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self._t[n.output[0]] = n.attribute[0].t
        self._arrays: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._t

    def __iter__(self):
        return iter(self._t)

    def __getitem__(self, name: str) -> np.ndarray:
        a = self._arrays.get(name)
        if a is None:
            a = self._arrays[name] = numpy_helper.to_array(self._t[name])
        return a

    def get(self, name: str, default=None):
        return self[name] if name in self._t else default

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._t[name].dims)

    def size(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64))


def _consts(model: onnx.ModelProto) -> _Consts:
    return _Consts(model)


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output if o}


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _rename_uses(model: onnx.ModelProto, old: str, new: str) -> None:
    for n in model.graph.node:
        for k, i in enumerate(n.input):
            if i == old:
                n.input[k] = new
    for o in model.graph.output:
        if o.name == old:
            raise RewriteError(f"cannot rewire graph output {old!r}")


def _reachable(model: onnx.ModelProto) -> tuple[list[onnx.NodeProto], set[str]]:
    """(the nodes something reaches from the graph outputs, in order; every
    tensor name they and the outputs read)."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for n in reversed(model.graph.node):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(i for i in n.input if i)
    keep.reverse()
    return keep, needed


def _prune(model: onnx.ModelProto) -> None:
    """Drop nodes and initializers nothing reaches from the graph outputs.
    Initializers are deleted where they lie, never re-added: rebuilding the
    list (del [:] then extend) copied every kept weight, 1.7 GB on Gemma 3."""
    keep, needed = _reachable(model)
    if len(keep) != len(model.graph.node):
        del model.graph.node[:]
        model.graph.node.extend(keep)
    inits = model.graph.initializer
    dead = [k for k, i in enumerate(inits) if i.name not in needed]
    for k in reversed(dead):
        del inits[k]


def _copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every field but graph.initializer copied (the few nodes
    and value infos, none of the weights)."""
    out = onnx.ModelProto()
    for fd, v in model.ListFields():
        if fd.name == "graph":
            continue
        _copy_field(out, fd, v)
    for fd, v in model.graph.ListFields():
        if fd.name == "initializer":
            continue
        _copy_field(out.graph, fd, v)
    return out


def _copy_field(dst, fd, v) -> None:
    repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED  # protobuf >= 6 / older
    if repeated:
        getattr(dst, fd.name).extend(v)
    elif fd.type == fd.TYPE_MESSAGE:
        getattr(dst, fd.name).CopyFrom(v)
    else:
        setattr(dst, fd.name, v)


# --------------------------------------------------------------------------
# sanitize
# --------------------------------------------------------------------------


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def sanitize(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """(the rewritten copy, how many of each fix were applied)."""
    m = _copy(model)
    return m, _sanitize(m)


def _sanitize(m: onnx.ModelProto) -> dict[str, int]:
    """sanitize, in place on `m`."""
    fixed: Counter = Counter()
    consts = _consts(m)
    producers = _producers(m)

    for n in m.graph.node:
        if n.op_type == "Reshape":
            for a in n.attribute:
                if a.name == "allowzero" and a.i == 1:
                    shape = consts.get(n.input[1])
                    if shape is None:
                        raise RewriteError(f"Reshape {n.name!r} has allowzero=1 and a computed shape; "
                                           "QNN needs static shapes")
                    if (shape == 0).any():
                        raise RewriteError(f"Reshape {n.name!r} has allowzero=1 with a zero in its shape "
                                           f"{shape.tolist()}: not expressible without allowzero")
                    a.i = 0
                    fixed["reshape_allowzero"] += 1

    # Where(IsNaN(x), c, x) -> x
    for n in list(m.graph.node):
        if n.op_type != "Where":
            continue
        cond = producers.get(n.input[0])
        if cond is not None and cond.op_type == "IsNaN" and cond.input[0] == n.input[2]:
            _rename_uses(m, n.output[0], n.input[2])
            m.graph.node.remove(n)
            fixed["isnan_where_guard"] += 1

    # rank-0 axes -> rank-1
    renamed: dict[str, str] = {}
    for n in m.graph.node:
        if n.op_type in ("Unsqueeze", "Squeeze") and len(n.input) > 1 and n.input[1] in consts:
            axes = consts[n.input[1]]
            if axes.ndim == 0:
                name = renamed.get(n.input[1])
                if name is None:
                    name = f"{n.input[1]}__rank1"
                    m.graph.initializer.append(numpy_helper.from_array(axes.reshape(1).astype(np.int64), name))
                    renamed[n.input[1]] = name
                n.input[1] = name
                fixed["rank0_axes"] += 1
    del consts
    _prune(m)
    left = Counter(n.op_type for n in m.graph.node if n.op_type in ("IsNaN",))
    if left:
        raise RewriteError(f"IsNaN nodes remain that are not a Where guard: {dict(left)}")
    return dict(fixed)


# --------------------------------------------------------------------------
# rope tables
# --------------------------------------------------------------------------


def _depends_only_on(model: onnx.ModelProto, source: str) -> set[str]:
    """Tensors computed from `source` and constants alone (source included)."""
    consts = set(_consts(model))
    graph_inputs = {i.name for i in model.graph.input}
    only = {source}
    for n in model.graph.node:  # topological order
        ins = [i for i in n.input if i]
        if ins and all(i in only or (i in consts and i not in graph_inputs) for i in ins) \
                and any(i in only for i in ins):
            only.update(o for o in n.output if o)
    return only


def rope_tables(model: onnx.ModelProto, position: str, context_length: int) -> tuple[onnx.ModelProto, int]:
    """Replace each Cos/Sin whose input depends on `position` alone by a Gather
    from a table of its values at positions 0..context_length-1.
    Returns (the rewritten copy, tables added)."""
    m = _copy(model)
    return m, _rope_tables(m, position, context_length)


def _rope_tables(m: onnx.ModelProto, position: str, context_length: int) -> int:
    """rope_tables, in place on `m`."""
    import onnxruntime as ort

    only = _depends_only_on(m, position)
    targets = [n for n in m.graph.node if n.op_type in ("Cos", "Sin") and n.input[0] in only]
    if not targets:
        return 0
    # A sub-model from `position` to the targets, evaluated at every position.
    # Built from the graph without its initializers, then given the few the
    # kept nodes read (the inverse frequencies): copying the whole model and
    # pruning it cost a 1.7 GB copy on Gemma 3 270M, and pruning it another.
    sub = _copy_without_initializers(m)
    del sub.graph.output[:]
    sub.graph.output.extend(helper.make_empty_tensor_value_info(n.output[0]) for n in targets)
    keep, needed = _reachable(sub)
    del sub.graph.node[:]
    sub.graph.node.extend(keep)
    sub.graph.initializer.extend(i for i in m.graph.initializer if i.name in needed)
    keep_inputs = [i for i in sub.graph.input if i.name == position]
    del sub.graph.input[:]
    sub.graph.input.extend(keep_inputs)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(sub.SerializeToString(), so, providers=["CPUExecutionProvider"])
    pos_type = keep_inputs[0].type.tensor_type
    pos_dtype = {onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32}[pos_type.elem_type]
    # `position` holds one position per row: [1] in the decode step, [T] in the prompt graph ([1, 1, T] in
    # Genie's form, its position_ids), whose Cos/Sin outputs lead with that axis. Each position's row is
    # computed with every row at it.
    dims = [d.dim_value for d in pos_type.shape.dim]
    n_pos = dims[-1] if dims and all(d == 1 for d in dims[:-1]) else 0
    if n_pos < 1:
        raise RewriteError(f"the graph input {position!r} is not a row of positions of static length")
    names = [n.output[0] for n in targets]
    rows = [sess.run(names, {position: np.full(dims, p, dtype=pos_dtype)}) for p in range(context_length)]
    for k, n in enumerate(targets):
        if rows[0][k].shape[0] != n_pos:
            raise RewriteError(f"{n.output[0]}: a rotary table whose first axis ({rows[0][k].shape}) is not "
                               f"{position!r}'s {n_pos} rows")
        table = np.stack([r[k][0] for r in rows]).astype(np.float32)  # [C, *row shape]
        shape = np.array((n_pos,) + table.shape[1:], dtype=np.int64)
        tname, gname = f"{n.output[0]}__table", f"{n.output[0]}__gathered"
        m.graph.initializer.append(numpy_helper.from_array(table, tname))
        m.graph.initializer.append(numpy_helper.from_array(shape, f"{n.output[0]}__shape"))
        idx = m.graph.node
        at = list(idx).index(n)
        gather = helper.make_node("Gather", [tname, position], [gname], axis=0, name=f"{n.output[0]}__gather")
        reshape = helper.make_node("Reshape", [gname, f"{n.output[0]}__shape"], [n.output[0]],
                                   name=f"{n.output[0]}__reshape")
        m.graph.node.remove(n)
        m.graph.node.insert(at, reshape)
        m.graph.node.insert(at, gather)
    _prune(m)
    return len(targets)


# --------------------------------------------------------------------------
# RMSNorm fusion
# --------------------------------------------------------------------------


def fuse_rms_norm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """x -> Pow(2) -> ReduceMean(last axis) -> Add(eps) -> Sqrt -> Reciprocal
    -> Mul(x, .) -> Mul(., gamma)  ==>  SimplifiedLayerNormalization(x, gamma).
    Returns (the rewritten copy, norms fused)."""
    m = _copy(model)
    return m, _fuse_rms_norm(m)


def _fuse_rms_norm(m: onnx.ModelProto) -> int:
    """fuse_rms_norm, in place on `m`."""
    consts = _consts(m)
    producers = _producers(m)
    consumers = _consumers(m)
    fused = 0

    def only_child(t: str, op: str):
        c = consumers.get(t, [])
        return c[0] if len(c) == 1 and c[0].op_type == op else None

    def const_of(node, x):
        other = [i for i in node.input if i != x]
        return other[0] if len(other) == 1 and other[0] in consts else None

    for pow_ in [n for n in m.graph.node if n.op_type == "Pow"]:
        x = pow_.input[0]
        if pow_.input[1] not in consts or float(consts[pow_.input[1]]) != 2.0:
            continue
        mean = only_child(pow_.output[0], "ReduceMean")
        if mean is None:
            continue
        axes = consts.get(mean.input[1]) if len(mean.input) > 1 else None
        attrs = {a.name: helper.get_attribute_value(a) for a in mean.attribute}
        if axes is None or axes.size != 1 or attrs.get("keepdims", 1) != 1:
            continue
        add = only_child(mean.output[0], "Add")
        eps_name = add and const_of(add, mean.output[0])
        if eps_name is None or consts.size(eps_name) != 1:
            continue
        sqrt = only_child(add.output[0], "Sqrt")
        recip = sqrt and only_child(sqrt.output[0], "Reciprocal")
        mul = recip and only_child(recip.output[0], "Mul")
        if mul is None or x not in mul.input:
            continue
        scale = only_child(mul.output[0], "Mul")
        gamma = scale and const_of(scale, mul.output[0])
        if gamma is None:
            continue
        axis = int(axes.ravel()[0])
        gshape = consts.shape(gamma)
        if axis != -1 or len(gshape) != 1:
            continue
        node = helper.make_node(
            "SimplifiedLayerNormalization", [x, gamma], [scale.output[0]],
            name=f"{scale.output[0]}__rmsnorm", axis=-1, epsilon=float(consts[eps_name].ravel()[0]),
            stash_type=1,
        )
        for dead in (pow_, mean, add, sqrt, recip, mul, scale):
            m.graph.node.remove(dead)
        m.graph.node.append(node)  # put in place by _topo_sort below
        fused += 1
    del consts
    _topo_sort(m)
    _prune(m)
    return fused


def _topo_sort(m: onnx.ModelProto) -> None:
    have = {i.name for i in m.graph.input} | {i.name for i in m.graph.initializer} | {""}
    pending = list(m.graph.node)
    done = []
    while pending:
        rest = []
        for n in pending:
            if all(i in have for i in n.input):
                done.append(n)
                have.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise RewriteError(f"graph has a cycle or a missing input near {rest[0].name!r}")
        pending = rest
    del m.graph.node[:]
    m.graph.node.extend(done)


# --------------------------------------------------------------------------
# quantization ranges the calibration text cannot be trusted with
# --------------------------------------------------------------------------


def embedding_ranges(model: onnx.ModelProto) -> dict[str, list[dict]]:
    """Tensor quantization overrides (ONNX Runtime's `init_overrides` format):
    each Gather from an initializer table gets the table's [min, max], and so
    does its product with a scalar constant (Gemma's embed_scale)."""
    consts = _consts(model)
    out: dict[str, list[dict]] = {}
    for n, scaled in _embedding_lookups(model, consts):
        t = consts[n.input[0]]
        if t.dtype.kind != "f":
            continue
        lo, hi = float(t.min()), float(t.max())
        out[n.output[0]] = [{"rmin": np.float32(lo), "rmax": np.float32(hi)}]
        for c, other in scaled:
            s = float(consts[other].ravel()[0])
            a, b = sorted((lo * s, hi * s))
            out[c.output[0]] = [{"rmin": np.float32(a), "rmax": np.float32(b)}]
    return out


def _embedding_lookups(model: onnx.ModelProto, consts: _Consts):
    """(Gather node, [(Mul node, its scalar constant's name), ...]) for each lookup into an initializer
    table that is not one of rope_tables' (`__table`): the embedding, and its scalings by a constant."""
    inits = {i.name for i in model.graph.initializer}
    consumers = _consumers(model)
    for n in model.graph.node:
        if n.op_type != "Gather" or n.input[0] not in inits or n.input[0].endswith("__table"):
            continue
        yield n, _scalings(n.output[0], consts, consumers)


def _scalings(tensor: str, consts: _Consts, consumers) -> list:
    """[(Mul node, its scalar constant's name), ...]: `tensor`'s products with a scalar constant."""
    scaled = []
    for c in consumers.get(tensor, []):
        other = [i for i in c.input if i != tensor]
        if c.op_type == "Mul" and len(other) == 1 and other[0] in consts and consts.size(other[0]) == 1:
            scaled.append((c, other[0]))
    return scaled


def _scaled(model: onnx.ModelProto, tensor: str) -> str:
    """`tensor` after its chain of scalings by a constant (Gemma's embed_scale; then, in a graph whose stream
    is carried scaled, scale_residual's Mul), else `tensor`."""
    consts, consumers = _consts(model), _consumers(model)
    seen = {tensor}
    while True:
        scaled = _scalings(tensor, consts, consumers)
        if not scaled or scaled[-1][0].output[0] in seen:
            return tensor
        tensor = scaled[-1][0].output[0]
        seen.add(tensor)


EMBEDS_INPUT = "inputs_embeds"


def embedding_input(model: onnx.ModelProto, ids: str = "input_ids") -> tuple[onnx.ModelProto, dict]:
    """The token embedding's lookup taken out of the graph: the Gather from the table becomes a graph
    input `inputs_embeds` (float32, the Gather's output shape: [1, 1, hidden] for the decode step);
    the table leaves the graph where nothing else reads it, and so does `ids` once unused. Rewrites
    `model` in place; returns it and {"table": the float table (numpy), "table_name", "gather_output"
    (the tensor inputs_embeds replaces: range overrides keyed by it move to inputs_embeds), "ids_dims"
    (the ids input's shape, which the lookup takes)}.

    Why (docs/small-artifacts.md): the HTP refuses a per-axis quantized Gather, so in the context
    binary the table was one more 16-bit tensor: on Gemma 3 270M (262,144 x 640) 335 MB of a 613 MB
    w8a16 binary, for a lookup of one row a step. Out of the graph the lookup is an 8-bit
    GatherBlockQuantized on the CPU (the pack stage's `embed/model.onnx`), as the field's phone flows
    run it (ExecuTorch's QNN Llama keeps its quantized embedding off the HTP)."""
    lookups = list(_embedding_lookups(model, _consts(model)))
    if not lookups:
        raise RewriteError("no embedding lookup (a Gather from an initializer table) to take out of the graph")
    gather = lookups[0][0]
    if gather.input[1] != ids:
        raise RewriteError(f"the embedding Gather reads {gather.input[1]!r}, not the graph input {ids!r}")
    table_name, out = gather.input[0], gather.output[0]
    table = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == table_name))
    if table.ndim != 2:
        raise RewriteError(f"the embedding table {table_name!r} has shape {table.shape}, not [vocab, hidden]")
    ids_in = next((i for i in model.graph.input if i.name == ids), None)
    if ids_in is None:
        raise RewriteError(f"the graph has no input {ids!r}")
    dims = [d.dim_value for d in ids_in.type.tensor_type.shape.dim] + [int(table.shape[1])]
    nodes = model.graph.node
    del nodes[[k for k, n in enumerate(nodes) if n is gather][0]]
    _rename_uses(model, out, EMBEDS_INPUT)
    at = [k for k, i in enumerate(model.graph.input) if i.name == ids][0]
    model.graph.input.insert(at, helper.make_tensor_value_info(EMBEDS_INPUT, onnx.TensorProto.FLOAT, dims))
    readers = _consumers(model)
    if ids not in readers:
        del model.graph.input[at + 1]
    if table_name not in readers:
        inits = model.graph.initializer
        del inits[[k for k, i in enumerate(inits) if i.name == table_name][0]]
    return model, {"table": table, "table_name": table_name, "gather_output": out, "ids_dims": dims[:-1]}


RESIDUAL_NORMS = ("SimplifiedLayerNormalization",)


def residual_stream(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The residual stream's nodes, by name: {"adds": the Add nodes that carry it from layer to layer,
    "norms": the (fused) RMSNorms that read it, "writers": the RMSNorms whose output an Add adds to it
    (Gemma's post-attention and post-feedforward norms; a Llama-family graph has none)}.

    Followed from the token embedding's lookup (and its scaling by a constant, Gemma's embed_scale): the
    stream's tensor r has one Add consumer (r + a sublayer's output -> the next r) and reads by norms;
    the last r feeds the final norm only. Why these (docs/phone-fidelity.md): real checkpoints carry
    massive activations in a few residual channels (Gemma 3 270M's stream reaches 28,686 in its last
    layers while most channels are O(1-10)), so one uint16 grid over the stream is steps of ~0.5 and the
    small channels are lost before every norm. Left in float, the HTP runs these nodes in fp16 (ulp 16
    at 28,686, relative 2^-11 everywhere); everything a matmul reads stays 16-bit.

    The writers are where those channels come from: on Gemma 3 270M the o_proj and down_proj outputs
    the post-norms read stay within +-1.3..127 with no outlier, and the post-norms' weights turn them
    into +-400..19,866 (median 0.3..110), so a uint16 grid over a post-norm's output has steps of up to
    0.6, coarser than most of what it writes. Left float, the matmuls' narrow outputs are what is
    quantized."""
    walk = _walk_stream(model)
    return {k: walk[k] for k in ("adds", "norms", "writers")}


def _walk_stream(model: onnx.ModelProto) -> dict:
    """residual_stream's walk; also "tensors" (the stream's tensors: the first, then each Add's output)
    and "others" (consumers of a stream tensor that are neither its Add nor a norm)."""
    consumers = _consumers(model)
    producers = _producers(model)
    start = None
    for n, _ in _embedding_lookups(model, _consts(model)):
        start = _scaled(model, n.output[0])
        break
    if start is None and any(i.name == EMBEDS_INPUT for i in model.graph.input):
        start = _scaled(model, EMBEDS_INPUT)
    adds, norms, writers, tensors, others = [], [], [], [], []
    r = start
    while r is not None:
        tensors.append(r)
        nxt = None
        for c in consumers.get(r, []):
            if c.op_type == "Add" and nxt is None:
                adds.append(c.name)
                nxt = c.output[0]
                writer = producers.get(next((i for i in c.input if i != r), ""))
                if writer is not None and writer.op_type in RESIDUAL_NORMS:
                    writers.append(writer.name)
            elif c.op_type in RESIDUAL_NORMS:
                norms.append(c.name)
            else:
                others.append(c.name)
        r = nxt
    if any(not name for name in adds + norms + writers):
        raise RewriteError("a residual-stream node has no name: ONNX Runtime's quantizer excludes nodes by name")
    return {"adds": adds, "norms": norms, "writers": writers, "tensors": tensors, "others": others}


def residual_tensors(model: onnx.ModelProto) -> list[str]:
    """The residual stream's tensors, in order (the scaled embedding, then each layer's Add output)."""
    return _walk_stream(model)["tensors"]


# fp16's largest value is 65,504: the stream is scaled so that its largest measured entry is at most this
# (a power-of-two factor, so no fp16 rounding), leaving 8x headroom for text larger than the probe's.
FP16_STREAM_LIMIT = 8192.0


def residual_scale_factor(max_abs: float, limit: float = FP16_STREAM_LIMIT) -> int:
    """The power of two the stream is divided by so that `max_abs` fits under `limit` (1: nothing to do)."""
    factor = 1
    while max_abs / factor > limit:
        factor *= 2
    return factor


def scale_residual(model: onnx.ModelProto, factor: int) -> dict:
    """Carry the residual stream divided by `factor` (in place; works on a graph loaded without its
    external data): a Mul by 1/factor after the stream's first tensor and on every sublayer output before
    its Add, and each norm that reads the stream given epsilon / factor^2, so that
    RMSNorm(r / f; eps / f^2) = RMSNorm(r; eps) and the graph computes what it did. Returns the Muls'
    names (float-island nodes, like the stream) and how many norms were changed.

    Why (docs/phone-fidelity.md, finding 5): the HTP runs the float stream in fp16, whose largest value
    is 65,504, and Gemma 3 270M's stream reaches 103,795 at the BOS token (layers 7-17 past 65,504), so
    the first token's hidden state and with it every K/V entry of the attention sink that all later steps
    read was wrong on the phone, and right on the CPU EP (fp32). A power-of-two factor changes no fp16
    rounding of the stream; the norms' outputs, which the rest reads, are unchanged."""
    from onnx import helper, numpy_helper

    if factor <= 1:
        return {"factor": 1, "muls": [], "norms": 0}
    walk = _walk_stream(model)
    if walk["others"]:
        raise RewriteError(f"the residual stream is read by {walk['others'][0]!r}, neither an Add nor an RMSNorm: "
                           "it cannot be carried scaled")
    tensors = walk["tensors"]
    if not walk["adds"]:
        raise RewriteError("no residual stream found to scale")
    nodes = {n.name: n for n in model.graph.node}
    const = "residual_stream_scale"
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.0 / factor, dtype=np.float32), const))
    muls = []

    def mul_after(tensor: str, name: str) -> str:
        out = f"{tensor}__scaled"
        model.graph.node.append(helper.make_node("Mul", [tensor, const], [out], name=name))
        muls.append(name)
        return out

    first = mul_after(tensors[0], "residual_scale/stream_in")
    stream = set(tensors)
    for name in walk["adds"]:
        add = nodes[name]
        for k, i in enumerate(add.input):
            if i == tensors[0]:
                add.input[k] = first
            elif i not in stream:
                add.input[k] = mul_after(i, f"residual_scale/{name}")
    for name in walk["norms"]:
        norm = nodes[name]
        if norm.input[0] == tensors[0]:
            norm.input[0] = first
        eps = next((a for a in norm.attribute if a.name == "epsilon"), None)
        if eps is None:  # the op's default
            norm.attribute.append(helper.make_attribute("epsilon", 1e-5 / factor ** 2))
        else:
            eps.f = eps.f / factor ** 2
    _topo_sort(model)
    return {"factor": int(factor), "muls": muls, "norms": len(walk["norms"])}


def attention_cores(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Every attention's core, by node name: {"scores": the MatMul q . K^T, "masks": the Adds between it and
    the Softmax (the mask), "softmaxes", "mixes": the MatMul softmax . V}.

    Found from each Softmax: back through Adds to a MatMul of two computed tensors, forward to the
    MatMul that reads the softmax. These are the graph's only activation-by-activation products. Why
    they matter (docs/phone-fidelity.md): the HTP computes a MatMul of two 16-bit activations far less
    exactly than the CPU EP's QDQ arithmetic that stands in for it. On Gemma 3 270M's w8a16 graph,
    compared tensor by tensor (`python -m pipeline.measure.graph_diff --htp`), every layer's softmax . V product
    agreed with the CPU EP's at only 12-28 dB, and the scores at 26-42, where the projections feeding them
    agreed at 60-70. Left float, the HTP runs them in fp16."""
    consts = _consts(model)
    producers = _producers(model)
    consumers = _consumers(model)

    cores: dict[str, list[str]] = {"scores": [], "masks": [], "softmaxes": [], "mixes": []}
    for sm in (n for n in model.graph.node if n.op_type == "Softmax"):
        masks, t = [], sm.input[0]
        while t in producers and producers[t].op_type == "Add":
            add = producers[t]
            masks.append(add.name)
            t = next((i for i in add.input if i in producers and producers[i].op_type in ("Add", "MatMul")),
                     None)
            if t is None:
                break
        score = producers.get(t) if t is not None else None
        mixes = [c for c in consumers.get(sm.output[0], []) if c.op_type == "MatMul"]
        if score is None or score.op_type != "MatMul" or any(i in consts for i in score.input) or not mixes:
            continue
        cores["scores"].append(score.name)
        cores["masks"] += masks
        cores["softmaxes"].append(sm.name)
        cores["mixes"] += [c.name for c in mixes]
    if any(not name for names in cores.values() for name in names):
        raise RewriteError("an attention node has no name: ONNX Runtime's quantizer excludes nodes by name")
    return cores


def prepare(model: onnx.ModelProto, *, position: str, context_length: int) -> tuple[onnx.ModelProto, dict]:
    """All rewrites, in order; (the QNN-ready float graph, what was done).

    Rewrites `model` in place and returns it (callers that still need the
    original pass a copy; the copying sanitize/rope_tables/fuse_rms_norm above
    give byte-identical results). Why, measured on Gemma 3 270M's fp32 export
    (1.74 GB of weights, context 1024; RSS in a fresh process, after a 2.32
    GiB peak for onnx.load itself): chaining the copying functions peaked at
    10.5 GiB and took 26 s -- a full copy per rewrite, a full copy for the
    rotary sub-model, every initializer converted to numpy in three places,
    and every _prune re-adding (so copying) each kept weight. In place, with
    constants converted on demand and the sub-model built without the
    weights, prepare adds 0.02 GiB to the loaded model (peak 2.32 GiB) and
    takes 0.1 s; the serialized graph has the same sha256."""
    m = model
    fixed = _sanitize(m)
    tables = _rope_tables(m, position, context_length)
    norms = _fuse_rms_norm(m)
    report = {"sanitize": fixed, "rope_tables": tables, "rms_norms_fused": norms,
              "ops": dict(Counter(n.op_type for n in m.graph.node).most_common())}
    # No onnx.checker here: SimplifiedLayerNormalization is an ONNX Runtime op
    # (registered in the default domain) the checker does not know; the graph
    # is proven by running it (tests, and the pack stage's own check).
    return m, report
