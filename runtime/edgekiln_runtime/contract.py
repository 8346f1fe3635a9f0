"""What a runtime of a built artifact does (the project's contract, pipeline/runtimes/contract.py,
documents it): decode one stream, greedy generation, resident memory. It lives in this package so that
the device-side runtime (GqaDecoder) installs without the build toolchain; the project's other
runtimes (OnnxDecoder, TorchReference, llama.cpp, onnxruntime-genai) derive from the same class."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ContextFull(RuntimeError):
    """A step past the exported context length."""


class Runtime:
    """The contract's shared part: greedy generation and a prompt fed token by token, for
    runtimes without a batched prefill of their own."""

    def reset(self) -> None:
        raise NotImplementedError

    def step(self, token_id: int) -> np.ndarray:
        raise NotImplementedError

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Token by token through `step`; a runtime with a batched prefill overrides it."""
        logits = None
        for t in token_ids:
            logits = self.step(int(t))
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits

    @property
    def batched_prefill(self) -> bool:
        """Does `prefill` run the prompt in one call (the runtime's own) or step by step (this base's)?"""
        return type(self).prefill is not Runtime.prefill

    def decode_greedy(self, n: int, logits: np.ndarray) -> None:
        """`n` greedy tokens after a prefill whose logits are `logits` (the benchmark's decode
        loop; a runtime with a loop of its own, onnxruntime-genai's, runs that instead)."""
        token = int(np.argmax(logits))
        for _ in range(n):
            token = int(np.argmax(self.step(token)))

    def kv_bytes(self) -> int:
        return 0

    def resident_bytes(self) -> int:
        return resident_bytes()

    def generate_greedy(self, prompt_ids: Sequence[int], n: int, prefilled: bool = False) -> list[int]:
        """Reset, feed the prompt, then `n` greedy tokens; returns those n tokens. The prompt goes a token
        at a time (the parity stage's order), or with `prefilled` in one `prefill` call (onnxruntime-genai's
        order: a batched prefill rounds differently, so near-ties can fall the other way)."""
        if not len(prompt_ids):
            raise ValueError("generate_greedy needs at least one prompt token")
        self.reset()
        logits = self.prefill(prompt_ids) if prefilled else None
        for t in ([] if prefilled else prompt_ids):
            logits = self.step(int(t))
        out = []
        for k in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            if k + 1 < n:
                logits = self.step(tok)
        return out


def resident_bytes() -> int:
    """This process's resident set (smaps_rollup's Rss: pages in memory, not allocations), in bytes."""
    from edgekiln_runtime.pages import smaps_rollup_mib

    return int(smaps_rollup_mib().get("Rss", 0.0) * 2**20)
