"""Which decoder linears get 8 bits (pipeline/bit_alloc.py): units, the greedy choice, the measurement."""

from __future__ import annotations

import pytest
import torch

from pipeline import bit_alloc

LAYERS = {  # calibration.json's shape: linears fed the same input share a "hessian" key
    "model.layers.0.self_attn.q_proj": {"hessian": "h0a", "in_features": 64, "out_features": 64},
    "model.layers.0.self_attn.k_proj": {"hessian": "h0a", "in_features": 64, "out_features": 32},
    "model.layers.0.self_attn.v_proj": {"hessian": "h0a", "in_features": 64, "out_features": 32},
    "model.layers.0.self_attn.o_proj": {"hessian": "h0o", "in_features": 64, "out_features": 64},
    "model.layers.0.mlp.down_proj": {"hessian": "h0d", "in_features": 128, "out_features": 64},
    "lm_head": {"hessian": "lm_head", "in_features": 64, "out_features": 100},
}


def test_a_unit_is_the_linears_that_share_an_input_and_the_head_is_left_out():
    units = bit_alloc.units(LAYERS, exclude=("lm_head",))
    assert [u.key for u in units] == ["model.layers.0.self_attn.q_proj+k_proj+v_proj",
                                      "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj"]
    assert units[0].layers == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                               "model.layers.0.self_attn.v_proj"]
    assert [u.extra_bytes for u in units] == [64 * 128 // 2, 64 * 64 // 2, 128 * 64 // 2]
    assert bit_alloc.code_bytes(LAYERS, exclude=("lm_head",)) == sum(u.extra_bytes for u in units)


def test_the_choice_is_greedy_by_gain_per_byte_within_the_budget():
    units = [bit_alloc.Unit("a", ["a"], 100), bit_alloc.Unit("b", ["b"], 50), bit_alloc.Unit("c", ["c"], 30),
             bit_alloc.Unit("d", ["d"], 10)]
    gains = {"a": 1.0, "b": 0.9, "c": 0.25, "d": 0.0}
    # per byte: b 0.018, a 0.01, c 0.0083; d has no gain
    assert bit_alloc.choose(gains, units, 200) == ["b", "a", "c"]
    assert bit_alloc.choose(gains, units, 80) == ["b", "c"]  # a no longer fits after b: c does
    assert bit_alloc.choose(gains, units, 49) == ["c"]  # b does not fit; the next that does is taken
    assert bit_alloc.choose(gains, units, 0) == []
    assert bit_alloc.choose({"a": -0.1}, units, 1000) == []  # a negative gain is noise, never a reason


class _Toy(torch.nn.Module):
    """Two linears in a row and a head, returning .logits like a transformers model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 32)
        self.a = torch.nn.Linear(32, 32, bias=False)
        self.b = torch.nn.Linear(32, 32, bias=False)
        self.lm_head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, ids):
        class Out:
            pass

        out = Out()
        out.logits = self.lm_head(torch.tanh(self.b(torch.tanh(self.a(self.emb(ids))))))
        return out


def test_measure_finds_the_unit_whose_codes_hurt_most_and_leaves_the_codes_in():
    model = _Toy().eval()
    full = {n: model.get_submodule(n).weight.detach().clone() for n in ("a", "b", "lm_head")}
    noise = {"a": 0.02, "b": 0.2, "lm_head": 0.0}  # b's "codes" are ten times as far off as a's
    gen = torch.Generator().manual_seed(1)
    codes = {n: w + noise[n] * w.std() * torch.randn(w.shape, generator=gen) for n, w in full.items()}
    units = [bit_alloc.Unit("a", ["a"], 512), bit_alloc.Unit("b", ["b"], 512)]
    windows = torch.randint(0, 50, (3, 16), generator=gen)
    seen = []
    found = bit_alloc.measure(model, windows, units, ["a", "b", "lm_head"], codes.__getitem__, full.__getitem__,
                              on_unit=lambda u: seen.append(u.key))
    assert seen == ["a", "b"]
    assert found["base"] > 0 and found["gains"]["b"] > 5 * found["gains"]["a"] > 0
    assert found["gains"]["b"] < found["base"]  # a's error remains with b put back
    for n in ("a", "b"):  # the model holds the codes again after each probe
        assert torch.equal(model.get_submodule(n).weight, codes[n])
    assert found["error"]() == pytest.approx(found["base"])
    assert bit_alloc.choose(found["gains"], units, 512) == ["b"]
