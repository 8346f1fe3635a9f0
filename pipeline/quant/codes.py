"""The quantize stage's output, `edgekiln-int4/1`: quant.json and quantized.safetensors,
read as {layer: (qweight, scales, zeros, group size)} by every packer (the GQA graph,
tinygemm, GGUF Q4_0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.quant import int4_layouts as L

QUANT_JSON = "quant.json"
QUANT_TENSORS = "quantized.safetensors"


class PackError(ValueError):
    """A quantized checkpoint or graph that cannot be packed as asked (user-facing)."""


def read_quant(quant_dir, bits: tuple[int, ...] = (4,), mixed_rows: bool = False
               ) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]]:
    """(quant.json, {layer: (qweight uint8 [N,K], scales f32 [N,K/g], zeros uint8 [N,K/g], g)}).

    g is the layer's own `group_size` when quant.json records one (the quantize
    stage's `group_fallback: divisor`), else the top-level group size. `bits`:
    the layer widths the caller packs; a layer of another width (an 8-bit head,
    `quantize.head_bits`) is a PackError naming it, so no 4-bit-only packer
    ever sees 8-bit codes. A layer's width: quant.json's `bits` for it, else 4.
    A layer of two widths by row (the head's 8-bit rows, pipeline/quant/head_rows.py: quant.json's
    `row_bits`) is a PackError unless `mixed_rows` (the caller reads its rows with `row_bits`).
    """
    from safetensors.numpy import load_file

    quant_dir = Path(quant_dir)
    meta_path, tensors_path = quant_dir / QUANT_JSON, quant_dir / QUANT_TENSORS
    if not meta_path.is_file() or not tensors_path.is_file():
        raise PackError(f"{quant_dir}: expected {QUANT_JSON} and {QUANT_TENSORS}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != L.FORMAT:
        raise PackError(f"{meta_path}: format {meta.get('format')!r}, expected {L.FORMAT!r}")
    if int(meta.get("bits", 0)) != 4:
        raise PackError(f"{meta_path}: bits {meta.get('bits')!r}; only 4-bit codes are packed")
    g_default = int(meta["group_size"])
    raw = load_file(str(tensors_path))
    layers = {}
    for name, info in meta["layers"].items():
        g = int(info.get("group_size", g_default))
        width = int(info.get("bits", 4))
        if width not in bits:
            raise PackError(f"layer {name} holds {width}-bit codes; this layout takes "
                            f"{' or '.join(map(str, bits))}-bit ones (quantize.head_bits=4 writes a 4-bit head, "
                            f"quantize.eight_bit_budget=0 4-bit decoder linears)")
        if info.get("row_bits") and not mixed_rows:
            raise PackError(f"layer {name} holds {info['row_bits'].get('8')} rows of 8-bit codes and "
                            f"{info['row_bits'].get('4')} of 4-bit ones, which only ONNX Runtime's MatMulNBits graph "
                            f"takes; quantize with quantize.head_rows8=0 for this layout")
        try:
            q, s, z = raw[f"{name}.qweight"], raw[f"{name}.scales"], raw[f"{name}.zeros"]
        except KeyError as err:
            raise PackError(f"{tensors_path}: layer {name} lacks tensor {err}") from None
        n, k = int(info["out_features"]), int(info["in_features"])
        if k % g:
            raise PackError(f"layer {name}: group size {g} does not divide in_features {k}")
        if q.shape != (n, k) or s.shape != (n, k // g) or z.shape != (n, k // g):
            raise PackError(f"layer {name}: tensor shapes {q.shape} {s.shape} {z.shape} "
                            f"do not match [{n}, {k}] with group size {g}")
        layers[name] = (q.astype(np.uint8, copy=False), s.astype(np.float32, copy=False),
                        z.astype(np.uint8, copy=False), g)
    return meta, layers


def row_bits(quant_dir, meta: dict, name: str) -> np.ndarray | None:
    """Layer `name`'s width per row (uint8 [N], 4 or 8) where quant.json records it as of two widths by row
    (`row_bits`), else None."""
    from safetensors import safe_open

    from pipeline.quant.head_rows import ROWS_TENSOR

    if not meta["layers"].get(name, {}).get("row_bits"):
        return None
    with safe_open(str(Path(quant_dir) / QUANT_TENSORS), framework="numpy") as f:
        rows = f.get_tensor(f"{name}.{ROWS_TENSOR}")
    n = int(meta["layers"][name]["out_features"])
    if rows.shape != (n,) or not np.isin(rows, (4, 8)).all():
        raise PackError(f"layer {name}: {name}.{ROWS_TENSOR} must be [{n}] of 4 and 8, got {rows.shape}")
    return rows.astype(np.uint8, copy=False)
