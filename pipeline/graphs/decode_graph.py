"""The decode-step graph: one token of a Hugging Face decoder with explicit KV.

Shared by `export`, `verify_parity` and the benchmark stages. Two pieces:

- `build_decode_step(hf_model, context_length, mask_value)`: a torch module that
  computes ONE decode step from the HF module's weights, with the KV cache as
  explicit per-layer tensors, laid out per layer type (field notes, "Phone NPU"):

  * full-attention layers: `past_key_i` / `past_value_i` of shape
    [1, n_kv, context_length, head_dim]; the entry of absolute position p lives
    in slot p; slot j is valid iff j < position.
  * sliding layers (window W): a ring of W-1 entries [1, n_kv, W-1, head_dim];
    the entry of position p lives in slot p mod (W-1); slot j is valid iff
    j < min(position, W-1). Together with the new key this is exactly HF's
    sliding mask (a query at p sees keys at positions > p - W, itself included).
    Softmax over keys is order-independent and each cached key carries its own
    rotary phase, so the ring is never reordered. If W-1 >= context_length the
    window can never bind inside the context, and the layer gets the (smaller)
    full layout instead.

  Inputs: input_ids int64 [1, 1], position int64 [1], then past_key_0,
  past_value_0, ... Outputs: logits float32 [1, 1, vocab], then new_key_i,
  new_value_i [1, n_kv, 1, head_dim] (the new entry only, already rotated: the
  runtime writes it into its slot). Grouped-query attention reshapes the query
  to [n_kv, group, 1, head_dim] (K/V are never expanded); keys are the cache
  concatenated with the new key, and one fused Softmax runs over them with an
  additive validity mask (`mask_value`, modest: -100 by default) computed in
  the graph from `position`. The graph holds no modulo: the runtime computes
  the ring slot from a non-negative position.

- `build_prompt_step(hf_model, context_length, tokens)`: the prompt graph, T
  tokens a call (Qualcomm's LLM exports: a prompt processor of 128 tokens beside
  the token generator, from the same weights). Same weights, same KV layout, same
  rope; what differs:

  * inputs: input_ids [1, T], position int64 [T] (each row's position), then one
    additive mask per kind of layer, `mask_full` [T, context_length + T] and
    `mask_ring` [T, (W-1) + T] (columns: the cache's slots, then the chunk's own
    T keys), then the past K/V as the decode step takes them. The masks are
    inputs, not computed from `position` as the decode step's are: which ring
    slot holds which position is a modulo, and the graph holds none (the runtime
    has the slots' positions; pipeline/runtimes/onnx.py `prompt_masks`);
  * outputs: logits [1, 1, vocab] of the LAST row only (a runtime pads a short
    chunk in front, masked out, so the last row is always the last token), then
    new_key_i / new_value_i [1, n_kv, T, head_dim], the runtime writing each real
    row into its slot.

- `build_genie_step(hf_model, context_length, tokens)`: the same layers in the I/O form Qualcomm's
  Genie runtime feeds a graph (its HTP engine's validator and feeding, read in the Genie sources the
  QAIRT SDK ships: qualla/engines/qnn-htp/nsp-model.cpp, attention-mask.cpp, KVCache/; pipeline/runtimes/genie.py):

  * inputs: input_ids int32 [1, T]; attention_mask [1, 1, T, CL] (columns: the past's CL - T entries,
    then the call's own T tokens; Genie writes 0 where a token may attend and -1000 elsewhere into a
    float mask, 0xffff / 0 into a quantized one); position_ids_cos / position_ids_sin [1, 1, T, rot/2]
    (Genie computes the rotary tables, half their width, from rope-theta); past_key_i_in
    [1, n_kv, head_dim, CL - T] (keys transposed) and past_value_i_in [1, n_kv, CL - T, head_dim];
  * outputs: logits [1, T, vocab] (every row: Genie pads a short call at the end and reads the last real
    row), past_key_i_out [1, n_kv, head_dim, T], past_value_i_out [1, n_kv, T, head_dim]: Genie's
    engine writes them into the _in buffers itself (pipeline/runtimes/genie_feed.py does as it does);
  * CL is `context_length`, one for the token graph (T = 1) and the prompt graph alike, so the past is
    CL - T long: Genie's layout, not the shared cache of the form above;
  * sliding layers (window W) form a cache group of their own (Genie's engine `cache-groups`, prefix
    `swa_`): swa_key_i_in [1, n_kv, head_dim, W - 1] / swa_value_i_in, the same ring of W - 1 entries
    as ours (Genie's sliding-window group fills its slots in order, then overwrites the oldest: slot =
    position mod (W - 1)), with a mask of their own, swa_attention_mask [1, 1, T, W - 1 + T], which
    Genie gathers from attention_mask slot by slot and cuts to the window (keys at positions > p - W);
  * a model with one rotary table per kind of layer (Gemma 3's two bases) takes Genie's `absolute`
    positional encoding instead: position_ids int32 [1, 1, T] (Genie writes n_past + i, 0 for padding),
    the tables computed in the graph from it as ours are.
  Refused where Genie's engine would not feed the graph: every layer sliding (Genie's default group,
  past_, must hold KV), a prompt graph of more than W tokens a call (Genie never cuts the call's own
  keys to the window) or whose past (CL - T) is shorter than the ring.

- `export_decode_step(...)`: the module to `model.onnx` (dynamo exporter, static
  shapes) plus `io.json` describing inputs, outputs and per-layer slot rules; with
  `prompt_tokens` > 1 the prompt graph beside it (`prompt.onnx`, io.json "prompt").
Its runtimes are pipeline/runtimes/onnx.py (`OnnxDecoder`) and the reference,
pipeline/runtimes/reference.py (`TorchReference`, the eager HF model).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.sources import families
from pipeline.sources.checkpoint_files import load_hf_model

FULL = "full_attention"
SLIDING = "sliding_attention"
IO_VERSION = 1
# Static rope types: inv_freq is fixed at init, so reading HF's buffers is exact (longrope up to its
# original positions: `_rope_tables` checks the context against families.rope_limit).
_STATIC_ROPE = set(families.STATIC_ROPE)
_EXTERNAL_DATA_BYTES = int(1.5e9)
PROMPT_MODEL = "prompt.onnx"
# Genie's form (the module docstring): the values its engine writes into a float attention mask (nsp-model.cpp:
# 0 where a token may attend, -1000 elsewhere), its cache groups' tensor-name prefixes (the default group's,
# which Genie fixes, and the sliding layers'), and the sliding group's mask.
GENIE_ATTEND, GENIE_MASKED = 0.0, -1000.0
GENIE_PAST, GENIE_SWA = "past_", "swa_"
GENIE_SWA_MASK = GENIE_SWA + "attention_mask"
GENIE_ROPE = ("position_ids_cos", "position_ids_sin")
GENIE_POSITIONS = "position_ids"  # the absolute positional encoding's input


class DecodeGraphError(ValueError):
    """A model or request this decode-step graph cannot serve (user-facing)."""


# --------------------------------------------------------------------------
# Model introspection
# --------------------------------------------------------------------------


def _text_config(config):
    return getattr(config, "text_config", None) or config


def layer_types(cfg, error: type[Exception] = None) -> tuple[list[str], int | None]:
    """(each layer's type, sliding_window) of a text config as its family's forward masks it
    (pipeline/sources/families.py: Mistral's window binds every layer, Qwen2's unused window none).
    Shared by the two graph builders (this module's export, pipeline/graphs/gqa_graph.py)."""
    error = error or DecodeGraphError
    try:
        slides, window = families.sliding_layers(cfg)
    except families.FamilyError as e:
        raise error(str(e)) from None
    return [SLIDING if s else FULL for s in slides], (window or None)


def layer_plan(config, context_length: int, sliding_layout: str = "ring") -> list[dict[str, Any]]:
    """Per layer: {index, type, cache_len, slot_rule, ring, window} for this config.

    `sliding_layout="full"` (a debugging/test reference, never exported by the
    stages) gives sliding layers the full-history layout with the window applied
    by the mask instead of the ring.
    """
    if sliding_layout not in ("ring", "full"):
        raise DecodeGraphError(f"sliding_layout must be 'ring' or 'full', got {sliding_layout!r}")
    types, window = layer_types(_text_config(config))
    plan = []
    for i, t in enumerate(types):
        if t == SLIDING:
            if window < 2:
                raise DecodeGraphError(f"sliding_window {window} < 2 leaves no ring")
            if window - 1 < context_length:
                if sliding_layout == "ring":
                    plan.append({"index": i, "type": t, "cache_len": window - 1,
                                 "slot_rule": f"position mod {window - 1}", "ring": window - 1, "window": 0})
                else:
                    plan.append({"index": i, "type": t, "cache_len": context_length,
                                 "slot_rule": "position", "ring": 0, "window": window})
                continue
        plan.append({"index": i, "type": t, "cache_len": context_length, "slot_rule": "position",
                     "ring": 0, "window": 0})
    return plan


def _applies_attn_softcap(attn) -> float | None:
    """The attention-logit softcap HF really applies for this attention module.

    transformers 5.x Gemma2 passes `softcap=self.attn_logit_softcapping` to its
    attention function; Gemma3 stores the config value but never passes it (its
    scores are uncapped whatever the config says). Follow the HF forward, since
    it is the reference.
    """
    import inspect

    cap = getattr(attn, "attn_logit_softcapping", None)
    if cap is None:
        return None
    try:
        src = inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        return float(cap)
    return float(cap) if "softcap=" in src else None


def _rope_tables(hf_model, context_length: int | None = None) -> dict[str, tuple["torch.Tensor", float]]:
    """{rope key: (inv_freq, attention_scaling)} read from HF's rotary module.

    Gemma3 keeps one table per layer type ("<type>_inv_freq"); the others one
    ("inv_freq", key "default"). Reading the buffers HF computed honours static
    scalings (linear, llama3, yarn, proportional, and LongRoPE's short factor up to
    its original positions) exactly; position-dependent ones (dynamic, LongRoPE past
    those positions) are refused, in one line naming the limit.
    """
    import torch

    rot = getattr(hf_model.model, "rotary_emb", None)
    if rot is None:
        raise DecodeGraphError("the model has no model.rotary_emb: not a rotary decoder this graph knows")
    limit = families.rope_limit(hf_model.config)
    if limit is not None and context_length is not None and context_length > limit:
        raise DecodeGraphError(f"LongRoPE switches to its long factor past {limit} positions "
                               f"(original_max_position_embeddings): a static graph serves at most {limit}; "
                               f"set export.context_length <= {limit}")
    rope_type = getattr(rot, "rope_type", "default")
    tables = {}
    if isinstance(rope_type, dict):
        for lt, rt in rope_type.items():
            if rt not in _STATIC_ROPE:
                raise DecodeGraphError(f"rope_type {rt!r} ({lt}) changes with position; not supported by the static graph")
            inv = getattr(rot, f"{lt}_inv_freq")
            tables[lt] = (inv.detach().to(torch.float32).clone(), float(getattr(rot, f"{lt}_attention_scaling")))
    else:
        if rope_type not in _STATIC_ROPE:
            raise DecodeGraphError(f"rope_type {rope_type!r} changes with position; not supported by the static graph")
        tables["default"] = (rot.inv_freq.detach().to(torch.float32).clone(), float(rot.attention_scaling))
    return tables


# --------------------------------------------------------------------------
# The step module
# --------------------------------------------------------------------------


def build_decode_step(hf_model, context_length: int, mask_value: float = -100.0, *,
                      sliding_layout: str = "ring"):
    """The decode-step module of `hf_model` (see the module docstring).

    `sliding_layout="full"` is a plain full-history reference for sliding layers
    (slot = position, window applied by the mask); exports use the ring.
    """
    return _step_module(hf_model, context_length, mask_value, sliding_layout, tokens=1)


def build_prompt_step(hf_model, context_length: int, tokens: int, mask_value: float = -100.0):
    """The prompt-step module of `hf_model`: `tokens` tokens a call over the same weights and KV layout
    as the decode step (the module docstring, "The prompt graph")."""
    if tokens < 2:
        raise DecodeGraphError(f"a prompt graph takes at least 2 tokens a call, got {tokens}")
    return _step_module(hf_model, context_length, mask_value, "ring", tokens=tokens)


def build_genie_step(hf_model, context_length: int, tokens: int = 1):
    """The step module in the I/O form Qualcomm's Genie feeds (the module docstring, "Genie's form"):
    `tokens` a call (1: the token graph, AR-1; more: a prompt graph, AR-N) over a context of
    `context_length` (Genie's CL), keys transposed, masks and rotary tables (or positions) as inputs."""
    if not 1 <= tokens < context_length:
        raise DecodeGraphError(f"a Genie-form graph takes 1 to context_length - 1 tokens a call, got {tokens}")
    return _step_module(hf_model, context_length, GENIE_MASKED, "ring", tokens=tokens, genie=True)


def genie_refusal(plan: list[dict[str, Any]], context_length: int, tokens: int = 1) -> str | None:
    """Why Genie's engine would not feed a Genie-form graph of this layer plan, `tokens` a call (read from the
    config alone, before any weight is loaded); None where it would."""
    rings = [p for p in plan if p["ring"]]
    if rings and len(rings) == len(plan):
        return (f"every layer slides over a window of {rings[0]['ring'] + 1} inside the context of {context_length}: "
                f"Genie's default cache group ({GENIE_PAST}) would hold no KV, and its engine refuses that")
    if rings and tokens > rings[0]["ring"] + 1:
        return (f"{tokens} tokens a call over a window of {rings[0]['ring'] + 1}: Genie never cuts a call's own keys "
                "to the window, so a call must not be longer than it")
    if rings and context_length - tokens < rings[0]["ring"]:
        return (f"the past of {context_length - tokens} entries ({context_length} - {tokens} tokens a call) is shorter "
                f"than the sliding layers' {rings[0]['ring']}: Genie gathers their mask from it")
    return None


def _genie_plan(plan: list[dict[str, Any]], context_length: int, tokens: int) -> list[dict[str, Any]]:
    """Genie's form of the layer plan: a full layer's past `context_length - tokens` entries long (Genie's
    past = CL - AR), slot = the token's index; a sliding layer's the ring (its cache group's buffer); each
    layer's cache group's name prefix. Refused where Genie's engine would not feed the graph."""
    why = genie_refusal(plan, context_length, tokens)
    if why:
        raise DecodeGraphError(f"Genie's form: {why}")
    return [{**p, "prefix": GENIE_SWA} if p["ring"] else
            {**p, "cache_len": context_length - tokens, "slot_rule": "position", "prefix": GENIE_PAST} for p in plan]


def mask_inputs(plan: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The prompt graph's mask inputs: {name: {cache_len, ring}}, one per kind of layer the plan has
    (full layers' `mask_full`, sliding rings' `mask_ring`), in input order."""
    masks = {}
    for p in plan:
        if p["window"]:
            raise DecodeGraphError("the prompt graph serves the ring layout only")
        masks.setdefault("mask_ring" if p["ring"] else "mask_full", {"cache_len": p["cache_len"], "ring": p["ring"]})
    return dict(sorted(masks.items()))


def _step_module(hf_model, context_length: int, mask_value: float, sliding_layout: str, tokens: int,
                 genie: bool = False):
    import torch
    from torch import nn

    cfg = _text_config(hf_model.config)
    base = getattr(hf_model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(hf_model, "lm_head"):
        raise DecodeGraphError(f"{type(hf_model).__name__}: expected a *ForCausalLM with .model.layers and .lm_head")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise DecodeGraphError("use_bidirectional_attention models are not causal decoders")
    if context_length < 1:
        raise DecodeGraphError(f"context_length must be >= 1, got {context_length}")

    plan = layer_plan(cfg, context_length, sliding_layout)
    rope = _rope_tables(hf_model, context_length)
    if genie:
        plan = _genie_plan(plan, context_length, tokens)
    family = families.of_config(cfg)
    rotary = families.rotary_layers(cfg)
    mult = families.multipliers(cfg)

    class DecodeStep(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = base.embed_tokens  # Gemma3's module already scales by sqrt(hidden)
            self.layers = base.layers
            self.norm = base.norm
            self.lm_head = hf_model.lm_head
            self.plan = plan
            self.n_heads = cfg.num_attention_heads
            self.n_kv = cfg.num_key_value_heads
            self.group = self.n_heads // self.n_kv
            self.head_dim = self.layers[0].self_attn.head_dim
            self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
            self.attn_softcap = [_applies_attn_softcap(layer.self_attn) for layer in self.layers]
            self.mask_value = float(mask_value)
            self.context_length = context_length
            # Which rope table each layer uses.
            self.rope_key = [t["type"] if t["type"] in rope else "default" for t in plan]
            for p in plan:
                if self.rope_key[p["index"]] not in rope:
                    raise DecodeGraphError(f"no rope table for layer {p['index']} ({p['type']})")
            self.rope_scale = {}
            for key, (inv, scale) in rope.items():
                self.register_buffer(f"inv_freq_{key}", inv, persistent=False)
                self.rope_scale[key] = scale
            # Slot indices per distinct cache length.
            for cl in sorted({p["cache_len"] for p in plan}):
                self.register_buffer(f"slots_{cl}", torch.arange(cl, dtype=torch.int64), persistent=False)
            self.gemma_sandwich = family.sandwich_norms
            self.fused_qkv = family.fused_qkv  # Phi-3: one q|k|v projection, split here
            self.rotary = rotary  # False on a NoPE layer (SmolLM3)
            self.embedding_multiplier = mult.get("embedding_multiplier")  # Granite's (families.MULTIPLIERS)
            self.residual_multiplier = mult.get("residual_multiplier")
            self.logits_scaling = mult.get("logits_scaling")
            self.tokens = tokens
            self.genie = genie
            self.masks = mask_inputs(plan) if tokens > 1 and not genie else {}
            # Genie's inputs before the KV: one rotary table fed as Genie computes it, or positions
            self.genie_inputs = genie_inputs(plan, len(rope)) if genie else []

        @staticmethod
        def _rotate(x, cos, sin):
            rot = cos.shape[-1]
            if rot == x.shape[-1]:
                x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
                return x * cos + torch.cat((-x2, x1), dim=-1) * sin
            xr, xp = x[..., :rot], x[..., rot:]  # partial rotary: rotate the leading dims
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
            return torch.cat((xr * cos + torch.cat((-x2, x1), dim=-1) * sin, xp), dim=-1)

        def forward(self, input_ids, position, *rest):
            if self.genie:  # (input_ids, attention_mask, [swa_attention_mask], cos, sin | position_ids, *past)
                given = dict(zip(self.genie_inputs[1:], (position, *rest)))
                masks = {}
                for p in self.plan:
                    mask = given[GENIE_SWA_MASK if p["ring"] else "attention_mask"]
                    if self.tokens > 1:  # rows (group member, token), as the scores' rows; one row broadcasts
                        mask = mask.repeat(1, 1, self.group, 1)
                    masks[(p["cache_len"], p["ring"], p["window"])] = mask
                past = rest[len(self.genie_inputs) - 2:]
                if GENIE_POSITIONS in given:  # the tables computed in the graph from Genie's positions
                    return self._layers(input_ids, given[GENIE_POSITIONS].reshape(self.tokens), masks, past)
                cos, sin = (torch.cat((t, t), dim=-1) for t in (given[n] for n in GENIE_ROPE))  # -> [1, 1, T, rot]
                return self._layers(input_ids, None, masks, past, trig={"default": (cos, sin)})
            if self.tokens > 1:  # the prompt graph: its masks are inputs, one per kind of layer
                masks = dict(zip(self.masks, rest))
                return self._layers(input_ids, position, {
                    (p["cache_len"], p["ring"], p["window"]): masks["mask_ring" if p["ring"] else "mask_full"]
                    for p in self.plan}, rest[len(self.masks):])
            return self._layers(input_ids, position, self._step_masks(position), rest)

        def _step_masks(self, position):
            """The decode step's additive masks from `position`: [cache_len + 1] per kind of layer."""
            masks = {}
            zero = torch.zeros(1, dtype=torch.float32)
            for p in self.plan:
                key = (p["cache_len"], p["ring"], p["window"])
                if key in masks:
                    continue
                slots = getattr(self, f"slots_{p['cache_len']}")
                limit = torch.clamp(position, max=p["ring"]) if p["ring"] else position
                invalid = slots >= limit
                if p["window"]:  # full-history sliding reference: keys at positions > p - W
                    invalid = invalid | (slots <= position - p["window"])
                masks[key] = torch.cat((invalid.to(torch.float32) * self.mask_value, zero))  # [cache_len + 1]
            return masks

        def _layers(self, input_ids, position, masks, past, trig=None):
            """Every layer over T = self.tokens tokens (T = 1: the decode step's ops exactly; T > 1: the
            prompt graph's, each mask [T, cache_len + T] with rows in token order). At most 4-D tensors:
            the HTP's ops are specified to rank 4."""
            T = self.tokens
            h = self.embed_tokens(input_ids)  # [1, T, H]
            if self.embedding_multiplier is not None:
                h = h * self.embedding_multiplier
            if trig is None:  # from `position` (Genie's form takes the tables as inputs)
                pos_f = position.to(torch.float32)  # [T]
                trig = {}
                for key in self.rope_scale:
                    freqs = pos_f[:, None] * getattr(self, f"inv_freq_{key}")[None, :]  # [T, rot/2]
                    emb = torch.cat((freqs, freqs), dim=-1)  # [T, rot]
                    trig[key] = (emb.cos() * self.rope_scale[key], emb.sin() * self.rope_scale[key])
            if T > 1 and not self.genie:  # query rows are (kv head, group member, token): each member sees its token's mask
                masks = {key: m.repeat(self.group, 1) for key, m in masks.items()}
            new_kv = []
            for p in self.plan:
                i = p["index"]
                layer = self.layers[i]
                attn = layer.self_attn
                past_k, past_v = past[2 * i], past[2 * i + 1]
                residual = h
                x = layer.input_layernorm(h)
                if self.fused_qkv:
                    q, k, v = getattr(attn, self.fused_qkv)(x).split(
                        [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1)
                else:
                    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
                q = q.view(1, T, self.n_heads, self.head_dim)
                k = k.view(1, T, self.n_kv, self.head_dim)
                v = v.view(1, T, self.n_kv, self.head_dim)
                if hasattr(attn, "q_norm"):
                    q = attn.q_norm(q)
                    k = attn.k_norm(k)
                q = q.transpose(1, 2)  # [1, nh, T, hd]
                k = k.transpose(1, 2)  # [1, nkv, T, hd]
                v = v.transpose(1, 2)
                if self.rotary[i]:
                    cos, sin = trig[self.rope_key[i]]
                    q = self._rotate(q, cos, sin)
                    k = self._rotate(k, cos, sin)
                if self.genie:  # keys kept transposed: [1, nkv, hd, L] in, [1, nkv, hd, T] out
                    # one token: the same bytes, a Reshape (where the layer has no rotary the exporter joins the
                    # two transposes into one of perm [0, 2, 3, 1], which the HTP refuses: SmolLM3's NoPE layers)
                    k = k.reshape(1, self.n_kv, self.head_dim, 1) if T == 1 else k.transpose(2, 3)
                    keys_t = torch.cat((past_k, k), dim=3)  # [1, nkv, hd, L+T]
                else:
                    keys_t = torch.cat((past_k, k), dim=2).transpose(2, 3)  # [1, nkv, L+T, hd] -> [.., hd, L+T]
                new_kv += [k, v]
                values = torch.cat((past_v, v), dim=2)
                qg = q.reshape(1, self.n_kv, self.group * T, self.head_dim) * attn.scaling
                scores = torch.matmul(qg, keys_t)  # [1, nkv, group*T, L+T]
                softcap = self.attn_softcap[i]
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                scores = scores + masks[(p["cache_len"], p["ring"], p["window"])]
                probs = torch.softmax(scores, dim=-1)
                o = torch.matmul(probs, values)  # [1, nkv, group*T, hd]
                if T > 1:  # rows (kv head, member, token) -> [T, heads, hd] -> [1, T, heads*hd]
                    o = o.reshape(self.n_heads, T, self.head_dim).transpose(0, 1)
                o = o.reshape(1, T, self.n_heads * self.head_dim)
                o = attn.o_proj(o)
                if self.gemma_sandwich:
                    h = residual + layer.post_attention_layernorm(o)
                    h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
                elif self.residual_multiplier is not None:
                    h = residual + o * self.residual_multiplier
                    h = h + layer.mlp(layer.post_attention_layernorm(h)) * self.residual_multiplier
                else:
                    h = residual + o
                    h = h + layer.mlp(layer.post_attention_layernorm(h))
            h = self.norm(h)
            if T > 1 and not self.genie:  # the prompt graph's logits: its last row only (a runtime pads a short chunk in front).
                # Cut after the final norm: the residual stream's readers stay Adds and norms, which the
                # phone's rewrite needs to carry it scaled (npu_rewrite.scale_residual).
                h = h[:, -1:, :]
            logits = self.lm_head(h)
            if self.logits_scaling is not None:
                logits = logits / self.logits_scaling
            if self.final_softcap is not None:
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
            return (logits.to(torch.float32), *new_kv)

        def example_inputs(self, position: int = 0):
            T = self.tokens
            if self.genie:
                ring = next((p["cache_len"] for p in self.plan if p["ring"]), 0)
                shapes = {"attention_mask": (1, 1, T, self.context_length), GENIE_SWA_MASK: (1, 1, T, ring + T)}
                if "default" in rope:  # the rotary tables: half their width (rot / 2)
                    shapes.update(dict.fromkeys(GENIE_ROPE, (1, 1, T, rope["default"][0].shape[0])))
                args = [torch.zeros(1, T, dtype=torch.int32)]
                for name in self.genie_inputs[1:]:
                    if name == GENIE_POSITIONS:
                        args.append(torch.zeros(1, 1, T, dtype=torch.int32))
                    else:
                        args.append(torch.zeros(shapes[name]))
                for p in self.plan:
                    args += [torch.zeros(1, self.n_kv, self.head_dim, p["cache_len"]),
                             torch.zeros(1, self.n_kv, p["cache_len"], self.head_dim)]
                return tuple(args)
            args = [torch.zeros(1, T, dtype=torch.int64), torch.arange(position, position + T, dtype=torch.int64)]
            args += [torch.zeros(T, m["cache_len"] + T) for m in self.masks.values()]
            for p in self.plan:
                shape = (1, self.n_kv, p["cache_len"], self.head_dim)
                args += [torch.zeros(shape), torch.zeros(shape)]
            return tuple(args)

    return DecodeStep().eval()


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    ins = ["input_ids", "position"]
    outs = ["logits"]
    for i in range(n_layers):
        ins += [f"past_key_{i}", f"past_value_{i}"]
        outs += [f"new_key_{i}", f"new_value_{i}"]
    return ins, outs


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------


def prompt_io_names(n_layers: int, masks: dict) -> tuple[list[str], list[str]]:
    ins, outs = io_names(n_layers)
    return ins[:2] + list(masks) + ins[2:], outs


def genie_inputs(plan: list[dict[str, Any]], rope_tables: int) -> list[str]:
    """Genie's inputs before the KV (the module docstring, "Genie's form")."""
    masks = ["attention_mask"] + ([GENIE_SWA_MASK] if any(p["ring"] for p in plan) else [])
    return ["input_ids", *masks, *(GENIE_ROPE if rope_tables == 1 else (GENIE_POSITIONS,))]


def genie_io_names(plan: list[dict[str, Any]], rope_tables: int = 1) -> tuple[list[str], list[str]]:
    """Genie's tensor names for a Genie-form layer plan (each layer's `prefix`: its cache group)."""
    ins = genie_inputs(plan, rope_tables)
    outs = ["logits"]
    for p in plan:
        ins += [f"{p['prefix']}key_{p['index']}_in", f"{p['prefix']}value_{p['index']}_in"]
        outs += [f"{p['prefix']}key_{p['index']}_out", f"{p['prefix']}value_{p['index']}_out"]
    return ins, outs


def _export_module(step, ins: list[str], outs: list[str], onnx_path: Path, opset: int, external: bool):
    """torch.onnx.export (dynamo, static shapes) of `step` to `onnx_path`, checked; the graph without weights."""
    import onnx
    import torch

    for stale in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
        stale.unlink(missing_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(step, step.example_inputs(), dynamo=True, opset_version=opset, verbose=False,
                                    input_names=ins, output_names=outs, external_data=external)
        program.save(str(onnx_path), external_data=external)
    onnx.checker.check_model(str(onnx_path), full_check=False)
    graph_model = onnx.load(str(onnx_path), load_external_data=False)
    got_in = [i.name for i in graph_model.graph.input]
    got_out = [o.name for o in graph_model.graph.output]
    if got_in != ins or got_out != outs:
        raise DecodeGraphError(f"exported names differ from the contract: {got_in} / {got_out}")
    return graph_model


def _values(vs) -> list[dict[str, Any]]:
    import onnx

    return [{"name": v.name, "shape": [d.dim_value for d in v.type.tensor_type.shape.dim],
             "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name} for v in vs]


def export_decode_step(hf_model_dir, out_dir, context_length: int, opset: int = 21,
                       mask_value: float = -100.0, prompt_tokens: int = 0) -> dict[str, Any]:
    """Export the decode step of the checkpoint at `hf_model_dir` to `out_dir`, and with `prompt_tokens`
    > 1 its prompt graph beside it (`prompt.onnx`, io.json "prompt").

    Writes `model.onnx` (+ `model.onnx.data` only if weights exceed 1.5 GB) and
    `io.json`; validates with onnx.checker; returns a summary dict. The prompt graph's weights, where
    they are external, are read from `model.onnx.data` (`prompt.onnx.data` holds only its own tensors).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = load_hf_model(hf_model_dir)
    cfg = _text_config(model.config)
    step = build_decode_step(model, context_length, mask_value)
    prompt = None
    if prompt_tokens > 1:
        pstep = build_prompt_step(model, context_length, prompt_tokens, mask_value)
        prompt = (pstep, prompt_io_names(cfg.num_hidden_layers, pstep.masks),
                  {"tokens": prompt_tokens, "masks": pstep.masks})
    graph_model, prompt, n_bytes, external = _export_graphs(out_dir, step, io_names(cfg.num_hidden_layers), opset,
                                                            prompt)
    t_export = time.perf_counter() - t0

    io = {
        "version": IO_VERSION,
        "inputs": _values(graph_model.graph.input),
        "outputs": _values(graph_model.graph.output),
        **_model_facts(model, step, context_length, opset, external),
        "mask_value": float(mask_value),
    }
    if prompt is not None:
        io["prompt"] = prompt
    return _written(out_dir, io, graph_model, n_bytes, t_export)


def _export_graphs(out_dir: Path, step, names: tuple[list[str], list[str]], opset: int,
                   prompt: tuple | None = None) -> tuple[Any, dict | None, int, bool]:
    """`step` (its input and output `names`) to out_dir/model.onnx, its weights external data where they pass
    1.5 GB; a stale prompt graph removed; with `prompt` = (its module, its names, its io.json facts) the
    prompt graph to prompt.onnx, its weights, where external, read from the token graph's data file, not
    written twice. Both forms' exports: (the token graph without weights, the prompt graph's io.json entry
    or None, the parameters' bytes, external or not)."""
    n_bytes = sum(p.numel() * p.element_size() for p in step.parameters())
    external = n_bytes > _EXTERNAL_DATA_BYTES
    onnx_path = out_dir / "model.onnx"
    graph_model = _export_module(step, *names, onnx_path, opset, external)
    prompt_path = out_dir / PROMPT_MODEL
    for stale in (prompt_path, prompt_path.with_name(PROMPT_MODEL + ".data")):
        stale.unlink(missing_ok=True)
    if prompt is None:
        return graph_model, None, n_bytes, external
    pstep, (p_ins, p_outs), facts = prompt
    pgraph = _export_module(pstep, p_ins, p_outs, prompt_path, opset, external)
    entry = {"file": PROMPT_MODEL, **facts}
    if external:  # the same weights: read from the decode step's data file, not written twice
        from pipeline.sources.tensorfile import share_external_data

        shared = share_external_data(onnx_path, prompt_path)
        entry.update(weights_from=onnx_path.name + ".data", shared_bytes=shared["shared_bytes"])
    entry.update(inputs=_values(pgraph.graph.input), outputs=_values(pgraph.graph.output))
    return graph_model, entry, n_bytes, external


def _model_facts(model, step, context_length: int, opset: int, external: bool) -> dict[str, Any]:
    """io.json's facts of the model and the graph, both forms alike."""
    cfg = _text_config(model.config)
    gen_cfg = getattr(model, "generation_config", None)
    return {
        "layers": [{k: p[k] for k in ("index", "type", "cache_len", "slot_rule")} for p in step.plan],
        "context_length": context_length,
        "vocab_size": cfg.vocab_size,
        "n_layers": cfg.num_hidden_layers,
        "n_kv_heads": cfg.num_key_value_heads,
        "head_dim": step.head_dim,
        "sliding_window": getattr(cfg, "sliding_window", None),
        "final_logit_softcapping": step.final_softcap,
        "attn_logit_softcapping_applied": step.attn_softcap[0],
        "opset": opset,
        "model_type": cfg.model_type,
        "bos_token_id": _first_id(getattr(cfg, "bos_token_id", None), getattr(gen_cfg, "bos_token_id", None)),
        "eos_token_id": _id_list(getattr(cfg, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)),
        "external_data": external,
    }


def _written(out_dir: Path, io: dict, graph_model, n_bytes: int, t_export: float) -> dict[str, Any]:
    """io.json written beside the graphs; the export's summary."""
    (out_dir / "io.json").write_text(json.dumps(io, indent=2) + "\n")
    ops: dict[str, int] = {}
    for node in graph_model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    onnx_path = out_dir / "model.onnx"
    prompt_path = out_dir / PROMPT_MODEL
    files = [onnx_path] + ([out_dir / "model.onnx.data"] if io["external_data"] else [])
    return {
        "onnx": str(onnx_path),
        "io": io,
        "nodes": len(graph_model.graph.node),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "bytes": sum(f.stat().st_size for f in files if f.exists()),
        "prompt_bytes": sum(f.stat().st_size for f in (prompt_path, prompt_path.with_name(PROMPT_MODEL + ".data"))
                            if f.exists()),
        "param_bytes": n_bytes,
        "export_s": round(t_export, 2),
    }


def export_genie_step(hf_model_dir, out_dir, context_length: int, opset: int = 21,
                      prompt_tokens: int = 0) -> dict[str, Any]:
    """The checkpoint's token graph in Genie's form (`model.onnx`, AR-1 over a context of `context_length`),
    with `prompt_tokens` > 1 its prompt graph beside it (`prompt.onnx`, AR-N, every row's logits), and
    io.json with `"form": "genie"` and the rotary frequencies Genie's engine computes its tables from
    (pipeline/runtimes/genie_feed.py feeds the graphs as that engine does)."""
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    # refused from the config, not after loading the weights (Gemma 3 270M: 19 s)
    plan = layer_plan(AutoConfig.from_pretrained(str(hf_model_dir)), context_length)
    why = genie_refusal(plan, context_length)
    if why:
        raise DecodeGraphError(f"Genie's form: {why}")
    prompt_why = genie_refusal(plan, context_length, prompt_tokens) if prompt_tokens > 1 else None
    if prompt_tokens >= context_length:  # a call of the whole context would leave its past no entry
        prompt_why = f"{prompt_tokens} tokens a call fill the context of {context_length}: its past would be empty"
    model = load_hf_model(hf_model_dir)
    step = build_genie_step(model, context_length, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    rope = _rope_tables(model, context_length)
    prompt = None
    if prompt_tokens > 1 and prompt_why is None:
        pstep = build_genie_step(model, context_length, prompt_tokens)
        prompt = (pstep, genie_io_names(pstep.plan, len(rope)), {"tokens": prompt_tokens})
    graph_model, prompt, n_bytes, external = _export_graphs(out_dir, step, genie_io_names(step.plan, len(rope)),
                                                            opset, prompt)
    io = {
        "version": IO_VERSION,
        "form": "genie",
        "inputs": _values(graph_model.graph.input),
        "outputs": _values(graph_model.graph.output),
        **_model_facts(model, step, context_length, opset, external),
        "mask": {"attend": GENIE_ATTEND, "masked": GENIE_MASKED},
    }
    io["layers"] = [{**x, "prefix": p["prefix"]} for x, p in zip(io["layers"], step.plan)]
    if len(rope) == 1:  # the frequencies Genie's engine computes its tables from
        inv_freq, scaling = rope["default"]
        io["rope"] = {"inv_freq": [float(x) for x in inv_freq.tolist()], "attention_scaling": scaling}
    else:  # Genie's absolute encoding: it writes positions, the graph holds the tables
        io["positions"] = {"encoding": "absolute", "input": GENIE_POSITIONS, "tables": sorted(rope)}
    sliding = [p for p in step.plan if p["ring"]]
    if sliding:  # Genie's cache group of the sliding layers: its prefix, mask, buffer and window
        io["cache_groups"] = [{"prefix": GENIE_SWA, "mask": GENIE_SWA_MASK, "layers": [p["index"] for p in sliding],
                               "buffer": sliding[0]["ring"], "window": sliding[0]["ring"] + 1}]
    if prompt is not None:
        io["prompt"] = prompt
    elif prompt_why:
        io["prompt_refused"] = prompt_why
    return _written(out_dir, io, graph_model, n_bytes, time.perf_counter() - t0)


def _first_id(*cands):
    for c in cands:
        if isinstance(c, (list, tuple)):
            c = c[0] if c else None
        if c is not None:
            return int(c)
    return None


def _id_list(*cands):
    for c in cands:
        if c is None:
            continue
        return [int(x) for x in (c if isinstance(c, (list, tuple)) else [c])]
    return []


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    """10*log10(sum ref^2 / sum (ref-test)^2); inf when identical."""
    ref = np.asarray(ref, dtype=np.float64)
    err = float(np.sum((ref - np.asarray(test, dtype=np.float64)) ** 2))
    return snr_from_sums(float(np.sum(ref ** 2)), err)


def snr_from_sums(sig: float, err: float) -> float:
    """snr_db from its two sums (sum ref^2, sum (ref-test)^2), for a measure summed in parts."""
    if err == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / err) if sig > 0 else -math.inf
