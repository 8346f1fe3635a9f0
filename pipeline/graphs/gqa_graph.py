"""A hand-built ONNX decoder for ONNX Runtime's fused CPU ops: GroupQueryAttention + MatMulNBits.

Why by hand (onnx.helper) and not through the torch exporter: what makes ORT's
CPU decode fast here is (1) com.microsoft.GroupQueryAttention doing rotary,
causal / sliding-window masking and the KV append in one kernel, writing into
KV buffers the caller owns and binds as both past and present
(past_present_share_buffer: nothing is copied per token), with window-sized
buffers for sliding layers (`sliding_window_cache`); (2)
com.microsoft.MatMulNBits fed with the quantize stage's own codes, q|k|v and
gate|up concatenated into one weight each; (3)
SkipSimplifiedLayerNormalization folding each residual add into the next
RMSNorm. None of that is reachable from torch.onnx.export: the exporter emits
standard ONNX (MatMul, Softmax, explicit masks, a KV tensor returned rather
than updated in place), ORT's CPU fusions do not rebuild GQA from that
pattern, and a traced program cannot alias a graph output to a graph input.
The graph is small (~15-20 nodes a layer), so writing it directly is also the
readable option.

The graph (`build_gqa_graph`):

- inputs (`io_layout` "genai", the default: what onnxruntime-genai feeds a
  decoder, so the folder loads as an onnxruntime-genai model with the
  genai_config.json `genai_config` writes): `input_ids` int64 [1, S] (S
  dynamic: the same graph serves prefill, S = prompt length, and decode, S =
  1), `attention_mask` int64 [1, T] (ones, T the tokens cached after this
  call), from which the graph computes GQA's `seqlens_k` int32 [1] (T - 1)
  and `total_sequence_length` int32 scalar (T) (`_mask_lengths`), then
  `past_key_values.i.key` / `.value` (kv_dtype) BNSH [1, n_kv, rows, head_dim]:
  rows = max_len, or W + slack for a sliding layer whose window binds
  (`window_cache_slack`), symbolic in the graph (genai sizes them; io.json
  says cache_len). `io_layout` "edgekiln", the layout before: `seqlens_k` and
  `total_sequence_length` fed, `past_key_i` / `past_value_i` of static rows.
- outputs: `logits` float32 [1, 1, vocab] ([1, vocab]: edgekiln) of the LAST
  position only, then `present.i.key` / `.value` (`present_key_i`: edgekiln),
  bound by the runtime to the past buffers. Past the last GroupQueryAttention
  (which needs every row's K/V) the last layer runs on the last row only
  (`last_layer_rows`), so prefill never computes the other rows' o_proj, MLP,
  final norm or vocab projection. A speculative decoder's verify feeds the
  last input, `logits_rows` (int64 scalar, 1 when not fed: `_last_rows`), and
  fetches the last output, `row_logits` [1, logits_rows, vocab]: those last
  rows' logits, from which `logits` is the last.
- per layer (defaults): [Skip]RMSNorm -> MatMulNBits(q|k|v) -> (no q/k norms:
  into GroupQueryAttention packed, no Split; with them:) Split(q|k, v) ->
  Reshape -> one RMSNormalization over [1, S, n_heads + n_kv, head_dim]
  with a stacked per-head gamma (q_norm / k_norm: ORT's CPU GQA refuses its
  own q_norm_weight input) -> Reshape -> Split(q, k) -> GroupQueryAttention
  (do_rotary=1 with the layer type's cos/sin cache, `local_window_size` = W on
  sliding layers, `scale` from the HF module) -> MatMulNBits(o) -> (Gemma3:
  RMSNorm post-attention) -> SkipSimplifiedLayerNormalization (residual add +
  the pre-MLP norm) -> MatMulNBits(gate|up) -> Split -> FastGelu (gelu tanh,
  Gemma3) or QuickGelu(alpha=1) (= SiLU, Qwen3 / Llama) -> Mul ->
  MatMulNBits(down) -> (Gemma3: RMSNorm post-feedforward). The next layer's
  input norm, or the final norm, is a SkipSimplifiedLayerNormalization that
  also adds the residual. RMSNormalization is the standard opset-23 op (ORT
  runs it with its SimplifiedLayerNormalization kernel).
- Gemma3 specifics: the embedding table pre-multiplied by embed_scale in the
  weight dtype (bit-identical to HF's runtime multiply), every RMSNorm gamma
  (1 + w), per-layer-type rope (sliding vs full rope_theta), `scale` =
  query_pre_attn_scalar ** -0.5, final logit softcap as Div/Tanh/Mul when set.
- weights: every quantized linear (lm_head included) is a MatMulNBits built
  from `quant.codes.read_quant` codes via `int4_layouts.to_matmulnbits` (no
  second rounding; bits=8 for a layer the quantize stage wrote at 8 bits, the
  head by default on this path); concatenation along N is exact (codes, scales and zeros
  are per output row); biases, if any, go in as the op's bias input. The
  embedding of a tied checkpoint is a GatherBlockQuantized over the head's
  own MatMulNBits weight, one tensor for both (`_shared_embedding`); an
  untied one's is a GatherBlockQuantized of its table's 8- or 4-bit codes
  (`_block_embedding`) or an fp32 Gather of the table, as the quantize stage
  measured and chose (quant.json "embedding"; the `embedding` option).
- the weights are external data (model.onnx.data), which ONNX Runtime maps
  rather than reads: `GqaDecoder` pages out what the session left mapped but
  does not use after loading (the table's rows are read when gathered).

`DEFAULT_OPTIONS` lists the variants; benchmarks/gqa_speed.py measures them.

`GqaDecoder` is the runtime: reset / step / prefill / generate_greedy /
kv_bytes like `runtimes.onnx.OnnxDecoder`, through IO binding: the KV buffers
are preallocated OrtValues bound as both past_* and present_*, the decode
inputs and the logits output numpy-backed OrtValues bound once, so a step is
three scalar writes and one `run_with_iobinding`.
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.quant import int4_layouts as L
from pipeline.graphs.decode_graph import SLIDING, DecodeGraphError, _applies_attn_softcap, _first_id, _id_list, _rope_tables, _text_config, layer_types, load_hf_model
from pipeline.sources import families
from edgekiln_runtime.io import IO_FORMAT, KV_NAMES, ROW_LOGITS_IO  # the folder's contract, which the device runtime reads

# Initializer bytes past which they go to model.onnx.data: 0, always. ONNX Runtime maps an external data
# file instead of reading the weights into the protobuf it parses, so what the session does not use after
# loading can leave memory (GqaDecoder, pages.page_out_file). Tests raise it to check the inline writer.
_EXTERNAL_DATA_BYTES = 0
FAMILIES = tuple(families.FAMILIES)  # every row of the family table (pipeline/sources/families.py)
MS = "com.microsoft"
OPSET = 23  # RMSNormalization (standard since 23; ORT runs it with its SimplifiedLayerNorm kernel)

# Build options (the defaults are what measured fastest here; see benchmarks/gqa_speed.py).
DEFAULT_OPTIONS = {
    "fuse_qkv": True,          # True: one MatMulNBits for q|k|v; "qk": q|k fused, v on its own; False: three
    "packed_qkv": True,        # a fused q|k|v (no q/k norm) goes into GroupQueryAttention packed, as
                               # onnxruntime-genai's builder feeds it: no Split, the same arithmetic
    "fuse_gate_up": True,      # one MatMulNBits for gate|up
    "qk_norm": "joint",        # "joint": Reshape + one RMSNorm over the q|k heads with a stacked gamma;
                               # "branchwise": com.microsoft.BranchwiseRMSNorm on the flat q|k (no Reshape;
                               # same decode, ~8-14% slower prefill here); "split": one RMSNorm each
    "skip_norm": True,         # SkipSimplifiedLayerNormalization for residual add + norm
    "last_layer_rows": "last",  # "last": the last layer's o_proj/MLP run on the last row only; "all"
    "window_offset": 0,        # local_window_size = sliding_window + window_offset (see _gqa_window)
    "window_cache_slack": 16,  # sliding layers: a window-sized KV buffer of W + slack rows
                               # (GQA sliding_window_cache=1); None: a max_len buffer like full layers
    "norm_op": "RMSNormalization",  # or "SimplifiedLayerNormalization" (ORT's contrib-in-ONNX-domain name)
    "embedding": "auto",       # "shared": GatherBlockQuantized over the head's own MatMulNBits weight (a tied
                               # checkpoint: one copy of the table, see _shared_embedding); "int8" / "int4":
                               # one over the untied table's own codes (_block_embedding); "fp32": a Gather of
                               # the untied table; "auto": shared where it can be, else quant.json's measured
                               # choice (its "embedding" record), else fp32
    "kv_dtype": "float32",     # the KV cache (and the attention's rope caches); "float16" halves the KV bytes
                               # (q/k/v cast in, the attention cast out), but ORT 1.32's CPU attention decodes
                               # slower over it on the AVX-512 builder (SmolLM2 0.85x at a 2048-token prompt:
                               # docs/devices.md); pack.ort_kv_dtype picks, the deploy profile measures both
    "io_layout": "genai",      # the graph's inputs and outputs: "genai", as onnxruntime-genai feeds a decoder
                               # (genai_config.json beside it: `genai_config`), or "edgekiln", the layout
                               # before it (seqlens_k / total_sequence_length fed, past_key_i, [1, V] logits)
}
KV_DTYPES = ("float16", "float32")
IO_LAYOUTS = ("genai", "edgekiln")
LOGITS_ROWS, ROW_LOGITS = ROW_LOGITS_IO["input"], ROW_LOGITS_IO["output"]
class GqaGraphError(DecodeGraphError):
    """A model, checkpoint or request the GQA graph cannot serve (user-facing)."""


# --------------------------------------------------------------------------
# Model facts
# --------------------------------------------------------------------------


def _family(cfg) -> families.Family:
    try:
        return families.of_config(cfg)
    except families.FamilyError as e:
        raise GqaGraphError(f"the GQA graph: {e}") from None


def _gqa_window(sliding_window: int, offset: int = 0) -> int:
    """GQA `local_window_size` for HF's window W.

    HF: a query at p sees keys at positions > p - W (W keys, itself included).
    ORT 1.32's CPU kernel with local_window_size = W gives exactly that
    (measured against the HF model past the window: ~135 dB at W, ~50 dB at
    W - 1; tests/test_gqa_graph.py keeps checking it). `offset` exists only to
    repeat that measurement.
    """
    return int(sliding_window) + int(offset)


def layer_plan(cfg, max_len: int, window_offset: int = 0, window_cache_slack: int | None = 16) -> list[dict[str, Any]]:
    """Per layer: {index, type, window (HF), local_window_size (GQA, -1 = none), cache_len, window_cache}.

    A sliding layer whose window binds inside max_len gets, unless
    `window_cache_slack` is None, a window-sized KV buffer of W + slack rows
    (GQA `sliding_window_cache=1`: the op keeps the most recent rows at the
    front and compacts every slack + 1 steps), so its decode attends over at
    most W + slack keys instead of every position so far.
    """
    types, w = layer_types(cfg, GqaGraphError)
    plan = []
    for i, t in enumerate(types):
        # A window that cannot bind inside max_len is left off (the op then does plain causal attention).
        binds = t == SLIDING and int(w) < max_len
        lws = _gqa_window(w, window_offset) if binds else -1
        windowed = binds and window_cache_slack is not None and lws + int(window_cache_slack) < max_len
        plan.append({"index": i, "type": t, "window": int(w) if binds else 0, "local_window_size": lws,
                     "window_cache": bool(windowed),
                     "cache_len": lws + int(window_cache_slack) if windowed else int(max_len)})
    return plan


def _rope_caches(hf_model, max_len: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{rope key: (cos [max_len, rot/2], sin [max_len, rot/2])} computed as HF does (fp32 torch)."""
    import torch

    out = {}
    pos = torch.arange(max_len, dtype=torch.float32)
    for key, (inv, scale) in _rope_tables(hf_model, max_len).items():
        freqs = pos[:, None] * inv.to(torch.float32)[None, :]  # the same fp32 product HF's matmul makes
        out[key] = ((freqs.cos() * scale).numpy().astype(np.float32),
                    (freqs.sin() * scale).numpy().astype(np.float32))
    return out


# --------------------------------------------------------------------------
# Graph construction helpers
# --------------------------------------------------------------------------


# Initializers are never held as TensorProtos. On Gemma 3 270M (a 920 MB graph, 671 MB of it the fp32
# embedding) the pack stage peaked at 6.46 GiB resident when they were: per tensor a numpy copy and its
# raw bytes, make_graph's and make_model's copies of the list, SerializeToString's buffer, and the
# checker's own serialization and parse of the in-memory model. Now each initializer is encoded once,
# straight from its array (the embedding in row chunks), into a spill file next to the output as it is
# built, and model.onnx is assembled from the node skeleton and that file (`_write_model`): the same
# bytes (sha256), peak 2.12 GiB, of which building takes 1.31 and onnx.checker's read + parse of the
# finished file the rest (measured: see build_gqa_graph).
_SPILL = ".gqa_initializers.tmp"
_SPILL_EXT = ".gqa_initializers_ext.tmp"
_CHUNK_BYTES = 16 << 20
# dtypes numpy_helper.from_array writes as plain little-endian raw_data (tobytes), which `_G.init`
# then encodes itself; any other (strings, 4-bit, ...) goes through from_array.
_RAW_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16,
                                               np.uint16, np.int32, np.uint32, np.int64, np.uint64, np.bool_))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _split_fields(buf: bytes, number: int) -> tuple[bytes, bytes]:
    """(the fields numbered below `number`, those above) of a serialized message, which holds no
    field `number`. Protobuf writes a message's fields in field-number order, so that is a cut."""
    i, cut = 0, None
    while i < len(buf):
        start = i
        tag, i = _read_varint(buf, i)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            _, i = _read_varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            n, i = _read_varint(buf, i)
            i += n
        elif wire == 5:
            i += 4
        else:
            raise GqaGraphError(f"serialized message: wire type {wire} of field {field}")
        if field == number or (field < number and cut is not None):
            raise GqaGraphError(f"serialized message: field {field} where field {number} goes")
        if field > number and cut is None:
            cut = start
    cut = len(buf) if cut is None else cut
    return buf[:cut], buf[cut:]


def _records(path: Path):
    """The serialized TensorProtos of a spill file of GraphProto.initializer (field 5) records."""
    with open(path, "rb") as f:
        while True:
            tag = f.read(1)
            if not tag:
                return
            n = shift = 0
            while True:
                b = f.read(1)[0]
                n |= (b & 0x7F) << shift
                shift += 7
                if not b & 0x80:
                    break
            yield f.read(n)


class _G:
    """Nodes in memory; initializers streamed, each as GraphProto field 5 (`initializer`) bytes, to
    `spill` (removed by `discard`)."""

    def __init__(self, spill):
        self.nodes, self._names = [], set()
        self._consts: dict[tuple, str] = {}
        self.init_bytes = 0  # the initializers' data bytes
        self.spill = Path(spill)
        self._f = open(self.spill, "wb")

    def init(self, name: str, arr: np.ndarray) -> str:
        arr = np.asarray(arr)
        if arr.dtype in _RAW_DTYPES and sys.byteorder == "little":
            return self.init_chunks(name, arr.shape, arr.dtype, [arr])
        from onnx import numpy_helper

        self._claim(name)
        t = numpy_helper.from_array(np.array(arr, order="C"), name)  # keeps 0-d
        self._record(t.SerializeToString())
        self.init_bytes += arr.nbytes
        return name

    def init_chunks(self, name: str, shape, dtype, chunks) -> str:
        """The tensor `shape` / `dtype` whose C-order bytes are those of `chunks` (arrays) one after
        another: the bytes numpy_helper.from_array(full array, name).SerializeToString() gives (dims,
        data_type, name, raw_data: fields 1, 2, 8, 9 in that order), without the full array."""
        from onnx import TensorProto, helper

        dtype = np.dtype(dtype)
        if dtype not in _RAW_DTYPES or sys.byteorder != "little":
            raise GqaGraphError(f"{name}: {dtype} is not written as raw little-endian data")
        self._claim(name)
        head = TensorProto()
        head.dims.extend(int(d) for d in shape)
        if name:
            head.name = name
        head.data_type = helper.np_dtype_to_tensor_dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        prefix = head.SerializeToString() + b"\x4a" + _varint(nbytes)  # field 9 (raw_data), length-delimited
        self._f.write(b"\x2a" + _varint(len(prefix) + nbytes) + prefix)
        written = 0
        for c in chunks:
            c = np.ascontiguousarray(c, dtype=dtype).reshape(-1)
            self._f.write(c.view(np.uint8))
            written += c.nbytes
        if written != nbytes:
            raise GqaGraphError(f"{name}: {written} bytes written for a tensor of {nbytes}")
        self.init_bytes += nbytes
        return name

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise GqaGraphError(f"duplicate initializer {name}")
        self._names.add(name)

    def _record(self, tensor_bytes: bytes) -> None:
        self._f.write(b"\x2a" + _varint(len(tensor_bytes)) + tensor_bytes)

    def finish(self) -> Path:
        self._f.close()
        return self.spill

    def discard(self) -> None:
        self._f.close()
        for p in (self.spill, self.spill.with_name(_SPILL_EXT)):
            p.unlink(missing_ok=True)

    def const_i64(self, values) -> str:
        key = ("i64", tuple(np.atleast_1d(values).tolist()), np.ndim(values))
        if key not in self._consts:
            self._consts[key] = self.init(f"const_i64_{len(self._consts)}", np.asarray(values, dtype=np.int64))
        return self._consts[key]

    def node(self, op, ins, outs, name, domain="", **attrs):
        from onnx import helper

        self.nodes.append(helper.make_node(op, list(ins), list(outs), name=name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs


def _write_model(model, g: _G, path: Path, external: bool, data_name: str, size_threshold: int = 1024) -> None:
    """Write `model` (a ModelProto whose graph has no initializers) with g's initializers to `path`: the
    bytes onnx.save_model(model with them, path, save_as_external_data=external,
    all_tensors_to_one_file=True, location=data_name, size_threshold) writes, one tensor in memory at a
    time. Protobuf writes fields in number order, so the file is the model's fields below 7 (graph),
    the graph's tag and length, its fields below 5 (node, name), the initializers, its fields above 5
    (input, output, ...), then the model's fields above 7 (opset_import, ...)."""
    from onnx import ModelProto, TensorProto
    from onnx import external_data_helper as edh

    inits = g.finish()
    if external:  # what convert_model_to_external_data + write_external_data_tensors do, tensor by tensor
        ext = inits.with_name(_SPILL_EXT)
        with open(ext, "wb") as out:
            for rec in _records(inits):
                t = TensorProto.FromString(rec)
                del rec
                if t.HasField("raw_data") and sys.getsizeof(t.raw_data) >= size_threshold:
                    edh.set_external_data(t, data_name)
                    edh.save_external_data(t, str(path.parent))
                    t.ClearField("raw_data")
                b = t.SerializeToString()
                out.write(b"\x2a" + _varint(len(b)) + b)
        inits.unlink()
        inits = ext
    graph_head, graph_tail = _split_fields(model.graph.SerializeToString(), 5)
    shell = ModelProto()
    shell.CopyFrom(model)
    shell.ClearField("graph")
    model_head, model_tail = _split_fields(shell.SerializeToString(), 7)
    graph_len = len(graph_head) + inits.stat().st_size + len(graph_tail)
    with open(path, "wb") as f:
        f.write(model_head + b"\x3a" + _varint(graph_len) + graph_head)  # field 7, length-delimited
        with open(inits, "rb") as src:
            shutil.copyfileobj(src, f, _CHUNK_BYTES)
        f.write(graph_tail + model_tail)
    inits.unlink()


def _nbits(g: _G, x: str, name: str, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]],
           out: str, accuracy_level: int, biases: list | None = None, bits: int = 4) -> tuple[str, dict]:
    """MatMulNBits of the concatenation (along N) of `parts` (q, s, z, group) from read_quant.

    `biases`: per part an fp32 [N_part] bias or None; any present goes in as the op's bias input.
    """
    groups = {p[3] for p in parts}
    ks = {p[0].shape[1] for p in parts}
    if len(groups) != 1 or len(ks) != 1:
        raise GqaGraphError(f"{name}: cannot fuse layers with group sizes {sorted(groups)} / K {sorted(ks)}")
    # one part: its own arrays (np.concatenate would copy them: the head's codes are 168 MB on Gemma 3)
    q, s, z = ((parts[0][0], parts[0][1], parts[0][2]) if len(parts) == 1 else
               (np.concatenate([p[i] for p in parts], axis=0) for i in range(3)))
    gs = groups.pop()
    n, k = q.shape
    b, sc, zp = L.to_matmulnbits(q, s, z, gs, bits=bits)
    ins = [x, g.init(f"{name}.B", b), g.init(f"{name}.scales", sc)]
    if zp is not None:
        ins.append(g.init(f"{name}.zero_points", zp))
    if biases and any(bb is not None for bb in biases):
        full = np.concatenate([bb if bb is not None else np.zeros(p[0].shape[0], np.float32)
                               for bb, p in zip(biases, parts)]).astype(np.float32)
        ins += [""] * (5 - len(ins)) + [g.init(f"{name}.bias", full)]  # inputs 3-4: zero_points, g_idx
    g.node("MatMulNBits", ins, [out], name, domain=MS, K=k, N=n, bits=int(bits), block_size=gs,
           accuracy_level=int(accuracy_level))
    return out, {"N": n, "K": k, "bits": int(bits), "block_size": gs, "zero_points": zp is not None,
                 "bytes": b.nbytes + sc.nbytes + (zp.nbytes if zp is not None else 0)}


def _linear(g, x, prefix, names, layers, out, acc, fuse, records, bias_of=lambda name: None, widths=None):
    """One fused MatMulNBits for `names` (or one each, concatenated by the caller).
    `widths`: {layer: bits} (quant.json's; 4 where absent). Each layer's codes leave `layers` once
    packed (their memory goes as the graph is built)."""
    missing = [n for n in names if n not in layers]
    if missing:
        raise GqaGraphError(f"the quantize stage has no codes for {', '.join(missing)}")
    bits = {n: int((widths or {}).get(n, 4)) for n in names}
    if fuse or len(names) == 1:
        if len(set(bits.values())) != 1:
            raise GqaGraphError(f"{prefix}: cannot fuse layers of {sorted(set(bits.values()))} bits")
        o, rec = _nbits(g, x, prefix, [layers[n] for n in names], out, acc, [bias_of(n) for n in names],
                        bits=bits[names[0]])
        records[prefix] = {**rec, "layers": list(names)}
        for n in names:
            del layers[n]
        return [o]
    outs = []
    for n in names:
        o, rec = _nbits(g, x, n, [layers[n]], f"{out}.{n.rsplit('.', 1)[-1]}", acc, [bias_of(n)], bits=bits[n])
        records[n] = {**rec, "layers": [n]}
        del layers[n]
        outs.append(o)
    return outs


def _mask_lengths(g: _G) -> None:
    """`seqlens_k` and `total_sequence_length`, GroupQueryAttention's length inputs, from the
    attention_mask onnxruntime-genai feeds (genai's io_layout).

    Why in the graph: onnxruntime-genai feeds a decoder `input_ids` and `attention_mask` [1, T] (T the
    tokens cached after this call; one longer each step: its DefaultPositionInputs), never GQA's own
    lengths. Its builder sums the mask (seqlens_k = sum - 1), which a padded batch needs; this graph
    takes one stream, whose mask genai fills with ones (nothing to pad), so T is the mask's length and
    no op reads its data: total_sequence_length = T (int32 scalar), seqlens_k = T - 1 (int32 [1]).
    """
    from onnx import TensorProto

    t = g.node("Shape", ["attention_mask"], ["mask.length"], "mask_length", start=1, end=2)  # int64 [1]
    t = g.node("Cast", [t], ["mask.length32"], "mask_length32", to=TensorProto.INT32)
    one = g.init("one_i32", np.asarray([1], np.int32))
    g.node("Sub", [t, one], ["seqlens_k"], "seqlens_k")
    g.node("Squeeze", [t], ["total_sequence_length"], "total_sequence_length")  # [1] -> a scalar


GENAI_CONFIG = "genai_config.json"


def genai_config(io: dict, threads: int | None = None, generation: dict | None = None) -> dict:
    """onnxruntime-genai's genai_config.json for a genai-layout graph, from its io.json.

    Written by hand, not by genai's builder: the builder's `config_only` option reads a Hugging Face
    checkpoint, not this graph, and turns past_present_share_buffer off, which this graph needs on
    (its GroupQueryAttention writes the new rows into the buffer it is given). The decoder is genai's
    generic `decoder` type; the I/O names are genai's defaults, so none are mapped. KV: genai allocates
    `num_key_value_heads` x `head_size` per layer, `search.max_length` rows (the graph's positions:
    `context_length`), and, for the layers listed in `decoder.sliding_window.layers`, window_size +
    cache_slack rows (slide_key_value_cache false: its GroupQueryAttention path, which evicts inside
    the op, sliding_window_cache=1): exactly io.json's cache_len. `threads`: the device's intra-op
    threads (genai's default is every core); `generation`: generation_config.json's sampling settings.
    """
    if io.get("io_layout") != "genai":
        raise GqaGraphError(f"io.json io_layout {io.get('io_layout')!r}: onnxruntime-genai needs a graph "
                            f"built with io_layout='genai'")
    windowed = [layer for layer in io["layers"] if layer["window_cache"]]
    sizes = {layer["local_window_size"] for layer in windowed}
    slacks = {layer["cache_len"] - layer["local_window_size"] for layer in windowed}
    if len(sizes) > 1 or len(slacks) > 1:  # genai's config holds one window and one slack
        raise GqaGraphError(f"window buffers of {sorted(sizes)} windows and {sorted(slacks)} slack rows: "
                            f"onnxruntime-genai's sliding_window holds one of each")
    eos = list(io.get("eos_token_id") or [])
    if not eos:
        raise GqaGraphError("the checkpoint names no eos_token_id: onnxruntime-genai needs one to stop")
    pad = io.get("pad_token_id")
    session = {"log_id": "onnxruntime-genai", "provider_options": [], "inter_op_num_threads": 1,
               # GqaDecoder's default (the arena kept a long prefill's workspace for good: gqa.py)
               "enable_cpu_mem_arena": False}
    if threads:
        session["intra_op_num_threads"] = int(threads)
    decoder = {
        "filename": "model.onnx",
        "session_options": session,
        "head_size": int(io["head_dim"]),
        "hidden_size": int(io["hidden_size"]),
        "num_attention_heads": int(io["n_heads"]),
        "num_hidden_layers": int(io["n_layers"]),
        "num_key_value_heads": int(io["n_kv_heads"]),
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": io["kv_names"]["past_key"], "past_value_names": io["kv_names"]["past_value"]},
        "outputs": {"logits": "logits", "present_key_names": io["kv_names"]["present_key"],
                    "present_value_names": io["kv_names"]["present_value"]},
    }
    if windowed:
        decoder["sliding_window"] = {"window_size": sizes.pop(), "cache_slack": slacks.pop(),
                                     "slide_key_value_cache": False, "slide_inputs": False,
                                     "layers": [int(layer["index"]) for layer in windowed]}
    gen = generation or {}
    search = {"max_length": int(io["max_len"]), "past_present_share_buffer": True, "num_beams": 1,
              "do_sample": bool(gen.get("do_sample", False))}
    for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
        if gen.get(key) is not None:
            search[key] = gen[key]
    model = {"type": "decoder", "context_length": int(io["max_len"]), "vocab_size": int(io["vocab_size"]),
             "eos_token_id": eos if len(eos) > 1 else eos[0], "pad_token_id": int(eos[0] if pad is None else pad),
             "decoder": decoder}
    if io.get("bos_token_id") is not None:
        model["bos_token_id"] = int(io["bos_token_id"])
    return {"model": model, "search": search}


def write_genai_config(graph_dir, threads: int | None = None) -> Path:
    """genai_config.json beside a genai-layout graph (`genai_config`), from its io.json and the
    generation_config.json beside it, if any; the path written."""
    graph_dir = Path(graph_dir)
    io = json.loads((graph_dir / "io.json").read_text())
    gen_path = graph_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    path = graph_dir / GENAI_CONFIG
    path.write_text(json.dumps(genai_config(io, threads, gen), indent=2) + "\n")
    return path


# --------------------------------------------------------------------------
# The embedding
# --------------------------------------------------------------------------

EMBEDDINGS = ("auto", "shared", "int8", "int4", "fp32")
_CHOSEN = {"keep": "fp32", "int8": "int8", "int4": "int4"}  # quant.json's embedding choice -> this option


def _embed_scale_fp32(emb, cfg):
    """The embedding's scale as the fp32 model applies it (HF's Gemma3TextScaledWordEmbedding multiplies
    by embed_scale cast to the weight's dtype: fp32 in the reference), or None for a plain embedding.
    A model loaded in bf16 holds the buffer rounded to bf16 (sqrt(2048): 45.25 for 45.2548): the fp32
    value is then sqrt(hidden_size), which must round to the buffer it stands for."""
    import torch

    buf = getattr(emb, "embed_scale", None)
    if buf is None:
        return None
    if buf.dtype == torch.float32:
        return buf.detach().clone()
    exact = torch.tensor(float(cfg.hidden_size) ** 0.5, dtype=torch.float32)
    if not torch.equal(exact.to(buf.dtype), buf.detach()):
        raise GqaGraphError(f"the embedding's scale {float(buf):g} ({buf.dtype}) is not sqrt(hidden_size): "
                            f"its fp32 value is unknown; load the checkpoint in fp32")
    return exact


def _can_share(emb, head, layers, widths, rows=None) -> bool:
    """Whether the head's MatMulNBits weight can also be the embedding table (`_shared_embedding`); `rows`:
    the head's width per row where it has two (`_mixed_head`)."""
    import torch

    if "lm_head" not in layers or widths.get("lm_head", 4) not in (4, 8):
        return False
    _, _, z, _ = layers["lm_head"]
    zero = 2 ** (widths.get("lm_head", 4) - 1) if rows is None else (1 << (rows.astype(np.int32) - 1))[:, None]
    if not (z == zero).all():  # asymmetric codes: zero points (not shared)
        return False
    return tuple(emb.weight.shape) == tuple(head.weight.shape) and torch.equal(emb.weight.detach(),
                                                                               head.weight.detach())


def _shared_embedding(g: "_G", layers, widths, scale: float) -> tuple[str, int]:
    """The token embedding as a GatherBlockQuantized over the head's own MatMulNBits weight: one tensor
    on disk (and, mapped, in memory) serves both, as in a tied checkpoint.

    Why by hand: ORT's GatherBlockQuantized takes data of any rank with `quantize_axis` the packed last
    one, so the head's B [V, K/bs, bs*bits/8] is its data as it is (quantize_axis=2, block_size=bs);
    its scales must have data's rank, so the head's [V, K/bs] scales go in through an Unsqueeze (ORT
    folds it into a 4-byte-per-block copy at load: 21 MB on Gemma 3's 262k x 640 at blocks of 32; the
    file holds them once). Zero points are ORT's default (8, 128) in both ops: symmetric codes only.
    The embedding then carries the head's rounding: the error record of lm_head is the embedding's too.
    Gemma 3's embed_scale is a Mul after the gather (HF multiplies the gathered rows too, in fp32 here).
    The caller has checked that the head can be shared (`_can_share`).
    """
    q, _, _, gs = layers["lm_head"]
    bits = int(widths.get("lm_head", 4))
    k = q.shape[1]
    scales3 = g.node("Unsqueeze", ["lm_head.scales", g.const_i64([2])], ["embed.scales"], "embed_scales")
    rows = g.node("GatherBlockQuantized", ["lm_head.B", "input_ids", scales3], ["embed.rows"], "embed", domain=MS,
                  bits=bits, block_size=int(gs), gather_axis=0, quantize_axis=2)  # [1, S, K/bs, bs]
    return _gathered_rows(g, rows, k, scale), 0  # its bytes are the head's (counted under matmulnbits)


def _mixed_parts(layers, rows) -> tuple[tuple, tuple, np.ndarray]:
    """The head's 8-bit rows and 4-bit rows as two read_quant parts, and each vocabulary entry's position
    in their logits side by side (int32 [V]: the 8-bit rows' first)."""
    q, s, z, gs = layers["lm_head"]
    hot, cold = np.flatnonzero(rows == 8), np.flatnonzero(rows == 4)
    pos = np.empty(len(rows), np.int32)
    pos[hot] = np.arange(len(hot), dtype=np.int32)
    pos[cold] = len(hot) + np.arange(len(cold), dtype=np.int32)
    return (q[hot], s[hot], z[hot], gs), (q[cold], s[cold], z[cold], gs), pos


def _mixed_head(g: "_G", x: str, layers, rows, out: str, acc: int, records: dict) -> str:
    """The head of two widths by row (pipeline/quant/head_rows.py): a MatMulNBits over its 8-bit rows and
    one over its 4-bit rows, their logits side by side, put back in vocabulary order.

    Why GatherElements and not Gather: ONNX Runtime 1.32's CPU Gather along the last axis copies one element
    at a time (Gemma 3's 262,144 logits: 3.5-4.5 ms a step, more than the 4-bit rows save), GatherElements
    takes 0.6-0.8 ms with int32 indices (measured side by side, benchmarks/head_rows.py). Its indices must
    have the data's shape, [1, R, V]: the [1, 1, V] positions expanded to it (R = 1 when decoding)."""
    hot, cold, pos = _mixed_parts(layers, rows)
    a, rec8 = _nbits(g, x, "lm_head.rows8", [hot], "logits.rows8", acc, bits=8)
    b, rec4 = _nbits(g, x, "lm_head.rows4", [cold], "logits.rows4", acc, bits=4)
    records["lm_head.rows8"] = {**rec8, "layers": ["lm_head"]}
    records["lm_head.rows4"] = {**rec4, "layers": ["lm_head"]}
    del layers["lm_head"]
    both = g.node("Concat", [a, b], ["logits.by_width"], "lm_head.by_width", axis=-1)
    g.init("lm_head.positions", pos)
    where = g.node("Reshape", ["lm_head.positions", g.const_i64([1, 1, -1])], ["lm_head.positions3"],
                   "lm_head.positions3")
    shape = g.node("Shape", [both], ["logits.shape"], "logits.shape")
    where = g.node("Expand", [where, shape], ["lm_head.positions_rows"], "lm_head.positions_rows")
    return g.node("GatherElements", [both, where], [out], "lm_head.vocab_order", axis=-1)


def _shared_mixed_embedding(g: "_G", layers, rows, scale: float) -> tuple[str, int]:
    """`_shared_embedding` over a head of two widths by row: each token's position (`_mixed_parts`) picks
    its row from the 8-bit table or the 4-bit one (a GatherBlockQuantized over each, the other's index
    clamped, then a Where): the tables stay the head's own."""
    q, _, _, gs = layers["lm_head"]
    n8, k = int((rows == 8).sum()), q.shape[1]
    p = g.node("Gather", ["lm_head.positions", "input_ids"], ["embed.position"], "embed_position", axis=0)
    n8_i = g.init("embed.rows8_count", np.asarray(n8, np.int32))
    is8 = g.node("Less", [p, n8_i], ["embed.is8"], "embed_is8")
    i8 = g.node("Min", [p, g.init("embed.rows8_last", np.asarray(max(n8 - 1, 0), np.int32))], ["embed.i8"], "embed_i8")
    i4 = g.node("Max", [g.node("Sub", [p, n8_i], ["embed.p4"], "embed_p4"),
                        g.init("embed.zero", np.asarray(0, np.int32))], ["embed.i4"], "embed_i4")
    picked = []
    for tag, idx, bits in (("rows8", i8, 8), ("rows4", i4, 4)):
        sc = g.node("Unsqueeze", [f"lm_head.{tag}.scales", g.const_i64([2])], [f"embed.{tag}.scales"],
                    f"embed_{tag}_scales")
        picked.append(g.node("GatherBlockQuantized", [f"lm_head.{tag}.B", idx, sc], [f"embed.{tag}"],
                             f"embed_{tag}", domain=MS, bits=bits, block_size=int(gs), gather_axis=0,
                             quantize_axis=2))  # [1, S, K/bs, bs]
    cond = g.node("Unsqueeze", [is8, g.const_i64([2, 3])], ["embed.is8_4d"], "embed_is8_4d")
    rows_ = g.node("Where", [cond, picked[0], picked[1]], ["embed.rows"], "embed_pick")
    return _gathered_rows(g, rows_, k, scale), 0  # its bytes are the head's (counted under matmulnbits)


def _gathered_rows(g: "_G", rows: str, k: int, scale: float) -> str:
    """h_0 [1, S, K] from a GatherBlockQuantized's [1, S, K/bs, bs] rows, times Gemma's embed_scale (a Mul
    after the gather, as HF multiplies the gathered rows) where it is not 1."""
    h = g.node("Reshape", [rows, g.const_i64([0, 0, k])], ["h_0" if scale == 1.0 else "h_0raw"], "embed_rows")
    if scale != 1.0:
        h = g.node("Mul", [h, g.init("embed_scale", np.asarray(scale, np.float32))], ["h_0"], "embed_scale")
    return h


def _block_embedding(g: "_G", table, bits: int, scale: float) -> tuple[str, int]:
    """An untied table as a GatherBlockQuantized of its own `bits`-bit codes (gptq.embedding_codes: the
    rounding the quantize stage measured) in MatMulNBits' layout, scales [V, K/bs, 1] float32 (the codes'
    fp16 values: rows come out float32 with no fp16 product). Scaled after the gather, as the shared one."""
    from pipeline.quant import gptq

    from pipeline.quant.int4_layouts import to_matmulnbits

    q = gptq.embedding_codes(table, bits)
    b, scales, _ = to_matmulnbits(q.qweight.numpy(), q.scales.numpy(), q.zeros.numpy(), q.group_size, sym=True,
                                  bits=bits)
    v, k = (int(d) for d in table.shape)
    del q
    g.init("embed.B", b)
    g.init("embed.scales", scales.astype(np.float32).reshape(v, k // gptq.EMBED_BLOCK, 1))
    rows = g.node("GatherBlockQuantized", ["embed.B", "input_ids", "embed.scales"], ["embed.rows"], "embed",
                  domain=MS, bits=bits, block_size=gptq.EMBED_BLOCK, gather_axis=0, quantize_axis=2)
    return _gathered_rows(g, rows, k, scale), int(b.nbytes + scales.size * 4)


# --------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------


def build_gqa_graph(untied_dir, quant_dir, out_dir, max_len: int, accuracy_level: int = 4,
                    **options) -> dict[str, Any]:
    """Write out_dir/model.onnx (+ model.onnx.data past 1.5 GB) and io.json; return facts for a manifest.

    `untied_dir`: the untie_head artifact (config.json + safetensors, head
    untied); `quant_dir`: the quantize stage's edgekiln-int4/1 folder (every
    linear, lm_head included); `max_len`: positions the graph serves (rope
    caches and full-layer KV rows); `accuracy_level`: MatMulNBits' (4 = int8
    activations, the fast CPU path; 0 = fp32). `options` override
    DEFAULT_OPTIONS. Returns node/op counts, bytes (file, weights by kind, KV),
    the per-layer plan and the MatMulNBits records (which layers each fuses).

    Memory: the initializers stream to disk as they are built (`_G`), each
    layer's codes are dropped once packed, and the HF model (its mapped
    weights) is released before the file is checked. Gemma 3 270M (920 MB
    graph, pack stage run alone, ru_maxrss): 6.46 GiB before that, 2.12 GiB
    after: 1.31 GiB while building (the quantize codes, the embedding's mapped
    pages, 16 MB row chunks), then onnx.checker reading and parsing the file
    (~1.8x its size on a 0.48 GiB base).
    """
    opts = {**DEFAULT_OPTIONS, **options}
    unknown = set(opts) - set(DEFAULT_OPTIONS)
    if unknown:
        raise GqaGraphError(f"unknown build options {sorted(unknown)}")
    if max_len < 1:
        raise GqaGraphError(f"max_len must be >= 1, got {max_len}")
    if opts["kv_dtype"] not in KV_DTYPES:
        raise GqaGraphError(f"kv_dtype must be one of {KV_DTYPES}, got {opts['kv_dtype']!r}")
    if opts["io_layout"] not in IO_LAYOUTS:
        raise GqaGraphError(f"io_layout must be one of {IO_LAYOUTS}, got {opts['io_layout']!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = _G(out_dir / _SPILL)
    try:
        return _build(g, untied_dir, quant_dir, out_dir, max_len, accuracy_level, opts)
    finally:
        g.discard()


def _build(g: _G, untied_dir, quant_dir, out_dir: Path, max_len: int, accuracy_level: int,
           opts: dict[str, Any]) -> dict[str, Any]:
    import onnx
    import torch
    from onnx import TensorProto, helper

    from pipeline.quant.codes import read_quant, row_bits

    t0 = time.perf_counter()
    meta, layers = read_quant(quant_dir, bits=(4, 8), mixed_rows=True)  # MatMulNBits takes 8-bit blocks too
    head_rows = row_bits(quant_dir, meta, "lm_head")  # the head's width per row where it has two, else None
    quantized = set(layers)  # `_linear` takes each layer's codes out of `layers` once packed
    widths = {n: int(info.get("bits", 4)) for n, info in meta["layers"].items()}
    linear = functools.partial(_linear, widths=widths)
    # The checkpoint's own dtype, mapped: the graph reads the norms, the rotary tables and (unless the
    # head's codes serve as the embedding) the embedding table, never the linears (their codes come from
    # quant_dir); each read is cast to fp32 exactly (bf16 -> fp32 is exact). On the 1.75B geometry the
    # fp32 load alone was 8.2 GB.
    model = load_hf_model(untied_dir, dtype="auto")
    cfg = _text_config(model.config)
    fam = _family(cfg)
    family = fam.model_type
    if getattr(cfg, "use_bidirectional_attention", False):
        raise GqaGraphError("use_bidirectional_attention models are not causal decoders")
    base = model.model
    n_layers = cfg.num_hidden_layers
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    attn0 = base.layers[0].self_attn
    hd = int(attn0.head_dim)
    hidden = cfg.hidden_size
    eps = float(cfg.rms_norm_eps)
    plan = layer_plan(cfg, max_len, opts["window_offset"], opts["window_cache_slack"])
    rope = _rope_caches(model, max_len)  # a partial rotary (Phi-4-mini) gives rot/2 < hd/2 columns: GQA rotates
    rotary = families.rotary_layers(cfg)  # the leading rot dims, as Phi3's apply_rotary_pos_emb does
    for key, (cos, _) in rope.items():
        if cos.shape[1] * 2 != hd and cos.shape[1] % 8:  # ORT 1.32's CPU GQA: "cos_cache dimension 1 must be
            raise GqaGraphError(  # <= head_size / 2 and a multiple of 8" (Phi-4-mini's 96 of 128 dims: 48, fine)
                f"partial rotary of {cos.shape[1] * 2} of {hd} dims ({key}): ONNX Runtime's GroupQueryAttention "
                f"rotates a multiple of 16 dims only; this checkpoint needs another device class (x86_avx2)")
    mult = families.multipliers(cfg)  # Granite's embedding, residual and logits multipliers
    if "lm_head" not in layers:
        raise GqaGraphError("the quantize stage did not quantize lm_head (a tied head?): untie it first")
    acc = int(accuracy_level)

    def w(t) -> np.ndarray:
        return t.detach().to(torch.float32).numpy().copy()

    def bias_of(name: str):
        b = getattr(model.get_submodule(name), "bias", None)
        return None if b is None else w(b)

    def gamma(norm) -> np.ndarray:  # Gemma 2/3: (1 + w); the others: w
        v = w(norm.weight)
        return (1.0 + v).astype(np.float32) if fam.norm_offset else v

    records: dict[str, Any] = {}
    genai = opts["io_layout"] == "genai"
    kv_names = KV_NAMES[opts["io_layout"]]
    S = "sequence_length" if genai else "S"
    if genai:
        _mask_lengths(g)
    # Embedding (scaled in the weight dtype, as HF's Gemma3TextScaledWordEmbedding does).
    emb = base.embed_tokens
    scale = _embed_scale_fp32(emb, cfg)
    scale_f = float(scale) if scale is not None else 1.0
    if opts["embedding"] in ("auto", "shared"):
        share = _can_share(emb, model.lm_head, layers, widths, head_rows)
        if opts["embedding"] == "shared" and not share:
            raise GqaGraphError("embedding='shared' needs a tied checkpoint (embedding and lm_head the same "
                                "tensor) whose head the quantize stage wrote symmetric at 4 or 8 bits; use "
                                "embedding='fp32'")
        chosen = (meta.get("embedding") or {}).get("chosen")
        opts["embedding"] = "shared" if share else _CHOSEN.get(chosen, "fp32")
    if opts["embedding"] in ("int8", "int4"):
        h, emb_bytes = _block_embedding(g, emb.weight.detach(), int(opts["embedding"][3:]), scale_f)
    elif opts["embedding"] == "fp32":
        # cast, scaled and written a row chunk at a time: no whole [V, H] fp32 table (671 MB on Gemma 3)
        table = emb.weight.detach()
        step = max(1, _CHUNK_BYTES // max(1, table[0].numel() * 4))

        def rows():
            for r in range(0, table.shape[0], step):
                c = table[r:r + step].to(torch.float32)
                yield (c * scale if scale is not None else c).numpy()

        g.init_chunks("embed_tokens", tuple(table.shape), np.float32, rows())
        h = g.node("Gather", ["embed_tokens", "input_ids"], ["h_0"], "embed", axis=0)  # [1, S, H]
        emb_bytes = int(table.numel() * 4)
    elif opts["embedding"] == "shared" and head_rows is not None:
        h, emb_bytes = _shared_mixed_embedding(g, layers, head_rows, scale_f)
    elif opts["embedding"] == "shared":
        h, emb_bytes = _shared_embedding(g, layers, widths, scale_f)
    else:
        raise GqaGraphError(f"embedding must be one of {EMBEDDINGS}, got {opts['embedding']!r}")
    if "embedding_multiplier" in mult:  # Granite: inputs_embeds * embedding_multiplier
        h = g.node("Mul", [h, g.init("embedding_multiplier", np.asarray(mult["embedding_multiplier"], np.float32))],
                   ["h_0m"], "embedding_multiplier")
    residual_mult = (g.init("residual_multiplier", np.asarray(mult["residual_multiplier"], np.float32))
                     if "residual_multiplier" in mult else None)

    def scaled(t: str, tag: str) -> str:
        """A sublayer's output times Granite's residual_multiplier before it joins the residual."""
        return g.node("Mul", [t, residual_mult], [f"{tag}.scaled"], f"{tag}.residual_multiplier") \
            if residual_mult is not None else t
    kv16 = opts["kv_dtype"] == "float16"
    kv_np, kv_proto = (np.float16, TensorProto.FLOAT16) if kv16 else (np.float32, TensorProto.FLOAT)
    kv_item = np.dtype(kv_np).itemsize
    for key, (cos, sin) in rope.items():
        g.init(f"cos_{key}", cos.astype(kv_np))
        g.init(f"sin_{key}", sin.astype(kv_np))

    rope_key = [p["type"] if p["type"] in rope else "default" for p in plan]
    softcaps = [_applies_attn_softcap(layer.self_attn) for layer in base.layers]
    qkv_sizes = [nh * hd, nkv * hd, nkv * hd]
    x_pending = None  # the previous sublayer's output, not yet added to the residual h
    layer_facts = []

    def norm_into(x_new, residual, gam_name, tag):
        """(normed, new residual) = RMSNorm(x_new + residual); x_new None: RMSNorm(residual)."""
        if x_new is None:
            return g.node(opts["norm_op"], [residual, gam_name], [f"{tag}.out"], tag,
                          axis=-1, epsilon=eps, stash_type=1), residual
        if opts["skip_norm"]:
            y, _, _, s = g.node("SkipSimplifiedLayerNormalization", [x_new, residual, gam_name],
                                [f"{tag}.out", "", "", f"{tag}.sum"], tag, domain=MS, epsilon=eps)
            return y, s
        s = g.node("Add", [x_new, residual], [f"{tag}.sum"], f"{tag}.add")
        return g.node(opts["norm_op"], [s, gam_name], [f"{tag}.out"], tag,
                      axis=-1, epsilon=eps, stash_type=1), s

    for p in plan:
        i = p["index"]
        layer = base.layers[i]
        attn = layer.self_attn
        pre = f"model.layers.{i}"
        last = i == n_layers - 1
        x, h = norm_into(x_pending, h, g.init(f"{pre}.input_layernorm.gamma", gamma(layer.input_layernorm)),
                         f"{pre}.input_layernorm")
        # Phi-3's checkpoint holds q|k|v as one projection: its codes are one layer, always fused
        names = ([f"{pre}.self_attn.{fam.fused_qkv}"] if fam.fused_qkv else
                 [f"{pre}.self_attn.{n}_proj" for n in ("q", "k", "v")])
        has_qk_norm = fam.qk_norm
        joint_norm = has_qk_norm and opts["qk_norm"] in ("joint", "branchwise")
        if opts["fuse_qkv"] == "qk" and not fam.fused_qkv:
            qk = linear(g, x, f"{pre}.self_attn.qk_proj", names[:2], layers, f"{pre}.qk", acc, True, records,
                         bias_of)[0]
            v = linear(g, x, f"{pre}.self_attn.v_proj", names[2:], layers, f"{pre}.v", acc, True, records,
                        bias_of)[0]
            qkv = [qk]
            if not joint_norm:
                q, k = g.node("Split", [qk, g.const_i64(qkv_sizes[:2])], [f"{pre}.q", f"{pre}.k"],
                              f"{pre}.split_qk_raw", axis=-1)
        else:
            qkv = linear(g, x, f"{pre}.self_attn.qkv_proj", names, layers, f"{pre}.qkv", acc,
                          bool(opts["fuse_qkv"]), records, bias_of)
            if len(qkv) == 1 and joint_norm:
                qk, v = g.node("Split", [qkv[0], g.const_i64([(nh + nkv) * hd, nkv * hd])],
                               [f"{pre}.qk", f"{pre}.v"], f"{pre}.split_qkv", axis=-1)
            elif len(qkv) == 1 and opts["packed_qkv"] and not has_qk_norm:
                # GQA's packed form: q|k|v as `query`, `key` and `value` left empty; no Split
                q, k, v = qkv[0], "", ""
            elif len(qkv) == 1:
                q, k, v = g.node("Split", [qkv[0], g.const_i64(qkv_sizes)], [f"{pre}.q", f"{pre}.k", f"{pre}.v"],
                                 f"{pre}.split_qkv", axis=-1)
            else:
                q, k, v = qkv
        if has_qk_norm:
            gq, gk = gamma(attn.q_norm), gamma(attn.k_norm)
            stacked = np.concatenate([np.tile(gq, (nh, 1)), np.tile(gk, (nkv, 1))]).astype(np.float32)
            qk_sizes = g.const_i64([nh * hd, nkv * hd])
            if opts["qk_norm"] == "branchwise" and len(qkv) == 1:
                # per-head RMSNorm on the flat [1, S, (nh + nkv) * hd] tensor: no Reshape around it
                n3 = g.node("BranchwiseRMSNorm", [qk, g.init(f"{pre}.qk_norm.gamma", stacked.reshape(-1))],
                            [f"{pre}.qkn"], f"{pre}.qk_norm", domain=MS, num_branches=nh + nkv, epsilon=eps)
                q, k = g.node("Split", [n3, qk_sizes], [f"{pre}.qn", f"{pre}.kn"], f"{pre}.split_qk", axis=-1)
            elif opts["qk_norm"] == "joint" and len(qkv) == 1:
                r = g.node("Reshape", [qk, g.const_i64([0, 0, -1, hd])], [f"{pre}.qk4"], f"{pre}.qk_reshape")
                n4 = g.node(opts["norm_op"], [r, g.init(f"{pre}.qk_norm.gamma", stacked)],
                            [f"{pre}.qk4n"], f"{pre}.qk_norm", axis=-1, epsilon=eps, stash_type=1)
                n3 = g.node("Reshape", [n4, g.const_i64([0, 0, -1])], [f"{pre}.qkn"], f"{pre}.qk_flat")
                q, k = g.node("Split", [n3, qk_sizes], [f"{pre}.qn", f"{pre}.kn"], f"{pre}.split_qk", axis=-1)
            else:
                outs = []
                for tag, t, gm in (("q", q, gq), ("k", k, gk)):
                    r = g.node("Reshape", [t, g.const_i64([0, 0, -1, hd])], [f"{pre}.{tag}4"], f"{pre}.{tag}_reshape")
                    n4 = g.node(opts["norm_op"], [r, g.init(f"{pre}.{tag}_norm.gamma", gm)],
                                [f"{pre}.{tag}4n"], f"{pre}.{tag}_norm", axis=-1, epsilon=eps, stash_type=1)
                    outs.append(g.node("Reshape", [n4, g.const_i64([0, 0, -1])], [f"{pre}.{tag}n"],
                                       f"{pre}.{tag}_flat"))
                q, k = outs
        key = rope_key[i]
        gqa_attrs = {"num_heads": nh, "kv_num_heads": nkv, "scale": float(attn.scaling),
                     "do_rotary": int(rotary[i]),  # 0 on a NoPE layer (SmolLM3)
                     "rotary_interleaved": 0, "local_window_size": int(p["local_window_size"])}
        if p["window_cache"]:
            gqa_attrs["sliding_window_cache"] = 1
        if softcaps[i]:
            gqa_attrs["softcap"] = float(softcaps[i])
        if kv16:  # GQA takes one type T for q/k/v, the caches and its output
            q, k, v = (g.node("Cast", [t], [f"{t}16"], f"{t}16", to=TensorProto.FLOAT16) if t else t
                       for t in (q, k, v))
        a = g.node("GroupQueryAttention",
                   [q, k, v, kv_names["past_key"] % i, kv_names["past_value"] % i, "seqlens_k", "total_sequence_length"]
                   + ([f"cos_{key}", f"sin_{key}"] if rotary[i] else []),
                   [f"{pre}.attn16" if kv16 else f"{pre}.attn", kv_names["present_key"] % i, kv_names["present_value"] % i],
                   f"{pre}.gqa", domain=MS, **gqa_attrs)[0]
        if kv16:
            a = g.node("Cast", [a], [f"{pre}.attn"], f"{pre}.attn32", to=TensorProto.FLOAT)
        if last and opts["last_layer_rows"] == "last":
            # Only the last `logits_rows` positions' logits leave the graph (1 unless fed: see _last_rows):
            # past the last GQA (whose K/V every row feeds), the last layer runs those rows only.
            idx = _last_rows(g, a)
            a = g.node("Gather", [a, idx], [f"{pre}.attn_last"], f"{pre}.attn_last", axis=1)
            h = g.node("Gather", [h, idx], [f"{pre}.res_last"], f"{pre}.res_last", axis=1)
        o = linear(g, a, f"{pre}.self_attn.o_proj", [f"{pre}.self_attn.o_proj"], layers, f"{pre}.o", acc,
                    True, records, bias_of)[0]
        o = scaled(o, f"{pre}.o")
        if fam.sandwich_norms:
            o = g.node(opts["norm_op"],
                       [o, g.init(f"{pre}.post_attention_layernorm.gamma", gamma(layer.post_attention_layernorm))],
                       [f"{pre}.o_n"], f"{pre}.post_attention_layernorm", axis=-1, epsilon=eps, stash_type=1)
            mlp_norm = layer.pre_feedforward_layernorm
            mlp_tag = "pre_feedforward_layernorm"
        else:
            mlp_norm = layer.post_attention_layernorm
            mlp_tag = "post_attention_layernorm"
        x, h = norm_into(o, h, g.init(f"{pre}.{mlp_tag}.gamma", gamma(mlp_norm)), f"{pre}.{mlp_tag}")
        names = ([f"{pre}.mlp.{fam.fused_gate_up}"] if fam.fused_gate_up else
                 [f"{pre}.mlp.gate_proj", f"{pre}.mlp.up_proj"])  # Phi-3: gate|up one projection, gate first
        gu = linear(g, x, f"{pre}.mlp.gate_up_proj", names, layers, f"{pre}.gu", acc, opts["fuse_gate_up"],
                     records, bias_of)
        if len(gu) == 1:
            inter = cfg.intermediate_size
            gate, up = g.node("Split", [gu[0], g.const_i64([inter, inter])], [f"{pre}.gate", f"{pre}.up"],
                              f"{pre}.split_gate_up", axis=-1)
        else:
            gate, up = gu
        act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act_name in ("gelu_pytorch_tanh", "gelu_tanh"):
            act = g.node("FastGelu", [gate], [f"{pre}.act"], f"{pre}.act", domain=MS)
        elif act_name in ("silu", "swish"):
            act = g.node("QuickGelu", [gate], [f"{pre}.act"], f"{pre}.act", domain=MS, alpha=1.0)
        else:
            raise GqaGraphError(f"activation {act_name!r} is not supported by the GQA graph")
        m = g.node("Mul", [act, up], [f"{pre}.gated"], f"{pre}.gated")
        m = linear(g, m, f"{pre}.mlp.down_proj", [f"{pre}.mlp.down_proj"], layers, f"{pre}.down", acc, True,
                    records, bias_of)[0]
        m = scaled(m, f"{pre}.down")
        if fam.sandwich_norms:
            m = g.node(opts["norm_op"],
                       [m, g.init(f"{pre}.post_feedforward_layernorm.gamma",
                                  gamma(layer.post_feedforward_layernorm))],
                       [f"{pre}.m_n"], f"{pre}.post_feedforward_layernorm", axis=-1, epsilon=eps, stash_type=1)
        x_pending = m
        layer_facts.append({**p, "rope": key, "rope_theta": _theta(cfg, key), "scale": float(attn.scaling),
                            "attn_softcap": softcaps[i]})

    xf, _ = norm_into(x_pending, h, g.init("model.norm.gamma", gamma(base.norm)), "model.norm")
    if opts["last_layer_rows"] != "last":
        xf = g.node("Gather", [xf, _last_rows(g, xf)], ["final_last"], "final_last", axis=1)  # [1, R, H]
    final_cap = getattr(cfg, "final_logit_softcapping", None)
    post = [n for n, on in (("scaling", "logits_scaling" in mult), ("softcap", bool(final_cap))) if on]
    if head_rows is not None:
        if bias_of("lm_head") is not None:
            raise GqaGraphError("a head of two widths by row with a bias is not built: quantize.head_rows8=0")
        logits = _mixed_head(g, xf, layers, head_rows, "logits_raw" if post else ROW_LOGITS, acc, records)
    else:
        logits = linear(g, xf, "lm_head", ["lm_head"], layers, "logits_raw" if post else ROW_LOGITS, acc, True,
                        records, bias_of)[0]  # [1, R, V]
    if "logits_scaling" in mult:  # Granite: logits / logits_scaling, before any softcap
        logits = g.node("Div", [logits, g.init("logits_scaling", np.asarray(mult["logits_scaling"], np.float32))],
                        [ROW_LOGITS if post == ["scaling"] else "logits_scaled"], "logits_scaling")
    if final_cap:
        c = g.init("final_softcap", np.asarray(final_cap, np.float32))
        t = g.node("Div", [logits, c], ["logits_div"], "softcap_div")
        t = g.node("Tanh", [t], ["logits_tanh"], "softcap_tanh")
        g.node("Mul", [t, c], [ROW_LOGITS], "softcap_mul")
    # `logits`, the last row: a scalar index gives [1, V]; genai's layout keeps the axis, [1, 1, V], because
    # onnxruntime-genai reads logits of a static length 1 as the last position's only (its Model::IsPruned)
    g.node("Gather", [ROW_LOGITS, g.const_i64([-1] if genai else -1)], ["logits"], "logits_last", axis=1)

    vi = helper.make_tensor_value_info
    if genai:
        inputs = [vi("input_ids", TensorProto.INT64, [1, S]),
                  vi("attention_mask", TensorProto.INT64, [1, "total_sequence_length"])]
        outputs = [vi("logits", TensorProto.FLOAT, [1, 1, cfg.vocab_size])]
    else:
        inputs = [vi("input_ids", TensorProto.INT64, [1, S]), vi("seqlens_k", TensorProto.INT32, [1]),
                  vi("total_sequence_length", TensorProto.INT32, [])]
        outputs = [vi("logits", TensorProto.FLOAT, [1, cfg.vocab_size])]
    for i in range(n_layers):
        # genai's layout leaves the buffer's rows symbolic: onnxruntime-genai allocates them from its
        # search.max_length (full layers) and window + cache_slack (its sliding_window.layers); a
        # distinct name for the window buffers, as its builder gives them, so no shape inference
        # equates the two. The project's layout states io.json's rows.
        rows = (("window_cache_length" if plan[i]["window_cache"] else "kv_cache_length") if genai
                else plan[i]["cache_len"])
        kv_shape = [1, nkv, rows, hd]
        inputs += [vi(kv_names["past_key"] % i, kv_proto, kv_shape), vi(kv_names["past_value"] % i, kv_proto, kv_shape)]
        outputs += [vi(kv_names["present_key"] % i, kv_proto, kv_shape),
                    vi(kv_names["present_value"] % i, kv_proto, kv_shape)]
    # the speculative decoder's input and output (last in each list: a runtime that feeds neither is unaffected)
    inputs.append(vi(LOGITS_ROWS, TensorProto.INT64, []))
    outputs.append(vi(ROW_LOGITS, TensorProto.FLOAT, [1, LOGITS_ROWS, cfg.vocab_size]))
    # the initializers are in g's spill file (model.onnx gets them in this order: `_write_model`)
    graph = helper.make_graph(g.nodes, f"{family}_gqa", inputs, outputs, [])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                                   producer_name="edgekiln.gqa_graph")
    onnx_model.ir_version = 11

    unused = sorted(quantized - {n for r in records.values() for n in r["layers"]})
    if unused:
        raise GqaGraphError(f"quantized layers the graph does not use: {', '.join(unused[:8])}")

    # The HF model (its mapped weights: the embedding's pages were read) is not needed past here.
    gen_cfg = getattr(model, "generation_config", None)
    model = base = attn0 = emb = table = scale = layer = attn = mlp_norm = None  # noqa: F841 (every module ref)
    gc.collect()

    onnx_path = out_dir / "model.onnx"
    data_name = "model.onnx.data"
    external = g.init_bytes > _EXTERNAL_DATA_BYTES
    for stale in (onnx_path, out_dir / data_name):
        stale.unlink(missing_ok=True)
    _write_model(onnx_model, g, onnx_path, external, data_name, size_threshold=1024)
    if opts["norm_op"] == "RMSNormalization":  # the checker does not know ORT's SimplifiedLayerNormalization
        onnx.checker.check_model(str(onnx_path), full_check=False)  # from the file: no in-memory copy

    def _io(v):
        dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        return {"name": v.name, "shape": dims,
                "dtype": helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name}

    io = {
        "format": IO_FORMAT,
        "io_layout": opts["io_layout"],
        "kv_names": kv_names,
        "family": family,
        "inputs": [_io(v) for v in inputs],
        "outputs": [_io(v) for v in outputs],
        "max_len": int(max_len),
        "kv_layout": "BNSH [1, n_kv, cache_len, head_dim] per layer (max_len, or window + slack for a "
                     "window_cache layer), past_* and present_* bound to one buffer",
        "kv_dtype": opts["kv_dtype"],
        "layers": layer_facts,
        "vocab_size": int(cfg.vocab_size),
        "n_layers": int(n_layers),
        "n_heads": int(nh),
        "n_kv_heads": int(nkv),
        "head_dim": hd,
        "hidden_size": int(hidden),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "final_logit_softcapping": final_cap,
        "accuracy_level": acc,
        "quant": {k: meta.get(k) for k in ("format", "method", "group_size", "sym")},
        "options": opts,
        "bos_token_id": _first_id(getattr(cfg, "bos_token_id", None), getattr(gen_cfg, "bos_token_id", None)),
        "eos_token_id": _id_list(getattr(cfg, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None)),
        "pad_token_id": _first_id(getattr(cfg, "pad_token_id", None), getattr(gen_cfg, "pad_token_id", None)),
        "external_data": external,
        "opset": OPSET,
        # verify(tokens) (edgekiln_runtime/speculative.py): feed LOGITS_ROWS = n, fetch ROW_LOGITS [1, n, V]
        "row_logits": {"input": LOGITS_ROWS, "output": ROW_LOGITS, "default_rows": 1},
    }
    (out_dir / "io.json").write_text(json.dumps(io, indent=2) + "\n")
    ops: dict[str, int] = {}
    for node in g.nodes:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    files = [onnx_path] + ([out_dir / data_name] if external else [])
    return {
        "onnx": str(onnx_path),
        "family": family,
        "nodes": len(g.nodes),
        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
        "bytes": sum(f.stat().st_size for f in files),
        "weight_bytes": {"matmulnbits": sum(r["bytes"] for r in records.values()),
                         "embedding": emb_bytes},
        "matmulnbits": records,
        "layer_plan": layer_facts,
        "max_len": int(max_len),
        "accuracy_level": acc,
        "kv_bytes": int(sum(2 * nkv * p["cache_len"] * hd * kv_item for p in plan)),
        "kv_dtype": opts["kv_dtype"],
        "options": opts,
        "external_data": external,
        "build_s": round(time.perf_counter() - t0, 2),
    }


def _last_rows(g: "_G", x: str) -> str:
    """The index [S - R, ..., S - 1] of x's last R rows (x: [1, S, X]), R the graph input LOGITS_ROWS.

    LOGITS_ROWS is an initializer (1) that is also a graph input, ONNX's way to give an input a default: a
    caller that does not feed it (a prefill, a decode step, onnxruntime-genai, which binds only the inputs
    its config names and does not list such an input) gets the last row alone; a speculative decoder's
    verify feeds R = its draft + 1 and fetches ROW_LOGITS. (An optional-typed input would say the same
    without ONNX Runtime's load-time warning about it, but onnxruntime-genai 0.18 crashes loading one.)
    Why by hand: ONNX has no "last R rows" op; Shape/Squeeze/Sub/Range is its usual spelling."""
    if not getattr(g, "has_logits_rows", False):
        g.init(LOGITS_ROWS, np.asarray(1, dtype=np.int64))
        g.has_logits_rows = True
    n = g.node("Shape", [x], [f"{x}.rows"], f"{x}.rows", start=1, end=2)
    n = g.node("Squeeze", [n], [f"{x}.rows0"], f"{x}.rows0")
    start = g.node("Sub", [n, LOGITS_ROWS], [f"{x}.rows_from"], f"{x}.rows_from")
    return g.node("Range", [start, n, g.const_i64(1)], [f"{x}.last_rows"], f"{x}.last_rows")


def _theta(cfg, key: str):
    rp = getattr(cfg, "rope_parameters", None) or {}
    if key in rp and isinstance(rp[key], dict):
        return rp[key].get("rope_theta")
    return rp.get("rope_theta", getattr(cfg, "rope_theta", None))
