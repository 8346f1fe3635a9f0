"""pipeline/tensorfile.py: a safetensors file written a tensor at a time reads back as safetensors' own."""

from __future__ import annotations

import pytest
import torch


def test_streamed_file_is_a_safetensors_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from pipeline.tensorfile import StreamWriter

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
    from pipeline.tensorfile import StreamWriter, TensorFileError

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
