"""Running packed 4-bit weights: tinygemm modules, the MatMulNBits graph rewrite, a GPTQ reference.
(The quantize stage's codes are read by pipeline/quant/codes.py.)

- `TinygemmLinear` / `load_tinygemm_model`: an HF model whose quantized linears
  (lm_head included) run `aten._weight_int4pack_mm_for_cpu` with bf16
  activations for few rows (fp32 activations are ~40x slower there, fp16 ~34x
  slower measured here), and dequantize + an ordinary GEMM for prefill (rows >=
  `prefill_threshold`): from the packed layout on every call
  (`dequant_packed`, no second copy of the weights) or from a row-major copy
  of the codes made once at load (`deinterleave_once`, ~1/1.63 the prefill
  cost per the field notes, at the price of that copy).
- `quantize_onnx_matmuls`: rewrites the fp32 decode-step ONNX graph so each
  quantized linear is a com.microsoft MatMulNBits with our own codes/scales.
  The pack stage's ORT artifact was this until the GroupQueryAttention graph
  (pipeline/graphs/gqa_graph.py) replaced it; kept as the "before" arm of
  benchmarks/gqa_speed.py, which measures the two side by side.
- `GptqReference`: a GPTQ checkpoint folder dequantized to fp32 into the HF
  model: what vLLM computes, as a torch reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.quant import int4_layouts as L
from pipeline.quant.codes import PackError, read_quant  # noqa: F401 (PackError: raised here too)

TINYGEMM_TENSORS = "tinygemm.safetensors"
TINYGEMM_JSON = "tinygemm.json"
PREFILL_MODES = ("dequant_packed", "deinterleave_once")
_EXTERNAL_DATA_BYTES = int(1.5e9)


# --------------------------------------------------------------------------
# tinygemm
# --------------------------------------------------------------------------


def _torch():
    import torch

    return torch


class TinygemmLinear(_torch().nn.Module):
    """nn.Linear replacement holding tinygemm-packed int4 weights (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, packed, scales_and_zeros,
                 bias=None, *, layout: dict | None = None, prefill: str = "dequant_packed",
                 prefill_threshold: int = 16, rowmajor=None):
        torch = _torch()
        super().__init__()
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.group_size = int(group_size)
        self.prefill = prefill
        self.prefill_threshold = int(prefill_threshold)
        self.layout = layout or L.tinygemm_layout()
        self.kernel_ok = packed is not None
        if not self.kernel_ok and rowmajor is None:
            raise ValueError("a layer the kernel cannot take needs its row-major codes")
        self.register_buffer("packed", packed if packed is not None else torch.empty(0, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", bias.detach().clone() if bias is not None else None)
        if rowmajor is None and prefill == "deinterleave_once":
            codes = L.codes_from_packed(packed, self.out_features, self.in_features, self.layout)
            rowmajor = L.pack_rowmajor(codes)
        self.register_buffer("rowmajor", rowmajor)

    def dequantized_weight(self, dtype=None):
        """The weight [N, K] as the kernel sees it (float32 unless `dtype`)."""
        if self.rowmajor is not None:
            codes = L.unpack_rowmajor(self.rowmajor)
            return L.dequant_tinygemm(codes, self.scales_and_zeros, self.group_size, dtype)
        return L.dequant_from_packed(self.packed, self.scales_and_zeros, self.group_size,
                                     self.out_features, self.in_features, self.layout, dtype)

    def forward(self, x):
        torch = _torch()
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.kernel_ok and x2.shape[0] < self.prefill_threshold:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.to(self.scales_and_zeros.dtype).contiguous(), self.packed, self.group_size,
                self.scales_and_zeros)
            y = y.to(x.dtype)
        else:
            w = self.dequantized_weight(torch.float32)
            y = (x2.to(torch.float32) @ w.t()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, g={self.group_size}, "
                f"prefill={self.prefill}, kernel={'tinygemm' if self.kernel_ok else 'dequant_rowmajor'}")


def pack_tinygemm(layers: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """({tensor name: tensor}, {layer: record}) for tinygemm.safetensors / tinygemm.json.

    Layers the kernel refuses (N not a multiple of 16) keep row-major codes and
    run dequantize + GEMM at every row count; the record says so.
    """
    torch = _torch()
    tensors, records = {}, {}
    layout = L.tinygemm_layout()
    for name, (q, s, z, group_size) in layers.items():
        n, k = q.shape
        why = L.tinygemm_supports(n, k, group_size)
        sz = L.tinygemm_scales_and_zeros(s, z, torch.bfloat16)
        tensors[f"{name}.scales_and_zeros"] = sz
        if why is None:
            packed, _ = L.to_tinygemm(q, s, z, group_size)
            tensors[f"{name}.packed"] = packed
            kind = "tinygemm"
        else:
            tensors[f"{name}.rowmajor"] = L.pack_rowmajor(q)
            kind = "dequant_rowmajor"
        records[name] = {"out_features": n, "in_features": k, "group_size": group_size, "kernel": kind,
                         "tail_channels": n % layout["block_n"] if kind == "tinygemm" else None,
                         "reason": why}
    return tensors, records


def _set_module(model, name: str, module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def load_tinygemm_model(untied_hf_dir, packed_dir, prefill_mode: str | None = None,
                        prefill_threshold: int | None = None, dtype=None):
    """The HF model of `untied_hf_dir` with every quantized linear swapped for a TinygemmLinear.

    A packed tensor is only valid for the CPU capability it was packed on
    (tinygemm.json `layout`); on another capability the codes are decoded from
    the stored layout and re-packed for this CPU.
    """
    torch = _torch()
    from safetensors.torch import load_file

    from pipeline.sources.checkpoint_files import load_hf_model

    packed_dir = Path(packed_dir)
    meta = json.loads((packed_dir / TINYGEMM_JSON).read_text())
    tensors = load_file(str(packed_dir / TINYGEMM_TENSORS))
    mode = prefill_mode or meta.get("prefill", "dequant_packed")
    threshold = int(prefill_threshold if prefill_threshold is not None else meta.get("prefill_threshold", 16))
    stored = meta["layout"]
    here = L.tinygemm_layout()
    repack = (stored["block_n"], stored["full_block"]) != (here["block_n"], here["full_block"])
    model = load_hf_model(untied_hf_dir)
    if dtype is not None:
        model = model.to(dtype)
    for name, rec in meta["layers"].items():
        g = int(rec.get("group_size", meta["group_size"]))
        old = model.get_submodule(name)
        n, k = rec["out_features"], rec["in_features"]
        if (old.out_features, old.in_features) != (n, k):
            raise PackError(f"{name}: model has [{old.out_features}, {old.in_features}], packed [{n}, {k}]")
        sz = tensors[f"{name}.scales_and_zeros"]
        packed = tensors.get(f"{name}.packed")
        rowmajor = tensors.get(f"{name}.rowmajor")
        if packed is not None and repack:
            codes = L.codes_from_packed(packed, n, k, stored)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        new = TinygemmLinear(k, n, g, packed, sz, getattr(old, "bias", None), layout=here, prefill=mode,
                             prefill_threshold=threshold, rowmajor=rowmajor)
        _set_module(model, name, new)
    return model.eval()


# --------------------------------------------------------------------------
# ONNX: MatMul -> MatMulNBits
# --------------------------------------------------------------------------


def _weight_candidates(graph) -> list[dict[str, Any]]:
    """MatMul nodes whose B is a constant weight: W^T [K, N] directly, or Transpose(W [N, K])."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    out = []
    for idx, node in enumerate(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        b = node.input[1]
        if b in inits and len(inits[b].dims) == 2:
            out.append({"index": idx, "node": node, "init": b, "transposed": True,
                        "w": lambda name=b: numpy_helper.to_array(inits[name]).T})
            continue
        p = producer.get(b)
        if p is not None and p.op_type == "Transpose" and p.input[0] in inits and len(inits[p.input[0]].dims) == 2:
            perm = [list(a.ints) for a in p.attribute if a.name == "perm"]
            if not perm or perm[0] == [1, 0]:
                out.append({"index": idx, "node": node, "init": p.input[0], "transposed": False,
                            "transpose_node": p, "w": lambda name=p.input[0]: numpy_helper.to_array(inits[name])})
    return out


def _match_layers(cands, deq: dict[str, np.ndarray]) -> dict[int, str]:
    """{candidate index: layer name}: the graph's constant weight each quantized layer came from.

    The exporter folds the transposes into anonymous initializers (`val_N`), so
    names cannot be matched; the fp32 weight is matched to the dequantized
    codes instead: same [N, K], and nearest by a random projection, then
    confirmed on the whole tensor (rounding error is a few % of the weight; an
    unrelated tensor of the same shape is ~140%). One-to-one, or it fails.
    """
    rng = np.random.default_rng(0)
    proj: dict[int, np.ndarray] = {}
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, w in deq.items():
        by_shape.setdefault(w.shape, []).append(name)
    fp_layer = {}
    for name, w in deq.items():
        r = proj.setdefault(w.shape[1], rng.standard_normal((w.shape[1], 4)).astype(np.float32))
        fp_layer[name] = w @ r
    taken: dict[str, int] = {}
    result = {}
    for ci, c in enumerate(cands):
        w = np.asarray(c["w"](), dtype=np.float32)
        names = by_shape.get(tuple(w.shape), [])
        if not names:
            continue
        f = w @ proj[w.shape[1]]
        dist = sorted((float(np.linalg.norm(f - fp_layer[n]) / (np.linalg.norm(fp_layer[n]) + 1e-30)), n)
                      for n in names)
        best_d, best = dist[0]
        if best_d > 0.5:
            continue  # a constant MatMul that is not one of the quantized layers
        if len(dist) > 1 and dist[1][0] < 2 * best_d:
            raise PackError(f"graph weight {c['init']} matches both {best} and {dist[1][1]}: ambiguous")
        full = float(np.linalg.norm(w - deq[best]) / (np.linalg.norm(deq[best]) + 1e-30))
        if full > 0.5:
            continue
        if best in taken:
            raise PackError(f"two graph weights ({cands[taken[best]]['init']}, {c['init']}) match layer {best}")
        taken[best] = ci
        result[ci] = best
    return result


def quantize_onnx_matmuls(fp32_onnx_path, quant_dir, out_path, accuracy_level: int = 4) -> dict[str, Any]:
    """Rewrite every quantized linear of the fp32 decode step into com.microsoft.MatMulNBits.

    Uses the quantize stage's own codes and scales (no second rounding). Raises
    PackError if any quantized layer (lm_head included) is not found in the graph.
    """
    import onnx
    from onnx import helper, numpy_helper

    from pipeline.sources.tensorfile import load_onnx

    meta, layers = read_quant(quant_dir)
    model = load_onnx(fp32_onnx_path)
    graph = model.graph
    deq = {name: L.dequant(q, s, z, g) for name, (q, s, z, g) in layers.items()}
    cands = _weight_candidates(graph)
    matched = _match_layers(cands, deq)
    missing = sorted(set(layers) - set(matched.values()))
    if missing:
        raise PackError(f"{len(missing)} quantized layer(s) not found as a MatMul weight in {fp32_onnx_path}: "
                        f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")

    replaced_nodes, new_inits, records = {}, [], {}
    for ci, name in matched.items():
        c = cands[ci]
        q, s, z, g = layers[name]
        n, k = q.shape
        b, sc, zp = L.to_matmulnbits(q, s, z, g)
        ins = [c["node"].input[0], f"{name}.nbits_B", f"{name}.nbits_scales"]
        new_inits += [numpy_helper.from_array(b, ins[1]), numpy_helper.from_array(sc, ins[2])]
        if zp is not None:
            ins.append(f"{name}.nbits_zero_points")
            new_inits.append(numpy_helper.from_array(zp, ins[3]))
        node = helper.make_node("MatMulNBits", ins, list(c["node"].output), name=f"{c['node'].name}_nbits",
                                domain="com.microsoft", K=k, N=n, bits=4, block_size=g,
                                accuracy_level=int(accuracy_level))
        replaced_nodes[c["index"]] = node
        records[name] = {"node": node.name, "graph_weight": c["init"], "K": k, "N": n, "block_size": g,
                         "zero_points": zp is not None}

    nodes = [replaced_nodes.get(i, node) for i, node in enumerate(graph.node)]
    used = {i for node in nodes for i in node.input}
    # Drop Transposes that fed a rewritten MatMul, then initializers nothing reads.
    nodes = [node for node in nodes if not (node.op_type == "Transpose" and not any(o in used for o in node.output))]
    used = {i for node in nodes for i in node.input} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(nodes)
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    if not any(op.domain == "com.microsoft" for op in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n_bytes = sum(int(np.prod(i.dims)) * np.dtype(helper.tensor_dtype_to_np_dtype(i.data_type)).itemsize
                  for i in graph.initializer)
    external = n_bytes > _EXTERNAL_DATA_BYTES
    data_name = out_path.name + ".data"
    for stale in (out_path, out_path.with_name(data_name)):
        stale.unlink(missing_ok=True)
    onnx.save_model(model, str(out_path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    onnx.checker.check_model(str(out_path) if external else model, full_check=False)
    ops: dict[str, int] = {}
    for node in graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    files = [out_path] + ([out_path.with_name(data_name)] if external else [])
    return {"converted": len(matched), "layers": records, "external_data": external,
            "bytes": sum(f.stat().st_size for f in files), "ops": ops,
            "unmatched_matmuls": len(cands) - len(matched)}


# --------------------------------------------------------------------------
# GPTQ reference
# --------------------------------------------------------------------------


class GptqReference:
    """A GPTQ checkpoint folder (as the pack stage writes it) dequantized to fp32 in the HF model.

    `GptqReference(dir).model` is a plain fp32 HF model whose quantized linears
    hold (q - z) * s from the GPTQ tensors (scales as stored, fp16): what vLLM's
    CPU kernel computes up to its bf16 activations. Pass it to
    `runtimes.reference.TorchReference(ref.model)`.
    """

    def __init__(self, gptq_dir):
        torch = _torch()
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        self.dir = Path(gptq_dir)
        raw = json.loads((self.dir / "config.json").read_text())
        qc = raw.get("quantization_config") or {}
        if qc.get("quant_method") != "gptq" or int(qc.get("bits", 0)) != 4:
            raise PackError(f"{self.dir}: not a 4-bit GPTQ checkpoint ({qc})")
        if qc.get("desc_act"):
            raise PackError(f"{self.dir}: desc_act (act-order) checkpoints are not supported")
        self.group_size = int(qc["group_size"])
        config = AutoConfig.from_pretrained(str(self.dir))
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        tensors = {}
        for f in sorted(self.dir.glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        state, self.layers = {}, []
        for key in list(tensors):
            if key.endswith(".qweight"):
                base = key[: -len(".qweight")]
                parts = {p: tensors.pop(f"{base}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx")
                         if f"{base}.{p}" in tensors}
                q, s, z = L.from_gptq(parts)  # group size from the scales' shape
                state[f"{base}.weight"] = torch.from_numpy(L.dequant(q, s, z, q.shape[1] // s.shape[1]))
                self.layers.append(base)
        state.update({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in tensors.items()})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected:
            raise PackError(f"{self.dir}: tensors the model does not have: {unexpected[:5]}")
        expected = {n for n, _ in model.named_parameters()}
        lost = [m for m in missing if m in expected]
        if lost:
            raise PackError(f"{self.dir}: parameters missing from the checkpoint: {lost[:5]}")
        self.model = model.eval()
