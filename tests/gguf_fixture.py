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


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    scores = [0.0] * len(SPECIALS) + [0.0] * 256 + [-float(i) for i in range(len(WORDS))]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN, CONTROL] + [BYTE] * 256 + [NORMAL] * len(WORDS)
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
