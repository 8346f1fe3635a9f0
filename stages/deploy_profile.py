"""deploy_profile: what the device's runtime starts from, unchanged.

Per weight path (pack's weight_path.json):
- w4a8_gptq_vllm: `vllm.yaml`, long-form `vllm serve` arguments (`vllm serve
  --config vllm.yaml`, run from this folder), and `env.sh` with the thread
  binding and preloads (sourced first: vLLM reads them from the environment).
  `kv-cache-memory-bytes` is sized from the model, never the engine's 1 GiB
  minimum (pipeline/kv_budget.py says why and how).
- w4_ort_matmulnbits: `onnxruntime.json`: the session options, the graph, its
  I/O and each layer's KV buffer. Threads and spinning are chosen by a short
  measured sweep when this host is the target device (pipeline/tune.py; the
  candidates' spreads and the host fingerprint are recorded), else taken from
  the device config, saying so. The MatMulNBits accuracy level is the pack
  stage's (`pack.ort_accuracy_level`), the one verify_parity measured: a
  faster level would be an unverified artifact.
- w4a16_tinygemm: `torch.json`: threads, the prefill mode and the loader.
- qnn_graph (phone NPU): `qnn.json`: the deployed context binary and the
  other compiled precisions, the QNN EP's provider and session options (CPU
  fallback disabled), every input and output with shape and dtype, the KV
  layout per layer type with the ring-slot rule, the runtime it is for and
  the QNN SDK version the binaries need.
- every path: `profile.json` with the above, the KV budget (flat and
  per-layer-type) and the weight path's rationale.
"""

from __future__ import annotations

import json

import yaml

READS = ("device", "export", "host")
INPUTS = ("untie_head", "pack", "compile_qnn")
TOOLCHAIN = ("pyyaml", "onnxruntime")
SWEEP_PROMPT, SWEEP_DECODE, SWEEP_ROUNDS = 32, 48, 5

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


def _tune(ctx, device, host, pack_dir, max_len: int) -> tuple[dict, dict]:
    """(settings, evidence): measured here when this host is the target, else the device's."""
    from pipeline import tune

    fingerprint = {k: host.get(k) for k in ("cpu_model", "arch", "isa", "physical_cores", "device_class")}
    if host.get("device_class") != device.name:
        return ({"intra_op_num_threads": int(device.threads), "allow_spinning": None},
                {"measured": False, "host": fingerprint,
                 "reason": f"cross-build: this host is {host.get('device_class')}, the target {device.name}; "
                           f"threads from the device config"})
    from pipeline.gqa_graph import GqaDecoder

    settings = tune.candidates(int(host["physical_cores"]))
    # Fit the sweep inside the graph's positions (a small export.context_length).
    n_prompt = max(1, min(SWEEP_PROMPT, max_len // 4))
    n_decode = max(1, min(SWEEP_DECODE, max_len - n_prompt - 1))
    prompt = list(range(4, 4 + n_prompt))
    with ctx.progress(len(settings) * SWEEP_ROUNDS, f"runtime settings sweep, {len(settings)} candidates") as bar:
        res = tune.sweep(lambda s: GqaDecoder(pack_dir, threads=s["intra_op_num_threads"],
                                              spinning=s["allow_spinning"]),
                         settings, prompt, n_decode, rounds=SWEEP_ROUNDS, progress=lambda _: bar.advance())
    return res["chosen"], {"measured": True, "host": fingerprint, **res}


def _onnxruntime(ctx, device, host, pack_dir) -> dict:
    from pipeline.stats import fmt

    io = json.loads((pack_dir / "io.json").read_text())
    chosen, evidence = _tune(ctx, device, host, pack_dir, int(io["max_len"]))
    session = {
        "model": "../pack/model.onnx",
        "runner": "pipeline.gqa_graph.GqaDecoder (IO binding: the KV buffers bound as past and present)",
        "providers": ["CPUExecutionProvider"],
        "intra_op_num_threads": int(chosen["intra_op_num_threads"]),
        "inter_op_num_threads": 1,
        "execution_mode": "ORT_SEQUENTIAL",
        "graph_optimization_level": "ORT_ENABLE_ALL",
        "session_config": ({} if chosen["allow_spinning"] is None else
                           {"session.intra_op.allow_spinning": "1" if chosen["allow_spinning"] else "0"}),
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "kv_layout": io["layers"],
        "context_length": io["max_len"],
        "tuning": evidence,
    }
    (ctx.out / "onnxruntime.json").write_text(json.dumps(session, indent=2) + "\n")
    if evidence["measured"]:
        ctx.log(f"sweep on this host: {chosen} at {fmt(evidence['chosen_decode_tok_s'])} decode tok/s; "
                + "; ".join(f"{r['setting']['intra_op_num_threads']}t{' spin' if r['setting']['allow_spinning'] else ''} "
                            f"{fmt(r['decode_tok_s'])}" for r in evidence["candidates"]))
    else:
        ctx.log(evidence["reason"])
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


def _qnn(ctx, comp_dir) -> dict:
    info = json.loads((comp_dir / "qnn.json").read_text())
    io = json.loads((comp_dir / "io.json").read_text())
    t = info["target"]

    def variant(p):
        c = info["compiled"][p]
        return {"model": f"../compile_qnn/{c['dir']}/{c['context_model']}",
                "binaries": [f"../compile_qnn/{c['dir']}/{b}" for b in c["binaries"]], "bytes": c["bytes"]}

    sliding = [x for x in io["layers"] if x["slot_rule"] != "position"]
    profile = {
        "runtime": "onnxruntime-qnn (ONNX Runtime with the QNN execution provider, HTP backend)",
        "qnn_sdk": info["qnn_sdk"],
        "target": t,
        "deployed": info["deployed"],
        "context_binary": variant(info["deployed"]),
        "variants": {p: variant(p) for p in info["precisions"]},
        "provider": {"name": "QNNExecutionProvider", "register": "register_execution_provider_library, then "
                     "add_provider_for_devices (the providers=[...] form silently runs on the CPU)",
                     "options": {"backend_path": "libQnnHtp.so", "htp_arch": str(t["htp_arch"]).lstrip("vV"),
                                 "soc_model": str(t["soc_id"])},
                     "fp16_option": {"enable_htp_fp16_precision": "1"}},
        "session_config": {"session.disable_cpu_ep_fallback": "1"},
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "kv_layout": io["layers"],
        "slot_rules": {
            "full_attention": "write new_key_i / new_value_i into slot `position` of past_key_i / past_value_i",
            "sliding_attention": ("a ring of window-1 entries: write the new entry into slot position mod (window-1)"
                                  " (position >= 0, so the modulo is non-negative); never reorder: each key carries"
                                  " its own rotary phase and the graph masks unwritten slots")
            if sliding else None,
        },
        "context_length": io["context_length"],
        "tokenizer": "../compile_qnn/tokenizer.json",
    }
    (ctx.out / "qnn.json").write_text(json.dumps(profile, indent=2) + "\n")
    ctx.log(f"QNN profile: {info['deployed']} context binary for {t['soc_model']} (HTP {t['htp_arch']}), "
            f"QNN SDK {info['qnn_sdk']}, {len(io['layers'])} KV layers ({len(sliding)} ring)")
    return {"runtime": "onnxruntime-qnn", "files": ["qnn.json"], "qnn": profile}


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
        from omegaconf import OmegaConf

        detail = _onnxruntime(ctx, device, OmegaConf.to_container(ctx.cfg.host), pack_dir)
    elif path == "w4a16_tinygemm":
        detail = _torch(ctx, device, pack_dir)
    elif path == "qnn_graph":
        detail = _qnn(ctx, ctx.inputs["compile_qnn"])
    else:
        detail = {"runtime": sel.get("runtime"), "files": [],
                  "note": f"{path}: no runtime profile for this path yet (the GPU is unverified)"}
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
