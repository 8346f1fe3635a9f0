"""Deploy profiles: what each runtime starts from, sized from the model."""

from __future__ import annotations

import json

import yaml
from omegaconf import OmegaConf

from pipeline.context import StageContext
from stages import deploy_profile

CONFIG = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "hidden_size": 256, "sliding_window": 64,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}


def run(tmp_path, path, extra_files=None, device=None):
    untie, pack, out = tmp_path / "untie", tmp_path / "pack", tmp_path / "out"
    for d in (untie, pack, out):
        d.mkdir()
    (untie / "config.json").write_text(json.dumps(CONFIG))
    (pack / "weight_path.json").write_text(json.dumps({"path": path, "runtime": "x", "verified": True}))
    for name, text in (extra_files or {}).items():
        (pack / name).write_text(text)
    dev = device or {"name": "xeon_amx", "threads": 24}
    ctx = StageContext(stage="deploy_profile", build="b",
                       cfg=OmegaConf.create({"device": dev, "export": {"context_length": 256}}),
                       inputs={"untie_head": untie, "pack": pack}, out=out)
    result = deploy_profile.run(ctx)
    return out, result


def test_vllm_profile_is_serve_config_with_model_sized_kv(tmp_path):
    out, result = run(tmp_path, "w4a8_gptq_vllm")
    args = yaml.safe_load((out / "vllm.yaml").read_text())
    assert args["quantization"] == "gptq" and args["max-model-len"] == 256
    # 6 layers x 256 tokens x K,V x 2 heads x 64 x 2 bytes, x1.25: far below the engine's 1 GiB default
    assert args["kv-cache-memory-bytes"] == int(6 * 256 * 2 * 2 * 64 * 2 * 1.25)
    assert all("_" not in k for k in args), "vllm serve --config takes the long-form (dashed) names"
    env = (out / "env.sh").read_text()
    assert "VLLM_CPU_OMP_THREADS_BIND=0-23" in env and "LD_PRELOAD" in env
    profile = json.loads((out / "profile.json").read_text())
    assert profile["kv_budget"]["per_layer_type_bytes"] < profile["kv_budget"]["flat_bytes"]
    assert result["runtime"] == "vllm-cpu"


def test_onnxruntime_profile_carries_io_and_kv_layout(tmp_path):
    io = {"inputs": [{"name": "input_ids"}], "outputs": [{"name": "logits"}], "context_length": 256,
          "layers": [{"index": 0, "type": "sliding_attention", "cache_len": 63, "slot_rule": "position mod 63"}]}
    out, _ = run(tmp_path, "w4_ort_matmulnbits", {"io.json": json.dumps(io)},
                 device={"name": "x86_avx512", "threads": 2})
    session = json.loads((out / "onnxruntime.json").read_text())
    assert session["intra_op_num_threads"] == 2 and session["kv_layout"][0]["slot_rule"] == "position mod 63"


def test_paths_without_a_cpu_runtime_write_only_the_profile(tmp_path):
    out, result = run(tmp_path, "qnn_graph", device={"name": "galaxy_s25", "threads": 4})
    assert sorted(p.name for p in out.iterdir()) == ["profile.json"]
    assert result["files"] == []
