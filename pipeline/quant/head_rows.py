"""The output head at two widths by row: 8 bits on the rows that carry the model's probability, 4 on the rest.

Why: on a large vocabulary the head is most of what a decoded token reads. Gemma 3 270M's 262,144 x 640
head at 8 bits (blocks of 32) is 189 MB against ~52 MB for the whole decoder at 4 bits, and at 4 bits the
head alone costs a KL divergence of 0.145 nats on held-out text (the decoder at full precision, RTN codes).
A token's logit error matters in proportion to its probability, and a few rows carry almost all of it: on
Gemma 3 (the decoder at full precision, RTN codes, docs/small-artifacts.md "The head's 8-bit rows") the 65,536 rows
most probable on 4,096 calibration tokens at 8 bits and the rest at 4 gave 0.00024 nats on held-out text of
the same kind and 0.00052 on other English text (licence texts), for 126 MB instead of 189; the first
65,536 ids instead (no permutation) 0.013, contiguous chunks of 256 rows 0.005: the rows must be chosen one
by one.

The rows are chosen by probability mass: the full-precision model's next-token distribution summed over
the calibration windows' tokens. GPTQ quantizes each row on its own (its error feedback runs along K), so
a row's 8-bit codes and its 4-bit codes are each what GPTQ makes of that row at that width, and a mixed
head is a selection of rows from the two (`mixed`). quant.json records it as the head's `row_bits`
({"8": n8, "4": n4}) with a uint8 tensor `lm_head.row_bits` [V] (4 or 8 per row); every row keeps its own
symmetric zero (128 or 8), so `gptq.dequantize` reads a mixed head as it reads any other.
"""

from __future__ import annotations

# The 8-bit rows tried, as a share of the vocabulary (1/n), narrowest first; past 1/4 the mixed head's bytes
# (at most 0.74 of the 8-bit head's at blocks of 32) stop paying for the graph's reordering of the logits.
LADDER = (16, 8, 4)
# The KL divergence a mixed head may add to the all-8-bit head's, on the calibration windows: this share of
# that head's own (the decoder's 4-bit error dominates it: SmolLM2-135M's artifact is ~0.08 nats), at least
# MIN_KLD nats (for a decoder near full precision). The calibration figure is optimistic (the rows are
# ranked and measured on the same ~512 tokens): SmolLM2-135M's 1/8 of the rows added 0.00052 nats there
# (within the first rule, 1% and 0.0005) and 0.0042 on held-out text (1.4 spreads, same top-1 -1.2 points);
# its 1/4 added 0.00008 there and 0.0016 held out (half a spread); Gemma 3 270M's 1/4 0.00002 and 0.0004.
MAX_KLD_SHARE = 0.002
MIN_KLD = 0.0002
ROWS_TENSOR = "row_bits"  # quantized.safetensors: f"{layer}.row_bits", uint8 [N], 4 or 8 per row
CHUNK_TOKENS = 64  # logits made this many tokens at a time (Gemma 3: 64 x 262,144 fp32 = 67 MB)


def probability_mass(hidden: list, head) -> "torch.Tensor":
    """Each row's share of the next-token probability, summed over every token of `hidden` (a list of
    [T, d] final hidden states of the full-precision model) under `head` [V, d]: float64 [V], sums to 1."""
    import torch

    mass = torch.zeros(head.shape[0], dtype=torch.float64)
    w = head.float()
    for h in hidden:
        for c in range(0, h.shape[0], CHUNK_TOKENS):
            mass += torch.softmax(h[c:c + CHUNK_TOKENS].float() @ w.T, -1).sum(0).double()
    return mass / mass.sum()


def top_rows(mass, n8: int) -> "torch.Tensor":
    """A bool [V] mask of the `n8` rows of most mass (ties by row index: deterministic)."""
    import torch

    order = torch.argsort(-mass, stable=True)
    rows = torch.zeros(mass.shape[0], dtype=torch.bool)
    rows[order[:n8]] = True
    return rows


def mixed(codes8: dict, codes4: dict, rows8) -> dict:
    """The head's codes (qweight, scales, zeros) with rows `rows8` (bool [V]) from the 8-bit codes and the
    rest from the 4-bit ones (same group size), and `row_bits` uint8 [V]."""
    import torch

    out = {}
    for key in ("qweight", "scales", "zeros"):
        t = codes4[key].clone()
        t[rows8] = codes8[key][rows8].to(t.dtype)
        out[key] = t
    out[ROWS_TENSOR] = torch.where(rows8, 8, 4).to(torch.uint8)
    return out


def kld(hidden: list, ref_hidden: list, head, ref_head) -> float:
    """Mean KL divergence (nats a token) of softmax(hidden @ head^T) from softmax(ref_hidden @ ref_head^T),
    over every token of the windows ([T, d] each, paired)."""
    import torch

    total, count = 0.0, 0
    a, b = head.float(), ref_head.float()
    for h, m in zip(hidden, ref_hidden):
        for c in range(0, h.shape[0], CHUNK_TOKENS):
            lq = torch.log_softmax(h[c:c + CHUNK_TOKENS].float() @ a.T, -1)
            lp = torch.log_softmax(m[c:c + CHUNK_TOKENS].float() @ b.T, -1)
            total += float((lp.exp() * (lp - lq)).sum())
            count += lq.shape[0]
    return total / max(count, 1)


def head_bytes(n: int, k: int, n8: int, group: int) -> int:
    """MatMulNBits bytes of a [n, k] head with `n8` rows at 8 bits and the rest at 4 (fp32 scales a block)."""
    scales = n * (k // group) * 4
    return n8 * k + (n - n8) * k // 2 + scales


def tolerance(kld_8bit: float) -> float:
    """The KL divergence a mixed head may add to the all-8-bit head's (MAX_KLD_SHARE, MIN_KLD)."""
    return max(MAX_KLD_SHARE * kld_8bit, MIN_KLD)
