"""quantize: 4-bit group-wise weights (GPTQ or round-to-nearest) for every
decoder linear and the output head.

The head is quantized too: left in 16/32-bit it cost more per decode step
than the whole 4-bit saving on the 1.7B model (field notes); untie_head has
made it `lm_head.weight`. The algorithm and the grid are in pipeline/quant/gptq.py;
which decoder linears get 8 bits, where the kernel takes them, in
pipeline/quant/bit_alloc.py (each unit's effect on the calibration logits, measured
from the final hidden states and the head's Grams, the layers below it replayed).

Output (the contract the packers read; pipeline.quant.gptq.load_quantized and
quant_meta read it back):

- quant.json: {"format": "edgekiln-int4/1", "bits": 4, "group_size": g, "sym",
  "method", "scale_search", ["scale_dtype": "fp16" only when set: an fp32
  run's quant.json stays byte-identical to the ones before the option],
  "layers": {name: {"in_features", "out_features",
  "weight_rel_mse", "out_rel_err_h"}}, "calibration": {"data_sha256", ...}}.
  A layer quantized under `group_fallback: divisor` (or, with `group_size:
  null` on a kernel that takes a size per layer, one whose K the kernel's
  default size does not divide), or the head at its own `head_group_size`,
  also records its own "group_size" (absent otherwise). Where the kernel takes
  one size for every layer (vLLM's GPTQ) and its default does not divide
  every K, "group_size" is the largest size that does and "group_size_default"
  the kernel's (absent otherwise);
  the head at 8 bits (`head_bits`) records "bits": 8 (with "head_bits": 8 at
  the top level), its codes 0..255 with the symmetric zero at 128. Decoder
  linears promoted to 8 bits (`eight_bit_budget`, pipeline/quant/bit_alloc.py)
  record "bits": 8 the same way, and quant.json an "eight_bit" record: the
  budget; every unit's extra bytes, gain (the relative squared error of the
  calibration logits it removes alone at full precision) and the SNR then;
  the units chosen; the SNR with every decoder linear at 4 bits and with the
  choice (absent when the budget is 0). Where the head's width is measured
  (`head_bits: null` on ORT's MatMulNBits), a "head" record: per width (4, 8)
  the calibration logits' SNR with the decoder at its final codes and the
  extra bytes, the gain, the threshold and the width chosen. Where the kernel
  gathers from block codes (the same two paths), an "embedding" record: a tied
  checkpoint's table is the head's ("chosen": "head"); an untied one's is
  measured kept, at 8 and at 4 bits (gptq.embedding_codes, blocks of 32,
  fp16-valued scales: per option the calibration logits' SNR, its loss against
  the table kept, its bytes as the kernel's artifact holds them) and "chosen"
  names the form the pack ships (keep, int8, int4).
- quantized.safetensors: per layer L, `L.qweight` uint8 [N, K] (codes 0..15,
  unpacked), `L.scales` float32 [N, K//g], `L.zeros` uint8 [N, K//g] (all 8
  when sym). W[n, k] = (qweight[n, k] - zeros[n, k//g]) * scales[n, k//g].

out_rel_err_h = tr(E H E^T) / tr(W H W^T), E = W - W_q, with H the layer's
calibration second moment: the relative error of the layer's output on the
calibration inputs, the quantity GPTQ minimizes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.engine.context import StageError
from pipeline.quant import head_rows

# device and priority: which kernel the codes are for decides whether the head
# may have its own group size (quantize.head_group_size: null).
READS = ("quantize", "device", "priority")
HEAD = "lm_head"
HEAD_GROUP_SIZE = 32
HEAD_BITS_ORT = 8
# quantize.head_bits: null where the kernel takes 8-bit heads (ORT's MatMulNBits; llama.cpp, whose Q8_0 holds
# a group-32 symmetric 8-bit head exactly, pipeline/quant/gguf_q4.py; HEAD8_PATHS): both widths are measured
# on the calibration windows (the logits' SNR with the decoder at its final codes and the head at 4, then 8
# bits) and 8 bits are kept where they buy at least this much; the extra bytes (K*N/2) are recorded beside.
# ~135M Llama-family model (README): 4-bit g32 head 38.9 dB against 46.2 at 8 bits, 7.3 dB.
HEAD_MIN_GAIN_DB = 1.0
# An untied checkpoint's token embedding on those kernels (ORT's GatherBlockQuantized, GGUF's Q8_0 / Q4_0):
# the table kept, at 8 bits or at 4 (gptq.embedding_codes), each measured as the head is (the calibration
# logits with everything else at its final codes: one run of the windows per option); the narrowest that
# loses at most this much against the table as it is ships. The head's rule read the other way: a wider
# form must buy at least a dB to be worth its bytes.
EMBED_MAX_LOSS_DB = HEAD_MIN_GAIN_DB
ORT_PATH = "w4_ort_matmulnbits"  # the weight path whose kernel (MatMulNBits) the *_ORT defaults are for
HEAD8_PATHS = (ORT_PATH, "gguf_q4_0")  # the kernels that take an 8-bit head (MatMulNBits bits=8, GGUF Q8_0)
# The body's group size where the kernel is ORT's MatMulNBits (the speed path): its int8-activation
# kernel does work per block, so 256-weight blocks ran its matmuls 1.1-1.24x faster than 128 for 3%
# fewer bytes; the ~100M model's graph decoded 1.13x faster at g256 than at g128 side by side, and
# 1.39-1.43x llama.cpp Q4_K_M at 32 in stage runs (g128: 1.19-1.36x; README).
GROUP_SIZE_ORT = 256
GROUP_SIZE = 128  # every other kernel (tinygemm, vLLM's GPTQ)
# Weight paths whose kernel takes a group size per layer: MatMulNBits (a block size per node), tinygemm (per
# packed layer), and the paths that run no 4-bit codes of ours (the phone's QNN graph is calibrated from
# the float export; model_dtype runs the checkpoint's dtype), so the codes need only be valid.
PER_LAYER_PATHS = (ORT_PATH, "w4a16_tinygemm", "qnn_graph", "model_dtype")
# vLLM's GPTQ config holds one group size (it fuses q/k/v and gate/up: stages/pack.py _write_gptq); no device
# (a config without one) is treated the same, as the size every kernel can take
ONE_GROUP_PATHS = (None, "w4a8_gptq_vllm")
# GGUF Q4_0 is 32-weight blocks (conf/quantize/q4_0.yaml pins group_size: 32): no other size to fall back to
FIXED_GROUP_PATHS = ("gguf_q4_0",)
# extra bytes for 8-bit decoder linears (pipeline/quant/bit_alloc.py), a fraction of the 4-bit code bytes:
# buys back what the coarser groups cost: on the ~100M model at g256, 4% (layer 0's attention) gave
# 9.8 dB, 10% (and layer 1's q|k|v, layer 0's down, layer 1's o) 11.4; Q4_K_M 9.7 (README)
EIGHT_BIT_BUDGET_ORT = 0.1
# quantize.sensitivity_windows: null: the calibration windows making about this many tokens (at least one):
# the 4 windows x 128 tokens the 8-bit choice was tuned on (README); Gemma 3 270M's 528-token windows: 1.
SENSITIVITY_TOKENS = 512
INPUTS = ("untie_head", "calibrate")
TOOLCHAIN = ("torch", "transformers", "numpy", "safetensors")
MEMORY_KEYS = ("quantize.sensitivity_windows",)  # the settings that size its memory (named when the kernel kills it)

FALLBACKS = ("error", "divisor")
SPILL = ".codes.spill"  # the codes as they are made (run); removed once quantized.safetensors is written
_QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "zeros")


def _settings(cfg, model: dict | None = None) -> dict:
    from pipeline.quant import bit_alloc, gptq

    q = cfg.quantize
    path = _weight_path(cfg, model)  # resolved once: every null default below depends on it
    group_size = _by_kernel(q, path, "group_size", GROUP_SIZE_ORT, GROUP_SIZE)
    s = {
        "method": str(q.get("method", "gptq")),
        "bits": int(q.get("bits", 4)),
        "group_size": group_size,
        # null is the kernel's preference, not the user's pin: where the kernel takes a group size per
        # layer (PER_LAYER_PATHS), a layer it does not divide takes the largest size the kernel takes that
        # does (_layer_group_size); where it takes one for every layer (vLLM's GPTQ, or no device known),
        # the model gets the largest that divides every K (_model_group_size). An explicit size errors.
        "group_size_by_kernel": q.get("group_size") is None and path in PER_LAYER_PATHS,
        "group_size_model_wide": q.get("group_size") is None and path not in PER_LAYER_PATHS
        and path not in FIXED_GROUP_PATHS,
        # the head's size is the body's where the kernel takes one size (null head_group_size there)
        "head_follows_body": q.get("head_group_size") is None and path in ONE_GROUP_PATHS,
        "sym": bool(q.get("sym", True)),
        "scale_search": bool(q.get("scale_search", True)),
        "damp": float(q.get("damp", 0.01)),
        "block_size": int(q.get("block_size", 128)),
        "group_fallback": str(q.get("group_fallback", "error")),
        "scale_dtype": str(q.get("scale_dtype", "fp32")),
        "head_group_size": _head_group_size(q, path, group_size),
        "head_bits": int(q.head_bits) if q.get("head_bits") is not None
        else HEAD_BITS_ORT if path in HEAD8_PATHS else 4,
        # null on the kernels that take 8-bit heads: the width is measured (_head_width), 8 until then
        "head_bits_measured": q.get("head_bits") is None and path in HEAD8_PATHS,
        # an 8-bit head's 8-bit rows (_head_rows): null measured, 0 one width, N the N most probable; only
        # MatMulNBits' graph takes a head of two widths (pipeline/graphs/gqa_graph.py reorders its logits)
        "head_rows8": _optional_int(q.get("head_rows8")),
        "head_rows_ok": path == ORT_PATH,
        # an untied table's width is measured where the kernel gathers from block codes (_embedding_width);
        # "keep" ships it as the pack holds it today: fp32 in ORT's graph, f16 in a GGUF
        "embedding_measured": path in HEAD8_PATHS,
        "embedding_keep_bytes": 4 if path == ORT_PATH else 2,
        # a block's scale: fp32 in ORT's graph (the rows come out fp32 with no fp16 product), fp16 in GGUF
        "embedding_scale_bytes": 4 if path == ORT_PATH else 2,
        "eight_bit_budget": _by_kernel(q, path, "eight_bit_budget", EIGHT_BIT_BUDGET_ORT, 0.0),
        # null: enough windows for SENSITIVITY_TOKENS tokens (_promote); an int: that many windows
        "sensitivity_windows": _optional_int(q.get("sensitivity_windows", 4)),
        "sensitivity": str(q.get("sensitivity", "auto")),
    }
    if s["method"] not in gptq.METHODS:
        raise StageError(f"quantize.method={s['method']!r} is not known; use {' or '.join(gptq.METHODS)}")
    if s["bits"] != gptq.BITS:
        raise StageError(f"quantize.bits={s['bits']}: only {gptq.BITS}-bit is supported")
    if s["head_bits"] not in gptq.LAYER_BITS:
        raise StageError(f"quantize.head_bits={s['head_bits']}: use {' or '.join(map(str, gptq.LAYER_BITS))}")
    if s["head_rows8"] and not s["head_rows_ok"]:
        raise StageError(f"quantize.head_rows8={s['head_rows8']}: a head of two widths runs on ONNX Runtime's "
                         f"MatMulNBits graph only (this device's weight path is {path}); use 0 or null")
    if s["head_rows8"] and s["head_bits"] != 8:
        raise StageError(f"quantize.head_rows8={s['head_rows8']} needs the head at 8 bits: "
                         f"quantize.head_bits=8 or null")
    if s["head_rows8"] is not None and s["head_rows8"] < 0:
        raise StageError(f"quantize.head_rows8={s['head_rows8']}: 0, a count of rows, or null")
    if not 0 <= s["eight_bit_budget"] <= 1:
        raise StageError(f"quantize.eight_bit_budget={s['eight_bit_budget']}: "
                         f"a fraction of the 4-bit code bytes, 0 to 1")
    if s["sensitivity"] not in bit_alloc.SENSITIVITIES:
        raise StageError(f"quantize.sensitivity={s['sensitivity']!r}: use {' or '.join(bit_alloc.SENSITIVITIES)}")
    if s["sensitivity_windows"] is not None and s["sensitivity_windows"] < 1:
        raise StageError("quantize.sensitivity_windows must be at least 1")
    if s["group_size"] < 1:
        raise StageError("quantize.group_size must be positive")
    if s["block_size"] < 1:
        raise StageError("quantize.block_size must be positive")
    if not 0 <= s["damp"] < 1:
        raise StageError("quantize.damp must be in [0, 1)")
    if s["scale_dtype"] not in gptq.SCALE_DTYPES:
        raise StageError(f"quantize.scale_dtype={s['scale_dtype']!r} is not known; "
                         f"use {' or '.join(gptq.SCALE_DTYPES)}")
    if s["group_fallback"] not in FALLBACKS:
        raise StageError(f"quantize.group_fallback={s['group_fallback']!r}; use {' or '.join(FALLBACKS)}")
    return s


def _optional_int(value) -> int | None:
    return None if value is None else int(value)


def _weight_path(cfg, model: dict | None = None) -> str | None:
    """The device's weight path for the model of config.json `model` (pipeline/quant/weight_path.py: the
    pack stage's choice, a fallback included), or None where the config names no device."""
    from omegaconf import OmegaConf

    from pipeline.quant import weight_path

    if "device" not in cfg or "priority" not in cfg:
        return None
    try:
        return weight_path.select(OmegaConf.to_container(cfg.device, resolve=True), str(cfg.priority.name),
                                  model)["path"]
    except ValueError:
        return None


def _head_group_size(q, path: str | None, group_size: int) -> int:
    """quantize.head_group_size, or for null: 32 unless the weight path `path` needs one group size
    (then the body's, `group_size`)."""
    if q.get("head_group_size") is not None:
        return int(q.head_group_size)
    # vLLM's GPTQ config has one group_size for every layer, the head included
    return group_size if path in ONE_GROUP_PATHS else HEAD_GROUP_SIZE


def _by_kernel(q, path: str | None, key: str, ort, others):
    """quantize.<key> (`q`), or for null: `ort` where the weight path `path` is ORT's MatMulNBits
    (which takes 8-bit blocks, and is the speed path), `others` for every other kernel (tinygemm,
    vLLM's GPTQ, GGUF Q4_0: 4-bit codes only). Used for eight_bit_budget (EIGHT_BIT_BUDGET_ORT / 0) and
    group_size (GROUP_SIZE_ORT / GROUP_SIZE); head_bits follows HEAD8_PATHS."""
    value = q.get(key)
    if value is not None:
        return type(ort)(value)
    return ort if path == ORT_PATH else others


def _layer_group_size(name: str, k: int, s: dict) -> int:
    """The group size of one linear: the configured one where it divides K; else, under
    group_fallback=divisor or the kernel's own default (group_size: null), the largest size the
    4-bit kernels take (config.GROUP_SIZES: powers of two, as MatMulNBits requires) below it
    that divides K; else an error naming the fix."""
    from pipeline.engine.config import GROUP_SIZES

    g = s["head_group_size"] if name == HEAD else s["group_size"]
    if k % g == 0:
        return g
    if s["group_fallback"] == "divisor" or (name != HEAD and s.get("group_size_by_kernel")):
        fits = [d for d in GROUP_SIZES if d <= g and k % d == 0]
        if fits:
            return max(fits)
        raise StageError(f"{name}: in_features K={k} is not a multiple of any group size <= {g} the 4-bit "
                         f"kernels take ({', '.join(map(str, GROUP_SIZES))})")
    raise StageError(
        f"{name}: quantize.{'head_' if name == HEAD else ''}group_size={g} does not divide in_features K={k} "
        f"(choose a group size that divides it, or quantize.group_fallback=divisor)"
    )


def _model_group_size(layers: dict, s: dict) -> int:
    """For a kernel that takes one group size for every layer (vLLM's GPTQ) under group_size: null: the
    kernel's size where it divides every linear's K (the head's too, which shares it), else the largest
    size the kernels take below it that does; an error where none does."""
    from pipeline.engine.config import GROUP_SIZES

    g = s["group_size"]
    ks = sorted({int(info["in_features"]) for name, info in layers.items()
                 if name != HEAD or s.get("head_follows_body")})
    fits = [d for d in GROUP_SIZES if d <= g and all(k % d == 0 for k in ks)]
    if not fits:
        raise StageError(f"no group size <= {g} the 4-bit kernels take ({', '.join(map(str, GROUP_SIZES))}) "
                         f"divides every in_features K of the model ({', '.join(map(str, ks))}), and this "
                         f"device's kernel takes one group size for every layer")
    return max(fits)


def _weight_map(src: Path) -> dict[str, str]:
    from pipeline.sources.checkpoint_files import weight_map

    found = weight_map(src)
    if not found:
        raise StageError(f"no *.safetensors weights in {src}")
    return found


def _snr_db(rel_err: float) -> float | None:
    """-10 log10 of a relative squared error; None for no error at all (JSON has no infinity)."""
    import math

    return round(-10 * math.log10(rel_err), 3) if rel_err > 0 else None


def _promote(ctx, s, src: Path, cal_dir: Path, layers: dict, tensors: dict, group_sizes: dict,
             weight, quantize_layer, head_alt: dict | None = None) -> tuple[dict, dict | None, dict | None,
                                                                           dict | None]:
    """The decoder units worth 8 bits under the budget (pipeline/quant/bit_alloc.py), requantized at 8 bits
    in place of their 4-bit codes; returns quant.json's "eight_bit" record (what was measured, what was
    chosen, the logits' SNR on the calibration windows before and after), given `head_alt` (the
    head's 4-bit tensors beside the 8-bit ones in `tensors`) the head's width record (_head_width) and,
    where it comes out at 8 bits, its 8-bit rows' (_head_rows: with the mixed codes under "codes" where
    they ship), and where s["embedding_measured"] the embedding's (_embedding_width)."""
    import numpy as np
    import torch

    from pipeline.quant import bit_alloc, gptq
    from pipeline.sources.checkpoint_files import load_hf_model

    windows = np.load(cal_dir / "token_ids.npy")
    count = s["sensitivity_windows"]
    if count is None:
        count = min(len(windows), max(1, round(SENSITIVITY_TOKENS / windows.shape[1])))
    if count > len(windows):
        raise StageError(f"quantize.sensitivity_windows={count}, but calibration holds "
                         f"{len(windows)} window(s) (calibrate.samples)")
    windows = windows[:count]
    # no budget: the run only weighs the head's width (no unit is measured)
    units = bit_alloc.units(layers, exclude=(HEAD,)) if s["eight_bit_budget"] > 0 else []
    budget_bytes = s["eight_bit_budget"] * bit_alloc.code_bytes(layers, exclude=(HEAD,))

    def at_codes(name: str) -> torch.Tensor:
        return gptq.dequantize(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], tensors[f"{name}.zeros"],
                               group_sizes[name])

    model = load_hf_model(src)  # fp32, eager attention: the parity stage's reference model
    tied = _shares_head(s, model.get_input_embeddings(), weight)  # before any measure moves the table
    with ctx.progress(len(units), f"8-bit sensitivities of {len(units)} units ({windows.size} tokens)") as bar:
        found = bit_alloc.measure(model, windows, units, list(layers), at_codes, lambda n: weight(n).float(),
                                  on_unit=lambda u: bar.advance(), sensitivity=s["sensitivity"])
    chosen = bit_alloc.choose(found["gains"], units, budget_bytes)
    by_key = {u.key: u for u in units}
    with ctx.progress(None, "the chosen units at 8 bits; the head's and the embedding's widths measured"):
        for key in chosen:
            for name in by_key[key].layers:
                quantize_layer(name, 8)
                model.get_submodule(name).weight.data.copy_(at_codes(name))
        changed = [name for key in chosen for name in by_key[key].layers]
        after = found["error"](changed=changed) if chosen else found["base"]
        head = _head_width(s, found, model, after, tensors, head_alt, weight, group_sizes, tied) if head_alt else None
        rows = None
        if head_alt is not None and s["head_rows_ok"] and s["head_rows8"] != 0 and (head is None or head["chosen"] == 8):
            rows = _head_rows(ctx, s, found, model, tensors, head_alt, weight, group_sizes, tied)

        def head_codes():  # the head as it ships (read only where an untied table is measured)
            final = head_alt if head is not None and head["chosen"] == 4 else \
                rows["codes"] if rows is not None and rows["chosen"] else \
                {k: tensors[f"{HEAD}.{k}"] for k in ("qweight", "scales", "zeros")}
            return gptq.dequantize(final["qweight"], final["scales"], final["zeros"], group_sizes[HEAD])

        embedding = _embedding_width(s, found, model, weight, tied, head_codes) if s["embedding_measured"] else None
    del model
    record = {
        "budget": s["eight_bit_budget"],
        "budget_bytes": int(budget_bytes),
        "extra_bytes": sum(by_key[k].extra_bytes for k in chosen),
        "windows": int(len(windows)),
        "tokens": int(windows.size),
        "measured_by": found["method"],
        # what measuring every unit exactly would have cost, in runs of the model (sensitivity: auto's test)
        "exact_runs": found.get("exact_runs"),
        "snr_db_all_4bit": _snr_db(found["base"]),
        "snr_db": _snr_db(after),
        "chosen": chosen,
        "units": {u.key: {"layers": u.layers, "extra_bytes": u.extra_bytes, "gain": found["gains"][u.key],
                          "snr_db_at_full_precision": _snr_db(found["base"] - found["gains"][u.key])}
                  for u in units},
    }
    ctx.log(f"8-bit units by measured sensitivity (budget {s['eight_bit_budget']:.0%} = "
            f"{budget_bytes / 1e6:.2f} MB): {', '.join(chosen) or 'none'}; calibration logits "
            f"{record['snr_db_all_4bit']} dB with every decoder linear at 4 bits, {record['snr_db']} dB now")
    if head is not None:
        ctx.log(f"head {head['chosen']}-bit (measured: calibration logits {head['options']['4']['snr_db']} dB with "
                f"a 4-bit head, {head['options']['8']['snr_db']} dB at 8 bits for "
                f"{head['options']['8']['extra_bytes'] / 1e6:.1f} MB more; 8 bits kept from "
                f"{head['min_gain_db']} dB; the embedding {head['embedding']})")
    if embedding is not None and embedding["measured"]:
        opts = embedding["options"]
        ctx.log(f"embedding {embedding['chosen']} (measured: calibration logits " + ", ".join(
            f"{k} {o['snr_db']} dB / {o['bytes'] / 1e6:.1f} MB" for k, o in opts.items())
            + f"; the narrowest within {embedding['max_loss_db']} dB of the table kept)")
    elif embedding is not None:
        ctx.log(f"embedding {embedding['chosen']}: {embedding['reason']}")
    return record, head, embedding, rows


def _head_rows(ctx, s, found, model, tensors: dict, head_alt: dict, weight, group_sizes, tied: bool) -> dict:
    """The 8-bit head's rows by measurement (pipeline/quant/head_rows.py): the full-precision model's
    probability mass on the calibration windows ranks the rows; with the decoder at its final codes (a tied
    table taking each option's codes too: a run of the decoder each) the all-8-bit head's KL divergence
    from the full-precision model, then each of head_rows.LADDER's shares of rows at 8 bits and the rest at
    4, narrowest first; the first within head_rows.tolerance ships (s["head_rows8"] = N: those N rows,
    measured for the record). Returns the record, with "codes" (the mixed head's tensors) where it ships.
    The rows are ranked and measured on the same windows; verify_parity measures the artifact on held-out
    text."""
    from pipeline.quant import bit_alloc, gptq

    err = found["error"]
    n, k = (int(d) for d in tensors[f"{HEAD}.qweight"].shape)
    g = group_sizes[HEAD]
    record = {"max_kld_share": head_rows.MAX_KLD_SHARE, "min_kld": head_rows.MIN_KLD,
              "bytes_8bit": head_rows.head_bytes(n, k, n, g), "ranked_and_measured_on": "the calibration windows"}
    if not isinstance(err, bit_alloc.HeadError):
        if s["head_rows8"]:
            raise StageError(f"quantize.head_rows8={s['head_rows8']}: the rows are ranked by the model's "
                             f"probability through its head, and this model's logits are not its head's linear "
                             f"map ({found['method']}); use 0")
        return {**record, "measured": False, "chosen": 0,
                "reason": f"the logits are not the head's linear map ({found['method']}): one width"}
    eight = {key: tensors[f"{HEAD}.{key}"] for key in ("qweight", "scales", "zeros")}
    emb = model.get_input_embeddings() if tied else None
    full = weight(HEAD).float()
    mass = head_rows.probability_mass(err.ref, full)
    hidden = None if tied else err.final_hidden()  # an untied decoder does not see the head's codes

    def kld(codes: dict) -> float:
        deq = gptq.dequantize(codes["qweight"], codes["scales"], codes["zeros"], g)
        if emb is not None:
            emb.weight.data.copy_(deq)
        return head_rows.kld(hidden if emb is None else err.final_hidden(), err.ref, deq, full)

    forced = s["head_rows8"] or 0
    counts = [forced] if forced else [n // d for d in head_rows.LADDER if n // d > 0]
    options, chosen, codes = {}, 0, None
    with ctx.progress(len(counts) + 1, "the head's 8-bit rows by the calibration text's probability") as bar:
        k8 = kld(eight)
        bar.advance()
        tol = head_rows.tolerance(k8)
        for n8 in counts:
            rows8 = head_rows.top_rows(mass, min(n8, n))
            mix = head_rows.mixed(eight, head_alt, rows8)
            k_mix = kld(mix)
            bar.advance()
            options[str(n8)] = {"kld": round(k_mix, 6), "added_kld": round(k_mix - k8, 6),
                                "mass": round(float(mass[rows8].sum()), 6),
                                "bytes": head_rows.head_bytes(n, k, min(n8, n), g)}
            if forced or k_mix - k8 <= tol:
                chosen, codes = min(n8, n), mix
                break
    record.update({"measured": not forced, "tokens": int(sum(m.shape[0] for m in err.ref)),
                   "kld_8bit": round(k8, 6), "tolerance": round(tol, 6), "options": options, "chosen": chosen})
    if chosen:
        o = options[str(n8)]
        ctx.log(f"head 8-bit on its {chosen} most probable rows ({o['mass']:.4f} of the calibration text's "
                f"probability), 4-bit on the other {n - chosen}: {o['bytes'] / 1e6:.1f} MB against "
                f"{record['bytes_8bit'] / 1e6:.1f}, KL divergence {o['kld']:.5f} against {k8:.5f} all at 8 bits")
        record["codes"] = codes
    else:
        ctx.log(f"head 8-bit on every row: no share of rows at 8 bits came within {tol:.5f} nats of the all-8-bit "
                f"head's {k8:.5f} (" + ", ".join(f"{c}: {o['kld']:.5f}" for c, o in options.items()) + ")")
    return record


def _head_width(s, found, model, error_8bit_head: float, tensors: dict, head_alt: dict, weight,
                group_sizes, tied: bool) -> dict:
    """The head's width by measurement: the calibration logits' error with the decoder at its final codes
    and the head at 4 and at 8 bits; 8 bits kept where they gain at least HEAD_MIN_GAIN_DB. Where the
    checkpoint is tied, the pack ships one table for the embedding and the head (pipeline/graphs/gqa_graph.py),
    so the embedding takes each width's codes too and each is a full run. Where the error is not
    HeadError's (a softcapped or biased head: no per-head shortcut), the kernel's default, 8, stays and
    the record says so."""
    import math

    from pipeline.quant import bit_alloc, gptq

    err = found["error"]
    n, k = tensors[f"{HEAD}.qweight"].shape
    extra = n * k // 2
    emb = model.get_input_embeddings()
    record = {"min_gain_db": HEAD_MIN_GAIN_DB,
              "embedding": "the head's own tensor (a tied checkpoint): measured with it" if tied else "its own"}
    if not isinstance(err, bit_alloc.HeadError):
        return {**record, "chosen": 8, "measured": False,
                "reason": f"the error is measured by {found['method']}, not through the head's Grams: the "
                          "kernel's default width kept",
                "options": {"4": {"snr_db": None, "extra_bytes": 0}, "8": {"snr_db": None, "extra_bytes": extra}}}

    def codes(t):
        return lambda: gptq.dequantize(t["qweight"], t["scales"], t["zeros"], group_sizes[HEAD])

    eight = {key: tensors[f"{HEAD}.{key}"] for key in ("qweight", "scales", "zeros")}
    if tied:
        errs = err.head_errors({"8": codes(eight), "4": codes(head_alt)}, lambda: weight(HEAD).float(), emb)
    else:
        errs = {"8": error_8bit_head, **err.head_errors({"4": codes(head_alt)}, lambda: weight(HEAD).float())}
    e4, e8 = errs["4"], errs["8"]
    gain_db = 10 * math.log10(e4 / e8) if e4 > 0 and e8 > 0 else float("inf")
    chosen = 8 if gain_db >= HEAD_MIN_GAIN_DB else 4
    return {**record, "chosen": chosen, "measured": True,
            "gain_db": round(gain_db, 3) if math.isfinite(gain_db) else None,
            "options": {"4": {"snr_db": _snr_db(e4), "extra_bytes": 0},
                        "8": {"snr_db": _snr_db(e8), "extra_bytes": extra}}}


def _shares_head(s, emb, weight) -> bool:
    """Whether the pack ships one table for the embedding and the head: the checkpoint is tied and the
    codes symmetric (gqa_graph._can_share, gguf_q4's shared token_embd)."""
    import torch

    head = weight(HEAD)
    return (s["sym"] and emb is not None and tuple(emb.weight.shape) == tuple(head.shape)
            and torch.equal(emb.weight, head.float()))


def _embedding_width(s, found, model, weight, tied: bool, head_codes) -> dict:
    """An untied table's form by measurement (EMBED_MAX_LOSS_DB): the calibration logits' error with the
    decoder and the head at their final codes (`head_codes()`) and the table kept, then at each of
    gptq.EMBED_BITS (gptq.embedding_codes, the rounding the pack ships), a run of the windows each. A tied
    table is the head's own tensor (nothing to choose); where the error is not HeadError's, or the width
    is not a multiple of the block, the table is kept and the record says why."""
    import math

    from pipeline.quant import bit_alloc, gptq

    emb = model.get_input_embeddings()
    record = {"block_size": gptq.EMBED_BLOCK, "scale_dtype": "fp16", "max_loss_db": EMBED_MAX_LOSS_DB}
    if tied:
        return {**record, "chosen": "head", "measured": False,
                "reason": "the head's own tensor (a tied checkpoint): its width is the head's"}
    err = found["error"]
    v, k = emb.weight.shape if emb is not None else (0, 0)
    why = ("no input embedding module" if emb is None else
           f"its width {k} is not a multiple of the block {gptq.EMBED_BLOCK}" if k % gptq.EMBED_BLOCK else
           None if isinstance(err, bit_alloc.HeadError) else
           f"the error is measured by {found['method']}, not through the head's Grams")
    if why:
        return {**record, "chosen": "keep", "measured": False, "reason": f"the table kept: {why}"}
    err.head.weight.data.copy_(weight(HEAD).float())
    err.set_head(head_codes())  # the head as it ships (HeadError takes B from the module, then A)
    table = emb.weight.data
    full = table.clone()
    errs = {"keep": err._error(err._hidden())}
    for bits in gptq.EMBED_BITS:
        q = gptq.embedding_codes(full, bits)
        table.copy_(q.dequantize())
        del q
        errs[f"int{bits}"] = err._error(err._hidden())
    table.copy_(full)
    del full
    scale_bytes = v * (k // gptq.EMBED_BLOCK) * s["embedding_scale_bytes"]
    size = {"keep": v * k * s["embedding_keep_bytes"], **{f"int{b}": v * k * b // 8 + scale_bytes
                                                          for b in gptq.EMBED_BITS}}

    def loss_db(key):
        e, e0 = errs[key], errs["keep"]
        return 0.0 if e <= e0 else math.inf if e0 <= 0 else 10 * math.log10(e / e0)

    order = sorted(errs, key=lambda key: size[key])  # narrowest first
    chosen = next(key for key in order if key == "keep" or loss_db(key) <= EMBED_MAX_LOSS_DB)
    return {**record, "chosen": chosen, "measured": True,
            "options": {key: {"snr_db": _snr_db(errs[key]), "loss_db": round(loss_db(key), 3),
                              "bytes": int(size[key])} for key in order}}


def run(ctx) -> dict:
    import torch
    from safetensors import safe_open

    from pipeline.quant import gptq
    from pipeline.sources.tensorfile import SpilledTensors

    from pipeline.quant import weight_path

    s = _settings(ctx.cfg, weight_path.model_config(ctx.inputs["untie_head"]))
    src = Path(ctx.inputs["untie_head"])
    cal_dir = Path(ctx.inputs["calibrate"])
    t_start = time.perf_counter()

    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "unknown method")
        raise StageError(f"{src} is already quantized ({method}); quantize needs the full-precision checkpoint")
    weight_map = _weight_map(src)
    already = [n for n in weight_map if n.rsplit(".", 1)[-1] in _QUANTIZED_SUFFIXES]
    if already:
        raise StageError(f"{src} is already quantized (tensor {already[0]})")

    calibration = json.loads((cal_dir / "calibration.json").read_text())
    layers = calibration["layers"]
    if "lm_head" not in layers or "lm_head.weight" not in weight_map:
        raise StageError("no separate lm_head.weight to quantize: the head must be untied (untie_head) and calibrated")
    missing = [n for n in layers if f"{n}.weight" not in weight_map]
    if missing:
        raise StageError(f"{len(missing)} calibrated linear(s) have no weight in the checkpoint, e.g. {missing[0]}.weight")

    group_size_default = s["group_size"]
    if s["group_size_model_wide"]:
        s["group_size"] = _model_group_size(layers, s)
        if s["head_follows_body"]:
            s["head_group_size"] = s["group_size"]
        if s["group_size"] != group_size_default:
            ctx.log(f"group size {s['group_size']} for every layer: the kernel's {group_size_default} does not "
                    f"divide every in_features K, and it takes one group size for the whole model")
    group_sizes = {name: _layer_group_size(name, int(info["in_features"]), s) for name, info in layers.items()}

    # The codes go to a spill file as they are made and are read back when needed (pipeline/sources/tensorfile.py):
    # held, they were 1.75 GB of the 1.75B geometry's 15.9 GB peak, with the fp32 model loaded beside them.
    tensors = SpilledTensors(ctx.out / SPILL, [f"{n}.{k}" for n in layers for k in ("qweight", "scales", "zeros")]
                             + [f"{HEAD}.{head_rows.ROWS_TENSOR}"])
    try:
        report: dict[str, dict] = {}
        # Each read opens its file and closes it: a handle held open keeps every page it has read mapped,
        # and counted resident (on the 1.75B geometry the Hessians' 6.4 GB and the shards' 3.5 GB).
        def weight(name: str) -> torch.Tensor:
            with safe_open(str(src / weight_map[f"{name}.weight"]), framework="pt") as f:
                return f.get_tensor(f"{name}.weight")

        def hessian(key: str) -> torch.Tensor:
            with safe_open(str(cal_dir / "hessians.safetensors"), framework="pt") as f:
                return f.get_tensor(key)

        h_cache: dict[str, list] = {}  # key -> [H float64, its factor or None until GPTQ needs it]

        def quantize_layer(name: str, bits: int) -> None:
            info = layers[name]
            w = weight(name).float()
            n_out, k_in = int(info["out_features"]), int(info["in_features"])
            if tuple(w.shape) != (n_out, k_in):
                raise StageError(
                    f"{name}.weight is {list(w.shape)} but calibration saw a [{n_out}, {k_in}] linear: "
                    f"calibrate and untie_head outputs do not belong together"
                )
            key = info["hessian"]
            if key not in h_cache:
                h_cache.clear()  # shared H are used by neighbouring layers: keep one, and its factor
                h_cache[key] = [hessian(key).double(), None]
            h = h_cache[key][0]

            def factor():
                if h_cache[key][1] is None:
                    h_cache[key][1] = gptq.hessian_factor(h, s["damp"], name)
                return h_cache[key][1]

            g = group_sizes[name]
            try:
                q = gptq.quantize_weight(
                    w, h, method=s["method"], group_size=g, sym=s["sym"], scale_search=s["scale_search"],
                    damp=s["damp"], block_size=s["block_size"], scale_dtype=s["scale_dtype"], bits=bits,
                    name=name, factor=factor,
                )
            except gptq.QuantError as e:
                raise StageError(str(e)) from None
            err = gptq.errors(w, q, h)  # by row slabs: no whole float64 copies of a tall head
            entry = {
                "in_features": k_in,
                "out_features": n_out,
                "weight_rel_mse": err["weight_rel_mse"],
                "out_rel_err_h": err["out_rel_err_h"],
            }
            if g != s["group_size"]:
                entry["group_size"] = g
            if bits != s["bits"]:
                entry["bits"] = bits
            report[name] = entry
            tensors[f"{name}.qweight"] = q.qweight.contiguous()
            tensors[f"{name}.scales"] = q.scales.contiguous()
            tensors[f"{name}.zeros"] = q.zeros.contiguous()

        with ctx.progress(len(layers), f"{s['method']} int4 g{s['group_size']}") as bar:
            for name in layers:
                quantize_layer(name, s["head_bits"] if name == HEAD else s["bits"])
                bar.advance()
        head_alt = None
        # the 4-bit head beside the 8-bit one, for _head_width to weigh and _head_rows to take rows from
        if s["head_bits_measured"] or (s["head_rows8"] or 0) > 0:
            kept = ({k: tensors[f"{HEAD}.{k}"] for k in ("qweight", "scales", "zeros")}, report[HEAD])
            with ctx.progress(None, "the head at 4 bits too, to weigh its width"):
                quantize_layer(HEAD, 4)
            head_alt = {**{k: tensors[f"{HEAD}.{k}"] for k in ("qweight", "scales", "zeros")}, "report": report[HEAD]}
            for k, t in kept[0].items():
                tensors[f"{HEAD}.{k}"] = t
            report[HEAD] = kept[1]
        eight_bit = head = embedding = rows = None
        if s["eight_bit_budget"] > 0 or head_alt is not None or s["embedding_measured"]:
            eight_bit, head, embedding, rows = _promote(ctx, s, src, cal_dir, layers, tensors, group_sizes,
                                                        weight, quantize_layer, head_alt)
            if s["eight_bit_budget"] == 0:
                eight_bit = None  # measured for the head only
        mixed = rows.pop("codes", None) if rows is not None else None  # the record keeps no tensors
        if head is not None and head["chosen"] == 4:
            for k in ("qweight", "scales", "zeros"):
                tensors[f"{HEAD}.{k}"] = head_alt[k]
            report[HEAD] = head_alt["report"]
            s["head_bits"] = 4
        elif mixed is not None:
            for k, t in mixed.items():
                tensors[f"{HEAD}.{k}"] = t
            report[HEAD]["row_bits"] = {"8": rows["chosen"], "4": int(layers[HEAD]["out_features"]) - rows["chosen"]}
        head_alt = mixed = None

        tensors.write(ctx.out / gptq.QUANT_TENSORS, {"format": gptq.FORMAT})
    finally:
        tensors.close()
    meta = {
        "format": gptq.FORMAT,
        "bits": s["bits"],
        "group_size": s["group_size"],
        # the kernel's default size, recorded where the whole model had to take a smaller one
        **({"group_size_default": group_size_default} if s["group_size"] != group_size_default else {}),
        **({"head_group_size": s["head_group_size"]} if s["head_group_size"] != s["group_size"] else {}),
        **({"head_bits": s["head_bits"]} if s["head_bits"] != s["bits"] else {}),
        "sym": s["sym"],
        "method": s["method"],
        "scale_search": s["scale_search"],
        "damp": s["damp"],
        "block_size": s["block_size"],
        **({"scale_dtype": s["scale_dtype"]} if s["scale_dtype"] != "fp32" else {}),
        **({"eight_bit": eight_bit} if eight_bit is not None else {}),
        **({"head": head} if head is not None else {}),
        **({"head_rows": rows} if rows is not None else {}),
        **({"embedding": embedding} if embedding is not None else {}),
        "layers": report,
        "calibration": {
            "data_sha256": calibration["data_sha256"],
            "dataset": calibration.get("dataset"),
            "samples": calibration.get("samples"),
            "tokens": calibration.get("tokens"),
        },
    }
    (ctx.out / gptq.QUANT_JSON).write_text(json.dumps(meta, indent=2) + "\n")
    out_errs = [e["out_rel_err_h"] for e in report.values()]
    worst = max(report, key=lambda n: report[n]["out_rel_err_h"])
    wall = time.perf_counter() - t_start
    scale_note = f", {s['scale_dtype']} scales" if s["scale_dtype"] != "fp32" else ""
    head_note = f", head g{s['head_group_size']}" if s["head_group_size"] != s["group_size"] else ""
    head_note += f", head {s['head_bits']}-bit" if s["head_bits"] != s["bits"] else ""
    if rows is not None and rows["chosen"]:
        head_note += f" on {rows['chosen']} rows, 4-bit on the rest"
    if eight_bit is not None:
        head_note += f", {sum(len(eight_bit['units'][k]['layers']) for k in eight_bit['chosen'])} linear(s) 8-bit"
    ctx.log(f"{len(report)} linears ({s['method']}, g{s['group_size']}{head_note}, {'sym' if s['sym'] else 'asym'}{scale_note}): "
            f"mean out_rel_err_h {sum(out_errs) / len(out_errs):.4g}, worst {worst} "
            f"{report[worst]['out_rel_err_h']:.4g}, {wall:.1f} s")
    return {
        "metrics": {
            "layers": len(report),
            **({"eight_bit_units": len(eight_bit["chosen"]), "calibration_snr_db": eight_bit["snr_db"]}
               if eight_bit is not None else {}),
            "mean_out_rel_err": sum(out_errs) / len(out_errs),
            "max_out_rel_err": max(out_errs),
            "seconds": round(wall, 2),
        }
    }
