"""The reference: the eager HF model (fp32) decoding with its own cache, and its greedy
runs kept as hidden states (the parity teacher)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from pipeline.graphs.decode_graph import DecodeGraphError, _text_config
from pipeline.runtimes.contract import Runtime
from pipeline.sources.checkpoint_files import load_hf_model


class TorchReference(Runtime):
    """The eager HF model (fp32) decoding token by token with its own cache."""

    def __init__(self, model_or_dir, threads: int | None = None, attn_implementation: str | None = "eager"):
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        if isinstance(model_or_dir, (str, Path)):
            self.model = load_hf_model(model_or_dir, attn_implementation)
        else:
            self.model = model_or_dir.eval()
        self.config = _text_config(self.model.config)
        self.vocab_size = self.config.vocab_size
        self._head_checked = False
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self.position = 0

    def kv_bytes(self) -> int:
        """What its DynamicCache holds now (grown as it decodes)."""
        total = 0
        for layer in getattr(self.cache, "layers", None) or ():
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is not None and hasattr(t, "numel"):
                    total += t.numel() * t.element_size()
        return int(total)

    def step(self, token_id: int) -> np.ndarray:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[int(token_id)]], dtype=torch.long),
                             position_ids=torch.tensor([[self.position]], dtype=torch.long),
                             past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.position += 1
        return out.logits[0, -1].to(torch.float32).numpy()

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """The whole prompt in one forward (batched prefill); logits of its last token."""
        import torch

        ids = [int(t) for t in token_ids]
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long),
                             position_ids=torch.arange(self.position, self.position + len(ids)).unsqueeze(0),
                             past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.position += len(ids)
        return out.logits[0, -1].to(torch.float32).numpy()

    def head(self, hidden) -> np.ndarray:
        """Logits float32 [n, vocab] of final hidden states [n, hidden] (after the final norm), as
        the HF forward computes them from its last_hidden_state (transformers 5.x *ForCausalLM,
        Gemma3ForCausalLM included): lm_head, then final_logit_softcapping when the config has
        one, in HF's order (divide, tanh, multiply). `greedy_run` checks this against the model's
        own logits once, so a head this does not reproduce is refused rather than mis-measured."""
        return _head_of(self.model, self.config)(hidden)

    def _hidden(self, token_ids: Sequence[int]):
        """Final hidden states [len(ids), hidden] of `token_ids` fed at the current position, with the cache."""
        import torch

        base = getattr(self.model, "model", None)
        if base is None or not hasattr(self.model, "lm_head"):
            raise DecodeGraphError(f"{type(self.model).__name__}: expected a *ForCausalLM with .model and .lm_head")
        ids = [int(t) for t in token_ids]
        with torch.inference_mode():
            out = base(input_ids=torch.tensor([ids], dtype=torch.long),
                       position_ids=torch.arange(self.position, self.position + len(ids)).unsqueeze(0),
                       past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.position += len(ids)
        return out.last_hidden_state[0]

    def _check_head(self, token_id: int) -> None:
        import torch

        if self._head_checked:
            return
        self.reset()
        with torch.inference_mode():
            want = self.model(input_ids=torch.tensor([[int(token_id)]], dtype=torch.long),
                              position_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False).logits[0, -1]
        want = want.to(torch.float32).numpy()
        self.reset()
        got = self.head(self._hidden([token_id]))[0]
        self.reset()
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max()))):
            raise DecodeGraphError(f"{type(self.model).__name__}: its logits are not lm_head(final hidden state) "
                                   "[/ logits_scaling, + final_logit_softcapping]; the parity reference cannot recompute them")
        self._head_checked = True

    def greedy_run(self, prompt_ids: Sequence[int], n: int,
                   progress: Callable[[int], Any] | None = None) -> "ReferenceRun":
        """Reset, the prompt in one forward, then `n` greedy tokens one cached step at a time.

        Keeps each fed token's final hidden state ([len(prompt) + n, hidden]: the last greedy
        token is fed too, so a decoder fed prompt + continuation has a reference row at every
        step), never a step's logits: at a 262,144-token vocabulary those are 1 MiB a step in
        fp32, [steps, hidden] is 640 floats. Each step's argmax is taken from `head` of its state,
        the same numbers `step` returns; `progress(k)` is told of every k tokens fed."""
        import torch

        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("greedy_run needs at least one prompt token")
        self._check_head(ids[0])
        self.reset()
        states = [self._hidden(ids)]
        if progress:
            progress(len(ids))
        cont = []
        for _ in range(n):
            tok = int(np.argmax(self.head(states[-1][-1:])[0]))
            cont.append(tok)
            states.append(self._hidden([tok]))
            if progress:
                progress(1)
        # the run keeps the head alone, not this reference: once the runs are made the model can go
        # (the parity stage drops it before loading the artifact's own model beside them)
        return ReferenceRun(ids, cont, torch.cat(states),
                            _head_of(self.model, self.config))


def _head_of(model, config) -> "_Head":
    """The head as the family's forward applies it: Granite divides by logits_scaling
    (pipeline/sources/families.py), Gemma softcaps."""
    from pipeline.sources import families

    cfg = getattr(config, "text_config", None) or config
    return _Head(model.lm_head, getattr(cfg, "final_logit_softcapping", None),
                 families.multipliers(cfg).get("logits_scaling"))


class _Head:
    """lm_head, then Granite's logits_scaling, then the final softcap (TorchReference.head), holding the
    head's module only."""

    def __init__(self, lm_head, cap, scaling=None):
        self.lm_head, self.cap, self.scaling = lm_head, cap, scaling

    def __call__(self, hidden) -> np.ndarray:
        import torch

        with torch.inference_mode():
            logits = self.lm_head(hidden)
            if self.scaling is not None:
                logits = logits / self.scaling
            if self.cap is not None:
                logits = logits / self.cap
                logits = torch.tanh(logits)
                logits = logits * self.cap
        return logits.to(torch.float32).numpy()


class ReferenceRun:
    """A reference's greedy run of one prompt in O(steps x hidden): the prompt, its greedy
    continuation, and the final hidden state after each fed token; `logits(start, stop)`
    recomputes those steps' logits (float64) when they are compared."""

    def __init__(self, prompt: Sequence[int], continuation: Sequence[int], hidden, head: Callable):
        if len(hidden) != len(prompt) + len(continuation):
            raise ValueError(f"{len(hidden)} hidden states for {len(prompt)} + {len(continuation)} tokens")
        self.prompt = list(prompt)
        self.continuation = list(continuation)
        self.hidden = hidden
        self.head = head

    @property
    def steps(self) -> int:
        return len(self.hidden)

    def logits(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.head(self.hidden[start:stop]), dtype=np.float64)
