"""GGUF as a source for each family transformers' GGUF loader reads (pipeline/sources/families.py
`gguf_source`): a tiny model of the family written as llama.cpp writes its arch (tests/gguf_fixture.py:
names, metadata, Llama's q/k permutation, Gemma's 1 + w norms, Phi-3's fused attn_qkv / ffn_up and LongRoPE
factor tensors), run through the model stage's gguf path, must give back the logits of the model its
tensors came from, with the family's settings in its config.json (Qwen2's biases, Gemma 2's softcaps and
attention scale, Phi-3's partial rotary and LongRoPE, a Mistral's window). Random weights: a check of the
conversion, not of fidelity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.engine.context import StageContext, StageError
from pipeline.sources import families, gguf_checkpoint
from stages import model as stage
from tests import gguf_fixture

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8  # a window that 26-token sequences pass


def _stage(tmp_path: Path, gguf_file: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    cfg = OmegaConf.create({"model": {"name": "g", "source": "gguf", "path": str(gguf_file), "package": None,
                                      "sha256": None, "trust_remote_code": False}})
    stage.run(StageContext(stage="model", build="t", cfg=cfg, inputs={}, out=out))
    return out


def _same_logits(out: Path, original):
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(3, original.config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = reloaded(input_ids=ids).logits, original(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    return reloaded


def _convert(tmp_path, family, window=None, config=None, **settings):
    model = gguf_fixture.family_model(family, config=config, **settings)
    path = tmp_path / f"tiny-{family}.gguf"
    gguf_fixture.write_family(path, model, window=window)
    out = _stage(tmp_path, path)
    return model, out, json.loads((out / "config.json").read_text())


def test_every_gguf_source_family_has_a_test_here():
    tested = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"}
    assert set(gguf_checkpoint.ARCHITECTURES) == tested


LLAMA2_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def test_llama_gives_back_its_logits(tmp_path):
    model, out, cfg = _convert(tmp_path, "llama", config=LLAMA2_ROPE)
    _same_logits(out, model)
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_llama3_rope_scaling_is_read_back_from_rope_freqs(tmp_path):
    """Llama 3.x's rope scaling lives in the file as rope_freqs divisors, which transformers' loader
    ignores (plain rotary: 60 dB off on this model's first 26 tokens); the conversion reads rope_scaling
    back from them. Head dim 64, as Llama 3.2 1B's: four rotary pairs between the bands."""
    model = gguf_fixture.family_model("llama", head_dim=64)  # make_hf_checkpoint's Llama: Llama 3.2's llama3
    path = tmp_path / "llama3.gguf"
    gguf_fixture.write_family(path, model)
    out = _stage(tmp_path, path)
    _same_logits(out, model)
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert {k: rope[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings")} == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}  # make_hf_checkpoint's own (min(8192, positions / 2))


def test_rope_freqs_that_do_not_read_back_are_refused_in_one_line(tmp_path):
    """Head dim 16 leaves one rotary pair between the bands: the divisors do not fix rope_scaling, so the
    file is refused, naming the tensor and model=hf, rather than built with plain rotary."""
    model = gguf_fixture.family_model("llama")
    path = tmp_path / "llama3.gguf"
    gguf_fixture.write_family(path, model)
    with pytest.raises(StageError) as e:
        _stage(tmp_path, path)
    msg = str(e.value)
    assert "\n" not in msg and "rope_freqs" in msg and "model=hf" in msg


def test_qwen2_keeps_its_biases(tmp_path):
    model, out, cfg = _convert(tmp_path, "qwen2")
    reloaded = _same_logits(out, model)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    q = reloaded.model.layers[1].self_attn.q_proj.bias
    assert q is not None and torch.equal(q, model.model.layers[1].self_attn.q_proj.bias)
    assert families.sliding_layers(reloaded.config)[1] == 0  # no window, as Qwen2.5 runs


def test_qwen3(tmp_path):
    model, out, cfg = _convert(tmp_path, "qwen3")
    _same_logits(out, model)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_gemma2_keeps_its_softcaps_and_attention_scale(tmp_path):
    # softcaps other than Gemma2Config's defaults (50, 30), so a value the conversion drops shows
    model, out, cfg = _convert(tmp_path, "gemma2", sliding_window=WINDOW,
                               config={"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0})
    _same_logits(out, model)
    assert cfg["architectures"] == ["Gemma2ForCausalLM"]
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (5.0, 3.0)
    assert cfg["query_pre_attn_scalar"] == 16 and cfg["sliding_window"] == WINDOW
    assert families.layer_types(model.config) == cfg["layer_types"]


def test_gemma3(tmp_path):
    model, out, cfg = _convert(tmp_path, "gemma3", sliding_window=WINDOW, full_every=6)
    _same_logits(out, model)
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]


def test_phi3_keeps_its_fused_projections_partial_rotary_and_longrope(tmp_path):
    model, out, cfg = _convert(tmp_path, "phi3", partial_rotary=0.75)
    _same_logits(out, model)
    assert cfg["architectures"] == ["Phi3ForCausalLM"]
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    assert rope["short_factor"] == pytest.approx(model.config.rope_parameters["short_factor"])  # float32 in the file
    assert rope["long_factor"] == pytest.approx(model.config.rope_parameters["long_factor"])
    assert rope["original_max_position_embeddings"] == 64
    assert rope["attention_factor"] == pytest.approx((1 + math.log(256 / 64) / math.log(64)) ** 0.5)  # the file's


def test_a_mistral_written_as_llama_keeps_its_window(tmp_path):
    from pipeline.sources import model_facts

    model, out, cfg = _convert(tmp_path, "mistral", window=WINDOW, sliding_window=WINDOW)
    _same_logits(out, model)
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == WINDOW
    facts = model_facts.of({"source": "gguf", "name": "m", "path": str(tmp_path / "tiny-mistral.gguf")})
    assert (facts.family, facts.sliding_window) == ("MistralForCausalLM", WINDOW)  # what compose time derives from
    # the parameter count from the file's tensor infos (no tensor read): the model's own
    assert facts.parameters == sum(p.numel() for p in model.parameters()), facts.parameters


@pytest.mark.parametrize("arch", ["smollm3", "granite"])
def test_families_the_loader_cannot_read_are_refused_in_one_line(tmp_path, arch):
    """transformers' GGUF loader has no reader for SmolLM3 or Granite (families: gguf_source=False): a file
    of either is refused at compose time and by the stage, naming model=hf."""
    import gguf

    from pipeline.sources import model_facts

    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(model_facts.FactsError) as facts:
        model_facts.of({"source": "gguf", "name": "g", "path": str(path)})
    with pytest.raises(StageError) as built:
        _stage(tmp_path, path)
    for e in (facts, built):
        msg = str(e.value)
        assert "\n" not in msg and "no reader" in msg and "model=hf" in msg, msg


def test_a_gguf_sources_default_context_is_bounded_by_its_header(tmp_path):
    """model=gguf: the context follows the header (context_length, LongRoPE's original context), its KV
    charged flat (the header does not say which layers slide)."""
    from pipeline.sources import model_facts

    model = gguf_fixture.family_model("phi3", partial_rotary=0.75)  # 256 positions, LongRoPE up to 64
    path = tmp_path / "phi3.gguf"
    gguf_fixture.write_family(path, model)
    facts = model_facts.of({"source": "gguf", "name": "p", "path": str(path)})
    assert (facts.max_positions, facts.rope_limit, facts.family) == (256, 64, "Phi3ForCausalLM")
    context, why = model_facts.default_context(facts, 24, "x86_avx512")
    assert context == 64 and why.startswith("context 64: LongRoPE's short factor ends at 64 positions")
    qwen = gguf_fixture.family_model("qwen2")
    gguf_fixture.write_family(tmp_path / "qwen2.gguf", qwen)
    facts = model_facts.of({"source": "gguf", "name": "q", "path": str(tmp_path / "qwen2.gguf")})
    # 4 layers x 2 x 2 KV heads x 16 x 2 bytes = 512 B a token: 128 KiB at 256, 160 KiB with headroom
    assert model_facts.default_context(facts, 24, "x86_avx512") == (
        256, "context 256: Qwen2ForCausalLM's 256 positions, within 160 KiB of KV on x86_avx512's 24 GiB")


@pytest.mark.parametrize("head_dim,factor", [(64, 32.0), (128, 8.0)])  # Llama 3.2 1B / 3B's; Llama 3.1 8B's
def test_a_llama3_releases_rope_freqs_read_back_as_its_rope_scaling(tmp_path, head_dim, factor):
    """The releases' divisors (theta 500000, low 1, high 4, from 8192 positions), as llama.cpp's converter
    writes them, read back as the releases' own rope_scaling."""
    import types

    import gguf
    import numpy as np

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / head_dim)
        if wavelen < 8192 / 4:
            divisors.append(1.0)
        elif wavelen > 8192:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / 3
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    path = tmp_path / "freqs.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("rope_freqs.weight", np.asarray(divisors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   head_dim=head_dim, hidden_size=2048, num_attention_heads=32)
    assert gguf_checkpoint._llama3_rope(config, path) == pytest.approx(rope)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_llama_arch_file_named_mistral_is_read(tmp_path, window):
    """transformers' loader reads a llama-arch file whose general.name is exactly "mistral" as a
    MistralConfig and then cannot map its tensors; the conversion loads it as the llama arch it is:
    a Llama without a window, a Mistral with one."""
    family, settings = ("mistral", {"sliding_window": WINDOW}) if window else ("llama", {"config": LLAMA2_ROPE})
    model = gguf_fixture.family_model(family, **settings)
    path = tmp_path / "m.gguf"
    gguf_fixture.write_family(path, model, name="mistral", window=window)
    out = _stage(tmp_path, path)
    _same_logits(out, model)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == (["MistralForCausalLM"] if window else ["LlamaForCausalLM"])
    assert cfg.get("sliding_window") == window
