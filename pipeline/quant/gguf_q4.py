"""Our GPTQ weights as a GGUF Q4_0 file that llama.cpp loads as it is.

GGUF Q4_0 is a symmetric 4-bit format: blocks of 32 consecutive weights along
a row (the input dimension K), each with one fp16 scale d and 32 unsigned
nibbles q, value = d * (q - 8). A GPTQ result with group_size 32, sym (zero
point 8) and fp16-exact scales (`quantize.scale_dtype: fp16`) is therefore that
format exactly: each group becomes one block, its scale d, its codes the
nibbles. Nothing is rounded a second time, and the file dequantizes (with
gguf's own `gguf.quants.dequantize`) to bit-for-bit the weights GPTQ chose.

How the file is made (`build_q4_0`, or `write_q4_0` on a GGUF already converted):

1. llama.cpp's own converter (pipeline/llamacpp.convert) turns the untied HF
   checkpoint into an f16 (or f32) GGUF: architecture metadata, tokenizer,
   tensor names, and whatever the converter does to non-linear tensors (e.g.
   Gemma's norm + 1) stay llama.cpp's. f16 by default: the non-quantized
   2-D tensors (token embedding) are then what llama.cpp's own f16 conversion
   holds (or, with others="q4_0"/"q8_0", rounded by gguf's quantizer as
   llama.cpp's own Q4_0 file rounds them); norms stay f32 either way.
2. `gguf.GGUFReader` reads it; `gguf.GGUFWriter` writes a new file with every
   KV field copied (general.file_type set to MOSTLY_Q4_0) and every tensor
   copied, except the 2-D weights of our quantized linears, which are written
   as Q4_0 blocks built from our codes and scales.

Which GGUF tensor holds which HF linear: gguf's own TensorNameMap (the table
the converter uses) gives the expected name, e.g. model.layers.0.self_attn.q_proj
-> blk.0.attn_q.weight, lm_head -> output.weight. The name is not trusted
alone: the converted tensor's rows are matched, exactly, against the HF
checkpoint's rows of that linear (cast to the GGUF tensor's float type). A
converter that reorders rows (llama.cpp permutes Q/K rows for the Llama
family's rotary layout) is detected that way and the same permutation is
applied to the codes and scales; rows are whole Q4_0 rows, so the result stays
exact. A linear the name table does not place is looked for, by the same row
match, among the converted 2-D tensors no HF tensor name claims. No exact row
mapping, a tensor whose values the converter changed, or a linear missing from
the converted file: refused, naming it (GgufQ4Error, one line).

Refused before anything is written (one line, naming what to set): a quant
result that is not group-32 symmetric, or whose scales are not fp16 values.
Not handled (refused by the row match, not worked around): converters that
drop or pad rows of a quantized linear, or fuse several linears into one tensor.

`dequantized_model` is the fp32 PyTorch reference of the same weights.

Written by hand, and why:
- The Q4_0 block packing (`pack_q4_0`): gguf's `quants.quantize(..., Q4_0)`
  takes float weights and picks its own scale (d = the block's signed
  absolute-max / -8) and rounds again; here codes and scales are already
  chosen, only their bytes are laid out. The layout (fp16 d, then byte j =
  q[j] | q[j + 16] << 4) was learned from gguf's `Q4_0.dequantize_blocks` and
  is checked against it in tests/test_gguf_q4.py.
- Copying the KV fields: gguf-py has no "copy this reader field" call; its
  writer's typed `add_*` helpers drop empty strings, so fields are written
  with `add_key_value` and the type the reader reports.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


GGUF_FILE = "model.gguf"  # the artifact's file in the pack folder of a llama.cpp device
BLOCK = 32  # GGUF Q4_0 / Q8_0 block: QK4_0 = QK8_0 weights per fp16 scale
SYM_ZERO = 8
SYM_ZERO_8 = 128  # an 8-bit symmetric code's zero: Q8_0's int8 value is code - 128
BLOCK_BYTES = 2 + BLOCK // 2  # fp16 d + 16 bytes of nibbles
BLOCK_BYTES_8 = 2 + BLOCK  # fp16 d + 32 int8
# The GGUF type of a linear of each width: an 8-bit group-32 symmetric result with fp16 scales (the head
# at quantize.head_bits=8) is Q8_0 exactly, as the 4-bit one is Q4_0.
GGUF_TYPE = {4: "Q4_0", 8: "Q8_0"}


class GgufQ4Error(ValueError):
    """Our weights cannot be written as GGUF Q4_0 as asked (one line, naming what to change)."""


# --------------------------------------------------------------------------
# The weights: checks and the block layout
# --------------------------------------------------------------------------

REQUANT_HINT = "quantize.group_size=32 quantize.sym=true quantize.scale_dtype=fp16"


def widths(meta: dict | None, layers) -> dict[str, int]:
    """{layer: its code width} (quant.json's per-layer `bits`, else 4)."""
    recorded = (meta or {}).get("layers", {})
    return {n: int(recorded.get(n, {}).get("bits", 4)) for n in layers}


def check_q4_0(layers: dict, meta: dict | None = None) -> None:
    """Refuse (GgufQ4Error) unless every layer is group-32 symmetric with fp16-exact scales, and 4-bit
    (Q4_0) or 8-bit (Q8_0) as quant.json (`meta`) records its width.

    `layers` as pipeline.quant.codes.read_quant returns them:
    {name: (qweight uint8 [N, K], scales f32 [N, K/g], zeros uint8 [N, K/g], g)}.
    """
    if not layers:
        raise GgufQ4Error("the quant result has no quantized layers: nothing to write as Q4_0")
    if meta is not None and meta.get("sym") is False:
        raise GgufQ4Error(f"the quant result is asymmetric (sym: false): GGUF Q4_0 has no zero point; "
                          f"requantize with {REQUANT_HINT}")
    width = widths(meta, layers)
    for name, (q, s, z, g) in layers.items():
        zero, top = (SYM_ZERO_8, 255) if width[name] == 8 else (SYM_ZERO, 15)
        if width[name] not in GGUF_TYPE:
            raise GgufQ4Error(f"layer {name} holds {width[name]}-bit codes: GGUF takes 4 (Q4_0) or 8 (Q8_0)")
        if int(g) != BLOCK:
            raise GgufQ4Error(f"layer {name} has group size {g}: GGUF Q4_0 blocks are {BLOCK} weights with one "
                              f"scale; requantize with {REQUANT_HINT}")
        if not bool((np.asarray(z) == zero).all()):
            raise GgufQ4Error(f"layer {name} has zero points other than {zero} (asymmetric): GGUF "
                              f"{GGUF_TYPE[width[name]]} has no zero point; requantize with {REQUANT_HINT}")
        q = np.asarray(q)
        if q.size and int(q.max()) > top:
            raise GgufQ4Error(f"layer {name} has codes above {top}: not a {width[name]}-bit result")
        s = np.asarray(s, dtype=np.float32)
        with np.errstate(over="ignore"):
            s16 = s.astype(np.float16)
        bad = s16.astype(np.float32) != s
        if bool(bad.any()):
            raise GgufQ4Error(
                f"layer {name}: {int(bad.sum())} of {s.size} scales are not fp16 values (GGUF Q4_0 stores the "
                f"scale as fp16, rounding it would change the weights GPTQ chose); requantize with "
                f"quantize.scale_dtype=fp16 (rounds the scale before the codes are chosen)"
            )


def _with_scales(codes, scales, pack_block, block_bytes: int) -> np.ndarray:
    """uint8 [N, K/32 * block_bytes]: per 32-weight block, its scale as little-endian fp16 followed by
    `pack_block(codes as [N, K/32, 32])`'s bytes (Q4_0's and Q8_0's shared block frame)."""
    codes = np.asarray(codes, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.float32)
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK):
        raise GgufQ4Error(f"codes {codes.shape} and scales {scales.shape} do not form {BLOCK}-weight blocks")
    nb = k // BLOCK
    d = scales.astype("<f2").reshape(n, nb, 1).view(np.uint8)  # [n, nb, 2]
    return np.concatenate([d, pack_block(codes.reshape(n, nb, BLOCK))], axis=-1).reshape(n, nb * block_bytes)


def pack_q4_0(codes, scales) -> np.ndarray:
    """Q4_0 blocks of codes uint8 [N, K] (0..15) and scales [N, K/32] (fp16 values): uint8 [N, K/32 * 18].

    Per block: d as little-endian fp16, then 16 bytes, byte j holding weight j
    in its low nibble and weight j + 16 in its high nibble. Written by hand
    (see the module docstring): the codes are ours, not re-derived from floats.
    """
    def nibbles(blocks):
        lo, hi = blocks[..., :BLOCK // 2], blocks[..., BLOCK // 2:]
        return ((lo & 0x0F) | ((hi & 0x0F) << 4)).astype(np.uint8)

    return _with_scales(codes, scales, nibbles, BLOCK_BYTES)


def pack_q8_0(codes, scales) -> np.ndarray:
    """Q8_0 blocks of 8-bit symmetric codes uint8 [N, K] (0..255, zero 128) and scales [N, K/32] (fp16
    values): uint8 [N, K/32 * 34]. Per block: d as little-endian fp16, then the 32 weights as int8
    (code - 128), as gguf's `Q8_0.dequantize_blocks` reads them (checked in tests/test_gguf_q4.py)."""
    return _with_scales(codes, scales,
                        lambda blocks: (blocks.astype(np.int16) - SYM_ZERO_8).astype(np.int8).view(np.uint8),
                        BLOCK_BYTES_8)


def dequant(codes, scales, bits: int = 4) -> np.ndarray:
    """Our weights as Q4_0 (Q8_0 for `bits`=8) holds them: scales * (codes - zero) per 32-block, fp32 [N, K]."""
    from pipeline.quant import int4_layouts

    codes = np.asarray(codes, dtype=np.uint8)
    scales = np.asarray(scales, dtype=np.float32)
    zero = SYM_ZERO_8 if bits == 8 else SYM_ZERO
    return int4_layouts.dequant(codes, scales, np.full(scales.shape, zero, np.uint8), BLOCK, bits=bits)


# --------------------------------------------------------------------------
# HF checkpoint <-> converted GGUF
# --------------------------------------------------------------------------


def _hf_weight_files(hf_dir: Path) -> dict[str, Path]:
    """{tensor name: safetensors shard} of an HF checkpoint folder."""
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: shard for k in f.keys()})
    if not out:
        raise GgufQ4Error(f"no *.safetensors weights in {hf_dir}")
    return out


def _hf_weight(files: dict[str, Path], name: str) -> np.ndarray:
    """One HF tensor as float32 numpy (bf16/fp16 widened exactly)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name).to(torch.float32).numpy()


_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16}


def _as_stored(w: np.ndarray, tensor) -> np.ndarray | None:
    """`w` cast to the GGUF tensor's float type, as its values would be; None if not F32/F16."""
    dtype = _FLOAT_TYPES.get(tensor.tensor_type.name)
    return None if dtype is None else w.astype(dtype)


def _digests(a: np.ndarray) -> list[bytes]:
    a = np.ascontiguousarray(a)
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in a.reshape(a.shape[0], -1)]


def row_mapping(target: np.ndarray, source: np.ndarray) -> np.ndarray | None:
    """perm with target[i] == source[perm[i]] for every row, bit for bit; None when there is none.

    Equal rows (a duplicated row) are paired in order, so perm is a permutation.
    """
    if target.shape != source.shape or target.dtype != source.dtype or target.ndim != 2:
        return None
    n = target.shape[0]
    if np.array_equal(target.view(np.uint8), source.view(np.uint8)):
        return np.arange(n)
    where: dict[bytes, list[int]] = {}
    for j, d in enumerate(_digests(source)):
        where.setdefault(d, []).append(j)
    perm = np.empty(n, dtype=np.int64)
    for i, d in enumerate(_digests(target)):
        rows = where.get(d)
        if not rows:
            return None
        perm[i] = rows.pop(0)
    # a 128-bit digest collision is not expected; the bytes are compared anyway
    if not np.array_equal(np.ascontiguousarray(target).view(np.uint8), source[perm].view(np.uint8)):
        return None
    return perm


def _arch_name_map(reader):
    import gguf

    arch = _field(reader, "general.architecture")
    if arch is None:
        raise GgufQ4Error("the converted GGUF has no general.architecture")
    enum = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    if enum is None:
        return arch, None
    blocks = _field(reader, f"{arch}.block_count")
    return arch, gguf.get_tensor_name_map(enum, int(blocks or 0))


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None or not f.types else f.contents()


def map_layers(reader, hf_dir: Path, layer_names) -> dict[str, tuple[str, np.ndarray]]:
    """{HF linear name: (GGUF tensor name, row permutation)} for every name in `layer_names`.

    GGUF tensor t holds the linear L when t's rows are, in some order, exactly
    L's rows (cast to t's float type): t[i] == W_L[perm[i]]. Raises GgufQ4Error
    when a linear has no such tensor.
    """
    hf_dir = Path(hf_dir)
    files = _hf_weight_files(hf_dir)
    arch, name_map = _arch_name_map(reader)
    tensors = {t.name: t for t in reader.tensors}

    def expected(hf_name: str) -> str | None:
        if name_map is None:
            return None
        return name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))

    claimed = {g for g in (expected(n) for n in files) if g}  # GGUF names some HF tensor maps to
    out: dict[str, tuple[str, np.ndarray]] = {}
    taken: set[str] = set()
    for layer in layer_names:
        key = f"{layer}.weight"
        if key not in files:
            raise GgufQ4Error(f"{hf_dir} has no {key}: the quant result does not belong to this checkpoint")
        w = _hf_weight(files, key)
        name = expected(key)
        if name is not None and name in tensors:
            t = tensors[name]
            src = _as_stored(w, t)
            if src is None:
                raise GgufQ4Error(f"{name} (for {layer}) is {t.tensor_type.name} in the converted GGUF: convert "
                                  f"with outtype f16 or f32 so its rows can be matched to the checkpoint's")
            perm = row_mapping(np.asarray(t.data), src)
            if perm is None:
                raise GgufQ4Error(
                    f"{name} is not {layer}'s weight row for row (shape {tuple(t.data.shape)} vs {w.shape}): the "
                    f"converter changed its values or layout, so our codes cannot stand in for it"
                )
            out[layer] = (name, perm)
            taken.add(name)
            continue
        # not placed by name: the same row match over the unclaimed 2-D tensors
        found = None
        for t in reader.tensors:
            if t.name in claimed or t.name in taken or len(t.data.shape) != 2:
                continue
            src = _as_stored(w, t)
            if src is None or tuple(t.data.shape) != w.shape:
                continue
            perm = row_mapping(np.asarray(t.data), src)
            if perm is not None:
                found = (t.name, perm)
                break
        if found is None and layer == HEAD and name is None and TOKEN_EMBD in tensors:
            # an architecture whose llama.cpp graph has no output tensor (gemma2: the converter drops
            # lm_head, llama.cpp reads the head from token_embd): a tied checkpoint's head is that tensor
            emb = tensors[TOKEN_EMBD]
            src = _as_stored(w, emb)
            if src is None or src.shape != tuple(emb.data.shape) or not np.array_equal(np.asarray(emb.data), src):
                raise GgufQ4Error(f"{layer}: llama.cpp's {arch} has no output tensor (it reads the head from "
                                  f"{TOKEN_EMBD}) and this checkpoint's head is not its token embedding, so an "
                                  f"untied {arch} checkpoint cannot ship as GGUF (its releases are tied); build it "
                                  f"for a device that is not a llama.cpp one")
            found = (TOKEN_EMBD, np.arange(w.shape[0]))
        if found is None:
            where = f"expected {name}" if name else f"gguf has no tensor-name table entry for it under {arch!r}"
            raise GgufQ4Error(f"{layer}: no tensor of the converted GGUF holds its rows ({where}); "
                              f"cannot place its Q4_0 weights")
        out[layer] = found
        taken.add(found[0])
    return out


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def _copy_field(writer, field) -> None:
    import gguf

    vtype = field.types[0]
    value = field.contents()
    if vtype == gguf.GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise GgufQ4Error(f"KV field {field.name}: nested arrays are not copied by this writer")
        if not len(value):
            raise GgufQ4Error(f"KV field {field.name} is an empty array, which gguf's writer cannot write")
        writer.add_key_value(field.name, value, vtype, sub_type=field.types[1])
    else:
        writer.add_key_value(field.name, value, vtype)


# The token embedding: "shared" = the head's own Q4_0/Q8_0 tensor (a tied checkpoint: token_embd holds
# it and output.weight is left out, as llama.cpp's converter does for a tied model; llama.cpp then reads
# the head from token_embd); "auto" = shared where the checkpoint is tied, else the quantize stage's
# measured choice for the table (quant.json "embedding": its int8 / int4 codes, gptq.embedding_codes, as
# Q8_0 / Q4_0, or kept), else "keep"; the others below.
OTHERS = ("auto", "shared", "keep", "q8_0", "q4_0")
TOKEN_EMBD = "token_embd.weight"
HEAD = "lm_head"


def _tied_head(reader, hf_dir: Path, placed: dict) -> bool:
    """Whether the converted token embedding is, as stored, exactly the head's weight (row for row, the
    head not permuted): then one tensor can serve both."""
    tensors = {t.name: t for t in reader.tensors}
    emb = tensors.get(TOKEN_EMBD)
    if HEAD not in placed or emb is None or not np.array_equal(placed[HEAD][1], np.arange(len(placed[HEAD][1]))):
        return False
    head = _as_stored(_hf_weight(_hf_weight_files(Path(hf_dir)), f"{HEAD}.weight"), emb)
    return head is not None and head.shape == tuple(emb.data.shape) and np.array_equal(np.asarray(emb.data), head)



def _embedding_name(files: dict[str, Path]) -> str:
    """The HF checkpoint's token embedding tensor (the one name ending in embed_tokens.weight)."""
    names = [n for n in files if n.endswith("embed_tokens.weight")]
    if len(names) != 1:
        raise GgufQ4Error(f"the checkpoint's token embedding: {len(names)} tensors named *embed_tokens.weight")
    return names[0]


def hf_table(hf_dir) -> np.ndarray:
    """The checkpoint's token embedding, float32 [V, H]."""
    files = _hf_weight_files(Path(hf_dir))
    return _hf_weight(files, _embedding_name(files))


def embedding_blocks(table: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The table as the quantize stage measured it at `bits` (gptq.embedding_codes): its Q8_0 / Q4_0
    blocks and the weights they dequantize to."""
    from pipeline.quant import gptq

    q = gptq.embedding_codes(table, bits)
    codes, scales = q.qweight.numpy(), q.scales.numpy()
    del q
    return (pack_q8_0 if bits == 8 else pack_q4_0)(codes, scales), dequant(codes, scales, bits)


def _window_pattern(reader, hf_dir: Path, arch: str) -> list[bool] | None:
    """Per layer, does it slide: for a family whose pattern llama.cpp reads from the file but whose
    converter does not write it (families.GGUF_WINDOW_PATTERN: Gemma 3, which llama.cpp otherwise takes
    as every 6th layer full; measured on a 1-in-2 checkpoint, 26.1 dB without the key, 32.3 with it,
    llama.cpp against the model of the file's codes). None where the file has it or the family needs none."""
    import gguf

    from pipeline.sources import families

    if _field(reader, gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=arch)) is not None:
        return None
    text = json.loads((hf_dir / "config.json").read_text())
    text = text.get("text_config") or text
    try:
        cfg = families.hf_config(text)
        fam = families.of_config(cfg)
    except (families.FamilyError, KeyError, ValueError):
        return None
    if fam.gguf_window != families.GGUF_WINDOW_PATTERN:
        return None
    slides, _ = families.sliding_layers(cfg)
    return slides


def write_q4_0(converted_gguf, hf_dir, quant_dir, out_file, *, others: str = "auto") -> dict[str, Any]:
    """A new GGUF at `out_file`: `converted_gguf` with our quantized linears as Q4_0.

    `converted_gguf` is llama.cpp's conversion (f16 or f32) of the HF checkpoint
    `hf_dir` that `quant_dir` (the quantize stage's output) quantized.
    `others`: the converted file's other 2-D float tensors (the token
    embedding; our quantizer does not touch it): "shared" (a tied checkpoint:
    the head's own quantized tensor is the token embedding, one copy; refused
    where the converted embedding is not the head's weight), "auto" (shared
    where it can be, else keep), "keep" them as converted, or round them to
    Q8_0 / Q4_0 with gguf's own quantizer (round to nearest, no calibration:
    llama.cpp's Q4_0 file holds a Q4_0 token embedding; on the embedded model
    "q4_0" gave it byte for byte). Our linears are Q4_0, or Q8_0 where
    quant.json records 8 bits (the head at quantize.head_bits=8).
    Returns what was done: {gguf name: HF linear}, the permuted ones, the tensor types written.
    """
    import gguf

    if others not in OTHERS:
        raise GgufQ4Error(f"others={others!r}: one of {', '.join(OTHERS)}")

    from pipeline.quant.codes import read_quant

    meta, layers = read_quant(quant_dir, bits=tuple(GGUF_TYPE))
    check_q4_0(layers, meta)
    width = widths(meta, layers)
    reader = gguf.GGUFReader(str(converted_gguf))
    placed = map_layers(reader, Path(hf_dir), list(layers))
    shared = others in ("auto", "shared") and _tied_head(reader, Path(hf_dir), placed)
    if others == "shared" and not shared:
        raise GgufQ4Error("pack.gguf_token_embedding=shared needs a tied checkpoint (its token embedding the "
                          "head's weight, as converted); use auto or keep")
    # an untied table under auto: the form the quantize stage measured and chose (its own codes, or kept)
    chosen = (meta.get("embedding") or {}).get("chosen") if others == "auto" and not shared else None
    embed_bits = {"int8": 8, "int4": 4}.get(chosen)
    others = "keep" if others == "auto" else others
    # output.weight: llama.cpp reads the head from token_embd (none to drop where the architecture has no
    # output tensor and map_layers placed the head at token_embd itself)
    dropped = placed[HEAD][0] if shared and placed[HEAD][0] != TOKEN_EMBD else None
    if shared:
        placed[HEAD] = (TOKEN_EMBD, placed[HEAD][1])
    by_tensor = {name: (layer, perm) for layer, (name, perm) in placed.items()}
    rounded = []  # the converted float tensors gguf's quantizer rounded (others="q8_0" / "q4_0")

    arch = _field(reader, "general.architecture")
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    try:
        writer = gguf.GGUFWriter(str(tmp), arch)
        ftype = int(gguf.LlamaFileType.MOSTLY_Q4_0)
        wrote_ftype = False
        for field in reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
                continue  # the header's own counts, and the architecture the writer already holds
            if field.name == gguf.Keys.General.ALIGNMENT:
                writer.add_custom_alignment(int(field.contents()))
            elif field.name == gguf.Keys.General.FILE_TYPE:
                writer.add_file_type(ftype)
                wrote_ftype = True
            else:
                _copy_field(writer, field)
        if _field(reader, gguf.Keys.General.QUANTIZATION_VERSION) is None:
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        pattern = _window_pattern(reader, Path(hf_dir), arch)
        if pattern is not None:
            writer.add_sliding_window_pattern(pattern)

        types: dict[str, int] = {}
        for t in reader.tensors:
            if t.name == dropped:
                continue
            if t.name == TOKEN_EMBD and embed_bits:
                # the codes are of the checkpoint's table: the converter must have written that table
                # (no padded vocabulary, no folded scale), or the file would gather other rows
                table = hf_table(hf_dir)
                stored = _as_stored(table, t)
                if stored is None or stored.shape != tuple(t.data.shape) or not np.array_equal(
                        np.asarray(t.data), stored):
                    raise GgufQ4Error(f"{TOKEN_EMBD} as converted is not the checkpoint's table: its measured "
                                      f"{chosen} codes cannot stand for it (pack.gguf_token_embedding=keep)")
                del stored
                blocks, _ = embedding_blocks(table, embed_bits)
                del table
                kind = GGUF_TYPE[embed_bits]
                writer.add_tensor(t.name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
                del blocks
            elif t.name in by_tensor:
                layer, perm = by_tensor[t.name]
                q, s, _z, _g = layers[layer]
                kind = GGUF_TYPE[width[layer]]
                blocks = (pack_q8_0 if width[layer] == 8 else pack_q4_0)(q[perm], s[perm])
                writer.add_tensor(t.name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            elif (others != "keep" and len(t.data.shape) == 2 and t.tensor_type.name in _FLOAT_TYPES
                  and t.data.shape[-1] % BLOCK == 0):
                qtype = gguf.GGMLQuantizationType[others.upper()]
                writer.add_tensor(t.name, gguf.quants.quantize(np.asarray(t.data, dtype=np.float32), qtype),
                                  raw_dtype=qtype)
                kind = qtype.name
                rounded.append(t.name)
            else:
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
                kind = t.tensor_type.name
            types[kind] = types.get(kind, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        del reader
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(out_file)
    return {
        "file": str(out_file),
        "bytes": out_file.stat().st_size,
        "layers": {name: layer for layer, (name, _) in placed.items()},
        "permuted": sorted(name for layer, (name, perm) in placed.items()
                           if not np.array_equal(perm, np.arange(len(perm)))),
        # file row i holds the linear's row row_order[name][i] (permuted tensors only)
        "row_order": {name: [int(i) for i in perm] for layer, (name, perm) in placed.items()
                      if not np.array_equal(perm, np.arange(len(perm)))},
        "tensor_types": dict(sorted(types.items())),
        "file_type": "MOSTLY_Q4_0" if wrote_ftype else "absent in the conversion (left absent)",
        # the token embedding: the head's own tensor (one copy), or what `others` made of the converted one
        "token_embedding": f"shared: the head's {GGUF_TYPE[width[HEAD]]} tensor "
                           f"({f'{dropped} left out' if dropped else f'{arch} has no output tensor'})" if shared
        else f"{chosen}: the quantize stage's measured choice, its codes as {GGUF_TYPE[embed_bits]}" if embed_bits
        else others,
        "rounded": rounded,
        # the table's own codes (auto on an untied checkpoint): verify_file reads them back
        **({"embedding_codes": {"tensor": TOKEN_EMBD, "bits": embed_bits}} if embed_bits else {}),
    }


def build_q4_0(hf_dir, quant_dir, out_file, *, src: str | None = None, outtype: str = "f16",
               converted: str | Path | None = None, others: str = "auto") -> dict[str, Any]:
    """Convert `hf_dir` with llama.cpp's converter (or reuse `converted`), then `write_q4_0`.

    The quant result is checked before the (slow) conversion runs.
    """
    from pipeline.toolchains import llamacpp
    from pipeline.quant.codes import read_quant

    meta, layers = read_quant(quant_dir, bits=tuple(GGUF_TYPE))
    check_q4_0(layers, meta)
    out_file = Path(out_file)
    if converted is not None:
        return write_q4_0(converted, hf_dir, quant_dir, out_file, others=others)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgekiln-gguf-", dir=out_file.parent) as tmp:
        conv = llamacpp.convert(Path(hf_dir), Path(tmp) / f"model-{outtype}.gguf", outtype=outtype, src=src)
        return write_q4_0(conv, hf_dir, quant_dir, out_file, others=others)


def _ours(reader, report: dict) -> set[str]:
    """The file's Q4_0 / Q8_0 tensors that are not gguf's rounding of a converted one (report["rounded"])."""
    kinds = set(GGUF_TYPE.values())
    table = [report["embedding_codes"]["tensor"]] if "embedding_codes" in report else []
    return {t.name for t in reader.tensors if t.tensor_type.name in kinds} - set(report.get("rounded", ())) - \
        set(table)


def file_weights(gguf_file, report: dict) -> dict[str, np.ndarray]:
    """{HF linear: fp32 weight [N, K]} read back from the file's Q4_0 / Q8_0 tensors by gguf's own
    dequantizer, rows put back in the checkpoint's order (`report` is write_q4_0's)."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_file))
    by_name = {t.name: t for t in reader.tensors}
    out = {}
    for gname, layer in report["layers"].items():
        t = by_name.get(gname)
        if t is None or t.tensor_type.name not in GGUF_TYPE.values():
            raise GgufQ4Error(f"{gguf_file}: tensor {gname} is missing or not Q4_0 / Q8_0")
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        order = report.get("row_order", {}).get(gname)
        if order is not None:
            w = w[np.argsort(np.asarray(order))]
        out[layer] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def verify_file(gguf_file, quant_dir, report: dict, hf_dir=None) -> int:
    """Every Q4_0 / Q8_0 tensor of ours in the file dequantizes bit-for-bit to our weights (GgufQ4Error
    otherwise); returns how many were checked. Those tensors must be exactly the report's. Where the
    table holds its own codes (report["embedding_codes"]), it is read back too, against the codes made
    again from the checkpoint `hf_dir` (then required), and counted."""
    import gguf

    from pipeline.quant.codes import read_quant

    meta, layers = read_quant(quant_dir, bits=tuple(GGUF_TYPE))
    width = widths(meta, layers)
    ours = _ours(gguf.GGUFReader(str(gguf_file)), report)
    if ours != set(report["layers"]):
        raise GgufQ4Error(f"{gguf_file}: quantized tensors {sorted(ours ^ set(report['layers']))} differ from the "
                          f"report's")
    got = file_weights(gguf_file, report)
    if set(got) != set(layers):
        raise GgufQ4Error(f"{gguf_file}: holds {len(got)} of the quant result's {len(layers)} layers")
    for layer, w in got.items():
        q, s, _z, _g = layers[layer]
        if not np.array_equal(w, dequant(q, s, width[layer])):
            raise GgufQ4Error(f"{gguf_file}: {layer} does not dequantize to the quantize stage's weights")
    table = report.get("embedding_codes")
    if table is None:
        return len(got)
    if hf_dir is None:
        raise GgufQ4Error(f"{gguf_file}: its {table['tensor']} holds the table's own codes; verifying it needs "
                          "the checkpoint (hf_dir)")
    t = next((t for t in gguf.GGUFReader(str(gguf_file)).tensors if t.name == table["tensor"]), None)
    if t is None or t.tensor_type.name != GGUF_TYPE[table["bits"]] or not np.array_equal(
            gguf.quants.dequantize(t.data, t.tensor_type), embedding_blocks(hf_table(hf_dir), table["bits"])[1]):
        raise GgufQ4Error(f"{gguf_file}: {table['tensor']} does not dequantize to the table's "
                          f"{table['bits']}-bit codes")
    return len(got) + 1


def _set_linears(model, weights: dict[str, np.ndarray]):
    import torch

    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, w in weights.items():
            lin = modules[name]
            if tuple(lin.weight.shape) != tuple(w.shape):
                raise GgufQ4Error(f"{name}: quantized {tuple(w.shape)} vs model {tuple(lin.weight.shape)}")
            lin.weight = torch.nn.Parameter(torch.from_numpy(w).to(lin.weight.dtype), requires_grad=False)
    return model.eval()


def file_model(hf_dir, gguf_file, report: dict):
    """The HF model (fp32) holding the file's Q4_0 / Q8_0 linears as gguf dequantizes them; the token
    embedding the head's where the file shares it, the file's own where it is Q4_0 / Q8_0 (the table's
    codes, or gguf's rounding); every other tensor (norms) as the checkpoint holds it."""
    import torch

    from pipeline.sources.checkpoint_files import load_hf_model

    import gguf

    weights = file_weights(gguf_file, report)
    model = _set_linears(load_hf_model(hf_dir), weights)
    if TOKEN_EMBD in report["layers"]:  # shared: token_embd is the head's tensor
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(torch.from_numpy(weights[report["layers"][TOKEN_EMBD]]))
        return model
    t = next((t for t in gguf.GGUFReader(str(gguf_file)).tensors if t.name == TOKEN_EMBD), None)
    if t is not None and t.tensor_type.name in GGUF_TYPE.values():  # the table's codes, or gguf's rounding
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(torch.from_numpy(
                np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)))
    return model


def dequantized_model(hf_dir, quant_dir):
    """The HF model (fp32, eager attention) with every quantized linear replaced by our
    dequantized weights, and the token embedding as pack.gguf_token_embedding=auto ships it (the
    head's where quant.json's "embedding" record says the table is the head's, its own codes where it
    chose int8 / int4): the reference a Q4_0 file of these weights should reproduce up to llama.cpp's
    activation rounding."""
    import torch

    from pipeline.quant import int4_layouts
    from pipeline.sources.checkpoint_files import load_hf_model
    from pipeline.quant.codes import read_quant

    meta, layers = read_quant(quant_dir, bits=tuple(GGUF_TYPE))
    width = widths(meta, layers)
    weights = {name: int4_layouts.dequant(q, s, z, g, bits=width[name]) for name, (q, s, z, g) in layers.items()}
    model = _set_linears(load_hf_model(hf_dir), weights)
    chosen = (meta.get("embedding") or {}).get("chosen")
    table = weights.get(HEAD) if chosen == "head" else \
        embedding_blocks(hf_table(hf_dir), {"int8": 8, "int4": 4}[chosen])[1] if chosen in ("int8", "int4") \
        else None
    if table is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(torch.from_numpy(table))
    return model
