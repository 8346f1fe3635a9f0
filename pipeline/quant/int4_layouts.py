"""4-bit weight layouts, one packing function per kernel (pure functions, no stage logic).

The input is the quantize stage's `edgekiln-int4/1` form, per linear layer:
`qweight` uint8 [N, K] codes 0..15, `scales` float32 [N, K/g], `zeros` uint8
[N, K/g] (8 when symmetric), and W[n, k] = (q[n, k] - z[n, k//g]) * s[n, k//g].
Every layout below re-packs those codes; nothing here rounds a weight again.

- GPTQ (vLLM, AutoGPTQ, transformers): `to_gptq` / `from_gptq`.
  qweight int32 [K/8, N]: 8 codes of consecutive k per int32, the code of row
  8*i + j in bits 4j..4j+3 (low nibble first). qzeros int32 [K/g, N/8]: 8
  zeros of consecutive output channels per int32, low nibble first, stored in
  the GPTQ *v1* convention `zero - 1` (AutoGPTQ's historical off-by-one, which
  loaders of `checkpoint_format: gptq` undo by adding 1; a symmetric zero of 8
  is stored as 7, i.e. 0x77777777). A zero of 0 cannot be written in v1 and is
  refused. vLLM's CPU path (gptq_marlin config -> CPUWNA16LinearKernel) takes
  only sym=True (quant type uint4b8: the zero is the fixed bias 8 and qzeros is
  not read); qzeros is still written correctly for other loaders. scales fp16
  [K/g, N] (the only lossy step: float32 -> float16), g_idx int32 [K] = k // g.

- tinygemm W4A16 (`aten._convert_weight_to_int4pack_for_cpu` /
  `_weight_int4pack_mm_for_cpu`), measured on torch 2.13.0+cpu:
  the op takes int32 codes [N, K] (values 0..15; uint8 is refused), returns
  uint8 [N, K/2]; `innerKTiles` is ignored on CPU (1, 2, 4, 8 give identical
  bytes). N must be a multiple of 16; qGroupSize must be 32, 64, 128 or 256.
  scales_and_zeros: [K/g, N, 2] in the activation dtype (bf16 here: fp32
  scales with bf16 activations are refused), [..., 0] = scale, [..., 1] = an
  additive offset, and the kernel dequantizes w = (q - 8) * scale + offset. Our
  (q - z) * s is the same with offset = (8 - z) * s (exact in real arithmetic;
  the bf16 storage of scale and offset is the kernel's own rounding).
  The packed byte layout depends on the CPU capability torch dispatched to
  (`torch.backends.cpu.get_cpu_capability()`), checked bit-exact here against
  the op under ATEN_CPU_CAPABILITY=avx512 / avx2 / default:
    AVX512: blocks of 64 output channels, [N/64][K][32 bytes]; byte d holds
            channel d (low nibble) and channel d+32 (high nibble). (The field
            notes' layout: right.)
    AVX2:   blocks of 32, [N/32][K][16 bytes]; byte d = channel d | d+16.
    DEFAULT (and, by the source, any non-x86 build): blocks of 32, adjacent
            pairs: byte j = channel 2j | channel 2j+1.
  A tail block (N mod block, a multiple of 16) is packed as adjacent pairs
  [K][tail/2] on every capability. So the tail is not mis-read by a decoder
  that knows this; `codes_from_packed` decodes it (checked bit-exact at N=80,
  112, 272, ...). A packed tensor is only valid on a CPU of the capability it
  was packed for; the runtime re-packs when they differ.

- ORT MatMulNBits (com.microsoft, ORT 1.32 schema): B uint8
  [N, K/bs, bs/2], codes along K, low nibble first; scales [N, K/bs] in A's
  dtype (float32); zero_points packed uint8 [N, ceil(K/bs / 2)] with the same
  nibble packing along the block axis (each row padded to a whole byte);
  omitted, the zero point is 2^(bits-1) = 8 (schema text, and checked
  numerically in the tests), so a symmetric layer ships no zero_points.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FORMAT = "edgekiln-int4/1"
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
GPTQ_PACK = 8  # codes per int32


class LayoutError(ValueError):
    """A shape or value a kernel's layout cannot represent."""


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _check(qweight, scales, zeros, group_size, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    q = _np(qweight)
    s = _np(scales).astype(np.float32, copy=False)
    z = _np(zeros)
    if q.ndim != 2:
        raise LayoutError(f"qweight must be [N, K], got {q.shape}")
    n, k = q.shape
    g = int(group_size)
    if g <= 0 or k % g:
        raise LayoutError(f"group size {g} does not divide K={k}")
    if s.shape != (n, k // g) or z.shape != (n, k // g):
        raise LayoutError(f"scales {s.shape} / zeros {z.shape} must be [N, K/g] = {(n, k // g)}")
    maxq = 2 ** int(bits) - 1
    if q.size and (q.min() < 0 or q.max() > maxq):
        raise LayoutError(f"codes must lie in 0..{maxq} ({bits}-bit)")
    if z.size and (z.min() < 0 or z.max() > maxq):
        raise LayoutError(f"zeros must lie in 0..{maxq} ({bits}-bit)")
    return q.astype(np.uint8, copy=False), s, z.astype(np.uint8, copy=False), n, k


def dequant(qweight, scales, zeros, group_size, bits: int = 4) -> np.ndarray:
    """The fp32 weight [N, K] the codes stand for: (q - z) * s per group."""
    q, s, z, n, k = _check(qweight, scales, zeros, group_size, bits)
    g = int(group_size)
    w = q.reshape(n, k // g, g).astype(np.float32) - z[:, :, None].astype(np.float32)
    return (w * s[:, :, None]).reshape(n, k)


# --------------------------------------------------------------------------
# GPTQ (v1 checkpoint format)
# --------------------------------------------------------------------------


def _pack_nibbles_i32(codes: np.ndarray, axis: int) -> np.ndarray:
    """Pack 8 consecutive entries along `axis` into one int32, low nibble first."""
    c = np.moveaxis(codes.astype(np.uint32), axis, 0)
    if c.shape[0] % GPTQ_PACK:
        raise LayoutError(f"axis of length {c.shape[0]} is not a multiple of {GPTQ_PACK}")
    c = c.reshape(c.shape[0] // GPTQ_PACK, GPTQ_PACK, *c.shape[1:])
    out = np.zeros((c.shape[0], *c.shape[2:]), dtype=np.uint32)
    for j in range(GPTQ_PACK):
        out |= (c[:, j] & 0xF) << np.uint32(4 * j)
    return np.moveaxis(out.view(np.int32), 0, axis)


def _unpack_nibbles_i32(packed: np.ndarray, axis: int) -> np.ndarray:
    p = np.moveaxis(np.ascontiguousarray(packed).view(np.uint32), axis, 0)
    parts = [((p >> np.uint32(4 * j)) & 0xF).astype(np.uint8) for j in range(GPTQ_PACK)]
    out = np.stack(parts, axis=1).reshape(p.shape[0] * GPTQ_PACK, *p.shape[1:])
    return np.moveaxis(out, 0, axis)


def to_gptq(qweight, scales, zeros, group_size) -> dict[str, Any]:
    """GPTQ v1 tensors for one linear: qweight, qzeros, scales (fp16), g_idx (torch tensors)."""
    import torch

    q, s, z, n, k = _check(qweight, scales, zeros, group_size)
    g = int(group_size)
    if k % GPTQ_PACK or n % GPTQ_PACK:
        raise LayoutError(f"GPTQ packs 8 codes per int32: K={k} and N={n} must be multiples of 8")
    if (z == 0).any():
        raise LayoutError("a zero point of 0 cannot be stored in the GPTQ v1 format (zero - 1 would be -1)")
    if not np.isfinite(s).all() or (np.abs(s) > 65504).any():
        raise LayoutError("scales overflow float16")
    qw = _pack_nibbles_i32(q.T, axis=0)  # [K/8, N]
    qz = _pack_nibbles_i32((z.T.astype(np.int16) - 1).astype(np.uint8), axis=1)  # [K/g, N/8]
    return {
        "qweight": torch.from_numpy(np.ascontiguousarray(qw)),
        "qzeros": torch.from_numpy(np.ascontiguousarray(qz)),
        "scales": torch.from_numpy(np.ascontiguousarray(s.T.astype(np.float16))),
        "g_idx": torch.from_numpy((np.arange(k, dtype=np.int32) // g).astype(np.int32)),
    }


def from_gptq(tensors: dict[str, Any], group_size: int | None = None):
    """The inverse of `to_gptq`: (qweight uint8 [N, K], scales float32 [N, K/g], zeros uint8 [N, K/g]).

    Codes and zeros round-trip exactly; scales come back as their float16 values.
    g_idx must be k // g (no act-order): anything else is refused.
    """
    qw = _np(tensors["qweight"])
    qz = _np(tensors["qzeros"])
    sc = _np(tensors["scales"])
    q = _unpack_nibbles_i32(qw, axis=0).T  # [N, K]
    n, k = q.shape
    n_groups = sc.shape[0]
    g = int(group_size) if group_size else k // n_groups
    if n_groups * g != k:
        raise LayoutError(f"scales have {n_groups} groups for K={k} and group size {g}")
    if "g_idx" in tensors and tensors["g_idx"] is not None:
        gi = _np(tensors["g_idx"]).astype(np.int64)
        if not np.array_equal(gi, np.arange(k) // g):
            raise LayoutError("g_idx is not k // group_size (act-order checkpoints are not supported)")
    z = ((_unpack_nibbles_i32(qz, axis=1).astype(np.int16) + 1) & 0xF).T.astype(np.uint8)  # v1: stored zero - 1
    return np.ascontiguousarray(q), np.ascontiguousarray(sc.T.astype(np.float32)), np.ascontiguousarray(z)


# --------------------------------------------------------------------------
# tinygemm (PyTorch CPU int4 W4A16)
# --------------------------------------------------------------------------

# capability -> (block of output channels, how a full block's bytes pair channels)
_TINYGEMM_LAYOUTS = {
    "AVX512": (64, "halves"),  # byte d: channel d | channel d+32
    "AVX2": (32, "halves"),  # byte d: channel d | channel d+16
    "DEFAULT": (32, "pairs"),  # byte j: channel 2j | channel 2j+1
}


def tinygemm_layout(capability: str | None = None) -> dict[str, Any]:
    """The packed layout torch uses on this CPU (or on `capability`)."""
    import torch

    cap = (capability or torch.backends.cpu.get_cpu_capability()).upper()
    if cap not in _TINYGEMM_LAYOUTS:
        raise LayoutError(f"no verified tinygemm layout for CPU capability {cap!r} "
                          f"(verified: {', '.join(_TINYGEMM_LAYOUTS)})")
    block, mode = _TINYGEMM_LAYOUTS[cap]
    return {"capability": cap, "block_n": block, "full_block": mode, "tail": "pairs"}


def tinygemm_supports(n: int, k: int, group_size: int) -> str | None:
    """None if the kernel takes this shape, else the reason it does not."""
    if group_size not in TINYGEMM_GROUP_SIZES:
        return f"group size {group_size} not in {TINYGEMM_GROUP_SIZES}"
    if k % group_size:
        return f"group size {group_size} does not divide K={k}"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    return None


def tinygemm_scales_and_zeros(scales, zeros, dtype=None):
    """[K/g, N, 2] (scale, (8 - zero) * scale) in `dtype` (bf16 by default)."""
    import torch

    s = torch.as_tensor(_np(scales), dtype=torch.float32)
    z = torch.as_tensor(_np(zeros).astype(np.float32))
    sz = torch.stack([s.t(), ((8.0 - z) * s).t()], dim=-1).contiguous()
    return sz.to(dtype or torch.bfloat16)


def to_tinygemm(qweight, scales, zeros, group_size, dtype=None):
    """(packed uint8 [N, K/2] in this CPU's layout, scales_and_zeros [K/g, N, 2])."""
    import torch

    q, s, z, n, k = _check(qweight, scales, zeros, group_size)
    why = tinygemm_supports(n, k, int(group_size))
    if why:
        raise LayoutError(f"tinygemm cannot take [{n}, {k}] g{group_size}: {why}")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 2)
    return packed, tinygemm_scales_and_zeros(s, z, dtype)


def codes_from_packed(packed, n: int, k: int, layout: dict | None = None):
    """The uint8 codes [N, K] read straight from the kernel's packed bytes (torch)."""
    import torch

    layout = layout or tinygemm_layout()
    block, mode = int(layout["block_n"]), layout["full_block"]
    flat = torch.as_tensor(packed).reshape(-1)
    if flat.numel() * 2 != n * k:
        raise LayoutError(f"packed has {flat.numel()} bytes for [{n}, {k}]")
    n_full = (n // block) * block
    parts = []
    if n_full:
        p = flat[: n_full * k // 2].view(n_full // block, k, block // 2)
        lo, hi = p & 0xF, p >> 4
        if mode == "halves":
            c = torch.cat([lo, hi], dim=2)  # [NB, K, block]: channel d, then d + block/2
        else:
            c = torch.stack([lo, hi], dim=3).reshape(n_full // block, k, block)
        parts.append(c.permute(0, 2, 1).reshape(n_full, k))
    tail = n - n_full
    if tail:
        p = flat[n_full * k // 2:].view(k, tail // 2)
        c = torch.stack([p & 0xF, p >> 4], dim=2).reshape(k, tail)
        parts.append(c.t())
    return torch.cat(parts, dim=0).contiguous() if len(parts) > 1 else parts[0].contiguous()


def dequant_tinygemm(codes, scales_and_zeros, group_size: int, out_dtype=None):
    """(q - 8) * scale + offset, in float32 from the kernel's own scales_and_zeros."""
    import torch

    c = torch.as_tensor(codes)
    n, k = c.shape
    g = int(group_size)
    sz = torch.as_tensor(scales_and_zeros).to(torch.float32)  # [K/g, N, 2]
    scale = sz[:, :, 0].t().unsqueeze(-1)  # [N, K/g, 1]
    off = sz[:, :, 1].t().unsqueeze(-1)
    w = (c.view(n, k // g, g).to(torch.float32) - 8.0) * scale + off
    w = w.reshape(n, k)
    return w if out_dtype is None else w.to(out_dtype)


def dequant_from_packed(packed, scales_and_zeros, group_size: int, n: int, k: int,
                        layout: dict | None = None, out_dtype=None):
    """The weight [N, K] dequantized from the kernel's packed layout (no row-major copy)."""
    return dequant_tinygemm(codes_from_packed(packed, n, k, layout), scales_and_zeros, group_size, out_dtype)


def pack_rowmajor(codes) -> "torch.Tensor":
    """Codes [N, K] -> uint8 [N, K/2], k even in the low nibble (a plain, portable layout)."""
    import torch

    c = torch.as_tensor(_np(codes).astype(np.uint8))
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_rowmajor(packed) -> "torch.Tensor":
    import torch

    p = torch.as_tensor(packed)
    return torch.stack([p & 0xF, p >> 4], dim=2).reshape(p.shape[0], p.shape[1] * 2)


# --------------------------------------------------------------------------
# ONNX Runtime MatMulNBits
# --------------------------------------------------------------------------


def to_matmulnbits(qweight, scales, zeros, group_size, *, sym: bool | None = None, bits: int = 4):
    """(B uint8 [N, K/bs, bs*bits/8], scales float32 [N, K/bs], zero_points uint8 or None).

    4 bits: two codes a byte (low nibble first), zero_points [N, ceil(K/bs/2)]
    packed the same way. 8 bits: one code a byte, zero_points [N, K/bs].
    zero_points is None when every zero is ORT's default (8, or 128 for 8 bits),
    or when `sym` is True (then any other zero is an error).
    """
    if bits not in (4, 8):
        raise LayoutError(f"MatMulNBits from {bits}-bit codes: 4 or 8")
    q, s, z, n, k = _check(qweight, scales, zeros, group_size, bits)
    bs = int(group_size)
    if bs < 16 or bs & (bs - 1):
        raise LayoutError(f"MatMulNBits block_size must be a power of two >= 16, got {bs}")
    if k % 2:
        raise LayoutError(f"K={k} must be even")
    blocks = k // bs
    default_zero = 2 ** (bits - 1)
    if bits == 8:
        b = q.reshape(n, blocks, bs)
    else:
        b = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(n, blocks, bs // 2)
    all_default = bool((z == default_zero).all())
    if sym and not all_default:
        raise LayoutError(f"sym=True but some zero points are not {default_zero}")
    zp = None
    if not all_default and bits == 8:
        zp = z.astype(np.uint8)
    elif not all_default:
        zz = z if blocks % 2 == 0 else np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
        zp = (zz[:, 0::2] | (zz[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(b), np.ascontiguousarray(s.astype(np.float32)), zp


def from_matmulnbits(b, scales, zero_points, n: int, k: int, block_size: int):
    """Inverse of `to_matmulnbits` (codes, scales, zeros) for tests and inspection."""
    b = _np(b).reshape(n, k // 2)
    q = np.stack([b & 0xF, b >> 4], axis=2).reshape(n, k).astype(np.uint8)
    blocks = k // block_size
    s = _np(scales).reshape(n, blocks).astype(np.float32)
    if zero_points is None:
        z = np.full((n, blocks), 8, np.uint8)
    else:
        zp = _np(zero_points).reshape(n, -1)
        z = np.stack([zp & 0xF, zp >> 4], axis=2).reshape(n, -1)[:, :blocks].astype(np.uint8)
    return q, s, z
