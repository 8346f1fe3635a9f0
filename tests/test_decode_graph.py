"""The decode-step graph against Hugging Face, and its ONNX export against eager.

Tiny random-init models built from config (no downloads). Window 8 everywhere,
so every sequence here runs well past the sliding window.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from pipeline.graphs import decode_graph  # noqa: E402
from pipeline.graphs.decode_graph import (DecodeGraphError, build_decode_step, build_prompt_step,  # noqa: E402
                                          export_decode_step, snr_db)
from pipeline.runtimes.contract import ContextFull  # noqa: E402
from pipeline.runtimes.onnx import OnnxDecoder  # noqa: E402
from pipeline.runtimes.reference import TorchReference  # noqa: E402
from tests.tiny_models import run_step as _run_step  # noqa: E402

WINDOW = 8
VOCAB = 128


def _gemma3(**kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=256,
        query_pre_attn_scalar=32, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw,
    )
    return Gemma3ForCausalLM(cfg)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_parameters=rope, bos_token_id=1, eos_token_id=2, **kw,
    )
    return LlamaForCausalLM(cfg)


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, **kw,
    )
    return Qwen3ForCausalLM(cfg)


def _qwen3_sliding():
    # Qwen3 with its own sliding layers (layers >= max_window_layers), as HF defines them.
    return _qwen3(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _gemma3_softcap():
    # final softcap is applied by HF Gemma3; its attn softcap is stored but unused
    # by the HF forward, which the step module follows.
    return _gemma3(final_logit_softcapping=3.0, attn_logit_softcapping=0.5)


BUILDERS = {"gemma3": _gemma3, "gemma3_softcap": _gemma3_softcap, "llama": _llama, "qwen3": _qwen3, "qwen3_sliding": _qwen3_sliding}


def _model(name, seed=0):
    torch.manual_seed(seed)
    model = BUILDERS[name]().eval()
    # Random init leaves norms at their identity; perturb them so q/k norms and
    # the Gemma sandwich norms are exercised by real weights.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# (a) ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "gemma3_softcap", "llama", "qwen3", "qwen3_sliding"])
def test_step_module_matches_hf_forward(name):
    model = _model(name)
    n = 3 * WINDOW + 2
    ids = torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf = model(ids).logits[0].numpy()
    step = build_decode_step(model, context_length=32, mask_value=-100.0)
    got, _ = _run_step(step, ids[0].tolist())
    snr = snr_db(hf, got)
    worst = min(snr_db(hf[p], got[p]) for p in range(n))
    assert np.abs(hf - got).max() < 1e-4, np.abs(hf - got).max()
    assert snr > 100.0 and worst > 95.0, (snr, worst)
    assert (hf.argmax(-1) == got.argmax(-1)).all()
    # The HF model's own cache decode (the parity reference) agrees as well.
    ref = TorchReference(model)
    eager = np.stack([ref.step(t) for t in ids[0].tolist()])
    assert snr_db(hf, eager) > 100.0


def test_window_binds_in_these_sequences():
    """Guard for (a)/(b): with the window lifted, logits past W do change."""
    model = _model("gemma3")
    ids = torch.randint(3, VOCAB, (1, 3 * WINDOW), generator=torch.Generator().manual_seed(2))
    wide = _gemma3()
    wide.config.sliding_window = 10_000
    for layer in wide.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = 10_000
    wide.load_state_dict(model.state_dict())
    wide.eval()
    with torch.no_grad():
        a = model(ids).logits[0].numpy()
        b = wide(ids).logits[0].numpy()
    assert snr_db(a[:WINDOW], b[:WINDOW]) > 100.0  # inside the window: identical
    assert snr_db(a[WINDOW:], b[WINDOW:]) < 40.0  # past it: the window matters


def test_position_dependent_rope_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(DecodeGraphError, match="dynamic"):
        build_decode_step(LlamaForCausalLM(cfg), 16, -100.0)


# (b) ---------------------------------------------------------------------


def test_ring_layout_equals_full_history():
    model = _model("gemma3")
    ids = torch.randint(3, VOCAB, (3 * WINDOW + 3,), generator=torch.Generator().manual_seed(3)).tolist()
    ring = build_decode_step(model, 40, -100.0)
    plain = build_decode_step(model, 40, -100.0, sliding_layout="full")
    assert [p["cache_len"] for p in ring.plan] == [WINDOW - 1] * 3 + [40]
    assert [p["cache_len"] for p in plain.plan] == [40] * 4
    lr, nr = _run_step(ring, ids)
    lp, np_ = _run_step(plain, ids)
    assert snr_db(lp, lr) > 120.0, snr_db(lp, lr)
    assert np.abs(lp - lr).max() < 1e-5
    for a, b in zip(nr, np_):  # new K/V entries of every layer, every step
        for x, y in zip(a, b):
            assert np.abs(x - y).max() < 1e-5


# (c)-(e): exported artifacts ----------------------------------------------

CONTEXT = {"gemma3": 24, "llama": 24, "qwen3": 24}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    arts = {}
    for name, ctx in CONTEXT.items():
        root = tmp_path_factory.mktemp(name)
        model = _model(name)
        model.save_pretrained(root / "hf")
        summary = export_decode_step(root / "hf", root / "onnx", context_length=ctx, opset=21, mask_value=-100.0)
        arts[name] = (root, summary)
    return arts


@pytest.mark.parametrize("name", ["gemma3", "llama", "qwen3"])
def test_onnx_matches_torch_reference(exported, name):
    root, _ = exported[name]
    ref = TorchReference(root / "hf")
    dec = OnnxDecoder(root / "onnx", threads=1)
    prompt = [1, 17, 42, 99]
    n = CONTEXT[name] - len(prompt)  # to the last position: well past the window
    greedy_ref = ref.generate_greedy(prompt, n)
    seq = prompt + greedy_ref[:-1]
    assert len(seq) > 2 * WINDOW
    ref.reset()
    dec.reset()
    a = np.stack([ref.step(t) for t in seq])
    b = np.stack([dec.step(t) for t in seq])
    assert snr_db(a, b) > 100.0, snr_db(a, b)
    assert min(snr_db(x, y) for x, y in zip(a, b)) > 95.0
    assert (a.argmax(-1) == b.argmax(-1)).all()
    top5a = np.argsort(-a, -1)[:, :5]
    top5b = np.argsort(-b, -1)[:, :5]
    assert all(set(x) == set(y) for x, y in zip(top5a, top5b))
    assert dec.generate_greedy(prompt, n) == greedy_ref


def test_onnx_decoder_refuses_past_context(exported):
    root, _ = exported["gemma3"]
    dec = OnnxDecoder(root / "onnx", threads=1)
    for t in range(CONTEXT["gemma3"]):
        dec.step(3 + t)
    with pytest.raises(ContextFull, match="context_length 24"):
        dec.step(5)
    dec.reset()
    assert dec.step(5).shape == (VOCAB,)


@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_graph_layout(exported, name):
    root, summary = exported[name]
    g = onnx.load(str(root / "onnx" / "model.onnx")).graph
    io = json.loads((root / "onnx" / "io.json").read_text())
    n_layers = io["n_layers"]
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in g.input}
    cache_inputs = [k for k in shapes if k.startswith("past_")]
    assert len(cache_inputs) == 2 * n_layers
    assert list(shapes)[:2] == ["input_ids", "position"]
    expect_types = ["sliding_attention"] * 3 + ["full_attention"] if name == "gemma3" else ["full_attention"] * n_layers
    assert [layer["type"] for layer in io["layers"]] == expect_types
    for layer in io["layers"]:
        i = layer["index"]
        want = WINDOW - 1 if layer["type"] == "sliding_attention" else CONTEXT[name]
        assert layer["cache_len"] == want
        assert layer["slot_rule"] == (f"position mod {WINDOW - 1}" if want == WINDOW - 1 else "position")
        assert shapes[f"past_key_{i}"] == [1, io["n_kv_heads"], want, io["head_dim"]]
        assert shapes[f"past_value_{i}"] == [1, io["n_kv_heads"], want, io["head_dim"]]
    ops = [n.op_type for n in g.node]
    assert "Expand" not in ops and "Tile" not in ops
    assert ops.count("Softmax") == n_layers
    outs = [v.name for v in g.output]
    assert outs[0] == "logits" and len(outs) == 1 + 2 * n_layers
    assert summary["ops"]["Softmax"] == n_layers
    assert io["vocab_size"] == VOCAB and io["bos_token_id"] == 1 and io["eos_token_id"] == [2]


# (f) the prompt graph ------------------------------------------------------
# T tokens a call beside the decode step (pipeline/graphs/decode_graph.py, "The prompt graph"): the
# same logits and the same KV cache as feeding the tokens one by one, across the ring's wrap, with a
# chunk shorter than the ring and one longer than it.

PROMPT_CONTEXT = 40


@pytest.fixture(scope="module")
def prompt_exported(tmp_path_factory):
    arts = {}
    for name, tokens in (("gemma3", 5), ("gemma3", 16), ("llama", 6), ("qwen3_sliding", 4)):
        root = tmp_path_factory.mktemp(f"{name}_p{tokens}")
        _model(name).save_pretrained(root / "hf")
        with pytest.MonkeyPatch.context() as mp:
            if name == "llama":  # its weights external, as a real model's are: the prompt graph reads them there
                mp.setattr(decode_graph, "_EXTERNAL_DATA_BYTES", 0)
            export_decode_step(root / "hf", root / "onnx", context_length=PROMPT_CONTEXT, prompt_tokens=tokens)
        arts[(name, tokens)] = root
    return arts


def test_the_prompt_graph_reads_its_weights_from_the_decode_steps_file(prompt_exported):
    """Where the weights are external (a real model's), the prompt graph's are the decode step's bytes,
    written once (tensorfile.share_external_data); its logits are checked with the others above."""
    out = prompt_exported[("llama", 6)] / "onnx"
    io = json.loads((out / "io.json").read_text())
    assert io["external_data"] and io["prompt"]["weights_from"] == "model.onnx.data"
    whole = (out / "model.onnx.data").stat().st_size
    own = (out / "prompt.onnx.data").stat().st_size if (out / "prompt.onnx.data").exists() else 0
    assert io["prompt"]["shared_bytes"] > 0.9 * whole and own < 0.1 * whole, (whole, own)


@pytest.mark.parametrize("name,tokens", [("gemma3", 5), ("gemma3", 16), ("llama", 6), ("qwen3_sliding", 4)])
def test_prompt_graph_matches_the_token_graph_and_the_reference(prompt_exported, name, tokens):
    root = prompt_exported[(name, tokens)]
    io = json.loads((root / "onnx" / "io.json").read_text())
    assert io["prompt"]["tokens"] == tokens and (root / "onnx" / "prompt.onnx").is_file()
    ids = torch.randint(3, VOCAB, (31,), generator=torch.Generator().manual_seed(7)).tolist()
    cut = 13  # two prefills: the second starts mid-ring (ring 7 has wrapped), its chunks padded
    tok = OnnxDecoder(root / "onnx", threads=1)
    stepped = [tok.step(t) for t in ids]
    ref = TorchReference(root / "hf")
    reference = [ref.step(t) for t in ids]

    dec = OnnxDecoder(root / "onnx", threads=1, prompt_file="prompt.onnx")
    assert dec.batched_prefill
    first = dec.prefill(ids[:cut])
    second = dec.prefill(ids[cut:])
    assert dec.calls == {"token": 0, "prompt": -(-cut // tokens) - (-(len(ids) - cut) // tokens)}
    for got, at in ((first, cut - 1), (second, len(ids) - 1)):
        assert snr_db(stepped[at], got) > 100.0, (at, snr_db(stepped[at], got))
        assert snr_db(reference[at], got) > 95.0
        assert int(np.argmax(got)) == int(np.argmax(reference[at]))
    # the caches the prompt graph wrote are the token graph's, slot for slot
    for (k1, v1, ring), (k2, v2, _) in zip(dec._caches, tok._caches):
        assert np.abs(k1 - k2).max() < 1e-5 and np.abs(v1 - v2).max() < 1e-5, ring
    # and decoding goes on from them as it would after a token-by-token prompt
    nxt = int(np.argmax(second))
    assert snr_db(tok.step(nxt), dec.step(nxt)) > 100.0


def test_prompt_graph_layout_and_refusals(prompt_exported):
    root = prompt_exported[("gemma3", 5)]
    io = json.loads((root / "onnx" / "io.json").read_text())
    spec = io["prompt"]
    assert spec["masks"] == {"mask_full": {"cache_len": PROMPT_CONTEXT, "ring": 0},
                             "mask_ring": {"cache_len": WINDOW - 1, "ring": WINDOW - 1}}
    shapes = {v["name"]: v["shape"] for v in spec["inputs"]}
    assert list(shapes)[:4] == ["input_ids", "position", "mask_full", "mask_ring"]
    assert shapes["input_ids"] == [1, 5] and shapes["position"] == [5]
    assert shapes["mask_ring"] == [5, WINDOW - 1 + 5] and shapes["mask_full"] == [5, PROMPT_CONTEXT + 5]
    outs = {v["name"]: v["shape"] for v in spec["outputs"]}
    assert outs["logits"] == [1, 1, VOCAB] and outs["new_key_0"] == [1, io["n_kv_heads"], 5, io["head_dim"]]
    ops = [n.op_type for n in onnx.load(str(root / "onnx" / "prompt.onnx")).graph.node]
    assert "Mod" not in ops and ops.count("Softmax") == io["n_layers"]
    dec = OnnxDecoder(root / "onnx", threads=1, prompt_file="prompt.onnx")
    with pytest.raises(ContextFull, match="context_length 40"):
        dec.prefill(list(range(3, 3 + PROMPT_CONTEXT + 1)))
    # the prompt graph alone (no token graph's session: the pack's check on a large model)
    alone = OnnxDecoder(root / "onnx", threads=1, model_file=None, prompt_file="prompt.onnx")
    ids = list(range(3, 15))
    dec.reset()
    assert snr_db(dec.prefill(ids), alone.prefill(ids)) > 120.0
    with pytest.raises(ValueError, match="prefill only"):
        alone.step(3)
    # the pack's calibration samples of it: one a chunk (its default progress callback takes the count)
    from pipeline.graphs import qnn

    samples = list(qnn.prompt_samples(alone, [ids, ids[:4]]))
    assert len(samples) == 3 + 1 and all(s["input_ids"].shape == (1, 5) for s in samples)
    with pytest.raises(DecodeGraphError, match="at least 2 tokens"):
        build_prompt_step(_model("gemma3"), 16, 1)


def test_prompt_masks_follow_the_window():
    """The masks' rule against HF's, position by position: a query at q sees keys at positions in
    (q - W, q] on a sliding layer, [0, q] on a full one."""
    from pipeline.runtimes.onnx import prompt_masks, ring_positions

    ring, ctx, T = WINDOW - 1, 30, 6
    specs = {"mask_full": {"cache_len": ctx, "ring": 0}, "mask_ring": {"cache_len": ring, "ring": ring}}
    for start in (0, 3, 7, 11, 20):
        for n in (1, 4, 6):
            m = prompt_masks(start, n, T, specs, -100.0)
            held = ring_positions(start, ring)
            pad = T - n
            for t in range(pad, T):
                q = start + t - pad
                keys_full = [j for j in range(ctx) if m["mask_full"][t, j] == 0] + \
                            [start + c - pad for c in range(T) if m["mask_full"][t, ctx + c] == 0]
                assert keys_full == list(range(q + 1)), (start, n, t)
                keys_ring = sorted([int(held[j]) for j in range(ring) if m["mask_ring"][t, j] == 0] +
                                   [start + c - pad for c in range(T) if m["mask_ring"][t, ring + c] == 0])
                assert keys_ring == list(range(max(0, q - WINDOW + 1), q + 1)), (start, n, t)
            for t in range(pad):  # a padding row sees itself only
                assert (m["mask_ring"][t] == 0).sum() == 1 and m["mask_ring"][t, ring + t] == 0


def test_prompt_graph_takes_the_phone_rewrites(prompt_exported, tmp_path):
    """The phone's rewrites on both graphs (pack): prepare, the embedding's lookup out, the residual stream
    carried divided by a factor (which needs the stream read by Adds and norms only: the prompt graph cuts
    its last row after the final norm); the rewritten pair prefills and steps as the export does."""
    from pipeline.graphs import npu_rewrite
    from pipeline.graphs.decode_graph import _values

    root = prompt_exported[("gemma3", 5)]
    io = json.loads((root / "onnx" / "io.json").read_text())
    out = tmp_path / "phone"
    out.mkdir()
    rewritten = {}
    for name in ("model.onnx", "prompt.onnx"):
        graph, report = npu_rewrite.prepare(onnx.load(str(root / "onnx" / name)), position="position",
                                            context_length=io["context_length"])
        assert report["rope_tables"] > 0 and report["rms_norms_fused"] > 0
        graph, cut = npu_rewrite.embedding_input(graph)
        scaled = npu_rewrite.scale_residual(graph, 8)
        assert scaled["factor"] == 8 and scaled["muls"]
        onnx.save(graph, str(out / name))
        rewritten[name] = _values(graph.graph.input)
    shapes = {i["name"]: i["shape"] for i in rewritten["prompt.onnx"]}
    assert shapes["inputs_embeds"] == [1, 5, cut["table"].shape[1]]
    phone_io = {**io, "inputs": rewritten["model.onnx"], "prompt": {**io["prompt"], "inputs": rewritten["prompt.onnx"]},
                "embedding": {"model": "unused", "input": "input_ids", "output": "inputs_embeds"}}
    (out / "io.json").write_text(json.dumps(phone_io))
    ids = torch.randint(3, VOCAB, (23,), generator=torch.Generator().manual_seed(9)).tolist()
    export = OnnxDecoder(root / "onnx", threads=1, prompt_file="prompt.onnx")
    phone = OnnxDecoder(out, threads=1, embed=cut["table"].__getitem__, prompt_file="prompt.onnx")
    assert snr_db(export.prefill(ids), phone.prefill(ids)) > 100.0
    assert snr_db(export.step(7), phone.step(7)) > 100.0


# Genie's form (decode_graph.build_genie_step), fed as Genie's engine feeds it (runtimes/genie_feed.py) ----


@pytest.fixture(scope="module")
def genie_exported(tmp_path_factory):
    from pipeline.graphs.decode_graph import export_genie_step

    arts = {}
    for name in ("llama", "qwen3", "gemma3", "qwen3_sliding"):
        root = tmp_path_factory.mktemp(f"genie-{name}")
        _model(name).save_pretrained(root / "hf")
        export_decode_step(root / "hf", root / "onnx", context_length=24)
        export_genie_step(root / "hf", root / "genie", context_length=24, prompt_tokens=5)
        arts[name] = root
    return arts


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "qwen3_sliding"])
def test_the_genie_form_fed_as_genie_feeds_it_decodes_as_the_token_graph(genie_exported, name):
    """Token by token to the last position of the context, then a prompt through the AR-5 graph right-padded
    (13 tokens: calls of 5, 5, 3), decoding on from the KV it wrote: the same logits as our graph's. Gemma 3
    and Qwen3's sliding layers (window 8) in Genie's sliding-window cache group, each window wrapped twice;
    Gemma 3's two rotary bases from Genie's absolute positions."""
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    root = genie_exported[name]
    ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    tok = OnnxDecoder(root / "onnx")
    want = np.stack([tok.step(t) for t in ids])
    dec = GenieFeedDecoder(root / "genie")
    got = np.stack([dec.step(t) for t in ids])
    assert snr_db(want, got) > 100.0 and (want.argmax(-1) == got.argmax(-1)).all()
    with pytest.raises(ContextFull):
        dec.step(5)
    pdec = GenieFeedDecoder(root / "genie", prompt_file="prompt.onnx")
    assert pdec.batched_prefill and pdec.prompt_tokens == 5
    first = pdec.prefill(ids[:13])
    assert pdec.calls == {"token": 0, "prompt": 3}
    assert snr_db(want[12], first) > 100.0
    after = np.stack([pdec.step(t) for t in ids[13:]])
    assert snr_db(want[13:], after) > 100.0


def test_the_sliding_groups_mask_is_cut_to_the_window_as_genie_cuts_it(genie_exported):
    """The prompt graph's later rows see past keys the window has left unless the sliding group's mask cuts
    them (Genie's window-size): fed without that cut, the chunk that starts past the window departs."""
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    root = genie_exported["gemma3"]
    ids = torch.randint(3, VOCAB, (15,), generator=torch.Generator().manual_seed(4)).tolist()
    tok = OnnxDecoder(root / "onnx")
    want = [tok.step(t) for t in ids][-1]
    cut = GenieFeedDecoder(root / "genie", model_file=None, prompt_file="prompt.onnx")
    assert cut._swa == {"prefix": "swa_", "mask": "swa_attention_mask", "layers": [0, 1, 2],
                        "buffer": WINDOW - 1, "window": WINDOW}
    assert snr_db(want, cut.prefill(ids)) > 100.0
    uncut = GenieFeedDecoder(root / "genie", model_file=None, prompt_file="prompt.onnx")
    uncut._swa = {**uncut._swa, "window": 10 ** 6}  # no cut: every slot the ring holds
    assert snr_db(want, uncut.prefill(ids)) < 60.0


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_the_genie_form_meets_the_io_rules_of_genies_engine(genie_exported, name):
    """The shapes Genie's validator checks (nsp-model.cpp: Dims from the last three axes), int32 ids, and
    pipeline/runtimes/genie.py's rules all met: no gap left in the graph's I/O. Gemma 3: its sliding layers'
    KV a group of its own (swa_, the ring's W - 1 entries in every graph) with its own mask, and int32
    positions for Genie's absolute encoding in place of one rotary table."""
    from pipeline.runtimes import genie

    io = json.loads((genie_exported[name] / "genie" / "io.json").read_text())
    assert io["form"] == "genie" and genie._io_gaps(io) == []
    CL, hd, nkv, V = io["context_length"], io["head_dim"], io["n_kv_heads"], io["vocab_size"]
    for spec, T in ((io, 1), (io["prompt"], 5)):
        shapes = {v["name"]: (v["shape"], v["dtype"]) for v in spec["inputs"] + spec["outputs"]}
        assert shapes["input_ids"] == ([1, T], "int32")
        assert shapes["attention_mask"][0] == [1, 1, T, CL]
        full = 3 if name == "gemma3" else 0  # a full-attention layer's index
        assert shapes[f"past_key_{full}_in"][0] == [1, nkv, hd, CL - T]
        assert shapes[f"past_value_{full}_in"][0] == [1, nkv, CL - T, hd]
        assert shapes[f"past_key_{full}_out"][0] == [1, nkv, hd, T] and shapes[f"past_value_{full}_out"][0] == [1, nkv, T, hd]
        assert np.prod(shapes["logits"][0]) == T * V  # every row: Genie reads the last real one
        if name == "llama":
            rot_half = len(io["rope"]["inv_freq"])
            assert shapes["position_ids_cos"][0] == shapes["position_ids_sin"][0] == [1, 1, T, rot_half]
            assert not any(n.startswith("swa_") for n in shapes) and "position_ids" not in shapes
        else:
            assert shapes["position_ids"] == ([1, 1, T], "int32") and "position_ids_cos" not in shapes
            assert io["positions"]["tables"] == ["full_attention", "sliding_attention"] and "rope" not in io
            assert shapes["swa_attention_mask"][0] == [1, 1, T, WINDOW - 1 + T]
            for i in (0, 1, 2):
                assert shapes[f"swa_key_{i}_in"][0] == [1, nkv, hd, WINDOW - 1]
                assert shapes[f"swa_value_{i}_in"][0] == [1, nkv, WINDOW - 1, hd]
                assert shapes[f"swa_key_{i}_out"][0] == [1, nkv, hd, T]
                assert f"past_key_{i}_in" not in shapes


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2))


def test_the_genie_form_is_refused_where_genies_engine_would_not_feed_it(tmp_path):
    """Every layer sliding (Mistral's window inside the context): Genie's default cache group would hold no
    KV. A prompt graph longer than the window (Genie never cuts a call's own keys to it): the token graph
    alone, the prompt graph's refusal recorded."""
    from pipeline.graphs.decode_graph import build_genie_step, export_genie_step

    with pytest.raises(DecodeGraphError, match="default cache group"):
        build_genie_step(_mistral(), context_length=32)
    _model("gemma3").save_pretrained(tmp_path / "hf")
    s = export_genie_step(tmp_path / "hf", tmp_path / "genie", context_length=24, prompt_tokens=WINDOW + 1)
    assert "prompt" not in s["io"] and "must not be longer" in s["io"]["prompt_refused"]
    assert not (tmp_path / "genie" / "prompt.onnx").exists()


def test_the_export_stage_keeps_its_graph_where_the_genie_form_is_refused_or_fails(tmp_path, monkeypatch):
    """export.genie on a model without the form (every layer of a Mistral sliding), and on one whose Genie export
    fails: our graph is exported, the Genie form recorded not built with why (genie.json, for the pack)."""
    from omegaconf import OmegaConf

    from pipeline.engine.context import StageContext
    from pipeline.graphs import decode_graph
    from stages import export

    def run(name: str) -> dict:
        src = tmp_path / name / "hf"
        (_mistral() if name == "mistral" else _model("llama")).save_pretrained(src)
        out = tmp_path / name / "export"
        out.mkdir()
        cfg = {"export": {"context_length": 24, "opset": 21, "mask_value": -100.0, "prompt_tokens": 0, "genie": True}}
        export.run(StageContext(stage="export", build="t", cfg=OmegaConf.create(cfg), inputs={"untie_head": src},
                                out=out))
        assert (out / "model.onnx").is_file()
        return json.loads((out / export.GENIE_FACTS).read_text())

    refused = run("mistral")
    assert refused["built"] is False and "every layer slides" in refused["why"]

    def broken(*a, **k):
        raise RuntimeError("the exporter tripped\nover this")

    monkeypatch.setattr(decode_graph, "export_genie_step", broken)
    failed = run("llama")
    assert failed == {"built": False, "why": "its export failed: RuntimeError: over this"}
