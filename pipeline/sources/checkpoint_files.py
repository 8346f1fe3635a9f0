"""The small files that let an artifact folder serve on its own: the model's
config and its tokenizer, copied beside the weights or graph a stage writes; and the
checkpoint itself loaded as an HF model (`load_hf_model`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def link_or_copy(src: Path, dst: Path) -> None:
    """Hardlink when on the same filesystem (checkpoints and packed weights are large), else copy."""
    import os

    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_side_files(src: Path, dst: Path, names: tuple[str, ...] = SIDE_FILES) -> list[str]:
    """Copy those of `names` that exist in `src` into `dst`; the names copied."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def weight_map(src: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file in `src` that holds it: the checkpoint's index, or its shards
    read (headers only) in name order; {} when it has no safetensors."""
    from safetensors import safe_open

    src = Path(src)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    found: dict[str, str] = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            found.update({k: shard.name for k in f.keys()})
    return found


def load_hf_model(hf_model_dir, attn_implementation: str | None = "eager", dtype: str = "float32"):
    """The checkpoint as an eval-mode HF model: in float32 (what every reference computes in), or with
    dtype="auto" in the checkpoint's own dtype, memory-mapped (what a reader of a few tensors needs: a
    bf16 1.75B model costs no resident memory until a tensor is touched, against 7 GB made in fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"dtype": torch.float32 if dtype == "float32" else dtype}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), **kw)
    return model.eval()
