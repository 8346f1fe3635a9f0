"""The model families the tool builds, each stated once as data: how it departs from the base decoder.

The base decoder is Llama's (transformers `models/llama/modeling_llama.py`):
token embedding -> per layer [RMSNorm -> q, k, v projections -> rotary on every
head dim -> causal attention, scale head_dim**-0.5 -> o projection -> residual add
-> RMSNorm -> SiLU(gate) * up -> down -> residual add] -> RMSNorm -> lm_head, no
biases. A family is a row of `FAMILIES`: its deviations from that base, each named
with the transformers 5.x source line that defines it, so a writer (the model
stage, the decode-step export, the GQA graph, the KV planner, the GGUF source)
asks the row instead of testing a model type. Adding a family is a row here and its
tests (tests/test_families.py builds a tiny checkpoint of each row through every
writer and compares it with transformers' own eager model of the same weights).

Why a table and not a subclass per family (onnxruntime-genai's builder has
`qwen.py`, `phi.py`, `gemma.py` overriding methods): what a family is can then be
read in one screen, and a writer cannot forget a family it never heard of: it
reads the same fields for every row. Deviations that live in the config (a bias
flag, a softcap value, a window) are read from the config by the writers; the
row says which config keys carry them, and what the family does when a key is
absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# How a family's layers slide (which layers have a window):
SLIDING_LAYER_TYPES = "layer_types"  # config.layer_types names each layer (Gemma 2/3, Qwen2, SmolLM3)
SLIDING_EVERY_LAYER = "every_layer"  # config.sliding_window, when set, binds every layer (Mistral, Phi-3)
SLIDING_NONE = "none"  # no window (Llama, Granite)
SLIDING = (SLIDING_LAYER_TYPES, SLIDING_EVERY_LAYER, SLIDING_NONE)

# How llama.cpp (0.3.36's, the runtime of the llama.cpp device classes) applies a family's window, measured
# by running each family's GGUF (tests/test_family_paths.py, llama.cpp against the model of the file's codes):
GGUF_WINDOW_NATIVE = "native"  # as transformers does, from what its converter writes (Gemma 2, Phi-3), or none
GGUF_WINDOW_PATTERN = "pattern"  # llama.cpp reads {arch}.attention.sliding_window_pattern, which its converter
# does not write: without it Gemma 3 takes every 6th layer as full (26 dB on a 1-in-2 checkpoint, 33 with it);
# the pack stage writes the checkpoint's own layer_types there
GGUF_WINDOW_NONE = "none"  # no window at all (Mistral, written as llama; Qwen2's converter writes none): the
# file is the model only within the window (41.6 dB inside, 2.1 past it on Mistral), so a llama.cpp build's
# positions end at the window (model_facts.on_runtime)

# Rotary variants whose inverse frequencies are fixed at init, so the static graphs read HF's own buffers.
# "longrope" is fixed only up to `original_max_position_embeddings` (transformers' modeling_rope_utils.py
# `longrope_frequency_update`: the long factor takes over past it); `rope_limit` checks a context against it.
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "proportional", "longrope")


@dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type (a Gemma 3 checkpoint's text model: gemma3_text)
    architecture: str  # config.json's architectures[0]
    gguf_arch: str  # llama.cpp's general.architecture for it
    sliding: str = SLIDING_NONE  # which layers have a window (SLIDING)
    norm_offset: bool = False  # RMSNorm computes x * (1 + w): the stored gamma is an offset from 1
    sandwich_norms: bool = False  # post_attention_layernorm after attention, pre/post_feedforward_layernorm
    qk_norm: bool = False  # a per-head RMSNorm on q and k before rotary (q_norm, k_norm)
    fused_qkv: str | None = None  # one projection for q|k|v (its module name under self_attn), else q/k/v_proj
    fused_gate_up: str | None = None  # one projection for gate|up (its module name under mlp), gate first
    nope_key: str | None = None  # a config list, per layer, of 1 = rotary / 0 = no rotary (NoPE)
    multipliers: tuple[str, ...] = ()  # scalar config multipliers the forward applies (see MULTIPLIERS)
    gguf_window: str = GGUF_WINDOW_NATIVE  # how llama.cpp applies its window (GGUF_WINDOW_*)
    gguf_source: bool = True  # a GGUF of it is read as a source: transformers' GGUF loader reads it
    # (transformers 5.x modeling_gguf_pytorch_utils GGUF_SUPPORTED_ARCHITECTURES has no smollm3 or granite)
    notes: tuple[str, ...] = field(default=(), compare=False)  # each deviation's source line in transformers

    @property
    def fused(self) -> dict[str, str]:
        """{fused module path suffix: what it concatenates} for the fused projections."""
        out = {}
        if self.fused_qkv:
            out[f"self_attn.{self.fused_qkv}"] = "q|k|v"
        if self.fused_gate_up:
            out[f"mlp.{self.fused_gate_up}"] = "gate|up"
        return out


# What each multiplier does, in the forward's own words (Granite: models/granite/modeling_granite.py).
MULTIPLIERS = {
    "embedding_multiplier": "inputs_embeds * embedding_multiplier (GraniteModel.forward)",
    "residual_multiplier": "residual + sublayer_out * residual_multiplier, after attention and after the MLP "
                           "(GraniteDecoderLayer.forward)",
    "logits_scaling": "logits / logits_scaling (GraniteForCausalLM.forward)",
    # attention_multiplier is the attention's `scaling` (GraniteAttention.__init__): the writers already read
    # the module's `scaling`, so it needs no handling of its own.
}

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM", "llama",
           notes=("the base decoder; rope_type llama3 scales inv_freq at init "
                  "(modeling_rope_utils._compute_llama3_parameters): a static table the graphs read",)),
    Family("mistral", "MistralForCausalLM", "llama", sliding=SLIDING_EVERY_LAYER, gguf_window=GGUF_WINDOW_NONE,
           notes=("sliding_window, when set, masks every layer and there is no layer_types map "
                  "(MistralModel.forward: create_sliding_window_causal_mask for all layers); llama.cpp "
                  "writes it as llama",)),
    Family("qwen2", "Qwen2ForCausalLM", "qwen2", sliding=SLIDING_LAYER_TYPES, gguf_window=GGUF_WINDOW_NONE,
           notes=("q/k/v projections with bias=True, o_proj without (Qwen2Attention.__init__)",
                  "config.sliding_window is None unless use_sliding_window (Qwen2Config.__post_init__): the "
                  "4096 or 32768 in a Qwen2.5 config.json is not a window",)),
    Family("qwen3", "Qwen3ForCausalLM", "qwen3", sliding=SLIDING_LAYER_TYPES, qk_norm=True,
           notes=("q_norm / k_norm per head before rotary (Qwen3Attention.forward)",)),
    Family("gemma2", "Gemma2ForCausalLM", "gemma2", sliding=SLIDING_LAYER_TYPES, norm_offset=True,
           sandwich_norms=True,
           notes=("Gemma2RMSNorm: x * (1 + weight)", "embedding scaled by sqrt(hidden) "
                  "(Gemma2TextScaledWordEmbedding)", "attention softcap passed to the attention function "
                  "(softcap=self.attn_logit_softcapping)", "final_logit_softcapping on the logits",
                  "scaling = query_pre_attn_scalar ** -0.5", "alternating sliding / full layer_types")),
    Family("gemma3_text", "Gemma3ForCausalLM", "gemma3", sliding=SLIDING_LAYER_TYPES, norm_offset=True,
           sandwich_norms=True, qk_norm=True, gguf_window=GGUF_WINDOW_PATTERN,
           notes=("as Gemma 2, plus q_norm / k_norm, one rotary table per layer type; its attention stores "
                  "attn_logit_softcapping but never applies it",)),
    Family("phi3", "Phi3ForCausalLM", "phi3", sliding=SLIDING_EVERY_LAYER, fused_qkv="qkv_proj",
           fused_gate_up="gate_up_proj",
           notes=("self_attn.qkv_proj and mlp.gate_up_proj fused (Phi3Attention, Phi3MLP: gate first)",
                  "partial rotary from rope_parameters.partial_rotary_factor (Phi-4-mini: 0.75; "
                  "Phi3 apply_rotary_pos_emb rotates the leading dims)",
                  "LongRoPE: short_factor up to original_max_position_embeddings, long past it",
                  "sliding_window on every layer when set (Phi-3.5 / Phi-4-mini set 262144: never binds)")),
    Family("smollm3", "SmolLM3ForCausalLM", "smollm3", sliding=SLIDING_LAYER_TYPES, nope_key="no_rope_layers",
           gguf_source=False,
           notes=("no rotary on layers where no_rope_layers[i] == 0, every fourth by default "
                  "(SmolLM3Attention: self.use_rope = config.no_rope_layers[layer_idx])",)),
    Family("granite", "GraniteForCausalLM", "granite",
           multipliers=("embedding_multiplier", "residual_multiplier", "logits_scaling"), gguf_source=False,
           notes=("embedding, residual and logits multipliers (MULTIPLIERS); scaling = attention_multiplier",)),
)}

BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}


class FamilyError(ValueError):
    """A checkpoint of a family the tool does not build (one line, naming what it does build)."""


def known() -> str:
    return ", ".join(f.architecture for f in FAMILIES.values())


def of_config(cfg) -> Family:
    """The row of a transformers config (or its text config), by model_type."""
    cfg = getattr(cfg, "text_config", None) or cfg
    mt = getattr(cfg, "model_type", None)
    if mt not in FAMILIES:
        raise FamilyError(f"model_type {mt!r} is not a family this tool builds; it builds {known()}")
    return FAMILIES[mt]


def of_architecture(arch: str | None) -> Family:
    """The row of config.json's architectures[0]."""
    if arch not in BY_ARCHITECTURE:
        raise FamilyError(f"unsupported architecture {arch or '(none in config.json)'}; supported: {known()}")
    return BY_ARCHITECTURE[arch]


def of_gguf_arch(arch: str) -> Family:
    """The row of a GGUF source's general.architecture (llama.cpp writes Mistral as llama: that file is
    read as the Llama it is)."""
    sources = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_source and f.model_type != "mistral"}
    if arch in sources:
        return sources[arch]
    known = any(f.gguf_arch == arch for f in FAMILIES.values())
    raise FamilyError(f"GGUF architecture {arch!r} is not read as a source"
                      + (" (transformers' GGUF loader has no reader for it; build from the Hugging Face "
                         "checkpoint: model=hf)" if known else "")
                      + f"; GGUF sources read: {', '.join(sorted(sources))}")


def hf_config(text: dict):
    """A config.json dict of a family of the table as transformers reads it (its config class), which is
    what every runtime reads (transformers, vLLM): where Qwen2's unused window becomes None, a Gemma 2
    config.json without layer_types gets its pattern and a Phi-3's rope_scaling becomes rope_parameters.
    Raises what transformers' config validation raises."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[text["model_type"]].from_dict(dict(text))


def sliding_layers(cfg) -> tuple[list[bool], int]:
    """(per layer: does it slide, the window) as the family's forward masks; window 0: none slides.

    Mistral and Phi-3 have no layer_types map: their window, when set, binds every layer. A map's
    sliding layers without a window (Qwen2's config with use_sliding_window false) slide nowhere."""
    cfg = getattr(cfg, "text_config", None) or cfg
    fam = of_config(cfg)
    n = int(cfg.num_hidden_layers)
    window = int(getattr(cfg, "sliding_window", None) or 0)
    if fam.sliding == SLIDING_NONE or not window:
        return [False] * n, 0
    if fam.sliding == SLIDING_EVERY_LAYER:
        return [True] * n, window
    types = list(getattr(cfg, "layer_types", None) or [])
    if len(types) < n:
        raise FamilyError(f"config.layer_types has {len(types)} entries for {n} layers")
    return [t == "sliding_attention" for t in types[:n]], window


def layer_types(cfg) -> list[str]:
    """Each layer's type, "sliding_attention" or "full_attention", as `sliding_layers` decides."""
    slides, _ = sliding_layers(cfg)
    return ["sliding_attention" if s else "full_attention" for s in slides]


def rotary_layers(cfg) -> list[bool]:
    """Per layer: is rotary applied (False on a NoPE layer)."""
    cfg = getattr(cfg, "text_config", None) or cfg
    fam = of_config(cfg)
    n = int(cfg.num_hidden_layers)
    if not fam.nope_key:
        return [True] * n
    flags = list(getattr(cfg, fam.nope_key, None) or [1] * n)
    if len(flags) < n:
        raise FamilyError(f"config.{fam.nope_key} has {len(flags)} entries for {n} layers")
    return [bool(x) for x in flags[:n]]


def multipliers(cfg) -> dict[str, float]:
    """{multiplier: value} the forward applies, only those that are not 1."""
    cfg = getattr(cfg, "text_config", None) or cfg
    out = {}
    for key in of_config(cfg).multipliers:
        v = getattr(cfg, key, None)
        if v is not None and float(v) != 1.0:
            out[key] = float(v)
    return out


def rope_limit(cfg) -> int | None:
    """The last context length the static rotary tables are exact for; None: any.

    LongRoPE switches from its short to its long factor past original_max_position_embeddings
    (transformers' longrope_frequency_update): a static graph holds one table, the short one."""
    cfg = getattr(cfg, "text_config", None) or cfg
    rp = getattr(cfg, "rope_parameters", None) or {}
    params = [rp] if "rope_type" in rp else [v for v in rp.values() if isinstance(v, dict)]
    limits = [int(p["original_max_position_embeddings"]) for p in params
              if p.get("rope_type") == "longrope" and p.get("original_max_position_embeddings")]
    return min(limits) if limits else None
