"""deploy_profile: what the device's runtime starts from, unchanged.

Per weight path (pack's weight_path.json):
- w4a8_gptq_vllm: `vllm.yaml`, long-form `vllm serve` arguments (`vllm serve
  --config vllm.yaml`, run from this folder), and `env.sh` with the thread
  binding and preloads (sourced first: vLLM reads them from the environment).
  `kv-cache-memory-bytes` is sized from the model, never the engine's 1 GiB
  minimum (pipeline/kv_budget.py says why and how).
- w4_ort_matmulnbits: `onnxruntime.json`: the session options, the graph, the
  decode-step I/O and each layer's KV layout and slot rule.
- w4a16_tinygemm: `torch.json`: threads, the prefill mode and the loader.
- every path: `profile.json` with the above, the KV budget (flat and
  per-layer-type) and the weight path's rationale.
"""

from __future__ import annotations

import json

import yaml

READS = ("device", "export")
INPUTS = ("untie_head", "pack")
TOOLCHAIN = ("pyyaml",)

# Thread binding and preloads doubled vLLM's CPU speed on the builders
# (field notes: 18-30 tok/s with defaults, 37-40 with both).
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _vllm(ctx, device, kv, context_length: int) -> dict:
    threads = int(device.threads)
    args = {
        "model": "../pack/gptq",
        "quantization": "gptq",
        "dtype": "bfloat16",
        "max-model-len": context_length,
        "kv-cache-memory-bytes": kv["kv_cache_memory_bytes"],
        "max-num-seqs": 1,
        "host": "127.0.0.1",
    }
    (ctx.out / "vllm.yaml").write_text(
        "# vllm serve --config vllm.yaml   (from this folder, after `source env.sh`)\n"
        + yaml.safe_dump(args, sort_keys=False)
    )
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    lines = ["# Source before `vllm serve --config vllm.yaml` (bash)."]
    lines += [f"export {k}={v}" for k, v in env.items()]
    lines += [
        "# tcmalloc + the venv's Intel OpenMP: with the binding above, doubled decode on the builders.",
        f'[ -e {TCMALLOC} ] && export LD_PRELOAD="{TCMALLOC}${{LD_PRELOAD:+:$LD_PRELOAD}}"',
        '[ -n "$VIRTUAL_ENV" ] && [ -e "$VIRTUAL_ENV/lib/libiomp5.so" ] && '
        'export LD_PRELOAD="$VIRTUAL_ENV/lib/libiomp5.so:$LD_PRELOAD"',
    ]
    (ctx.out / "env.sh").write_text("\n".join(lines) + "\n")
    return {"runtime": "vllm-cpu", "files": ["vllm.yaml", "env.sh"], "vllm_args": args, "env": env}


def _onnxruntime(ctx, device, pack_dir) -> dict:
    io = json.loads((pack_dir / "io.json").read_text())
    session = {
        "model": "../pack/model.onnx",
        "providers": ["CPUExecutionProvider"],
        "intra_op_num_threads": int(device.threads),
        "inter_op_num_threads": 1,
        "execution_mode": "ORT_SEQUENTIAL",
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "kv_layout": io["layers"],
        "context_length": io["context_length"],
    }
    (ctx.out / "onnxruntime.json").write_text(json.dumps(session, indent=2) + "\n")
    return {"runtime": "onnxruntime", "files": ["onnxruntime.json"], "session": session}


def _torch(ctx, device, pack_dir) -> dict:
    meta = json.loads((pack_dir / "tinygemm.json").read_text())
    cfg = {
        "loader": "pipeline.int4_runtime.load_tinygemm_model(pack_dir, pack_dir)",
        "pack_dir": "../pack",
        "torch_num_threads": int(device.threads),
        "activations": "bfloat16 (the tinygemm kernel is ~40x slower with fp32 activations)",
        "prefill": meta.get("prefill"),
        "prefill_threshold": meta.get("prefill_threshold"),
        "layout": meta.get("layout"),
    }
    (ctx.out / "torch.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"runtime": "torch", "files": ["torch.json"], "torch": cfg}


def run(ctx) -> dict:
    from pipeline.kv_budget import kv_budget

    device = ctx.cfg.device
    pack_dir = ctx.inputs["pack"]
    sel = json.loads((pack_dir / "weight_path.json").read_text())
    config = json.loads((ctx.inputs["untie_head"] / "config.json").read_text())
    context_length = int(ctx.cfg.export.context_length)
    kv = kv_budget(config, context_length)
    path = sel["path"]
    if path == "w4a8_gptq_vllm":
        detail = _vllm(ctx, device, kv, context_length)
    elif path == "w4_ort_matmulnbits":
        detail = _onnxruntime(ctx, device, pack_dir)
    elif path == "w4a16_tinygemm":
        detail = _torch(ctx, device, pack_dir)
    else:
        detail = {"runtime": sel.get("runtime"), "files": [],
                  "note": f"{path}: no CPU runtime profile (the phone and GPU profiles are their own stages' work)"}
    profile = {
        "device": device.name,
        "weight_path": sel,
        "kv_budget": kv,
        **detail,
    }
    (ctx.out / "profile.json").write_text(json.dumps(profile, indent=2, sort_keys=True) + "\n")
    ctx.log(
        f"{path} -> {detail['runtime']}: KV {kv['kv_cache_memory_bytes'] / 2**20:.1f} MiB flat+headroom "
        f"({kv['per_layer_type_with_headroom'] / 2**20:.1f} MiB per layer type) at {context_length} tokens"
    )
    return {"metrics": {"kv_cache_memory_bytes": kv["kv_cache_memory_bytes"],
                        "kv_per_layer_type_bytes": kv["per_layer_type_with_headroom"]},
            "runtime": detail["runtime"], "files": detail["files"]}
