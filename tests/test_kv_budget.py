"""The KV planner on the field notes' 1.7B hybrid geometry."""

from __future__ import annotations

import pytest

from pipeline.runtimes.kv_budget import kv_budget

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
