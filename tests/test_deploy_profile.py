"""Deploy profiles: what each runtime starts from, sized from the model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from pipeline.runtimes.contract import Runtime
from pipeline.engine.context import StageContext
from stages import deploy_profile
from tests.conftest import StepClock

CONFIG = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "hidden_size": 256, "sliding_window": 64, "bos_token_id": 2, "eos_token_id": 1,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}


HOST = {"device_class": "x86_avx512", "cpu_model": "test cpu", "arch": "x86_64", "isa": ["avx512f"],
        "physical_cores": 2}


def run(tmp_path, path, extra_files=None, device=None, host=None, compiled=None, untie_files=None):
    """deploy_profile on faked inputs: `extra_files` in pack, `compiled` in compile_qnn (a path -> text or
    bytes), `untie_files` in untie_head beside CONFIG's config.json (which they may replace)."""
    untie, pack, out, comp = tmp_path / "untie", tmp_path / "pack", tmp_path / "out", tmp_path / "compile_qnn"
    for d in (untie, pack, out, comp):
        d.mkdir(exist_ok=True)
    for name, data in (compiled or {}).items():
        (comp / name).parent.mkdir(parents=True, exist_ok=True)
        (comp / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    (untie / "config.json").write_text(json.dumps(CONFIG))
    for name, text in (untie_files or {}).items():
        (untie / name).write_text(text)
    (pack / "weight_path.json").write_text(json.dumps({"path": path, "runtime": "x", "verified": True}))
    for name, text in (extra_files or {}).items():
        (pack / name).write_text(text)
    dev = device or {"name": "xeon_amx", "threads": 24}
    ctx = StageContext(stage="deploy_profile", build="b",
                       cfg=OmegaConf.create({"device": dev, "export": {"context_length": 256},
                                             "host": host or HOST}),
                       inputs={"untie_head": untie, "pack": pack, "compile_qnn": comp}, out=out)
    result = deploy_profile.run(ctx)
    return out, result


def test_vllm_profile_is_serve_config_with_model_sized_kv(tmp_path):
    import os
    import subprocess

    out, result = run(tmp_path, "w4a8_gptq_vllm")
    args = yaml.safe_load((out / "vllm.yaml").read_text())
    assert args["quantization"] == "gptq" and args["max-model-len"] == 256
    assert args["served-model-name"] == "b"  # an OpenAI client asks for the build by its name (the stage's build)
    dev = json.loads((out / "profile.json").read_text())["on_device"]
    assert dev["runtime"] == "vllm-cpu" and dev["needs_this_project"] is False and "vllm.yaml" in dev["files"]
    # every setting the KV budget was sized with is stated: vllm-cpu's CPU block (128, not 16)
    assert args["block-size"] == 128 and args["max-num-batched-tokens"] == 256
    # vLLM's own rule: 2 full blocks + 5 sliding layers x 3 blocks of 128 x 2 KV x 2 heads x 64 x 2 bytes,
    # x1.25 in whole blocks: far below the engine's 1 GiB default, above the 16-token figure vLLM refused
    assert args["kv-cache-memory-bytes"] == 22 * 65536 > int(6 * 256 * 2 * 2 * 64 * 2 * 1.25)
    assert all("_" not in k for k in args), "vllm serve --config takes the long-form (dashed) names"
    env = (out / "env.sh").read_text()
    assert "_ek_t=24" in env and "LD_PRELOAD" in env
    # sourced here: the device's 24 threads, or the CPUs this host has, saying so
    proc = subprocess.run(["bash", "-c", "source ./env.sh && echo $VLLM_CPU_OMP_THREADS_BIND "
                           "$VLLM_CPU_NUM_OF_RESERVED_CPU"], cwd=out, capture_output=True, text=True, check=True)
    cpus = os.cpu_count()
    assert proc.stdout.split() == [f"0-{min(24, cpus) - 1}", "0"]
    assert ("binding 0-" in proc.stderr) == (cpus < 24)
    # tcmalloc is preloaded only where the file exists: VLLM_TCMALLOC names another one, or none
    fake = tmp_path / "libtcmalloc_minimal.so.4"
    fake.write_bytes(b"")
    for tc, want in ((str(fake), str(fake)), ("none", "")):
        got = subprocess.run(["bash", "-c", "unset LD_PRELOAD VIRTUAL_ENV; source ./env.sh 2>/dev/null; "
                              "echo \"$LD_PRELOAD\""], cwd=out, capture_output=True, text=True, check=True,
                             env={**os.environ, "VLLM_TCMALLOC": tc}).stdout.strip()
        assert got == want, (tc, got)
    profile = json.loads((out / "profile.json").read_text())
    assert profile["kv_budget"]["block_size"] == 128
    assert profile["vllm_kv"]["kv_cache_memory_bytes"] == args["kv-cache-memory-bytes"]
    assert profile["kv_budget"]["per_layer_type_bytes"] < profile["kv_budget"]["flat_bytes"]
    assert result["runtime"] == "vllm-cpu"


def test_vllm_gpu_profile_states_cuda_rules_and_says_it_is_unverified(tmp_path):
    from pipeline.sources.kv_budget import vllm_kv_bytes

    gpu = {"name": "cuda_discrete", "threads": 16, "runtime": "vllm", "accelerator": "cuda"}
    (tmp_path / "gpu").mkdir()
    (tmp_path / "cpu").mkdir()
    out, result = run(tmp_path / "gpu", "model_dtype", device=gpu)
    args = yaml.safe_load((out / "vllm.yaml").read_text())
    # the checkpoint itself in bf16 (no GPTQ), vLLM's CUDA block (16, not the CPU's 128), stated
    assert args["model"] == "../untie_head" and "quantization" not in args and args["dtype"] == "bfloat16"
    assert args["block-size"] == 16 and args["max-num-batched-tokens"] == 256 and args["max-model-len"] == 256
    want = vllm_kv_bytes(CONFIG, 256, block_size=16, max_num_batched_tokens=2048)
    assert args["kv-cache-memory-bytes"] == want["kv_cache_memory_bytes"]
    cpu_out, _ = run(tmp_path / "cpu", "w4a8_gptq_vllm")
    cpu = yaml.safe_load((cpu_out / "vllm.yaml").read_text())
    assert args["kv-cache-memory-bytes"] < cpu["kv-cache-memory-bytes"]  # finer blocks: less rounding
    env = (out / "env.sh").read_text()
    assert "CUDA_VISIBLE_DEVICES" in env and "VLLM_CPU" not in env and "LD_PRELOAD" not in env
    profile = json.loads((out / "profile.json").read_text())
    assert profile["verified"] is False and profile["note"].startswith("not run: no GPU")
    assert result["runtime"] == "vllm (CUDA)"
    assert profile["on_device"]["needs_this_project"] is False and "no GPU" in profile["on_device"]["ran_here"]


IO = {"format": "edgekiln-gqa/1", "inputs": [{"name": "input_ids"}], "outputs": [{"name": "logits"}], "max_len": 256,
      "layers": [{"index": 0, "type": "sliding_attention", "cache_len": 80, "window": 64}]}


def test_a_cross_built_onnxruntime_profile_takes_the_device_threads(tmp_path):
    out, _ = run(tmp_path, "w4_ort_matmulnbits", {"io.json": json.dumps(IO)},
                 device={"name": "x86_avx2", "threads": 4})
    session = json.loads((out / "onnxruntime.json").read_text())
    assert session["intra_op_num_threads"] == 4 and session["kv_layout"][0]["cache_len"] == 80
    assert session["context_length"] == 256 and session["tuning"]["measured"] is False
    assert "cross-build" in session["tuning"]["reason"] and session["session_config"] == {}
    assert session["huge_pages"] is None  # the target's pages are not known on the builder
    assert "speculative" not in session  # a graph without row_logits: nothing to offer


def test_a_graph_with_row_logits_offers_speculative_decoding_off_by_default(tmp_path):
    rows = {"input": "logits_rows", "output": "row_logits", "default_rows": 1}
    out, _ = run(tmp_path, "w4_ort_matmulnbits", {"io.json": json.dumps({**IO, "row_logits": rows})},
                 device={"name": "x86_avx2", "threads": 4})
    spec = json.loads((out / "onnxruntime.json").read_text())["speculative"]
    assert spec["default"] == "off" and spec["enable"].startswith("--speculate")
    assert spec["graph"] == {"input": "logits_rows", "output": "row_logits"} and spec["draft_max"] >= 1


def test_a_genai_layout_graph_gets_the_onnxruntime_genai_route_and_its_command(tmp_path):
    """A genai-layout pack: the profile names ../pack as an onnxruntime-genai model and the one command
    that generates from it, overlaying the threads where they are not the genai_config's; the project's
    own layout says why there is no such route."""
    import ast
    import shlex

    genai_cfg = {"model": {"decoder": {"session_options": {"intra_op_num_threads": 2}}}}
    out, _ = run(tmp_path, "w4_ort_matmulnbits", {"io.json": json.dumps({**IO, "io_layout": "genai"}),
                                                   "genai_config.json": json.dumps(genai_cfg)},
                 device={"name": "x86_avx2", "threads": 4})
    route = json.loads((out / "onnxruntime.json").read_text())["onnxruntime_genai"]
    assert route["model"] == "../pack" and route["config"] == "../pack/genai_config.json" and route["threads"] == 4
    argv = shlex.split(route["command"])
    assert argv[:2] == ["python", "-c"] and argv[3] == "def read_file(path):"
    code = argv[2]
    ast.parse(code)  # one valid program, as the shell hands it to python
    assert "og.Config('../pack')" in code and "range(256)" in code
    overlay = code.split("c.overlay('")[1].split("')")[0]
    assert json.loads(overlay) == {"model": {"decoder": {"session_options": {"intra_op_num_threads": 4}}}}
    # profile.json says what the device needs: genai alone, the pack folder, that command
    dev = json.loads((out / "profile.json").read_text())["on_device"]
    assert dev["runtime"] == "onnxruntime-genai" and dev["needs_this_project"] is False
    assert dev["files"] == ["../pack/"] and dev["command"] == route["command"]
    from pipeline.runtimes.ortgenai import CHECKED
    import tomllib
    peers = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["peers"]
    assert CHECKED in peers and f"pip install {CHECKED}" in dev["install"]
    # beside genai, the build's own runner without the build toolchain
    alt = dev["alternative"]
    assert alt["needs_this_project"] is False and shlex.split(alt["command"])[:4] == [
        "python", "-m", "edgekiln_runtime", "../pack"]
    (tmp_path / "same").mkdir()
    same, _ = run(tmp_path / "same", "w4_ort_matmulnbits", {"io.json": json.dumps({**IO, "io_layout": "genai"}),
                                                             "genai_config.json": json.dumps(genai_cfg)},
                  device={"name": "x86_avx2", "threads": 2})
    assert "overlay" not in json.loads((same / "onnxruntime.json").read_text())["onnxruntime_genai"]["command"]
    (tmp_path / "old").mkdir()
    old, _ = run(tmp_path / "old", "w4_ort_matmulnbits", {"io.json": json.dumps(IO)}, device={"name": "x86_avx2",
                                                                                            "threads": 4})
    session = json.loads((old / "onnxruntime.json").read_text())
    assert session["onnxruntime_genai"] is None and "rebuild the pack" in session["onnxruntime_genai_why"]
    dev = json.loads((old / "profile.json").read_text())["on_device"]
    # the build's own runner, installable alone (runtime/): it runs the project's own layout too
    assert dev["runtime"].startswith("edgekiln-runtime") and dev["needs_this_project"] is False
    assert "rebuild the pack" in dev["why"] and "pip install ./runtime" in dev["install"]
    assert shlex.split(dev["command"])[:4] == ["python", "-m", "edgekiln_runtime", "../pack"]


def _word_tokenizer() -> str:
    """A tokenizer.json whose words are single ids (HEALTH_PROMPT's among them), no post-processor: whether a
    BOS is prepended is then up to the config (add_bos_token) or the family."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(deploy_profile.HEALTH_PROMPT.split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


def test_the_genai_route_carries_the_health_check_a_device_runs(tmp_path):
    """The onnxruntime-genai route's health check: health_check.py written beside the profile (the module as it
    is: the standard library and onnxruntime_genai only), and on_device.health with the command (`{python}`, run
    from the version folder), the fixed prompt's ids as genai frames them (BOS where the model uses one) and
    the 16 tokens to decode; a path without the route has no health key."""
    import ast
    import sys

    from pipeline.runtimes import health_check

    genai_cfg = {"model": {"decoder": {"session_options": {"intra_op_num_threads": 2}}}}
    words = [3 + i for i in range(len(deploy_profile.HEALTH_PROMPT.split()))]
    cases = [({"bos_token": "<s>", "add_bos_token": True}, "llama", [1] + words),  # the config asks for BOS
             ({"bos_token": "<s>"}, "llama", words),                                 # a tokenizer without one
             ({"bos_token": {"content": "<s>"}}, "gemma3", [1] + words)]             # a Gemma always has it
    for n, (tok_cfg, family, ids) in enumerate(cases):
        (tmp_path / str(n)).mkdir()
        out, result = run(tmp_path / str(n), "w4_ort_matmulnbits",
                          {"io.json": json.dumps({**IO, "io_layout": "genai", "family": family, "bos_token_id": 1}),
                           "genai_config.json": json.dumps(genai_cfg), "tokenizer.json": _word_tokenizer(),
                           "tokenizer_config.json": json.dumps(tok_cfg)},
                          device={"name": "x86_avx2", "threads": 4})
        health = json.loads((out / "profile.json").read_text())["on_device"]["health"]
        assert health["prompt_ids"] == ids, (tok_cfg, family)
    assert health["command"] == ["{python}", "deploy_profile/health_check.py", "--model", "pack",
                                 "--ids", ",".join(map(str, ids)), "--new-tokens", "16", "--threads", "4",
                                 "--runs", "3"]
    assert health["new_tokens"] == 16 and health["timeout_s"] == 300
    assert health["prompt"] == deploy_profile.HEALTH_PROMPT
    # the fixed prompt is one of the build's default parity prompts (verify_parity records its tokens)
    parity = yaml.safe_load((Path(__file__).parents[1] / "conf/parity/default.yaml").read_text())
    assert deploy_profile.HEALTH_PROMPT in parity["prompts"]
    profile = json.loads((out / "profile.json").read_text())
    assert "health" not in profile  # on_device's only
    assert profile["on_device"]["files"] == ["../pack/", "health_check.py"] and "health_check.py" in result["files"]
    script = (out / "health_check.py").read_bytes()
    assert script == Path(health_check.__file__).read_bytes()
    imported = set()
    for node in ast.walk(ast.parse(script)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__", "onnxruntime_genai"}, imported
    # the script is in the stage's keyed code (it imports it), so a changed script reruns the stage
    from pipeline.engine.codedeps import stage_code

    assert "pipeline/runtimes/health_check.py" in stage_code("deploy_profile")
    # the project's own layout has no genai route, so no health check (the agent reports "unchecked")
    (tmp_path / "old").mkdir()
    old, _ = run(tmp_path / "old", "w4_ort_matmulnbits",
                 {"io.json": json.dumps(IO), "tokenizer.json": _word_tokenizer()}, device={"name": "x86_avx2", "threads": 4})
    assert "health" not in json.loads((old / "profile.json").read_text())["on_device"]
    assert not (old / "health_check.py").exists()


def _matmulnbits_graph(level: int) -> bytes:
    """A graph with one MatMulNBits node at `level` (its attributes are all the level sweep reads)."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=32, N=8, bits=4,
                            block_size=32, accuracy_level=level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor("w", TensorProto.UINT8, [8, 1, 16], bytes(128), raw=True),
                               helper.make_tensor("s", TensorProto.FLOAT, [8], [1.0] * 8)])
    return onnx.helper.make_model(graph).SerializeToString()


def _level_of(graph_dir) -> int:
    import onnx

    node = onnx.load(str(graph_dir / "model.onnx")).graph.node[0]
    return next(a.i for a in node.attribute if a.name == "accuracy_level")


class FakeDecoder(Runtime):
    """Known speeds: 2 threads twice as fast as 1, spinning no faster; a graph at
    accuracy level `SLOW_LEVEL` three times slower."""

    SLOW_LEVEL = 1
    HUGE_PAGE_SPEEDUP = 1.0
    HUGE_PAGES_HERE = True
    FP32_KV_SPEEDUP = 1.0

    def __init__(self, pack_dir, threads, spinning, huge_pages=False):
        from pathlib import Path

        slow = 3 if _level_of(Path(pack_dir)) == FakeDecoder.SLOW_LEVEL else 1
        self.kv_dtype = json.loads((Path(pack_dir) / "io.json").read_text())["kv_dtype"]
        kv = FakeDecoder.FP32_KV_SPEEDUP if self.kv_dtype == "float32" else 1.0
        self.seconds = 0.004 / threads * slow / kv / (FakeDecoder.HUGE_PAGE_SPEEDUP if huge_pages else 1.0)

    def kv_bytes(self):
        return (4 if self.kv_dtype == "float32" else 2) * 2**20

    def reset(self):
        pass

    def step(self, token):
        import numpy as np

        StepClock.now += self.seconds

        return np.zeros(4)


def _on_target(tmp_path, monkeypatch) -> dict:
    """A level-4 GQA pack built on this (fake) host, profiled with FakeDecoder's known speeds:
    the onnxruntime.json written."""
    import edgekiln_runtime.gqa
    import edgekiln_runtime.pages
    import pipeline.measure.tune

    monkeypatch.setattr(edgekiln_runtime.gqa, "GqaDecoder", FakeDecoder)
    monkeypatch.setattr(pipeline.measure.tune, "time", StepClock)
    monkeypatch.setattr(edgekiln_runtime.pages, "support", lambda: (FakeDecoder.HUGE_PAGES_HERE, "test host"))
    monkeypatch.setattr(deploy_profile, "SWEEP_DECODE", 8)
    monkeypatch.setattr(deploy_profile, "SWEEP_PROMPT", 2)
    (tmp_path / "pack").mkdir(parents=True)
    (tmp_path / "pack" / "model.onnx").write_bytes(_matmulnbits_graph(4))
    out, _ = run(tmp_path, "w4_ort_matmulnbits", {"io.json": json.dumps({**IO, "kv_dtype": "float16"})},
                 device={"name": "x86_avx512", "threads": 1})
    return json.loads((out / "onnxruntime.json").read_text())


def test_on_the_target_the_settings_are_measured_and_recorded(tmp_path, monkeypatch):
    session = _on_target(tmp_path, monkeypatch)
    tuning = session["tuning"]
    assert tuning["measured"] and tuning["host"]["cpu_model"] == "test cpu"
    assert len(tuning["candidates"]) == 2 + 1  # 1 thread; 2 threads with and without spinning
    assert session["intra_op_num_threads"] == 2  # measured faster than the device config's 1
    assert session["session_config"] == {"session.intra_op.allow_spinning": "0"}  # spinning bought nothing
    levels = tuning["accuracy_level"]
    assert levels["deployed"] == levels["fastest"] == 4 and levels["verdict"].startswith("deployed")
    assert [c["setting"]["accuracy_level"] for c in levels["candidates"]] == [4, 1]
    assert _level_of(tmp_path / "pack") == 4  # the artifact itself is never rewritten
    kv = tuning["kv_dtype"]  # as fast in fp32: the fp16 KV, half the bytes, stays
    assert kv["deployed"] == kv["best"] == "float16" and kv["verdict"].startswith("deployed")
    assert [(c["setting"]["kv_dtype"], c["kv_mib"]) for c in kv["candidates"]] == [("float16", 2.0), ("float32", 4.0)]
    assert kv["prompt_tokens"] == 256 // 2  # a long prompt: half of this small graph's positions
    assert json.loads((tmp_path / "pack" / "io.json").read_text())["kv_dtype"] == "float16"  # never rewritten


def test_the_kv_budget_of_an_onnxruntime_build_is_in_its_graphs_kv_dtype(tmp_path, monkeypatch):
    """The profile's KV figure is the graph's own (io.json kv_dtype, fp32 by default): a 2-byte figure for a
    4-byte cache would say half of what the device holds."""
    from pipeline.sources.kv_budget import DTYPE_BYTES

    _on_target(tmp_path, monkeypatch)  # io.json: float16
    kv = json.loads((tmp_path / "out" / "profile.json").read_text())["kv_budget"]
    assert kv["kv_dtype"] == "float16"
    for d in ("pack", "out", "untie", "compile_qnn"):
        shutil.rmtree(tmp_path / d, ignore_errors=True)
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "model.onnx").write_bytes(_matmulnbits_graph(4))
    out, _ = run(tmp_path, "w4_ort_matmulnbits", {"io.json": json.dumps({**IO, "kv_dtype": "float32"})},
                 device={"name": "x86_avx512", "threads": 1})
    kv32 = json.loads((out / "profile.json").read_text())["kv_budget"]
    assert kv32["kv_dtype"] == "float32" and kv32["flat_bytes"] == kv["flat_bytes"] * DTYPE_BYTES["float32"] // 2


def test_huge_pages_are_deployed_only_when_measured_faster(tmp_path, monkeypatch):
    session = _on_target(tmp_path, monkeypatch)  # the same speed on both: the cheaper 4 KiB pages
    hp = session["tuning"]["huge_pages"]
    assert hp["measured"] and [c["setting"]["huge_pages"] for c in hp["candidates"]] == [False, True]
    assert session["huge_pages"] is False and "environment" not in session
    monkeypatch.setattr(FakeDecoder, "HUGE_PAGE_SPEEDUP", 2.0)
    session = _on_target(tmp_path / "faster", monkeypatch)
    assert session["huge_pages"] is True and session["tuning"]["huge_pages"]["chosen"] == {"huge_pages": True}
    assert session["environment"] == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_huge_pages_are_not_swept_where_the_host_has_none(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeDecoder, "HUGE_PAGES_HERE", False)
    session = _on_target(tmp_path, monkeypatch)
    assert session["huge_pages"] is False
    assert session["tuning"]["huge_pages"] == {"measured": False, "huge_pages": False, "reason": "test host"}


def test_a_faster_accuracy_level_is_recommended_not_swapped_in(tmp_path, monkeypatch):
    monkeypatch.setattr(FakeDecoder, "SLOW_LEVEL", 4)
    levels = _on_target(tmp_path, monkeypatch)["tuning"]["accuracy_level"]
    assert levels["deployed"] == 4 and levels["fastest"] == 1
    assert "rebuild with pack.ort_accuracy_level=1" in levels["verdict"]


def test_a_faster_kv_dtype_is_recommended_not_swapped_in(tmp_path, monkeypatch):
    """fp32 KV twice as fast on this (fake) target: the profile says rebuild with pack.ort_kv_dtype=float32;
    only beyond the noise floor (5% faster is no result: the fp16 KV, half the bytes, stays)."""
    monkeypatch.setattr(FakeDecoder, "FP32_KV_SPEEDUP", 2.0)
    kv = _on_target(tmp_path, monkeypatch)["tuning"]["kv_dtype"]
    assert kv["deployed"] == "float16" and kv["best"] == "float32"
    assert "rebuild with pack.ort_kv_dtype=float32" in kv["verdict"]
    monkeypatch.setattr(FakeDecoder, "FP32_KV_SPEEDUP", 1.05)
    kv = _on_target(tmp_path / "noise", monkeypatch)["tuning"]["kv_dtype"]
    assert kv["best"] == "float16" and kv["verdict"].startswith("deployed")


def test_paths_without_a_runtime_profile_write_only_the_profile(tmp_path):
    out, result = run(tmp_path, "model_dtype", device={"name": "jetson_orin", "threads": 4})
    assert sorted(p.name for p in out.iterdir()) == ["profile.json"]
    assert result["files"] == []


PHONE_IO = {"context_length": 256, "head_dim": 64, "inputs": [{"name": "input_ids", "shape": [1, 1], "dtype": "int64"},
                                              {"name": "past_key_0", "shape": [1, 2, 63, 64], "dtype": "float32"}],
            "outputs": [{"name": "logits", "shape": [1, 1, 2048], "dtype": "float32"}],
            "layers": [{"index": 0, "type": "sliding_attention", "cache_len": 63, "slot_rule": "position mod 63"},
                       {"index": 1, "type": "full_attention", "cache_len": 256, "slot_rule": "position"}]}
PHONE_QNN = {"deployed": "w8a16", "precisions": ["w8a16", "fp16"], "qnn_sdk": "2.51.0",
             "target": {"soc_model": "SM8750", "htp_arch": "v79", "soc_id": 69, "device": "galaxy_s25"},
             "compiled": {p: {"dir": p, "context_model": "model_ctx.onnx", "binaries": ["model_ctx_qnn.bin"],
                              "bytes": 10} for p in ("w8a16", "fp16")}}


def epcontext_model(graph: str = "QNNExecutionProvider_QNN_0_0", spill_fill: int = 0) -> bytes:
    """A compiled model_ctx.onnx as onnxruntime-qnn 2.7.0 writes it: one EPContext node pointing at its .bin
    (its attributes as that version writes them, read from a real compile)."""
    from onnx import TensorProto, helper

    node = helper.make_node("EPContext", ["x"], ["y"], name=graph, domain="com.microsoft", embed_mode=0,
                            main_context=1, ep_cache_context="model_ctx_qnn.bin", partition_name=graph,
                            max_size=spill_fill, source="QNNExecutionProvider")
    g = helper.make_graph([node], "ctx", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21),
                                               helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def phone_compiled(io=PHONE_IO, qnn=PHONE_QNN, spill_fill: int = 0) -> dict:
    """A compile_qnn folder's files: io.json, qnn.json and the deployed precision's compiled model."""
    c = qnn["compiled"][qnn["deployed"]]
    return {"io.json": json.dumps(io), "qnn.json": json.dumps(qnn),
            f"{c['dir']}/{c['context_model']}": epcontext_model(spill_fill=spill_fill)}


def test_a_phone_profile_names_the_binary_its_io_kv_layout_and_sdk(tmp_path):
    out, result = run(tmp_path, "qnn_graph", device={"name": "galaxy_s25", "threads": 4}, compiled=phone_compiled())
    assert result["files"] == ["qnn.json", "genie_config.json", "htp_backend_ext_config.json"]  # no tokenizer.json
    assert result["runtime"] == "onnxruntime-qnn"
    p = json.loads((out / "qnn.json").read_text())
    assert p["context_binary"] == {"model": "../compile_qnn/w8a16/model_ctx.onnx",
                                   "binaries": ["../compile_qnn/w8a16/model_ctx_qnn.bin"], "bytes": 10}
    assert set(p["variants"]) == {"w8a16", "fp16"} and p["qnn_sdk"] == "2.51.0"
    assert p["provider"]["options"] == {"backend_path": "libQnnHtp.so", "htp_arch": "79", "soc_model": "69",
                                        "enable_htp_fp16_precision": "1"}  # the QDQ graphs' float residual
    assert p["session_config"] == {"session.disable_cpu_ep_fallback": "1"}
    assert p["inputs"] == PHONE_IO["inputs"] and p["kv_layout"] == PHONE_IO["layers"]
    assert "mod (window-1)" in p["slot_rules"]["sliding_attention"]


def test_llamacpp_profile_names_the_file_threads_and_commands(tmp_path):
    info = {"file": "model.gguf", "file_type": "MOSTLY_Q4_0", "tensor_types": {"Q4_0": 43, "F16": 1},
            "converter": {"identity": "sha256:0123", "source": "test"}}
    out, result = run(tmp_path, "gguf_q4_0", {"gguf.json": json.dumps(info)},
                      device={"name": "x86_llamacpp", "threads": 4})
    prof = json.loads((out / "llama.cpp.json").read_text())
    assert result["runtime"] == "llama.cpp" and result["files"] == ["llama.cpp.json"]
    assert prof["model"] == "../pack/model.gguf" and prof["settings"]["n_threads"] == 4
    assert prof["llama_cli"].startswith("llama-cli -m ../pack/model.gguf -c 256 ") and " -t 4 " in prof["llama_cli"]
    assert prof["llama_cpp_python"] == {"model_path": "../pack/model.gguf", "n_ctx": 256, "n_batch": 256,
                                        "n_threads": 4, "n_threads_batch": 4}
    kv = prof["kv_cache_bytes_f16"]
    assert kv["sliding_layers_windowed"] < kv["every_layer_full"]
    assert "no sweep" in prof["threads_from"]
    # llama-server's draftless drafting: off (the command deployed has no --spec-type), the flags that turn it on
    spec = prof["speculative"]
    assert spec["default"] == "off" and "--spec-type" not in prof["llama_server"]
    assert spec["enable"] == prof["llama_server"].replace(" --host", " --spec-type ngram-mod --host")
    assert "benchmark" in spec["measured"] and spec["why_off"]
    dev = json.loads((out / "profile.json").read_text())["on_device"]
    assert dev == {**dev, "runtime": "llama.cpp", "files": ["../pack/model.gguf"], "command": prof["llama_server"],
                   "needs_this_project": False}
