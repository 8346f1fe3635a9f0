"""untie_head: emit the output head as its own tensor when it is tied to the embedding.

Why a stage: with a tied embedding the head is reached through the embedding
(a Transpose in an exported graph), so quantizers skip it and it stays in
16/32-bit. Left unquantized it cost 2.97 ms per decode step on the 1.7B model,
more than the whole 4-bit saving, and invalidated a round of W4A8 numbers
(field notes). After this stage the head is `lm_head.weight` and
`tie_word_embeddings` is false, so every later stage treats it as a linear.

The source shards are copied unchanged; the head is written as one extra shard
and the safetensors index lists it, so a multi-GB checkpoint is never rewritten.
"""

from __future__ import annotations

import json
import shutil

READS = ("model",)
INPUTS = ("model",)
TOOLCHAIN = ("safetensors", "torch")
MEMORY_KEYS = ("model.dtype",)  # the settings that size its memory (named when the kernel kills it)

HEAD = "lm_head.weight"
HEAD_SHARD = "model-lm_head.safetensors"
BODY_SHARD = "model-body.safetensors"
INDEX = "model.safetensors.index.json"


def _embedding_name(weight_map: dict[str, str]) -> str:
    for name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight"):
        if name in weight_map:
            return name
    candidates = [k for k in weight_map if k.endswith("embed_tokens.weight")]
    if len(candidates) == 1:
        return candidates[0]
    from pipeline.engine.context import StageError

    raise StageError(f"cannot find the token embedding among {len(weight_map)} tensors (looked for *embed_tokens.weight)")


def run(ctx) -> dict:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.sources import checkpoint_files

    src = ctx.inputs["model"]
    for p in sorted(src.iterdir()):
        if p.name != "manifest.json" and p.is_file():
            shutil.copy2(p, ctx.out / p.name)
    config = json.loads((src / "config.json").read_text())
    weight_map = checkpoint_files.weight_map(src)
    text_cfg = config.get("text_config", config)
    tied = bool(config.get("tie_word_embeddings", text_cfg.get("tie_word_embeddings", True)))
    if HEAD in weight_map and not tied:
        ctx.log("head already untied: copied unchanged")
        return {"untied": False, "reason": "checkpoint already has its own lm_head.weight"}

    # transformers prefers a lone model.safetensors over an index: rename it so
    # the index (which lists the new head shard) is what gets loaded.
    if (ctx.out / "model.safetensors").exists():
        (ctx.out / "model.safetensors").rename(ctx.out / BODY_SHARD)
        weight_map = {k: (BODY_SHARD if v == "model.safetensors" else v) for k, v in weight_map.items()}
    embed = _embedding_name(weight_map)
    with safe_open(ctx.out / weight_map[embed], framework="pt") as f:
        head = f.get_tensor(embed).clone().contiguous()
    save_file({HEAD: head}, str(ctx.out / HEAD_SHARD), metadata={"format": "pt"})
    weight_map = {k: v for k, v in weight_map.items() if k != HEAD}
    weight_map[HEAD] = HEAD_SHARD
    total = sum((ctx.out / s).stat().st_size for s in set(weight_map.values()))
    (ctx.out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
    )
    config["tie_word_embeddings"] = False
    if "text_config" in config:
        config["text_config"]["tie_word_embeddings"] = False
    (ctx.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    ctx.log(f"untied: {embed} -> {HEAD} {tuple(head.shape)} {head.dtype}")
    return {"untied": True, "embedding": embed, "head_shape": list(head.shape), "dtype": str(head.dtype)}
