"""GGUF Q4_0 from our GPTQ codes (pipeline/quant/gguf_q4.py) and the fp16-scale quantizer option.

Three layers of checks:

- no llama.cpp needed (gguf only): the Q4_0 block layout against gguf's own
  dequantizer, the refusals, and a round trip through a GGUF written here in
  the converter's place (tensor names from gguf's name table, Q/K rows
  permuted the way llama.cpp's Llama converter permutes them);
- llama.cpp's converter (where pipeline/toolchains/converter.py finds it:
  $EDGEKILN_LLAMACPP_SRC, `python -m pipeline.toolchains.converter fetch`'s copy, the
  installed llama-cpp-python): a tiny random
  Gemma 3 and a tiny random Llama, each with a SentencePiece tokenizer trained
  here, converted for real; every Q4_0 tensor must dequantize bit-exactly to
  our weights;
- llama-cpp-python: the file loads and its logits follow the fp32 model
  holding our dequantized weights (llama.cpp rounds activations to 8 bits in
  its Q4_0 dot products, so close, not equal).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.quant import gguf_q4, gptq

try:
    import gguf
except ImportError:  # the llamacpp extra; the quantizer's tests below run without it
    gguf = None

torch.set_num_threads(1)


def gguf_only(fn):
    """Needs the gguf package (the llamacpp extra): the `optional` marker, skipped with the reason when absent."""
    skip = pytest.mark.skipif(gguf is None, reason="the gguf package is not installed (pip install gguf==0.19.0: "
                                                   "the llamacpp extra)")
    return pytest.mark.optional(skip(fn))


VOCAB = 512
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


# --------------------------------------------------------------------------
# helpers: tiny checkpoints and quant results in the quantize stage's format
# --------------------------------------------------------------------------


def _tokenizer(folder: Path) -> Path:
    """A SentencePiece BPE (Gemma's special-token layout) trained on a few stdlib docstrings."""
    import argparse
    import collections
    import functools
    import itertools
    import pathlib
    import re
    import subprocess
    import textwrap

    from stages.model import _train_tokenizer

    docs = [m.__doc__ for m in (argparse, collections, functools, json, re, textwrap, pathlib, subprocess,
                                itertools, os) if m.__doc__]
    work = folder / "_spm"
    work.mkdir(parents=True, exist_ok=True)
    return _train_tokenizer(docs, VOCAB, work)


def _tiny(kind: str, folder: Path, spm: Path | None = None, seed: int = 0, tied: bool = False) -> Path:
    """A random untied HF checkpoint; every linear's K is a multiple of 32. `tied`: its head a copy of
    the embedding, as the untie_head stage writes a tied model."""
    import shutil

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                  tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if kind == "gemma3":
        # llama.cpp's Gemma 3 fixes what HF reads from the config: every 6th layer full attention
        # (2 layers: both sliding) and queries scaled by 1/sqrt(head_dim)
        cfg = Gemma3TextConfig(**common, sliding_window=16, layer_types=["sliding_attention"] * 2,
                               query_pre_attn_scalar=32)
        model = Gemma3ForCausalLM(cfg)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():  # the Gemma norms start at zero (weight + 1): give them a spread
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        if tied:
            model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    model.save_pretrained(folder)
    if spm is not None:
        shutil.copy(spm, folder / "tokenizer.model")
    return folder


def _layer_names(n_layers: int = 2) -> list[str]:
    return [f"model.layers.{i}.{m}" for i in range(n_layers) for m in LINEARS] + ["lm_head"]


def _quantize(hf_dir: Path, out: Path, *, group_size=32, sym=True, scale_dtype="fp16", method="gptq",
              head_bits=4) -> Path:
    """Every linear of `hf_dir` quantized with pipeline.quant.gptq, written as the quantize stage writes it
    (the head at `head_bits`)."""
    from safetensors.torch import load_file, save_file

    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    tensors, layers = {}, {}
    g = torch.Generator().manual_seed(1)
    for name in _layer_names():
        w = state[f"{name}.weight"].float()
        n, k = w.shape
        x = torch.randn(256, k, generator=g)
        h = (x.T @ x).double()
        bits = head_bits if name == "lm_head" else 4
        q = gptq.quantize_weight(w, h, method=method, group_size=group_size, sym=sym, scale_dtype=scale_dtype,
                                 name=name, bits=bits)
        tensors.update({f"{name}.qweight": q.qweight, f"{name}.scales": q.scales, f"{name}.zeros": q.zeros})
        layers[name] = {"in_features": k, "out_features": n, **({"bits": bits} if bits != 4 else {})}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / gptq.QUANT_TENSORS), metadata={"format": gptq.FORMAT})
    meta = {"format": gptq.FORMAT, "bits": 4, "group_size": group_size, "sym": sym, "method": method,
            "scale_search": True, "layers": layers, **({"head_bits": head_bits} if head_bits != 4 else {})}
    (out / gptq.QUANT_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _fake_conversion(hf_dir: Path, out: Path, *, permute_qk: bool = True, tamper: str | None = None) -> Path:
    """A GGUF laid out as llama.cpp's converter lays out a Llama checkpoint (f16 2-D, f32 1-D, gguf's
    tensor names), written here so the writer is tested without a llama.cpp tree. Q/K rows are
    permuted as the Llama converter does (per head, the two rotary halves interleaved)."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    cfg = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_key_value("general.empty_note", "", gguf.GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.tokens", ["<pad>", "<eos>", "a b"], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.0, -1.5, 2.25], gguf.GGUFValueType.ARRAY,
                    sub_type=gguf.GGUFValueType.FLOAT32)
    w.add_key_value("tokenizer.ggml.add_bos_token", True, gguf.GGUFValueType.BOOL)
    w.add_key_value("llama.rope.freq_base", 10000.0, gguf.GGUFValueType.FLOAT32)

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    for hf_name, t in state.items():
        t = t.float()
        if permute_qk and hf_name.endswith("q_proj.weight"):
            t = permute(t, cfg["num_attention_heads"])
        if permute_qk and hf_name.endswith("k_proj.weight"):
            t = permute(t, cfg["num_key_value_heads"])
        if tamper and hf_name == tamper:
            t = t.clone()
            t[1] *= 2  # not row 0: a table's row 0 can be the all-zero padding row
        arr = t.numpy().astype(np.float16 if t.dim() == 2 else np.float32)
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _check_round_trip(out_file: Path, quant_dir: Path, report: dict) -> int:
    """Every Q4_0 tensor of the file dequantizes (gguf's dequantizer) bit-exactly to our weights,
    permuted as the report says the converter permuted the rows; returns how many were checked."""
    from pipeline.quant.codes import read_quant

    _, layers = read_quant(quant_dir, bits=(4, 8))  # permuted: attention rows, 4-bit here
    by_name = {t.name: t for t in gguf.GGUFReader(str(out_file)).tensors}
    for gname in report["permuted"]:  # the file's rows really are reordered ...
        q, s, _, _ = layers[report["layers"][gname]]
        got = gguf.quants.dequantize(by_name[gname].data, by_name[gname].tensor_type)
        assert not np.array_equal(got, gguf_q4.dequant(q, s))
        assert sorted(map(bytes, got)) == sorted(map(bytes, gguf_q4.dequant(q, s)))
    assert set(report["row_order"]) == set(report["permuted"])
    return gguf_q4.verify_file(out_file, quant_dir, report)  # ... and put back, every tensor is exact


# --------------------------------------------------------------------------
# the quantizer's fp16 scales
# --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gptq", "rtn"])
@pytest.mark.parametrize("sym", [True, False])
def test_fp16_scales_are_fp16_values_and_cost_nothing(method, sym):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.05
    x = torch.randn(512, 128, generator=g)
    h = (x.T @ x).double()
    q32 = gptq.quantize_weight(w, h, method=method, group_size=32, sym=sym)
    q16 = gptq.quantize_weight(w, h, method=method, group_size=32, sym=sym, scale_dtype="fp16")
    assert torch.equal(q16.scales.half().float(), q16.scales)
    assert not torch.equal(q32.scales.half().float(), q32.scales)  # fp32 default: as computed, not rounded
    e32 = gptq.errors(w, q32.dequantize(), h)["out_rel_err_h"]
    e16 = gptq.errors(w, q16.dequantize(), h)["out_rel_err_h"]
    assert e16 < e32 * 1.05, (e16, e32)


def test_fp16_scales_tiny_and_huge_groups():
    w = torch.zeros(4, 64)
    w[1, :32] = 1e-9  # below fp16's smallest subnormal
    q = gptq.rtn_quantize(w, group_size=32, scale_dtype="fp16")
    assert torch.isfinite(q.dequantize()).all() and float(q.dequantize()[0].abs().max()) == 0.0
    assert float(q.scales.min()) == 2.0**-24
    with pytest.raises(gptq.QuantError, match=r"^big: .*fp16's maximum"):
        gptq.rtn_quantize(torch.full((2, 32), 1e6), group_size=32, scale_dtype="fp16", name="big")
    with pytest.raises(gptq.QuantError, match="scale_dtype 'bf16'"):
        gptq.quantize_weight(w, None, method="rtn", group_size=32, scale_dtype="bf16")


def test_stage_settings_scale_dtype():
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageError
    from stages import quantize

    cfg = OmegaConf.create({"quantize": {"scale_dtype": "fp16"}})
    assert quantize._settings(cfg)["scale_dtype"] == "fp16"
    assert quantize._settings(OmegaConf.create({"quantize": {}}))["scale_dtype"] == "fp32"
    with pytest.raises(StageError, match="quantize.scale_dtype='fp8'"):
        quantize._settings(OmegaConf.create({"quantize": {"scale_dtype": "fp8"}}))


# --------------------------------------------------------------------------
# the block layout and the refusals (gguf only)
# --------------------------------------------------------------------------


@gguf_only
def test_pack_q4_0_matches_gguf_dequantize_bit_exactly():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(48, 128), dtype=np.uint8)
    codes[0, :32] = np.arange(32) % 16  # weight j and j + 16 of one block differ
    scales = (rng.random((48, 4)) * 0.1 + 1e-4).astype(np.float16).astype(np.float32)
    scales[1, 0] = 2.0**-24  # a subnormal scale survives too
    scales[2, 1] = -0.5  # Q4_0's d may be negative
    blocks = gguf_q4.pack_q4_0(codes, scales)
    assert blocks.dtype == np.uint8 and blocks.shape == (48, 4 * 18)
    got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    assert got.shape == (48, 128) and np.array_equal(got, gguf_q4.dequant(codes, scales))
    assert np.array_equal(got, scales.repeat(32, axis=1) * (codes.astype(np.float32) - 8))
    # and gguf's own quantizer, fed weights it can hold exactly, lays out the same bytes
    # (d = max / -8: the block's signed absolute-max must be -8 d)
    codes[:, ::32] = 0
    pos = np.abs(scales)
    theirs = gguf.quants.quantize(gguf_q4.dequant(codes, pos), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(theirs, gguf_q4.pack_q4_0(codes, pos))


@gguf_only
def test_pack_q8_0_matches_gguf_dequantize_bit_exactly():
    """An 8-bit symmetric code (0..255 around 128) is Q8_0's int8 value + 128: the blocks dequantize, by
    gguf's own dequantizer, to exactly our weights; gguf's quantizer, fed weights it holds exactly, lays
    out the same bytes."""
    rng = np.random.default_rng(1)
    codes = rng.integers(1, 256, size=(16, 96), dtype=np.uint8)
    codes[0, :3] = (0, 128, 255)  # the grid's ends and its zero
    scales = (rng.random((16, 3)) * 0.01 + 1e-4).astype(np.float16).astype(np.float32)
    blocks = gguf_q4.pack_q8_0(codes, scales)
    assert blocks.dtype == np.uint8 and blocks.shape == (16, 3 * 34)
    got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got, gguf_q4.dequant(codes, scales, 8))
    assert np.array_equal(got, scales.repeat(32, axis=1) * (codes.astype(np.float32) - 128))
    codes[:, ::32] = 1  # d = amax / 127: each block's absolute max is code 1 (-127 d)
    theirs = gguf.quants.quantize(gguf_q4.dequant(codes, scales, 8), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(theirs, gguf_q4.pack_q8_0(codes, scales))


def _layers(g=32, zero=8, scale=0.25):
    rng = np.random.default_rng(0)
    n, k = 8, 128
    return {"model.layers.0.mlp.up_proj": (rng.integers(0, 16, (n, k), dtype=np.uint8),
                                           np.full((n, k // g), scale, np.float32),
                                           np.full((n, k // g), zero, np.uint8), g)}


@pytest.mark.parametrize("kw, match", [
    ({"g": 128}, r"group size 128: .*quantize\.group_size=32"),
    ({"zero": 7}, r"zero points other than 8 \(asymmetric\).*quantize\.sym=true"),
    ({"scale": 0.1}, r"32 of 32 scales are not fp16 values.*quantize\.scale_dtype=fp16"),
])
def test_refusals_are_one_line_value_errors(kw, match):
    with pytest.raises(gguf_q4.GgufQ4Error, match=match) as exc:
        gguf_q4.check_q4_0(_layers(**kw))
    assert isinstance(exc.value, ValueError) and "\n" not in str(exc.value)


def test_accepts_group_32_symmetric_fp16():
    gguf_q4.check_q4_0(_layers())
    with pytest.raises(gguf_q4.GgufQ4Error, match=r"asymmetric \(sym: false\)"):
        gguf_q4.check_q4_0(_layers(), {"sym": False})


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    hf = _tiny("llama", root / "hf")
    return hf, _quantize(hf, root / "quant")


@gguf_only
def test_round_trip_through_a_converter_shaped_gguf(tiny_llama, tmp_path):
    hf, quant = tiny_llama
    conv = _fake_conversion(hf, tmp_path / "conv.gguf")
    out = tmp_path / "q4.gguf"
    report = gguf_q4.build_q4_0(hf, quant, out, converted=conv)
    assert _check_round_trip(out, quant, report) == 15
    assert report["layers"]["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj"
    assert report["layers"]["output.weight"] == "lm_head"
    assert report["permuted"] == ["blk.0.attn_k.weight", "blk.0.attn_q.weight",
                                  "blk.1.attn_k.weight", "blk.1.attn_q.weight"]
    assert report["tensor_types"] == {"F16": 1, "F32": 5, "Q4_0": 15}
    # every KV field copied with its type and value, the file type now Q4_0
    src, dst = gguf.GGUFReader(str(conv)), gguf.GGUFReader(str(out))
    for name, f in src.fields.items():
        if name.startswith("GGUF."):
            continue
        g = dst.fields[name]
        assert g.types == f.types, name
        if name == "general.file_type":
            assert g.contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)
        else:
            assert g.contents() == f.contents(), name
    assert set(dst.fields) == set(src.fields)
    assert dst.fields["general.empty_note"].contents() == ""
    # the other tensors byte for byte
    dt = {t.name: t for t in dst.tensors}
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    for t in src.tensors:
        if t.name not in report["layers"]:
            assert dt[t.name].tensor_type == t.tensor_type and np.array_equal(dt[t.name].data, t.data)
    # the unquantized token embedding can be rounded like llama.cpp's Q4_0 file's
    out8 = tmp_path / "q4-emb8.gguf"
    r8 = gguf_q4.build_q4_0(hf, quant, out8, converted=conv, others="q8_0")
    assert r8["tensor_types"] == {"F32": 5, "Q4_0": 15, "Q8_0": 1}
    assert _check_round_trip(out8, quant, r8) == 15


@gguf_only
@pytest.mark.parametrize("head_bits", [4, 8])
def test_a_tied_checkpoint_ships_the_head_as_its_token_embedding(tmp_path, head_bits):
    """A tied checkpoint (the untied head a copy of the embedding): by default (others="auto") the file's
    token_embd is the head's own Q4_0 / Q8_0 tensor and output.weight is left out (llama.cpp then reads
    the head from token_embd, as for its own tied conversions), one table instead of an f16 one beside
    the head; every tensor of ours still reads back bit for bit. An untied checkpoint (no measured choice
    in quant.json) keeps its f16 table under "auto", and "shared" refuses it."""
    hf = _tiny("llama", tmp_path / "hf", tied=True)
    quant = _quantize(hf, tmp_path / "quant", head_bits=head_bits)
    conv = _fake_conversion(hf, tmp_path / "conv.gguf")
    out = tmp_path / "shared.gguf"
    report = gguf_q4.build_q4_0(hf, quant, out, converted=conv)
    head = gguf_q4.GGUF_TYPE[head_bits]
    assert report["layers"]["token_embd.weight"] == "lm_head" and "output.weight" not in report["layers"]
    assert report["token_embedding"].startswith(f"shared: the head's {head}")
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert "output.weight" not in names and names["token_embd.weight"] == head
    assert _check_round_trip(out, quant, report) == 15
    kept = gguf_q4.build_q4_0(hf, quant, tmp_path / "kept.gguf", converted=conv, others="keep")
    table = VOCAB * 64 * 2  # the f16 token embedding the shared file does not carry
    assert out.stat().st_size < kept["bytes"] - table + 1024
    # the model the file stands for: the head's dequantized weight as the embedding too
    model = gguf_q4.file_model(hf, out, report)
    assert torch.equal(model.get_input_embeddings().weight, model.lm_head.weight)
    untied_hf = _tiny("llama", tmp_path / "untied", seed=3)
    untied_q = _quantize(untied_hf, tmp_path / "untied_q", head_bits=head_bits)
    untied_conv = _fake_conversion(untied_hf, tmp_path / "untied.gguf")
    r = gguf_q4.build_q4_0(untied_hf, untied_q, tmp_path / "u.gguf", converted=untied_conv)
    assert r["token_embedding"] == "keep" and r["layers"]["output.weight"] == "lm_head"
    assert r["tensor_types"] == ({"F16": 1, "F32": 5, "Q4_0": 14, "Q8_0": 1} if head_bits == 8
                                 else {"F16": 1, "F32": 5, "Q4_0": 15})
    with pytest.raises(gguf_q4.GgufQ4Error, match="tied checkpoint"):
        gguf_q4.build_q4_0(untied_hf, untied_q, tmp_path / "s.gguf", converted=untied_conv, others="shared")


@gguf_only
@pytest.mark.parametrize("bits", [8, 4])
def test_an_untied_table_ships_as_the_quantize_stages_codes_where_it_chose_them(tmp_path, bits):
    """An untied checkpoint whose quant.json chose int8 / int4 for its table: under "auto" token_embd is
    Q8_0 / Q4_0 of gptq.embedding_codes (not gguf's own rounding), read back bit for bit by verify_file
    (which then needs the checkpoint), and the model the file stands for (file_model), like the
    reference of the weights (dequantized_model), holds those rows; the file is the f16 table's bytes
    lighter, less the blocks'."""
    from pipeline.quant import gptq

    hf = _tiny("llama", tmp_path / "hf", seed=3)
    quant = _quantize(hf, tmp_path / "quant")
    kept = gguf_q4.build_q4_0(hf, quant, tmp_path / "kept.gguf", converted=_fake_conversion(hf, tmp_path / "c.gguf"))
    meta = json.loads((quant / "quant.json").read_text())
    meta["embedding"] = {"chosen": f"int{bits}", "measured": True}
    (quant / "quant.json").write_text(json.dumps(meta))
    out = tmp_path / "codes.gguf"
    report = gguf_q4.build_q4_0(hf, quant, out, converted=_fake_conversion(hf, tmp_path / "conv.gguf"))
    kind = gguf_q4.GGUF_TYPE[bits]
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert names["token_embd.weight"] == kind and report["embedding_codes"] == {"tensor": "token_embd.weight",
                                                                                "bits": bits}
    assert report["token_embedding"].startswith(f"int{bits}: the quantize stage's measured choice")
    assert report["rounded"] == [] and "F16" not in report["tensor_types"]
    assert gguf_q4.verify_file(out, quant, report, hf) == 16
    with pytest.raises(gguf_q4.GgufQ4Error, match="needs the checkpoint"):
        gguf_q4.verify_file(out, quant, report)
    blocks = VOCAB * 64 // 32 * (gguf_q4.BLOCK_BYTES_8 if bits == 8 else gguf_q4.BLOCK_BYTES)
    assert abs(kept["bytes"] - report["bytes"] - (VOCAB * 64 * 2 - blocks)) < 1024
    table = gptq.embedding_codes(gguf_q4.hf_table(hf), bits).dequantize()
    for model in (gguf_q4.file_model(hf, out, report), gguf_q4.dequantized_model(hf, quant)):
        assert torch.equal(model.get_input_embeddings().weight, table)
    # a conversion whose table is not the checkpoint's: its codes cannot stand for it
    with pytest.raises(gguf_q4.GgufQ4Error, match="not the checkpoint's table"):
        gguf_q4.build_q4_0(hf, quant, tmp_path / "t.gguf",
                           converted=_fake_conversion(hf, tmp_path / "t0.gguf", tamper="model.embed_tokens.weight"))


@gguf_only
def test_refuses_a_conversion_that_changed_a_linear(tiny_llama, tmp_path):
    hf, quant = tiny_llama
    conv = _fake_conversion(hf, tmp_path / "conv.gguf", tamper="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(gguf_q4.GgufQ4Error, match=r"blk\.1\.ffn_up\.weight is not model\.layers\.1\.mlp\.up_proj's "
                                                   r"weight row for row"):
        gguf_q4.build_q4_0(hf, quant, tmp_path / "q4.gguf", converted=conv)
    assert not (tmp_path / "q4.gguf").exists()


@gguf_only
def test_refuses_quant_results_q4_0_cannot_hold(tiny_llama, tmp_path):
    hf, _ = tiny_llama
    conv = _fake_conversion(hf, tmp_path / "conv.gguf")
    cases = {
        "g64": ({"group_size": 64}, "group size 64"),
        "asym": ({"sym": False}, r"asymmetric \(sym: false\)"),
        "fp32": ({"scale_dtype": "fp32"}, r"not fp16 values.*quantize\.scale_dtype=fp16"),
    }
    for label, (kw, match) in cases.items():
        quant = _quantize(hf, tmp_path / label, method="rtn", **kw)
        with pytest.raises(gguf_q4.GgufQ4Error, match=match):
            gguf_q4.build_q4_0(hf, quant, tmp_path / f"{label}.gguf", converted=conv)
        assert not (tmp_path / f"{label}.gguf").exists()


# --------------------------------------------------------------------------
# llama.cpp's converter and runtime
# --------------------------------------------------------------------------


def _need_converter() -> str:
    """The llama.cpp tree where the stages look for the converter (pipeline/toolchains/converter.py), or skip saying how to get it."""
    from pipeline.toolchains import converter

    tree = converter.find()
    if tree is None:
        pytest.skip(converter.missing_message())
    return str(tree)


@pytest.fixture(scope="module")
def converted_pair(tmp_path_factory):
    """(hf, quant, our Q4_0 GGUF, report) for a tiny Gemma 3 and a tiny Llama, through the real converter."""
    src = _need_converter()
    root = tmp_path_factory.mktemp("conv")
    spm = _tokenizer(root)
    out = {}
    for kind in ("gemma3", "llama"):
        hf = _tiny(kind, root / kind / "hf", spm)
        quant = _quantize(hf, root / kind / "quant")
        gguf_file = root / kind / "q4_0.gguf"
        out[kind] = (hf, quant, gguf_file, gguf_q4.build_q4_0(hf, quant, gguf_file, src=src))
    return out


@gguf_only
@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_real_conversion_round_trip(converted_pair, kind):
    hf, quant, out, report = converted_pair[kind]
    assert _check_round_trip(out, quant, report) == 15
    assert report["file_type"] == "MOSTLY_Q4_0"
    if kind == "llama":  # the Llama converter reorders Q/K rows for llama.cpp's rotary layout
        assert report["permuted"] == ["blk.0.attn_k.weight", "blk.0.attn_q.weight",
                                      "blk.1.attn_k.weight", "blk.1.attn_q.weight"]
    else:
        assert report["permuted"] == []
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_0)


@gguf_only
@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_llama_cpp_runs_it_close_to_our_dequantized_weights(converted_pair, kind):
    from pipeline.toolchains import llamacpp
    from pipeline.runtimes.llamacpp import LlamaCppDecoder
    from pipeline.runtimes.reference import TorchReference
    from pipeline.graphs.decode_graph import snr_db

    ok, reason = llamacpp.available()
    if not ok:
        pytest.skip(reason)
    hf, quant, out, _ = converted_pair[kind]
    ref = TorchReference(gguf_q4.dequantized_model(hf, quant))
    fp32 = TorchReference(hf)
    dec = LlamaCppDecoder(out, threads=1, n_ctx=64)
    ids = [2] + list(range(10, 250, 8))  # BOS + 30 tokens: past the Gemma model's 16-token window
    r, f, o = [], [], []
    for d, acc in ((ref, r), (fp32, f), (dec, o)):
        d.reset()
        acc.extend(d.step(t) for t in ids)
    r, f, o = np.stack(r), np.stack(f), np.stack(o)
    assert np.abs(o).max() > 0  # real logits (Llama.scores stays zero with logits_all=False in 0.3.36)
    snr_ours = snr_db(r, o)
    # llama.cpp departs from our fp32 dequantized model only by its 8-bit activations (Q8_0 in
    # the Q4_0 dot products) and the f16 token embedding; measured here: ~36 dB (Gemma 3) and
    # ~43 dB (Llama), top-1 0.90 and 1.0 (random tiny models: near ties)
    assert snr_ours > 30.0, snr_ours
    assert (r.argmax(-1) == o.argmax(-1)).mean() >= 0.8
    assert snr_ours > snr_db(f, o) + 3.0  # nearer our weights than the fp32 ones
    # batched prefill lands on the same last logits as the steps
    dec.reset()
    assert snr_db(o[-1], dec.prefill(ids)) > 40.0


@gguf_only
@pytest.mark.parametrize("kind", ["gemma3", "llama"])
def test_llama_cpp_runs_a_tied_checkpoint_from_the_head_alone(tmp_path, kind):
    """Through the real converter, a tied checkpoint with an 8-bit head: the file holds the head's Q8_0
    tensor as token_embd and no output.weight; llama.cpp loads it, gathers and computes its logits
    from that one tensor, close to the fp32 model holding our weights with the dequantized head as the
    embedding (its own departures: 8-bit activations)."""
    from pipeline.toolchains import llamacpp
    from pipeline.runtimes.llamacpp import LlamaCppDecoder
    from pipeline.runtimes.reference import TorchReference
    from pipeline.graphs.decode_graph import snr_db

    src = _need_converter()
    ok, reason = llamacpp.available()
    if not ok:
        pytest.skip(reason)
    hf = _tiny(kind, tmp_path / "hf", _tokenizer(tmp_path), tied=True)
    quant = _quantize(hf, tmp_path / "quant", head_bits=8)
    out = tmp_path / "shared.gguf"
    report = gguf_q4.build_q4_0(hf, quant, out, src=src)
    assert report["layers"]["token_embd.weight"] == "lm_head" and gguf_q4.verify_file(out, quant, report) == 15
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert names["token_embd.weight"] == "Q8_0" and "output.weight" not in names
    ref = TorchReference(gguf_q4.file_model(hf, out, report))
    dec = LlamaCppDecoder(out, threads=1, n_ctx=64)
    ids = [2] + list(range(10, 250, 8))
    r, o = [], []
    for d, acc in ((ref, r), (dec, o)):
        d.reset()
        acc.extend(d.step(t) for t in ids)
    r, o = np.stack(r), np.stack(o)
    assert snr_db(r, o) > 30.0, snr_db(r, o)
    assert (r.argmax(-1) == o.argmax(-1)).mean() >= 0.8
