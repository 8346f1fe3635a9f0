"""The KV planner on the field notes' 1.7B hybrid geometry."""

from __future__ import annotations

import pytest

from pipeline.sources.kv_budget import kv_budget

# 28 layers (21 sliding, window 512 + 7 full), K,V x 512 values x 2 bytes = 56 KiB/token.
SPARK = {
    "num_hidden_layers": 28,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 7,
}


def test_flat_rate_is_56_kib_per_token():
    kv = kv_budget(SPARK, 32768)
    assert kv["bytes_per_token_flat"] == 56 * 1024
    assert kv["flat_bytes"] == 56 * 1024 * 32768


def test_per_layer_type_is_3_8x_smaller_at_32k():
    kv = kv_budget(SPARK, 32768)
    # 7 x 32768 + 21 x 512 against 28 x 32768
    assert kv["per_layer_type_bytes"] == (7 * 32768 + 21 * 512) * 2 * 512 * 2
    assert round(kv["flat_over_per_layer_type"], 1) == 3.8


def test_headroom_block_rounding_and_window_rounding():
    cfg = dict(SPARK, sliding_window=500)
    kv = kv_budget(cfg, 1000, block_size=16)
    assert kv["context_length"] == 1000
    ctx_tokens, win_tokens = 1008, 512  # both rounded up to the block
    per = 2 * 2 * 256 * 2
    assert kv["flat_bytes"] == 28 * ctx_tokens * per
    assert kv["per_layer_type_bytes"] == (7 * ctx_tokens + 21 * win_tokens) * per
    assert kv["kv_cache_memory_bytes"] == int(kv["flat_bytes"] * 1.25)


def test_sliding_window_without_layer_types_is_charged_flat():
    cfg = {k: v for k, v in SPARK.items() if k != "layer_types"}
    kv = kv_budget(cfg, 4096)
    assert kv["per_layer_type_bytes"] == kv["flat_bytes"]
    assert "charged flat" in kv["basis"]


def test_window_longer_than_context_is_capped():
    kv = kv_budget(SPARK, 256)
    assert kv["per_layer_type_bytes"] == kv["flat_bytes"]


def test_nested_text_config_and_bad_input():
    assert kv_budget({"text_config": SPARK}, 64)["flat_bytes"] == kv_budget(SPARK, 64)["flat_bytes"]
    with pytest.raises(ValueError):
        kv_budget(SPARK, 0)
    with pytest.raises(ValueError):
        kv_budget(dict(SPARK, layer_types=["full_attention"]), 64)


# --------------------------------------------------------------------------
# which layers slide follows the family (pipeline/sources/families.py), as config.json is read
# --------------------------------------------------------------------------

# Mistral-7B-v0.1's config.json: a 4096 window and no layer_types map (every layer slides).
MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "head_dim": 128,
           "sliding_window": 4096, "max_position_embeddings": 32768}
# Gemma 2 2B's config.json (no layer_types: transformers alternates sliding / full, sliding first).
GEMMA2 = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 26,
          "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 2304, "head_dim": 256,
          "sliding_window": 4096, "max_position_embeddings": 8192}
# A Qwen2.5 config.json: a sliding_window with use_sliding_window false (here smaller than the context,
# so charging it would show).
QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896, "sliding_window": 1024,
         "use_sliding_window": False, "max_window_layers": 21, "max_position_embeddings": 32768}


def test_mistral_every_layer_is_charged_its_window():
    kv = kv_budget(MISTRAL, 32768)
    per = 2 * 8 * 128 * 2
    assert kv["bytes_per_token_flat"] == 32 * per
    assert kv["per_layer_type_bytes"] == 32 * 4096 * per  # the window on all 32 layers: 8x under flat
    assert kv["flat_over_per_layer_type"] == 8.0
    assert kv["basis"].startswith("32 sliding (window 4096) + 0 full")
    assert kv_budget(MISTRAL, 2048)["per_layer_type_bytes"] == kv_budget(MISTRAL, 2048)["flat_bytes"]


def test_gemma2_alternates_without_a_layer_types_map():
    kv = kv_budget(GEMMA2, 8192)
    per = 2 * 4 * 256 * 2
    assert kv["per_layer_type_bytes"] == (13 * 4096 + 13 * 8192) * per
    assert kv["basis"].startswith("13 sliding (window 4096) + 13 full")


def test_qwen2s_unused_window_is_charged_as_full_attention():
    kv = kv_budget(QWEN2, 4096)
    assert kv["per_layer_type_bytes"] == kv["flat_bytes"] == 24 * 4096 * 2 * 2 * 64 * 2
    assert "sliding_window is unused" in kv["basis"]
    on = dict(QWEN2, use_sliding_window=True)  # turned on: layers from max_window_layers on slide
    assert kv_budget(on, 4096)["per_layer_type_bytes"] == (21 * 4096 + 3 * 1024) * 2 * 2 * 64 * 2


def test_vllm_charges_every_mistral_layer_as_a_sliding_one():
    from pipeline.sources.kv_budget import vllm_kv_bytes

    # vLLM's LlamaAttention passes a per-layer window only from layer_types; without the map its Attention
    # takes the model's window (cache_config.sliding_window) on every layer: one group of 32 sliding layers.
    kv = vllm_kv_bytes(MISTRAL, 32768, block_size=128, max_num_batched_tokens=2048)
    assert kv["groups"] == {"sliding_attention": 1} and kv["group_size"] == 32
    assert kv["blocks_per_request"] == -(-(4095 + 2048) // 128) + 1  # 49, not 32768 / 128 = 256
    # inside the window a sliding layer holds one block more than a full one: the budget must cover it
    short = vllm_kv_bytes(MISTRAL, 256, block_size=128, max_num_batched_tokens=2048)
    assert short["blocks_per_request"] == 256 // 128 + 1
    qwen = vllm_kv_bytes(QWEN2, 4096, block_size=128, max_num_batched_tokens=2048)
    assert qwen["groups"] == {"full_attention": 1} and qwen["blocks_per_request"] == 4096 // 128
    # a config of no known family, window but no map: each layer charged the larger of the two rules
    unknown = {k: v for k, v in MISTRAL.items() if k != "model_type"}
    assert vllm_kv_bytes(unknown, 32768, block_size=128, max_num_batched_tokens=2048)["blocks_per_request"] == 256
    assert vllm_kv_bytes(unknown, 256, block_size=128, max_num_batched_tokens=2048)["blocks_per_request"] == 3


def test_the_kv_a_decode_step_reads_stops_at_each_sliding_layers_window():
    """The roofline's KV term: full layers read every cached position, a sliding layer at most its window,
    in the arm's KV width; Qwen2's unused window reads everything, Gemma 2 alternates."""
    from pipeline.sources.kv_budget import kv_read_bytes

    per = 2 * 4 * 256  # K and V, 4 KV heads of 256: entries a position, before the width
    assert kv_read_bytes(GEMMA2, 100, 2) == 26 * 100 * per * 2  # inside the window: every layer reads 100
    assert kv_read_bytes(GEMMA2, 8000, 2) == (13 * 4096 + 13 * 8000) * per * 2
    assert kv_read_bytes(GEMMA2, 8000, 4) == 2 * kv_read_bytes(GEMMA2, 8000, 2)
    assert kv_read_bytes(MISTRAL, 9000, 2) == 32 * 4096 * 2 * 8 * 128 * 2
    assert kv_read_bytes(QWEN2, 9000, 2) == 24 * 9000 * 2 * 2 * 64 * 2
