"""Phone NPU builds: QNN HTP context binaries compiled offline and run on the
HTP backend of this host (onnxruntime-qnn's x86 emulation: the HTP's numerics).

The compile and HTP tests need onnxruntime-qnn (in the `test` extra); they are
skipped, saying so, where it is absent. The end-to-end phone build runs through
DVC on the tiny model, as a user would.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.graphs import qnn
from pipeline.engine.context import StageContext, StageError
from tests.conftest import PHONE_ARGS, matmul_weight_codes, ran_stages, run_cli

needs_qnn = pytest.mark.skipif(qnn.missing() is not None, reason=f"QNN toolchain absent: {qnn.missing()}")
S25 = {"soc_model": "SM8750", "htp_arch": "v79", "soc_id": 69}


def _graph(tmp_path, op: str):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])
    nodes = {"ok": [helper.make_node("Relu", ["x"], ["y"])],
             # A CPU-only op in the middle: QNN cannot take it.
             "cpu_only": [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Erf", ["r"], ["e"]),
                          helper.make_node("Mod", ["e", "e"], ["y"], fmod=1)]}[op]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 21)])
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, str(path))
    return path


@needs_qnn
def test_a_graph_compiles_to_a_context_binary_that_runs_on_the_htp(tmp_path):
    facts = qnn.compile_context(_graph(tmp_path, "ok"), tmp_path / "ctx", S25, "fp16")
    assert facts["binaries"] and facts["bytes"] > 0
    session = qnn.htp_session(tmp_path / "ctx" / qnn.CONTEXT_MODEL, S25, "fp16")
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(1, 8)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], np.maximum(x, 0), atol=1e-3)


@needs_qnn
def test_a_graph_within_the_budget_compiles_whole_and_one_over_it_without_layers_is_refused(tmp_path):
    """compile_parts: a graph whose weights fit 90% of the target's max_graph_bytes is one binary, as
    compile_context makes it (one part, the folder itself); one over it that has no layers to cut between
    is refused in one line naming the budget and the device setting."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(64, dtype=np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 21)])
    path = tmp_path / "mm.onnx"
    onnx.save(model, str(path))
    facts = qnn.compile_parts(path, path, tmp_path / "whole", {**S25, "max_graph_bytes": 1 << 20}, "fp16")
    assert [p["dir"] for p in facts["parts"]] == ["."] and facts["weight_bytes"] == 64 * 64 * 2  # fp16 on the HTP
    assert (tmp_path / "whole" / qnn.CONTEXT_MODEL).is_file() and facts["budget_bytes"] == int(0.9 * (1 << 20))
    session = qnn.open_htp(tmp_path, {"compiled": {"fp16": {"dir": "whole", **facts}}, "target": S25}, "fp16")
    v = np.linspace(-2, 2, 64, dtype=np.float32).reshape(1, 64)
    np.testing.assert_allclose(session.run(None, {"x": v})[0], v, atol=1e-2)
    with pytest.raises(qnn.QnnError, match=r"over the HTP's per-graph budget .*max_graph_bytes.* cannot be cut into parts: .*no layer boundaries"):
        qnn.compile_parts(path, path, tmp_path / "over", {**S25, "max_graph_bytes": 4096}, "fp16")


@needs_qnn
def test_the_embedding_taken_out_leaves_its_table_out_of_the_context_binary(tmp_path):
    """A lookup + untied head graph compiled for the HTP with the table in it, and with
    npu_rewrite.embedding_input's cut: the binary loses at least the table's fp16 bytes, and the cut
    binary fed the table's rows gives the logits the whole one gives."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.graphs import npu_rewrite

    v, h = 8192, 64
    rng = np.random.default_rng(2)
    table = rng.standard_normal((v, h)).astype(np.float32)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1])
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["emb"], name="embed", axis=0),
             helper.make_node("MatMul", ["emb", "head"], ["logits"], name="head")]
    inits = [numpy_helper.from_array(table, "table"),
             numpy_helper.from_array(rng.standard_normal((h, 256)).astype(np.float32), "head")]
    model = helper.make_model(helper.make_graph(nodes, "g", [ids], [helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, [1, 1, 256])], inits), opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(tmp_path / "whole.onnx"))
    cut, _ = npu_rewrite.embedding_input(model)
    onnx.save(cut, str(tmp_path / "cut.onnx"))
    whole = qnn.compile_context(tmp_path / "whole.onnx", tmp_path / "w", S25, "fp16")
    small = qnn.compile_context(tmp_path / "cut.onnx", tmp_path / "c", S25, "fp16")
    assert whole["bytes"] - small["bytes"] >= v * h * 2, (whole["bytes"], small["bytes"])
    a = qnn.htp_session(tmp_path / "w" / qnn.CONTEXT_MODEL, S25, "fp16")
    b = qnn.htp_session(tmp_path / "c" / qnn.CONTEXT_MODEL, S25, "fp16")
    for t in (0, 4097, v - 1):
        np.testing.assert_allclose(b.run(None, {"inputs_embeds": table[t].reshape(1, 1, h)})[0],
                                   a.run(None, {"input_ids": np.array([[t]], np.int64)})[0], rtol=1e-2, atol=1e-2)


@needs_qnn
def test_a_graph_that_would_fall_back_to_the_cpu_is_a_failure(tmp_path):
    with pytest.raises(qnn.QnnError, match="refused|EPContext"):
        qnn.compile_context(_graph(tmp_path, "cpu_only"), tmp_path / "ctx", S25, "fp16")


def test_the_qnn_sdk_version_is_part_of_the_compile_key():
    from pipeline.engine.layout import declaration
    from pipeline.toolchains.toolchain import fingerprint

    decl = declaration("compile_qnn")
    assert "qnn-sdk" in decl.toolchain and "onnxruntime-qnn" in decl.toolchain
    fp = fingerprint(decl.toolchain)
    assert fp["qnn-sdk"] == qnn.sdk_version()
    if qnn.missing() is None:
        assert fp["qnn-sdk"][0].isdigit(), fp  # the SDK's own version (2.51.0 with onnxruntime-qnn 2.7.0)


def test_compile_without_the_toolchain_fails_with_what_to_install(tmp_path, monkeypatch):
    from stages import compile_qnn

    pack = tmp_path / "pack"
    pack.mkdir()
    (pack / "npu.json").write_text(json.dumps({"precisions": ["w8a16"], "deployed": "w8a16", "graphs": {}}))
    monkeypatch.setattr(qnn, "missing", lambda: f"onnxruntime-qnn is not installed: {qnn.INSTALL}")
    ctx = StageContext(stage="compile_qnn", build="b", inputs={"pack": pack}, out=tmp_path / "out",
                       cfg=OmegaConf.create({"device": {"name": "galaxy_s25", "accelerator": "qnn_htp", "qnn": S25}}))
    (tmp_path / "out").mkdir()
    with pytest.raises(StageError, match=r"pip install -e '\.\[qnn\]'"):
        compile_qnn.run(ctx)


def test_compile_does_not_apply_to_a_cpu_device(tmp_path):
    from stages import compile_qnn

    ctx = StageContext(stage="compile_qnn", build="b", inputs={"pack": tmp_path}, out=tmp_path,
                       cfg=OmegaConf.create({"device": {"name": "x86_avx512", "accelerator": "none", "qnn": None}}))
    assert compile_qnn.run(ctx)["applies"] is False


def test_the_htp_emulation_timing_is_bounded_in_time_cutting_steps_then_passes():
    """A phone build's benchmark times the HTP emulation (no device timing) within benchmark.qnn_minutes:
    Gemma 3 270M's mixed binary took ~43 s a step on an AVX2 host, 5 passes of 2 + 8 steps an hour."""
    from stages.benchmark import NPU_STEPS, npu_plan

    assert npu_plan(0.1, 300, 5) == (5, NPU_STEPS)  # the embedded model's 48 steps in 4.8 s: all of them
    # 43 s a step, 5 minutes for this precision: one step a pass leaves (5 + 4 x 2) x 43 s, too long; two
    # passes (a spread) of two steps, (4 + 2) x 43 = 258 s, the most that fits
    assert npu_plan(43, 300, 5) == (2, 2)
    assert npu_plan(43, 300, 1) == (1, 6)  # one pass asked: never more, the steps cut to fit
    assert npu_plan(100, 60, 5) == (2, 1)  # the fewest the spread stands on, though past the bound


def test_expected_device_latency_is_the_s25_table_labelled_as_such():
    from stages.benchmark import expected_device_ms

    layers = [{"type": "sliding_attention"}] * 21 + [{"type": "full_attention"}] * 7
    e = expected_device_ms("SM8750", layers, "w4a16", 1024)
    # the notes' own sum: a step of 21 sliding + 7 full layers, w4a16, at 1k
    assert e["step_ms"] == pytest.approx(21 * 0.917 + 7 * 1.127)
    assert "real Galaxy S25" in e["source"] and "not a measurement" in e["caveat"]
    assert expected_device_ms("SM8650", layers, "w4a16", 1024) is None  # nothing measured on the S24's chip
    assert expected_device_ms("SM8750", layers, "w4a16", 8192) is None  # nor past 4k


@pytest.mark.slow
@pytest.mark.optional
@needs_qnn
def test_phone_build_end_to_end_compiles_once_and_verifies_on_the_htp(phone_build, tmp_path):
    repo, first = phone_build
    args = PHONE_ARGS
    build = repo / "artifacts" / "galaxy_s25-embedded-speed"
    info = json.loads((build / "compile_qnn" / "qnn.json").read_text())
    assert info["target"] == {"soc_model": "SM8750", "htp_arch": "v79", "soc_id": 69, "device": "galaxy_s25"}
    assert info["precisions"] == ["w4a16", "fp16"] and info["qnn_sdk"] == qnn.sdk_version()
    # which precision ships was measured (pack.qnn_select=measured, the default [w4a16, w8a16, fp16]): w4a16 on
    # the CPU EP against the fp32 export over held-out windows met parity.artifact.qnn_w4a16, so it ships and
    # w8a16, listed after it, is recorded and never built; fp16 stays as listed
    sel = info["selection"]
    assert sel["deployed"] == info["deployed"] == "w4a16" and sel["dropped"] == ["w8a16"], sel
    w4_sel = sel["options"]["w4a16"]
    assert w4_sel["measured"] and w4_sel["passed"] and w4_sel["missed"] == [] and w4_sel["tokens"] == 62, w4_sel
    assert 0 < w4_sel["kld_mean"] <= w4_sel["kld_p99"] <= 1.5 and not sel["options"]["w8a16"]["measured"]
    assert "w4a16 is listed before it" in sel["options"]["w8a16"]["why"]
    assert not (build / "pack" / "w8a16").exists() and not (build / "compile_qnn" / "w8a16").exists()
    # the 500 kB per-graph limit (PHONE_ARGS) cuts fp16 into parts of whole layers, every part's weights
    # within 90% of it, the parts covering the 4 layers in order, each reading the stream the one before it
    # wrote; w4a16's weights (under 450 kB) compile whole
    assert info["max_graph_bytes"] == 500000
    w4c = info["compiled"]["w4a16"]
    assert len(w4c["parts"]) == 1 and w4c["weight_bytes"] <= w4c["budget_bytes"] == 450000, w4c["weight_bytes"]
    assert (build / "compile_qnn" / "w4a16" / qnn.CONTEXT_MODEL).is_file()
    for p in ["fp16"]:
        c = info["compiled"][p]
        assert len(c["parts"]) >= 2 and c["weight_bytes"] > c["budget_bytes"] == 450000, (p, c["weight_bytes"])
        assert [q["layers"][0] for q in c["parts"]][0] == 0 and c["parts"][-1]["layers"][1] == 4
        assert all(a["layers"][1] == b["layers"][0] and a["stream_out"] == b["stream_in"]
                   for a, b in zip(c["parts"], c["parts"][1:]))
        assert all(q["weight_bytes"] <= c["budget_bytes"] for q in c["parts"])
        assert "logits" in c["parts"][-1]["outputs"] and c["parts"][0]["stream_in"] is None
        for q in c["parts"]:
            assert (build / "compile_qnn" / p / q["dir"] / qnn.CONTEXT_MODEL).is_file()
            assert any((build / "compile_qnn" / p / q["dir"]).glob("*.bin"))
        assert not list((build / "compile_qnn" / p).glob(".parts-*"))  # the cut graphs are not kept
    npu = json.loads((build / "pack" / "npu.json").read_text())
    assert npu["rewrites"]["rms_norms_fused"] > 0 and npu["rewrites"]["rope_tables"] > 0
    assert npu["rewrite_check"]["worst_snr_db"] >= 100
    assert npu["graphs"]["w4a16"]["samples"] > 0 and npu["graphs"]["w4a16"]["activation_type"] == "uint16"
    assert npu["graphs"]["w4a16"]["samples"] == npu["calibration"]["samples"] and npu["graphs"]["w4a16"]["streamed"]
    # the token embedding is off the HTP (pack.qnn_embedding=int8): an 8-bit lookup the phone runs on its CPU,
    # both widths measured; the binaries take inputs_embeds and hold no table
    emb = npu["embedding"]
    assert emb["bits"] == 8 and emb["block_size"] == 32 and set(emb["options"]) == {"int8", "int4"}
    assert emb["options"]["int8"]["snr_db"] > emb["options"]["int4"]["snr_db"] + 15
    assert emb["options"]["int8"]["bytes"] < emb["options"]["int4"]["bytes"] * 2.2
    assert (build / "compile_qnn" / "embed" / "model.onnx").is_file()
    io = json.loads((build / "compile_qnn" / "io.json").read_text())
    assert "input_ids" not in {i["name"] for i in io["inputs"]} and io["embedding"]["model"] == "embed/model.onnx"

    parity = json.loads((build / "verify_parity" / "report.json").read_text())
    assert parity["metrics"]["logits_snr_db"] >= 100  # the fp32 export against eager
    art = parity["artifact"]
    assert art["path"] == "qnn_graph" and art["deployed"] == "w4a16"
    fp16 = art["precisions"]["fp16"]["metrics"]
    w4 = art["precisions"]["w4a16"]["metrics"]
    assert fp16["logits_snr_db"] >= 40 and w4["logits_snr_db"] >= 30, (fp16, w4)
    assert fp16["top1_agreement"] >= 0.98 and w4["top1_agreement"] >= 0.9
    parts = art["precisions"]["w4a16"]["parts"]
    # the bulk on the CPU EP covers every prompt in full; the HTP confirms on 32 steps a prompt (parity.qnn_steps),
    # a cold run and one across the window's wrap, the CPU EP's figures on exactly its steps beside each
    assert set(parts) == {"cpu_qdq", "cold", "past_window"}
    assert parts["cold"]["prompts"] == parts["past_window"]["prompts"] == 2  # parity.qnn_prompts
    assert parts["cpu_qdq"]["prompts"] == len(parity["per_prompt"]) == 12
    htp_steps = parts["cold"]["metrics"]["steps"] + parts["past_window"]["metrics"]["steps"]
    assert htp_steps <= 2 * 32 < parts["cpu_qdq"]["metrics"]["steps"]
    for key in ("cold", "past_window"):
        same = parts[key]["cpu_qdq_same_steps"]
        assert same["steps"] == parts[key]["metrics"]["steps"]
        assert parts[key]["htp_s_per_step"] > 0  # what the confirmation costs a step, in the report
        # the stand-in runs the graph's quantization exactly and its float residual in fp32; the HTP reaches
        # its figure, or the ceiling of its own fp16 residual (~60-70 dB: the tiny model's 74 stand-in, 70.5 HTP)
        assert parts[key]["metrics"]["logits_snr_db"] > min(same["logits_snr_db"], 60) - 3, parts
    assert art["kld"] is not None and art["kld"]["tokens"] > 0 and "kld_skipped" not in art
    assert set(art["precisions"]["fp16"]["parts"]) == {"cold"}  # no CPU stand-in for the HTP's fp16
    assert art["precisions"]["fp16"]["prompts"] == 1 and fp16["steps"] < w4["steps"]
    assert {"qnn_w4a16", "qnn_fp16", "qnn_w4a16_load"} <= set(parity["seconds"])
    # every HTP run is gated in the field's units over its own steps (no evaluation windows there): KLD mean
    # and p99, fp16 (which has no CPU stand-in) included; the run's time planned against parity.qnn_minutes
    fp16_checked = art["precisions"]["fp16"]["parts"]["cold"]["thresholds"]
    assert fp16_checked["step_kld_p99"].startswith("<= 0.02") and fp16_checked["logits_snr_db"] == ">= 30"
    assert parts["cold"]["thresholds"]["step_kld_p99"].startswith("<= 1.5") and "ppl_ratio" not in parts["cold"]["thresholds"]
    assert parts["cpu_qdq"]["thresholds"]["kld_p99"] == "<= 1.5"  # the deployed stand-in: the windows' figure
    assert fp16["step_kld_p99"] <= 0.02 and fp16["logits_snr_centred_db"] >= 40, fp16
    plan = art["htp_plan"]
    assert plan["bound_minutes"] == 20 and plan["s_per_step"] > 0 and plan["steps"] == plan["steps_asked"]
    # the prompt graph (16 tokens a call, PHONE_ARGS): made QNN-ready beside the token graph and checked against
    # the export's decode steps a chunk at a time; w4a16's calibrated on its own samples with the token graph's
    # weights (pack checks the codes equal); both compiled, cut into parts under the same limit, and on the HTP
    # its chunk ends agree with the reference as the token graph's steps do, in one execution per 16 tokens
    assert npu["prompt_graph"]["tokens"] == 16 and npu["prompt_graph"]["chunks"] >= 2
    assert npu["prompt_graph"]["worst_snr_db"] >= 100 and npu["prompt_graph"]["precisions"] == ["w4a16", "fp16"]
    assert npu["prompt_graph"]["not_yet"] == [] and npu["calibration"]["prompt_samples"] > 0
    pk = build / "pack"
    assert qnn.same_weights(pk / "w4a16" / "model.onnx", pk / "float" / "model.onnx",
                            pk / "w4a16" / "prompt.onnx", pk / "float" / "prompt.onnx") == []
    # ... and would say which weight differs: one scale changed in a copy
    import onnx
    from onnx import numpy_helper

    from pipeline.sources.tensorfile import load_onnx

    m = load_onnx(pk / "w4a16" / "prompt.onnx")
    inits = {i.name for i in m.graph.initializer}
    reads = {n.input[1] for n in m.graph.node if n.op_type == "MatMul"}
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in reads
              and n.input[0] in inits)
    scale = next(i for i in m.graph.initializer if i.name == dq.input[1])
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * 1.5, scale.name))
    onnx.save(m, str(tmp_path / "prompt.onnx"))
    assert qnn.same_weights(pk / "w4a16" / "model.onnx", pk / "float" / "model.onnx", tmp_path / "prompt.onnx",
                            pk / "float" / "prompt.onnx") != []
    for p in info["precisions"]:
        pc = info["compiled"][p]["prompt"]
        assert pc["tokens"] == 16 and len(pc["parts"]) >= (2 if p == "fp16" else 1), (p, pc)
        assert all((build / "compile_qnn" / p / "prompt" / q["dir"] / qnn.CONTEXT_MODEL).is_file() for q in pc["parts"])
    # ... and the w4a16 prompt graph's CPU stand-in over every parity prompt in full, a chunk at a time,
    # gated as the HTP's runs are (SNR floor and KL: verify_parity._prompt_gate)
    bulk = art["precisions"]["w4a16"]["parts"]["cpu_qdq"]["prompt_graph"]
    assert bulk["thresholds"] == {"logits_snr_db": ">= 0", "kl_nats": "<= 0.25",
                                  "step_kld_mean": "<= 0.25 (max_kld_mean, over the chunk ends)",
                                  "step_kld_p99": "<= 1.5 (max_kld_p99, over the chunk ends)"}, bulk
    assert bulk["chunk_ends"] >= 12 and bulk["executions"] == bulk["chunk_ends"] < bulk["tokens"], bulk
    assert bulk["logits_snr_db"] >= 30 and bulk["kl_nats"] <= 0.01 and bulk["top1_agreement"] >= 0.9, bulk
    assert "qnn_w4a16_cpu_qdq_prompt_graph" in parity["seconds"]
    for p, key in (("fp16", "cold"), ("w4a16", "cold"), ("w4a16", "past_window")):
        pg = art["precisions"][p]["parts"][key]["prompt_graph"]
        assert set(pg["thresholds"]) == {"logits_snr_db", "kl_nats", "step_kld_mean", "step_kld_p99"}, pg
        assert pg["tokens_a_call"] == 16 and pg["executions"] == -(-pg["tokens"] // 16) < pg["tokens"], (p, key, pg)
        floor = 40 if p == "fp16" else 30
        assert pg["logits_snr_db"] >= floor and pg["top1_agreement"] >= 0.5, (p, key, pg)

    profile = json.loads((build / "deploy_profile" / "qnn.json").read_text())
    assert profile["context_binary"]["model"] == f"../compile_qnn/w4a16/{qnn.CONTEXT_MODEL}"  # one part, whole
    assert profile["selection"]["deployed"] == "w4a16" and profile["selection"]["options"]["w4a16"]["passed"]
    parts = info["compiled"]["fp16"]["parts"]  # a variant in parts: every part's binary, in order
    assert profile["variants"]["fp16"]["models"] == [f"../compile_qnn/fp16/{q['dir']}/model_ctx.onnx" for q in parts]
    assert [q["layers"] for q in profile["variants"]["fp16"]["parts"]] == [q["layers"] for q in parts]
    assert profile["session_config"] == {"session.disable_cpu_ep_fallback": "1"}
    assert profile["provider"]["options"]["htp_arch"] == "79" and profile["qnn_sdk"] == qnn.sdk_version()
    assert {x["slot_rule"] for x in profile["kv_layout"]} >= {"position", "position mod 15"}
    names = {i["name"]: i for i in profile["inputs"]}
    assert profile["embedding"]["model"] == "../compile_qnn/embed/model.onnx" and profile["embedding"]["bits"] == 8
    assert names["inputs_embeds"]["dtype"] == "float32" and "input_ids" not in names
    prompt = profile["prompt_graph"]
    assert prompt["tokens"] == 16 and prompt["precisions"] == ["w4a16", "fp16"] and prompt["without"] == {}
    assert [q["layers"] for q in prompt["variants"]["fp16"]["parts"]] == [q["layers"] for q in pc["parts"]]
    assert prompt["executions_for_512_prompt_tokens"] == {"prompt_graph": 32, "token_graph": 512}
    pnames = {i["name"]: i["shape"] for i in prompt["inputs"]}
    assert pnames["inputs_embeds"][:2] == [1, 16] and pnames["position"] == [16] and "mask_ring" in pnames
    assert names["past_key_0"]["dtype"] == "float32" and names["past_key_0"]["shape"][2] == 15

    bench = json.loads((build / "benchmark" / "report.json").read_text())
    assert bench["device_measured"] is False and bench["on_target"] is False
    assert any("not galaxy_s25 timings" in n for n in bench["notes"])
    assert bench["htp_emulation_ms_per_step"]["w4a16"]["median"] > 0
    # a tiny model's steps fit the default bound: nothing cut, the plan recorded per precision
    assert bench["settings"]["qnn_minutes"] == 10 and not any(v["cut"] for v in bench["htp_plan"].values())
    assert bench["htp_plan"]["w4a16"]["passes"] == bench["settings"]["passes"] and bench["htp_plan"]["w4a16"]["s_per_step"] > 0
    assert "HTP emulation" in first.stdout + first.stderr

    gen = run_cli(repo, "generate", "galaxy_s25-embedded-speed", "def f(x):", "--max-new-tokens", "4")
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "HTP backend emulated on this host" in gen.stderr and " new at " in gen.stderr

    again = run_cli(repo, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not [s for s in ran_stages(again.stdout + again.stderr) if not s.endswith("--probe")
                and not s.startswith("probe--")], "a rebuild with nothing changed compiles nothing"


@pytest.mark.parametrize("precision,bits", [("w8a16", 8), ("w4a16", 4)])
def test_qdq_quantize_calibrates_16_bit_activations_and_n_bit_weights(tmp_path, precision, bits):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                          "g", [x], [y], [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "f.onnx"))
    samples = [{"x": rng.standard_normal((1, 32)).astype(np.float32)} for _ in range(16)]
    facts = qnn.qdq_quantize(tmp_path / "f.onnx", tmp_path / "q.onnx", samples, precision, {})
    assert facts["samples"] == 16 and facts["activation_type"] == "uint16"
    assert facts["matmul_weights"] == {"granularity": "per_channel", "type": f"int{bits}", "symmetric": True,
                                       "count": 1, "scales": 16}
    q = onnx.load(str(tmp_path / "q.onnx"))
    kinds = {numpy_helper.to_array(i).dtype.name for i in q.graph.initializer}
    assert ("uint16" in kinds) and ({"int8"} if bits == 8 else {"int4"}) & kinds, kinds
    assert qnn.weight_scales(tmp_path / "q.onnx") == {"w_quantized": 16}
    import onnxruntime as ort

    s = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    xin = samples[0]["x"]
    want = np.maximum(xin @ w, 0)
    got = s.run(None, {"x": xin})[0]
    snr = 10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum())
    assert snr > (30 if bits == 8 else 12), snr
    if qnn.missing() is None:  # and the HTP takes it
        qnn.compile_context(tmp_path / "q.onnx", tmp_path / "ctx", S25, precision)


def _outlier_decoder(tmp_path):
    """A tiny two-layer MLP block whose first weight has a few output channels
    40x the rest, as real checkpoints do (Gemma 3 270M: a down_proj weight 34
    standard deviations out), then a residual add: the activation those
    channels feed is an outlier too."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    k, n = 128, 192
    w1 = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    w1[:, :6] *= 40
    w2 = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, k])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Gelu", ["h"], ["a"]),
                           helper.make_node("MatMul", ["a", "w2"], ["d"]), helper.make_node("Add", ["x", "d"], ["y"])],
                          "g", [x], [y], [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "f.onnx"))
    return tmp_path / "f.onnx", [{"x": rng.standard_normal((1, 1, k)).astype(np.float32)} for _ in range(24)]


@pytest.mark.parametrize("precision,floor,gain", [("w8a16", 35.0, 6.0), ("w4a16", 16.5, 2.0)])
def test_per_channel_weights_keep_an_outlier_channel_model_within_the_floor(tmp_path, precision, floor, gain):
    """The phone-fidelity fix (docs/phone-fidelity.md): ONNX Runtime's QNN
    config gives a MatMul weight one scale, so outlier channels set the grid
    of every other one. Per tensor this block falls below the floor; per
    output channel it passes, on the CPU EP's QDQ and on the HTP backend."""
    import onnxruntime as ort

    model, samples = _outlier_decoder(tmp_path)
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    def snr(session):
        num = den = 0.0
        for feed in samples:
            want = ref.run(None, feed)[0]
            got = session.run(None, feed)[0]
            num, den = num + float((want ** 2).sum()), den + float(((want - got) ** 2).sum())
        return 10 * np.log10(num / den)

    got = {}
    for weights in ("per_tensor", "per_channel"):
        q = tmp_path / f"{weights}.onnx"
        facts = qnn.qdq_quantize(model, q, samples, precision, {}, weights)
        assert facts["matmul_weights"]["granularity"] == weights and facts["matmul_weights"]["count"] == 2
        assert set(qnn.weight_scales(q).values()) == ({1} if weights == "per_tensor" else {192, 128})
        got[weights] = {"cpu": snr(ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]))}
        if qnn.missing() is None:
            qnn.compile_context(q, tmp_path / f"ctx_{weights}", S25, precision)
            got[weights]["htp"] = snr(qnn.htp_session(tmp_path / f"ctx_{weights}" / qnn.CONTEXT_MODEL, S25,
                                                      precision))
    for arm, per_channel in got["per_channel"].items():
        assert got["per_tensor"][arm] < floor <= per_channel, (arm, got)
        assert per_channel - got["per_tensor"][arm] > gain, (arm, got)
    if "htp" in got["per_channel"]:  # the CPU EP's QDQ is a bound for the HTP (which measured 4 dB better here)
        assert got["per_channel"]["htp"] > got["per_channel"]["cpu"] - 2, got


@pytest.mark.parametrize("weights", ["per_channel", "per_block"])
def test_the_cpu_stand_in_multiplies_a_16_bit_activation_outlier_as_its_qdq_says(tmp_path, weights):
    """The CPU EP's stand-in for the HTP (qnn.CPU_QDQ_CONFIG, QDQ fusions off): a uint16 activation with an outlier
    channel times int8 weights (per output channel, or per block of 32 inputs) is the product of the
    dequantized values, as on the HTP. With ONNX Runtime's defaults the CPU EP fuses the weight's
    DequantizeLinear + MatMul into MatMulNBits and puts the activation on an int8 grid per block of
    K, where the outlier's block loses its small channels: the bulk parity measure was that loose."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k, n, block = 256, 64, 32
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, k)).astype(np.float32)
    x[:, 3] *= 300.0  # one outlier channel, as real checkpoints carry
    a_scale = np.float32((x.max() - x.min()) / 65535)
    a_zero = np.uint16(round(-x.min() / a_scale))
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    if weights == "per_channel":
        w_scale, dq = (rng.random(n) * 0.01 + 1e-3).astype(np.float32), {"axis": 1}
        wf = w.astype(np.float32) * w_scale
    else:
        w_scale, dq = (rng.random((k // block, n)) * 0.01 + 1e-3).astype(np.float32), {"axis": 0, "block_size": block}
        wf = w.astype(np.float32) * np.repeat(w_scale, block, axis=0)
    nodes = [helper.make_node("QuantizeLinear", ["x", "a_scale", "a_zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "a_scale", "a_zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "w_scale"], ["wd"], **dq),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    inits = [numpy_helper.from_array(a, name) for name, a in
             (("a_scale", np.array(a_scale)), ("a_zero", np.array(a_zero)), ("w", w), ("w_scale", w_scale))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "q.onnx"))
    xd = (np.clip(np.round(x / a_scale) + int(a_zero), 0, 65535) - int(a_zero)).astype(np.float32) * a_scale
    want = xd.astype(np.float64) @ wf.astype(np.float64)

    def snr(config):
        so = ort.SessionOptions()
        for key, value in config.items():
            so.add_session_config_entry(key, value)
        got = ort.InferenceSession(str(tmp_path / "q.onnx"), so, providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        return 10 * np.log10((want ** 2).sum() / ((want - got) ** 2).sum())

    assert snr(qnn.CPU_QDQ_CONFIG) > 100  # fp32 arithmetic on the dequantized values
    assert snr({}) < 60  # ONNX Runtime's default: the activation on an int8 grid (the trap the config avoids)


def _massive_channel_block(tmp_path, massive: float = 30000.0):
    """Embedding -> RMSNorm -> MLP, on a residual stream one channel of which a sublayer drives to 30,000
    (Gemma 3 270M's stream reaches 28,686; its norms' weights mute such a channel), then the final norm
    and a head: the signal is in the small channels, and one uint16 grid over the stream is steps of 0.46."""
    pytest.importorskip("onnx")
    from onnx import helper

    rng = np.random.default_rng(4)
    h, v = 64, 32
    table = rng.standard_normal((v, h)).astype(np.float32)
    sink = np.zeros(h, np.float32)
    sink[5] = massive
    w1 = (rng.standard_normal((h, h)) * 0.1).astype(np.float32)
    w1[5, :] = 0
    w1[:, 5] = 0
    w2 = (rng.standard_normal((h, h)) * 0.1).astype(np.float32)
    g = np.ones(h, np.float32)
    g[5] = 1e-3

    nodes = [helper.make_node("Gather", ["table", "ids"], ["r0"], name="embed"),
             helper.make_node("SimplifiedLayerNormalization", ["r0", "g"], ["n1"], name="norm1", axis=-1, epsilon=1e-6),
             helper.make_node("MatMul", ["n1", "w1"], ["b1"], name="mlp"),
             helper.make_node("Add", ["r0", "sink"], ["r1"], name="sink_add"),
             helper.make_node("Add", ["r1", "b1"], ["r2"], name="mlp_add"),
             helper.make_node("SimplifiedLayerNormalization", ["r2", "g"], ["n2"], name="final_norm", axis=-1,
                              epsilon=1e-6),
             helper.make_node("MatMul", ["n2", "w2"], ["y"], name="head")]
    return _token_block(tmp_path, nodes, {"table": table, "w1": w1, "w2": w2, "g": g, "sink": sink},
                        ("r0", "n1", "b1", "r1", "r2", "n2"), h, v)


def _token_block(tmp_path, nodes, weights: dict, hidden: tuple, h: int = 64, v: int = 32):
    """A token-id -> [1, 1, h] block of `nodes` saved as f.onnx: (its path, the model, one sample per id)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    def vi(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 1, h])

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 1])], [vi("y")],
                              [numpy_helper.from_array(a, n) for n, a in weights.items()],
                              value_info=[vi(t) for t in hidden])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "f.onnx"))
    return tmp_path / "f.onnx", model, [{"ids": np.array([[i]], np.int64)} for i in range(v)]


def test_a_float_residual_stream_keeps_a_massive_activation_model_within_the_floor(tmp_path):
    """The phone-fidelity fix for an activation outlier (docs/phone-fidelity.md): quantized, the residual
    stream's grid is set by its massive channel and the small ones are lost (below the 30 dB floor); left
    float (pack.qnn_residual=fp16, run in the HTP's fp16) the block passes, on the CPU EP and on the HTP."""
    import onnxruntime as ort

    from pipeline.graphs import npu_rewrite

    path, model, samples = _massive_channel_block(tmp_path)
    stream = npu_rewrite.residual_stream(model)
    assert stream == {"adds": ["sink_add", "mlp_add"], "norms": ["norm1", "final_norm"], "writers": []}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def snr(session):
        num = den = 0.0
        for feed in samples:
            want, got = ref.run(None, feed)[0], session.run(None, feed)[0]
            num, den = num + float((want ** 2).sum()), den + float(((want - got) ** 2).sum())
        return 10 * np.log10(num / den)

    got = {}
    for name, float_nodes in (("uint16", []), ("fp16", stream["adds"] + stream["norms"])):
        q = tmp_path / f"{name}.onnx"
        facts = qnn.qdq_quantize(path, q, samples, "w8a16", {}, float_nodes=float_nodes)
        assert facts["float_nodes"] == len(float_nodes)
        ops = {n.name: n for n in __import__("onnx").load(str(q)).graph.node}
        if float_nodes:  # the stream's tensors are never quantized
            quantized = {n.input[0] for n in ops.values() if n.op_type == "QuantizeLinear"}
            assert not {"r1", "r2"} & quantized, quantized
        got[name] = {"cpu": snr(ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]))}
        if qnn.missing() is None:
            qnn.compile_context(q, tmp_path / f"ctx_{name}", S25, "w8a16")
            got[name]["htp"] = snr(qnn.htp_session(tmp_path / f"ctx_{name}" / qnn.CONTEXT_MODEL, S25, "w8a16"))
    for arm, value in got["fp16"].items():
        assert got["uint16"][arm] < 30 <= value, (arm, got)


def test_a_residual_stream_past_fp16s_largest_value_is_carried_scaled(tmp_path):
    """docs/phone-fidelity.md finding 5: Gemma 3 270M's stream reaches 103,795 at the BOS, past fp16's
    65,504, and the HTP carries the float stream in fp16. The block's stream holds a 100,000 channel: the
    fp16 graph on the HTP is wrong as it is, and right with the stream carried divided by a power of two
    (npu_rewrite.scale_residual, which the pack applies from the stream's measured range); in fp32 the
    scaled graph computes what the original does."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort

    from pipeline.graphs import npu_rewrite

    path, model, samples = _massive_channel_block(tmp_path, massive=100000.0)
    assert npu_rewrite.residual_tensors(model) == ["r0", "r1", "r2"]
    factor = npu_rewrite.residual_scale_factor(100000.0 + 10)
    assert factor == 16 and npu_rewrite.residual_scale_factor(8000.0) == 1
    scaled_model = onnx.load(str(path))
    done = npu_rewrite.scale_residual(scaled_model, factor)
    assert done == {"factor": 16, "muls": ["residual_scale/stream_in", "residual_scale/sink_add",
                                           "residual_scale/mlp_add"], "norms": 2}
    scaled = tmp_path / "scaled.onnx"
    onnx.save(scaled_model, str(scaled))
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert _snr_over(ref, ort.InferenceSession(str(scaled), providers=["CPUExecutionProvider"]), samples) > 100
    if qnn.missing() is not None:
        pytest.skip(f"the HTP half needs the QNN toolchain: {qnn.missing()}")
    got = {}
    for name, graph in (("as_is", path), ("scaled", scaled)):
        qnn.compile_context(graph, tmp_path / f"ctx_{name}", S25, "fp16")
        got[name] = _snr_over(ref, qnn.htp_session(tmp_path / f"ctx_{name}" / qnn.CONTEXT_MODEL, S25, "fp16"),
                              samples)
    assert got["as_is"] < 30 and got["scaled"] >= 40, got


def _post_norm_block(tmp_path):
    """Gemma's sandwich: norm -> projection -> post-norm -> residual Add. The projection's output is narrow
    (no outlier); the post-norm's weight is 4,000 on one channel (Gemma 3 270M's post-norms
    turn outputs within +-1.3..127 into +-400..19,866), so the norm writes the stream's massive channel;
    the final norm mutes it and a head reads the small channels."""
    pytest.importorskip("onnx")
    from onnx import helper

    rng = np.random.default_rng(6)
    h, v = 64, 32
    table = rng.standard_normal((v, h)).astype(np.float32)
    w1 = (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32)
    # channel 5 of the projection is large on every token (as Gemma's are: one input channel, constant
    # across tokens, read strongly), so the post-norm writes it massive on every token, as a sink does
    table[:, 7] = 3.0
    w1[:, 5] = 0.0
    w1[7, 5] = 5.0
    g, post, final = (np.ones(h, np.float32) for _ in range(3))
    post[5] = 4000.0  # the norm writes ~28,000 there: within fp16, as Gemma 3 270M's 28,686
    final[5] = 1e-3

    norm = "SimplifiedLayerNormalization"
    nodes = [helper.make_node("Gather", ["table", "ids"], ["r0"], name="embed"),
             helper.make_node(norm, ["r0", "g"], ["n1"], name="pre_norm", axis=-1, epsilon=1e-6),
             helper.make_node("MatMul", ["n1", "w1"], ["b1"], name="proj"),
             helper.make_node(norm, ["b1", "post"], ["p1"], name="post_norm", axis=-1, epsilon=1e-6),
             helper.make_node("Add", ["r0", "p1"], ["r1"], name="res_add"),
             helper.make_node(norm, ["r1", "final"], ["n2"], name="final_norm", axis=-1, epsilon=1e-6),
             helper.make_node("MatMul", ["n2", "w2"], ["y"], name="head")]
    return _token_block(tmp_path, nodes, {"table": table, "w1": w1, "w2": w2, "g": g, "post": post, "final": final},
                        ("r0", "n1", "b1", "p1", "r1", "n2"), h, v)


def test_float_post_norms_keep_the_massive_channel_they_write_off_the_16_bit_grid(tmp_path):
    """The residual stream's writers (docs/phone-fidelity.md finding 5): with the stream float but the
    post-norm that writes its massive channel quantized, the norm's uint16 grid (steps of ~0.8 over
    +-26,700) loses the small channels it writes: 28.1 dB on the CPU EP and 23.3 on the HTP (measured),
    below the 30 dB floor; with the writers float too (pack.qnn_residual=fp16, as built now) 37.2 and
    44.5. Fails with the writers left out of the float islands."""
    import onnxruntime as ort

    from pipeline.graphs import npu_rewrite

    path, model, samples = _post_norm_block(tmp_path)
    stream = npu_rewrite.residual_stream(model)
    assert stream == {"adds": ["res_add"], "norms": ["pre_norm", "final_norm"], "writers": ["post_norm"]}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = {}
    for name, float_nodes in (("stream", stream["adds"] + stream["norms"]),
                              ("stream_and_writers", stream["adds"] + stream["norms"] + stream["writers"])):
        q = tmp_path / f"{name}.onnx"
        qnn.qdq_quantize(path, q, samples, "w8a16", {}, float_nodes=float_nodes)
        got[name] = {"cpu": _snr_over(ref, ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]),
                                      samples)}
        if qnn.missing() is None:
            qnn.compile_context(q, tmp_path / f"ctx_{name}", S25, "w8a16")
            got[name]["htp"] = _snr_over(ref, qnn.htp_session(tmp_path / f"ctx_{name}" / qnn.CONTEXT_MODEL, S25,
                                                              "w8a16"), samples)
    for arm, value in got["stream_and_writers"].items():
        assert got["stream"][arm] < 30 <= value, (arm, got)


def _attention_block(tmp_path, wide_value_channel: float = 20.0):
    """One decode step's attention over a 63-entry cache: q and v projections, the cache concatenated,
    q.K^T, the mask's Add, Softmax, softmax.V, the output projection. One channel of the value cache is
    `wide_value_channel` times the others (Gemma 3 270M's V caches span [-26, 80] with most entries O(1))."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    h, d, t = 64, 64, 63
    wq, wv = ((rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32) for _ in range(2))
    wo = (rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32)

    def vi(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q0"], name="q_proj"),
             helper.make_node("Reshape", ["q0", "s4"], ["q"], name="q_view"),
             helper.make_node("MatMul", ["x", "wv"], ["v0"], name="v_proj"),
             helper.make_node("Reshape", ["v0", "s4"], ["v"], name="v_view"),
             helper.make_node("Concat", ["past_key", "q"], ["keys"], name="k_cat", axis=2),
             helper.make_node("Concat", ["past_value", "v"], ["values"], name="v_cat", axis=2),
             helper.make_node("Transpose", ["keys"], ["keys_t"], name="k_t", perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "keys_t"], ["scores"], name="scores"),
             helper.make_node("Add", ["scores", "mask"], ["masked"], name="mask_add"),
             helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["probs", "values"], ["mixed"], name="mix"),
             helper.make_node("Reshape", ["mixed", "s3"], ["m"], name="m_view"),
             helper.make_node("MatMul", ["m", "wo"], ["y"], name="o_proj")]
    graph = helper.make_graph(
        nodes, "attention", [vi("x", [1, 1, h]), vi("past_key", [1, 1, t, d]), vi("past_value", [1, 1, t, d]),
                             vi("mask", [1, 1, 1, t + 1])], [vi("y", [1, 1, h])],
        [numpy_helper.from_array(a, n) for a, n in ((wq, "wq"), (wv, "wv"), (wo, "wo"),
                                                    (np.array([1, 1, 1, d], np.int64), "s4"),
                                                    (np.array([1, 1, d], np.int64), "s3"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "attention.onnx"))

    def sample():
        value = rng.standard_normal((1, 1, t, d)).astype(np.float32)
        value[..., 3] *= wide_value_channel
        return {"x": rng.standard_normal((1, 1, h)).astype(np.float32),
                "past_key": (rng.standard_normal((1, 1, t, d)) * 0.5).astype(np.float32),
                "past_value": value, "mask": np.zeros((1, 1, 1, t + 1), np.float32)}

    return tmp_path / "attention.onnx", model, [sample() for _ in range(16)]


def _snr_over(ref, session, samples) -> float:
    num = den = 0.0
    for feed in samples:
        want, got = ref.run(None, feed)[0], session.run(None, feed)[0]
        num, den = num + float((want ** 2).sum()), den + float(((want - got) ** 2).sum())
    return float("inf") if den == 0 else 10 * np.log10(num / den)


@needs_qnn
def test_float_attention_cores_keep_a_wide_value_channel_within_the_floor_on_the_htp(tmp_path):
    """The phone-fidelity fix for the HTP's products of two activations (docs/phone-fidelity.md): with one
    value channel 20x wider than the rest, the quantized attention core (pack.qnn_attention=uint16) is
    within the 30 dB floor on the CPU EP that stands in for the HTP (38.8 dB measured) and far below it on
    the HTP itself (15.8); left float (fp16, the default) the HTP passes (41.3). The CPU EP alone would
    never have shown it: the test runs the HTP."""
    import onnxruntime as ort

    from pipeline.graphs import npu_rewrite

    path, model, samples = _attention_block(tmp_path)
    cores = npu_rewrite.attention_cores(model)
    assert cores == {"scores": ["scores"], "masks": ["mask_add"], "softmaxes": ["softmax"], "mixes": ["mix"]}
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = {}
    for name, float_nodes in (("uint16", []), ("fp16", [n for names in cores.values() for n in names])):
        q = tmp_path / f"{name}.onnx"
        qnn.qdq_quantize(path, q, samples, "w8a16", {}, float_nodes=float_nodes)
        qnn.compile_context(q, tmp_path / f"ctx_{name}", S25, "w8a16")
        got[name] = {"cpu": _snr_over(ref, ort.InferenceSession(str(q), providers=["CPUExecutionProvider"]),
                                      samples),
                     "htp": _snr_over(ref, qnn.htp_session(tmp_path / f"ctx_{name}" / qnn.CONTEXT_MODEL, S25,
                                                           "w8a16"), samples)}
    assert got["uint16"]["cpu"] >= 30 > got["uint16"]["htp"], got  # the stand-in hides it
    assert got["fp16"]["htp"] >= 30 and got["fp16"]["cpu"] >= 30, got


@needs_qnn
def test_graph_diff_on_the_htp_names_the_product_where_the_htp_departs_from_the_cpu_ep(tmp_path):
    """`python -m pipeline.measure.graph_diff --htp`: the quantized attention block's tensors agree between the CPU EP
    and the HTP until softmax.V, the first where they part (by > 10 dB below everything before it)."""
    from pipeline.measure import graph_diff

    path, model, samples = _attention_block(tmp_path)
    q = tmp_path / "uint16.onnx"
    qnn.qdq_quantize(path, q, samples, "w8a16", {})
    rows = graph_diff.compare_htp(model, __import__("onnx").load(str(q)), samples[0], S25, tmp_path / "work")
    by = {r["tensor"]: r for r in rows}
    assert {"scores", "probs", "mixed", "x"} <= set(by), sorted(by)
    order = [r["tensor"] for r in rows]
    first = next(r for r in rows if r["cpu_htp_db"] < 30)
    assert first["tensor"] == "mixed", [(r["tensor"], round(r["cpu_htp_db"], 1)) for r in rows]
    before = [r["cpu_htp_db"] for r in rows[: order.index("mixed")]]
    assert min(before) > first["cpu_htp_db"] + 10, rows
    assert by["mixed"]["ref_cpu_db"] > 30  # on the CPU EP the product is fine


def _gptq_case(tmp_path, k=96, n=64, seed=5, runs=True):
    """A float MatMul graph f.onnx over correlated inputs, its checkpoint linear `lin`, the calibrate
    stage's files for it, and its samples; with `runs`, the weight's runs of 32 inputs scaled apart."""
    onnx = pytest.importorskip("onnx")
    import torch
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)).astype(np.float32)
    xs = [(rng.standard_normal((1, 1, k)).astype(np.float32) @ mix) for _ in range(64)]
    # within each output channel, runs of 32 inputs of very different magnitudes (x0.02 .. x7): what one
    # scale per channel serves badly and one per 32 inputs well
    scale = np.repeat(np.exp(2 * rng.standard_normal((1, k // 32))), 32, axis=1) if runs else 1.0
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32) * 0.05  # the checkpoint's [out, in]
    ckpt, cal = tmp_path / "ckpt", tmp_path / "cal"
    ckpt.mkdir()
    cal.mkdir()
    save_file({"lin.weight": torch.from_numpy(w)}, str(ckpt / "model.safetensors"))
    x = np.concatenate([v.reshape(1, k) for v in xs]).astype(np.float64)
    save_file({"lin": torch.from_numpy(x.T @ x / len(xs))}, str(cal / "hessians.safetensors"))
    (cal / "calibration.json").write_text(json.dumps({"layers": {"lin": {"hessian": "lin", "in_features": k,
                                                                         "out_features": n}}}))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])],
                          [numpy_helper.from_array(w.T.copy(), "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "f.onnx"))
    return ckpt, cal, [{"x": v} for v in xs]


def _htp_agrees_with_the_cpu_ep(graph, samples, precision: str, work) -> None:
    """Where the QNN toolchain is here: `graph` compiles for the S25's HTP and its outputs on 8 samples are
    the CPU EP's within 30 dB."""
    if qnn.missing() is not None:
        return
    import onnxruntime as ort

    info = qnn.compile_context(graph, work, S25, precision)
    htp = qnn.htp_session(work / info["context_model"], S25, precision)
    cpu = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    a = np.concatenate([cpu.run(None, f)[0] for f in samples[:8]])
    b = np.concatenate([htp.run(None, f)[0] for f in samples[:8]])
    assert 10 * np.log10((a ** 2).sum() / ((a - b) ** 2).sum()) > 30


def _output_error(ref_model, model, samples) -> float:
    import onnxruntime as ort

    ref = ort.InferenceSession(str(ref_model), providers=["CPUExecutionProvider"])
    s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sum(float(((ref.run(None, f)[0] - s.run(None, f)[0]) ** 2).sum()) for f in samples)


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_block_codes_put_each_weight_on_a_finer_grid_the_htp_takes(tmp_path, method):
    """pack.qnn_weights=per_block: w8a16's MatMul weights get a scale per 32 inputs of each output channel
    (a blockwise DequantizeLinear, no zero point, no orphan initializer left), their output error on the
    calibration inputs is below the per-channel grid's with the same method, and the HTP compiles it and
    agrees with the CPU EP."""
    from onnx import numpy_helper

    ckpt, cal, samples = _gptq_case(tmp_path)
    per_channel, per_block = tmp_path / "c.onnx", tmp_path / "b.onnx"
    for q in (per_channel, per_block):
        qnn.qdq_quantize(tmp_path / "f.onnx", q, samples, "w8a16", {})
    if method == "gptq":
        qnn.requantize_weights(per_channel, tmp_path / "f.onnx", ckpt, cal)
    facts = qnn.requantize_weights(per_block, tmp_path / "f.onnx", ckpt, cal, method=method, block=32)
    assert facts["granularity"] == "per_block" and facts["block"] == 32 and facts["weights"] == 1
    assert facts["scales"] == (96 // 32) * 64 and qnn.weight_scales(per_block) == {"w_quantized": 3 * 64}
    m = qnn_load(per_block)
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w_quantized")
    assert {a.name: a.i for a in dq.attribute} == {"axis": 0, "block_size": 32} and len(dq.input) == 2
    used = {i for n in m.graph.node for i in n.input}
    assert all(i.name in used for i in m.graph.initializer)
    scales = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}["w_scale"]
    assert scales.shape == (3, 64)
    # the weights' own error on the calibration inputs (activations exact): tr(dW H dW^T)
    x = np.concatenate([f["x"].reshape(1, -1) for f in samples]).astype(np.float64)
    w = numpy_helper.to_array(qnn_load(tmp_path / "f.onnx").graph.initializer[0]).astype(np.float64)

    def weight_error(model):
        i = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in qnn_load(model).graph.initializer}
        s = i["w_scale"]
        deq = i["w_quantized"] * (np.repeat(s, 32, axis=0) if s.ndim == 2 else s)
        return float((((x @ (deq - w)) ** 2).sum()))

    assert weight_error(per_block) < 0.5 * weight_error(per_channel)
    assert _output_error(tmp_path / "f.onnx", per_block, samples) < \
        _output_error(tmp_path / "f.onnx", per_channel, samples)
    with pytest.raises(qnn.QnnError, match="pack.qnn_weight_block=64 does not divide"):
        qnn.check_weight_block(tmp_path / "f.onnx", 64)
    with pytest.raises(qnn.QnnError, match="multiple of 4"):
        qnn.check_weight_block(tmp_path / "f.onnx", 6)
    qnn.check_weight_block(tmp_path / "f.onnx", 32)
    _htp_agrees_with_the_cpu_ep(per_block, samples, "w8a16", tmp_path / "ctx")


def _quantize_stage(tmp_path, ckpt, cal, group=32, sym=True):
    """The quantize stage's folder for _gptq_case's one linear: GPTQ at 4 bits in groups of `group`."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.quant import gptq

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("lin.weight").float()
    with safe_open(str(cal / "hessians.safetensors"), framework="pt") as f:
        h = f.get_tensor("lin").double()
    q = gptq.gptq_quantize(w, h, group_size=group, sym=sym, name="lin")
    out = tmp_path / "quantize"
    out.mkdir()
    save_file({"lin.qweight": q.qweight, "lin.scales": q.scales, "lin.zeros": q.zeros},
              str(out / gptq.QUANT_TENSORS), metadata={"format": gptq.FORMAT})
    (out / gptq.QUANT_JSON).write_text(json.dumps({
        "format": gptq.FORMAT, "bits": 4, "group_size": group, "sym": sym, "method": "gptq",
        "layers": {"lin": {"in_features": w.shape[1], "out_features": w.shape[0]}}}))
    return out, q


def test_w4a16_weights_are_the_quantize_stages_gptq_codes(tmp_path):
    """w4a16 (pack.qnn_precisions): each MatMul weight takes the quantize stage's own 4-bit GPTQ codes, the
    codes every CPU path packs, as INT4 in blocks of that stage's group size (a blockwise DequantizeLinear,
    no zero point): the graph's codes are those codes, its scales those scales, and the output error on
    the calibration inputs is below ONNX Runtime's per-channel rounding; the HTP compiles it and agrees with
    the CPU EP. Asymmetric codes are refused in one line naming quantize.sym."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import numpy_helper

    ckpt, cal, samples = _gptq_case(tmp_path, n=64)
    quant, q = _quantize_stage(tmp_path, ckpt, cal)
    rounded, graph = tmp_path / "r.onnx", tmp_path / "w4.onnx"
    for path in (rounded, graph):
        qnn.qdq_quantize(tmp_path / "f.onnx", path, samples, "w4a16", {})
    facts = qnn.requantize_weights(graph, tmp_path / "f.onnx", ckpt, cal, codes_from=quant)
    assert facts["method"] == "quantize" and facts["weights"] == 1 and facts["rounded"] == 0
    assert facts["blocks"] == [32] and facts["scales"] == (96 // 32) * 64
    m = qnn_load(graph)
    inits = {i.name: i for i in m.graph.initializer}
    assert inits["w_quantized"].data_type == onnx.TensorProto.INT4
    codes = numpy_helper.to_array(inits["w_quantized"])  # [K, N], signed
    np.testing.assert_array_equal(codes, (q.qweight.numpy().astype(np.int16) - 8).T)  # the GPTQ codes
    np.testing.assert_array_equal(numpy_helper.to_array(inits["w_scale"]), q.scales.numpy().T)
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w_quantized")
    assert {a.name: a.i for a in dq.attribute} == {"axis": 0, "block_size": 32} and len(dq.input) == 2
    assert _output_error(tmp_path / "f.onnx", graph, samples) < _output_error(tmp_path / "f.onnx", rounded, samples)
    _htp_agrees_with_the_cpu_ep(graph, samples, "w4a16", tmp_path / "ctx")
    (tmp_path / "asym").mkdir()
    asym, _ = _quantize_stage(tmp_path / "asym", *(_gptq_case(tmp_path / "asym", n=64)[:2]), sym=False)
    with pytest.raises(qnn.QnnError, match="quantize.sym=true"):
        qnn.requantize_weights(rounded, tmp_path / "f.onnx", ckpt, cal, codes_from=asym)


def test_gptq_codes_replace_the_rounded_int8_weights_on_the_same_grid(tmp_path):
    """w8a16's codes from GPTQ (pack.qnn_weight_method=gptq): the graph weight found by content in the
    checkpoint, its Hessian from the calibrate stage's files; the same per-channel grid, a smaller output
    error on the calibration inputs than ONNX Runtime's rounding, and the HTP still takes it."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import numpy_helper

    n = 64
    ckpt, cal, samples = _gptq_case(tmp_path, n=n, runs=False)
    q = tmp_path / "q.onnx"
    qnn.qdq_quantize(tmp_path / "f.onnx", q, samples, "w8a16", {})
    rounded = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(q)).graph.initializer}
    # as the pack's graphs are: their weights in q.onnx.data, which the new codes must replace, not follow
    onnx.save(onnx.load(str(q)), str(q), save_as_external_data=True, all_tensors_to_one_file=True,
              location="q.onnx.data", size_threshold=0)
    facts = qnn.requantize_weights(q, tmp_path / "f.onnx", ckpt, cal)
    assert _external_bytes(q) == (tmp_path / "q.onnx.data").stat().st_size  # no dead bytes left in front
    assert facts["method"] == "gptq" and facts["weights"] == 1 and facts["rounded"] == 0
    assert facts["output_error_db_gain"]["min"] > 0.5, facts
    after = {i.name: numpy_helper.to_array(i) for i in qnn_load(q).graph.initializer}
    assert after["w_quantized"].dtype == np.int8 and after["w_scale"].shape == (n,)
    assert not np.array_equal(after["w_quantized"], rounded["w_quantized"])
    assert qnn.weight_scales(q) == {"w_quantized": n}

    ref = ort.InferenceSession(str(tmp_path / "f.onnx"), providers=["CPUExecutionProvider"])

    def err(model):
        s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        return sum(float(((ref.run(None, f)[0] - s.run(None, f)[0]) ** 2).sum()) for f in samples)

    qnn.qdq_quantize(tmp_path / "f.onnx", tmp_path / "r.onnx", samples, "w8a16", {})
    assert err(q) < err(tmp_path / "r.onnx")
    if qnn.missing() is None:
        qnn.compile_context(q, tmp_path / "ctx", S25, "w8a16")


def test_the_calibration_spill_is_checked_against_free_disk_before_it_starts(tmp_path, monkeypatch):
    """The pack's QDQ samples (each a decode step's whole input, KV caches included) are sized before any
    is decoded: on a disk too small the stage stops at once, naming the bytes needed and free."""
    import shutil

    feed = {"past_key_0": np.zeros((1, 2, 511, 256), np.float32), "position": np.zeros(1, np.int64)}
    need = 256 * (2 * 511 * 256 * 4 + 8)
    assert qnn.spill_space(256, feed, tmp_path) == need
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - need // 2, need // 2))
    with pytest.raises(qnn.QnnError, match=r"spills 0\.3 GB of samples to .*, 0\.1 GB free"):
        qnn.spill_space(256, feed, tmp_path)
    # The fix it names is one that lowers the spill: with one whole-context sequence (a 1.5B build at
    # context 1024: 15.0 GB), a lower step budget changes nothing (calibration_plan never goes below one).
    assert qnn.calibration_plan(1024, 4, 256) == qnn.calibration_plan(1024, 4, 1024) == 1
    assert "raise pack.qnn_calibration_stride (now 4" in qnn.spill_fix(1, 1024, 1024, 4)
    assert "lower pack.qnn_calibration_steps (now 1024: 4 sequences of 256" in qnn.spill_fix(4, 256, 1024, 4)


def _external_bytes(path) -> int:
    """The bytes a graph's initializers take in its external data file."""
    import onnx

    total = 0
    for i in onnx.load(str(path), load_external_data=False).graph.initializer:
        if i.data_location == onnx.TensorProto.EXTERNAL:
            total += int({e.key: e.value for e in i.external_data}["length"])
    return total


def qnn_load(path):
    from pipeline.sources.tensorfile import load_onnx

    return load_onnx(path)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_embedding_lookup_returns_the_rows_its_recorded_snr_was_measured_on(tmp_path, bits):
    """The phone's CPU lookup (pack.qnn_embedding): ONNX Runtime's GatherBlockQuantized gives exactly the
    rows whose SNR the pack records, both widths are measured, and a table already on Q8_0's grid (a
    GGUF-origin one, Gemma 3 270M's) comes back bit for bit at 8 bits."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(1)
    table = rng.standard_normal((300, 64)).astype(np.float32)
    facts = qnn.write_embedding(table, tmp_path / "e", bits, [1, 1])
    assert facts["bits"] == bits and set(facts["options"]) == {"int8", "int4"}
    assert facts["options"]["int8"]["snr_db"] > 40 > facts["options"]["int4"]["snr_db"] > 15
    s = ort.InferenceSession(str(tmp_path / "e" / "model.onnx"), providers=["CPUExecutionProvider"])
    rows = np.concatenate([s.run(None, {"input_ids": np.array([[t]], np.int64)})[0][0] for t in range(300)])
    err = float(np.sum((rows.astype(np.float64) - table) ** 2))
    assert 10 * np.log10(float(np.sum(table.astype(np.float64) ** 2)) / err) == pytest.approx(facts["snr_db"], abs=0.01)
    # on the grid: int8 codes times fp16 block scales that fp16 holds exactly
    codes = rng.integers(-127, 128, (300, 64)).astype(np.float32)
    codes[:, ::32] = 127  # every block's absmax is 127 codes, as Q8_0 writes them
    scales = np.repeat((2.0 ** -rng.integers(6, 10, (300, 2))).astype(np.float32), 32, axis=1)
    on_grid = codes * scales
    if bits == 8:
        qnn.write_embedding(on_grid, tmp_path / "g", 8, [1, 1])
        g = ort.InferenceSession(str(tmp_path / "g" / "model.onnx"), providers=["CPUExecutionProvider"])
        got = np.concatenate([g.run(None, {"input_ids": np.array([[t]], np.int64)})[0][0] for t in range(300)])
        assert np.array_equal(got, on_grid)


def test_weight_overrides_name_every_matmul_weight_and_refuse_an_unknown_granularity(tmp_path):
    model, _ = _outlier_decoder(tmp_path)
    o = qnn.weight_overrides(model, "w8a16", "per_channel")
    assert set(o) == {"w1", "w2"} and all(v[0]["axis"] == 1 and v[0]["symmetric"] for v in o.values())
    assert qnn.weight_overrides(model, "w8a16", "per_tensor") == {}
    with pytest.raises(ValueError, match="pack.qnn_weights"):
        qnn.weight_overrides(model, "w8a16", "per_row")


def _tiny_matmul(tmp_path, rng):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = rng.standard_normal((32, 16)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y],
                          [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]), str(tmp_path / "f.onnx"))
    return tmp_path / "f.onnx"


def test_qdq_calibration_streams_its_samples_one_at_a_time(tmp_path):
    """A real model's sample is ~22 MB (its KV caches): they are made as the
    calibrator asks for them and dropped after, never all held."""
    import gc
    import weakref

    rng = np.random.default_rng(1)
    model = _tiny_matmul(tmp_path, rng)
    alive = []
    most = [0]

    def samples():
        for _ in range(40):
            gc.collect()
            most[0] = max(most[0], sum(r() is not None for r in alive))
            x = rng.standard_normal((1, 32)).astype(np.float32)
            alive.append(weakref.ref(x))
            yield {"x": x}

    facts = qnn.qdq_quantize(model, tmp_path / "q.onnx", samples(), "w8a16", {})
    assert facts["samples"] == 40 and facts["streamed"]
    assert most[0] <= 2, f"{most[0]} calibration samples were alive at once"


def test_qdq_calibration_with_no_samples_is_a_failure(tmp_path):
    model = _tiny_matmul(tmp_path, np.random.default_rng(2))
    with pytest.raises(qnn.QnnError, match="no samples"):
        qnn.qdq_quantize(model, tmp_path / "q.onnx", iter(()), "w8a16", {})


def test_calibration_steps_are_bounded_by_whole_context_sequences():
    # Gemma 3 270M: a 1024 context, 4 sequences asked, 1024 steps: one whole context (past its 512 window).
    assert qnn.calibration_plan(1024, 4, 1024) == 1
    # The embedded model's short context keeps all four.
    assert qnn.calibration_plan(256, 4, 1024) == 4
    # A budget under one context still runs one whole sequence; never more than asked.
    assert qnn.calibration_plan(4096, 4, 1024) == 1
    assert qnn.calibration_plan(64, 4, 10_000) == 4


def test_decode_samples_is_lazy_and_samples_every_stride_th_step():
    class Dec:
        def __init__(self):
            self.position, self.steps = 0, []

        def reset(self):
            self.position = 0

        def next_inputs(self, tok):
            return {"tok": tok, "pos": self.position}

        def step(self, tok):
            self.steps.append(tok)
            self.position += 1

    dec = Dec()
    gen = qnn.decode_samples(dec, [[1, 2, 3, 4, 5], [6, 7, 8]], 2)
    assert dec.steps == []  # nothing decoded before a sample is asked for
    got = list(gen)
    assert [(s["tok"], s["pos"]) for s in got] == [(1, 0), (3, 2), (5, 4), (6, 0), (8, 2)]
    assert dec.steps == [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.mark.slow
@pytest.mark.optional
@needs_qnn
def test_a_prompt_graph_the_htp_refuses_leaves_that_precision_token_by_token(phone_build, tmp_path, monkeypatch):
    """compile_qnn on the tiny phone build's pack, the HTP made to refuse w8a16's prompt graph (as it refuses
    Gemma 3 270M's at 128 tokens: QNN_COMMON_ERROR_MEM_ALLOC): the build goes on, w8a16 ships its token
    graph alone with the reason in qnn.json, fp16 keeps its prompt graph, and nothing of the refused one
    is left in the folder."""
    from stages import compile_qnn

    repo, _ = phone_build
    pack = repo / "artifacts" / "galaxy_s25-embedded-speed" / "pack"
    real = qnn.compile_parts
    q = json.loads((pack / "npu.json").read_text())["deployed"]  # the QDQ precision pack chose
    assert q != "fp16"

    seen = {}  # the provider options each prompt graph was compiled with

    def refusing(graph, float_graph, out_dir, target, precision, progress=lambda _: None, options=None, ranges=None):
        if graph.name == "prompt.onnx":
            seen[precision] = options
        if precision == q and graph.name == "prompt.onnx":
            (out_dir / "part0").mkdir(parents=True)  # what a failed compile leaves behind
            raise qnn.QnnError(f"QNN HTP (SM8750, v79) refused the {q} graph: QNN_COMMON_ERROR_MEM_ALLOC")
        return real(graph, float_graph, out_dir, target, precision, progress, options, ranges)

    monkeypatch.setattr(qnn, "compile_parts", refusing)
    out = tmp_path / "out"
    out.mkdir()
    lines = []
    ctx = StageContext(stage="compile_qnn", build="b", inputs={"pack": pack}, out=out,
                       cfg=OmegaConf.create({"device": {"name": "galaxy_s25", "accelerator": "qnn_htp",
                                                        "qnn": {**S25, "max_graph_bytes": 500000}}}))
    monkeypatch.setattr(ctx, "log", lines.append)
    info = compile_qnn.run(ctx)
    assert "prompt" not in info["compiled"][q] and "MEM_ALLOC" in info["compiled"][q]["prompt_refused"]
    assert info["compiled"]["fp16"]["prompt"]["tokens"] == 16 and not (out / q / "prompt").exists()
    assert any(x.startswith(f"warning: {q}: the HTP refused its prompt graph") for x in lines), lines
    # both compiled at QNN's highest finalization mode (the default mode refused Gemma 3 270M's w8a16 one)
    assert seen == {q: qnn.PROMPT_COMPILE_OPTIONS, "fp16": qnn.PROMPT_COMPILE_OPTIONS}
    assert qnn.PROMPT_COMPILE_OPTIONS == {"htp_graph_finalization_optimization_mode": "3"}


@pytest.mark.slow
@pytest.mark.optional
@needs_qnn
def test_compile_qnn_stopped_midway_resumes_past_the_binaries_it_had(phone_build, tmp_path, monkeypatch):
    """compile_qnn with a journal on the tiny phone build's pack, stopped at its last binary (at 1.75B a
    prompt graph compiles for most of an hour): the rerun compiles that one only, links the others from
    the journal, and writes the same binaries and qnn.json facts as the first run's."""
    from stages import compile_qnn

    repo, _ = phone_build
    pack = repo / "artifacts" / "galaxy_s25-embedded-speed" / "pack"
    real = qnn.compile_parts
    calls = []

    def counted(graph, float_graph, out_dir, *a, **k):
        calls.append(out_dir.name)
        if stop_at and len(calls) == stop_at:
            raise KeyboardInterrupt  # the session's end, mid-compile
        return real(graph, float_graph, out_dir, *a, **k)

    monkeypatch.setattr(qnn, "compile_parts", counted)
    journal = tmp_path / ".compile_qnn.journal-k"

    def run(out):
        out.mkdir()
        return compile_qnn.run(StageContext(stage="compile_qnn", build="b", inputs={"pack": pack}, out=out,
                                            journal=journal, cfg=OmegaConf.create(
                                                {"device": {"name": "galaxy_s25", "accelerator": "qnn_htp",
                                                            "qnn": S25}})))

    stop_at = 0
    whole = run(tmp_path / "whole")
    n = len(calls)
    assert n >= 3, calls  # the deployed precision's token and prompt graphs, and fp16's at least
    shutil.rmtree(journal)
    calls.clear()
    stop_at = n
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "stopped")
    assert len(list(journal.glob("*.json"))) == n - 1 and not list(journal.glob(".*"))  # no half binary kept
    calls.clear()
    stop_at = 0
    resumed = run(tmp_path / "resumed")
    assert len(calls) == 1  # the one the stopped run had not finished

    def facts(c):  # every fact but the seconds a compile took
        if isinstance(c, dict):
            return {k: facts(v) for k, v in c.items() if k != "compile_s"}
        return [facts(v) for v in c] if isinstance(c, list) else c

    assert facts(resumed["compiled"]) == facts(whole["compiled"]) and facts(resumed["genie"]) == facts(whole["genie"])
    files = {d: sorted((str(f.relative_to(tmp_path / d)), f.stat().st_size) for f in (tmp_path / d).rglob("*")
                       if f.is_file() and f.name != "qnn.json") for d in ("whole", "resumed")}  # its seconds differ
    assert files["resumed"] == files["whole"]


def test_a_prompt_graphs_codes_are_the_token_graphs_made_once(tmp_path, monkeypatch):
    """pack passes requantize_weights a `made` dict: the token graph's call makes each weight's GPTQ codes
    and keeps them; the prompt graph's call over the same weights takes them from there (GPTQ not run again)
    and writes the same codes, scales and facts as making them again would."""
    from onnx import numpy_helper

    from pipeline.quant import gptq

    ckpt, cal, samples = _gptq_case(tmp_path)
    token, prompt, fresh = (tmp_path / f"{n}.onnx" for n in ("token", "prompt", "fresh"))
    for q in (token, prompt, fresh):
        qnn.qdq_quantize(tmp_path / "f.onnx", q, samples, "w8a16", {})
    calls = []
    real = gptq.gptq_quantize
    monkeypatch.setattr(gptq, "gptq_quantize", lambda *a, **k: calls.append(k.get("name")) or real(*a, **k))
    made = {}
    first = qnn.requantize_weights(token, tmp_path / "f.onnx", ckpt, cal, block=32, made=made)
    assert len(calls) == 1 and set(made) == {calls[0]}
    second = qnn.requantize_weights(prompt, tmp_path / "f.onnx", ckpt, cal, block=32, made=made)
    assert len(calls) == 1  # not made again
    again = qnn.requantize_weights(fresh, tmp_path / "f.onnx", ckpt, cal, block=32)
    assert len(calls) == 2 and first == second == again
    inits = [{i.name: numpy_helper.to_array(i) for i in qnn_load(m).graph.initializer} for m in (prompt, fresh)]
    assert inits[0].keys() == inits[1].keys()
    assert all(np.array_equal(inits[0][k], inits[1][k]) for k in inits[0])
    assert qnn.same_weights(token, tmp_path / "f.onnx", prompt, tmp_path / "f.onnx") == []


@pytest.mark.slow
@pytest.mark.optional
@needs_qnn
def test_the_phone_precision_is_the_first_that_meets_its_floors(phone_build, tmp_path, monkeypatch):
    """pack.qnn_select=measured (the default): each QDQ precision on the CPU EP against the fp32 export over
    held-out windows, gated by parity.artifact.qnn_<p>. w4a16 made to miss its KLD floor: it is recorded
    with its figures and the reason, not kept; w8a16, measured next, ships beside fp16 (the whole graph's
    choice: pack.qnn_mix_groups=0; per part below). Both missing with no fp16 listed: the pack fails
    naming each one's figures, before any compile."""
    from pipeline.engine.config import load_build_file
    from stages import pack

    repo, _ = phone_build
    build = repo / "artifacts" / "galaxy_s25-embedded-speed"
    full = load_build_file(repo / "builds" / "galaxy_s25-embedded-speed.yaml")
    inputs = {s: build / s for s in pack.INPUTS}

    def run(out, precisions, journal=None, **floors):
        artifact = {k: dict(v) for k, v in full["parity"]["artifact"].items()}
        for path, kv in floors.items():
            artifact[path].update(kv)
        cfg = {"pack": {**full["pack"], "qnn_precisions": precisions, "qnn_mix_groups": 0}, "device": full["device"],
               "priority": full["priority"], "parity": {"artifact": artifact}}
        out.mkdir()
        ctx = StageContext(stage="pack", build="b", inputs=inputs, out=out, cfg=OmegaConf.create(cfg), journal=journal)
        lines = []
        monkeypatch.setattr(ctx, "log", lines.append)
        return pack.run(ctx), lines

    out = tmp_path / "a"
    journal = tmp_path / ".pack.journal-k"
    _, lines = run(out, ["w4a16", "w8a16", "fp16"], journal, qnn_w4a16={"max_kld_mean": 1e-9})
    npu = json.loads((out / "npu.json").read_text())
    sel = npu["selection"]
    w4, w8 = sel["options"]["w4a16"], sel["options"]["w8a16"]
    assert w4["measured"] and not w4["passed"] and w4["missed"][0].startswith("kld_mean "), w4
    assert w4["kld_mean"] > 1e-9 and w4["tokens"] == sel["data"]["scored_tokens"] > 0
    assert w8["measured"] and w8["passed"] and w8["kld_mean"] < w4["kld_mean"], (w8, w4)
    assert sel["deployed"] == npu["deployed"] == "w8a16" and npu["precisions"] == ["w8a16", "fp16"]
    assert sel["dropped"] == ["w4a16"] and not (out / "w4a16").exists() and (out / "w8a16" / "model.onnx").is_file()
    assert any("w4a16 on the CPU EP" in x and "misses kld_mean" in x for x in lines), lines
    assert sel["options"]["mixed"] == {"measured": False, "why": "pack.qnn_mix_groups=0: the whole graph's choice only"}
    # a pack stopped after its QDQ graphs, measures and Genie form (at 1.75B an hour and ten minutes a precision,
    # half an hour the Genie form) and run again: none is made or measured twice, and what it writes is the same
    monkeypatch.setattr(pack._Selection, "_measured", lambda *a: pytest.fail("measured twice"))
    monkeypatch.setattr(pack, "_qdq_graph", lambda *a, **k: pytest.fail(f"{a[3]} quantized twice"))
    _, lines = run(tmp_path / "again", ["w4a16", "w8a16", "fp16"], journal, qnn_w4a16={"max_kld_mean": 1e-9})
    again = json.loads((tmp_path / "again" / "npu.json").read_text())
    assert again["selection"] == sel and again["graphs"] == npu["graphs"] and npu["genie"]["built"]
    assert again["genie"] == npu["genie"]  # its check against ours run again on the kept graphs: the same figures
    assert sum("kept by the run that stopped before this one" in x for x in lines) == 5, lines
    for f in ("w8a16/model.onnx", "genie/w8a16/model.onnx", "genie/w8a16/prompt.onnx", "genie/io.json"):
        assert (tmp_path / "again" / f).read_bytes() == (out / f).read_bytes(), f
    monkeypatch.undo()
    with pytest.raises(StageError, match=r"no phone precision meets .*qnn_w4a16: kld_mean .*qnn_w8a16: same_top1 "):
        run(tmp_path / "b", ["w4a16", "w8a16"], qnn_w4a16={"max_kld_mean": 1e-9},
            qnn_w8a16={"min_top1_agreement": 1.01})


@pytest.mark.slow
@pytest.mark.optional
@needs_qnn
def test_per_part_precision_keeps_w4a16_in_the_parts_where_the_whole_still_meets_its_floors(phone_build, tmp_path,
                                                                                           monkeypatch):
    """pack.qnn_mix_groups: where w4a16 misses its floors as a whole and w8a16 meets its own, each part of the
    w8a16 graph (the tiny build's 500 kB budget cuts it in two: layers 0-1, 2-3) and the head are tried at
    w4a16 with the rest at w8a16, and the units that pass alone are added while the whole meets
    parity.artifact.qnn_mixed. The figures are set per trial here (the rule is under test; what an
    assembled graph computes is tests/test_family_paths.py's): w4a16 in layers 2-3 passes, in 0-1 and in
    the head misses, so `mixed` ships with layers 2-3 at 4 bits: its MatMul weights int4 there, 8-bit in
    0-1 and the head, its prompt graph holding the same codes; compile_qnn cuts it at those parts and
    records them, the deploy profile names each part's weights, and the S25 expectation sums each layer at
    its own precision. Every trial is in npu.json."""
    import onnx

    from pipeline.engine.config import load_build_file
    from pipeline.graphs import parts
    from stages import benchmark, compile_qnn, deploy_profile, pack

    repo, _ = phone_build
    build = repo / "artifacts" / "galaxy_s25-embedded-speed"
    full = load_build_file(repo / "builds" / "galaxy_s25-embedded-speed.yaml")
    inputs = {s: build / s for s in pack.INPUTS}
    kld_of = {"w4a16": 0.5, "w8a16": 0.001, "mixed, w4a16 in layers 0-1": 0.3, "mixed, w4a16 in layers 2-3": 0.1,
              "mixed, w4a16 in the head": 0.3}
    seen = []

    def figures(self, what, model_file):
        self.data = self.data or {"scored_tokens": 62}
        seen.append(what)
        return {"tokens": 62.0, "ppl_ratio": 1.0, "kld_mean": kld_of[what], "kld_p99": 0.01, "kld_max": 0.1,
                "same_top1_pct": 99.0, "logits_snr_db": 30.0}

    monkeypatch.setattr(pack._Selection, "_figures", figures)
    cfg = {"pack": dict(full["pack"]), "device": full["device"], "priority": full["priority"],
           "parity": {"artifact": full["parity"]["artifact"]}}
    out = tmp_path / "pack"
    out.mkdir()
    lines = []
    ctx = StageContext(stage="pack", build="b", inputs=inputs, out=out, cfg=OmegaConf.create(cfg))
    monkeypatch.setattr(ctx, "log", lines.append)
    pack.run(ctx)
    npu = json.loads((out / "npu.json").read_text())
    sel, mixed = npu["selection"], npu["graphs"]["mixed"]
    assert seen == ["w4a16", "w8a16", "mixed, w4a16 in layers 0-1", "mixed, w4a16 in layers 2-3",
                    "mixed, w4a16 in the head"], seen
    assert sel["deployed"] == npu["deployed"] == "mixed" and npu["precisions"] == ["mixed", "fp16"]
    assert sel["dropped"] == ["w4a16", "w8a16"] and not (out / "w4a16").exists() and not (out / "w8a16").exists()
    groups = [{"layers": [0, 2], "precision": "w8a16"}, {"layers": [2, 4], "precision": "w4a16"}]
    assert mixed["groups"] == sel["options"]["mixed"]["groups"] == groups and mixed["parts"] == [[0, 2], [2, 4]]
    assert mixed["head"] == sel["options"]["mixed"]["head"] == "w8a16"
    w8_bytes = sel["options"]["mixed"]["w8a16_weight_bytes"]  # each trial's weights: fewer bytes than all-w8a16's
    assert all(0 < t["weight_bytes"] < w8_bytes for t in sel["options"]["mixed"]["trials"]), w8_bytes
    trials = sel["options"]["mixed"]["trials"]
    assert [(t["w4a16_layers"], t["w4a16_head"], t["passed"]) for t in trials] == [
        ([[0, 2]], False, False), ([[2, 4]], False, True), ([], True, False)], trials
    assert sel["options"]["mixed"]["kld_mean"] == 0.1
    assert any("mixed ships, w4a16 in layers 2-3, w8a16 in the rest" in x for x in lines), lines
    # on disk: each part's MatMul weights at its own precision, the prompt graph the same codes
    for graph, float_graph in (("model.onnx", "model.onnx"), ("prompt.onnx", "prompt.onnx")):
        m = onnx.load(str(out / "mixed" / graph), load_external_data=False)
        bounds = parts.boundaries(m, onnx.load(str(out / "float" / float_graph), load_external_data=False))
        eight = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
        head = [o.name for o in m.graph.output if not parts._PRESENT.match(o.name)]
        kv = [o.name for o in m.graph.output if parts._PRESENT.match(o.name) and int(o.name.split("_")[-1]) >= 2]
        for nodes, want in ((parts._part(m, 0, 2, bounds)[1], eight),
                            (parts._part_nodes(m, kv + [bounds[4]], bounds[2]), {onnx.TensorProto.INT4}),
                            (parts._part_nodes(m, head, bounds[4]), eight)):
            codes = matmul_weight_codes(m, nodes)
            assert codes and codes <= want, (graph, codes, want)
    assert qnn.same_weights(out / "mixed/model.onnx", out / "float/model.onnx", out / "mixed/prompt.onnx",
                            out / "float/prompt.onnx") == []
    # the Genie form at the same mix: assembled from its own w8a16 and w4a16 graphs over one calibration (the
    # sources removed), each part's weights at its precision, the prompt graph the same codes, decoding as ours
    # on the CPU EP fed as Genie feeds it
    g = npu["genie"]
    assert g["built"] and g["precision"] == "mixed" and g["quantize"]["groups"] == groups, g
    assert not (out / "genie" / "w8a16").exists() and not (out / "genie" / "w4a16").exists()
    assert g["against_ours"]["snr_db"] > 40.0 and g["against_ours"]["top1_agreement"] == 1.0, g["against_ours"]
    for graph in ("model.onnx", "prompt.onnx"):
        m = onnx.load(str(out / "genie" / "mixed" / graph), load_external_data=False)
        bounds = parts.boundaries(m, onnx.load(str(out / "genie" / "float" / graph), load_external_data=False))
        head = [o.name for o in m.graph.output if not parts._PRESENT.match(o.name)]
        kv = [o.name for o in m.graph.output
              if (hit := parts._PRESENT.match(o.name)) and int(hit.group(1) or hit.group(2)) >= 2]
        for nodes, want in ((parts._part(m, 0, 2, bounds)[1], eight),
                            (parts._part_nodes(m, kv + [bounds[4]], bounds[2]), {onnx.TensorProto.INT4}),
                            (parts._part_nodes(m, head, bounds[4]), eight)):
            codes = matmul_weight_codes(m, nodes)
            assert codes and codes <= want, ("genie", graph, codes, want)
    assert qnn.same_weights(out / "mixed/model.onnx", out / "float/model.onnx", out / "genie/mixed/model.onnx",
                            out / "genie/float/model.onnx") == []
    # compile_qnn: the pack's parts, one precision each, and the groups recorded
    comp = tmp_path / "compile_qnn"
    comp.mkdir()
    info = compile_qnn.run(StageContext(stage="compile_qnn", build="b", inputs={"pack": out}, out=comp,
                                        cfg=OmegaConf.create({"device": full["device"]})))
    c = info["compiled"]["mixed"]
    assert [p["layers"] for p in c["parts"]] == [[0, 2], [2, 4]] and c["groups"] == groups
    assert [p["layers"] for p in c["prompt"]["parts"]] == [[0, 2], [2, 4]]
    # the deploy profile names each part's weights; Genie's bundle lists the mixed binaries in order
    dp = tmp_path / "deploy_profile"
    dp.mkdir()
    deploy_profile.run(StageContext(stage="deploy_profile", build="b", out=dp,
                                    inputs={"untie_head": build / "untie_head", "pack": out, "compile_qnn": comp},
                                    cfg=OmegaConf.create({"device": full["device"], "export": full["export"],
                                                          "host": json.loads((build / "probe/host.json").read_text())})))
    profile = json.loads((dp / "qnn.json").read_text())
    assert profile["deployed"] == "mixed" and profile["context_binary"]["groups"] == groups
    assert [p["weights"] for p in profile["context_binary"]["parts"]] == ["w8a16", ["w4a16", "w8a16"]]
    bins = json.loads((dp / "genie_config.json").read_text())["dialog"]["engine"]["model"]["binary"]["ctx-bins"]
    # the Genie form's binaries at the mix, cut at the same parts: the token graph's, then its prompt graph's
    assert info["genie"]["precision"] == "mixed" and [p["layers"] for p in info["genie"]["parts"]] == [[0, 2], [2, 4]]
    assert [b.split("/")[-4:-1] for b in bins] == [["genie", "mixed", "part0"], ["genie", "mixed", "part1"],
                                                   ["mixed", "prompt", "part0"], ["mixed", "prompt", "part1"]], bins
    layers = [{"type": "sliding_attention"}, {"type": "full_attention"}] * 2
    each = benchmark.layer_precisions(info, "mixed", 4)
    assert each == ["w8a16", "w8a16", "w4a16", "w4a16"]
    ms = benchmark.expected_device_ms("SM8750", layers, each, 64)["step_ms"]
    table = benchmark.S25_LAYER_MS
    assert ms == pytest.approx(table["sliding_attention"]["w8a16"] + table["full_attention"][1024]["w8a16"]
                               + table["sliding_attention"]["w4a16"] + table["full_attention"][1024]["w4a16"], abs=1e-3)
