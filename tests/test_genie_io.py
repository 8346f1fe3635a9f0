"""pipeline/graphs/genie_io.py: a QDQ graph's boundary turned into the codes Genie writes and reads, on small
hand-made QDQ graphs run by ONNX Runtime's CPU EP (the whole path on real graphs, compiled for the HTP:
tests/test_family_paths.py)."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from pipeline.graphs import genie_io  # noqa: E402

F, U16 = TensorProto.FLOAT, TensorProto.UINT16


def _qdq(x: str, scale: float, zp: int, nodes: list, inits: list, name: str | None = None) -> str:
    """x -> QuantizeLinear -> DequantizeLinear (the quantizer's pattern); the float it dequantizes to."""
    name = name or x
    inits += [numpy_helper.from_array(np.asarray(scale, np.float32), f"{name}_scale"),
              numpy_helper.from_array(np.asarray(zp, np.uint16), f"{name}_zero_point")]
    nodes += [helper.make_node("QuantizeLinear", [x, f"{name}_scale", f"{name}_zero_point"], [f"{name}_q"]),
              helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_scale", f"{name}_zero_point"], [f"{name}_dq"])]
    return f"{name}_dq"


def _graph(out_scale: float = 2e-4, out_zp: int = 30000) -> onnx.ModelProto:
    """inputs_embeds (read quantized and, as the residual stream is, float), attention_mask (read only as a
    float), past_key_0_in; outputs past_key_0_out (also read inside) and logits (kept float)."""
    nodes, inits = [], [numpy_helper.from_array(np.full((1, 4), 0.5, np.float32), "w")]
    e = _qdq("inputs_embeds", 1e-4, 32768, nodes, inits)
    k = _qdq("past_key_0_in", 2e-4, 30000, nodes, inits)
    nodes.append(helper.make_node("Mul", [e, "w"], ["new_key"]))
    new = _qdq("new_key", out_scale, out_zp, nodes, inits)
    nodes[-1].output[0] = "past_key_0_out"  # the graph output is the DequantizeLinear's
    nodes += [helper.make_node("Add", ["past_key_0_out", k], ["s"]),
              helper.make_node("Add", ["s", "inputs_embeds"], ["s2"]),  # a float reader of the input
              helper.make_node("Add", ["s2", "attention_mask"], ["logits"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, [1, 4]) for n in
                                       ("inputs_embeds", "attention_mask", "past_key_0_in")],
                          [helper.make_tensor_value_info(n, F, [1, 4]) for n in ("past_key_0_out", "logits")], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _run(model, feed):
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], s.run(None, feed)))


def test_the_boundary_takes_and_gives_codes_and_computes_the_same():
    rng = np.random.default_rng(0)
    x = {"inputs_embeds": rng.uniform(-1, 1, (1, 4)).astype(np.float32),
         "attention_mask": np.array([[0, -1000, 0, -1000]], np.float32),
         "past_key_0_in": rng.uniform(-1, 1, (1, 4)).astype(np.float32)}
    want = _run(_graph(), x)
    m, enc = genie_io.quantized_boundary(_graph(), given={"attention_mask": genie_io.uint16_encoding(-1000.0, 0.0)})
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.input) + list(m.graph.output)}
    assert types == {"inputs_embeds": U16, "attention_mask": U16, "past_key_0_in": U16, "past_key_0_out": U16,
                     "logits": F}
    assert enc["inputs_embeds"] == {"dtype": "uint16", "scale": pytest.approx(1e-4), "offset": -32768}
    assert enc["attention_mask"]["offset"] == -65535  # the top code means 0: Genie writes 0xffff to attend
    assert not [n for n in m.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in x]
    codes = {k: genie_io.quantize(v, enc[k]) for k, v in x.items()}
    got = _run(m, codes)
    # the float reader now reads the input's codes dequantized: within half a step of its float (and float32's
    # own rounding where the mask's -1000 is added)
    np.testing.assert_allclose(got["logits"], want["logits"], atol=0.5e-4 + 1e-6, rtol=1e-7)
    np.testing.assert_allclose(genie_io.dequantize(got["past_key_0_out"], enc["past_key_0_out"]),
                               want["past_key_0_out"], atol=1e-6)
    # an input only float islands read and no range given stays float: nothing to take it from
    _, enc2 = genie_io.quantized_boundary(_graph())
    assert "attention_mask" not in enc2


def test_a_kv_pair_gets_one_encoding_over_both_ranges():
    m, enc = genie_io.quantized_boundary(_graph(out_scale=3e-4, out_zp=20000))
    assert genie_io.untied(enc) == ["past_key_0"]
    a, b = dict(enc["past_key_0_in"]), dict(enc["past_key_0_out"])
    assert genie_io.tie_kv(m, enc) == 1 and genie_io.untied(enc) == []
    t = enc["past_key_0_in"]

    def span(e):
        return e["offset"] * e["scale"], (65535 + e["offset"]) * e["scale"]

    lo, hi = span(t)
    assert lo <= min(span(a)[0], span(b)[0]) + 1e-6 and hi >= max(span(a)[1], span(b)[1]) - 1e-6
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    for n in m.graph.node:  # every Q / DQ of either tensor carries it
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and (
                "past_key_0_out" in n.output or n.input[0] in ("past_key_0_out", "past_key_0_in")):
            assert float(inits[n.input[1]]) == pytest.approx(t["scale"], rel=1e-7)
            assert int(inits[n.input[2]]) == -t["offset"]


def test_uint16_encoding_holds_zero_and_the_range():
    e = genie_io.uint16_encoding(-1000.0, 0.0)
    assert e["offset"] == -65535 and (0 + e["offset"]) * e["scale"] == pytest.approx(-1000.0)
    e = genie_io.uint16_encoding(0.25, 1.0)  # zero inside always
    assert e["offset"] == 0 and e["scale"] == pytest.approx(1.0 / 65535)


def test_a_prompt_graph_encoding_a_step_apart_takes_the_token_graphs_and_one_truly_apart_is_refused():
    # the figures of Gemma 3 270M's phone build: the prompt graph's swa_key_1_in came out one uint16 step
    # wider than the token graph's (relative 1.3e-5), and Genie's validator compares them exactly
    want = {"dtype": "uint16", "scale": 0.0005874842754565179, "offset": -35930}
    m, enc = genie_io.quantized_boundary(_graph())
    enc["past_key_0_in"] = {"dtype": "uint16", "scale": 0.0005874917260371149, "offset": -35930}
    assert genie_io.impose(m, enc, {"past_key_0_in": want}) == 1
    assert enc["past_key_0_in"] == want
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    readers = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "past_key_0_in"]
    assert readers and all(float(inits[n.input[1]]) == np.float32(want["scale"]) and
                           int(inits[n.input[2]]) == 35930 for n in readers)
    # an offset one code apart at the same scale is rounding too; a range 1% wider is not
    enc["past_key_0_in"] = {**want, "offset": -35931}
    assert genie_io.impose(m, enc, {"past_key_0_in": want}) == 1
    enc["past_key_0_in"] = {**want, "scale": want["scale"] * 1.01}
    with pytest.raises(genie_io.BoundaryError, match="past_key_0_in"):
        genie_io.impose(m, enc, {"past_key_0_in": want})
