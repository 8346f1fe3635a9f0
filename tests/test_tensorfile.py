"""pipeline/sources/tensorfile.py: a safetensors file written a tensor at a time reads back as safetensors' own."""

from __future__ import annotations

import pytest
import torch


def test_streamed_file_is_a_safetensors_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from pipeline.sources.tensorfile import StreamWriter

    tensors = {"model.layers.0.mlp.down_proj": torch.randn(6, 10), "codes": torch.arange(9, dtype=torch.uint8),
               "h64": torch.randn(3, 3, dtype=torch.float64), "half": torch.randn(4).half(), "empty": torch.zeros(0, 4)}
    path = tmp_path / "t.safetensors"
    with StreamWriter(path, [*tensors, "never.written"], {"format": "pt"}) as w:
        for name, t in tensors.items():
            w.add(name, t)
    back = load_file(str(path))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with open(path, "rb") as f:  # the data starts 8-byte aligned, as safetensors' own files
        assert (8 + int.from_bytes(f.read(8), "little")) % 8 == 0


def test_a_name_outside_the_header_or_a_failure_leaves_no_file(tmp_path):
    from pipeline.sources.tensorfile import StreamWriter, TensorFileError

    path = tmp_path / "t.safetensors"
    with pytest.raises(TensorFileError, match="not among the names"):
        with StreamWriter(path, ["a"]) as w:
            w.add("a", torch.ones(2))
            w.add("b", torch.ones(2))
    assert not path.exists()
    with pytest.raises(TensorFileError, match="written twice"):
        with StreamWriter(path, ["a"]) as w:
            w.add("a", torch.ones(2))
            w.add("a", torch.ones(2))
    assert not path.exists()


def test_load_onnx_reads_external_data_that_dvc_hardlinked(tmp_path):
    """DVC's hardlink cache gives every stage output a second link; onnx.load refuses such external data
    ("potential hardlink attack") and the phone build's pack stage died on it. load_onnx reads it."""
    import os

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.sources.tensorfile import TensorFileError, load_onnx

    w = np.arange(4096, dtype=np.float32).reshape(64, 64)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
                          [numpy_helper.from_array(w, "w")])
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(g), str(path), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    os.link(tmp_path / "model.onnx.data", tmp_path / "cache-entry")  # what `cache.type hardlink` does
    with pytest.raises(Exception, match="hard link"):
        onnx.load(str(path))
    m = load_onnx(path)
    assert np.array_equal(numpy_helper.to_array(m.graph.initializer[0]), w)
    assert not onnx.external_data_helper.uses_external_data(m.graph.initializer[0])
    bad = onnx.load(str(path), load_external_data=False)
    for entry in bad.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../elsewhere.data"
    onnx.save(bad, str(tmp_path / "bad.onnx"))
    with pytest.raises(TensorFileError, match="not a file beside the model"):
        load_onnx(tmp_path / "bad.onnx")


def test_a_second_graph_reads_the_weights_it_shares_from_the_first_graphs_file(tmp_path, monkeypatch):
    """share_external_data: the prompt graph's copy of the token graph's weights is dropped from its own
    data file (matched by content, whatever the names), ONNX Runtime computes the same, a tensor of its own
    stays its own, the first graph's file is untouched, a hardlink to the old data file (DVC's cache) keeps
    its bytes, and a second call changes nothing."""
    import os

    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.sources import tensorfile
    from pipeline.sources.tensorfile import load_onnx, share_external_data

    monkeypatch.setattr(tensorfile, "_CHUNK", 1000)  # each 16 kB tensor read and copied in pieces
    rng = np.random.default_rng(0)
    w1, w2, own = (rng.standard_normal((64, 64)).astype(np.float32) for _ in range(3))

    def save(name, weights, rows):
        nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])]
        inits = [numpy_helper.from_array(w1, weights[0]), numpy_helper.from_array(w2, weights[1])]
        if len(weights) > 2:
            nodes.append(helper.make_node("MatMul", ["y", weights[2]], ["z"]))
            inits.append(numpy_helper.from_array(own, weights[2]))
        out = "z" if len(weights) > 2 else "y"
        for n in nodes:
            n.input[1] = {"w1": weights[0], "w2": weights[1]}.get(n.input[1], n.input[1])
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 64])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [rows, 64])], inits)
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(path),
                  save_as_external_data=True, location=f"{name}.onnx.data", size_threshold=1024)
        return path

    def run(path, x):
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    token = save("model", ["w1", "w2"], 1)
    prompt = save("prompt", ["val_7", "val_9", "own"], 4)  # the exporter names them its own way
    x = rng.standard_normal((4, 64)).astype(np.float32)
    want, want_token = run(prompt, x), run(token, x[:1])
    token_data = (tmp_path / "model.onnx.data").read_bytes()
    old = (tmp_path / "prompt.onnx.data").read_bytes()
    os.link(tmp_path / "prompt.onnx.data", tmp_path / "cache-entry")

    got = share_external_data(token, prompt)
    assert got == {"shared": 2, "shared_bytes": 2 * w1.nbytes, "own_bytes": own.nbytes}
    assert (tmp_path / "prompt.onnx.data").stat().st_size == own.nbytes
    assert (tmp_path / "model.onnx.data").read_bytes() == token_data
    assert (tmp_path / "cache-entry").read_bytes() == old  # replaced, not written through the link
    np.testing.assert_array_equal(run(prompt, x), want)
    np.testing.assert_array_equal(run(token, x[:1]), want_token)
    m = load_onnx(prompt)
    assert np.array_equal(numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "own")), own)
    skeleton = onnx.load(str(prompt), load_external_data=False)
    where = {i.name: {e.key: e.value for e in i.external_data}["location"] for i in skeleton.graph.initializer}
    assert where == {"val_7": "model.onnx.data", "val_9": "model.onnx.data", "own": "prompt.onnx.data"}

    assert share_external_data(token, prompt) == got  # idempotent
    np.testing.assert_array_equal(run(prompt, x), want)
    assert not list(tmp_path.glob(".*"))  # no temporaries left
