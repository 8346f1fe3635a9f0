"""A tiny Gemma 3 GGUF file written here with the `gguf` package (fp32 tensors,
a SentencePiece-style vocabulary with BOS), and the HF model it was made from,
so a test can check that the model stage's conversion gives back its logits."""

from __future__ import annotations

from pathlib import Path

WORDS = ["▁The", "▁function", "▁returns", "▁a", "▁list", "▁of", "▁the", "▁file", "▁is", "▁value",
         "The", "▁cat", "▁sat", "▁on", "▁mat", "s", "e", "t", "a", "▁"]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Gemma's first five ids
# token types, as llama.cpp's vocabulary names them
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]  # Llama's SentencePiece ids 0-2, which transformers' reader adds
# for every SentencePiece vocabulary but Gemma's


def vocabulary(llama: bool = False) -> tuple[list[str], list[float], list[int]]:
    specials = LLAMA_SPECIALS if llama else SPECIALS
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    scores = [0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(WORDS))]
    types = ([UNKNOWN, CONTROL, CONTROL] if llama else [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL]) \
        + [BYTE] * 256 + [NORMAL] * len(WORDS)
    return tokens, scores, types


def tiny_gemma3(vocab_size: int, window: int = 16, positions: int = 128, seed: int = 0):
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    # Two sliding layers: the GGUF carries no layer_types, and transformers' reader
    # applies Gemma 3's own pattern (every 6th layer full), which makes both sliding.
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=window, layer_types=["sliding_attention", "sliding_attention"],
        max_position_embeddings=positions, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their init value, so a lost "+1" would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return model


def write(path: Path, window: int = 16, positions: int = 128, add_bos: bool = True):
    """Write the GGUF file; returns the HF model its tensors came from."""
    import gguf
    import numpy as np

    tokens, scores, types = vocabulary()
    model = tiny_gemma3(len(tokens), window, positions)
    cfg = model.config
    arch = gguf.MODEL_ARCH.GEMMA3
    name_map = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny gemma3")
    w.add_context_length(positions)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied: llama.cpp's files hold the embedding only
        gname = name_map.get_name(hf_name, try_suffixes=(".weight",))
        assert gname, hf_name
        data = t.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp stores Gemma's norms as 1 + w; transformers' reader undoes it
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


# --------------------------------------------------------------------------
# any family the GGUF source reads: a tiny HF model of the family (benchmarks/make_hf_checkpoint.py's
# family_config, the releases' settings) written as llama.cpp's converter writes that arch
# --------------------------------------------------------------------------


def _llama_permute(w, n_head: int, n_head_kv: int):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: q and k rows reordered for its rotary
    (interleaved pairs); transformers' GGUF reader undoes it for the llama arch only."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def family_model(family: str, seed: int = 0, config: dict | None = None, head_dim: int = 16, **settings):
    """A tiny model of `family` (random weights; norms and biases perturbed so a lost offset or bias
    shows), its vocabulary this module's; `config`: attributes set on its config before it is built."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from make_hf_checkpoint import family_config

    gemma = family in ("gemma2", "gemma3")  # Gemma's vocabulary and tied head, as its releases have them
    tokens, _, _ = vocabulary(llama=not gemma)
    ids = {"bos": 2, "eos": 1, "pad": 0} if gemma else {"bos": 1, "eos": 2, "pad": None}
    cfg = family_config(family, vocab=len(tokens), hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2,
                        head_dim=head_dim, max_positions=256, tie=gemma, **ids, **settings)
    for key, value in (config or {}).items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    from tests.tiny_models import perturb

    return perturb(AutoModelForCausalLM.from_config(cfg).eval())


def write_family(path: Path, model, name: str = "tiny", window: int | None = None) -> None:
    """Write `model` as llama.cpp writes its arch (names, metadata, conventions: Llama's q/k permutation,
    Gemma's norms as 1 + w, Phi-3's fused attn_qkv and ffn_up and its LongRoPE factor tensors).
    `window`: a llama arch file's attention.sliding_window (a Mistral)."""
    import gguf
    import numpy as np

    from pipeline.sources import families

    cfg = model.config
    fam = families.of_config(cfg)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == fam.gguf_arch)
    layers, heads, kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    name_map = gguf.get_tensor_name_map(arch, layers)
    w = gguf.GGUFWriter(str(path), fam.gguf_arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope) if "rope_type" not in rope else rope
    w.add_rope_freq_base(rope["rope_theta"])
    if fam.gguf_arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if fam.gguf_arch != "phi3":  # convert_hf_to_gguf.py TextModel: key/value length where config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if fam.gguf_arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if fam.gguf_arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if fam.gguf_arch == "phi3":  # convert_hf_to_gguf.py Phi3MiniModel
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("rope_type") == "longrope":  # its attn_factor: sqrt(1 + ln(scale) / ln(original))
            import math

            scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])))
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
    if window:
        w.add_sliding_window(window)
    gemma = fam.gguf_arch in ("gemma2", "gemma3")
    tokens, scores, types = vocabulary(llama=not gemma)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2 if gemma else 1)
    w.add_eos_token_id(1 if gemma else 2)
    w.add_unk_token_id(3 if gemma else 0)
    if gemma:
        w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors: the scaling as divisors
        import math

        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        divisors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
            if wavelen < old / high:
                divisors.append(1.0)
            elif wavelen > old / low:
                divisors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                divisors.append(1 / ((1 - smooth) / factor + smooth))
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                     np.asarray(divisors, dtype=np.float32))
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                     np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                     np.asarray(rope["short_factor"], dtype=np.float32))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for hf_name, t in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp's files hold the embedding only
        base, _, suffix = hf_name.rpartition(".")
        gname = name_map.get_name(base)
        assert gname, hf_name
        data = t.detach().float().numpy()
        if fam.gguf_arch == "llama" and base.endswith("q_proj"):
            data = _llama_permute(data, heads, heads)
        elif fam.gguf_arch == "llama" and base.endswith("k_proj"):
            data = _llama_permute(data, heads, kv_heads)
        if fam.norm_offset and base.endswith("norm"):
            data = data + 1.0
        w.add_tensor(f"{gname}.{suffix}", np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
