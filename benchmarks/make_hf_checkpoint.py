"""Write a Qwen3- or Llama-shaped checkpoint of a realistic size (random init,
seeded) so the pipeline can benchmark it without a download:

    python benchmarks/make_hf_checkpoint.py --tokenizer-from artifacts/<build>/untie_head --out /tmp/qwen3-100m
    python -m pipeline model=hf model.path=/tmp/qwen3-100m device=x86_avx512
    # a ~135M Llama-family shape with a tied head (SmolLM-135M's: 30 x 576, vocab 49,152)
    python benchmarks/make_hf_checkpoint.py --family llama --tie --layers 30 --hidden 576 --intermediate 1536 \
        --heads 9 --kv-heads 3 --head-dim 64 --vocab 49152 --tokenizer-from DIR --out /tmp/llama-135m

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
    p.add_argument("--family", choices=("qwen3", "llama"), default="qwen3")
    p.add_argument("--vocab", type=int, default=None,
                   help="embedding rows (default: the tokenizer's); more rows than the tokenizer has size the "
                        "table and the head as a real vocabulary does, its ids stay the tokenizer's")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    src = a.tokenizer_from
    src_cfg = json.loads((src / "config.json").read_text())
    if not (src / "tokenizer.model").is_file() and not (src / "tokenizer.json").is_file():
        print(f"error: no tokenizer.model or tokenizer.json in {src}", file=sys.stderr)
        return 2
    if a.out.exists() and any(a.out.iterdir()):
        print(f"error: {a.out} exists and is not empty", file=sys.stderr)
        return 2
    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if a.family == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    vocab = int(a.vocab or src_cfg["vocab_size"])
    if vocab < int(src_cfg["vocab_size"]):
        print(f"error: --vocab {vocab} is below the tokenizer's {src_cfg['vocab_size']}", file=sys.stderr)
        return 2
    cfg = config_cls(
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
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, a.out / name)
    print(f"{a.out}: {model_cls.__name__}, {n:,} parameters ({n / 1e6:.1f}M), {a.layers} layers, hidden {a.hidden}, "
          f"vocab {cfg.vocab_size}, seed {a.seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
