"""ONNX Runtime running an exported decode step (pipeline/graphs/decode_graph.py's io.json
contract): the fp32 export, the phone's QDQ graphs on the CPU EP, and a QNN context
binary through the session pipeline/graphs/qnn.py makes for it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from edgekiln_runtime.session import session_options  # noqa: F401  (the project's name for it)
from pipeline.runtimes.contract import ContextFull, Runtime


def _lookup(session, name: str, ids: np.ndarray, token_id: int) -> np.ndarray:
    """One token's embedding row from an embedding model (qnn.write_embedding's), flat."""
    ids[0, 0] = token_id
    return session.run(None, {name: ids})[0].reshape(-1)


def ring_positions(start: int, ring: int) -> np.ndarray:
    """The position each slot of a ring of `ring` entries holds when the stream is at `start` (-1: empty):
    slot j holds the latest position q < start with q mod ring = j."""
    j = np.arange(ring)
    return np.where(j < start, j + ring * ((start - 1 - j) // ring), -1)


def prompt_masks(start: int, n: int, tokens: int, masks: dict[str, dict[str, int]],
                 mask_value: float) -> dict[str, np.ndarray]:
    """The prompt graph's additive masks (pipeline/graphs/decode_graph.py, "The prompt graph") for a chunk
    of `n` tokens at positions start..start+n-1, padded in front to `tokens` rows: {name: [T, cache + T]}.

    A real row at position q sees a full layer's slots j < start, a ring's slots holding a position
    > q - window (window = ring + 1: HF's sliding mask), and the chunk's real rows up to its own (within
    the window on a ring). A padding row sees only itself: its logits and keys are never used."""
    T = tokens
    pad = T - n
    rows = np.arange(T)
    real = rows >= pad
    q = start + rows - pad
    causal = (rows[None, :] <= rows[:, None]) & real[None, :] & real[:, None]
    own = np.eye(T, dtype=bool) & ~real[:, None]
    out = {}
    for name, m in masks.items():
        ring = m["ring"]
        if ring:
            held = ring_positions(start, ring)
            cache = (held[None, :] >= 0) & (held[None, :] >= q[:, None] - ring)
            chunk = causal & (rows[:, None] - rows[None, :] <= ring)
        else:
            cache = np.broadcast_to(np.arange(m["cache_len"])[None, :] < start, (T, m["cache_len"]))
            chunk = causal
        seen = np.concatenate((cache & real[:, None], chunk | own), axis=1)
        out[name] = np.where(seen, 0.0, mask_value).astype(np.float32)
    return out


class OnnxDecoder(Runtime):
    """Runs an exported decode step with onnxruntime; numpy caches, slot writes per io.json; with a prompt
    graph (io.json "prompt"), a prompt goes through it `tokens` at a call."""

    _prompt = None  # the prompt graph's session, where it has one

    def __init__(self, artifact_dir, threads: int = 1, providers: Iterable = ("CPUExecutionProvider",), *,
                 model_file: str | None = "model.onnx", session=None, embed=None, extra_outputs: Sequence[str] = (),
                 config: dict | None = None, prompt_file: str | None = None, prompt_session=None):
        """`artifact_dir` holds io.json; the graph is `model_file` inside it, or
        `session` when given (a graph of the same io.json compiled elsewhere,
        e.g. a QNN context binary: pipeline/graphs/qnn.py).

        A graph whose token embedding was taken out (the phone's: io.json
        "embedding", npu_rewrite.embedding_input) takes `inputs_embeds`: each
        step first runs io.json's embedding model (on the CPU EP) on the token,
        or `embed(token_id) -> [hidden]` when given (the pack stage's check of
        its rewrites, with the float table).

        `extra_outputs`: more of the graph's outputs fetched each step, left in
        `self.extra` (name -> array) for a caller that probes the graph (the
        pack stage's residual-stream range). `config`: session config entries
        for the graph's session (pipeline/graphs/qnn.py's CPU stand-in of a QDQ graph).

        `prompt_file` (a graph beside io.json) or `prompt_session`: the prompt graph io.json "prompt"
        describes; `prefill` then runs a prompt through it, a chunk of its `tokens` a call (executions
        counted in `self.calls`)."""
        import onnxruntime as ort

        self.dir = Path(artifact_dir)
        self.io = json.loads((self.dir / "io.json").read_text())
        # model_file=None: no token graph (a caller that only prefills through the prompt graph, e.g. the
        # pack's check of it: on a 1.75B model each session holds 8 GB of weights)
        self._session_args = (threads, list(providers), config)  # the prompt graph's session opens alike
        self.session = session or (None if model_file is None else self._open(model_file))
        self.context_length = int(self.io["context_length"])
        self.vocab_size = int(self.io["vocab_size"])
        shapes = {i["name"]: i["shape"] for i in self.io["inputs"]}
        self._ids = np.zeros((1, 1), dtype=np.int64)
        self._pos = np.zeros((1,), dtype=np.int64)
        self.feed: dict[str, np.ndarray] = {"input_ids": self._ids, "position": self._pos}
        self._embed = None
        lookup = self.io.get("embedding")
        if lookup is not None:  # the embedding runs before the graph, its rows fed as the graph's input
            self._embeds = np.zeros(shapes[lookup["output"]], dtype=np.float32)
            self.feed = {lookup["output"]: self._embeds, "position": self._pos}
            if embed is None:
                table = ort.InferenceSession(str(self.dir / lookup["model"]), sess_options=session_options(threads),
                                             providers=["CPUExecutionProvider"])
                embed = functools.partial(_lookup, table, lookup["input"], self._ids)
            self._embed = embed
        self._caches: list[tuple[np.ndarray, np.ndarray, int]] = []  # (K, V, ring size or 0)
        for layer in self.io["layers"]:
            i = layer["index"]
            rule = layer["slot_rule"]
            if rule == "position":
                ring = 0
            elif rule.startswith("position mod "):
                ring = int(rule.split()[-1])
            else:
                raise ValueError(f"io.json layer {i}: unknown slot_rule {rule!r}")
            k = np.zeros(shapes[f"past_key_{i}"], dtype=np.float32)
            v = np.zeros(shapes[f"past_value_{i}"], dtype=np.float32)
            if k.shape[2] != layer["cache_len"]:
                raise ValueError(f"io.json layer {i}: cache_len {layer['cache_len']} != input shape {k.shape}")
            self.feed[f"past_key_{i}"] = k
            self.feed[f"past_value_{i}"] = v
            self._caches.append((k, v, ring))
        self.output_names = [o["name"] for o in self.io["outputs"]]
        self.extra_names = list(extra_outputs)
        self.extra: dict[str, np.ndarray] = {}
        self.position = 0
        self.calls = {"token": 0, "prompt": 0}
        if prompt_file is not None or prompt_session is not None:
            self._open_prompt(prompt_file, prompt_session)

    def _open(self, name: str):
        import onnxruntime as ort

        threads, providers, config = self._session_args
        return ort.InferenceSession(str(self.dir / name), sess_options=session_options(threads, config=config),
                                    providers=providers)

    def _open_prompt(self, prompt_file, session) -> None:
        spec = self.io.get("prompt")
        if spec is None:
            raise ValueError(f"{self.dir}/io.json describes no prompt graph (export with a prompt_tokens)")
        self._prompt = session or self._open(prompt_file)
        self.prompt_tokens = T = int(spec["tokens"])
        shapes = {i["name"]: i["shape"] for i in spec["inputs"]}
        self._p_pos = np.zeros((T,), dtype=np.int64)
        if self._embed is None:
            self._p_in = ("input_ids", np.zeros((1, T), dtype=np.int64))
        else:
            name = self.io["embedding"]["output"]
            self._p_in = (name, np.zeros(shapes[name], dtype=np.float32))
        self._p_feed = {self._p_in[0]: self._p_in[1], "position": self._p_pos}
        self._p_feed.update((k, v) for k, v in self.feed.items() if k.startswith("past_"))
        self._p_outputs = [o["name"] for o in spec["outputs"]]

    @property
    def batched_prefill(self) -> bool:
        return self._prompt is not None

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Through the prompt graph, `prompt_tokens` a call (the last chunk padded in front), or token by
        token without one."""
        if self._prompt is None:
            return super().prefill(token_ids)
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("prefill needs at least one token")
        if self.position + len(ids) > self.context_length:
            raise ContextFull(f"a prompt of {len(ids)} tokens at position {self.position} passes the exported "
                              f"context_length {self.context_length}")
        T = self.prompt_tokens
        for i in range(0, len(ids), T):
            logits = self._prompt_chunk(ids[i:i + T])
        return logits

    def _fill_prompt(self, chunk: list[int]) -> int:
        """The prompt graph's feed for `chunk` at the current position (rows, positions, masks); its padding."""
        T, n, p = self.prompt_tokens, len(chunk), self.position
        if not 1 <= n <= T:
            raise ValueError(f"a chunk of {n} tokens for a prompt graph of {T}")
        pad = T - n
        name, rows = self._p_in
        rows.fill(0)
        if self._embed is None:
            rows[0, pad:] = chunk
        else:
            for r, t in enumerate(chunk):
                rows[0, pad + r] = self._embed(t).reshape(rows.shape[2:])
        self._p_pos.fill(p)
        self._p_pos[pad:] = np.arange(p, p + n)
        self._p_feed.update(prompt_masks(p, n, T, self.io["prompt"]["masks"], float(self.io["mask_value"])))
        return pad

    def next_prompt_inputs(self, chunk: Sequence[int]) -> dict[str, np.ndarray]:
        """A copy of the inputs the prompt graph gets for `chunk` next (a calibration sample)."""
        self._fill_prompt([int(t) for t in chunk])
        return {k: v.copy() for k, v in self._p_feed.items()}

    def _prompt_chunk(self, chunk: list[int]) -> np.ndarray:
        n, p = len(chunk), self.position
        pad = self._fill_prompt(chunk)
        res = self._prompt.run(self._p_outputs, self._p_feed)
        self.calls["prompt"] += 1
        for j, (k, v, ring) in enumerate(self._caches):
            new_k, new_v = res[1 + 2 * j][:, :, pad:, :], res[2 + 2 * j][:, :, pad:, :]
            if ring:  # only the last `ring` rows survive in a ring: distinct slots
                m = min(n, ring)
                slots = np.arange(p + n - m, p + n) % ring
                k[:, :, slots, :] = new_k[:, :, n - m:, :]
                v[:, :, slots, :] = new_v[:, :, n - m:, :]
            else:
                k[:, :, p:p + n, :] = new_k
                v[:, :, p:p + n, :] = new_v
        self.position = p + n
        return res[0].reshape(-1)

    def kv_bytes(self) -> int:
        """Its preallocated numpy K/V, every layer."""
        return int(sum(k.nbytes + v.nbytes for k, v, _ in self._caches))

    def reset(self) -> None:
        for k, v, _ in self._caches:
            k.fill(0.0)
            v.fill(0.0)
        self.position = 0

    def next_inputs(self, token_id: int) -> dict[str, np.ndarray]:
        """A copy of the inputs the next step(token_id) will feed (a calibration sample)."""
        feed = {k: v.copy() for k, v in self.feed.items()}
        if self._embed is None:
            feed["input_ids"][0, 0] = token_id
        else:
            feed[self.io["embedding"]["output"]].reshape(-1)[:] = self._embed(token_id)
        feed["position"][0] = self.position
        return feed

    def step(self, token_id: int) -> np.ndarray:
        if self.session is None:
            raise ValueError(f"{self.dir}: opened without its token graph (model_file=None): prefill only")
        p = self.position
        if p >= self.context_length:
            raise ContextFull(f"position {p} is past the exported context_length {self.context_length}; "
                              "reset() or export with a larger export.context_length")
        self._ids[0, 0] = token_id
        if self._embed is not None:
            self._embeds.reshape(-1)[:] = self._embed(token_id)
        self._pos[0] = p
        res = self.session.run(self.output_names + self.extra_names, self.feed)
        self.calls["token"] += 1
        self.extra = dict(zip(self.extra_names, res[len(self.output_names):]))
        for j, (k, v, ring) in enumerate(self._caches):
            slot = p % ring if ring else p  # p >= 0: Python's % is non-negative anyway
            k[:, :, slot, :] = res[1 + 2 * j][:, :, 0, :]
            v[:, :, slot, :] = res[2 + 2 * j][:, :, 0, :]
        self.position = p + 1
        return res[0].reshape(-1)
