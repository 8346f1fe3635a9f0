"""A GGUF file as a Hugging Face checkpoint folder (safetensors, fp32).

transformers reads GGUF (`from_pretrained(dir, gguf_file=name)`, dequantizing
every tensor), but the model it returns is marked GGUF-quantized and refuses
`save_pretrained`: measured here on Gemma 3 270M. So the dequantized weights
are moved into a model built from the same config, which saves as any
checkpoint does. What the GGUF loader (transformers 5.x integrations/ggml.py
GGUF_CONFIG_MAPPING) drops is put back from the file, as llama.cpp runs it
(each checked per family by tests/test_gguf_families.py):

- `tokenizer.ggml.add_bos_token`: the converted tokenizer.json adds no BOS,
  and Gemma without its BOS generates garbage, so the tokenizer is loaded
  with the file's own setting (its post-processor then adds it);
- `architectures`, which every later stage reads from config.json;
- Gemma 2's and Gemma 3's attention scale (query_pre_attn_scalar) as llama.cpp
  derives it, and Gemma 2's two softcaps;
- the head dim (attention.key_length) where the loader reads none (Qwen3);
- Phi-3's partial rotary (rope.dimension_count), LongRoPE (its factor tensors
  and original context) and window;
- a Mistral's window: llama.cpp writes a Mistral as the llama arch; with an
  attention.sliding_window it is built as the Mistral it is;
- Llama 3's rope scaling, read back from the rope_freqs divisors llama.cpp
  writes (or the file refused where they do not read back).

Peak memory is about three fp32 copies of the model (the loader's dequantized
tensors, its GGUF-quantized model, the saved file's buffers): 3.3 GB for
Gemma 3 270M.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.sources import families
from pipeline.sources.model_facts import gguf_metadata

# GGUF architecture -> the transformers class of its family row (families.of_gguf_arch: the rows that
# transformers' GGUF loader reads).
ARCHITECTURES = {f.gguf_arch: f.architecture for f in families.FAMILIES.values()
                 if f.gguf_source and f.model_type != "mistral"}


class GgufError(ValueError):
    """The GGUF file cannot become a checkpoint (one line)."""


def dequantize(gguf_file: Path, out: Path) -> dict:
    """Write `out` as a loadable checkpoint folder; returns facts for the manifest."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    meta = gguf_metadata([gguf_file])
    arch = meta.get("general.architecture")
    try:
        families.of_gguf_arch(arch)
    except families.FamilyError as e:
        raise GgufError(f"{gguf_file.name}: {e}") from None
    folder, name = str(gguf_file.parent), gguf_file.name
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    try:
        config = _loaded_shape(AutoConfig.from_pretrained(folder, gguf_file=name), arch, meta)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, add_bos_token=add_bos)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
        config.architectures = [ARCHITECTURES[arch]]
        config = _as_llama_cpp_runs(config, arch, meta, gguf_file)
    except (ImportError, GgufError):
        raise  # a missing package (accelerate, gguf): run_stage names it with the install command
    except Exception as e:  # transformers' GGUF loader raises many types
        raise GgufError(f"{gguf_file.name}: transformers cannot read it: {str(e).strip().splitlines()[0]}") from None
    state = loaded.state_dict()
    del loaded
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, assign=True, strict=False)
    del state
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [m for m in missing if not (tied and m == "lm_head.weight") and not m.endswith("inv_freq")]
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise GgufError(f"{gguf_file.name}: its tensors do not fill a {config.architectures[0]} ({what})")
    if tied:
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) stay on meta: they are not saved, and every
    # reader of the folder computes them anew.
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for stray in ("is_local", "local_files_only"):
        _drop_tokenizer_key(out, stray)
    return {"gguf_architecture": arch, "add_bos_token": add_bos, "gguf_file_type": meta.get("general.file_type"),
            "gguf_name": meta.get("general.name")}


def _loaded_shape(config, arch: str, meta: dict):
    """The config the loader can load the file's tensors with. transformers' qwen3 mapping reads no
    attention.key_length, and Qwen3Config's default head_dim is 128 (every Qwen3 release's, by chance);
    any other fails to load (measured: a head_dim 16 file)."""
    if arch == "llama" and getattr(config, "model_type", None) == "mistral":
        # The loader reads a llama-arch file whose general.name is exactly "mistral" as a MistralConfig,
        # then cannot map its tensors (gguf-py has no "mistral" arch: measured, "Unknown gguf model_type:
        # mistral"); it is loaded as the llama arch it is, and its window, if any, makes it a Mistral.
        from transformers import LlamaConfig

        config = LlamaConfig(**{k: v for k, v in config.to_dict().items()
                                if k not in ("model_type", "architectures", "sliding_window")})
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length and getattr(config, "head_dim", None) != int(key_length):
        config.head_dim = int(key_length)
    vocab = getattr(config, "vocab_size", None)
    pad = getattr(config, "pad_token_id", None)
    if vocab and isinstance(pad, int) and pad >= vocab:
        # A family config's default pad id past the file's vocabulary (Phi3Config's 32000) where the
        # file names none: the embedding refuses it. The file's own pad id, when it has one, is kept.
        config.pad_token_id = None
    return config


def _as_llama_cpp_runs(config, arch: str, meta: dict, gguf_file: Path):
    """The config with what the loader drops put back from the file (the module docstring)."""
    get = lambda key: meta.get(f"{arch}.{key}")  # noqa: E731
    if arch in ("gemma2", "gemma3") and get("attention.key_length"):
        # The file carries no query_pre_attn_scalar and transformers' reader fixes 256;
        # llama.cpp scales attention by 1/sqrt(key_length) (every Gemma 2 and 3 but the 27B,
        # not a target here), so the checkpoint says what llama.cpp runs.
        config.query_pre_attn_scalar = int(get("attention.key_length"))
    if arch == "gemma3":
        # llama.cpp takes every 6th layer as full unless the file has a pattern (the pack stage writes the
        # checkpoint's: gguf_q4._window_pattern); Gemma3Config's default pattern is the same every 6th.
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == config.num_hidden_layers:
            config.layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    if arch == "gemma2":
        # Gemma2Config's defaults (50, 30) are the releases', but the file's own values are what
        # llama.cpp applies (measured: softcaps 5 and 3 came back as 50 and 30).
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                setattr(config, key, float(get(key)))
    if arch == "phi3":
        _phi3_rope(config, meta, gguf_file)
    if arch == "llama" and (llama3 := _llama3_rope(config, gguf_file)) is not None:
        # Llama 3.x: llama.cpp's converter folds rope_scaling (llama3) into per-dim frequency divisors;
        # transformers' loader ignores the tensor and builds plain rotary: the slow dims turn at the
        # wrong rate, an error that grows with position (measured on tests/gguf_fixture.py's tiny
        # Llama 3.2-style file: 60 dB logits SNR over its first 26 tokens, where parity asks > 100).
        # So rope_scaling is read back from the divisors (_llama3_rope) or the file is refused.
        config.rope_parameters = llama3
    if arch == "llama" and get("attention.sliding_window"):
        # llama.cpp's converter writes MistralForCausalLM as the llama arch; the window is the one thing
        # that tells it apart, and it binds every layer (families: Mistral's row). Built as a Llama, the
        # window is lost (measured: logits 0.47 off a Mistral with an 8-token window).
        from transformers import MistralConfig

        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MistralConfig(**{**fields, "sliding_window": int(get("attention.sliding_window"))})
        config.architectures = ["MistralForCausalLM"]
    return config


def _llama3_rope(config, gguf_file: Path) -> dict | None:
    """rope_parameters (rope_type llama3) that give back the file's rope_freqs divisors; None: it has none.

    llama.cpp's convert_hf_to_gguf.py LlamaModel writes, per rotary pair of frequency f and wavelength
    w = 2 pi / f: 1 where w < old / high, `factor` where w > old / low, and between them
    1 / ((1 - s) / factor + s) with s = (old / w - low) / (high - low), which transformers'
    _compute_llama3_parameters divides inv_freq by as well. `factor` is the largest divisor; each
    divisor between the bands gives s, linear in 1 / w: s = A / w - B with A = old / (high - low),
    B = low / (high - low), which two such divisors fix. old, low and high appear only through A and B
    (the band edges are where s is 0 and 1), so low is taken as 1, every Llama 3 release's, which gives
    back their own old and high (8192 and 4). Every divisor is then recomputed and must match, else the
    file is refused (fewer than two between the bands leave A and B free: a head dim too small to
    sample the band)."""
    import math

    import gguf

    rope = dict(config.rope_parameters or {})
    theta = float(rope.get("rope_theta") or 10000.0)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    divisors = next(([float(x) for x in t.data] for t in gguf.GGUFReader(str(gguf_file)).tensors
                     if t.name == "rope_freqs.weight"), None)
    if divisors is None:
        return None
    waves = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(len(divisors))]
    factor = max(divisors)
    inner = [(w, (1 / d - 1 / factor) / (1 - 1 / factor)) for w, d in zip(waves, divisors)
             if factor > 1 and abs(d - 1) > 1e-4 and abs(d - factor) > 1e-4 * factor]
    refuse = GgufError(f"{gguf_file.name}: its rope_freqs tensor (Llama 3's rope scaling, which transformers' "
                       f"GGUF loader ignores) does not read back as rope_scaling llama3; build from the Hugging "
                       f"Face checkpoint instead: model=hf")
    if len(inner) < 2:
        raise refuse
    (w1, s1), (w2, s2) = inner[0], inner[-1]
    a = (s1 - s2) / (1 / w1 - 1 / w2)
    b = a / w1 - s1
    if a <= 0 or b <= 0:
        raise refuse
    low, span = 1.0, 1 / b  # span: high - low
    old = round(a / b)
    out = {**rope, "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
           "high_freq_factor": round(low + span, 6), "original_max_position_embeddings": old}
    span = out["high_freq_factor"] - low
    for w, d in zip(waves, divisors):
        if w < old / out["high_freq_factor"]:
            want = 1.0
        elif w > old / low:
            want = factor
        else:
            smooth = (old / w - low) / span
            want = 1 / ((1 - smooth) / factor + smooth)
        if abs(want - d) > 1e-3 * d:
            raise refuse
    return out


def _phi3_rope(config, meta: dict, gguf_file: Path) -> None:
    """Phi-3's rotary as llama.cpp runs it: rope.dimension_count of each head's dims rotated (Phi-4-mini:
    0.75 of 128), LongRoPE's short and long factors (the rope_factors_short / _long tensors llama.cpp's
    converter writes) from rope.scaling.original_context_length; transformers' phi3 mapping reads none of
    them, nor its window (attention.sliding_window)."""
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rope = dict(config.rope_parameters or {})
    dims = meta.get("phi3.rope.dimension_count")
    if dims and int(dims) != head_dim:
        rope["partial_rotary_factor"] = int(dims) / head_dim
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original:
        import gguf

        factors = {t.name: [float(x) for x in t.data] for t in gguf.GGUFReader(str(gguf_file)).tensors
                   if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
        if len(factors) == 2:
            rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                        short_factor=factors["rope_factors_short.weight"],
                        original_max_position_embeddings=int(original))
            if meta.get("phi3.rope.scaling.attn_factor"):  # the cos/sin scale llama.cpp applies, as written
                rope["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
            # Phi3Config copies its own original_max_position_embeddings over the rope's
            config.original_max_position_embeddings = int(original)
    config.rope_parameters = rope
    if meta.get("phi3.attention.sliding_window"):
        config.sliding_window = int(meta["phi3.attention.sliding_window"])


def _drop_tokenizer_key(out: Path, key: str) -> None:
    """save_pretrained records loading flags of this machine: drop them, so the
    folder is the same wherever it is built."""
    import json

    path = out / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.pop(key, None) is not None:
            path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
