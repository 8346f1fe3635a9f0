"""Write a Qwen3- or Llama-shaped checkpoint of a realistic size (random init,
seeded) so the pipeline can benchmark it without a download:

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
    p.add_argument("--family", choices=("qwen3", "llama", "gemma3"), default="qwen3")
    p.add_argument("--sliding-window", type=int, default=512, help="gemma3: the sliding layers' window")
    p.add_argument("--full-every", type=int, default=6,
                   help="gemma3: every Nth layer attends to the whole context, the others to the window")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the weights' dtype on disk (Gemma 3 ships bfloat16)")
    p.add_argument("--vocab", type=int, default=None,
                   help="embedding rows (default: the tokenizer's); more rows than the tokenizer has size the "
                        "table and the head as a real vocabulary does, its ids stay the tokenizer's")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    src = a.tokenizer_from
    src_cfg = json.loads((src / "config.json").read_text())
    if not (src / "tokenizer.model").is_file() and not (src / "tokenizer.json").is_file():
        print(f"error: no tokenizer.model or tokenizer.json in {src}", file=sys.stderr)
        return 2
    if a.out.exists() and any(a.out.iterdir()):
        print(f"error: {a.out} exists and is not empty", file=sys.stderr)
        return 2
    config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                             "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}[a.family]
    vocab = int(a.vocab or src_cfg["vocab_size"])
    if vocab < int(src_cfg["vocab_size"]):
        print(f"error: --vocab {vocab} is below the tokenizer's {src_cfg['vocab_size']}", file=sys.stderr)
        return 2
    family = {}
    if a.family == "gemma3":  # Gemma 3's own settings (the 270M release's), the geometry from the flags
        family = dict(
            sliding_window=a.sliding_window,
            sliding_window_pattern=a.full_every,  # the old name of the same pattern, which older readers take
            layer_types=["full_attention" if (i + 1) % a.full_every == 0 else "sliding_attention"
                         for i in range(a.layers)],
            query_pre_attn_scalar=a.head_dim,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        )
    cfg = config_cls(
        **family,
        vocab_size=vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=a.max_positions,
        tie_word_embeddings=a.tie,
        bos_token_id=src_cfg.get("bos_token_id"),
        eos_token_id=src_cfg.get("eos_token_id"),
        pad_token_id=src_cfg.get("pad_token_id"),
    )
    torch.manual_seed(a.seed)
    model = model_cls(cfg).eval()
    n = sum(t.numel() for t in model.parameters())
    if a.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True, max_shard_size="2GB")  # sharded, as releases are
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, a.out / name)
    print(f"{a.out}: {model_cls.__name__}, {n:,} parameters ({n / 1e6:.1f}M), {a.layers} layers, hidden {a.hidden}, "
          f"vocab {cfg.vocab_size}, seed {a.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
