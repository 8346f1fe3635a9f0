"""A Genie-form graph (pipeline/graphs/decode_graph.py, "Genie's form") fed the way Qualcomm's
Genie runtime feeds it: our check, on this host, that a graph in that form computes the model
when its inputs are what Genie writes, since nothing here runs Genie itself.

What it does as Genie's HTP engine does (qualla/engines/qnn-htp/nsp-model.cpp and
attention-mask.cpp in the Genie sources the QAIRT SDK ships; read, not copied):
- the attention mask of a call: every entry the negative value, then per real row its span of the
  past (the first n_past entries: the past kept in place, its mask saying which are valid, as
  Genie's SMART_MASK manager keeps it) and the call's own tokens up to its own; for a float mask
  0 and -1000 (GENIE_ATTEND / GENIE_MASKED);
- a short call right-padded: the real tokens first, the pad token after them, and the logits read
  from the last real row;
- the rotary tables: cos and sin of position x inverse frequency, half the rotary width a row,
  scaled by the rope's attention factor (Genie computes the frequencies from rope-theta and the
  rope scaling in double; here they are Hugging Face's, io.json "rope", the same formula);
- the KV: each call's `past_*_out` written into the `_in` buffers at the next n_past entries
  (keys transposed: [1, n_kv, head_dim, len]);
- the sliding layers' cache group (io.json "cache_groups", prefix swa_: KVCache/ and
  context-manager.cpp): its buffer filled slot by slot, then the oldest entry overwritten (with no
  reserved tokens, slot = position mod buffer), its mask (swa_attention_mask) the global mask's
  columns gathered slot by slot with the keys out of the window (position <= p - W) masked;
- Genie's absolute positional encoding (io.json "positions", a model with a rotary table per kind of
  layer): position_ids int32 n_past + i, 0 for the padding;
- a quantized boundary (io.json "boundary", pipeline/graphs/genie_io.py): the mask as 0xffff where a
  token may attend and 0 elsewhere whatever the tensor's encoding; the rotary tables' codes
  truncated as Genie's engine computes them; the embeddings' codes from the LUT (written rounded to
  nearest, pipeline/runtimes/genie.py write_lut: Genie copies a fixed-point LUT's bytes); the KV as
  codes, each call's out codes copied into the in buffers.

The context is io.json's `context_length` (Genie's CL): a call of T tokens needs n_past <= CL - T.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from edgekiln_runtime.session import session_options
from pipeline.graphs import genie_io
from pipeline.runtimes.contract import ContextFull, Runtime
from pipeline.runtimes.onnx import _lookup


class GenieFeedDecoder(Runtime):
    """Runs a Genie-form export (io.json "form": "genie") on ONNX Runtime, fed as Genie feeds it."""

    def __init__(self, artifact_dir, threads: int = 1, providers: Iterable = ("CPUExecutionProvider",), *,
                 model_file: str | None = "model.onnx", prompt_file: str | None = None, session=None,
                 prompt_session=None, embed=None, lut: np.ndarray | None = None, config: dict | None = None):
        """`artifact_dir` holds io.json; the AR-1 graph is `model_file` there or `session` (a compiled context
        binary's: pipeline/graphs/qnn.py), the prompt graph `prompt_file` or `prompt_session`. A graph that
        takes `inputs_embeds` gets `embed(token_id) -> [hidden]` rows (Genie's LUT: the pad rows are the EOS
        token's, as Genie pads), or with `lut` (the bundle's embedding_lut.bin as [vocab, hidden] codes) the
        LUT's rows copied as they are, as Genie copies a fixed-point LUT; `config`: session config entries
        (qnn.CPU_QDQ_CONFIG for a QDQ graph)."""
        import onnxruntime as ort

        self.dir = Path(artifact_dir)
        self.io = json.loads((self.dir / "io.json").read_text())
        if self.io.get("form") != "genie":
            raise ValueError(f"{self.dir}/io.json is not a Genie-form export (decode_graph.export_genie_step)")

        def open_(name):
            return ort.InferenceSession(str(self.dir / name), sess_options=session_options(threads, config=config),
                                        providers=list(providers))

        self.context_length = CL = int(self.io["context_length"])
        self.vocab_size = int(self.io["vocab_size"])
        eos = self.io.get("eos_token_id") or [0]
        self.pad_token = int(eos[0] if isinstance(eos, list) else eos)
        self.first = self.io["inputs"][0]["name"]
        lookup = self.io.get("embedding")
        self._lut = lut
        if self.first == "inputs_embeds" and embed is None and lut is None:
            if lookup is None:
                raise ValueError(f"{self.dir}: the graph takes inputs_embeds and io.json names no embedding model")
            table = ort.InferenceSession(str(self.dir / lookup["model"]), sess_options=session_options(threads),
                                         providers=["CPUExecutionProvider"])
            embed = functools.partial(_lookup, table, lookup["input"], np.zeros((1, 1), dtype=np.int64))
        self._embed = embed
        self.enc = self.io.get("boundary") or {}  # the quantized boundary's encodings, where it has one
        self._positions = "positions" in self.io  # Genie's absolute encoding: the tables are in the graph
        if not self._positions:
            rope = self.io["rope"]
            angles = np.arange(CL, dtype=np.float64)[:, None] * np.asarray(rope["inv_freq"], np.float64)[None, :]
            scale = float(rope["attention_scaling"])
            self._cos = self._table(np.cos(angles) * scale, "position_ids_cos")  # [CL, rot/2]
            self._sin = self._table(np.sin(angles) * scale, "position_ids_sin")
        if "attention_mask" in self.enc:  # Genie's constants for a quantized mask, whatever its encoding
            info = np.iinfo(self.enc["attention_mask"]["dtype"])
            self.attend, self.masked, self._mask_dtype = info.max, 0, self.enc["attention_mask"]["dtype"]
        else:
            self.attend, self.masked = float(self.io["mask"]["attend"]), float(self.io["mask"]["masked"])
            self._mask_dtype = np.float32
        n_kv, hd = int(self.io["n_kv_heads"]), int(self.io["head_dim"])
        # Each layer's K/V in place: a full layer's whole context (a call's past buffer is its first CL - T
        # entries), a sliding layer's its group's buffer (a ring)
        group = {g["prefix"]: g for g in self.io.get("cache_groups", [])}
        self._names, self._ring, self._k, self._v = [], [], [], []
        for layer in self.io["layers"]:
            prefix = layer.get("prefix", "past_")
            names = {k: f"{prefix}{k}_{layer['index']}" for k in ("key", "value")}
            ring = int(group[prefix]["buffer"]) if prefix in group else 0
            dt = [np.dtype(self.enc.get(names[k] + "_in", {}).get("dtype", "float32")) for k in ("key", "value")]
            self._names.append(names)
            self._ring.append(ring)
            self._k.append(np.zeros((1, n_kv, hd, ring or CL), dt[0]))
            self._v.append(np.zeros((1, n_kv, ring or CL, hd), dt[1]))
        self._swa = next(iter(group.values()), None)
        self._graphs = {}
        if session is not None or model_file is not None:
            self._graphs[1] = session or open_(model_file)
        if prompt_file is not None or prompt_session is not None:
            self._graphs[int(self.io["prompt"]["tokens"])] = prompt_session or open_(prompt_file)
        self.prompt_tokens = max(self._graphs)
        # by name: a graph cut into parts (pipeline/graphs/parts.py PartsSession) gives its outputs part by part
        self._outputs = [o["name"] for o in self.io["outputs"]]
        self.position = 0
        self.calls = {"token": 0, "prompt": 0}

    def _table(self, values: np.ndarray, name: str) -> np.ndarray:
        """A rotary table as Genie's engine writes it: float, or codes truncated (calculate_rope_embeddings)."""
        enc = self.enc.get(name)
        if enc is None:
            return values.astype(np.float32)
        return np.floor(values / enc["scale"] - enc["offset"]).astype(enc["dtype"])

    def _rows(self, tokens: Sequence[int], T: int) -> np.ndarray:
        """The first input for `tokens` right-padded to T: ids (int32), or the embedding rows (codes where
        the boundary is quantized)."""
        padded = list(tokens) + [self.pad_token] * (T - len(tokens))
        if self._lut is not None:
            return self._lut[padded][None]
        if self._embed is None:
            return np.asarray(padded, dtype=np.int32)[None]
        rows = np.stack([np.asarray(self._embed(t), dtype=np.float32).reshape(-1) for t in padded])[None]
        enc = self.enc.get(self.first)
        return rows if enc is None else genie_io.quantize(rows, enc)

    @property
    def batched_prefill(self) -> bool:
        return self.prompt_tokens > 1

    def reset(self) -> None:
        for k, v in zip(self._k, self._v):
            k.fill(0.0)
            v.fill(0.0)
        self.position = 0

    def kv_bytes(self) -> int:
        return int(sum(k.nbytes + v.nbytes for k, v in zip(self._k, self._v)))

    def feed(self, tokens: Sequence[int], T: int) -> dict[str, np.ndarray]:
        """The inputs Genie writes for a call of the AR-`T` graph on `tokens` at the current position."""
        n, p, CL = len(tokens), self.position, self.context_length
        past = CL - T
        if not 1 <= n <= T:
            raise ValueError(f"a call of {n} tokens for a graph of {T}")
        if p > past:
            raise ContextFull(f"{p} tokens already held: the AR-{T} graph's past holds {past} (context_length {CL})")
        mask = np.full((1, 1, T, CL), self.masked, dtype=self._mask_dtype)
        for r in range(n):
            mask[0, 0, r, :p] = self.attend  # the past, kept in place
            mask[0, 0, r, past:past + r + 1] = self.attend  # the call's own tokens up to this one
        feed = {self.first: self._rows(tokens, T), "attention_mask": mask}
        if self._swa is not None:
            feed[self._swa["mask"]] = self._window_mask(n, T)
        pos = np.zeros(T, dtype=np.int64)
        pos[:n] = np.arange(p, p + n)  # Genie's position ids: 0 for the padding
        if self._positions:
            feed[self.io["positions"]["input"]] = pos.astype(np.int32)[None, None]
        else:
            feed.update(position_ids_cos=self._cos[pos][None, None], position_ids_sin=self._sin[pos][None, None])
        for names, ring, k, v in zip(self._names, self._ring, self._k, self._v):
            feed[names["key"] + "_in"] = k if ring else np.ascontiguousarray(k[..., :past])
            feed[names["value"] + "_in"] = v if ring else v[:, :, :past, :]
        return feed

    def _window_mask(self, n: int, T: int) -> np.ndarray:
        """The sliding group's mask for a call of `n` real tokens (of T) at the current position: a slot
        attended where it holds a position the global mask attends and the window reaches (> p + r - W),
        then the call's own tokens as the global mask has them."""
        B, W, p = int(self._swa["buffer"]), int(self._swa["window"]), self.position
        mask = np.full((1, 1, T, B + T), self.masked, dtype=self._mask_dtype)
        slots = np.arange(B)
        held = slots + B * ((p - 1 - slots) // B)  # the position each slot holds (the latest < p in its ring)
        valid = slots < min(p, B)
        for r in range(n):
            mask[0, 0, r, :B][valid & (held > p + r - W)] = self.attend
            mask[0, 0, r, B:B + r + 1] = self.attend
        return mask

    def _call(self, tokens: Sequence[int], T: int) -> np.ndarray:
        n, p = len(tokens), self.position
        if p + n > self.context_length:
            raise ContextFull(f"{n} tokens at position {p} pass the context_length {self.context_length}")
        res = self._graphs[T].run(self._outputs, self.feed(tokens, T))
        self.calls["token" if T == 1 else "prompt"] += 1
        for i, (ring, k, v) in enumerate(zip(self._ring, self._k, self._v)):  # Genie's KV update: the real rows'
            new_k, new_v = res[1 + 2 * i], res[2 + 2 * i]
            if ring:  # the group's buffer: slot by slot, the oldest overwritten
                for j in range(n):
                    k[..., (p + j) % ring] = new_k[..., j]
                    v[:, :, (p + j) % ring, :] = new_v[:, :, j, :]
            else:
                k[..., p:p + n] = new_k[..., :n]
                v[:, :, p:p + n, :] = new_v[:, :, :n, :]
        self.position = p + n
        logits = res[0].reshape(T, -1)[n - 1]  # the last real row
        enc = self.enc.get("logits")
        return logits if enc is None else genie_io.dequantize(logits, enc)

    def next_inputs(self, token_id: int) -> dict[str, np.ndarray]:
        """A copy of the inputs the next step(token_id) feeds (a calibration sample)."""
        return {k: v.copy() for k, v in self.feed([int(token_id)], 1).items()}

    def next_prompt_inputs(self, chunk: Sequence[int]) -> dict[str, np.ndarray]:
        """A copy of the inputs the prompt graph gets for `chunk` next (a calibration sample)."""
        return {k: v.copy() for k, v in self.feed([int(t) for t in chunk], self.prompt_tokens).items()}

    def step(self, token_id: int) -> np.ndarray:
        if 1 not in self._graphs:
            raise ValueError(f"{self.dir}: opened without its token graph: prefill only")
        return self._call([int(token_id)], 1)

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Through the prompt graph, `prompt_tokens` a call, where it has one; token by token otherwise."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        T = self.prompt_tokens
        logits = None
        for i in range(0, len(ids), T):
            logits = self._call(ids[i:i + T], T)
        return logits
