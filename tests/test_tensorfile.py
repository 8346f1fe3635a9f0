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
