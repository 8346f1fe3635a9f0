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


class OnnxDecoder(Runtime):
    """Runs an exported decode step with onnxruntime; numpy caches, slot writes per io.json."""

    def __init__(self, artifact_dir, threads: int = 1, providers: Iterable = ("CPUExecutionProvider",), *,
                 model_file: str = "model.onnx", session=None, embed=None, extra_outputs: Sequence[str] = (),
                 config: dict | None = None):
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
        for the graph's session (pipeline/graphs/qnn.py's CPU stand-in of a QDQ graph)."""
        import onnxruntime as ort

        self.dir = Path(artifact_dir)
        self.io = json.loads((self.dir / "io.json").read_text())
        self.session = session or ort.InferenceSession(str(self.dir / model_file),
                                                       sess_options=session_options(threads, config=config),
                                                       providers=list(providers))
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
        p = self.position
        if p >= self.context_length:
            raise ContextFull(f"position {p} is past the exported context_length {self.context_length}; "
                              "reset() or export with a larger export.context_length")
        self._ids[0, 0] = token_id
        if self._embed is not None:
            self._embeds.reshape(-1)[:] = self._embed(token_id)
        self._pos[0] = p
        res = self.session.run(self.output_names + self.extra_names, self.feed)
        self.extra = dict(zip(self.extra_names, res[len(self.output_names):]))
        for j, (k, v, ring) in enumerate(self._caches):
            slot = p % ring if ring else p  # p >= 0: Python's % is non-negative anyway
            k[:, :, slot, :] = res[1 + 2 * j][:, :, 0, :]
            v[:, :, slot, :] = res[2 + 2 * j][:, :, 0, :]
        self.position = p + 1
        return res[0].reshape(-1)
