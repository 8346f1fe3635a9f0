"""verify_parity: ONNX Runtime against the eager PyTorch model, token by token.

Per prompt (tokenized with the checkpoint's tokenizer, BOS prepended when the
model uses one):

1. The reference (TorchReference: eager HF fp32 with its own cache) decodes the
   prompt and `parity.decode_tokens` greedy tokens (teacher sequence).
2. The ONNX decoder (OnnxDecoder) is fed the SAME sequence (prompt + the
   reference's continuation); logits are compared at every step, i.e. after
   every fed token: len(prompt) + decode_tokens steps per prompt.
3. The ONNX decoder runs its own free greedy decode of decode_tokens tokens;
   the prompt counts toward greedy_match when it equals the reference's.

Figures:
- logits_snr_db: 10*log10(sum ref^2 / sum (ref-onnx)^2) over all steps of all
  prompts; worst_step_snr_db: the minimum of the same per step.
- top1_agreement: fraction of steps whose argmax agrees.
- top5_agreement: fraction of steps whose top-5 token SETS are identical
  (order inside the five ignored). top5_overlap (reported, not gated): the mean
  |top5(ref) & top5(onnx)| / 5.
- greedy_match: prompts whose free greedy continuations are identical.

report.json is written only when every figure meets its parity.min_* threshold;
otherwise the stage fails naming the figure and its threshold.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.context import StageContext, StageError

READS = ("parity", "export")
INPUTS = ("untie_head", "export")
TOOLCHAIN = ("torch", "transformers", "onnxruntime", "numpy")
THREADS = 2  # onnxruntime intra-op threads
# The eager reference runs one torch thread: its ops are microseconds, and on a
# shared 2-core host two OpenMP threads spent ~8 ms per tiny op in barriers
# (measured: 115 ms/step at 2 threads vs ~5 ms at 1 on the embedded model).
REF_THREADS = 1


def _prompt_ids(tokenizer, text: str, bos_id, model_type: str) -> list[int]:
    """Token ids of `text`, with BOS prepended when the model uses one.

    The model uses one when its tokenizer adds it by itself (add_special_tokens),
    declares add_bos_token, or is a Gemma (which is trained with BOS always).
    """
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    if bos_id is None:
        return list(plain)
    special = tokenizer(text, add_special_tokens=True)["input_ids"]
    uses_bos = (
        (len(special) > 0 and special[0] == bos_id)
        or bool(getattr(tokenizer, "add_bos_token", False))
        or model_type.startswith("gemma")
    )
    return ([int(bos_id)] if uses_bos else []) + list(plain)


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def run(ctx: StageContext) -> dict:
    import numpy as np
    from transformers import AutoTokenizer

    from pipeline.decode_graph import OnnxDecoder, TorchReference, snr_db

    pc = ctx.cfg.parity
    hf_dir = Path(ctx.inputs["untie_head"])
    art = Path(ctx.inputs["export"])
    prompts = [str(p) for p in pc.prompts]
    decode_tokens = int(pc.decode_tokens)
    if not prompts:
        raise StageError("parity.prompts is empty: nothing to compare")
    if decode_tokens < 1:
        raise StageError(f"parity.decode_tokens must be >= 1, got {decode_tokens}")
    if int(pc.min_greedy_match) > len(prompts):
        raise StageError(f"parity.min_greedy_match {pc.min_greedy_match} exceeds the {len(prompts)} prompts")
    if not (art / "io.json").is_file() or not (art / "model.onnx").is_file():
        raise StageError(f"verify_parity: no exported graph at {art} (model.onnx / io.json); rerun export")
    io = json.loads((art / "io.json").read_text())
    context_length = int(io["context_length"])
    if context_length != int(ctx.cfg.export.context_length):
        raise StageError(f"the export artifact has context_length {context_length} but export.context_length "
                         f"is {ctx.cfg.export.context_length}: rerun export")
    sliding = [layer for layer in io["layers"] if layer["type"] == "sliding_attention"]
    window = io.get("sliding_window") if sliding else None

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    except (OSError, ValueError) as err:
        raise StageError(f"verify_parity: cannot load the checkpoint's tokenizer from {hf_dir}: {err}") from None
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else io.get("bos_token_id")
    encoded = []
    for text in prompts:
        ids = _prompt_ids(tokenizer, text, bos, str(io.get("model_type", "")))
        if not ids:
            raise StageError(f"parity prompt {text!r} tokenizes to nothing")
        total = len(ids) + decode_tokens
        if total > context_length:
            raise StageError(f"parity prompt {text!r}: {len(ids)} prompt tokens + parity.decode_tokens "
                             f"{decode_tokens} = {total} exceeds export.context_length {context_length}")
        if window and total <= window:
            raise StageError(f"parity prompt {text!r}: {len(ids)} + {decode_tokens} tokens stay inside the "
                             f"{window}-token sliding window; raise parity.decode_tokens past it")
        encoded.append(ids)

    ref = TorchReference(hf_dir, threads=REF_THREADS)
    dec = OnnxDecoder(art, threads=THREADS)
    if ref.vocab_size != dec.vocab_size:
        raise StageError(f"vocab mismatch: checkpoint {ref.vocab_size}, export {dec.vocab_size}: rerun export")

    per_prompt = []
    all_ref, all_onnx = [], []
    with ctx.progress(len(prompts), "parity") as bar:
        for text, ids in zip(prompts, encoded):
            # Teacher: the reference's greedy decode, its logits at every step.
            ref.reset()
            r_logits = [ref.step(t) for t in ids]
            cont = []
            for _ in range(decode_tokens):
                tok = int(np.argmax(r_logits[-1]))
                cont.append(tok)
                r_logits.append(ref.step(tok))
            # ONNX fed the same sequence.
            dec.reset()
            o_logits = [dec.step(t) for t in ids + cont]
            r = np.stack(r_logits).astype(np.float64)
            o = np.stack(o_logits).astype(np.float64)
            step_snr = [snr_db(a, b) for a, b in zip(r, o)]
            top1 = r.argmax(-1) == o.argmax(-1)
            t5r = np.argpartition(-r, 5, axis=-1)[:, :5]
            t5o = np.argpartition(-o, 5, axis=-1)[:, :5]
            overlap = np.array([len(set(a) & set(b)) for a, b in zip(t5r, t5o)])
            # Free greedy of the ONNX decoder against the reference's continuation.
            free = dec.generate_greedy(ids, decode_tokens)
            first_div = next((k for k, (a, b) in enumerate(zip(cont, free)) if a != b), None)
            per_prompt.append({
                "prompt": text,
                "prompt_tokens": len(ids),
                "steps": len(ids) + decode_tokens,
                "logits_snr_db": _finite(snr_db(r, o)),
                "worst_step_snr_db": _finite(min(step_snr)),
                "top1_agreement": float(top1.mean()),
                "top5_agreement": float((overlap == 5).mean()),
                "top5_overlap": float(overlap.mean() / 5),
                "greedy_match": free == cont,
                "greedy_first_divergence": first_div,
                "reference_continuation": cont,
            })
            all_ref.append(r)
            all_onnx.append(o)
            bar.advance()

    r = np.concatenate(all_ref)
    o = np.concatenate(all_onnx)
    steps = int(r.shape[0])
    n_steps = np.array([p["steps"] for p in per_prompt])
    metrics = {
        "logits_snr_db": snr_db(r, o),
        "worst_step_snr_db": min(float(p["worst_step_snr_db"]) for p in per_prompt),
        "top1_agreement": float(np.sum([p["top1_agreement"] * s for p, s in zip(per_prompt, n_steps)]) / steps),
        "top5_agreement": float(np.sum([p["top5_agreement"] * s for p, s in zip(per_prompt, n_steps)]) / steps),
        "top5_overlap": float(np.sum([p["top5_overlap"] * s for p, s in zip(per_prompt, n_steps)]) / steps),
        "greedy_match": int(sum(p["greedy_match"] for p in per_prompt)),
        "prompts": len(prompts),
        "steps": steps,
    }
    thresholds = {
        "logits_snr_db": float(pc.min_logits_snr_db),
        "top1_agreement": float(pc.min_top1_agreement),
        "top5_agreement": float(pc.min_top5_agreement),
        "greedy_match": int(pc.min_greedy_match),
    }
    failures = [f"{k} {metrics[k]:.4g} < parity.min_{k} {v:g}" for k, v in thresholds.items() if metrics[k] < v]
    summary = (f"SNR {metrics['logits_snr_db']:.1f} dB (worst step {metrics['worst_step_snr_db']:.1f}), "
               f"top1 {metrics['top1_agreement']:.4f}, top5 {metrics['top5_agreement']:.4f}, "
               f"greedy {metrics['greedy_match']}/{len(prompts)} over {steps} steps")
    ctx.log(summary)
    if failures:
        for p in per_prompt:
            ctx.log(f"  {p['prompt']!r}: snr {p['logits_snr_db']} worst {p['worst_step_snr_db']} "
                    f"top1 {p['top1_agreement']:.3f} greedy {p['greedy_match']}")
        raise StageError("parity failed: " + "; ".join(failures))

    report = {
        "passed": True,
        "metrics": {k: _finite(v) if isinstance(v, float) else v for k, v in metrics.items()},
        "thresholds": thresholds,
        "definitions": {
            "logits_snr_db": "10*log10(sum ref^2 / sum (ref-onnx)^2) over every step of every prompt",
            "worst_step_snr_db": "minimum per-step SNR",
            "top1_agreement": "fraction of steps with the same argmax",
            "top5_agreement": "fraction of steps with identical top-5 token sets (order ignored)",
            "top5_overlap": "mean |top5(ref) & top5(onnx)| / 5 (not gated)",
            "greedy_match": "prompts whose free greedy continuations (decode_tokens) are identical",
            "steps": "per prompt: prompt tokens + decode_tokens; ONNX fed the reference's tokens",
        },
        "decode_tokens": decode_tokens,
        "context_length": context_length,
        "sliding_window": window,
        "threads": {"onnxruntime": THREADS, "torch": REF_THREADS},
        "reference": "transformers eager fp32, own DynamicCache",
        "per_prompt": per_prompt,
    }
    (Path(ctx.out) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return {"metrics": {k: metrics[k] for k in ("logits_snr_db", "worst_step_snr_db", "top1_agreement",
                                                 "top5_agreement", "greedy_match", "prompts", "steps")}}
