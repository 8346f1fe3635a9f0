"""The hand-built GroupQueryAttention + MatMulNBits graph against the GPTQ reference.

Tiny random-init Gemma3 / Qwen3 / Llama checkpoints (no downloads), untied,
their linears round-to-nearest quantized in the quantize stage's format
(scales rounded to float16 values, so the GPTQ folder that
`runtimes.tinygemm.GptqReference` loads holds exactly the same weights). Window 8,
sequences of 40+ tokens: every check runs well past the sliding window.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from pipeline.quant import int4_layouts as L  # noqa: E402
from pipeline.runtimes.contract import ContextFull  # noqa: E402
from pipeline.runtimes.reference import TorchReference
from pipeline.graphs.decode_graph import snr_db
from edgekiln_runtime.gqa import GqaDecoder  # noqa: E402
from pipeline.graphs.gqa_graph import GqaGraphError, build_gqa_graph, genai_config, write_genai_config
from pipeline.runtimes.tinygemm import GptqReference
from pipeline.quant.codes import read_quant  # noqa: E402
from tests.conftest import needs_genai  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 8
VOCAB = 128
MAX_LEN = 48
GROUP = 32


def _gemma3(hidden: int = 64):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
        query_pre_attn_scalar=24, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    )
    return Gemma3ForCausalLM(cfg)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(cfg)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _llama_bias():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.5)  # zero-initialized by HF: give them values that show
    return model


BUILDERS = {"gemma3": _gemma3, "gemma3_96": lambda: _gemma3(96), "qwen3": _qwen3, "llama": _llama, "llama_bias": _llama_bias}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rtn(w: np.ndarray, sym: bool):
    """RTN codes in the quantize stage's layout; scales float16-exact (the GPTQ folder stores fp16)."""
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP).astype(np.float32)
    if sym:
        s = np.abs(wg).max(-1) / 7.0
        s = np.where(s == 0, 1.0, s).astype(np.float16).astype(np.float32)
        z = np.full((n, k // GROUP), 8, np.uint8)
    else:
        lo, hi = wg.min(-1), wg.max(-1)
        s = (hi - lo) / 15.0
        s = np.where(s == 0, 1.0, s).astype(np.float16).astype(np.float32)
        z = np.clip(np.round(-lo / s), 1, 15).astype(np.uint8)  # 1..15: GPTQ v1 cannot store 0
    q = np.clip(np.round(wg / s[..., None]) + z[..., None], 0, 15).astype(np.uint8).reshape(n, k)
    return q, s, z


def _checkpoint(root: Path, name: str, sym: bool = True, seed: int = 0, tied: bool = False, model=None) -> dict:
    """hf/ (untied), quant/ (quant.json + quantized.safetensors), gptq/ (for GptqReference).

    `tied`: the head holds a copy of the embedding (a tied model after the untie_head stage);
    `model`: this model instead of BUILDERS[name]'s (tests/test_families.py: every family's)."""
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as save_torch

    torch.manual_seed(seed)
    model = (BUILDERS[name]() if model is None else model).eval()
    with torch.no_grad():  # random init leaves norms at identity: perturb them so they matter
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
        if tied:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(root / "hf")
    tensors, layers, gptq = {}, {}, {}
    for lname, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            q, s, z = _rtn(mod.weight.detach().numpy(), sym)
            tensors.update({f"{lname}.qweight": q, f"{lname}.scales": s, f"{lname}.zeros": z})
            layers[lname] = {"in_features": q.shape[1], "out_features": q.shape[0]}
            for part, t in L.to_gptq(q, s, z, GROUP).items():
                gptq[f"{lname}.{part}"] = t
    (root / "quant").mkdir()
    save_file(tensors, str(root / "quant" / "quantized.safetensors"))
    (root / "quant" / "quant.json").write_text(json.dumps(
        {"format": "edgekiln-int4/1", "bits": 4, "group_size": GROUP, "sym": sym, "method": "rtn", "layers": layers}))
    (root / "gptq").mkdir()
    for k, v in model.state_dict().items():
        if not (k.endswith(".weight") and k[: -len(".weight")] in layers):
            gptq[k] = v.detach().clone().contiguous()
    save_torch(gptq, str(root / "gptq" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "hf" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": sym,
                                  "desc_act": False, "lm_head": True, "checkpoint_format": "gptq"}
    (root / "gptq" / "config.json").write_text(json.dumps(cfg))
    return {"root": root, "hf": root / "hf", "quant": root / "quant", "gptq": root / "gptq"}


# The tests of the graph's arithmetic build it with an fp32 KV cache, where it is exact to the reference
# (> 90 dB); the fp16 cache (the default) is checked against it in test_fp16_kv_cache_*.
EXACT = {"kv_dtype": "float32"}


def _graph(ck, acc: int, tag: str = "", **options) -> Path:
    out = ck["root"] / f"gqa_acc{acc}{tag}"
    if not (out / "io.json").is_file():
        facts = build_gqa_graph(ck["hf"], ck["quant"], out, max_len=MAX_LEN, accuracy_level=acc,
                                **{**EXACT, **options})
        (out / "facts.json").write_text(json.dumps(facts, default=str))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cache = {}

    def get(name, sym=True, tied=False):
        if (name, sym, tied) not in cache:
            cache[(name, sym, tied)] = _checkpoint(
                tmp_path_factory.mktemp(f"{name}_{'sym' if sym else 'asym'}{'_tied' if tied else ''}"), name, sym,
                tied=tied)
        return cache[(name, sym, tied)]

    return get


def _seq(n=40, seed=1):
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def _steps(runtime, ids):
    runtime.reset()
    return np.stack([runtime.step(t) for t in ids])


def _reference(ck):
    return TorchReference(GptqReference(ck["gptq"]).model)


# --------------------------------------------------------------------------
# logits against the GPTQ reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name,sym,acc,min_snr", [
    ("gemma3", True, 0, 90.0), ("qwen3", True, 0, 90.0), ("llama", True, 0, 90.0),
    ("llama_bias", True, 0, 90.0),  # attention / MLP biases as the MatMulNBits bias input
    ("gemma3", False, 0, 90.0),  # zero points shipped to MatMulNBits
    ("gemma3", True, 4, 25.0), ("qwen3", True, 4, 25.0),  # int8 activations: ORT's own rounding
])
def test_logits_match_gptq_reference(ckpts, name, sym, acc, min_snr):
    ck = ckpts(name, sym)
    dec = GqaDecoder(_graph(ck, acc), threads=1)
    ids = _seq()
    ref = _steps(_reference(ck), ids)
    got = _steps(dec, ids)
    per_pos = [snr_db(a, b) for a, b in zip(ref, got)]
    assert snr_db(ref, got) > min_snr + 5 and min(per_pos) > min_snr, (snr_db(ref, got), min(per_pos))
    top_ref, top_got = ref.argmax(-1), got.argmax(-1)
    if acc == 0:
        assert (top_ref == top_got).all()
    else:  # a flip is allowed only where the reference itself is a near tie
        srt = np.sort(ref, -1)
        margin = srt[:, -1] - srt[:, -2]
        err = np.abs(ref - got).max(-1)
        assert ((top_ref == top_got) | (margin < 2 * err)).all()
        assert (top_ref == top_got).mean() >= 0.9


ATTN0 = tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo")


@pytest.mark.parametrize("eight,acc,min_snr", [
    (("lm_head",), 0, 90.0), (("lm_head",), 4, 25.0),  # quantize.head_bits=8
    (("lm_head", *ATTN0), 0, 90.0), (("lm_head", *ATTN0), 4, 25.0),  # + a layer's attention (eight_bit_budget)
])
def test_8_bit_layers_are_one_code_a_byte_and_match_their_dequantized_model(ckpts, tmp_path, eight, acc, min_snr):
    """8-bit layers (the head, quantize.head_bits; decoder units, quantize.eight_bit_budget): their
    MatMulNBits take bits=8 blocks, q/k/v still fused as one; the graph computes the model holding the
    4-bit and 8-bit layers as dequantized (the reference with the 8-bit weights swapped in)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    ck = ckpts("qwen3")
    quant = tmp_path / "quant8"
    shutil.copytree(ck["quant"], quant)
    tensors = load_file(str(quant / "quantized.safetensors"))
    meta = json.loads((quant / "quant.json").read_text())
    ref_model = GptqReference(ck["gptq"]).model
    for name in eight:
        w = ref_model.get_submodule(name).weight.detach().numpy()  # its 4-bit dequantized weight: a fair target
        n, k = w.shape
        wg = w.reshape(n, k // GROUP, GROUP)
        s = (np.abs(wg).max(-1) / 127.0).astype(np.float32)
        s = np.where(s == 0, 1.0, s).astype(np.float32)
        q = np.clip(np.round(wg / s[..., None]) + 128, 0, 255).astype(np.uint8).reshape(n, k)
        z = np.full(s.shape, 128, np.uint8)
        tensors.update({f"{name}.qweight": q, f"{name}.scales": s, f"{name}.zeros": z})
        meta["layers"][name]["bits"] = 8
        with torch.no_grad():
            ref_model.get_submodule(name).weight.copy_(torch.from_numpy(L.dequant(q, s, z, GROUP, bits=8)))
    meta["head_bits"] = 8
    save_file(tensors, str(quant / "quantized.safetensors"))
    (quant / "quant.json").write_text(json.dumps(meta))
    out = tmp_path / f"gqa8_{acc}"
    facts = build_gqa_graph(ck["hf"], quant, out, max_len=MAX_LEN, accuracy_level=acc, **EXACT)
    for rec in facts["matmulnbits"].values():
        assert rec["bits"] == (8 if set(rec["layers"]) <= set(eight) else 4), rec
    assert any(len(r["layers"]) == 3 and r["bits"] == (8 if ATTN0[0] in eight else 4)
               for r in facts["matmulnbits"].values() if ATTN0[0] in r["layers"])  # q/k/v fused either way
    ids = _seq()
    ref, got = _steps(TorchReference(ref_model), ids), _steps(GqaDecoder(out, threads=1), ids)
    assert snr_db(ref, got) > min_snr + 5, snr_db(ref, got)


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_prefill_equals_stepping(ckpts, name):
    ck = ckpts(name)
    dec = GqaDecoder(_graph(ck, 0), threads=1)
    ids = _seq(37, seed=2)
    stepped = _steps(dec, ids)
    dec.reset()
    last = dec.prefill(ids)
    assert dec.position == len(ids)
    assert snr_db(stepped[-1], last) > 100.0
    # then decoding continues from the prefilled cache exactly as from the stepped one
    after_prefill = np.stack([dec.step(t) for t in (5, 6, 7)])
    dec.reset()
    for t in ids:
        dec.step(t)
    after_steps = np.stack([dec.step(t) for t in (5, 6, 7)])
    assert snr_db(after_steps, after_prefill) > 100.0
    # chunked prefill (a chunk on top of a cache, longer than the window) = one prefill
    dec.reset()
    dec.prefill(ids[:5])
    dec.prefill(ids[5:20])
    chunked = dec.prefill(ids[20:])
    assert snr_db(stepped[-1], chunked) > 100.0


def test_prefill_at_accuracy_level_4_matches_reference(ckpts):
    ck = ckpts("gemma3")
    dec = GqaDecoder(_graph(ck, 4), threads=2)
    ids = _seq(30, seed=3)
    ref = _steps(_reference(ck), ids)[-1]
    dec.reset()
    assert snr_db(ref, dec.prefill(ids)) > 30.0


def test_window_semantics_are_pinned(ckpts):
    """local_window_size = W matches HF; W - 1 does not (so the checks above do see the window)."""
    ck = ckpts("gemma3")
    ids = _seq()
    ref = _steps(_reference(ck), ids)
    off = _steps(GqaDecoder(_graph(ck, 0, "_w-1", window_offset=-1), threads=1), ids)
    assert snr_db(ref[:WINDOW - 1], off[:WINDOW - 1]) > 90.0  # until a W-1 window binds, nothing differs
    assert snr_db(ref[WINDOW:], off[WINDOW:]) < 60.0


@pytest.mark.parametrize("slack", [None, 0, 1])
def test_window_cache_equals_full_buffer(ckpts, slack):
    """Sliding layers in a window-sized buffer (GQA sliding_window_cache, compaction every slack + 1 steps)
    give what a max_len buffer gives: stepping, and prefills longer than the buffer."""
    ck = ckpts("gemma3")
    ids = _seq(44, seed=6)
    ref = _steps(_reference(ck), ids)
    dec = GqaDecoder(_graph(ck, 0, f"_slack{slack}", window_cache_slack=slack), threads=1)
    io = json.loads((dec.dir / "io.json").read_text())
    rows = [layer["cache_len"] for layer in io["layers"]]
    assert rows == ([MAX_LEN] * 4 if slack is None else [WINDOW + slack] * 3 + [MAX_LEN])
    got = _steps(dec, ids)
    assert snr_db(ref, got) > 90.0 and (ref.argmax(-1) == got.argmax(-1)).all()
    dec.reset()
    dec.prefill(ids[:30])  # longer than a window buffer
    tail = np.stack([dec.step(t) for t in ids[30:]])
    assert snr_db(ref[30:], tail) > 90.0


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "llama"])
def test_fp16_kv_cache_halves_the_kv_and_keeps_the_logits(ckpts, name):
    """An fp16 KV cache (llama.cpp's default f16 cache; the default is fp32, faster here): past/present are
    float16 in the graph and io.json, the decoder's KV bytes are half the fp32 cache's, and the logits stay
    within fp16's rounding of the fp32-cache graph's (stepping, the window buffers' compaction, a prefill)."""
    ck = ckpts(name)
    ids = _seq(44, seed=8)
    default = ck["root"] / "gqa_default_kv"
    assert build_gqa_graph(ck["hf"], ck["quant"], default, max_len=MAX_LEN, accuracy_level=0)["kv_dtype"] == "float32"
    exact = GqaDecoder(default, threads=1)
    out = ck["root"] / "gqa_kv16"
    facts = build_gqa_graph(ck["hf"], ck["quant"], out, max_len=MAX_LEN, accuracy_level=0, kv_dtype="float16")
    assert facts["options"]["kv_dtype"] == "float16" and facts["kv_dtype"] == "float16"
    io = json.loads((out / "io.json").read_text())
    kv_io = [v for v in io["inputs"] + io["outputs"] if v["name"].startswith(("past_", "present_"))]
    assert kv_io and {v["dtype"] for v in kv_io} == {"float16"}
    half = GqaDecoder(out, threads=1)
    assert half.kv_bytes() * 2 == exact.kv_bytes() and facts["kv_bytes"] == half.kv_bytes()
    ref, got = _steps(exact, ids), _steps(half, ids)
    assert snr_db(ref, got) > 50.0, snr_db(ref, got)
    srt = np.sort(ref, -1)
    flips = ref.argmax(-1) != got.argmax(-1)
    assert not (flips & (srt[:, -1] - srt[:, -2] > 2 * np.abs(ref - got).max(-1))).any()
    half.reset()
    assert snr_db(ref[-1], half.prefill(ids)) > 50.0


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "llama"])  # llama: q|k|v packed into the attention
def test_a_kv_dtype_copy_computes_what_the_builder_builds(ckpts, name, tmp_path):
    """The deploy profile measures the other KV dtype on a copy of the built graph (tune.with_kv_dtype): the
    fp16 graph retyped to fp32 computes the builder's own fp32-cache graph's logits, and the fp32 graph
    retyped to fp16 the builder's fp16 graph's (stepping past the window's compaction, and a prefill), to
    within fp16's rounding of the rope tables (an fp16 graph's, upcast, keep it: the copy is for measuring
    speed, a rebuild computes them in fp32); io.json says the new dtype, and the KV bytes follow it."""
    from pipeline.measure.tune import with_kv_dtype

    ck = ckpts(name)
    ids = _seq(44, seed=8)
    built = {"float32": _graph(ck, 0), "float16": _graph(ck, 0, "_kv16", kv_dtype="float16")}
    for src, dst in (("float16", "float32"), ("float32", "float16")):
        copy = tmp_path / f"{src}-to-{dst}"
        with_kv_dtype(built[src], dst, copy)
        io = json.loads((copy / "io.json").read_text())
        kv_io = [v for v in io["inputs"] + io["outputs"] if v["name"].startswith(("past_", "present"))]
        assert io["kv_dtype"] == dst and kv_io and {v["dtype"] for v in kv_io} == {dst}
        want, got = GqaDecoder(built[dst], threads=1), GqaDecoder(copy, threads=1)
        assert got.kv_bytes() == want.kv_bytes()
        ref, out = _steps(want, ids), _steps(got, ids)
        assert snr_db(ref, out) > 50.0, (src, dst, snr_db(ref, out))
        assert (ref.argmax(-1) == out.argmax(-1)).mean() > 0.95
        got.reset()
        want.reset()
        assert snr_db(want.prefill(ids), got.prefill(ids)) > 50.0


@pytest.mark.parametrize("tag,options", [
    ("_plain", dict(fuse_qkv=False, fuse_gate_up=False, qk_norm="split", skip_norm=False, last_layer_rows="all",
                    norm_op="SimplifiedLayerNormalization")),
    ("_branchwise", dict(qk_norm="branchwise")),
    ("_qk", dict(fuse_qkv="qk", qk_norm="split")),
])
def test_graph_variants_are_identical(ckpts, tag, options):
    """Concatenating q|k|v and gate|up along N is exact; the q/k norm layouts, the norm op and the
    last-row-only tail agree with the default graph."""
    ck = ckpts("qwen3")
    ids = _seq(20, seed=4)
    fused = _steps(GqaDecoder(_graph(ck, 0), threads=1), ids)
    other = _steps(GqaDecoder(_graph(ck, 0, tag, **options), threads=1), ids)
    assert snr_db(fused, other) > 110.0


@pytest.mark.parametrize("name", ["llama", "llama_bias"])
def test_a_fused_qkv_goes_into_the_attention_packed(ckpts, name):
    """Without q/k norms the fused q|k|v is GroupQueryAttention's packed `query` (key and value empty, as
    onnxruntime-genai's builder feeds it): no Split in front of any attention, and the logits are the
    Split graph's (stepping and a prefill), at both accuracy levels."""
    ck = ckpts(name)
    ids = _seq(30, seed=6)
    for acc in (0, 4):
        packed, split = _graph(ck, acc), _graph(ck, acc, "_split", packed_qkv=False)
        g = onnx.load(str(packed / "model.onnx"), load_external_data=False).graph
        gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
        made = {o: n.op_type for n in g.node for o in n.output}
        assert gqa and all(list(n.input[1:3]) == ["", ""] and made[n.input[0]] == "MatMulNBits" for n in gqa)
        assert not any(n.op_type == "Split" and "qkv" in n.name for n in g.node)
        g_split = onnx.load(str(split / "model.onnx"), load_external_data=False).graph
        assert sum(n.op_type == "Split" for n in g_split.node) == sum(n.op_type == "Split" for n in g.node) + len(gqa)
        a, b = GqaDecoder(packed, threads=1), GqaDecoder(split, threads=1)
        assert snr_db(_steps(b, ids), _steps(a, ids)) > 110.0
        a.reset()
        b.reset()
        assert snr_db(b.prefill(ids), a.prefill(ids)) > 110.0


@pytest.mark.parametrize("head_bits", [4, 8])
def test_tied_checkpoint_ships_one_table_for_embedding_and_head(ckpts, tmp_path, head_bits):
    """A tied checkpoint (embedding == head): by default the embedding is a GatherBlockQuantized over the
    head's own MatMulNBits weight (Gemma's sqrt(hidden) scale a Mul after it) = the reference model whose
    embedding is the dequantized head, at 4 and 8 bits; the file holds that tensor once (no fp32 table);
    an untied checkpoint (no measured choice in quant.json) keeps its fp32 table, and `shared` is refused there."""
    import onnx

    ck = ckpts("gemma3", tied=True)
    quant = ck["quant"]
    if head_bits == 8:
        quant = _eight_bit_head(ck, tmp_path)
    ref_model = GptqReference(ck["gptq"]).model
    with torch.no_grad():
        if head_bits == 8:
            ref_model.lm_head.weight.copy_(torch.from_numpy(_dequant8(quant)))
        ref_model.model.embed_tokens.weight.copy_(ref_model.lm_head.weight)
    ids = _seq(30, seed=7)
    ref = _steps(TorchReference(ref_model), ids)
    out = tmp_path / f"shared{head_bits}"
    facts = build_gqa_graph(ck["hf"], quant, out, max_len=MAX_LEN, accuracy_level=0, **EXACT)
    assert facts["options"]["embedding"] == "shared"
    got = _steps(GqaDecoder(out, threads=1), ids)
    assert snr_db(ref, got) > 90.0
    g = onnx.load(str(out / "model.onnx"), load_external_data=False)
    names = {t.name for t in g.graph.initializer}
    assert "embed_tokens" not in names
    gather = next(n for n in g.graph.node if n.op_type == "GatherBlockQuantized")
    assert gather.input[0] == "lm_head.B"  # the head's own weight
    assert facts["weight_bytes"]["embedding"] == 0
    table = build_gqa_graph(ck["hf"], quant, tmp_path / "table", max_len=MAX_LEN, accuracy_level=0,
                            embedding="fp32", **EXACT)
    assert abs(table["bytes"] - VOCAB * 64 * 4 - facts["bytes"]) < 1024  # all but the fp32 table is the same
    untied = build_gqa_graph(ckpts("gemma3")["hf"], ckpts("gemma3")["quant"], tmp_path / "untied", max_len=MAX_LEN,
                             accuracy_level=0)
    assert untied["options"]["embedding"] == "fp32"
    with pytest.raises(GqaGraphError, match="tied"):
        build_gqa_graph(ckpts("gemma3")["hf"], ckpts("gemma3")["quant"], tmp_path / "no", max_len=MAX_LEN,
                        accuracy_level=0, embedding="shared")


def _with_embedding_choice(quant: Path, out: Path, chosen: str) -> Path:
    """A copy of the quant folder whose quant.json records the quantize stage's choice for the table."""
    import shutil

    shutil.copytree(quant, out)
    meta = json.loads((out / "quant.json").read_text())
    meta["embedding"] = {"chosen": chosen, "measured": True}
    (out / "quant.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_an_untied_table_ships_as_its_own_block_codes_where_the_quantize_stage_chose_them(ckpts, tmp_path, bits):
    """An untied checkpoint whose quant.json chose int8 / int4 for the table: under `auto` the embedding is
    a GatherBlockQuantized of gptq.embedding_codes (the rounding the stage measured) = the reference model
    holding those dequantized rows (Gemma's scale after the gather); the file is the fp32 table's bytes
    lighter, less the codes'; quant.json's "keep" (or no record) ships the fp32 table."""
    import onnx

    from pipeline.quant import gptq

    ck = ckpts("gemma3")
    quant = _with_embedding_choice(ck["quant"], tmp_path / f"q{bits}", f"int{bits}")
    out = tmp_path / f"block{bits}"
    facts = build_gqa_graph(ck["hf"], quant, out, max_len=MAX_LEN, accuracy_level=0, **EXACT)
    assert facts["options"]["embedding"] == f"int{bits}"
    ref_model = GptqReference(ck["gptq"]).model
    with torch.no_grad():
        emb = ref_model.model.embed_tokens.weight
        emb.copy_(gptq.embedding_codes(emb.detach().clone(), bits).dequantize())
    ids = _seq(30, seed=7)
    assert snr_db(_steps(TorchReference(ref_model), ids), _steps(GqaDecoder(out, threads=1), ids)) > 90.0
    g = onnx.load(str(out / "model.onnx"), load_external_data=False)
    gather = next(n for n in g.graph.node if n.op_type == "GatherBlockQuantized")
    assert gather.input[0] == "embed.B" and "embed_tokens" not in {t.name for t in g.graph.initializer}
    codes = VOCAB * 64 * bits // 8 + VOCAB * (64 // gptq.EMBED_BLOCK) * 4  # codes, fp32 scales
    assert facts["weight_bytes"]["embedding"] == codes
    kept = build_gqa_graph(ck["hf"], _with_embedding_choice(ck["quant"], tmp_path / f"k{bits}", "keep"),
                           tmp_path / f"kept{bits}", max_len=MAX_LEN, accuracy_level=0, **EXACT)
    assert kept["options"]["embedding"] == "fp32"
    assert abs(kept["bytes"] - facts["bytes"] - (VOCAB * 64 * 4 - codes)) < 1024


def _eight_bit_head(ck, tmp_path) -> Path:
    """ck's quant folder with lm_head re-quantized to 8 bits (symmetric, codes 0..255 around 128)."""
    from safetensors.numpy import load_file, save_file

    q = tmp_path / "quant8"
    q.mkdir()
    tensors = load_file(str(ck["quant"] / "quantized.safetensors"))
    meta = json.loads((ck["quant"] / "quant.json").read_text())
    w = GptqReference(ck["gptq"]).model.lm_head.weight.detach().numpy().astype(np.float32)
    n, k = w.shape
    wg = w.reshape(n, k // GROUP, GROUP)
    s = np.maximum(np.abs(wg).max(-1), 1e-8) / 127.0
    codes = (np.clip(np.round(wg / s[..., None]), -127, 127) + 128).astype(np.uint8).reshape(n, k)
    tensors.update({"lm_head.qweight": codes, "lm_head.scales": s.astype(np.float32),
                    "lm_head.zeros": np.full(s.shape, 128, np.uint8)})
    save_file(tensors, str(q / "quantized.safetensors"))
    meta["layers"]["lm_head"]["bits"] = 8
    meta["head_bits"] = 8
    (q / "quant.json").write_text(json.dumps(meta))
    return q


def _mixed_head(ck, tmp_path, rows8: np.ndarray) -> Path:
    """ck's quant folder with the head of two widths by row (pipeline/quant/head_rows.py): rows `rows8`
    (bool [V]) the 8-bit head's codes (`_eight_bit_head`), the rest ck's 4-bit ones; `lm_head.row_bits`."""
    from safetensors.numpy import load_file, save_file

    (tmp_path / "for_mixed").mkdir()
    q8 = _eight_bit_head(ck, tmp_path / "for_mixed")
    q = tmp_path / "mixed"
    q.mkdir()
    t8, t4 = load_file(str(q8 / "quantized.safetensors")), load_file(str(ck["quant"] / "quantized.safetensors"))
    for key in ("qweight", "scales", "zeros"):
        t4[f"lm_head.{key}"] = np.where(rows8[:, None], t8[f"lm_head.{key}"], t4[f"lm_head.{key}"])
    t4["lm_head.row_bits"] = np.where(rows8, 8, 4).astype(np.uint8)
    save_file(t4, str(q / "quantized.safetensors"))
    meta = json.loads((q8 / "quant.json").read_text())
    meta["layers"]["lm_head"]["row_bits"] = {"8": int(rows8.sum()), "4": int((~rows8).sum())}
    (q / "quant.json").write_text(json.dumps(meta))
    return q


@pytest.mark.parametrize("tied", [True, False])
def test_a_head_of_two_widths_by_row_computes_its_dequantized_model(ckpts, tmp_path, tied):
    """The head at 8 bits on some rows and 4 on the rest (quantize.head_rows8): a MatMulNBits over each
    set of rows, the logits put back in vocabulary order by a GatherElements = the reference model holding
    the dequantized mixed head (and, tied, the same rows as its embedding: a GatherBlockQuantized over each
    table picked by a Where), stepping and in a prefill, at accuracy level 0; the file holds each row once,
    at its width; a 4-bit-only packer refuses the layer."""
    import onnx

    from pipeline.quant.codes import PackError, read_quant

    ck = ckpts("gemma3", tied=tied)
    rows8 = np.random.default_rng(3).random(VOCAB) < 0.3
    quant = _mixed_head(ck, tmp_path, rows8)
    ref_model = GptqReference(ck["gptq"]).model
    with torch.no_grad():
        head = ref_model.lm_head.weight
        head[torch.from_numpy(rows8)] = torch.from_numpy(_dequant8(quant))[torch.from_numpy(rows8)]
        if tied:
            ref_model.model.embed_tokens.weight.copy_(head)
    ids = _seq(30, seed=7)
    out = tmp_path / "graph"
    facts = build_gqa_graph(ck["hf"], quant, out, max_len=MAX_LEN, accuracy_level=0, **EXACT)
    assert facts["options"]["embedding"] == ("shared" if tied else "fp32")
    dec = GqaDecoder(out, threads=1)
    ref = _steps(TorchReference(ref_model), ids)
    assert snr_db(ref, _steps(dec, ids)) > 90.0
    dec.reset()
    assert snr_db(ref[-1:], dec.prefill(ids)[None]) > 90.0
    g = onnx.load(str(out / "model.onnx"), load_external_data=False)
    heads = {n.name: n for n in g.graph.node if n.op_type == "MatMulNBits" and n.name.startswith("lm_head")}
    attrs = {name: {a.name: a.i for a in n.attribute} for name, n in heads.items()}
    assert attrs["lm_head.rows8"]["bits"] == 8 and attrs["lm_head.rows8"]["N"] == rows8.sum()
    assert attrs["lm_head.rows4"]["bits"] == 4 and attrs["lm_head.rows4"]["N"] == (~rows8).sum()
    assert any(n.op_type == "GatherElements" for n in g.graph.node)
    k = 64
    assert facts["matmulnbits"]["lm_head.rows8"]["bytes"] + facts["matmulnbits"]["lm_head.rows4"]["bytes"] == (
        rows8.sum() * k + (~rows8).sum() * k // 2 + VOCAB * (k // GROUP) * 4)
    if tied:
        gathers = [n for n in g.graph.node if n.op_type == "GatherBlockQuantized"]
        assert sorted(n.input[0] for n in gathers) == ["lm_head.rows4.B", "lm_head.rows8.B"]
        assert "embed_tokens" not in {t.name for t in g.graph.initializer}
    with pytest.raises(PackError, match="head_rows8=0"):
        read_quant(quant, bits=(4, 8))


def _dequant8(quant: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    t = load_file(str(quant / "quantized.safetensors"))
    q, s = t["lm_head.qweight"].astype(np.float32), t["lm_head.scales"]
    return ((q - 128.0).reshape(q.shape[0], -1, GROUP) * s[..., None]).reshape(q.shape)


def test_mapped_weights_are_paged_out_and_compute_the_same(ckpts):
    """GqaDecoder pages out the session's mapping of model.onnx.data after loading (pages.page_out_file):
    the logits are bit-identical with it on and off, and the mapping was there to page out."""
    ck = ckpts("gemma3", tied=True)
    out = _graph(ck, 4)
    ids = _seq(12, seed=9)
    on = GqaDecoder(out, threads=1)
    off = GqaDecoder(out, threads=1, page_out=False)
    assert (out / "model.onnx.data").is_file()
    assert on.paged_out_bytes > 0 and off.paged_out_bytes == 0
    assert np.array_equal(_steps(on, ids), _steps(off, ids))


def test_huge_pages_changes_nothing_but_pages(ckpts):
    ck = ckpts("qwen3")
    ids = _seq(12, seed=8)
    plain = _steps(GqaDecoder(_graph(ck, 4), threads=1), ids)
    dec = GqaDecoder(_graph(ck, 4), threads=1, huge_pages=True)
    assert dec.huge_page_bytes >= 0  # 0 where the kernel has no MADV_COLLAPSE or nothing is 2 MiB-sized
    assert np.array_equal(plain, _steps(dec, ids))


def test_greedy_matches_reference(ckpts):
    ck = ckpts("gemma3")
    prompt = [1, 17, 42, 99]
    n = MAX_LEN - len(prompt)
    assert GqaDecoder(_graph(ck, 0), threads=1).generate_greedy(prompt, n) == \
        _reference(ck).generate_greedy(prompt, n)


# --------------------------------------------------------------------------
# runtime contract
# --------------------------------------------------------------------------


def test_reset_and_context_full(ckpts):
    ck = ckpts("gemma3")
    dec = GqaDecoder(_graph(ck, 0), threads=1)
    ids = _seq(MAX_LEN, seed=5)
    first = _steps(dec, ids[:10])
    for t in ids[10:]:
        dec.step(t)
    assert dec.position == MAX_LEN
    with pytest.raises(ContextFull, match=f"max_len {MAX_LEN}"):
        dec.step(5)
    dec.reset()
    again = _steps(dec, ids[:10])
    assert np.array_equal(first, again)  # stale cache rows past the position are never read
    dec.reset()
    dec.prefill(ids[:40])
    with pytest.raises(ContextFull):
        dec.prefill(ids[:9])
    assert dec.position == 40  # a refused call changes nothing
    assert dec.prefill(ids[:8]).shape == (VOCAB,)
    with pytest.raises(ContextFull):
        dec.step(5)
    # the returned logits are the caller's: the next step does not overwrite them
    dec.reset()
    a = dec.step(3)
    keep = a.copy()
    dec.step(4)
    assert np.array_equal(a, keep)
    # K and V fp32 [1, 1, rows, 32]: 3 sliding layers with window buffers of W + 16 rows, one full of max_len
    assert dec.kv_bytes() == 4 * 2 * 32 * (3 * (WINDOW + 16) + MAX_LEN)


def test_graph_layout_and_io(ckpts):
    ck = ckpts("gemma3")
    out = _graph(ck, 4)
    io = json.loads((out / "io.json").read_text())
    facts = json.loads((out / "facts.json").read_text())
    g = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in g.node]
    n_layers = 4
    assert ops.count("GroupQueryAttention") == n_layers
    assert ops.count("MatMulNBits") == 4 * n_layers + 1  # qkv, o, gate|up, down per layer + lm_head
    assert "MatMul" not in ops and "Softmax" not in ops
    assert all(n.domain == "com.microsoft" for n in g.node if n.op_type in ("GroupQueryAttention", "MatMulNBits"))
    assert {a.name: a.i for n in g.node if n.op_type == "MatMulNBits" for a in n.attribute}["accuracy_level"] == 4
    gqa = [{a.name: (a.i if a.type == a.INT else a.f) for a in n.attribute} for n in g.node
           if n.op_type == "GroupQueryAttention"]
    assert [x["local_window_size"] for x in gqa] == [WINDOW] * 3 + [-1]
    assert all(x["do_rotary"] == 1 and x["num_heads"] == 2 and x["kv_num_heads"] == 1 for x in gqa)
    assert all(abs(x["scale"] - 24 ** -0.5) < 1e-7 for x in gqa)  # query_pre_attn_scalar
    # sliding and full layers read different rope caches (rope_theta 1e4 vs 1e6)
    cos_in = [n.input[7] for n in g.node if n.op_type == "GroupQueryAttention"]
    assert cos_in[:3] == ["cos_sliding_attention"] * 3 and cos_in[3] == "cos_full_attention"
    # onnxruntime-genai's inputs (the default io_layout): GQA's lengths computed from attention_mask
    assert [i.name for i in g.input][:3] == ["input_ids", "attention_mask", "past_key_values.0.key"]
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in g.input}
    assert shapes["input_ids"] == [1, "sequence_length"] and shapes["attention_mask"] == [1, "total_sequence_length"]
    assert shapes["past_key_values.3.value"] == [1, 1, "kv_cache_length", 32]  # genai sizes the rows
    assert shapes["past_key_values.0.key"] == [1, 1, "window_cache_length", 32]
    out_shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in g.output}
    assert [v.name for v in g.output][:2] == ["logits", "present.0.key"] and out_shapes["logits"] == [1, 1, VOCAB]
    assert [layer["cache_len"] for layer in io["layers"]] == [WINDOW + 16] * 3 + [MAX_LEN]
    assert io["family"] == "gemma3_text" and io["max_len"] == MAX_LEN and io["vocab_size"] == VOCAB
    assert [layer["local_window_size"] for layer in io["layers"]] == [WINDOW] * 3 + [-1]
    assert [layer["rope_theta"] for layer in io["layers"]] == [10000.0] * 3 + [1000000.0]
    assert facts["ops"]["GroupQueryAttention"] == n_layers and facts["bytes"] > 0
    # every quantized layer went in once, from the stage's own codes
    _, layers = read_quant(ck["quant"])
    used = [n for r in facts["matmulnbits"].values() for n in r["layers"]]
    assert sorted(used) == sorted(layers)


def test_the_two_io_layouts_compute_the_same(ckpts):
    """genai's layout (attention_mask in, the lengths computed in the graph) and the project's (seqlens_k /
    total_sequence_length fed) give bit-identical logits, stepping past the window buffers' compaction and
    in a prefill; the project's layout keeps its names and static rows."""
    ck = ckpts("gemma3")
    ids = _seq(44, seed=6)
    old_dir = _graph(ck, 4, "_edgekiln", io_layout="edgekiln")
    new, old = GqaDecoder(_graph(ck, 4), threads=1), GqaDecoder(old_dir, threads=1)
    assert new.io_layout == "genai" and old.io_layout == "edgekiln"
    assert np.array_equal(_steps(new, ids), _steps(old, ids))
    new.reset(), old.reset()
    assert np.array_equal(new.prefill(ids[:30]), old.prefill(ids[:30]))
    assert np.array_equal(new.step(5), old.step(5)) and new.kv_bytes() == old.kv_bytes()
    g = onnx.load(str(old_dir / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in g.input][:4] == ["input_ids", "seqlens_k", "total_sequence_length", "past_key_0"]
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in g.input}
    assert shapes["past_key_0"] == [1, 1, WINDOW + 16, 32] and shapes["past_key_3"] == [1, 1, MAX_LEN, 32]
    with pytest.raises(GqaGraphError, match="io_layout"):
        genai_config(json.loads((old_dir / "io.json").read_text()))


def test_genai_config_states_the_graph(ckpts):
    """genai_config.json: genai's `decoder` type, its default I/O names, the KV geometry, the window
    buffers (window + slack rows, the sliding layers listed: what io.json's cache_len says), the buffer
    shared by past and present, and the checkpoint's special tokens."""
    ck = ckpts("gemma3")
    out = _graph(ck, 4)
    cfg = json.loads(write_genai_config(out, threads=2).read_text())
    io = json.loads((out / "io.json").read_text())
    m, d = cfg["model"], cfg["model"]["decoder"]
    assert m["type"] == "decoder" and m["context_length"] == MAX_LEN and m["vocab_size"] == VOCAB
    assert (m["bos_token_id"], m["eos_token_id"], m["pad_token_id"]) == (1, 2, 0)
    assert d["filename"] == "model.onnx" and d["session_options"]["intra_op_num_threads"] == 2
    assert (d["num_hidden_layers"], d["num_key_value_heads"], d["head_size"]) == (4, 1, 32)
    assert d["inputs"]["past_key_names"] == "past_key_values.%d.key" and d["outputs"]["logits"] == "logits"
    sw = d["sliding_window"]
    assert sw["layers"] == [0, 1, 2] and sw["slide_key_value_cache"] is False
    assert [sw["window_size"] + sw["cache_slack"] if i in sw["layers"] else cfg["search"]["max_length"]
            for i in range(4)] == [layer["cache_len"] for layer in io["layers"]]
    assert cfg["search"]["past_present_share_buffer"] is True and cfg["search"]["do_sample"] is False
    # no window buffer (window_cache_slack=None): every layer at max_length, no sliding_window section
    whole = json.loads(write_genai_config(_graph(ck, 4, "_nowin", window_cache_slack=None)).read_text())
    assert "sliding_window" not in whole["model"]["decoder"]


@needs_genai
def test_onnxruntime_genai_runs_the_graph_as_gqa_decoder_does(ckpts):
    """onnxruntime-genai loads the folder (its own KV buffers, attention_mask, window buffers) and computes
    GqaDecoder's logits bit for bit, token by token past the window buffers' compaction; its own greedy
    loop after a prefill gives GqaDecoder's tokens."""
    import onnxruntime_genai as og

    ck = ckpts("gemma3")
    out = _graph(ck, 4)
    write_genai_config(out, threads=1)
    ids = _seq(44, seed=6)
    dec = GqaDecoder(out, threads=1)
    want = _steps(dec, ids)
    model = og.Model(str(out))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=MAX_LEN, do_sample=False)
    gen = og.Generator(model, params)
    got = []
    for t in ids:
        gen.append_tokens(np.asarray([t], np.int32))
        got.append(np.asarray(gen.get_logits(), np.float32).reshape(-1))
    assert np.array_equal(want, np.stack(got))
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(ids[:5], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    tokens = [int(t) for t in gen.get_sequence(0)][5:]
    assert tokens == dec.generate_greedy(ids[:5], len(tokens), prefilled=True)


@needs_genai
def test_the_benchmarks_genai_arm_runs_the_pack_folder_as_it_is(ckpts, tmp_path):
    """The benchmark's second artifact arm: the pack folder itself, opened as the `ort_int4_genai` runtime
    with its threads set by an overlay (nothing in the folder is written), prefills to GqaDecoder's logits
    bit for bit and holds the graph's own KV buffers."""
    from pipeline.runtimes.open import open_runtime
    from stages.benchmark import _artifact_in_genai

    out = _graph(ckpts("gemma3"), 4, "_benchmark_arm")  # a folder of its own: its io.json is changed below
    write_genai_config(out, threads=1)
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    folder, why = _artifact_in_genai(out)
    assert folder == out and "onnxruntime-genai" in why, why
    ids = _seq(20, seed=3)
    genai = open_runtime("ort_int4_genai", str(folder), threads=2)
    dec = GqaDecoder(out, threads=2)
    assert np.array_equal(genai.prefill(ids), dec.prefill(ids))
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before  # the folder as it was
    assert genai.kv_bytes() == dec.kv_bytes()
    io = json.loads((out / "io.json").read_text())
    (out / "io.json").write_text(json.dumps({**io, "io_layout": "edgekiln"}))
    none, why = _artifact_in_genai(out)
    assert none is None and "before the genai layout" in why


def test_refusals(ckpts, tmp_path):
    ck = ckpts("qwen3")
    from safetensors.numpy import load_file, save_file

    q = tmp_path / "no_head"
    q.mkdir()
    meta = json.loads((ck["quant"] / "quant.json").read_text())
    del meta["layers"]["lm_head"]
    (q / "quant.json").write_text(json.dumps(meta))
    t = {k: v for k, v in load_file(str(ck["quant"] / "quantized.safetensors")).items() if not k.startswith("lm_head")}
    save_file(t, str(q / "quantized.safetensors"))
    with pytest.raises(GqaGraphError, match="lm_head"):
        build_gqa_graph(ck["hf"], q, tmp_path / "x", max_len=16)
    with pytest.raises(GqaGraphError, match="unknown build options"):
        build_gqa_graph(ck["hf"], ck["quant"], tmp_path / "y", max_len=16, fuse_everything=True)


# --------------------------------------------------------------------------
# the embedded build's own artifacts, when present
# --------------------------------------------------------------------------

EMBEDDED = ROOT / "artifacts" / "x86_avx512-embedded-speed"


@pytest.mark.skipif(not (EMBEDDED / "quantize" / "quant.json").is_file(), reason="embedded build artifacts absent")
def test_embedded_build_matches_dequantized_model(tmp_path):
    from pipeline.sources.checkpoint_files import load_hf_model

    out = tmp_path / "gqa"
    # the fp32 table as the lookup: the default shares the head's 8-bit codes (one table), which the
    # dequantized model below does not (its embedding stays fp32): 58.9 dB, not a graph error
    build_gqa_graph(EMBEDDED / "untie_head", EMBEDDED / "quantize", out, max_len=160, accuracy_level=0,
                    embedding="fp32", **EXACT)
    model = load_hf_model(EMBEDDED / "untie_head")
    meta, layers = read_quant(EMBEDDED / "quantize", bits=(4, 8))  # the head is 8-bit by default on this path
    for n, (q, s, z, g) in layers.items():
        bits = int(meta["layers"][n].get("bits", 4))
        model.get_submodule(n).weight.data = torch.from_numpy(L.dequant(q, s, z, g, bits=bits))
    ids = np.random.default_rng(0).integers(4, 2048, 150).tolist()  # the window is 64
    ref = _steps(TorchReference(model), ids)
    dec = GqaDecoder(out, threads=2)
    got = _steps(dec, ids)
    assert snr_db(ref, got) > 100.0
    assert (ref.argmax(-1) == got.argmax(-1)).all()
    dec.reset()
    assert snr_db(ref[-1], dec.prefill(ids)) > 100.0


# --------------------------------------------------------------------------
# the streamed model file (pack's memory: gqa_graph._G / _write_model)
# --------------------------------------------------------------------------


def test_initializers_are_encoded_as_from_array_serializes_them(tmp_path):
    from onnx import TensorProto, numpy_helper

    from pipeline.graphs import gqa_graph

    rng = np.random.default_rng(0)
    arrays = {"f32": rng.standard_normal((5, 7)).astype(np.float32), "scalar": np.asarray(3.5, np.float32),
              "i64": np.asarray([0, -1, 2**40], np.int64), "u8": rng.integers(0, 255, (4, 3, 2), dtype=np.uint8),
              "f16": rng.standard_normal(9).astype(np.float16), "bool": np.asarray([True, False]),
              "empty": np.zeros((0, 4), np.float32), "strided": rng.standard_normal((6, 6)).astype(np.float32)[:, ::2]}
    g = gqa_graph._G(tmp_path / "spill")
    for name, a in arrays.items():
        g.init(name, a)
    big = rng.standard_normal((37, 5)).astype(np.float32)
    g.init_chunks("chunked", big.shape, np.float32, (big[r:r + 8] for r in range(0, 37, 8)))
    got = list(gqa_graph._records(g.finish()))
    want = [numpy_helper.from_array(np.array(a, order="C"), n).SerializeToString() for n, a in arrays.items()]
    want.append(numpy_helper.from_array(big, "chunked").SerializeToString())
    assert got == want
    assert np.array_equal(numpy_helper.to_array(TensorProto.FromString(got[-1])), big)
    assert g.init_bytes == sum(a.nbytes for a in arrays.values()) + big.nbytes
    g.discard()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,options", [("gemma3", {}), ("qwen3", {"fuse_qkv": False, "fuse_gate_up": False})])
def test_model_file_is_what_onnx_save_model_writes(ckpts, tmp_path, monkeypatch, name, options):
    """model.onnx is assembled from the node skeleton and the spilled initializers: byte for byte what
    serializing the whole ModelProto gives (onnx.save_model of it), and nothing else is left behind
    (written inline here: the artifact's data is external, next test)."""
    from pipeline.graphs import gqa_graph

    monkeypatch.setattr(gqa_graph, "_EXTERNAL_DATA_BYTES", 1 << 62)
    out = tmp_path / "inline"
    build_gqa_graph(ckpts(name)["hf"], ckpts(name)["quant"], out, max_len=MAX_LEN, accuracy_level=0, **options)
    path = out / "model.onnx"
    model = onnx.load(str(path))
    assert len(model.graph.initializer) > 10 and "embed_tokens" in {t.name for t in model.graph.initializer}
    assert path.read_bytes() == model.SerializeToString()
    onnx.checker.check_model(model)
    assert sorted(p.name for p in out.iterdir()) == ["io.json", "model.onnx"]


def test_external_data_is_what_onnx_save_model_writes(ckpts, tmp_path, monkeypatch):
    """The artifact's tensors go, one at a time, where onnx.save_model(..., save_as_external_data=True,
    size_threshold=1024) puts them: the same two files; the logits those of the inline graph."""
    from pipeline.graphs import gqa_graph

    ck = ckpts("gemma3")
    out = tmp_path / "ext"
    facts = build_gqa_graph(ck["hf"], ck["quant"], out, max_len=MAX_LEN, accuracy_level=0)
    assert facts["external_data"] and (out / "model.onnx.data").is_file()
    assert sorted(p.name for p in out.iterdir()) == ["io.json", "model.onnx", "model.onnx.data"]
    monkeypatch.setattr(gqa_graph, "_EXTERNAL_DATA_BYTES", 1 << 62)
    inline = tmp_path / "inline"
    build_gqa_graph(ck["hf"], ck["quant"], inline, max_len=MAX_LEN, accuracy_level=0)
    assert not (inline / "model.onnx.data").exists()
    ref = tmp_path / "ref"
    ref.mkdir()
    onnx.save_model(onnx.load(str(inline / "model.onnx")), str(ref / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    for f in ("model.onnx", "model.onnx.data"):
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f
    ids = _seq(12)
    assert np.array_equal(_steps(GqaDecoder(out, threads=1), ids), _steps(GqaDecoder(inline, threads=1), ids))


def test_benchmark_pass_splits_resident_memory_into_components(ckpts):
    """bench_arm's pass says where the resident MiB go: runtime + mapped weight pages + what the runtime
    allocated (prepacked copies, arena) + KV + other = resident after the run; the mapped part is at most
    the weight files."""
    from pipeline.measure import bench_arm

    out = _graph(ckpts("gemma3", tied=True), 4)
    r = bench_arm.measure("ort_int4", str(out), prompt_length=8, decode_tokens=4, warmup=1, threads=1, seed=0)
    m = r["memory"]
    parts = m["runtime_mib"] + m["weights_mapped_resident_mib"] + m["allocated_mib"] + m["kv_held_mib"] + m["other_mib"]
    assert parts == pytest.approx(m["after_run_mib"], abs=0.01)
    assert 0 <= m["weights_mapped_resident_mib"] <= m["weights_file_mib"] + 0.01
    assert m["kv_held_mib"] == pytest.approx(r["kv_mib"]) and m["kv_held_mib"] > 0


def test_a_long_prefill_hands_its_workspace_back(ckpts, monkeypatch):
    """GqaDecoder.prefill of _TRIM_AFTER_ROWS rows or more calls pages.release_heap (glibc's malloc_trim), so
    the prefill's freed workspace leaves the resident set; shorter prefills and steps do not pay for it."""
    from edgekiln_runtime import gqa, pages

    calls = []
    monkeypatch.setattr(gqa, "release_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(gqa, "_TRIM_AFTER_ROWS", 8)
    dec = GqaDecoder(_graph(ckpts("qwen3"), 0), threads=1)
    ids = _seq(20, seed=9)
    dec.prefill(ids[:7])
    dec.step(ids[7])
    assert calls == []
    dec.reset()
    dec.prefill(ids[:8])
    assert calls == [1]
    assert pages.release_heap() in (True, False)  # glibc here: True; elsewhere a no-op


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_checkpoint_builds_the_graph_its_fp32_copy_builds(ckpts, tmp_path, tied):
    """The pack reads the checkpoint in its own dtype, mapped (a bf16 1.75B model then costs no resident
    memory, against 8.2 GB loaded in fp32): the graph of a bf16 checkpoint is byte for byte the graph of
    the same weights written in fp32, with an fp32 embedding table and with the head's codes as the
    table. Gemma 3's embedding scale is what the fp32 model applies (sqrt(96) = 9.798, which the bf16
    model's buffer holds rounded to 9.8125)."""
    import shutil

    from transformers import AutoModelForCausalLM

    ck = ckpts("gemma3_96", tied=tied)
    bf16, fp32 = tmp_path / "bf16", tmp_path / "fp32"
    model = AutoModelForCausalLM.from_pretrained(ck["hf"], dtype=torch.bfloat16)
    assert float(model.model.embed_tokens.embed_scale) == 9.8125
    model.save_pretrained(bf16)
    AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).save_pretrained(fp32)
    quant = tmp_path / "quant"
    shutil.copytree(ck["quant"], quant)
    if tied:  # the head's codes of the bf16-rounded table, so that the two tensors stay equal
        from safetensors.numpy import load_file, save_file

        t = load_file(str(quant / "quantized.safetensors"))
        w = model.lm_head.weight.detach().float().numpy()
        t["lm_head.qweight"], t["lm_head.scales"], t["lm_head.zeros"] = _rtn(w, True)
        save_file(t, str(quant / "quantized.safetensors"))
    graphs = {}
    for tag, d in (("bf16", bf16), ("fp32", fp32)):
        out = tmp_path / f"gqa_{tag}"
        facts = build_gqa_graph(d, quant, out, max_len=MAX_LEN, accuracy_level=0)
        assert facts["options"]["embedding"] == ("shared" if tied else "fp32")
        graphs[tag] = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "io.json"}
    assert graphs["bf16"] == graphs["fp32"]


def test_the_op_profile_splits_decode_steps_from_the_prefill(ckpts):
    """benchmarks/op_profile.py: ONNX Runtime's profile of a prefill and N decode steps is split by model run;
    only the steps' node time is summed per op type, and it fits inside the steps' run time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("op_profile", Path(__file__).parents[1] / "benchmarks" / "op_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.profile_decode(_graph(ckpts("qwen3"), 0), prompt_len=12, steps=5, threads=1)
    ops = res["ms_per_step"]
    assert {"GroupQueryAttention", "MatMulNBits"} <= set(ops) and all(v > 0 for v in ops.values())
    assert sum(ops.values()) <= res["profiled_run_ms_per_step"] * 1.01
