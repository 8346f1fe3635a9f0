"""Which decoder linears get 8 bits (pipeline/quant/bit_alloc.py): units, the greedy choice, the measurement."""

from __future__ import annotations

import pytest
import torch

from pipeline.quant import bit_alloc

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


def _tiny_gemma3(**overrides):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                           sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=64, tie_word_embeddings=False, **overrides)
    model = Gemma3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "eager"
    return model


def _gemma_units(model):
    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
            key = name.rsplit(".", 1)[0] + "." + shared.get(leaf, leaf)
            layers[name] = {"hessian": key, "in_features": mod.in_features, "out_features": mod.out_features}
    return layers


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_the_head_gram_measure_is_the_logits_error_and_falls_back_where_it_is_not(softcap):
    """HeadError (the final hidden states through the head's Grams, the layers below a unit replayed) gives
    LogitsError's numbers; a softcapped head is not a linear map of the hidden state: the logits are used."""
    model = _tiny_gemma3(final_logit_softcapping=softcap)
    layers = _gemma_units(model)
    units = bit_alloc.units(layers, exclude=("lm_head",))
    names = list(layers)
    full = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    gen = torch.Generator().manual_seed(1)
    codes = {n: w + 0.05 * w.std() * torch.randn(w.shape, generator=gen) for n, w in full.items()}
    windows = torch.randint(0, 300, (2, 20), generator=gen)
    found = {}
    for exact in (True, False):
        for n in names:
            model.get_submodule(n).weight.data.copy_(full[n])
        found[exact] = bit_alloc.measure(model, windows, units, names, codes.__getitem__, full.__getitem__,
                                         exact_logits=exact)
    assert found[True]["method"] == "logits"
    assert found[False]["method"] == ("logits" if softcap else "head_gram+prefix_replay")
    assert found[False]["base"] == pytest.approx(found[True]["base"], rel=1e-5)
    for u in units:
        assert found[False]["gains"][u.key] == pytest.approx(found[True]["gains"][u.key], rel=1e-3, abs=1e-6 * found[True]["base"])
    assert len({u.key for u in units}) == 12 and any(found[True]["gains"][u.key] > 0 for u in units)
    # the final choice's error, measured from its lowest changed layer up, is a full run's
    last = [u for u in units if ".layers.2." in u.key][0]
    for n in last.layers:
        model.get_submodule(n).weight.data.copy_(full[n])
    assert found[False]["error"](changed=last.layers) == pytest.approx(found[False]["error"](), rel=1e-6)
    assert found[False]["error"]() == pytest.approx(found[True]["base"] - found[True]["gains"][last.key], rel=1e-4)


def test_the_prefix_replay_is_turned_off_when_the_replayed_run_differs():
    model = _tiny_gemma3()
    layers = _gemma_units(model)
    names = list(layers)
    full = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    windows = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    err = bit_alloc.HeadError.of(model, windows)
    err.set_head(full["lm_head"] * 1.01)
    err.base()
    err.cache[0][0] = err.cache[0][0] + 1.0  # a cache that does not reproduce the run
    err.check_replay()
    assert not err.reuse_prefix


def _spearman(a, b) -> float:
    import numpy as np

    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_the_first_order_gains_rank_the_units_as_the_exact_ones(monkeypatch):
    """One forward and backward run (first_order_gains) against each unit put back in turn: the same
    order of the units (rank correlation >= 0.8 on a 3-layer Gemma 3 with unequal code errors), the
    same top unit, magnitudes within a factor 3; the codes stay in and no weight is left wanting a
    gradient changed. sensitivity: auto takes the exact measure within EXACT_MAX_RUNS runs of the model,
    the first-order one beyond, and says which."""
    model = _tiny_gemma3()
    layers = _gemma_units(model)
    units = bit_alloc.units(layers, exclude=("lm_head",))
    names = list(layers)
    full = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    gen = torch.Generator().manual_seed(1)
    codes = {n: w + 0.05 * (1 + 3 * (i % 3)) * w.std() * torch.randn(w.shape, generator=gen)
             for i, (n, w) in enumerate(full.items())}
    windows = torch.randint(0, 300, (2, 20), generator=gen)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    found = {}
    for sensitivity in ("exact", "first_order", "auto"):
        for n in names:
            model.get_submodule(n).weight.data.copy_(full[n])
        if sensitivity == "auto":
            monkeypatch.setattr(bit_alloc, "EXACT_MAX_RUNS", 7)  # this model's exact measure costs 8 runs
        found[sensitivity] = bit_alloc.measure(model, windows, units, names, codes.__getitem__, full.__getitem__,
                                               sensitivity=sensitivity)
        for n in names:
            assert torch.equal(model.get_submodule(n).weight, codes[n])
    assert found["exact"]["method"] == "head_gram+prefix_replay" and found["exact"]["exact_runs"] == 8
    assert found["first_order"]["method"] == found["auto"]["method"] == "first_order+head_gram"
    assert found["auto"]["gains"] == found["first_order"]["gains"]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    exact = [found["exact"]["gains"][u.key] for u in units]
    first = [found["first_order"]["gains"][u.key] for u in units]
    assert _spearman(exact, first) >= 0.8
    assert max(units, key=lambda u: found["exact"]["gains"][u.key]) == max(units, key=lambda u: found["first_order"]["gains"][u.key])
    top = max(range(len(units)), key=exact.__getitem__)
    assert exact[top] / 3 < first[top] < 3 * exact[top]
    assert found["first_order"]["base"] == pytest.approx(found["exact"]["base"])
