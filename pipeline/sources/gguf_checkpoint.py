"""A GGUF file as a Hugging Face checkpoint folder (safetensors, fp32).

transformers reads GGUF (`from_pretrained(dir, gguf_file=name)`, dequantizing
every tensor), but the model it returns is marked GGUF-quantized and refuses
`save_pretrained`: measured here on Gemma 3 270M. So the dequantized weights
are moved into a model built from the same config, which saves as any
checkpoint does. Two things the GGUF loader drops are put back:

- `tokenizer.ggml.add_bos_token`: the converted tokenizer.json adds no BOS,
  and Gemma without its BOS generates garbage, so the tokenizer is loaded
  with the file's own setting (its post-processor then adds it);
- `architectures`, which every later stage reads from config.json;
- Gemma 3's attention scale (query_pre_attn_scalar) as llama.cpp derives it.

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
    key_length = meta.get(f"{arch}.attention.key_length")
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        if key_length and getattr(config, "head_dim", None) not in (None, int(key_length)):
            # transformers' reader maps no key_length to head_dim for some architectures and leaves the
            # config class's default (Qwen3Config: 128): a Qwen3 of another head_dim then fails to load
            config.head_dim = int(key_length)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, add_bos_token=add_bos)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config, dtype=torch.float32)
    except ImportError:
        raise  # a missing package (accelerate, gguf): run_stage names it with the install command
    except Exception as e:  # transformers' GGUF loader raises many types
        raise GgufError(f"{gguf_file.name}: transformers cannot read it: {str(e).strip().splitlines()[0]}") from None
    config.architectures = [ARCHITECTURES[arch]]
    if arch in ("gemma2", "gemma3") and key_length:
        # The file carries no query_pre_attn_scalar and transformers' reader fixes 256;
        # llama.cpp scales attention by 1/sqrt(key_length) (every Gemma 2 and 3 but the 27Bs,
        # not a target here), so the checkpoint says what llama.cpp runs.
        config.query_pre_attn_scalar = int(key_length)
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
        raise GgufError(f"{gguf_file.name}: its tensors do not fill a {ARCHITECTURES[arch]} ({what})")
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


def _drop_tokenizer_key(out: Path, key: str) -> None:
    """save_pretrained records loading flags of this machine: drop them, so the
    folder is the same wherever it is built."""
    import json

    path = out / "tokenizer_config.json"
    if path.is_file():
        cfg = json.loads(path.read_text())
        if cfg.pop(key, None) is not None:
            path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
