"""Each QNN rewrite on a small graph that contains its pattern: the pattern is
gone afterwards and the graph computes the same (pipeline/graphs/npu_rewrite.py)."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from pipeline.graphs import npu_rewrite  # noqa: E402

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits=(), opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(model, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _f32(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_sanitize_removes_what_qnn_rejects_and_computes_the_same():
    x = _f32("x", [2, 3, 4])
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], allowzero=1),
        helper.make_node("IsNaN", ["r"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "r"], ["guarded"]),
        helper.make_node("Unsqueeze", ["guarded", "axis0"], ["u"]),
        helper.make_node("Squeeze", ["u", "axis0_1d"], ["y"]),
    ]
    inits = [("shape", np.array([6, 4], np.int64)), ("zero", np.array(0.0, np.float32)),
             ("axis0", np.array(0, np.int64)),  # rank-0 axes, as the dynamo exporter emits them
             ("axis0_1d", np.array([0], np.int64))]  # (ORT's CPU Squeeze itself refuses rank 0)
    model = _model(nodes, [x], [_f32("y", [6, 4])], inits)
    clean, fixed = npu_rewrite.sanitize(model)
    assert fixed == {"reshape_allowzero": 1, "isnan_where_guard": 1, "rank0_axes": 1}
    assert "IsNaN" not in _ops(clean) and "Where" not in _ops(clean)
    assert all(a.i == 0 for n in clean.graph.node if n.op_type == "Reshape" for a in n.attribute
               if a.name == "allowzero")
    inits_after = {i.name: numpy_helper.to_array(i) for i in clean.graph.initializer}
    for n in clean.graph.node:
        if n.op_type in ("Unsqueeze", "Squeeze"):
            assert inits_after[n.input[1]].ndim == 1
    feeds = {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)}
    np.testing.assert_array_equal(_run(model, feeds)[0], _run(clean, feeds)[0])


def test_sanitize_refuses_an_allowzero_reshape_it_cannot_express():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1)]
    model = _model(nodes, [_f32("x", [0, 4])], [_f32("y", [4, 0])], [("shape", np.array([4, 0], np.int64))])
    with pytest.raises(npu_rewrite.RewriteError, match="zero in its shape"):
        npu_rewrite.sanitize(model)


def _rope_model(inv_freq):
    pos = helper.make_tensor_value_info("position", TensorProto.INT64, [1])
    x = _f32("x", [1, 1, 2 * inv_freq.size])
    nodes = [
        helper.make_node("Cast", ["position"], ["pf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pf", "ax"], ["pu"]),
        helper.make_node("Mul", ["pu", "inv_freq"], ["angle"]),
        helper.make_node("Concat", ["angle", "angle"], ["emb"], axis=-1),
        helper.make_node("Cos", ["emb"], ["cos"]),
        helper.make_node("Sin", ["emb"], ["sin"]),
        helper.make_node("Mul", ["x", "cos"], ["xc"]),
        helper.make_node("Mul", ["x", "sin"], ["xs"]),
        helper.make_node("Add", ["xc", "xs"], ["y"]),
    ]
    inits = [("ax", np.array([1], np.int64)), ("inv_freq", inv_freq.reshape(1, -1).astype(np.float32))]
    return _model(nodes, [pos, x], [_f32("y", [1, 1, 2 * inv_freq.size])], inits)


def test_rope_tables_replace_in_graph_angles_with_gathered_tables():
    inv_freq = 1.0 / (10000 ** (np.arange(0, 16, 2) / 16))
    model = _rope_model(inv_freq)
    C = 300
    new, n = npu_rewrite.rope_tables(model, "position", C)
    assert n == 2
    assert not {"Cos", "Sin", "Cast"} & set(_ops(new)), "no angle is computed on the device any more"
    tables = [numpy_helper.to_array(i) for i in new.graph.initializer if i.name.endswith("__table")]
    assert [t.shape[0] for t in tables] == [C, C] and all(np.abs(t).max() <= 1.0 for t in tables)
    x = RNG.standard_normal((1, 1, 16)).astype(np.float32)
    for p in (0, 1, 63, 64, 255, C - 1):
        feeds = {"position": np.array([p], np.int64), "x": x}
        np.testing.assert_allclose(_run(model, feeds)[0], _run(new, feeds)[0], rtol=0, atol=1e-6)


def _rms_model(eps=1e-6, with_plus_one=False):
    x = _f32("x", [1, 3, 8])
    gamma = RNG.standard_normal(8).astype(np.float32)
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rt"]),
        helper.make_node("Reciprocal", ["rt"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["xn", "gamma"], ["y"]),
    ]
    inits = [("two", np.array(2.0, np.float32)), ("axes", np.array([-1], np.int64)),
             ("eps", np.array(eps, np.float32)), ("gamma", gamma)]
    return _model(nodes, [x], [_f32("y", [1, 3, 8])], inits)


def test_rms_norm_fusion_keeps_the_output_and_drops_the_intermediates():
    model = _rms_model()
    new, n = npu_rewrite.fuse_rms_norm(model)
    assert n == 1 and _ops(new) == ["SimplifiedLayerNormalization"]
    for scale in (1e-3, 1.0, 30.0):  # the intermediates span orders of magnitude; the output does not
        feeds = {"x": (RNG.standard_normal((1, 3, 8)) * scale).astype(np.float32)}
        np.testing.assert_allclose(_run(model, feeds)[0], _run(new, feeds)[0], rtol=1e-5, atol=1e-6)


def test_rms_norm_fusion_leaves_a_norm_over_another_axis_alone():
    model = _rms_model()
    for i in model.graph.initializer:
        if i.name == "axes":
            i.CopyFrom(numpy_helper.from_array(np.array([1], np.int64), "axes"))
    new, n = npu_rewrite.fuse_rms_norm(model)
    assert n == 0 and "Pow" in _ops(new)


def test_embedding_ranges_cover_the_whole_table_not_the_calibration_tokens():
    table = RNG.standard_normal((50, 8)).astype(np.float32)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
             helper.make_node("Mul", ["emb", "scale"], ["y"])]
    model = _model(nodes, [ids], [_f32("y", [1, 1, 8])], [("table", table), ("scale", np.array(-2.0, np.float32))])
    ov = npu_rewrite.embedding_ranges(model)
    assert float(ov["emb"][0]["rmin"]) == table.min() and float(ov["emb"][0]["rmax"]) == table.max()
    # scaled by a negative constant: the bounds swap
    assert float(ov["y"][0]["rmin"]) == pytest.approx(-2 * table.max())
    assert float(ov["y"][0]["rmax"]) == pytest.approx(-2 * table.min())


def test_residual_stream_follows_the_scaled_embedding_through_each_layers_adds():
    """Gemma's shape: the lookup scaled by a constant, then per layer a norm reading the stream and an Add
    writing a sublayer's output back; the rotary tables' Gathers and the sublayers' own Adds are not it."""
    table = RNG.standard_normal((50, 8)).astype(np.float32)
    g = np.ones(8, np.float32)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed", axis=0),
             helper.make_node("Mul", ["emb", "scale"], ["r0"], name="scale"),
             helper.make_node("Gather", ["cos__table", "pos"], ["cos"], name="rope"),
             helper.make_node("SimplifiedLayerNormalization", ["r0", "g"], ["n0"], name="ln0", axis=-1),
             helper.make_node("Add", ["n0", "cos"], ["s0"], name="sublayer_add"),  # inside a sublayer
             helper.make_node("Add", ["r0", "s0"], ["r1"], name="res0"),
             helper.make_node("SimplifiedLayerNormalization", ["r1", "g"], ["n1"], name="ln1", axis=-1),
             helper.make_node("Add", ["r1", "n1"], ["r2"], name="res1"),
             helper.make_node("SimplifiedLayerNormalization", ["r2", "g"], ["y"], name="final", axis=-1)]
    model = _model(nodes, [ids, helper.make_tensor_value_info("pos", TensorProto.INT64, [1])], [_f32("y", [1, 1, 8])],
                   [("table", table), ("scale", np.array(2.0, np.float32)), ("g", g),
                    ("cos__table", np.ones((4, 8), np.float32))])
    # ln1 both reads the stream and writes back into it (the Add adds its output): a writer, as Gemma's
    # post-norms are
    assert npu_rewrite.residual_stream(model) == {"adds": ["res0", "res1"], "norms": ["ln0", "ln1", "final"],
                                                  "writers": ["ln1"]}
    assert npu_rewrite.residual_tensors(model) == ["r0", "r1", "r2"]
    # carried scaled (a stream past fp16's range): the walk follows the embedding's second scaling, so the
    # layers' boundaries (which compile_qnn cuts parts at) are still found, and the graph computes the same
    feeds = {"ids": np.array([[3]], np.int64), "pos": np.array([1], np.int64)}
    before = _run(model, feeds)
    npu_rewrite.scale_residual(model, 4)
    assert npu_rewrite.residual_tensors(model) == ["r0__scaled", "r1", "r2"]
    np.testing.assert_allclose(_run(model, feeds)[0], before[0], rtol=1e-5, atol=1e-5)


def test_attention_cores_are_the_products_of_two_activations_around_each_softmax():
    """q.K^T (two computed tensors), the mask's Add, Softmax and softmax.V are a core; a Softmax over a
    weight's product (a classifier's) is not, and neither are the projections around the core."""
    q, k, v, x = (_f32(n, [1, 1, 4, 8]) for n in ("q", "k", "v", "x"))
    mask = _f32("mask", [1, 1, 4, 4])
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Add", ["s", "mask"], ["sm"], name="mask_add"),
             helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"], name="pv"),
             helper.make_node("MatMul", ["o", "w"], ["o2"], name="o_proj"),
             helper.make_node("MatMul", ["x", "w"], ["c"], name="classifier"),
             helper.make_node("Softmax", ["c"], ["cp"], name="classifier_softmax", axis=-1)]
    model = _model(nodes, [q, k, v, x, mask], [_f32("o2", [1, 1, 4, 8]), _f32("cp", [1, 1, 4, 8])],
                   [("w", RNG.standard_normal((8, 8)).astype(np.float32))])
    assert npu_rewrite.attention_cores(model) == {"scores": ["qk"], "masks": ["mask_add"],
                                                  "softmaxes": ["softmax"], "mixes": ["pv"]}


def _tied_head_model(table, head_reads_table: bool):
    """input_ids -> Gather(table) * scale -> MatMul with a head (the table itself, transposed by the graph,
    or a separate initializer as the untie_head stage's export has it)."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1])
    pos = helper.make_tensor_value_info("position", TensorProto.INT64, [1])
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["emb"], name="embed", axis=0),
             helper.make_node("Mul", ["emb", "scale"], ["r0"], name="scale"),
             helper.make_node("Cast", ["position"], ["posf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["r0", "posf"], ["r1"], name="res0")]
    inits = [("table", table), ("scale", np.array(3.0, np.float32))]
    if head_reads_table:
        nodes += [helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0])]
    else:
        inits.append(("head", np.ascontiguousarray(table.T)))
    nodes.append(helper.make_node("MatMul", ["r1", "head"], ["logits"]))
    return _model(nodes, [ids, pos], [_f32("logits", [1, 1, table.shape[0]])], inits)


@pytest.mark.parametrize("head_reads_table", [False, True])
def test_embedding_input_takes_the_lookup_out_and_computes_the_same_from_the_fed_rows(head_reads_table):
    table = RNG.standard_normal((50, 8)).astype(np.float32)
    model = _tied_head_model(table, head_reads_table)
    before = [_run(model, {"input_ids": np.array([[t]], np.int64), "position": np.array([t % 5], np.int64)})[0]
              for t in (0, 7, 49)]
    cut, info = npu_rewrite.embedding_input(model)
    assert info["gather_output"] == "emb" and np.array_equal(info["table"], table)
    names = [i.name for i in cut.graph.input]
    assert names == ["inputs_embeds", "position"] and "Gather" not in _ops(cut)
    dims = [d.dim_value for d in cut.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 1, 8]
    # the table leaves the graph unless the head still reads it (then it stays, once)
    assert ("table" in {i.name for i in cut.graph.initializer}) == head_reads_table
    for t, want in zip((0, 7, 49), before):
        got = _run(cut, {"inputs_embeds": table[t].reshape(1, 1, 8), "position": np.array([t % 5], np.int64)})[0]
        assert np.array_equal(got, want)
    # the residual stream is still found, now from the input's scaling
    assert npu_rewrite.residual_stream(cut)["adds"] == ["res0"]


def test_embedding_input_refuses_a_graph_without_a_lookup():
    x = _f32("x", [1, 1, 8])
    model = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [_f32("y", [1, 1, 8])])
    with pytest.raises(npu_rewrite.RewriteError, match="no embedding lookup"):
        npu_rewrite.embedding_input(model)


def test_graph_diff_names_the_first_tensor_a_qdq_range_clips():
    from pipeline.measure import graph_diff

    x = _f32("x", [1, 8])
    w1 = RNG.standard_normal((8, 8)).astype(np.float32)
    w2 = RNG.standard_normal((8, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["y"])]
    ref = _model(nodes, [x], [_f32("y", [1, 4])], [("w1", w1), ("w2", w2)])
    # The test graph: `x` quantized faithfully, `a` through a range far too
    # narrow (what calibration on too few tokens does), as a QDQ pass writes it.
    qdq = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["x_q"]),
           helper.make_node("DequantizeLinear", ["x_q", "sx", "zx"], ["x_dq"]),
           helper.make_node("MatMul", ["x_dq", "w1"], ["h"]),
           helper.make_node("Relu", ["h"], ["a"]),
           helper.make_node("QuantizeLinear", ["a", "sa", "za"], ["a_q"]),
           helper.make_node("DequantizeLinear", ["a_q", "sa", "za"], ["a_dq"]),
           helper.make_node("MatMul", ["a_dq", "w2"], ["y"])]
    test = _model(qdq, [x], [_f32("y", [1, 4])],
                  [("w1", w1), ("w2", w2), ("sx", np.array(8 / 65535, np.float32)), ("zx", np.array(32768, np.uint16)),
                   ("sa", np.array(0.1 / 65535, np.float32)), ("za", np.array(0, np.uint16))])
    feeds = {"x": RNG.standard_normal((1, 8)).astype(np.float32)}
    rows = graph_diff.compare(ref, test, feeds)
    assert [r["tensor"] for r in rows] == ["h", "a", "y"]
    assert rows[0]["snr_db"] > 60 and not rows[0]["quantized"]
    first = graph_diff.first_divergence(rows, 30.0)
    assert first["tensor"] == "a" and first["quantized"] and first["test_range"][1] <= 0.1 + 1e-6


def _all_patterns_model():
    """The rotary pattern, then an RMSNorm, an allowzero Reshape, an IsNaN
    guard, a MatMul weight (what the decoder's weights are to the rewrites:
    never read) and an initializer nothing uses (pruned)."""
    m = _rope_model(1.0 / (10000 ** (np.arange(0, 8, 2) / 8)))  # width 8, the norm's
    r = _rms_model()
    g = m.graph
    ren = {"x": "y"}
    for n in r.graph.node:
        g.node.append(helper.make_node(n.op_type, [ren.get(i, "r_" + i) for i in n.input], ["r_" + o for o in n.output],
                                       **{a.name: helper.get_attribute_value(a) for a in n.attribute}))
    for i in r.graph.initializer:
        g.initializer.append(numpy_helper.from_array(numpy_helper.to_array(i), "r_" + i.name))
    g.node.extend([helper.make_node("Reshape", ["r_y", "shp"], ["rr"], allowzero=1),
                   helper.make_node("IsNaN", ["rr"], ["nan"]),
                   helper.make_node("Where", ["nan", "zero", "rr"], ["w"]),
                   helper.make_node("MatMul", ["w", "weight"], ["out"])])
    g.initializer.extend([numpy_helper.from_array(np.array([1, 8], np.int64), "shp"),
                          numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                          numpy_helper.from_array(RNG.standard_normal((8, 4)).astype(np.float32), "weight"),
                          numpy_helper.from_array(np.ones((5, 5), np.float32), "unused")])
    del g.output[:]
    g.output.append(_f32("out", [1, 4]))
    return m


def test_prepare_rewrites_in_place_byte_identical_to_the_copying_rewrites(monkeypatch):
    # prepare works on the one ModelProto it is given (on Gemma 3 270M the
    # copies peaked at 10.5 GiB); its graph must be the very bytes the
    # copying functions chained produce, which leave their input untouched.
    raw = _all_patterns_model().SerializeToString()
    src = onnx.load_from_string(raw)
    chained, _ = npu_rewrite.sanitize(src)
    chained, _ = npu_rewrite.rope_tables(chained, "position", 300)
    chained, _ = npu_rewrite.fuse_rms_norm(chained)
    assert src.SerializeToString() == raw

    read = []
    to_array = numpy_helper.to_array
    monkeypatch.setattr(npu_rewrite.numpy_helper, "to_array", lambda t: read.append(t.name) or to_array(t))
    model = onnx.load_from_string(raw)
    prepared, report = npu_rewrite.prepare(model, position="position", context_length=300)
    assert prepared is model
    assert prepared.SerializeToString() == chained.SerializeToString()
    assert report["sanitize"] == {"reshape_allowzero": 1, "isnan_where_guard": 1}
    assert report["rope_tables"] == 2 and report["rms_norms_fused"] == 1
    assert "weight" not in read, "a weight no rewrite reads is never converted to numpy"
    assert "unused" not in {i.name for i in prepared.graph.initializer}
    feeds = {"position": np.array([7], np.int64), "x": RNG.standard_normal((1, 1, 8)).astype(np.float32)}
    np.testing.assert_allclose(_run(onnx.load_from_string(raw), feeds)[0], _run(prepared, feeds)[0],
                               rtol=1e-5, atol=1e-5)
