"""Fewer bytes in a large-vocabulary head: what a third, narrower tier of rows costs in fidelity.

The head ships 8 bits on the rows that carry the model's probability and 4 on the rest
(pipeline/quant/head_rows.py). ONNX Runtime's MatMulNBits also takes 2-bit codes at accuracy level 4
(the CPU kernel refuses 3), so the least probable rows could be read at 2 bits, or at 4 bits in wider
blocks. This measures what that would cost before any of it is built: the decoder at full precision (the
head alone is measured), round-to-nearest codes per row and block (symmetric at 8 and 4 bits as the build
ships them, asymmetric at 2: four levels need their zero), rows ranked by probability mass on the first
half of the held-out windows and measured on the second half, KL divergence from the full-precision head
(mean, p99), same top-1, and the bytes a token reads (fp32 scales a block; a 2-bit block's zero point
packed at 2 bits).

    python benchmarks/head_tiers.py --model artifacts/_models/gemma3_270m-*/ --windows 8

No ONNX graph is built: the codes are dequantized in torch, which computes what MatMulNBits computes up to
its int8 rounding of the activations (the same for every row, so the comparison between variants holds).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rtn(w, bits: int, group: int, sym: bool):
    """Round-to-nearest codes of w [n, k] per block of `group`, dequantized back to float32."""
    import torch

    n, k = w.shape
    b = w.reshape(n, k // group, group).double()
    if sym:
        half = 2 ** (bits - 1)
        scale = b.abs().amax(-1, keepdim=True) / (half - 1 if bits > 2 else half)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.clamp(torch.round(b / scale), -half, half - 1)
        return (q * scale).reshape(n, k).float()
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.clamp(torch.round(-lo / scale), 0, 2 ** bits - 1)
    q = torch.clamp(torch.round(b / scale) + zero, 0, 2 ** bits - 1)
    return ((q - zero) * scale).reshape(n, k).float()


def tier_bytes(rows: int, k: int, bits: int, group: int, sym: bool) -> int:
    blocks = rows * (k // group)
    return rows * k * bits // 8 + blocks * 4 + (0 if sym else (blocks * bits + 7) // 8)


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.measure import kld
    from pipeline.quant.head_rows import probability_mass

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a Hugging Face model folder (the head is its lm_head)")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of --n-ctx tokens: half rank, half measure")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    tok = AutoTokenizer.from_pretrained(str(a.model))
    model = AutoModelForCausalLM.from_pretrained(str(a.model), torch_dtype=torch.float32).eval()
    bos = tok.bos_token_id
    windows, _ = kld.heldout_windows(a.model, tok, [], a.n_ctx, bos, a.windows)
    if len(windows) < 2:
        raise SystemExit(f"{len(windows)} held-out windows: need at least 2")
    hidden = []
    with torch.no_grad():
        for w in windows:
            hidden.append(model.model(torch.tensor([w])).last_hidden_state[0])
    head = model.get_output_embeddings().weight.detach().float()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    n, k = head.shape
    half = len(hidden) // 2
    rank, measure = hidden[:half], list(zip(hidden[half:], windows[half:]))
    order = torch.argsort(-probability_mass(rank, head), stable=True)
    print(f"{a.model}: head {n} x {k}; {sum(h.shape[0] for h in rank)} tokens rank the rows, "
          f"{sum(h.shape[0] - 1 for h, _ in measure)} held-out tokens measure")

    def logits(h, w):
        z = h @ w.T
        return torch.tanh(z / softcap) * softcap if softcap else z

    def figures(w) -> dict:
        """llama.cpp's KL-divergence statistics of the head `w` against the full-precision head (kld.Accumulator,
        as verify_parity reports them), every position of the measuring windows but the last."""
        acc = kld.Accumulator()
        for h, ids in measure:
            for c in range(0, h.shape[0] - 1, 64):
                e = min(c + 64, h.shape[0] - 1)
                acc.add(logits(h[c:e], head).numpy(), logits(h[c:e], w).numpy(), ids[c + 1:e + 1])
        return acc.summary()

    g8, g4 = 32, 32
    w8, w4 = rtn(head, 8, g8, True), rtn(head, 4, g4, True)
    n8 = 65536 if n > 4 * 65536 else n // 4

    def variant(name: str, tiers: list[tuple[int, int, int, bool]]):
        """tiers: (rows, bits, group, sym) in order of probability; rows summing to n."""
        w = torch.empty_like(head)
        start, nbytes = 0, 0
        for rows, bits, group, sym in tiers:
            idx = order[start:start + rows]
            if bits == 8 and group == g8 and sym:
                w[idx] = w8[idx]
            elif bits == 4 and group == g4 and sym:
                w[idx] = w4[idx]
            else:
                w[idx] = rtn(head[idx], bits, group, sym)
            nbytes += tier_bytes(rows, k, bits, group, sym)
            start += rows
        assert start == n
        f = figures(w)
        print(f"{name:58s} {nbytes / 1e6:7.1f} MB  KLD {f['kld_mean']:.5f} / p99 {f['kld_p99']:.4f}  "
              f"same top-1 {f['same_top1_pct']:.2f}%", flush=True)

    rest = n - n8
    variant("every row 8-bit g32", [(n, 8, g8, True)])
    variant(f"8-bit on {n8} rows, 4-bit g32 on the rest (the build's)", [(n8, 8, g8, True), (rest, 4, g4, True)])
    variant("every row 4-bit g32", [(n, 4, g4, True)])
    for tail in (rest // 3, rest // 3 * 2, rest):
        if tail <= 0:
            continue
        variant(f"  + the {tail} least probable at 2-bit g32 asym", [(n8, 8, g8, True), (rest - tail, 4, g4, True),
                                                                      (tail, 2, 32, False)])
    for tail in (rest // 3 * 2, rest):
        variant(f"  + the {tail} least probable at 4-bit g128", [(n8, 8, g8, True), (rest - tail, 4, g4, True),
                                                                 (tail, 4, 128, True)])
    variant(f"  + the {rest // 3 * 2} least probable at 2-bit g64 asym",
            [(n8, 8, g8, True), (rest - rest // 3 * 2, 4, g4, True), (rest // 3 * 2, 2, 64, False)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
