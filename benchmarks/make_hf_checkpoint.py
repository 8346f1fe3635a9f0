"""Write a checkpoint of any family the tool builds (pipeline/sources/families.py), of a realistic
size (random init, seeded), so the pipeline can benchmark it without a download:

    python benchmarks/make_hf_checkpoint.py --tokenizer-from artifacts/<build>/untie_head --out /tmp/qwen3-100m
    python -m pipeline model=hf model.path=/tmp/qwen3-100m device=x86_avx512
    # a ~135M Llama-family shape with a tied head (SmolLM-135M's: 30 x 576, vocab 49,152)
    python benchmarks/make_hf_checkpoint.py --family llama --tie --layers 30 --hidden 576 --intermediate 1536 \
        --heads 9 --kv-heads 3 --head-dim 64 --vocab 49152 --tokenizer-from DIR --out /tmp/llama-135m
    # the field notes' 1.7B geometry in a Gemma 3 config (~1.75B parameters, bf16 as Gemma ships: 3.5 GB):
    # 28 layers, a 512-token sliding window on 3 of every 4 (21 sliding, 7 full), GEGLU 2048 -> 6656,
    # 8 heads and 2 KV heads of head_dim 256, vocabulary 151,936, tied head
    python benchmarks/make_hf_checkpoint.py --family gemma3 --tie --layers 28 --hidden 2048 --intermediate 6656 \
        --heads 8 --kv-heads 2 --head-dim 256 --vocab 151936 --sliding-window 512 --full-every 4 \
        --dtype bfloat16 --tokenizer-from DIR --out /tmp/gemma3-1.75b

    # Qwen2.5-0.5B's geometry (24 layers, hidden 896, 14 / 2 heads of 64, intermediate 4864, tied)
    python benchmarks/make_hf_checkpoint.py --family qwen2 --tie --layers 24 --hidden 896 --intermediate 4864 \
        --heads 14 --kv-heads 2 --head-dim 64 --vocab 151936 --max-positions 32768 --tokenizer-from DIR --out /tmp/qwen2.5-0.5b

Each family gets its releases' own settings beside the geometry (`family_settings`: Qwen2's
biases and unused window, Mistral's window on every layer, Phi-3's fused projections and LongRoPE,
Gemma 2's softcaps, SmolLM3's NoPE layers, Granite's multipliers, Llama 3's rope scaling).

The defaults (8 layers, hidden 1024, intermediate 3072, 16 heads, 8 KV heads,
head_dim 64, vocab from the tokenizer: 2048 for the embedded one) give ~105M
parameters with an untied head: the shape of the 94M model in the field notes.
Random weights decode noise, so parity and speed are meaningful, text is not.
The tokenizer (SentencePiece tokenizer.model + tokenizer.json) is copied from a
model folder the pipeline produced, with its special-token ids.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "granite")


def family_settings(family: str, *, layers: int, head_dim: int, sliding_window: int | None = None,
                    full_every: int | None = None, partial_rotary: float | None = None,
                    max_positions: int = 4096) -> dict:
    """The config keys each family's public releases set beyond the geometry (their config.json files:
    Qwen2.5, Mistral-7B, Phi-3.5-mini / Phi-4-mini, Gemma 2 2B, SmolLM3-3B, Granite 3.x 2B, Llama 3.2),
    so a random checkpoint exercises what the family's forward does differently. `sliding_window` makes
    the window small enough for a short sequence to pass it (gemma2, gemma3, mistral, qwen2)."""
    if family == "llama":  # Llama 3.2's rope scaling (rope_type llama3)
        return {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": min(8192, max_positions // 2)}}
    if family == "mistral":  # a window on every layer, no layer_types map
        return {"sliding_window": sliding_window or 4096, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 1_000_000.0}}
    if family == "qwen2":  # Qwen2.5: q/k/v biases; a sliding_window it does not use unless asked
        use = sliding_window is not None
        return {"use_sliding_window": use, "sliding_window": sliding_window or 32768,
                "max_window_layers": (layers // 2) if use else layers,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}
    if family == "qwen3":
        return {}
    if family == "gemma2":  # Gemma 2 2B: alternating sliding/full, both softcaps, query_pre_attn_scalar
        return {"sliding_window": sliding_window or 4096, "query_pre_attn_scalar": head_dim,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh",
                "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]}
    if family == "gemma3":  # Gemma 3's own settings (the 270M release's)
        every = full_every or 6
        return {"sliding_window": sliding_window or 512,
                "sliding_window_pattern": every,  # the old name of the same pattern, which older readers take
                "layer_types": ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                                for i in range(layers)],
                "query_pre_attn_scalar": head_dim, "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}
    if family == "phi3":  # Phi-3.5-mini / Phi-4-mini: LongRoPE, partial rotary (Phi-4-mini 0.75)
        factor = partial_rotary or 1.0
        n = int(head_dim * factor) // 2
        return {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": factor,
                                    "short_factor": [1.0 + 0.05 * i for i in range(n)],
                                    "long_factor": [1.0 + 0.5 * i for i in range(n)],
                                    "original_max_position_embeddings": max_positions // 4},
                # Phi3Config copies its own original_max_position_embeddings (default 4096) over the rope's
                "original_max_position_embeddings": max_positions // 4, "sliding_window": 262144}
    if family == "smollm3":  # NoPE on every fourth layer
        return {"no_rope_layer_interval": 4,
                "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
                "rope_parameters": {"rope_type": "default", "rope_theta": 2_000_000.0}}
    if family == "granite":  # Granite 3.x 2B's multipliers
        return {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 1.0 / head_dim,
                "logits_scaling": 8.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def family_config(family: str, *, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                  kv_heads: int, head_dim: int, max_positions: int = 4096, tie: bool = False,
                  bos=None, eos=None, pad=None, **settings):
    """A transformers config of `family` with this geometry and the family's release settings."""
    from transformers import AutoConfig

    model_type = "gemma3_text" if family == "gemma3" else family
    extra = family_settings(family, layers=layers, head_dim=head_dim, max_positions=max_positions, **settings)
    if family == "phi3":  # Phi3Config derives head_dim from hidden / heads
        if hidden != heads * head_dim:
            raise ValueError(f"phi3: hidden {hidden} must be heads x head_dim ({heads} x {head_dim})")
    else:
        extra["head_dim"] = head_dim
    cfg = AutoConfig.for_model(
        model_type, **extra, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tie, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=pad)
    cfg.architectures = [{"gemma3": "Gemma3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                          "gemma2": "Gemma2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                          "granite": "GraniteForCausalLM"}[family]]
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer-from", required=True, type=Path, help="a model folder with tokenizer files and config.json")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--tie", action="store_true", help="tie the head to the embedding (default: untied)")
    p.add_argument("--family", choices=FAMILIES, default="qwen3")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="gemma2/gemma3/mistral: the window (default: the release's); qwen2: turns its window on")
    p.add_argument("--full-every", type=int, default=6,
                   help="gemma3: every Nth layer attends to the whole context, the others to the window")
    p.add_argument("--partial-rotary", type=float, default=None, help="phi3: partial_rotary_factor (Phi-4-mini 0.75)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weights' dtype on disk (Gemma 3 ships bfloat16)")
    p.add_argument("--vocab", type=int, default=None,
                   help="embedding rows (default: the tokenizer's); more rows than the tokenizer has size the "
                        "table and the head as a real vocabulary does, its ids stay the tokenizer's")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    src = a.tokenizer_from
    src_cfg = json.loads((src / "config.json").read_text())
    if not (src / "tokenizer.model").is_file() and not (src / "tokenizer.json").is_file():
        print(f"error: no tokenizer.model or tokenizer.json in {src}", file=sys.stderr)
        return 2
    if a.out.exists() and any(a.out.iterdir()):
        print(f"error: {a.out} exists and is not empty", file=sys.stderr)
        return 2
    vocab = int(a.vocab or src_cfg["vocab_size"])
    if vocab < int(src_cfg["vocab_size"]):
        print(f"error: --vocab {vocab} is below the tokenizer's {src_cfg['vocab_size']}", file=sys.stderr)
        return 2
    settings = {"sliding_window": a.sliding_window} if a.family in ("gemma2", "gemma3", "mistral", "qwen2") else {}
    if a.family == "gemma3":
        settings["full_every"] = a.full_every
    if a.family == "phi3":
        settings["partial_rotary"] = a.partial_rotary
    try:
        cfg = family_config(a.family, vocab=vocab, hidden=a.hidden, intermediate=a.intermediate, layers=a.layers,
                            heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, max_positions=a.max_positions,
                            tie=a.tie, bos=src_cfg.get("bos_token_id"), eos=src_cfg.get("eos_token_id"),
                            pad=src_cfg.get("pad_token_id"), **settings)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    n = sum(t.numel() for t in model.parameters())
    if a.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size="2GB")  # sharded, as releases are
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, a.out / name)
    print(f"{a.out}: {type(model).__name__}, {n:,} parameters ({n / 1e6:.1f}M), {a.layers} layers, hidden {a.hidden}, "
          f"vocab {cfg.vocab_size}, seed {a.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
