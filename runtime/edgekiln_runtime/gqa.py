"""ONNX Runtime running the GQA graph (pipeline/graphs/gqa_graph.py builds it; a build's pack folder
holds it): IO binding, the KV buffers bound as past and present, a batched prefill. Needs onnxruntime
and numpy only."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from edgekiln_runtime.contract import ContextFull, Runtime
from edgekiln_runtime.io import KV_NAMES, ROW_LOGITS_IO, read_io
from edgekiln_runtime.pages import anon_mappings, collapse_to_huge_pages, page_out_file, release_heap
from edgekiln_runtime.session import session_options


# A prefill of at least this many rows hands its freed workspace back to the kernel (pages.release_heap):
# decode steps' temporaries are small and reused, a long prefill's are not.
_TRIM_AFTER_ROWS = 64


class GqaDecoder(Runtime):
    """The runtime of a `build_gqa_graph` artifact; the API of the project's OnnxDecoder plus batched prefill.

    KV: one preallocated OrtValue (io.json's kv_dtype) per past/present pair, bound as both
    (GQA writes the new rows in place; a window_cache layer's buffer is W +
    slack rows and the op compacts it itself). Decode: input_ids / logits (and,
    in the edgekiln io_layout, seqlens_k / total_sequence_length) are
    numpy-backed OrtValues bound once; a step writes the token and runs. The
    genai io_layout's attention_mask [1, T] is a view of one preallocated row
    of max_len ones, bound at each call with its length (one bind, no copy).
    `step` and `prefill` return a copy of the logits (the bound buffer is
    overwritten by the next call). `verify` / `rewind` / `verify_room`: a
    speculative decoder's (edgekiln_runtime/speculative.py) check of a draft
    in one call, every row's logits, and the drop of the rows it rejects.

    Session: intra_op `threads`, inter_op 1, sequential, spinning on (ORT's
    default: decode measured 1.26x (~100M) to 1.43x (5M) faster than with
    spinning off at 2 threads),
    ORT_ENABLE_ALL. `huge_pages=True` collapses the session's memory into
    2 MiB pages after loading (edgekiln_runtime/pages.py; the deploy profile says
    whether it measured faster on the target). `page_out=True` (the default)
    pages out the mapped weights file once the session is built
    (pages.page_out_file): the prepacked weights are the session's own copies,
    and a tied model's table is resident only in the rows a gather has read.
    `memory_arena=False` (the default) turns ONNX Runtime's CPU arena off: with
    it the arena kept the 512-token prefill's workspace for good (Gemma 3 270M:
    576 MiB resident after a 512-token prompt, 503-531 without; decode and
    prefill the same within this host's noise).
    """

    def __init__(self, artifact_dir, threads: int = 1, *, spinning: bool | None = None, opt_level: str = "all",
                 profile: str | None = None, session_config: dict | None = None, huge_pages: bool = False,
                 page_out: bool = True, memory_arena: bool = False):
        import onnxruntime as ort

        maps_before = anon_mappings() if huge_pages else {}
        self._ort = ort
        self.dir = Path(artifact_dir)
        self.io = read_io(self.dir)
        so = session_options(threads, spinning=spinning, opt_level=opt_level, profile=profile, config=session_config)
        so.enable_cpu_mem_arena = bool(memory_arena)
        # errors only: ONNX Runtime warns at every load that the graph's logits_rows initializer is also an
        # input, which is how the graph gives the speculative decoder's input its default (gqa_graph._last_rows)
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(self.dir / "model.onnx"), sess_options=so,
                                            providers=["CPUExecutionProvider"])
        self.max_len = self.context_length = int(self.io["max_len"])
        self.vocab_size = int(self.io["vocab_size"])
        self.n_layers = int(self.io["n_layers"])
        # io.json before io_layout: the edgekiln layout
        self.io_layout = self.io.get("io_layout", "edgekiln")
        self._names = self.io.get("kv_names") or KV_NAMES["edgekiln"]
        self._mask = np.ones((1, self.max_len), np.int64) if self.io_layout == "genai" else None
        logits_shape = next(v["shape"] for v in self.io["outputs"] if v["name"] == "logits")
        self._logits_shape = tuple(int(d) for d in logits_shape)  # [1, V] or genai's [1, 1, V]
        self._kv = []
        self.kv_dtype = np.dtype(self.io.get("kv_dtype", "float32"))  # io.json before kv_dtype: fp32
        for layer in self.io["layers"]:
            shape = (1, int(self.io["n_kv_heads"]), int(layer["cache_len"]), int(self.io["head_dim"]))
            self._kv.append((ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype),
                             ort.OrtValue.ortvalue_from_shape_and_type(shape, self.kv_dtype)))
        # Decode-step buffers (numpy memory shared with the bound OrtValues).
        self._ids = np.zeros((1, 1), np.int64)
        self._seqlens = np.zeros((1,), np.int32)
        self._total = np.zeros((), np.int32)
        self._logits = np.zeros(self._logits_shape, np.float32)
        self._step_binding, self._step_values = self._binding(self._ids, self._seqlens, self._total, self._logits)
        self.position = 0
        self._rewindable = 0  # rows of the last verify that rewind may drop
        # (C, W) of each window buffer (verify_room)
        self._windows = sorted({(int(x["cache_len"]), int(x["local_window_size"])) for x in self.io["layers"]
                                if x.get("window_cache")})
        data = self.dir / "model.onnx.data"
        self.paged_out_bytes = page_out_file(data) if page_out and data.is_file() else 0
        # Back the session's weights (and the KV) with 2 MiB pages (edgekiln_runtime/pages.py).
        self.huge_page_bytes = collapse_to_huge_pages(maps_before) if huge_pages else 0

    def _binding(self, ids, seqlens, total, logits):
        """(IOBinding, the OrtValues wrapping the numpy arrays: keep them alive while it is used)."""
        ort = self._ort
        b = self.session.io_binding()
        keep = []
        fed = [("input_ids", ids)] + ([] if self._mask is not None else
                                      [("seqlens_k", seqlens), ("total_sequence_length", total)])
        for name, arr in fed:
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            keep.append(v)
            b.bind_ortvalue_input(name, v)
        lv = ort.OrtValue.ortvalue_from_numpy(logits)
        keep.append(lv)
        b.bind_ortvalue_output("logits", lv)
        n = self._names
        for i, (k, v) in enumerate(self._kv):
            b.bind_ortvalue_input(n["past_key"] % i, k)
            b.bind_ortvalue_input(n["past_value"] % i, v)
            b.bind_ortvalue_output(n["present_key"] % i, k)
            b.bind_ortvalue_output(n["present_value"] % i, v)
        return b, keep

    def _bind_mask(self, b, total: int) -> None:
        """genai's layout: attention_mask [1, total], the first `total` of the ones row (no copy)."""
        if self._mask is not None:
            b.bind_input("attention_mask", "cpu", 0, np.int64, [1, total], self._mask.ctypes.data)

    def reset(self) -> None:
        # GQA never reads rows at or past seqlens_k + 1, so stale K/V need not be cleared.
        self.position = 0
        self._rewindable = 0

    def _check(self, n: int) -> None:
        if self.position + n > self.max_len:
            raise ContextFull(f"position {self.position} + {n} token(s) is past the graph's max_len "
                              f"{self.max_len}; reset() or build with a larger max_len")

    def step(self, token_id: int) -> np.ndarray:
        self._check(1)
        p = self.position
        self._ids[0, 0] = token_id
        self._seqlens[0] = p
        self._total[()] = p + 1
        self._bind_mask(self._step_binding, p + 1)
        self.session.run_with_iobinding(self._step_binding)
        self.position = p + 1
        self._rewindable = 0
        return self._logits.reshape(-1).copy()

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """All of `token_ids` in one run (S = len); logits of the last one."""
        ids = np.asarray([list(token_ids)], dtype=np.int64)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("prefill needs at least one token")
        if n == 1:
            return self.step(int(ids[0, 0]))
        self._check(n)
        p = self.position
        seqlens = np.asarray([p + n - 1], np.int32)
        total = np.asarray(p + n, np.int32)
        logits = np.zeros(self._logits_shape, np.float32)
        b, _keep = self._binding(ids, seqlens, total, logits)
        self._bind_mask(b, p + n)
        self.session.run_with_iobinding(b)
        self.position = p + n
        self._rewindable = 0
        if n >= _TRIM_AFTER_ROWS:
            release_heap()  # the prefill's freed workspace leaves the resident set (pages.release_heap)
        return logits.reshape(-1)

    def rewind_refusal(self) -> str | None:
        """Why `verify` / `rewind` (a speculative decoder's) cannot run on this graph; None where they can."""
        if self.io.get("row_logits") is None:
            return "its graph has no row_logits output (built before speculative decoding): rebuild the pack stage"
        return None

    def verify_room(self) -> int:
        """The most rows `verify` may write now: what the graph still holds, and, with window buffers, what
        keeps every rewind of it exact.

        A sliding layer's window buffer (C = W + slack rows, GQA sliding_window_cache) is laid out by the
        stream's length L alone: positions from start(L) on, from slot 0, where start(L) = 0 up to L = C,
        then L - W - ((L - C - 1) mod (slack + 1)): the op keeps the last W rows and compacts again every
        slack + 1 positions (measured on ONNX Runtime 1.32, stepping and in chunks; tests/test_speculative.py
        pins it). A rewind from L1 back to L0 is exact while start(L0) = start(L1); across a compaction the
        rows it moved out are gone. So a verify at position p writes at most up to the end of the epoch
        that holds p + 1 (its first row, always kept)."""
        p = self.position
        room = self.max_len - p
        for c, w in self._windows:
            first = p + 1
            if first <= c:
                end = c
            else:
                span = c - w + 1  # slack + 1
                end = c + ((first - c - 1) // span + 1) * span
            room = min(room, end - p)
        return room

    def verify(self, token_ids: Sequence[int]) -> np.ndarray:
        """Run `token_ids` (1 <= n <= verify_room()) on top of the cache in one call and return every row's
        logits [n, V]: row i is the logits after token_ids[i], what `step` would return up to how a
        multi-row call rounds (at accuracy_level 4 MatMulNBits quantizes its activations otherwise than a
        step's: benchmarks/speculative.py). A speculative decoder's check of its draft; `rewind` then drops
        the rows it rejects."""
        ids = np.asarray([list(token_ids)], dtype=np.int64)
        n = ids.shape[1]
        why = self.rewind_refusal()
        if why:
            raise ValueError(f"{self.dir}: cannot verify a draft: {why}")
        if not 1 <= n <= self.verify_room():
            self._check(n)
            raise ValueError(f"verify of {n} rows at position {self.position}: at most {self.verify_room()} "
                             "keep a rewind exact here (verify_room)")
        p = self.position
        seqlens = np.asarray([p + n - 1], np.int32)
        total = np.asarray(p + n, np.int32)
        rows = np.zeros((1, n, self.vocab_size), np.float32)
        b, keep = self._binding(ids, seqlens, total, np.zeros(self._logits_shape, np.float32))
        r = self._ort.OrtValue.ortvalue_from_numpy(np.asarray(n, np.int64))
        rv = self._ort.OrtValue.ortvalue_from_numpy(rows)
        keep += [r, rv]
        b.bind_ortvalue_input(ROW_LOGITS_IO["input"], r)
        b.bind_ortvalue_output(ROW_LOGITS_IO["output"], rv)
        self._bind_mask(b, p + n)
        self.session.run_with_iobinding(b)
        self.position = p + n
        self._rewindable = n - 1
        return rows[0]

    def rewind(self, n: int) -> None:
        """Drop the last `n` rows of the last `verify` (its rejected draft; n < the rows it ran): GQA reads
        only rows below the length it is given, so the stale rows are overwritten, never read."""
        if not 0 <= n <= self._rewindable:
            raise ValueError(f"rewind {n}: only the last verify's rows but its first can be dropped "
                             f"({self._rewindable} now)")
        self.position -= n
        self._rewindable = 0

    def kv_bytes(self) -> int:
        return int(sum(self.kv_dtype.itemsize * (np.prod(k.shape()) + np.prod(v.shape())) for k, v in self._kv))

    def end_profiling(self) -> str:
        return self.session.end_profiling()
