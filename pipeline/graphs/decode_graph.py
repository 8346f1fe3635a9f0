"""The decode-step graph: one token of a Hugging Face decoder with explicit KV.

Shared by `export`, `verify_parity` and the benchmark stages. Four pieces:

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

- `export_decode_step(...)`: the module to `model.onnx` (dynamo exporter, static
  shapes) plus `io.json` describing inputs, outputs and per-layer slot rules.
- `OnnxDecoder`: the onnxruntime runtime of that artifact (numpy caches).
- `TorchReference`: the eager HF model decoding with its own cache, the same
  `reset/step/generate_greedy` API: the parity reference and fp32 baseline.
  Its `greedy_run` is the parity teacher (`ReferenceRun`): the greedy
  continuation and every step's final hidden state, never a step's logits.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from pipeline.sources.checkpoint_files import load_hf_model

FULL = "full_attention"
SLIDING = "sliding_attention"
IO_VERSION = 1
# Static rope types: inv_freq is fixed at init, so reading HF's buffers is exact.
_STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}
_EXTERNAL_DATA_BYTES = int(1.5e9)


class DecodeGraphError(ValueError):
    """A model or request this decode-step graph cannot serve (user-facing)."""


# --------------------------------------------------------------------------
# Model introspection
# --------------------------------------------------------------------------


def _text_config(config):
    return getattr(config, "text_config", None) or config


def layer_types(cfg, error: type[Exception] = None) -> tuple[list[str], int | None]:
    """(each layer's type, sliding_window) of a text config, checked: every type
    full or sliding, and a sliding layer only with a window. Shared by the two
    graph builders (this module's export, pipeline/graphs/gqa_graph.py)."""
    error = error or DecodeGraphError
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or [FULL] * n)
    if len(types) < n:
        raise error(f"config.layer_types has {len(types)} entries for {n} layers")
    window = getattr(cfg, "sliding_window", None)
    for i, t in enumerate(types[:n]):
        if t not in (FULL, SLIDING):
            raise error(f"layer {i}: unsupported layer type {t!r} (only {FULL}, {SLIDING})")
        if t == SLIDING and not window:
            raise error(f"layer {i} is {SLIDING} but config.sliding_window is {window!r}")
    return types[:n], window


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


def _rope_tables(hf_model) -> dict[str, tuple["torch.Tensor", float]]:
    """{rope key: (inv_freq, attention_scaling)} read from HF's rotary module.

    Gemma3 keeps one table per layer type ("<type>_inv_freq"); Llama/Qwen3 one
    ("inv_freq", key "default"). Reading the buffers HF computed honours static
    scalings (linear, llama3, yarn, proportional) exactly; position-dependent
    ones (dynamic, longrope) are refused.
    """
    import torch

    rot = getattr(hf_model.model, "rotary_emb", None)
    if rot is None:
        raise DecodeGraphError("the model has no model.rotary_emb: not a rotary decoder this graph knows")
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
    rope = _rope_tables(hf_model)

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
            self.gemma_sandwich = hasattr(self.layers[0], "pre_feedforward_layernorm")

        @staticmethod
        def _rotate(x, cos, sin):
            rot = cos.shape[-1]
            if rot == x.shape[-1]:
                x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
                return x * cos + torch.cat((-x2, x1), dim=-1) * sin
            xr, xp = x[..., :rot], x[..., rot:]  # partial rotary: rotate the leading dims
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
            return torch.cat((xr * cos + torch.cat((-x2, x1), dim=-1) * sin, xp), dim=-1)

        def forward(self, input_ids, position, *past):
            h = self.embed_tokens(input_ids)  # [1, 1, H]
            pos_f = position.to(torch.float32)  # [1]
            trig = {}
            for key in self.rope_scale:
                freqs = pos_f[:, None] * getattr(self, f"inv_freq_{key}")[None, :]  # [1, rot/2]
                emb = torch.cat((freqs, freqs), dim=-1)  # [1, rot]
                trig[key] = (emb.cos() * self.rope_scale[key], emb.sin() * self.rope_scale[key])
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

            new_kv = []
            for p in self.plan:
                i = p["index"]
                layer = self.layers[i]
                attn = layer.self_attn
                past_k, past_v = past[2 * i], past[2 * i + 1]
                residual = h
                x = layer.input_layernorm(h)
                q = attn.q_proj(x).view(1, 1, self.n_heads, self.head_dim)
                k = attn.k_proj(x).view(1, 1, self.n_kv, self.head_dim)
                v = attn.v_proj(x).view(1, 1, self.n_kv, self.head_dim)
                if hasattr(attn, "q_norm"):
                    q = attn.q_norm(q)
                    k = attn.k_norm(k)
                q = q.transpose(1, 2)  # [1, nh, 1, hd]
                k = k.transpose(1, 2)  # [1, nkv, 1, hd]
                v = v.transpose(1, 2)
                cos, sin = trig[self.rope_key[i]]
                q = self._rotate(q, cos, sin)
                k = self._rotate(k, cos, sin)
                new_kv += [k, v]
                keys = torch.cat((past_k, k), dim=2)  # [1, nkv, L+1, hd]
                values = torch.cat((past_v, v), dim=2)
                qg = q.reshape(1, self.n_kv, self.group, self.head_dim) * attn.scaling
                scores = torch.matmul(qg, keys.transpose(2, 3))  # [1, nkv, group, L+1]
                softcap = self.attn_softcap[i]
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                scores = scores + masks[(p["cache_len"], p["ring"], p["window"])]
                probs = torch.softmax(scores, dim=-1)
                o = torch.matmul(probs, values).reshape(1, 1, self.n_heads * self.head_dim)
                o = attn.o_proj(o)
                if self.gemma_sandwich:
                    h = residual + layer.post_attention_layernorm(o)
                    h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
                else:
                    h = residual + o
                    h = h + layer.mlp(layer.post_attention_layernorm(h))
            logits = self.lm_head(self.norm(h))
            if self.final_softcap is not None:
                logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
            return (logits.to(torch.float32), *new_kv)

        def example_inputs(self, position: int = 0):
            args = [torch.zeros(1, 1, dtype=torch.int64), torch.tensor([position], dtype=torch.int64)]
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


def export_decode_step(hf_model_dir, out_dir, context_length: int, opset: int = 21,
                       mask_value: float = -100.0) -> dict[str, Any]:
    """Export the decode step of the checkpoint at `hf_model_dir` to `out_dir`.

    Writes `model.onnx` (+ `model.onnx.data` only if weights exceed 1.5 GB) and
    `io.json`; validates with onnx.checker; returns a summary dict.
    """
    import onnx
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = load_hf_model(hf_model_dir)
    cfg = _text_config(model.config)
    step = build_decode_step(model, context_length, mask_value)
    args = step.example_inputs()
    ins, outs = io_names(cfg.num_hidden_layers)
    n_bytes = sum(p.numel() * p.element_size() for p in step.parameters())
    external = n_bytes > _EXTERNAL_DATA_BYTES
    onnx_path = out_dir / "model.onnx"
    for stale in (onnx_path, out_dir / "model.onnx.data"):
        stale.unlink(missing_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(step, args, dynamo=True, opset_version=opset,
                                    input_names=ins, output_names=outs, external_data=external)
        program.save(str(onnx_path), external_data=external)
    t_export = time.perf_counter() - t0

    if external:
        onnx.checker.check_model(str(onnx_path), full_check=False)
        graph_model = onnx.load(str(onnx_path), load_external_data=False)
    else:
        graph_model = onnx.load(str(onnx_path))
        onnx.checker.check_model(graph_model, full_check=False)
    got_in = [i.name for i in graph_model.graph.input]
    got_out = [o.name for o in graph_model.graph.output]
    if got_in != ins or got_out != outs:
        raise DecodeGraphError(f"exported names differ from the contract: {got_in} / {got_out}")

    def _shape(v):
        return [d.dim_value for d in v.type.tensor_type.shape.dim]

    def _dtype(v):
        return onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name

    plan = layer_plan(cfg, context_length)
    gen_cfg = getattr(model, "generation_config", None)
    io = {
        "version": IO_VERSION,
        "inputs": [{"name": v.name, "shape": _shape(v), "dtype": _dtype(v)} for v in graph_model.graph.input],
        "outputs": [{"name": v.name, "shape": _shape(v), "dtype": _dtype(v)} for v in graph_model.graph.output],
        "layers": [{k: p[k] for k in ("index", "type", "cache_len", "slot_rule")} for p in plan],
        "context_length": context_length,
        "vocab_size": cfg.vocab_size,
        "n_layers": cfg.num_hidden_layers,
        "n_kv_heads": cfg.num_key_value_heads,
        "head_dim": step.head_dim,
        "sliding_window": getattr(cfg, "sliding_window", None),
        "mask_value": float(mask_value),
        "final_logit_softcapping": step.final_softcap,
        "attn_logit_softcapping_applied": step.attn_softcap[0],
        "opset": opset,
        "model_type": cfg.model_type,
        "bos_token_id": _first_id(getattr(cfg, "bos_token_id", None), getattr(gen_cfg, "bos_token_id", None)),
        "eos_token_id": _id_list(getattr(cfg, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)),
        "external_data": external,
    }
    (out_dir / "io.json").write_text(json.dumps(io, indent=2) + "\n")
    ops: dict[str, int] = {}
    for node in graph_model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    files = [onnx_path] + ([out_dir / "model.onnx.data"] if external else [])
    return {
        "onnx": str(onnx_path),
        "io": io,
        "nodes": len(graph_model.graph.node),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "bytes": sum(f.stat().st_size for f in files if f.exists()),
        "param_bytes": n_bytes,
        "export_s": round(t_export, 2),
    }


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


# --------------------------------------------------------------------------
# Runtimes
# --------------------------------------------------------------------------


class ContextFull(RuntimeError):
    """A step past the exported context length."""


class _Greedy:
    def generate_greedy(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        """Reset, feed the prompt, then `n` greedy tokens; returns those n tokens."""
        if not len(prompt_ids):
            raise ValueError("generate_greedy needs at least one prompt token")
        self.reset()
        logits = None
        for t in prompt_ids:
            logits = self.step(int(t))
        out = []
        for k in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            if k + 1 < n:
                logits = self.step(tok)
        return out


def session_options(threads: int, *, spinning: bool | None = None, opt_level: str = "all",
                    profile: str | None = None, config: dict | None = None):
    """ONNX Runtime session options for one decode stream, as both decoders run it:
    `threads` intra-op, one inter-op thread, sequential execution."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt_level]
    if spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    for key, value in (config or {}).items():
        so.add_session_config_entry(str(key), str(value))
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = profile
    return so


def _lookup(session, name: str, ids: np.ndarray, token_id: int) -> np.ndarray:
    """One token's embedding row from an embedding model (qnn.write_embedding's), flat."""
    ids[0, 0] = token_id
    return session.run(None, {name: ids})[0].reshape(-1)


class OnnxDecoder(_Greedy):
    """Runs an exported decode step with onnxruntime; numpy caches, slot writes per io.json."""

    def __init__(self, artifact_dir, threads: int = 1, providers: Iterable = ("CPUExecutionProvider",), *,
                 model_file: str = "model.onnx", session=None, embed=None, extra_outputs: Sequence[str] = (),
                 config: dict | None = None):
        """`artifact_dir` holds io.json; the graph is `model_file` inside it, or
        `session` when given (a graph of the same io.json compiled elsewhere,
        e.g. a QNN context binary: pipeline/graphs/qnn.py).

        A graph whose token embedding was taken out (the phone's: io.json
        "embedding", npu_rewrite.embedding_input) takes `inputs_embeds`: each
        step first runs io.json's embedding model (on the CPU EP) on the token,
        or `embed(token_id) -> [hidden]` when given (the pack stage's check of
        its rewrites, with the float table).

        `extra_outputs`: more of the graph's outputs fetched each step, left in
        `self.extra` (name -> array) for a caller that probes the graph (the
        pack stage's residual-stream range). `config`: session config entries
        for the graph's session (pipeline/graphs/qnn.py's CPU stand-in of a QDQ graph)."""
        import onnxruntime as ort

        self.dir = Path(artifact_dir)
        self.io = json.loads((self.dir / "io.json").read_text())
        self.session = session or ort.InferenceSession(str(self.dir / model_file),
                                                       sess_options=session_options(threads, config=config),
                                                       providers=list(providers))
        self.context_length = int(self.io["context_length"])
        self.vocab_size = int(self.io["vocab_size"])
        shapes = {i["name"]: i["shape"] for i in self.io["inputs"]}
        self._ids = np.zeros((1, 1), dtype=np.int64)
        self._pos = np.zeros((1,), dtype=np.int64)
        self.feed: dict[str, np.ndarray] = {"input_ids": self._ids, "position": self._pos}
        self._embed = None
        lookup = self.io.get("embedding")
        if lookup is not None:  # the embedding runs before the graph, its rows fed as the graph's input
            self._embeds = np.zeros(shapes[lookup["output"]], dtype=np.float32)
            self.feed = {lookup["output"]: self._embeds, "position": self._pos}
            if embed is None:
                table = ort.InferenceSession(str(self.dir / lookup["model"]), sess_options=session_options(threads),
                                             providers=["CPUExecutionProvider"])
                embed = functools.partial(_lookup, table, lookup["input"], self._ids)
            self._embed = embed
        self._caches: list[tuple[np.ndarray, np.ndarray, int]] = []  # (K, V, ring size or 0)
        for layer in self.io["layers"]:
            i = layer["index"]
            rule = layer["slot_rule"]
            if rule == "position":
                ring = 0
            elif rule.startswith("position mod "):
                ring = int(rule.split()[-1])
            else:
                raise ValueError(f"io.json layer {i}: unknown slot_rule {rule!r}")
            k = np.zeros(shapes[f"past_key_{i}"], dtype=np.float32)
            v = np.zeros(shapes[f"past_value_{i}"], dtype=np.float32)
            if k.shape[2] != layer["cache_len"]:
                raise ValueError(f"io.json layer {i}: cache_len {layer['cache_len']} != input shape {k.shape}")
            self.feed[f"past_key_{i}"] = k
            self.feed[f"past_value_{i}"] = v
            self._caches.append((k, v, ring))
        self.output_names = [o["name"] for o in self.io["outputs"]]
        self.extra_names = list(extra_outputs)
        self.extra: dict[str, np.ndarray] = {}
        self.position = 0

    def reset(self) -> None:
        for k, v, _ in self._caches:
            k.fill(0.0)
            v.fill(0.0)
        self.position = 0

    def next_inputs(self, token_id: int) -> dict[str, np.ndarray]:
        """A copy of the inputs the next step(token_id) will feed (a calibration sample)."""
        feed = {k: v.copy() for k, v in self.feed.items()}
        if self._embed is None:
            feed["input_ids"][0, 0] = token_id
        else:
            feed[self.io["embedding"]["output"]].reshape(-1)[:] = self._embed(token_id)
        feed["position"][0] = self.position
        return feed

    def step(self, token_id: int) -> np.ndarray:
        p = self.position
        if p >= self.context_length:
            raise ContextFull(f"position {p} is past the exported context_length {self.context_length}; "
                              "reset() or export with a larger export.context_length")
        self._ids[0, 0] = token_id
        if self._embed is not None:
            self._embeds.reshape(-1)[:] = self._embed(token_id)
        self._pos[0] = p
        res = self.session.run(self.output_names + self.extra_names, self.feed)
        self.extra = dict(zip(self.extra_names, res[len(self.output_names):]))
        for j, (k, v, ring) in enumerate(self._caches):
            slot = p % ring if ring else p  # p >= 0: Python's % is non-negative anyway
            k[:, :, slot, :] = res[1 + 2 * j][:, :, 0, :]
            v[:, :, slot, :] = res[2 + 2 * j][:, :, 0, :]
        self.position = p + 1
        return res[0].reshape(-1)


class TorchReference(_Greedy):
    """The eager HF model (fp32) decoding token by token with its own cache."""

    def __init__(self, model_or_dir, threads: int | None = None, attn_implementation: str | None = "eager"):
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        if isinstance(model_or_dir, (str, Path)):
            self.model = load_hf_model(model_or_dir, attn_implementation)
        else:
            self.model = model_or_dir.eval()
        self.config = _text_config(self.model.config)
        self.vocab_size = self.config.vocab_size
        self._head_checked = False
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.position = 0

    def step(self, token_id: int) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[int(token_id)]], dtype=torch.long),
                             position_ids=torch.tensor([[self.position]], dtype=torch.long),
                             past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.position += 1
        return out.logits[0, -1].to(torch.float32).numpy()

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """The whole prompt in one forward (batched prefill); logits of its last token."""
        import torch

        ids = [int(t) for t in token_ids]
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long),
                             position_ids=torch.arange(self.position, self.position + len(ids)).unsqueeze(0),
                             past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.position += len(ids)
        return out.logits[0, -1].to(torch.float32).numpy()

    def head(self, hidden) -> np.ndarray:
        """Logits float32 [n, vocab] of final hidden states [n, hidden] (after the final norm), as
        the HF forward computes them from its last_hidden_state (transformers 5.x *ForCausalLM,
        Gemma3ForCausalLM included): lm_head, then final_logit_softcapping when the config has
        one, in HF's order (divide, tanh, multiply). `greedy_run` checks this against the model's
        own logits once, so a head this does not reproduce is refused rather than mis-measured."""
        return _Head(self.model.lm_head, getattr(self.config, "final_logit_softcapping", None))(hidden)

    def _hidden(self, token_ids: Sequence[int]):
        """Final hidden states [len(ids), hidden] of `token_ids` fed at the current position, with the cache."""
        import torch

        base = getattr(self.model, "model", None)
        if base is None or not hasattr(self.model, "lm_head"):
            raise DecodeGraphError(f"{type(self.model).__name__}: expected a *ForCausalLM with .model and .lm_head")
        ids = [int(t) for t in token_ids]
        with torch.inference_mode():
            out = base(input_ids=torch.tensor([ids], dtype=torch.long),
                       position_ids=torch.arange(self.position, self.position + len(ids)).unsqueeze(0),
                       past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.position += len(ids)
        return out.last_hidden_state[0]

    def _check_head(self, token_id: int) -> None:
        import torch

        if self._head_checked:
            return
        self.reset()
        with torch.inference_mode():
            want = self.model(input_ids=torch.tensor([[int(token_id)]], dtype=torch.long),
                              position_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False).logits[0, -1]
        want = want.to(torch.float32).numpy()
        self.reset()
        got = self.head(self._hidden([token_id]))[0]
        self.reset()
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max()))):
            raise DecodeGraphError(f"{type(self.model).__name__}: its logits are not lm_head(final hidden state) "
                                   "[+ final_logit_softcapping]; the parity reference cannot recompute them")
        self._head_checked = True

    def greedy_run(self, prompt_ids: Sequence[int], n: int,
                   progress: Callable[[int], Any] | None = None) -> "ReferenceRun":
        """Reset, the prompt in one forward, then `n` greedy tokens one cached step at a time.

        Keeps each fed token's final hidden state ([len(prompt) + n, hidden]: the last greedy
        token is fed too, so a decoder fed prompt + continuation has a reference row at every
        step), never a step's logits: at a 262,144-token vocabulary those are 1 MiB a step in
        fp32, [steps, hidden] is 640 floats. Each step's argmax is taken from `head` of its state,
        the same numbers `step` returns; `progress(k)` is told of every k tokens fed."""
        import torch

        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("greedy_run needs at least one prompt token")
        self._check_head(ids[0])
        self.reset()
        states = [self._hidden(ids)]
        if progress:
            progress(len(ids))
        cont = []
        for _ in range(n):
            tok = int(np.argmax(self.head(states[-1][-1:])[0]))
            cont.append(tok)
            states.append(self._hidden([tok]))
            if progress:
                progress(1)
        # the run keeps the head alone, not this reference: once the runs are made the model can go
        # (the parity stage drops it before loading the artifact's own model beside them)
        return ReferenceRun(ids, cont, torch.cat(states),
                            _Head(self.model.lm_head, getattr(self.config, "final_logit_softcapping", None)))


class _Head:
    """lm_head then the final softcap (TorchReference.head), holding the head's module only."""

    def __init__(self, lm_head, cap):
        self.lm_head, self.cap = lm_head, cap

    def __call__(self, hidden) -> np.ndarray:
        import torch

        with torch.inference_mode():
            logits = self.lm_head(hidden)
            if self.cap is not None:
                logits = logits / self.cap
                logits = torch.tanh(logits)
                logits = logits * self.cap
        return logits.to(torch.float32).numpy()


class ReferenceRun:
    """A reference's greedy run of one prompt in O(steps x hidden): the prompt, its greedy
    continuation, and the final hidden state after each fed token; `logits(start, stop)`
    recomputes those steps' logits (float64) when they are compared."""

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], hidden, head: Callable):
        if len(hidden) != len(prompt) + len(continuation):
            raise ValueError(f"{len(hidden)} hidden states for {len(prompt)} + {len(continuation)} tokens")
        self.prompt = list(prompt)
        self.continuation = list(continuation)
        self.hidden = hidden
        self.head = head

    @property
    def steps(self) -> int:
        return len(self.hidden)

    def logits(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.head(self.hidden[start:stop]), dtype=np.float64)


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
