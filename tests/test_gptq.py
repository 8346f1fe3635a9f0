"""GPTQ / RTN on the int4 grid, and the calibrate and quantize stages on a tiny checkpoint.

The algorithm tests use random matrices with a correlated input Hessian; the
stage tests train a tiny embedded model through stages/model.py's own code
(a few steps: the numbers do not matter, the shapes and the tokenizer do).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.quant import gptq
from pipeline.engine.context import StageContext, StageError

torch.set_num_threads(1)


def correlated_hessian(k: int, rows: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(rows, k, generator=g) @ mix + 0.3 * torch.randn(rows, k, generator=g)
    x[:, :8] *= 5  # a few outlier channels, as in real activations
    return (x.T @ x).double()


def weights(n: int, k: int, seed: int = 1, skew: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05 + skew


def out_err(w, q, h) -> float:
    return gptq.errors(w, q.dequantize(), h)["out_rel_err_h"]


# --------------------------------------------------------------------------
# the algorithm
# --------------------------------------------------------------------------


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_output_error_clearly_below_rtn(sym):
    w, h = weights(128, 256), correlated_hessian(256)
    e_gptq = out_err(w, gptq.gptq_quantize(w, h, group_size=64, sym=sym), h)
    e_rtn = out_err(w, gptq.rtn_quantize(w, h, group_size=64, sym=sym), h)
    assert e_gptq < 0.75 * e_rtn, (e_gptq, e_rtn)


def test_scale_search_no_worse():
    w, h = weights(128, 256), correlated_hessian(256)
    d = torch.diagonal(h).float()

    def diag_err(q):  # what the search minimizes, exactly
        return float(((q.dequantize() - w).square() @ d).sum())

    plain = gptq.rtn_quantize(w, h, group_size=64, scale_search=False)
    searched = gptq.rtn_quantize(w, h, group_size=64, scale_search=True)
    assert diag_err(searched) <= diag_err(plain) * (1 + 1e-6)
    assert (plain.scales * 7.5 - w.view(128, 4, 64).abs().amax(-1)).abs().max() < 1e-6  # plain: absmax / 7.5
    g_plain = out_err(w, gptq.gptq_quantize(w, h, group_size=64, scale_search=False), h)
    g_search = out_err(w, gptq.gptq_quantize(w, h, group_size=64, scale_search=True), h)
    assert g_search <= g_plain * 1.02, (g_search, g_plain)


def test_asymmetric_beats_symmetric_on_skewed_weights():
    w, h = weights(128, 256, skew=0.08), correlated_hessian(256)
    for method in ("gptq", "rtn"):
        sym = out_err(w, gptq.quantize_weight(w, h, method=method, group_size=64, sym=True), h)
        asym = out_err(w, gptq.quantize_weight(w, h, method=method, group_size=64, sym=False), h)
        assert asym < 0.7 * sym, (method, asym, sym)


@pytest.mark.parametrize("method", ["gptq", "rtn"])
@pytest.mark.parametrize("sym", [True, False])
def test_codes_scales_zeros(method, sym):
    w, h = weights(64, 256), correlated_hessian(256)
    q = gptq.quantize_weight(w, h, method=method, group_size=128, sym=sym)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (64, 256)
    assert int(q.qweight.max()) <= 15
    assert q.scales.dtype == torch.float32 and q.scales.shape == (64, 2)
    assert q.zeros.dtype == torch.uint8 and q.zeros.shape == (64, 2)
    assert bool((q.scales > 0).all())
    if sym:
        assert bool((q.zeros == 8).all())
    else:
        assert int(q.zeros.max()) <= 15
    deq = gptq.dequantize(q.qweight, q.scales, q.zeros, 128)
    assert deq.shape == w.shape and deq.dtype == torch.float32
    manual = (q.qweight.float() - q.zeros.float().repeat_interleave(128, 1)) * q.scales.repeat_interleave(128, 1)
    assert torch.equal(deq, manual)
    assert torch.equal(gptq.dequantize(q.qweight, q.scales, q.zeros), deq)  # group size inferred


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_eight_bit_codes_are_the_same_grid_with_256_levels(method):
    w, h = weights(64, 256), correlated_hessian(256)
    q4 = gptq.quantize_weight(w, h, method=method, group_size=128)
    q8 = gptq.quantize_weight(w, h, method=method, group_size=128, bits=8)
    assert 15 < int(q8.qweight.max()) <= 255 and bool((q8.zeros == 128).all())
    # 16x finer steps: the output error drops by about 16^2
    assert out_err(w, q8, h) < out_err(w, q4, h) / 50, (out_err(w, q8, h), out_err(w, q4, h))
    with pytest.raises(gptq.QuantError, match="6-bit"):
        gptq.quantize_weight(w, h, method=method, group_size=128, bits=6)


def test_group_size_must_divide_k():
    w, h = weights(16, 96), correlated_hessian(96)
    with pytest.raises(gptq.QuantError, match="K=96"):
        gptq.gptq_quantize(w, h, group_size=64)
    from stages import quantize

    s = {"group_size": 128, "group_fallback": "error"}
    with pytest.raises(StageError, match=r"model\.layers\.0\.mlp\.down_proj.*K=96"):
        quantize._layer_group_size("model.layers.0.mlp.down_proj", 96, s)
    # divisor: the largest size a kernel takes (a power of two: MatMulNBits refuses 96)
    assert quantize._layer_group_size("x", 96, {**s, "group_fallback": "divisor"}) == 32
    assert quantize._layer_group_size("x", 320, {**s, "group_fallback": "divisor"}) == 64
    with pytest.raises(StageError, match=r"K=48 .*<= 128"):
        quantize._layer_group_size("x", 48, {**s, "group_fallback": "divisor"})
    assert quantize._layer_group_size("x", 256, s) == 128


def test_row_slabs_give_the_same_codes(monkeypatch):
    w, h = weights(300, 128), correlated_hessian(128)
    whole = gptq.gptq_quantize(w, h, group_size=32, bits=8)
    monkeypatch.setattr(gptq, "ROW_SLAB", 64)  # 300 rows: four slabs of 64 and one of 44
    slabs = gptq.gptq_quantize(w, h, group_size=32, bits=8)
    assert torch.equal(whole.qweight, slabs.qweight) and torch.equal(whole.scales, slabs.scales)


def test_dead_columns_and_block_group_nesting():
    w, h = weights(32, 256), correlated_hessian(256)
    h[5, :] = 0
    h[:, 5] = 0  # input 5 never active in calibration
    q = gptq.gptq_quantize(w, h, group_size=64, block_size=128)
    assert torch.isfinite(q.dequantize()).all()
    # its weight is kept (rounded), not zeroed
    col = q.dequantize()[:, 5]
    assert (col - w[:, 5]).square().sum() / w[:, 5].square().sum() < 0.1
    # blocks smaller than groups, and not nesting at all, give valid results too
    for block in (32, 48):
        e = out_err(w, gptq.gptq_quantize(w, h, group_size=64, block_size=block), h)
        assert e < out_err(w, gptq.rtn_quantize(w, h, group_size=64), h)


# --------------------------------------------------------------------------
# the stages, on a tiny embedded checkpoint
# --------------------------------------------------------------------------

TINY = {
    "seed": 0, "threads": 1, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "sliding_window": 16, "full_attention_every": 2, "max_position_embeddings": 128, "seq_len": 32,
    "batch_size": 4, "steps": 3, "warmup_steps": 1,
}


def ctx(stage: str, out: Path, cfg: dict, inputs: dict) -> StageContext:
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage=stage, build="t", cfg=OmegaConf.create(cfg), inputs=inputs, out=out)


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory):
    from stages import model, untie_head

    root = tmp_path_factory.mktemp("tiny")
    model.run(ctx("model", root / "model", {"model": {"name": "embedded", "source": "embedded", "train": TINY}}, {}))
    untie_head.run(ctx("untie_head", root / "untied", {"model": {}}, {"model": root / "model"}))
    return root / "untied"


CAL = {"dataset": "stdlib_docstrings_heldout", "samples": 16, "seq_len": 32, "min_samples": 16, "seed": 0}


@pytest.fixture(scope="module")
def calibrated(tiny_untied, tmp_path_factory):
    from stages import calibrate

    out = tmp_path_factory.mktemp("cal")
    result = calibrate.run(ctx("calibrate", out, {"calibrate": CAL}, {"untie_head": tiny_untied}))
    return out, result


def test_calibrate_hessians_for_every_linear(tiny_untied, calibrated):
    from safetensors.torch import load_file

    out, result = calibrated
    info = json.loads((out / "calibration.json").read_text())
    assert info["dataset"] == "stdlib_docstrings_heldout"
    assert info["samples"] == 16 and info["seq_len"] == 32 and info["tokens"] == 16 * 32
    expected = {"lm_head"} | {
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    assert set(info["layers"]) == expected
    hs = load_file(str(out / "hessians.safetensors"))
    for name, layer in info["layers"].items():
        h = hs[layer["hessian"]]
        assert h.dtype == torch.float32 and h.shape == (layer["in_features"], layer["in_features"])
        assert layer["rows"] == 16 * 32
        assert torch.allclose(h, h.T) and float(torch.diagonal(h).min()) >= 0
    L = info["layers"]
    assert L["lm_head"]["out_features"] == 512 and L["lm_head"]["in_features"] == 128
    # q/k/v share their input, as do gate/up; o and down see their own
    assert L["model.layers.0.self_attn.k_proj"]["hessian"] == L["model.layers.0.self_attn.q_proj"]["hessian"]
    assert L["model.layers.0.self_attn.v_proj"]["hessian"] == L["model.layers.0.self_attn.q_proj"]["hessian"]
    assert L["model.layers.0.mlp.up_proj"]["hessian"] == L["model.layers.0.mlp.gate_proj"]["hessian"]
    assert L["model.layers.0.mlp.down_proj"]["hessian"] != L["model.layers.0.mlp.gate_proj"]["hessian"]
    assert len(hs) == 2 * 4 + 1
    # the held-out split reproduces training's (checked against training_report.json)
    report = json.loads((tiny_untied / "training_report.json").read_text())
    assert info["corpus"]["heldout_tokens"] == report["split"]["heldout_tokens"]
    assert info["corpus"]["corpus_sha256"] == report["corpus"]["sha256"]
    assert result["metrics"]["samples"] == 16 and len(info["data_sha256"]) == 64


@pytest.mark.parametrize("k", [5, 2048, 2500])
def test_the_second_moment_is_x_transposed_x_symmetric_by_construction(monkeypatch, k):
    """add_second_moment computes the upper block triangle in float32 and mirrors it: the same as x^T x in
    float64 to float32's rounding, symmetric, whatever K is against its block."""
    from stages import calibrate

    monkeypatch.setattr(calibrate, "SYMMETRIC_BLOCK", 1024)
    torch.manual_seed(0)
    acc = torch.zeros(k, k)
    xs = [torch.randn(64, k) * torch.rand(k) for _ in range(3)]
    for x in xs:
        calibrate.add_second_moment(acc, x)
    want = sum(x.double().T @ x.double() for x in xs)
    assert float((acc - acc.T).abs().max() / acc.abs().max()) < 1e-6  # the blocks off the diagonal: mirrored
    assert float((acc.double() - want).abs().max() / want.abs().max()) < 1e-5


def test_layer_by_layer_calibration_is_the_whole_model_forwards(tiny_untied, calibrated):
    """The stage runs one decoder layer at a time over every batch (pipeline/quant/layerwise.py); the same
    windows through the whole model's forward, batch after batch, hooks on every linear, give the same
    second moments (the same sums in the same order: bit for bit) and so the same GPTQ codes."""
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline.quant import gptq
    from stages import calibrate

    out, _ = calibrated
    info = json.loads((out / "calibration.json").read_text())
    streamed = load_file(str(out / "hessians.safetensors"))
    windows = torch.from_numpy(np.load(out / "token_ids.npy").astype("int64"))
    model = AutoModelForCausalLM.from_pretrained(tiny_untied, dtype=torch.float32).eval()
    linears = calibrate.decoder_linears(model)
    whole: dict[str, torch.Tensor] = {}

    def add(key, x):  # the stage's own sum, in the whole model's order
        x2 = x.detach().reshape(-1, x.shape[-1])
        calibrate.add_second_moment(whole.setdefault(key, torch.zeros(x2.shape[1], x2.shape[1])), x2)

    keys = {info["layers"][n]["hessian"] for n in info["layers"]}
    handles = [m.register_forward_pre_hook(lambda _m, a, _n=n: add(_n, a[0]))
               for n, m in linears.items() if n in keys and n != "lm_head"]
    with torch.no_grad():
        for i in range(0, len(windows), calibrate.BATCH):
            add("lm_head", model.get_decoder()(input_ids=windows[i : i + calibrate.BATCH]).last_hidden_state)
    for h in handles:
        h.remove()
    assert set(whole) == set(streamed) == keys
    for key in keys:
        assert torch.equal(whole[key].float(), streamed[key]), key
    name = "model.layers.1.mlp.down_proj"
    w = linears[name].weight.detach()
    a = gptq.quantize_weight(w, whole[name].float().double(), group_size=32)  # the stage stores H as fp32
    b = gptq.quantize_weight(w, streamed[name].double(), group_size=32)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


def test_layer_by_layer_run_refuses_a_loop_it_does_not_reproduce(tiny_untied, monkeypatch):
    """A decoder whose loop does not call every layer once with the previous one's output is caught
    before any long work: here the loop stops after the first of the two layers."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant import layerwise

    model = AutoModelForCausalLM.from_pretrained(tiny_untied, dtype=torch.float32).eval()
    decoder = model.get_decoder()
    layerwise.check(decoder, torch.arange(1, 17)[None])
    monkeypatch.setattr(decoder.config, "num_hidden_layers", 1)
    with pytest.raises(layerwise.LayerwiseError, match="called 1 of 2 layers"):
        layerwise.check(decoder, torch.arange(1, 17)[None])


def test_calibrate_data_sha_is_of_the_token_ids(tiny_untied, calibrated):
    from transformers import AutoTokenizer

    from stages import calibrate

    out, _ = calibrated
    info = json.loads((out / "calibration.json").read_text())
    held, _ = calibrate.heldout_ids(tiny_untied, AutoTokenizer.from_pretrained(tiny_untied))
    windows = torch.tensor(held[: info["windows_available"] * 32]).view(-1, 32)
    picks = torch.randperm(info["windows_available"], generator=torch.Generator().manual_seed(0))[:16].sort().values
    ids = windows[picks].numpy().astype("<i4")
    assert hashlib.sha256(ids.tobytes()).hexdigest() == info["data_sha256"]


def test_calibrate_fails_when_too_few_samples(tiny_untied, tmp_path):
    from stages import calibrate

    cfg = {"calibrate": {**CAL, "samples": 100_000, "min_samples": 100_000}}
    with pytest.raises(StageError, match="too short"):
        calibrate.run(ctx("calibrate", tmp_path / "c", cfg, {"untie_head": tiny_untied}))
    with pytest.raises(StageError, match="dataset"):
        calibrate.run(ctx("calibrate", tmp_path / "d", {"calibrate": {**CAL, "dataset": "wikitext"}},
                          {"untie_head": tiny_untied}))


QCFG = {"method": "gptq", "bits": 4, "group_size": 128, "sym": True, "scale_search": True,
        "damp": 0.01, "block_size": 128}


def test_quantize_end_to_end_format(tiny_untied, calibrated, tmp_path):
    from safetensors import safe_open

    from stages import quantize

    cal, _ = calibrated
    cal_info = json.loads((cal / "calibration.json").read_text())
    results = {}
    for method in ("gptq", "rtn"):
        out = tmp_path / method
        results[method] = quantize.run(ctx("quantize", out, {"quantize": {**QCFG, "method": method}},
                                           {"untie_head": tiny_untied, "calibrate": cal}))
    out = tmp_path / "gptq"
    meta = json.loads((out / "quant.json").read_text())
    assert meta["format"] == "edgekiln-int4/1" and meta["bits"] == 4 and meta["group_size"] == 128
    assert meta["sym"] is True and meta["method"] == "gptq" and meta["scale_search"] is True
    assert meta["calibration"]["data_sha256"] == cal_info["data_sha256"]
    assert set(meta["layers"]) == set(cal_info["layers"])
    for name, layer in meta["layers"].items():
        assert set(layer) == {"in_features", "out_features", "weight_rel_mse", "out_rel_err_h"}
        assert 0 < layer["out_rel_err_h"] < 0.2 and 0 < layer["weight_rel_mse"] < 0.2
    with safe_open(str(out / "quantized.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert keys == {f"{n}.{t}" for n in meta["layers"] for t in ("qweight", "scales", "zeros")}
        q = f.get_tensor("lm_head.qweight")
        assert q.dtype == torch.uint8 and q.shape == (512, 128) and int(q.max()) <= 15
        assert f.get_tensor("lm_head.scales").shape == (512, 1)
        z = f.get_tensor("model.layers.0.mlp.down_proj.zeros")
        assert z.dtype == torch.uint8 and z.shape == (128, 2) and bool((z == 8).all())
    loaded = gptq.load_quantized(out)
    assert gptq.quant_meta(out)["method"] == "gptq"
    from safetensors.torch import load_file

    w = load_file(str(tiny_untied / "model-lm_head.safetensors"))["lm_head.weight"]
    deq = gptq.dequantize(*loaded["lm_head"], gptq.layer_group_size(meta, "lm_head"))
    assert deq.shape == w.shape and (deq - w).square().sum() / w.square().sum() < 0.2
    m = results["gptq"]["metrics"]
    assert m["layers"] == 15 and m["max_out_rel_err"] >= m["mean_out_rel_err"] > 0
    assert m["mean_out_rel_err"] < results["rtn"]["metrics"]["mean_out_rel_err"]


@pytest.mark.parametrize("device, priority, head_setting, want", [
    ("x86_avx512", "speed", None, 32),      # ORT MatMulNBits: a group size per node
    ("x86_avx2", "speed", None, 32),        # tinygemm: a group size per layer
    ("xeon_amx", "speed", None, 128),       # vLLM's GPTQ config: one group size for every layer
    ("xeon_amx", "fidelity", None, 32),     # tinygemm again
    ("xeon_amx", "speed", 64, 64),          # an explicit size is taken as it is
])
def test_the_head_gets_its_own_group_size_where_the_kernel_takes_one(device, priority, head_setting, want):
    assert _quantize_settings(device, priority, head_group_size=head_setting)["head_group_size"] == want


@pytest.mark.parametrize("device, priority, setting, want", [
    ("x86_avx512", "speed", None, 256),     # ORT MatMulNBits, the speed path: fewer blocks, faster kernel
    ("x86_avx2", "speed", None, 128),       # tinygemm
    ("xeon_amx", "speed", None, 128),       # vLLM's GPTQ
    ("xeon_amx", "fidelity", None, 128),    # tinygemm again
    ("x86_avx512", "speed", 64, 64),        # an explicit size is taken as it is
])
def test_the_body_group_size_follows_the_kernel(device, priority, setting, want):
    s = _quantize_settings(device, priority, group_size=setting)
    assert s["group_size"] == want
    # the null default is a preference that gives way to a K it does not divide: per layer where the kernel
    # takes a size per layer, for the whole model where it takes one (vLLM's GPTQ: xeon_amx at speed)
    one_size = device == "xeon_amx" and priority == "speed"
    assert s["group_size_by_kernel"] is (setting is None and not one_size)
    assert s["group_size_model_wide"] is (setting is None and one_size)
    if device == "xeon_amx" and priority == "speed":  # vLLM: the head shares the body's size
        assert s["head_group_size"] == want


def test_the_kernels_group_size_gives_way_to_a_k_it_does_not_divide():
    from stages import quantize

    auto = _quantize_settings("x86_avx512", "speed", group_size=None)
    assert quantize._layer_group_size("model.layers.0.self_attn.q_proj", 896, auto) == 128  # 7 x 128
    assert quantize._layer_group_size("model.layers.0.mlp.down_proj", 4864, auto) == 256
    assert quantize._layer_group_size("model.layers.0.mlp.down_proj", 160, auto) == 32
    with pytest.raises(StageError, match=r"K=40 .*<= 256 .*32, 64, 128, 256"):
        quantize._layer_group_size("model.layers.0.mlp.down_proj", 40, auto)
    pinned = _quantize_settings("x86_avx512", "speed", group_size=256)  # the user's own size still fails loudly
    with pytest.raises(StageError, match=r"group_size=256 does not divide in_features K=896"):
        quantize._layer_group_size("model.layers.0.self_attn.q_proj", 896, pinned)


def test_quantize_records_the_layers_the_kernels_size_does_not_divide(tiny_untied, calibrated, tmp_path):
    from pipeline.engine import devices
    from stages import quantize

    cal, _ = calibrated
    out = tmp_path / "q"
    cfg = {"quantize": {**QCFG, "group_size": None, "eight_bit_budget": 0},
           "device": devices.spec_sheet("x86_avx512"), "priority": {"name": "speed"}}
    quantize.run(ctx("quantize", out, cfg, {"untie_head": tiny_untied, "calibrate": cal}))
    meta = json.loads((out / "quant.json").read_text())
    assert meta["group_size"] == 256
    layers = meta["layers"]
    assert layers["model.layers.0.mlp.down_proj"]["in_features"] == 256
    assert "group_size" not in layers["model.layers.0.mlp.down_proj"]  # K=256: the kernel's size
    assert layers["model.layers.0.self_attn.q_proj"]["in_features"] == 128
    assert layers["model.layers.0.self_attn.q_proj"]["group_size"] == 128  # K=128: the largest that divides
    loaded = gptq.load_quantized(out)
    assert tuple(loaded["model.layers.0.mlp.down_proj"][1].shape)[1] == 1
    assert tuple(loaded["model.layers.0.self_attn.q_proj"][1].shape)[1] == 1
    assert gptq.layer_group_size(meta, "model.layers.0.self_attn.q_proj") == 128


def _quantize_settings(device: str, priority: str, **quantize) -> dict:
    """The quantize stage's settings for QCFG plus `quantize`, built for `device` at `priority`."""
    from pipeline.engine import devices
    from stages import quantize as stage

    cfg = OmegaConf.create({"quantize": {**QCFG, **quantize},
                            "device": devices.spec_sheet(device), "priority": {"name": priority}})
    return stage._settings(cfg)


@pytest.mark.parametrize("device, priority, head_setting, want", [
    ("x86_avx512", "speed", None, 8),       # ORT MatMulNBits takes 8-bit blocks
    ("x86_avx2", "speed", None, 4),         # tinygemm: 4-bit only
    ("xeon_amx", "speed", None, 4),         # vLLM's GPTQ: 4-bit only
    ("x86_llamacpp", "speed", None, 8),     # GGUF: Q8_0 holds an 8-bit group-32 symmetric head
    ("x86_avx512", "speed", 4, 4),          # an explicit width is taken as it is
])
def test_the_head_gets_8_bits_where_the_kernel_takes_them(device, priority, head_setting, want):
    s = _quantize_settings(device, priority, head_bits=head_setting)
    assert s["head_bits"] == want
    assert s["head_bits_measured"] == (head_setting is None and want == 8)  # 8 until measured against 4


def test_an_8_bit_head_is_recorded_and_4_bit_layouts_refuse_it(tiny_untied, calibrated, tmp_path):
    from pipeline.quant.codes import PackError, read_quant
    from stages import quantize

    cal, _ = calibrated
    metas = {}
    for bits in (4, 8):
        out = tmp_path / f"head{bits}"
        quantize.run(ctx("quantize", out, {"quantize": {**QCFG, "head_group_size": 32, "head_bits": bits}},
                         {"untie_head": tiny_untied, "calibrate": cal}))
        metas[bits] = json.loads((out / "quant.json").read_text())
    meta = metas[8]
    assert meta["head_bits"] == 8 and meta["layers"]["lm_head"]["bits"] == 8 and "head_bits" not in metas[4]
    assert "bits" not in meta["layers"]["model.layers.0.mlp.down_proj"]
    assert gptq.layer_bits(meta, "lm_head") == 8 and gptq.layer_bits(meta, "model.layers.0.mlp.down_proj") == 4
    head8, head4 = meta["layers"]["lm_head"], metas[4]["layers"]["lm_head"]
    assert head8["out_rel_err_h"] < head4["out_rel_err_h"] / 50, (head8, head4)
    with pytest.raises(PackError, match="lm_head holds 8-bit codes"):
        read_quant(tmp_path / "head8")  # every 4-bit-only layout (tinygemm, GPTQ, GGUF Q4_0) reads this way
    _, layers = read_quant(tmp_path / "head8", bits=(4, 8))
    assert int(layers["lm_head"][0].max()) > 15 and int(layers["model.layers.0.mlp.down_proj"][0].max()) <= 15


@pytest.mark.parametrize("device, setting, want", [
    ("x86_avx512", None, 0.1),    # ORT MatMulNBits takes 8-bit blocks
    ("x86_avx2", None, 0.0),      # tinygemm: 4-bit only
    ("xeon_amx", None, 0.0),      # vLLM's GPTQ: 4-bit only
    ("x86_llamacpp", None, 0.0),  # GGUF Q4_0
    ("x86_avx512", 0.1, 0.1),     # an explicit budget is taken as it is
    ("x86_avx512", 0, 0.0),
])
def test_the_8_bit_budget_is_spent_only_where_the_kernel_takes_8_bits(device, setting, want):
    assert _quantize_settings(device, "speed", eight_bit_budget=setting)["eight_bit_budget"] == want


def test_the_8_bit_budget_promotes_whole_units_by_measured_gain(tiny_untied, calibrated, tmp_path):
    from pipeline.quant import bit_alloc
    from pipeline.quant.codes import PackError, read_quant
    from stages import quantize

    cal, _ = calibrated
    cal_layers = json.loads((cal / "calibration.json").read_text())["layers"]
    runs = {}
    for budget in (0.0, 0.3, 1.0):
        out = tmp_path / f"b{budget}"
        runs[budget] = quantize.run(ctx("quantize", out, {"quantize": {**QCFG, "eight_bit_budget": budget}},
                                        {"untie_head": tiny_untied, "calibrate": cal}))
        runs[budget] = (runs[budget]["metrics"], json.loads((out / "quant.json").read_text()))
    metrics, meta = runs[0.0]
    assert "eight_bit" not in meta and "eight_bit_units" not in metrics
    assert all("bits" not in e for e in meta["layers"].values())
    units = {u.key: u for u in bit_alloc.units(cal_layers, exclude=("lm_head",))}
    for budget in (0.3, 1.0):
        metrics, meta = runs[budget]
        rec = meta["eight_bit"]
        assert set(rec["units"]) == set(units) and rec["windows"] == 4 and rec["tokens"] == 4 * 32
        assert rec["budget_bytes"] == int(budget * bit_alloc.code_bytes(cal_layers, exclude=("lm_head",)))
        assert rec["chosen"] and rec["extra_bytes"] == sum(units[k].extra_bytes for k in rec["chosen"])
        assert rec["extra_bytes"] <= rec["budget_bytes"]
        eight = {n for k in rec["chosen"] for n in units[k].layers}  # a unit is promoted whole
        for name, entry in meta["layers"].items():
            assert entry.get("bits", 4) == (8 if name in eight else 4), name
            if name in eight:  # requantized at 8 bits: its own error far below the 4-bit run's
                assert entry["out_rel_err_h"] < runs[0.0][1]["layers"][name]["out_rel_err_h"] / 20, name
        # the first unit taken is the best measured per byte; and the choice did buy back logits SNR
        best = max((k for k in units if rec["units"][k]["gain"] > 0),
                   key=lambda k: rec["units"][k]["gain"] / units[k].extra_bytes)
        assert best == rec["chosen"][0]
        assert rec["snr_db"] > rec["snr_db_all_4bit"] and metrics["calibration_snr_db"] == rec["snr_db"]
        assert metrics["eight_bit_units"] == len(rec["chosen"])
    assert len(runs[1.0][1]["eight_bit"]["chosen"]) > len(runs[0.3][1]["eight_bit"]["chosen"])
    assert runs[1.0][1]["eight_bit"]["snr_db"] > runs[0.3][1]["eight_bit"]["snr_db"]
    with pytest.raises(PackError, match="eight_bit_budget=0"):
        read_quant(tmp_path / "b0.3")  # a 4-bit-only layout refuses the 8-bit units, naming the setting
    with pytest.raises(StageError, match="sensitivity_windows=99"):
        quantize.run(ctx("quantize", tmp_path / "bad", {"quantize": {**QCFG, "eight_bit_budget": 0.1,
                                                                     "sensitivity_windows": 99}},
                         {"untie_head": tiny_untied, "calibrate": cal}))


def test_quantize_records_the_heads_own_group_size(tiny_untied, calibrated, tmp_path):
    from stages import quantize

    cal, _ = calibrated
    out = tmp_path / "q"
    quantize.run(ctx("quantize", out, {"quantize": {**QCFG, "head_group_size": 32}},
                     {"untie_head": tiny_untied, "calibrate": cal}))
    meta = json.loads((out / "quant.json").read_text())
    assert meta["group_size"] == 128 and meta["head_group_size"] == 32
    assert meta["layers"]["lm_head"]["group_size"] == 32
    assert "group_size" not in meta["layers"]["model.layers.0.mlp.down_proj"]
    loaded = gptq.load_quantized(out)
    assert tuple(loaded["lm_head"][1].shape) == (512, 128 // 32)  # scales: one per 32 inputs
    assert gptq.layer_group_size(meta, "lm_head") == 32


def test_quantize_refuses_quantized_checkpoint_and_bad_config(tiny_untied, calibrated, tmp_path):
    import shutil

    from stages import quantize

    cal, _ = calibrated
    src = tmp_path / "src"
    shutil.copytree(tiny_untied, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StageError, match="already quantized"):
        quantize.run(ctx("quantize", tmp_path / "o1", {"quantize": QCFG}, {"untie_head": src, "calibrate": cal}))
    for bad, match in (({"bits": 8}, "only 4-bit"), ({"method": "awq"}, "not known"),
                       ({"group_size": 96}, "K=128")):
        with pytest.raises(StageError, match=match):
            quantize.run(ctx("quantize", tmp_path / "o2", {"quantize": {**QCFG, **bad}},
                             {"untie_head": tiny_untied, "calibrate": cal}))


def test_heldout_split_is_the_tail_and_never_empty():
    from pipeline.sources import corpus

    train, held = corpus.heldout_split(list(range(1000)), 0.05)
    assert len(held) == 50 and train + held == list(range(1000))
    with pytest.raises(corpus.CorpusError):
        corpus.heldout_split([1, 2, 3], 0.05)  # int(3 * 0.05) == 0: no held-out part


# --------------------------------------------------------------------------
# the null group size's fallback on every weight path (a hidden size of 576, as SmolLM's)
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def k576(tiny_untied, tmp_path_factory):
    """A 2-layer Llama checkpoint (random weights, the tiny model's tokenizer) whose q/k/v/o/gate/up and head
    read K=576 (SmolLM-135M's hidden size: 128 does not divide it), down K=256."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from stages import calibrate, untie_head

    root = tmp_path_factory.mktemp("k576")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(tiny_untied / f, root / "model" / f)
    untie_head.run(ctx("untie_head", root / "untied", {"model": {}}, {"model": root / "model"}))
    calibrate.run(ctx("calibrate", root / "cal", {"calibrate": CAL}, {"untie_head": root / "untied"}))
    return root / "untied", root / "cal"


@pytest.mark.parametrize("device, priority, path, body, down, head", [
    ("galaxy_s25", "speed", "qnn_graph", 64, 128, 32),       # the phone: sizes per layer, the head its own 32
    ("x86_avx2", "speed", "w4a16_tinygemm", 64, 128, 32),    # tinygemm: per layer
    ("xeon_amx", "speed", "w4a8_gptq_vllm", 64, 64, 64),     # vLLM's GPTQ: one size, dividing every K
    ("x86_avx512", "speed", "w4_ort_matmulnbits", 64, 256, 32),  # MatMulNBits, as before
])
def test_a_k_576_model_quantizes_with_the_null_group_size_on_every_weight_path(k576, tmp_path, device, priority,
                                                                                path, body, down, head):
    from pipeline.engine import devices
    from pipeline.quant import weight_path
    from stages import quantize

    spec = devices.spec_sheet(device)
    assert weight_path.select(spec, priority)["path"] == path
    untied, cal = k576
    out = tmp_path / "q"
    cfg = {"quantize": {**QCFG, "group_size": None, "eight_bit_budget": 0},
           "device": spec, "priority": {"name": priority}}
    quantize.run(ctx("quantize", out, cfg, {"untie_head": untied, "calibrate": cal}))
    meta = json.loads((out / "quant.json").read_text())
    sizes = {name: gptq.layer_group_size(meta, name) for name in meta["layers"]}
    assert meta["layers"]["model.layers.0.self_attn.q_proj"]["in_features"] == 576
    assert meta["layers"]["model.layers.0.mlp.down_proj"]["in_features"] == 256
    for name, g in sizes.items():
        k = meta["layers"][name]["in_features"]
        want = head if name == "lm_head" else down if k == 256 else body
        assert g == want, (name, k, g)
    loaded = gptq.load_quantized(out)
    assert tuple(loaded["model.layers.1.mlp.up_proj"][1].shape) == (256, 576 // body)
    if path == "w4a8_gptq_vllm":  # one size for the model, recorded as the model's, the kernel's default beside it
        assert meta["group_size"] == 64 and meta["group_size_default"] == 128
        assert all("group_size" not in e for e in meta["layers"].values()) and "head_group_size" not in meta
    else:  # the kernel's size stays the model's; the layers it does not divide record their own
        assert meta["group_size"] == (256 if path == "w4_ort_matmulnbits" else 128)
        assert "group_size_default" not in meta
        assert meta["layers"]["model.layers.0.self_attn.q_proj"]["group_size"] == 64


@pytest.mark.parametrize("device", ["galaxy_s25", "x86_avx2", "xeon_amx", "x86_avx512"])
def test_an_explicit_group_size_that_does_not_divide_k_still_fails(k576, tmp_path, device):
    from pipeline.engine import devices
    from stages import quantize

    untied, cal = k576
    cfg = {"quantize": {**QCFG, "group_size": 128, "eight_bit_budget": 0},
           "device": devices.spec_sheet(device), "priority": {"name": "speed"}}
    with pytest.raises(StageError, match=r"group_size=128 does not divide in_features K=576"):
        quantize.run(ctx("quantize", tmp_path / "q", cfg, {"untie_head": untied, "calibrate": cal}))


def test_the_model_wide_size_is_the_largest_dividing_every_k():
    from stages import quantize

    s = _quantize_settings("xeon_amx", "speed", group_size=None)
    assert s["group_size_model_wide"] and s["head_follows_body"] and not s["group_size_by_kernel"]
    layers = {"a": {"in_features": 576}, "b": {"in_features": 1536}, "lm_head": {"in_features": 576}}
    assert quantize._model_group_size(layers, s) == 64
    assert quantize._model_group_size({"a": {"in_features": 896}, "b": {"in_features": 4864}}, s) == 128
    assert quantize._model_group_size({"a": {"in_features": 160}}, s) == 32
    with pytest.raises(StageError, match=r"no group size <= 128 .* divides every in_features K .*40"):
        quantize._model_group_size({"a": {"in_features": 40}}, s)
    pinned = _quantize_settings("xeon_amx", "speed", group_size=128)
    assert not pinned["group_size_model_wide"] and not pinned["group_size_by_kernel"]


def test_the_null_sensitivity_windows_take_about_512_tokens_measured_from_the_hidden_states(tiny_untied, calibrated,
                                                                                             tmp_path):
    from stages import quantize

    cal, _ = calibrated  # 16 windows x 32 tokens
    out = tmp_path / "q"
    quantize.run(ctx("quantize", out, {"quantize": {**QCFG, "eight_bit_budget": 0.3, "sensitivity_windows": None}},
                     {"untie_head": tiny_untied, "calibrate": cal}))
    rec = json.loads((out / "quant.json").read_text())["eight_bit"]
    assert rec["windows"] == quantize.SENSITIVITY_TOKENS // 32 == 16 and rec["tokens"] == 512
    assert rec["measured_by"] == "head_gram+prefix_replay"
    assert rec["chosen"] and rec["snr_db"] > rec["snr_db_all_4bit"]


def test_a_weight_already_on_the_8bit_grid_skips_the_search_with_the_same_codes():
    """A GGUF-origin tensor (Q8_0: int8 codes, a scale per 32) is exact on the 8-bit g32 grid:
    gptq.on_grid gives what the 32-candidate search and GPTQ give, bytes and all, at once."""
    import torch

    from pipeline.quant import gptq

    torch.manual_seed(0)
    n, k, g = 48, 128, 32
    codes = torch.randint(-127, 128, (n, k // g, g)).float()
    codes[..., 0] = 127  # each group reaches +-absmax, as a Q8_0 block does
    codes[5] = 0  # an all-zero row: the plain candidate wins there
    inv = torch.tensor(1.0 / 127, dtype=torch.float32)
    scales = torch.empty(n, k // g)
    for idx in range(scales.numel()):  # scales s with fl(fl(127 s) / 127) == s, as the grid computes them
        s = torch.tensor(0.001 + 0.0001 * idx, dtype=torch.float32)
        while not torch.equal((s * 127) * inv, s):
            s = torch.nextafter(s, torch.tensor(1.0))
        scales.view(-1)[idx] = s
    w = (codes * scales[..., None]).reshape(n, k)
    h = torch.randn(400, k)
    h = h.T @ h
    fast = gptq.on_grid(w, g, bits=8)
    assert fast is not None and torch.equal(fast.dequantize(), w)
    for slow in (gptq.gptq_quantize(w.clone(), h, group_size=g, bits=8),
                 gptq.rtn_quantize(w.clone(), h, group_size=g, bits=8)):
        assert torch.equal(fast.qweight, slow.qweight) and torch.equal(fast.scales, slow.scales)
        assert torch.equal(fast.zeros, slow.zeros)
    assert gptq.quantize_weight(w, h, group_size=g, bits=8).qweight.data_ptr() != 0
    assert gptq.on_grid(torch.randn(8, 64), 32, bits=8) is None  # an ordinary weight takes the search


def test_errors_by_row_slabs_equal_the_whole_formula():
    import torch

    from pipeline.quant import gptq

    torch.manual_seed(1)
    w = torch.randn(1000, 64)
    h = torch.randn(300, 64)
    h = h.T @ h
    q = gptq.rtn_quantize(w, h, group_size=32)
    whole = gptq.errors(w, q.dequantize(), h, rows=10**9)
    for rows in (7, 128, 1000):
        slabs = gptq.errors(w, q, h, rows=rows)
        for k in ("weight_rel_mse", "out_rel_err_h"):
            # the [rows, K] x [K, K] products are float32 (the sums float64): slabs differ in rounding only
            assert abs(slabs[k] - whole[k]) <= 1e-6 * abs(whole[k]), (rows, k)
    e = (w - q.dequantize()).double()
    exact = float(((e @ h.double()) * e).sum() / ((w.double() @ h.double()) * w.double()).sum())
    assert abs(whole["out_rel_err_h"] - exact) <= 1e-6 * exact


def _at_codes_model(untied: Path, quant_dir: Path):
    """The untied checkpoint's model with every quantized linear at its dequantized codes."""
    from safetensors.torch import load_file

    from pipeline.sources.checkpoint_files import load_hf_model

    meta = json.loads((quant_dir / "quant.json").read_text())
    t = load_file(str(quant_dir / gptq.QUANT_TENSORS))
    model = load_hf_model(untied)
    for name, info in meta["layers"].items():
        g = int(info.get("group_size", meta.get("head_group_size", meta["group_size"]) if name == "lm_head"
                         else meta["group_size"]))
        w = gptq.dequantize(t[f"{name}.qweight"], t[f"{name}.scales"], t[f"{name}.zeros"], g)
        model.get_submodule(name).weight.data.copy_(w)
    return model


def _quantize_no_budget(device: str, extra: dict, untied: Path, cal: Path, out: Path) -> dict:
    """The quantize stage for `device` at speed with no 8-bit budget (QCFG plus `extra`); its quant.json."""
    from pipeline.engine import devices
    from stages import quantize

    cfg = {"quantize": {**QCFG, "eight_bit_budget": 0, **extra}, "device": devices.spec_sheet(device),
           "priority": {"name": "speed"}}
    quantize.run(ctx("quantize", out, cfg, {"untie_head": untied, "calibrate": cal}))
    return json.loads((out / "quant.json").read_text())


@pytest.mark.parametrize("device, extra", [
    ("x86_avx512", {"head_rows8": 0}),  # ORT's MatMulNBits (bits=8 blocks); one width (its rows: below)
    ("x86_llamacpp", {"group_size": 32, "scale_dtype": "fp16"}),  # GGUF Q8_0 (quantize=q4_0's settings)
])
@pytest.mark.parametrize("min_gain_db, want", [(-1.0, 8), (1e9, 4)])
def test_the_heads_width_is_measured_where_the_kernel_takes_8_bits(tiny_untied, calibrated, tmp_path, monkeypatch,
                                                                    min_gain_db, want, device, extra):
    """quantize.head_bits: null on ORT's MatMulNBits and llama.cpp: the head at 4 and at 8 bits, each weighed by the
    calibration logits' SNR with the decoder at its codes (the figure a direct logits run gives), 8 bits
    kept where they gain HEAD_MIN_GAIN_DB; both options' bytes and SNR are recorded with the choice,
    and the head that ships is the chosen one."""
    import numpy as np

    from pipeline.quant import bit_alloc
    from stages import quantize

    monkeypatch.setattr(quantize, "HEAD_MIN_GAIN_DB", min_gain_db)
    cal, _ = calibrated
    out = tmp_path / "measured"
    meta = _quantize_no_budget(device, extra, tiny_untied, cal, out)
    if device == "x86_llamacpp":  # either width is what GGUF holds exactly (Q4_0 / Q8_0)
        from pipeline.quant import gguf_q4
        from pipeline.quant.codes import read_quant

        gguf_q4.check_q4_0(read_quant(out, bits=(4, 8))[1], meta)
    rec = meta["head"]
    assert "eight_bit" not in meta and rec["measured"]
    four, eight = rec["options"]["4"], rec["options"]["8"]
    n, k = meta["layers"]["lm_head"]["out_features"], meta["layers"]["lm_head"]["in_features"]
    assert eight["extra_bytes"] == n * k // 2 and four["extra_bytes"] == 0
    assert eight["snr_db"] > four["snr_db"]
    assert rec["gain_db"] == pytest.approx(eight["snr_db"] - four["snr_db"], abs=2e-3)
    assert rec["chosen"] == want and gptq.layer_bits(meta, "lm_head") == want
    # the recorded SNR of the chosen width is the one a direct run of the logits measures
    windows = np.load(cal / "token_ids.npy")[:4]
    from pipeline.sources.checkpoint_files import load_hf_model

    err = bit_alloc.LogitsError(load_hf_model(tiny_untied), windows)
    err.model = _at_codes_model(tiny_untied, out)
    # the embedded model is tied: the pack ships the head's codes as its embedding too, and so it was measured
    assert rec["embedding"].startswith("the head's own tensor")
    assert meta["embedding"]["chosen"] == "head" and not meta["embedding"]["measured"]
    err.model.get_input_embeddings().weight.data.copy_(err.model.lm_head.weight.data)
    snr = -10 * np.log10(err())
    assert snr == pytest.approx(rec["options"][str(want)]["snr_db"], abs=0.01)


@pytest.mark.parametrize("share, want", [(1e9, 16), (-1.0, 0)])
def test_an_8_bit_heads_rows_are_measured_by_the_calibration_texts_probability(tiny_untied, calibrated, tmp_path,
                                                                               monkeypatch, share, want):
    """quantize.head_rows8: null on ORT's MatMulNBits, the head at 8 bits: the rows ranked by the
    full-precision model's probability mass on the calibration windows, the narrowest share of
    head_rows.LADDER within the tolerance ships (a tolerance no share meets: every row at 8 bits). The
    shipped head's rows are the 8-bit codes' on the most probable rows and the 4-bit codes' elsewhere
    (each row GPTQ's own at its width), `lm_head.row_bits` says which, and the recorded KL divergence is
    the one a direct run of the model at those codes gives."""
    import numpy as np
    from safetensors.torch import load_file

    from pipeline.quant import head_rows
    from pipeline.sources.checkpoint_files import load_hf_model
    from stages import quantize

    monkeypatch.setattr(quantize, "HEAD_MIN_GAIN_DB", -1.0)  # the head at 8 bits
    monkeypatch.setattr(head_rows, "MAX_KLD_SHARE", share)
    monkeypatch.setattr(head_rows, "MIN_KLD", 0.0 if share > 0 else -1.0)
    cal, _ = calibrated
    mixed = _quantize_no_budget("x86_avx512", {}, tiny_untied, cal, tmp_path / "mixed")
    one = _quantize_no_budget("x86_avx512", {"head_rows8": 0}, tiny_untied, cal, tmp_path / "one")
    rec, n = mixed["head_rows"], mixed["layers"]["lm_head"]["out_features"]
    assert rec["measured"] and "head_rows" not in one
    t, t1 = load_file(str(tmp_path / "mixed" / gptq.QUANT_TENSORS)), load_file(str(tmp_path / "one" / gptq.QUANT_TENSORS))
    if not want:
        assert rec["chosen"] == 0 and len(rec["options"]) == len(head_rows.LADDER)  # every share tried
        assert "row_bits" not in mixed["layers"]["lm_head"] and "lm_head.row_bits" not in t
        assert torch.equal(t["lm_head.qweight"], t1["lm_head.qweight"])
        return
    assert rec["chosen"] == n // want and list(rec["options"]) == [str(n // want)]
    assert mixed["layers"]["lm_head"]["row_bits"] == {"8": n // want, "4": n - n // want}
    rows8 = t["lm_head.row_bits"] == 8
    assert int(rows8.sum()) == n // want and set(t["lm_head.row_bits"].unique().tolist()) == {4, 8}
    assert torch.equal(t["lm_head.qweight"][rows8], t1["lm_head.qweight"][rows8])  # the 8-bit codes' rows
    assert int(t["lm_head.qweight"][~rows8].max()) <= 15 and (t["lm_head.zeros"][~rows8] == 8).all()
    assert (t["lm_head.zeros"][rows8] == 128).all()
    # the 8-bit rows are the most probable ones under the full-precision model on the calibration windows
    windows = np.load(cal / "token_ids.npy")[:4]
    ref = load_hf_model(tiny_untied)
    with torch.no_grad():
        ref_h = [ref.base_model(torch.as_tensor(w)[None], use_cache=False).last_hidden_state[0] for w in windows]
    mass = head_rows.probability_mass(ref_h, ref.lm_head.weight.data)
    assert torch.equal(head_rows.top_rows(mass, n // want), rows8)
    assert rec["options"][str(n // want)]["mass"] == pytest.approx(float(mass[rows8].sum()), abs=1e-5)
    # the recorded KL divergence is a direct run's, the tied table taking the head's codes
    model = _at_codes_model(tiny_untied, tmp_path / "mixed")
    model.get_input_embeddings().weight.data.copy_(model.lm_head.weight.data)
    with torch.no_grad():
        h = [model.base_model(torch.as_tensor(w)[None], use_cache=False).last_hidden_state[0] for w in windows]
    got = head_rows.kld(h, ref_h, model.lm_head.weight.data, ref.lm_head.weight.data)
    assert got == pytest.approx(rec["options"][str(n // want)]["kld"], rel=1e-3, abs=1e-6)
    assert rec["options"][str(n // want)]["bytes"] < rec["bytes_8bit"]


@pytest.mark.parametrize("device, rows8, message", [
    ("x86_llamacpp", 64, "MatMulNBits graph only"),
    ("x86_avx512", -1, "0, a count of rows, or null"),
])
def test_head_rows8_is_refused_where_it_cannot_ship(tiny_untied, calibrated, tmp_path, device, rows8, message):
    from pipeline.engine.context import StageError

    cal, _ = calibrated
    with pytest.raises(StageError, match=message):
        _quantize_no_budget(device, {"head_rows8": rows8}, tiny_untied, cal, tmp_path / "q")


@pytest.fixture(scope="module")
def truly_untied(tiny_untied, tmp_path_factory):
    """The tiny checkpoint with its table no longer the head's (an untied model), calibrated."""
    import shutil

    from safetensors.torch import load_file, save_file

    from stages import calibrate

    root = tmp_path_factory.mktemp("untied")
    ck = root / "ck"
    shutil.copytree(tiny_untied, ck)
    for f in ck.glob("*.safetensors"):
        state = load_file(str(f))
        name = next((n for n in state if n.endswith("embed_tokens.weight")), None)
        if name is not None:
            g = torch.Generator().manual_seed(5)
            w = state[name]
            state[name] = (w + 0.5 * w.std() * torch.randn(w.shape, generator=g)).contiguous()
            save_file(state, str(f), metadata={"format": "pt"})
    calibrate.run(ctx("calibrate", root / "cal", {"calibrate": CAL}, {"untie_head": ck}))
    return ck, root / "cal"


@pytest.mark.parametrize("device, extra", [
    ("x86_avx512", {}),  # ORT: GatherBlockQuantized, the table kept fp32
    ("x86_llamacpp", {"group_size": 32, "scale_dtype": "fp16"}),  # GGUF Q8_0 / Q4_0, the table kept f16
])
@pytest.mark.parametrize("max_loss_db, want", [(None, None), (1e9, "int4"), (-1.0, "keep")])
def test_an_untied_tables_form_is_measured_and_recorded(truly_untied, tmp_path, monkeypatch, device, extra,
                                                        max_loss_db, want):
    """Where the kernel gathers from block codes, an untied table is measured kept, at 8 and at 4 bits:
    per option the calibration logits' SNR (the figure a direct logits run gives, with the head and the
    decoder at their codes and the table at gptq.embedding_codes), its loss against the table kept, its
    bytes; the narrowest option within EMBED_MAX_LOSS_DB ships (the table kept whatever the bound)."""
    import numpy as np

    from pipeline.quant import bit_alloc
    from pipeline.sources.checkpoint_files import load_hf_model
    from stages import quantize

    if max_loss_db is not None:
        monkeypatch.setattr(quantize, "EMBED_MAX_LOSS_DB", max_loss_db)
    ck, cal = truly_untied
    out = tmp_path / "q"
    meta = _quantize_no_budget(device, extra, ck, cal, out)
    rec = meta["embedding"]
    assert rec["measured"] and list(rec["options"]) == ["int4", "int8", "keep"]
    v, k = TINY["vocab_size"], TINY["hidden_size"]
    scales = v * k // 32 * (4 if device == "x86_avx512" else 2)  # fp32 in ORT's graph, fp16 in GGUF's blocks
    assert [o["bytes"] for o in rec["options"].values()] == \
        [v * k // 2 + scales, v * k + scales, v * k * (4 if device == "x86_avx512" else 2)]
    bound = quantize.EMBED_MAX_LOSS_DB
    assert rec["max_loss_db"] == bound
    fits = [key for key, o in rec["options"].items() if key == "keep" or o["loss_db"] <= bound]
    assert rec["chosen"] == fits[0] and (want is None or rec["chosen"] == want)
    assert rec["options"]["keep"]["loss_db"] == 0 < rec["options"]["int4"]["loss_db"]
    # each option's recorded SNR is the one a direct run of the logits measures
    windows = np.load(cal / "token_ids.npy")[:4]
    err = bit_alloc.LogitsError(load_hf_model(ck), windows)
    err.model = _at_codes_model(ck, out)
    table = err.model.get_input_embeddings().weight.data
    full = table.clone()
    for key, option in rec["options"].items():
        table.copy_(full if key == "keep" else gptq.embedding_codes(full, int(key[3:])).dequantize())
        assert -10 * np.log10(err()) == pytest.approx(option["snr_db"], abs=0.01), key


def test_calibrate_on_a_users_chat_file_through_the_chat_template(tiny_untied, tmp_path):
    """calibrate.dataset=FILE.jsonl with chat_template: each record's messages rendered by the checkpoint's
    own template, framed, cut into windows; calibration.json records the source and the windows' sha256 is of
    exactly those ids; a checkpoint without a template is refused in one line."""
    import shutil

    from transformers import AutoTokenizer

    from pipeline.sources import textdata
    from stages import calibrate

    ck = tmp_path / "ck"
    shutil.copytree(tiny_untied, ck)
    tc = json.loads((ck / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
    (ck / "tokenizer_config.json").write_text(json.dumps(tc))
    chats = tmp_path / "chats.jsonl"
    import argparse
    import collections

    lines = [json.dumps({"messages": [{"role": "user", "content": f"explain {m.__name__}"},
                                      {"role": "assistant", "content": m.__doc__}]}) for m in (argparse, collections)]
    chats.write_text("\n".join(lines) + "\n")
    cfg = {"calibrate": {**CAL, "dataset": str(chats), "field": "messages", "chat_template": True,
                         "samples": 4, "min_samples": 4}}
    out = tmp_path / "cal"
    calibrate.run(ctx("calibrate", out, cfg, {"untie_head": ck}))
    info = json.loads((out / "calibration.json").read_text())
    assert info["dataset"] == str(chats) and info["samples"] == 4
    assert info["corpus"]["chat_template"] is True and info["corpus"]["documents"] == 2
    ids, _ = textdata.stream(AutoTokenizer.from_pretrained(ck), chats, "messages", True)
    windows = torch.tensor(ids[: info["windows_available"] * 32]).view(-1, 32)
    picks = torch.randperm(info["windows_available"], generator=torch.Generator().manual_seed(0))[:4].sort().values
    assert hashlib.sha256(windows[picks].numpy().astype("<i4").tobytes()).hexdigest() == info["data_sha256"]
    with pytest.raises(StageError, match="no chat template"):
        calibrate.run(ctx("calibrate", tmp_path / "c2", cfg, {"untie_head": tiny_untied}))


def test_the_inverse_hessian_factor_is_gptqs_three_step_recipe():
    """Cholesky of the reversed H and one triangular inverse give the same upper factor of H^-1 as GPTQ's
    Cholesky -> cholesky_inverse -> upper Cholesky, with one cubic step fewer."""
    from pipeline.quant import gptq

    torch.manual_seed(0)
    k = 300
    x = torch.randn(200, k, dtype=torch.float64) * torch.rand(k, dtype=torch.float64)  # rank < K: the damping binds
    h = x.T @ x
    u = gptq._inverse_hessian_factor(h, 0.01, "w")
    damped = h + 0.01 * torch.diagonal(h).mean() * torch.eye(k, dtype=torch.float64)
    want = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    assert torch.equal(u, u.triu()) and bool((torch.diagonal(u) > 0).all())
    assert float((u - want).abs().max() / want.abs().max()) < 1e-12
    assert float((u.T @ u - torch.linalg.inv(damped)).abs().max() / torch.linalg.inv(damped).abs().max()) < 1e-10
