"""Every model family the tool builds (pipeline/sources/families.py), one tiny checkpoint each.

Each family's checkpoint comes from benchmarks/make_hf_checkpoint.py's `family_config` (the
releases' own settings: Qwen2's biases, Mistral's window on every layer, Phi-3's fused projections,
LongRoPE and partial rotary, Gemma 2's softcaps, SmolLM3's NoPE layers, Granite's multipliers,
Llama 3's rope scaling) with random weights, norms and biases perturbed so they matter. A window of
8 and 26-token sequences: every sliding layer's window binds. Random weights: a check of the graph
against transformers' own eager model of the same weights, not a fidelity claim.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from make_hf_checkpoint import FAMILIES, family_config  # noqa: E402

from pipeline.graphs.decode_graph import DecodeGraphError, build_decode_step, snr_db  # noqa: E402
from pipeline.runtimes.reference import TorchReference  # noqa: E402
from pipeline.sources import families, model_facts  # noqa: E402
from tests.tiny_models import perturb, run_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW, VOCAB, SEQ = 8, 128, 26


def tiny_config(family: str, layers: int = 4, **over):
    kw = {"sliding_window": WINDOW} if family in ("gemma2", "gemma3", "mistral", "qwen2") else {}
    geometry = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16}
    if family == "phi3":
        kw["partial_rotary"] = 0.75  # Phi-4-mini's: 48 of 64 dims (ONNX Runtime's GQA rotates multiples of 16)
        geometry = {"hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 64}  # Phi3Config: hidden = heads x head_dim
    if family == "gemma3":
        kw["full_every"] = 2
    kw.update(over)
    return family_config(family, vocab=VOCAB, intermediate=128, layers=layers, max_positions=256, bos=1, eos=2,
                         pad=0, **geometry, **kw)


def tiny_model(family: str, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return perturb(AutoModelForCausalLM.from_config(tiny_config(family, **over)).eval())


def _ids(seed=1):
    return torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------


def test_every_family_has_a_row_and_a_checkpoint_recipe():
    assert {families.of_config(tiny_config(f)).model_type for f in FAMILIES} == set(families.FAMILIES)
    for f in families.FAMILIES.values():
        assert families.of_architecture(f.architecture) is f


def test_an_unknown_family_is_refused_at_compose_time_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(model_facts.FactsError) as e:
        model_facts.of({"source": "hf", "path": str(tmp_path)})
    msg = str(e.value)
    assert "\n" not in msg and "GPT2LMHeadModel" in msg and "Qwen2ForCausalLM" in msg and "Phi3ForCausalLM" in msg


@pytest.mark.parametrize("family,expect", [
    ("mistral", ["sliding_attention"] * 4),  # no layer_types map: the window binds every layer
    ("gemma2", ["sliding_attention", "full_attention"] * 2),  # alternating
    ("qwen2", ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]),  # max_window_layers
    ("llama", ["full_attention"] * 4),
])
def test_which_layers_slide_follows_the_family(family, expect):
    assert families.layer_types(tiny_config(family)) == expect


def test_qwen2s_unused_window_is_no_window():
    # Qwen2.5's config.json carries sliding_window 32768 with use_sliding_window false
    cfg = tiny_config("qwen2", sliding_window=None)
    assert families.sliding_layers(cfg) == ([False] * 4, 0)


def test_smollm3_nope_layers_and_granite_multipliers_are_read():
    assert families.rotary_layers(tiny_config("smollm3")) == [True, True, True, False]
    assert families.multipliers(tiny_config("granite")) == {
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0}


# --------------------------------------------------------------------------
# the decode step (export's graph) against transformers' eager forward
# --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_step_matches_transformers(family):
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        hf = model(ids).logits[0].numpy()
    step = build_decode_step(model, context_length=32, mask_value=-100.0)
    got, _ = run_step(step, ids[0].tolist())
    assert snr_db(hf, got) > 100.0, snr_db(hf, got)
    assert (hf.argmax(-1) == got.argmax(-1)).all()
    # the parity reference (transformers' own cached decode, its head recomputed) agrees too
    ref = TorchReference(model)
    eager = np.stack([ref.step(t) for t in ids[0].tolist()])
    assert snr_db(hf, eager) > 100.0
    run = TorchReference(model).greedy_run(ids[0, :4].tolist(), 6)
    full = model(torch.tensor([run.prompt + run.continuation])).logits[0].detach().numpy()
    assert snr_db(full, run.logits(0, run.steps)) > 100.0


def test_longrope_past_its_original_positions_is_refused_in_one_line():
    model = tiny_model("phi3")  # original_max_position_embeddings 64
    with pytest.raises(DecodeGraphError, match="LongRoPE.*at most 64.*export.context_length <= 64"):
        build_decode_step(model, context_length=128)


# --------------------------------------------------------------------------
# x86_avx512: the GroupQueryAttention + MatMulNBits graph against the GPTQ reference of the same codes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gqa_graph_matches_the_gptq_reference(tmp_path, family):
    pytest.importorskip("onnxruntime")
    from pipeline.graphs.gqa_graph import build_gqa_graph
    from edgekiln_runtime.gqa import GqaDecoder
    from pipeline.runtimes.tinygemm import GptqReference
    from tests.test_gqa_graph import _checkpoint

    ck = _checkpoint(tmp_path, family, model=tiny_model(family))
    facts = build_gqa_graph(ck["hf"], ck["quant"], tmp_path / "gqa", max_len=48, accuracy_level=0,
                            kv_dtype="float32")
    assert facts["family"] == families.of_config(tiny_config(family)).model_type
    ids = _ids()[0].tolist()
    ref = TorchReference(GptqReference(ck["gptq"]).model)
    want = np.stack([ref.step(t) for t in ids])
    dec = GqaDecoder(tmp_path / "gqa")
    got = np.stack([dec.step(t) for t in ids])
    assert snr_db(want, got) > 90.0, snr_db(want, got)
    assert (want.argmax(-1) == got.argmax(-1)).all()
    # prefill (the same graph, S = prompt length) agrees with stepping
    dec.reset()
    assert snr_db(want[len(ids) - 1], dec.prefill(ids)) > 90.0


@pytest.mark.parametrize("family", FAMILIES)
def test_calibration_runs_each_family_one_layer_at_a_time_exactly(family):
    # calibrate and quantize run the decoder layer by layer (pipeline/quant/layerwise.py); Granite's
    # embedding_multiplier sits between the embedding and the loop
    from pipeline.quant import layerwise

    model = tiny_model(family)
    layerwise.check(model.model, _ids())
