"""calibrate: per-linear input second moments H = sum x x^T for GPTQ.

Data: `calibrate.dataset`, either the user's own text (a local .txt / .jsonl
file or a folder of them, pipeline/sources/textdata.py: each document framed with
BOS / EOS as the tokenizer says; `calibrate.field` names a .jsonl record's
text, `calibrate.chat_template: true` renders chat records with the
checkpoint's own template; DVC hashes the files, so an edit reruns the stage),
or by default the held-out tail of the embedded corpus (pipeline/sources/corpus.py), tokenized
with the checkpoint's own tokenizer exactly as training framed it
([BOS, *ids, EOS] per docstring), cut into `samples` non-overlapping windows of
`seq_len` tokens (drawn with `seed` among all the windows the tail holds).
Too few windows is a StageError, never a silent shortfall. For the embedded
model, training_report.json (copied along by untie_head) supplies the
held-out fraction the model was trained with, and the corpus hash and held-out
token count are checked against it, so calibration can never reach text the
model was trained on (a different Python's stdlib would shift the split).

The fp32 model runs the windows one decoder layer at a time (layer i over every
batch, then layer i + 1: pipeline/quant/layerwise.py, checked exact against the
model's own forward first); a forward pre-hook on every nn.Linear inside the
decoder layers accumulates H in float32 (add_second_moment), only the current layer's held, each
layer's written as soon as it is done (pipeline/sources/tensorfile.py) and its weights
dropped: on the 1.75B geometry the whole-model order would hold 12.7 GB of H.
The head's input is the decoder's final hidden state, accumulated directly from it (for the supported families,
Llama / Qwen3 / Gemma3, the head is applied to exactly that tensor), so the
[tokens, vocab] logits are never materialized (262k columns for Gemma 3).
Linears fed the same tensor (q/k/v; gate/up) share one H, stored once.

Writes `hessians.safetensors` (float32), `token_ids.npy` (the windows, int32
[samples, seq_len]: the phone build calibrates its QDQ graph on them) and
`calibration.json`:
{dataset, data_sha256, samples, tokens, seq_len, layers: {name: {hessian,
rows, in_features, out_features}}, ...}. data_sha256 is the sha256 of the
exact token ids used (int32 little-endian, window after window): later stages
key on the data's content, not its name.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

from pipeline.engine.context import StageError

READS = ("calibrate",)
INPUTS = ("untie_head",)
TOOLCHAIN = ("torch", "transformers", "numpy", "safetensors")
MEMORY_KEYS = ("calibrate.samples", "calibrate.seq_len")  # the settings that size its memory (named when the kernel kills it)

DATASETS = ("stdlib_docstrings_heldout",)  # the built-in one; any other value is a local path (textdata)
HEAD = "lm_head"
HESSIANS = "hessians.safetensors"
CALIBRATION_JSON = "calibration.json"
TOKENS = "token_ids.npy"
BATCH = 8
_LAYER_LINEAR = re.compile(r"(^|\.)layers\.\d+\.")


def _settings(cfg) -> dict:
    c = cfg.calibrate
    s = {
        "dataset": str(c.dataset),
        "samples": int(c.samples),
        "seq_len": int(c.seq_len),
        "min_samples": int(c.get("min_samples", c.samples)),
        "seed": int(c.get("seed", 0)),
        "field": str(c.get("field") or "text"),
        "chat_template": bool(c.get("chat_template", False)),
    }
    if s["dataset"] not in DATASETS:
        from pipeline.sources import textdata

        try:
            textdata.files_of(s["dataset"])
        except textdata.TextDataError as err:
            raise StageError(f"calibrate.dataset: {err}") from None
    if s["samples"] < 1 or s["seq_len"] < 2:
        raise StageError("calibrate.samples must be >= 1 and calibrate.seq_len >= 2")
    if not 1 <= s["min_samples"] <= s["samples"]:
        raise StageError(f"calibrate.min_samples={s['min_samples']} must be in 1..samples ({s['samples']})")
    return s


def heldout_ids(src: Path, tokenizer, log=None) -> tuple[list[int], dict]:
    """The held-out token ids of the corpus under this checkpoint's tokenizer (pipeline/textdata.heldout)."""
    from pipeline.sources import textdata

    try:
        return textdata.heldout(src, tokenizer, log)
    except textdata.TextDataError as err:
        raise StageError(str(err)) from None


SYMMETRIC_BLOCK = 2048  # add_second_moment's column block


def add_second_moment(acc: torch.Tensor, x: torch.Tensor) -> None:
    """acc (float32 [K, K]) += x^T x for one batch's inputs x [rows, K], in float32 as GPTQ's reference
    implementations accumulate it (the stage stores H as float32), the upper block triangle computed and
    mirrored (x^T x is symmetric: ~40% fewer products at K = 8960). Written by hand because torch has no
    symmetric rank-k update. It was float64 throughout: on the Qwen2.5-1.5B geometry (down_proj's K = 8960,
    28 layers, 8192 rows) ~39 TFLOP of float64, most of the stage's 791 s on the 2-core AVX-512 builder;
    one K = 8960 batch there took 3.29 s in float64, 1.66 s in float32, 1.27 s so."""
    import torch

    x = x.float()
    k = x.shape[1]
    for i in range(0, k, SYMMETRIC_BLOCK):
        j = min(i + SYMMETRIC_BLOCK, k)
        prod = torch.mm(x[:, i:j].T, x[:, i:])  # block row i against columns i..K
        acc[i:j, i:].add_(prod)
        if j < k:
            acc[j:, i:j].add_(prod[:, j - i:].T)


def decoder_linears(model) -> dict:
    """{name: nn.Linear} for every linear inside the decoder layers, plus the head."""
    import torch

    found = {name: m for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and _LAYER_LINEAR.search(name)}
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise StageError("the model has no linear output head (lm_head)")
    found[HEAD] = head
    return found


def run(ctx) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from pipeline.quant import layerwise
    from pipeline.sources.tensorfile import StreamWriter

    s = _settings(ctx.cfg)
    src = Path(ctx.inputs["untie_head"])
    t_start = time.perf_counter()
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise StageError(f"{src} is already quantized: calibration needs the full-precision checkpoint")

    with ctx.progress(None, "the tokenizer and the calibration text, tokenized"):
        tokenizer = AutoTokenizer.from_pretrained(src)
        if s["dataset"] in DATASETS:
            held, facts = heldout_ids(src, tokenizer, ctx.log)
            where = "the held-out split"
        else:
            from pipeline.sources import textdata

            try:
                held, facts = textdata.stream(tokenizer, s["dataset"], s["field"], s["chat_template"])
            except textdata.TextDataError as err:
                raise StageError(f"calibrate.dataset: {err}") from None
            where = f"calibrate.dataset ({s['dataset']})"
    T = s["seq_len"]
    available = len(held) // T
    if available < s["min_samples"]:
        raise StageError(
            f"calibration data too short: {where} has {len(held)} tokens, {available} windows of "
            f"{T} tokens; calibrate.min_samples={s['min_samples']} (samples={s['samples']})"
        )
    n = min(s["samples"], available)
    if n < s["samples"]:
        ctx.log(f"only {available} windows of {T} tokens in {where}: using {n} of the {s['samples']} asked")
    gen = torch.Generator().manual_seed(s["seed"])
    picks = torch.randperm(available, generator=gen)[:n].sort().values
    held_t = torch.tensor(held[: available * T], dtype=torch.long).view(available, T)
    windows = held_t[picks].contiguous()
    ids32 = windows.numpy().astype("<i4")
    data_sha = hashlib.sha256(ids32.tobytes()).hexdigest()
    vocab = int(config.get("text_config", config).get("vocab_size", 0)) or None
    if vocab is not None and int(windows.max()) >= vocab:
        raise StageError(f"token id {int(windows.max())} is outside the model's vocabulary ({vocab})")

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    linears = decoder_linears(model)
    if len(linears) < 2:
        raise StageError("found no linear layers inside the decoder layers (expected *.layers.N.*)")

    # the layer-by-layer run (below) checked against the forward before the hooks go on
    decoder = model.get_decoder()
    try:
        layer_list = layerwise.layers_of(decoder)
        layerwise.check(decoder, windows[:1, : min(T, 16)])
    except layerwise.LayerwiseError as err:
        raise StageError(f"calibrate: {err}") from None
    acc: dict[str, torch.Tensor] = {}  # key -> float32 H, the current layer's only
    rows: dict[str, int] = {}  # key -> rows accumulated
    key_of: dict[str, str] = {}  # linear name -> key (fixed by the first batch)
    batch_inputs: dict[int, tuple] = {}  # id(input tensor) -> (tensor, key), this batch only

    def accumulate(name: str, x: torch.Tensor) -> None:
        seen = batch_inputs.get(id(x))
        if seen is not None and seen[0] is x:
            key = seen[1]
        else:
            key = key_of.get(name, name)
            x2 = x.detach().reshape(-1, x.shape[-1])
            if key not in acc:
                if key in rows:
                    raise StageError(f"{name} shares its input with {key}, which belongs to an earlier layer")
                acc[key] = torch.zeros(x2.shape[1], x2.shape[1], dtype=torch.float32)
                rows[key] = 0
            add_second_moment(acc[key], x2)
            rows[key] += x2.shape[0]
            batch_inputs[id(x)] = (x, key)
        if key_of.setdefault(name, key) != key:
            raise StageError(f"{name} shared its input with {key} in one batch and not in another")

    def finish(writer, key: str) -> None:
        h = acc.pop(key)
        if not torch.isfinite(h).all():
            raise StageError(f"the input second moment of {key} is not finite (the fp32 model overflowed)")
        writer.add(key, h.float())

    handles = [
        module.register_forward_pre_hook(lambda mod, args, _name=name: accumulate(_name, args[0]))
        for name, module in linears.items() if name != HEAD
    ]
    # Layer by layer (pipeline/quant/layerwise.py): layer i runs over every batch before layer i + 1, so one
    # layer's second moments are held (not every layer's: 12.7 GB in float64, 6.3 in float32, on a 1.75B model) and each
    # is written, and its layer's weights dropped, once that layer is done. The same sums, batch by batch
    # in the same order, as the whole-model forward: checked exact on a short prefix first.
    batches = [windows[i : i + BATCH] for i in range(0, n, BATCH)]
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), StreamWriter(ctx.out / HESSIANS, list(linears), {"format": "pt"}) as writer, \
                ctx.progress(len(layer_list) * n, f"calibration, {len(layer_list)} layers x {n} samples") as bar:
            states = [list(layerwise.capture(decoder, b)) for b in batches]  # per batch: [hidden, calls]
            for i, layer in enumerate(layer_list):
                for st, b in zip(states, batches):
                    batch_inputs.clear()
                    st[0] = layerwise.step(layer, st[0], st[1][i])
                    bar.advance(b.shape[0])
                for key in list(acc):
                    finish(writer, key)
                layer.to("meta")  # its weights are no longer needed: the memory goes back
            for st in states:
                batch_inputs.clear()
                accumulate(HEAD, decoder.norm(st[0]))
            finish(writer, HEAD)
            del states
    finally:
        for h in handles:
            h.remove()
        batch_inputs.clear()
    t_forward = time.perf_counter() - t0

    missing = [name for name in linears if name not in key_of]
    if missing:
        raise StageError(f"{len(missing)} linear(s) saw no input during calibration, e.g. {missing[0]}")
    layers = {}
    for name, module in linears.items():
        key = key_of[name]
        layers[name] = {
            "hessian": key,
            "rows": rows[key],
            "in_features": int(module.in_features),
            "out_features": int(module.out_features),
        }
    # The windows themselves: the phone build's QDQ calibration runs them
    # through the exported graph (stages/pack.py). Their bytes are data_sha256's.
    import numpy as np

    np.save(ctx.out / TOKENS, ids32)
    info = {
        "dataset": s["dataset"],
        "data_sha256": data_sha,
        "samples": n,
        "tokens": int(windows.numel()),
        "seq_len": T,
        "seed": s["seed"],
        "windows_available": available,
        "corpus": facts,
        "layers": layers,
    }
    (ctx.out / CALIBRATION_JSON).write_text(json.dumps(info, indent=2) + "\n")
    wall = time.perf_counter() - t_start
    ctx.log(f"{n} samples x {T} tokens (sha256 {data_sha[:12]}): {len(layers)} linears, "
            f"{len(rows)} distinct H, forward {t_forward:.1f} s, total {wall:.1f} s")
    return {
        "metrics": {
            "samples": n,
            "tokens": int(windows.numel()),
            "linears": len(layers),
            "hessians": len(rows),
            "seconds": round(wall, 2),
        },
        "data_sha256": data_sha,
    }
