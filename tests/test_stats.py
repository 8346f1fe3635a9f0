"""The benchmark statistics on synthetic timings (no model, no runtime): interleaving,
spread, the noise-floor rule, the context-point check, and the HTML report."""

from __future__ import annotations

import pytest

from pipeline.measure import report
from pipeline.engine.context import StageError
from pipeline.measure.stats import compare, fmt, interleave, spread


def test_interleave_runs_every_arm_once_per_pass_in_order():
    order = interleave(["a", "b", "c"], 3)
    assert [arm for _, arm in order] == ["a", "b", "c"] * 3
    assert [p for p, _ in order] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # Never A A A B B B: a drift during the run hits every arm alike.
    assert all(order[i][1] != order[i + 1][1] for i in range(len(order) - 1))


@pytest.mark.parametrize("arms,passes", [([], 3), (["a"], 0)])
def test_interleave_refuses_empty(arms, passes):
    with pytest.raises(ValueError):
        interleave(arms, passes)


def test_spread_min_median_max():
    s = spread([30.0, 10.0, 20.0, 50.0])
    assert s == {"min": 10.0, "median": 25.0, "max": 50.0, "n": 4}
    assert spread([7.0]) == {"min": 7.0, "median": 7.0, "max": 7.0, "n": 1}
    assert fmt(spread([1.0, 2.0, 3.0])) == "2.0 [1.0-3.0]"
    with pytest.raises(ValueError):
        spread([])


def test_spread_median_resists_one_outlier():
    """A 30% swing in one pass moves the median not at all."""
    s = spread([100.0, 101.0, 70.0, 99.0, 100.0])
    assert s["median"] == 100.0 and s["min"] == 70.0


@pytest.mark.parametrize(
    "a,b,higher,verdict",
    [
        ([105.0], [100.0], True, "no difference"),   # +5%: inside the 8% floor
        ([95.0], [100.0], True, "no difference"),    # -5%: inside, the other direction
        ([107.9], [100.0], True, "no difference"),
        ([110.0], [100.0], True, "better"),          # +10% throughput
        ([90.0], [100.0], True, "worse"),            # -10% throughput
        ([110.0], [100.0], False, "worse"),          # +10% memory or latency
        ([90.0], [100.0], False, "better"),          # -10% memory or latency
        ([104.0], [100.0], False, "no difference"),
    ],
)
def test_noise_floor_rule(a, b, higher, verdict):
    c = compare(a, b, 0.08, higher_is_better=higher)
    assert c["verdict"] == verdict
    assert c["ratio"] == pytest.approx(a[0] / b[0])
    assert c["noise_floor"] == 0.08


def test_noise_floor_compares_medians_not_best_passes():
    # a's best pass is 30% above b's, but the medians are within 8%: no difference.
    c = compare([130.0, 100.0, 99.0], [100.0, 101.0, 98.0], 0.08)
    assert c["verdict"] == "no difference" and c["ratio"] == pytest.approx(1.0)


def test_noise_floor_is_a_parameter():
    assert compare([105.0], [100.0], 0.02)["verdict"] == "better"
    assert compare([115.0], [100.0], 0.20)["verdict"] == "no difference"
    with pytest.raises(ValueError):
        compare([1.0], [0.0], 0.08)


def test_context_points_must_fit_the_exported_context():
    from stages.benchmark import check_context_points

    assert check_context_points([128, 32], 256, 32, 4) == [32, 128]
    assert check_context_points([], 256, 32, 4) == []
    with pytest.raises(StageError, match="context_points: 221 must be in \\[1, 220\\]"):
        check_context_points([32, 221], 256, 32, 4)
    with pytest.raises(StageError):
        check_context_points([0], 256, 32, 4)
    with pytest.raises(StageError, match="duplicates"):
        check_context_points([8, 8], 256, 32, 4)


def _s(m, lo=None, hi=None):
    return {"min": m if lo is None else lo, "median": m, "max": m if hi is None else hi, "n": 3}


def synthetic_report(on_target: bool) -> dict:
    arms = {}
    for arm, tok in (("ort_int4", 1800.0), ("onnx_fp32", 600.0), ("torch_eager_fp32", 150.0)):
        arms[arm] = {f: _s(tok, tok * 0.8, tok * 1.05) for f in ("decode_tok_s", "prefill_tok_s")}
        arms[arm].update({f: _s(1.0) for f in ("ttft_ms", "load_s", "cold_start_s", "warm_start_s", "kv_mib")})
        arms[arm].update({f: _s(100.0) for f in ("peak_rss_mib", "resident_mib")})
    mem = {f: _s(10.0) for f in ("before_load_mib", "after_load_mib", "after_run_mib", "load_delta_mib",
                                 "run_delta_mib", "anon_after_run_mib", "file_after_run_mib",
                                 "weights_file_mib", "weights_mapped_resident_mib")}
    return {
        "settings": {"prompt_length": 32, "decode_tokens": 64, "passes": 3, "threads": 2, "context_length": 256,
                     "context_decode_tokens": 32, "order": "interleaved A B A B, one process per pass"},
        "on_target": on_target,
        "device": "galaxy_s25",
        "host": {"device_class": "x86_avx512", "cpu_model": "Synthetic CPU", "isa": ["avx512f"], "physical_cores": 2},
        "notes": ["llama.cpp baseline skipped: llama-cpp-python not installed"],
        "arms": arms,
        "memory": {a: mem for a in arms},
        "context": {a: {"32": {"decode_tok_s": _s(arms[a]["decode_tok_s"]["median"], 1.0, 2000.0)},
                        "128": {"decode_tok_s": _s(arms[a]["decode_tok_s"]["median"] * 0.9)}} for a in arms},
        "artifact_arm": "ort_int4",
        "artifact_vs_eager": {"decode_tok_s": {"ratio": 12.0, "verdict": "better", "noise_floor": 0.08}},
        "artifact_vs_llamacpp": None,
    }


def test_report_renders_charts_for_every_arm():
    parity = {"artifact": {"per_prompt": [{"prompt": "The <b> function", "logits_snr_db": 38.0, "worst_step_snr_db": 28.0},
                                          {"prompt": "If", "logits_snr_db": float("inf"), "worst_step_snr_db": 30.0}]}}
    page = report.render(synthetic_report(on_target=True), parity=parity, build="b1")
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 3
    for arm in ("ort_int4", "onnx_fp32", "torch_eager_fp32"):
        assert arm in page
    assert "CROSS-MEASURED" not in page and "cross-measured" not in page
    assert "The &lt;b&gt; function" in page  # text is escaped
    assert "llama.cpp baseline skipped" in page
    assert "1800.0 [1440.0&ndash;1890.0]" in page  # spreads, not a single number


def test_report_labels_cross_measured_results():
    page = report.render(synthetic_report(on_target=False), parity=None, build="b2")
    assert "CROSS-MEASURED" in page and "(cross-measured)" in page
    assert "not galaxy_s25 figures" in page
    assert "<svg" in page and "python -m pipeline.measure.report b2" in page


def test_step_snr_series_bins_finite_values():
    from pipeline.measure.report import step_snr_series

    per = [{"step_snr_db": [40.0, 42.0, "inf", 38.0] + [30.0] * 8}, {"step_snr_db": [44.0] * 12}]
    series = step_snr_series(per, bin_steps=8)
    assert [s[0] for s in series] == [0.0, 8.0]
    first = series[0]
    assert first[2] == 30.0 and first[3] == 44.0  # min, max over prompts and steps; "inf" skipped


def test_fp32_baselines_run_in_the_first_baseline_passes_only():
    from stages.benchmark import pass_order

    arms = ["ort_int4", "onnx_fp32", "torch_eager_fp32", "llamacpp_q4_k_m"]
    order, n = pass_order(arms, 5, 2)
    assert n == 2
    runs = {a: [p for p, arm in order if arm == a] for a in arms}
    assert runs["ort_int4"] == runs["llamacpp_q4_k_m"] == [0, 1, 2, 3, 4]
    assert runs["onnx_fp32"] == runs["torch_eager_fp32"] == [0, 1]
    assert order[:4] == [(0, a) for a in arms]  # still interleaved A B A B
    assert pass_order(arms, 3, None) == ([(p, a) for p in range(3) for a in arms], 3)
    assert pass_order(arms, 1, 2)[1] == 1


def test_a_peer_its_runtime_refuses_is_skipped_and_any_other_failed_arm_fails_the_stage():
    """A peer's file its own runtime refuses on the first pass (llama.cpp on a GGUF its converter cut short)
    is a baseline not measured, named with the reason, its later passes not run; the artifact's arm failing,
    a peer failing after it has run, or a peer killed by a signal, stop the stage naming the arm."""
    import json
    import subprocess

    from stages.benchmark import pass_order, run_passes

    def proc(rc, err=""):
        return subprocess.CompletedProcess([], rc, stdout=json.dumps({"decode_tok_s": 1.0}) + "\n" if rc == 0 else "",
                                           stderr=err)

    arms = ["ort_int4", "llamacpp_q4_k_m", "ortgenai_int4"]
    order, _ = pass_order(arms, 3, None)
    calls, advanced = [], []

    def refuse_llama(arm):
        calls.append(arm)
        return proc(1, "ValueError: Failed to load model from file: x.gguf") if arm == "llamacpp_q4_k_m" else proc(0)

    runs = {a: [] for a in arms}
    dropped = run_passes(order, runs, refuse_llama, lambda **kw: advanced.append(kw["arm"]))
    assert list(dropped) == ["llamacpp_q4_k_m"] and "Failed to load model" in dropped["llamacpp_q4_k_m"]
    assert "exit 1" in dropped["llamacpp_q4_k_m"] and "baseline skipped" in dropped["llamacpp_q4_k_m"]
    assert "llamacpp_q4_k_m" not in runs and len(runs["ort_int4"]) == len(runs["ortgenai_int4"]) == 3
    assert calls.count("llamacpp_q4_k_m") == 1 and len(advanced) == len(order)  # the bar still reaches its end

    def fail(name, rc, after=0):
        seen = []

        def run_one(arm):
            seen.append(arm)
            return proc(rc, "boom") if arm == name and seen.count(arm) > after else proc(0)
        return run_one

    for name, rc, after in (("ort_int4", 1, 0), ("llamacpp_q4_k_m", 1, 1), ("ortgenai_int4", -9, 0)):
        with pytest.raises(StageError, match=f"benchmark arm {name} failed") as err:
            run_passes(order, {a: [] for a in arms}, fail(name, rc, after))
        assert "boom" in str(err.value)


def test_report_shows_each_arms_kld_statistics_and_distribution():
    import numpy as np

    from pipeline.measure import kld

    def stats(scale, seed):
        rng = np.random.default_rng(seed)
        acc = kld.Accumulator()
        base = rng.standard_normal((64, 50))
        acc.add(base, base + scale * rng.standard_normal((64, 50)), rng.integers(0, 50, 64))
        return acc.summary()

    parity = {"artifact": {"path": "w4_ort_matmulnbits", "per_prompt": [], "kld": stats(0.1, 1),
                           "peers": {"llamacpp_q4_0": {"kld": stats(0.3, 2)},
                                     "ortgenai_int4": {"skipped": "not installed"}}},
              "evaluation": {"windows": 4, "n_ctx": 32, "text": "stdlib_docstrings_heldout", "scored_tokens": 64,
                             "scored": "the second half"}}
    page = report.render(synthetic_report(on_target=True), parity=parity, build="b1")
    section = page[page.index("Perplexity and KL divergence"):]
    assert "w4_ort_matmulnbits" in section and "llamacpp_q4_0" in section and "ortgenai_int4" not in section
    assert section.count("<svg") == 1 and "KLD distribution per arm" in section
    assert f"{parity['artifact']['kld']['kld_mean']:.4f}" in section
    assert parity["artifact"]["kld"]["kld_distribution"]["100"] == parity["artifact"]["kld"]["kld_max"]


def test_the_roofline_column_is_bytes_a_token_times_speed_against_the_host():
    from pipeline.measure.roofline import arm_roofline, read_bandwidth

    row = arm_roofline(1000.0, 24_000_000, 40.0, 80.0)  # 1 GB of weights + 24 MB of KV at 40 tok/s, host 80 GB/s
    assert row == {"mb_per_token": 1024.0, "gb_s": 40.96, "of_host": 0.512}
    assert arm_roofline(None, 0, 40.0, 20.0) is None  # no weight files: no row, never a guess
    passes = read_bandwidth(2, mib=64, passes=3)
    assert len(passes) == 3 and all(0.1 < g < 10_000 for g in passes)


def _lookup_graph(folder, tied: bool) -> int:
    """A model.onnx (weights in model.onnx.data) whose table E is looked up and, `tied`, also the head's
    MatMul; W a body matmul. Returns E's bytes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    e = numpy_helper.from_array(np.ones((64, 16), np.float32), "E")
    w = numpy_helper.from_array(np.ones((16, 16), np.float32), "W")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"]), helper.make_node("MatMul", ["x", "W"], ["h"])]
    if tied:
        nodes += [helper.make_node("Transpose", ["E"], ["Et"]), helper.make_node("MatMul", ["h", "Et"], ["y"])]
    else:
        nodes += [helper.make_node("Identity", ["h"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [e, w])
    folder.mkdir()
    onnx.save(helper.make_model(g), str(folder / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)
    return 64 * 16 * 4


def test_the_roofline_leaves_out_a_table_a_token_reads_one_row_of(tmp_path):
    """An untied embedding table is read one row a token: the roofline's bytes leave it out (else an fp32
    arm's or onnxruntime-genai's own untied table read as a whole puts it above the host's bandwidth);
    a tied one is the head too, and read whole. Same for a GGUF with and without an output head of its own."""
    import numpy as np
    from gguf import GGUFWriter

    from pipeline.measure.roofline import gathered_only_bytes, read_per_token_mb

    e_bytes = _lookup_graph(tmp_path / "untied", tied=False)
    assert gathered_only_bytes(tmp_path / "untied") == e_bytes  # external data: its length, not loaded
    _lookup_graph(tmp_path / "tied", tied=True)
    assert gathered_only_bytes(tmp_path / "tied") == 0
    assert read_per_token_mb(tmp_path / "untied", 10.0) == round(10.0 - e_bytes / 1e6, 1)
    assert read_per_token_mb(tmp_path / "untied", None) is None

    for name, head in (("own_head.gguf", True), ("tied.gguf", False)):
        w = GGUFWriter(str(tmp_path / name), "llama")
        w.add_tensor("token_embd.weight", np.ones((64, 16), np.float32))
        if head:
            w.add_tensor("output.weight", np.ones((64, 16), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    assert gathered_only_bytes(tmp_path / "own_head.gguf") == 64 * 16 * 4
    assert gathered_only_bytes(tmp_path / "tied.gguf") == 0
