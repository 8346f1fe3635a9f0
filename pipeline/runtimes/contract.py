"""The one contract every runtime of a built artifact implements.

A runtime is made from an artifact (its constructor: the artifact's folder or file,
the threads, the context where the runtime needs one) and then decodes one stream:

    reset()                 forget the stream (position 0)
    prefill(token_ids)      feed a prompt; the logits after its last token (batched_prefill: in one call)
    step(token_id)          feed one token; the logits after it (float32 [vocab])
    kv_bytes()              bytes its KV cache holds (0 where it cannot say)
    resident_bytes()        this process's resident memory now (counted pages, not allocations)
    generate_greedy(ids, n) reset, prompt, then n greedy tokens

Parity (stages/verify_parity.py), the benchmark's arms (pipeline/measure/bench_arm.py),
deploy_profile's settings sweeps (pipeline/measure/tune.py) and `python -m pipeline
generate` use runtimes only through it. The runtimes: OnnxDecoder (the fp32 ONNX step
and QDQ graphs on ONNX Runtime; the QNN HTP binary through its session,
pipeline/graphs/qnn.py), GqaDecoder (the ORT GQA graph), TorchReference (eager PyTorch,
the reference), tinygemm (an HF model with tinygemm linears, wrapped by TorchReference),
LlamaCppDecoder (llama.cpp), GenaiDecoder (onnxruntime-genai).
"""

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
    from pipeline.runtimes.pages import smaps_rollup_mib

    return int(smaps_rollup_mib().get("Rss", 0.0) * 2**20)
