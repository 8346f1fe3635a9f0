"""4-bit group-wise weight quantization: GPTQ and a round-to-nearest baseline.

Written here rather than taken from a library. The maintained GPTQ
implementations were checked (pip metadata and their documentation, 2026):
GPTQModel (7.x) and AutoGPTQ (0.7, unmaintained) ship CUDA/ROCm builds pinned
to specific torch releases and pull their own torch; llm-compressor pulls a
compressed-tensors / accelerate stack with its own torch pins and is
GPU-oriented; optimum's GPTQ path delegates to GPTQModel. None is installable
into this project's pinned CPU torch (2.13.0+cpu) without replacing it, and
what the pipeline needs is small: the algorithm on one weight matrix given its
input second moment H, plus a grid the project's packers and kernels agree on.

The algorithm is GPTQ (Frantar, Ashkboos, Hoefler, Alistarh, 2022):

- H = sum x x^T over the calibration inputs of the linear; dead inputs (a zero
  diagonal entry: never active in calibration) get H[i,i] = 1 so H is
  invertible. Their weights are kept and simply rounded (the original code
  zeroes them; an input unseen in calibration may still fire in use).
- Dampening: `damp * mean(diag(H))` is added to the diagonal (retried x10 up
  to four times when the Cholesky factorization still fails).
- The inverse Hessian's upper Cholesky factor U drives column-by-column
  quantization with error feedback: the error of column i, divided by U[i,i],
  is propagated to the remaining columns through row i of U. Updates outside
  the current block of `block_size` columns are applied lazily, once per
  block, as one matrix product.
- Group-wise scales are computed when the loop enters each group, from the
  group's weights as updated so far. Blocks and groups nest (one divides the
  other) so the weights a group's scale sees are exact; otherwise the block is
  set to the group size.
- No act-order: columns are quantized in their natural order, so groups are
  contiguous and no permutation index has to travel with the weights.

The grid (4 bits, codes 0..15, group size g along the input dimension K):

    W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]

- symmetric (default): z = 8 for every group (the W4A8 kernel pins it there);
  the plain scale is absmax / 7.5. With `scale_search`, candidate scales
  `m * absmax / 7` for m in [0.70, 1.00] are tried besides the plain one and
  each row of each group keeps the one minimizing the group's reconstruction
  error weighted by diag(H), sum_k H[k,k] (w - w_q)^2. The plain scale is
  among the candidates, so the search is never worse on that measure.
- asymmetric: min/max range (widened to include 0) mapped to 0..15, the zero
  point round(-min / s) clamped to 0..15; `scale_search` shrinks the range by
  the same multipliers.
- `rtn`: the same grid and scale choice, every weight rounded to nearest with
  no error feedback: the baseline GPTQ has to beat.
- `scale_dtype`: "fp32" (default) keeps scales as computed; "fp16" rounds
  every candidate scale to the nearest fp16 value before its codes are chosen,
  so the scale search, the codes and GPTQ's error feedback all see the scale
  a format storing fp16 scales (GGUF Q4_0's block scale d) will hold, and the
  weights it writes dequantize to exactly what was quantized. A scale below
  fp16's smallest subnormal (2^-24) is raised to it (an all-zero group then
  still codes to exactly zero); one above fp16's maximum is an error.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "edgekiln-int4/1"
BITS = 4
MAXQ = 2**BITS - 1  # 15
SYM_ZERO = 8
# A layer may take 8 bits instead (the head, where the ORT MatMulNBits path is
# used: stages/quantize.py `head_bits`): the same grid with codes 0..255, z = 128.
LAYER_BITS = (4, 8)
QUANT_JSON = "quant.json"
QUANT_TENSORS = "quantized.safetensors"
METHODS = ("gptq", "rtn")
SCALE_DTYPES = ("fp32", "fp16")
_FP16_MAX = 65504.0
_FP16_MIN_SUBNORMAL = 2.0**-24

# Candidate multipliers of the scale search (see the module docstring).
SEARCH_MULTIPLIERS = tuple(round(0.70 + 0.01 * i, 2) for i in range(31))


class QuantError(ValueError):
    """A weight or Hessian this quantizer cannot handle (shape, group size, H not PD)."""


@dataclass
class Quantized:
    qweight: torch.Tensor  # uint8 [N, K], codes 0..15 (0..255 for an 8-bit layer)
    scales: torch.Tensor  # float32 [N, K // g]
    zeros: torch.Tensor  # uint8 [N, K // g]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.zeros, self.group_size)


# --------------------------------------------------------------------------
# the grid
# --------------------------------------------------------------------------


def _check_scale_dtype(scale_dtype: str, name: str = "weight") -> None:
    if scale_dtype not in SCALE_DTYPES:
        raise QuantError(f"{name}: unknown scale_dtype {scale_dtype!r}; known: {', '.join(SCALE_DTYPES)}")


def round_scale(scale: torch.Tensor, scale_dtype: str = "fp32") -> torch.Tensor:
    """The scale as it will be stored: unchanged for fp32, nearest fp16 value (as float32) for fp16."""
    if scale_dtype == "fp32":
        return scale
    _check_scale_dtype(scale_dtype)
    if bool((scale > _FP16_MAX).any()):
        raise QuantError(f"a group scale {float(scale.max()):.6g} exceeds fp16's maximum {_FP16_MAX:g}: "
                         f"these weights cannot take fp16 scales (quantize.scale_dtype=fp32)")
    return scale.clamp_min(_FP16_MIN_SUBNORMAL).to(torch.float16).to(torch.float32)


def _named(name: str, fn, *args):
    """fn(*args), a QuantError from it prefixed with the layer's name."""
    try:
        return fn(*args)
    except QuantError as e:
        raise QuantError(f"{name}: {e}") from None


def _grid(bits: int) -> tuple[int, int]:
    """(maxq, symmetric zero) of the `bits` grid: (15, 8) for 4 bits, (255, 128) for 8."""
    if bits not in LAYER_BITS:
        raise QuantError(f"{bits}-bit codes: the grid has {' or '.join(map(str, LAYER_BITS))} bits")
    return 2**bits - 1, 2 ** (bits - 1)


def _candidates(w: torch.Tensor, sym: bool, scale_search: bool, scale_dtype: str = "fp32", bits: int = BITS):
    """(scale [N], zero [N]) candidates for a group w [N, g]; the plain choice first.

    Each scale is already rounded to `scale_dtype` (so the asymmetric zero point
    and everything downstream use the stored value). For 4 bits the plain
    symmetric scale is absmax / 7.5 and the searched ones m * absmax / 7; for
    8 bits, / 127.5 and / 127."""
    tiny = torch.finfo(torch.float32).tiny
    maxq, sym_zero = _grid(bits)
    if sym:
        amax = w.abs().amax(dim=1).clamp_min(tiny)
        zero = torch.full_like(amax, float(sym_zero))
        yield round_scale(amax / (maxq / 2), scale_dtype), zero
        if scale_search:
            for m in SEARCH_MULTIPLIERS:
                yield round_scale((amax * (m / (sym_zero - 1))).clamp_min(tiny), scale_dtype), zero
    else:
        wmin = w.amin(dim=1).clamp(max=0.0)
        wmax = w.amax(dim=1).clamp(min=0.0)
        for m in (1.0, *SEARCH_MULTIPLIERS[:-1]) if scale_search else (1.0,):
            lo, hi = wmin * m, wmax * m
            scale = round_scale(((hi - lo) / maxq).clamp_min(tiny), scale_dtype)
            zero = torch.round(-lo / scale).clamp(0, maxq)
            yield scale, zero


def _codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int = BITS) -> torch.Tensor:
    """Codes (as float) of w [N] or [N, g] under per-row scale/zero [N]."""
    if w.dim() == 2:
        scale, zero = scale[:, None], zero[:, None]
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def group_params(w: torch.Tensor, weight: torch.Tensor | None, sym: bool, scale_search: bool,
                 scale_dtype: str = "fp32", bits: int = BITS):
    """Per-row (scale, zero) of one group w [N, g], chosen to minimize the
    diag(H)-weighted reconstruction error sum_k weight[k] (w - w_q)^2."""
    best_s = best_z = best_err = None
    maxq = 2**bits - 1
    buf = torch.empty_like(w)
    for scale, zero in _candidates(w, sym, scale_search, scale_dtype, bits):
        if best_s is None and not scale_search:
            return scale, zero
        # (clamp(round(w / s) + z, 0, maxq) - z) * s - w, squared: _codes and the dequantization, the same
        # operations in the same order (so the same floats), in one buffer instead of eight new tensors
        # (the scale search was ~70% of GPTQ's time on a 32768 x 640 head at 8 bits g32, profiled; the
        # in-place form ran 8192 x 640 in 57 s against 84 s, 2 threads on the loaded shared host)
        s, z = scale[:, None], zero[:, None]
        sq = torch.div(w, s, out=buf).round_().add_(z).clamp_(0, maxq).sub_(z).mul_(s).sub_(w).square_()
        err = sq @ weight if weight is not None else sq.sum(dim=1)
        if best_s is None:
            best_s, best_z, best_err = scale.clone(), zero.clone(), err
            continue
        better = err < best_err
        best_s = torch.where(better, scale, best_s)
        best_z = torch.where(better, zero, best_z)
        best_err = torch.where(better, err, best_err)
    return best_s, best_z


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """W[n, k] = (qweight[n, k] - zeros[n, k // g]) * scales[n, k // g], float32 [N, K]."""
    n, k = qweight.shape
    groups = scales.shape[1]
    if group_size is None:
        group_size = k // groups
    if scales.shape != (n, k // group_size) or zeros.shape != scales.shape or k % group_size:
        raise QuantError(
            f"inconsistent quantized tensors: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, "
            f"zeros {tuple(zeros.shape)}, group size {group_size}"
        )
    # in place on one float copy of the codes, the scales and zeros broadcast per group: the same
    # float32 operations as (q - z_expanded) * s_expanded, without three more [N, K] temporaries
    # (the 262144 x 640 head of Gemma 3 270M: 671 MB each)
    w = qweight.to(torch.float32, copy=True).reshape(n, groups, group_size)
    w.sub_(zeros.float().unsqueeze(-1)).mul_(scales.float().unsqueeze(-1))
    return w.reshape(n, k)


# --------------------------------------------------------------------------
# the algorithms
# --------------------------------------------------------------------------


def _check(w: torch.Tensor, h: torch.Tensor | None, group_size: int, name: str) -> None:
    if w.dim() != 2:
        raise QuantError(f"{name}: weight must be 2-D, got {tuple(w.shape)}")
    k = w.shape[1]
    if group_size < 1 or k % group_size:
        raise QuantError(f"{name}: group size {group_size} does not divide in_features K={k}")
    if h is not None and tuple(h.shape) != (k, k):
        raise QuantError(f"{name}: Hessian {tuple(h.shape)} does not match in_features K={k}")


def _diag_weight(h: torch.Tensor | None) -> torch.Tensor | None:
    if h is None:
        return None
    d = torch.diagonal(h).float().clamp_min(0)
    return torch.where(d > 0, d, torch.ones_like(d))


def rtn_quantize(w: torch.Tensor, h: torch.Tensor | None = None, *, group_size: int = 128, sym: bool = True,
                 scale_search: bool = True, scale_dtype: str = "fp32", bits: int = BITS,
                 name: str = "weight") -> Quantized:
    """Round-to-nearest on the grid; H (optional) only weights the scale search."""
    _check(w, h, group_size, name)
    _check_scale_dtype(scale_dtype, name)
    _named(name, _grid, bits)
    w = w.detach().float()
    n, k = w.shape
    d = _diag_weight(h)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size, dtype=torch.float32)
    zeros = torch.empty(n, k // group_size, dtype=torch.uint8)
    for gi, c0 in enumerate(range(0, k, group_size)):
        wg = w[:, c0 : c0 + group_size]
        s, z = _named(name, group_params, wg, None if d is None else d[c0 : c0 + group_size], sym, scale_search,
                      scale_dtype, bits)
        codes[:, c0 : c0 + group_size] = _codes(wg, s, z, bits).to(torch.uint8)
        scales[:, gi], zeros[:, gi] = s, z.to(torch.uint8)
    return Quantized(codes, scales, zeros, group_size)


def _inverse_hessian_factor(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp*mean(diag) I)^-1 (U^T U = H^-1), float64.

    GPTQ's recipe takes three cubic steps: Cholesky of H, its inverse (cholesky_inverse), and the upper
    Cholesky of that. Here two: with J the index reversal, J H J = L' L'^T gives H^-1 = U^T U for
    U = J L'^-1 J, upper triangular with a positive diagonal, so the same factor (to 1e-14 relative,
    tests). On K = 8960 (the Qwen2.5-1.5B geometry's down_proj, 28 of them) 35.2 -> 22.7 s each on the
    2-core AVX-512 builder; cholesky_inverse alone was 30 s."""
    mean_diag = torch.diagonal(h).mean().item()
    if not math.isfinite(mean_diag) or mean_diag <= 0:
        raise QuantError(f"{name}: the Hessian's diagonal is empty or not finite (mean {mean_diag})")
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    lam = damp
    for _ in range(5):
        try:
            lower = torch.linalg.cholesky((h + (lam * mean_diag) * eye).flip(0, 1))
            return torch.linalg.solve_triangular(lower, eye, upper=False).flip(0, 1)
        except torch.linalg.LinAlgError:
            lam = lam * 10 if lam > 0 else 1e-4
    raise QuantError(f"{name}: the Hessian is not positive definite even with dampening {lam / 10:g}")


def hessian_factor(h: torch.Tensor, damp: float = 0.01, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(u, d) of an input second moment H [K, K]: the upper Cholesky factor of the dampened inverse
    (float32) and the scale search's per-column weights. Linears that read one input (q/k/v, gate/up)
    share H and so this: made once for them (gptq_quantize's `factor`), it is a third of GPTQ's time on
    K = 2048 linears."""
    h = h.detach().double().clone()
    dead = torch.diagonal(h) <= 0
    if bool(dead.all()):
        raise QuantError(f"{name}: every input column is dead in calibration (H is zero)")
    h[dead, :] = 0
    h[:, dead] = 0
    d = _diag_weight(h)
    # a dead input weighs like an average one in the scale search: unseen in
    # calibration is not unused in deployment
    d[dead] = d[~dead].mean()
    h[dead, dead] = 1
    return _inverse_hessian_factor(h, damp, name).float(), d


def gptq_quantize(w: torch.Tensor, h: torch.Tensor | None, *, group_size: int = 128, sym: bool = True,
                  scale_search: bool = True, damp: float = 0.01, block_size: int = 128,
                  scale_dtype: str = "fp32", bits: int = BITS, name: str = "weight",
                  factor: tuple[torch.Tensor, torch.Tensor] | None = None) -> Quantized:
    """GPTQ of one weight [N, K] given its input second moment H [K, K] (or `factor`, hessian_factor's
    result for it: the same codes)."""
    _check(w, h, group_size, name)
    _check_scale_dtype(scale_dtype, name)
    _named(name, _grid, bits)
    w = w.detach().float().clone()
    n, k = w.shape
    u, d = factor if factor is not None else hessian_factor(h, damp, name)
    if tuple(u.shape) != (k, k):
        raise QuantError(f"{name}: Hessian factor {tuple(u.shape)} does not match in_features K={k}")

    if not (block_size % group_size == 0 or group_size % block_size == 0):
        block_size = group_size  # groups and blocks must nest (module docstring)
    g = group_size
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // g, dtype=torch.float32)
    zeros = torch.empty(n, k // g, dtype=torch.uint8)
    # Rows are independent in GPTQ (the error of a column feeds forward along its own row), so a tall weight
    # may be done a slab of rows at a time: the same arithmetic row by row (the same codes, tests), less
    # memory for the update buffer. Not tuned: on the shared 2-core host the slab timings were within
    # the noise of its neighbours' load, so a slab is as tall as Gemma 3's head (one slab, as before).
    for r1 in range(0, n, ROW_SLAB):
        r2 = min(r1 + ROW_SLAB, n)
        _gptq_rows(w[r1:r2], u, d, codes[r1:r2], scales[r1:r2], zeros[r1:r2], g, block_size, sym, scale_search,
                   scale_dtype, bits, name)
    return Quantized(codes, scales, zeros, g)


ROW_SLAB = 262144  # rows of a weight GPTQ updates together (gptq_quantize)


def _gptq_rows(w, u, d, codes, scales, zeros, g, block_size, sym, scale_search, scale_dtype, bits, name) -> None:
    """GPTQ's column loop on the rows `w` (updated in place), writing their codes, scales and zeros."""
    k = w.shape[1]
    scale = zero = None
    tmp = torch.empty(w.shape[0], block_size, dtype=w.dtype)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                # Groups nest in blocks or blocks in groups, so the group's
                # current weights are w1[:, i:i+g] or (at a block start) w[:, col:col+g].
                wg = w1[:, i : i + g] if col + g <= i2 else w[:, col : col + g]
                # with scale_dtype fp16 the scale is already the stored one, so
                # the codes and the error fed forward below are against it
                scale, zero = _named(name, group_params, wg, d[col : col + g], sym, scale_search, scale_dtype, bits)
                scales[:, col // g], zeros[:, col // g] = scale, zero.to(torch.uint8)
            wc = w1[:, i]
            q = _codes(wc, scale, zero, bits)
            codes[:, col] = q.to(torch.uint8)
            e = (wc - (q - zero) * scale) / u1[i, i]
            # w1[:, i:] -= e u1[i, i:], the product made in a reused buffer (the same floats)
            w1[:, i:].sub_(torch.mul(e[:, None], u1[i, i:][None, :], out=tmp[:, : i2 - col]))
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]


def on_grid(w: torch.Tensor, group_size: int, scale_dtype: str = "fp32", bits: int = BITS) -> Quantized | None:
    """The symmetric scale-searched codes of a weight that already lies exactly on the grid, or None.

    A GGUF-origin checkpoint's tensors can: Gemma 3 270M's token embedding is Q8_0 (int8
    codes, one scale per 32), so its untied head at 8 bits g32 is exact at scale absmax / 127.
    Then the search (32 candidates a group) and GPTQ (error feedback of zero) can only return
    these codes: of the candidates, only m = 1.0 reproduces a row whose absmax is not zero
    (every smaller scale clamps the absmax element, the plain absmax / (maxq / 2) rounds it
    past the grid), and an all-zero row is exact under the first, plain, one. Same bytes, in
    a fraction of a second where GPTQ of the 262144 x 640 head took ~2 minutes here."""
    tiny = torch.finfo(torch.float32).tiny
    maxq, sym_zero = _grid(bits)
    n, k = w.shape
    if k % group_size:
        return None
    wg = w.detach().float().reshape(n, k // group_size, group_size)
    amax = wg.abs().amax(dim=2).clamp_min(tiny)
    plain = round_scale(amax / (maxq / 2), scale_dtype)
    exact = round_scale((amax * (1.0 / (sym_zero - 1))).clamp_min(tiny), scale_dtype)
    scale = torch.where(amax <= tiny, plain, exact)
    codes = torch.clamp(torch.round(wg / scale[..., None]) + sym_zero, 0, maxq)
    if not torch.equal((codes - sym_zero) * scale[..., None], wg):
        return None
    return Quantized(qweight=codes.reshape(n, k).to(torch.uint8), scales=scale.float(),
                     zeros=torch.full((n, k // group_size), sym_zero, dtype=torch.uint8), group_size=group_size)


def quantize_weight(w: torch.Tensor, h: torch.Tensor | None, *, method: str = "gptq", group_size: int = 128,
                    sym: bool = True, scale_search: bool = True, damp: float = 0.01, block_size: int = 128,
                    scale_dtype: str = "fp32", bits: int = BITS, name: str = "weight", factor=None) -> Quantized:
    """`factor`: a callable returning hessian_factor(h, damp) (made only where GPTQ runs, and cacheable
    by the caller across the linears sharing H)."""
    if sym and scale_search and method in METHODS:
        _check(w, h, group_size, name)
        exact = on_grid(w, group_size, scale_dtype, bits)
        if exact is not None:
            return exact
    if method == "gptq":
        if h is None:
            raise QuantError(f"{name}: GPTQ needs the layer's calibration Hessian")
        return gptq_quantize(w, h, group_size=group_size, sym=sym, scale_search=scale_search, damp=damp,
                             block_size=block_size, scale_dtype=scale_dtype, bits=bits, name=name,
                             factor=factor() if factor is not None else None)
    if method == "rtn":
        return rtn_quantize(w, h, group_size=group_size, sym=sym, scale_search=scale_search,
                            scale_dtype=scale_dtype, bits=bits, name=name)
    raise QuantError(f"unknown method {method!r}; known: {', '.join(METHODS)}")


# The token embedding's codes (an untied table on the kernels that gather from block codes: ORT's
# GatherBlockQuantized, GGUF's Q8_0 / Q4_0; the phone's lookup). Blocks of Q8_0's 32 with fp16 scales, as
# GGUF holds them: a GGUF-origin table (Gemma 3 270M's) is then on the grid, exactly (on_grid).
EMBED_BLOCK = 32
EMBED_BITS = (8, 4)


def embedding_codes(table, bits: int, block: int = EMBED_BLOCK) -> Quantized:
    """The table [V, H]'s symmetric `bits`-bit codes in blocks of `block`, fp16 scales: round to nearest
    with the scale search, no calibration (a row's error reaches only the tokens that gather it, so no
    Hessian weighs it). The one rounding the quantize stage measures and the packers ship."""
    if isinstance(table, torch.Tensor):
        t = table
    else:
        # The table is often a read-only view (a mapped file, an ONNX initializer); nothing here writes to
        # it, and copying Gemma 3 270M's would cost 671 MB, so torch's not-writable warning is not shown.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(table)
    return quantize_weight(t.detach().to(torch.float32), None, method="rtn", group_size=block, sym=True,
                           scale_dtype="fp16", bits=bits, name="embedding")


def errors(w: torch.Tensor, wq, h: torch.Tensor | None, rows: int = 16384) -> dict:
    """weight_rel_mse = |E|^2/|W|^2 and out_rel_err_h = tr(E H E^T) / tr(W H W^T), E = W - Wq.

    `wq`: the dequantized weight, or the Quantized codes (dequantized a slab at a time).
    float64 sums over slabs of `rows` rows: whole, the float64 temporaries of Gemma 3
    270M's 262144 x 640 head (W, E, E H, W H: 1.34 GB each) took the quantize stage to
    7.9 GiB; by slabs it holds a few hundred MB whatever the height."""
    hd = h.detach().double() if h is not None else None
    hf = hd.float() if hd is not None else None
    e2 = w2 = num = den = 0.0
    for r0 in range(0, w.shape[0], rows):
        r1 = min(r0 + rows, w.shape[0])
        wr = w[r0:r1].detach().double()
        if isinstance(wq, Quantized):
            qr = dequantize(wq.qweight[r0:r1], wq.scales[r0:r1], wq.zeros[r0:r1], wq.group_size)
        else:
            qr = wq[r0:r1]
        e = wr - qr.detach().double()
        e2 += float(e.square().sum())
        w2 += float(wr.square().sum())
        if hd is not None:
            # the [rows, K] x [K, K] products in float32 (half the time of float64: 2 of the 10 minutes
            # of the 1.75B geometry's GPTQ pass were these two), the sums in float64
            num += float(((e.float() @ hf) * e.float()).sum(dtype=torch.float64))
            den += float(((wr.float() @ hf) * wr.float()).sum(dtype=torch.float64))
    out = {"weight_rel_mse": e2 / max(w2, 1e-300)}
    if hd is not None:
        out["out_rel_err_h"] = num / den if den > 0 else float("nan")
    return out


# --------------------------------------------------------------------------
# the artifact (what quantize writes and later stages read)
# --------------------------------------------------------------------------


def quant_meta(folder) -> dict:
    """quant.json of a quantize output folder."""
    meta = json.loads((Path(folder) / QUANT_JSON).read_text())
    if meta.get("format") != FORMAT:
        raise QuantError(f"{folder}: quant.json format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def layer_group_size(meta: dict, name: str) -> int:
    """A layer's group size: the global one unless the layer records its own (fallback)."""
    return int(meta["layers"][name].get("group_size", meta["group_size"]))


def layer_bits(meta: dict, name: str) -> int:
    """A layer's bits: 4 unless the layer records its own (an 8-bit head)."""
    return int(meta["layers"][name].get("bits", meta["bits"]))


def load_quantized(folder) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """{linear name: (qweight uint8 [N, K], scales float32 [N, K//g], zeros uint8 [N, K//g])}."""
    from safetensors import safe_open

    meta = quant_meta(folder)
    out = {}
    with safe_open(str(Path(folder) / QUANT_TENSORS), framework="pt") as f:
        for name in meta["layers"]:
            out[name] = (f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales"), f.get_tensor(f"{name}.zeros"))
    return out
