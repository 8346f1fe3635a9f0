"""Greedy speculative decoding with prompt-lookup drafts: no draft model.

A draft is what followed the latest earlier occurrence of the context's last n tokens (n from
`max_ngram` down to `min_ngram`), up to `draft_max` tokens; the model checks the token it just chose and
the draft in one call (GqaDecoder.verify: every row's logits) and keeps the draft's longest prefix that
equals its own greedy choices, plus its own next token. The output is greedy decoding's token for token
(but where a near-tie falls the other way because a multi-row call rounds otherwise: see `generate`): a
draft only decides how many positions one call covers. It pays where the output copies the input
(editing or continuing code that is in the prompt, quoting a given text) or a small model repeats
itself; where drafts fail, a verify is a step that also wrote rows that are then dropped, which the
adaptive draft length keeps short.

Why by hand: onnxruntime has no decode loop, and onnxruntime-genai 0.18's n-gram mode needs every row's
logits, which the graph prunes for prefill (docs/devices.md). The n-gram table is a dict per n, updated
as tokens arrive, so a lookup is O(max_ngram), not a scan of the context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

# The defaults: drafts of up to 8 tokens, matched on the last 3 or 2 tokens (a single token matches too
# often on free text, where its drafts are mostly rejected), their length adaptive. benchmarks/speculative.py
# measured them (docs/results.md): fixed-length drafts lost up to 30% on SmolLM2's free text where adaptive
# ones were level, and gained up to 15% more on Gemma 3 270M, whose extra verify rows cost less.
DRAFT_MAX = 8
MAX_NGRAM = 3
MIN_NGRAM = 2
ADAPTIVE = True


class NgramDrafter:
    """Prompt-lookup drafting over a growing token list."""

    def __init__(self, draft_max: int = DRAFT_MAX, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram or draft_max < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and draft_max >= 1, got {min_ngram}, "
                             f"{max_ngram}, {draft_max}")
        self.draft_max, self.max_ngram, self.min_ngram = draft_max, max_ngram, min_ngram
        self.tokens: list[int] = []
        self._after: dict[int, dict[tuple, int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0  # tokens whose n-grams ending at them are in the table

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def _index_until(self, end: int) -> None:
        """Record, for every n-gram ending before `end`, the position after it (a later one overwrites)."""
        toks = self.tokens
        for i in range(self._indexed, end):
            for n, table in self._after.items():
                if i + 1 >= n:
                    table[tuple(toks[i + 1 - n:i + 1])] = i + 1
        self._indexed = max(self._indexed, end)

    def draft(self, limit: int | None = None) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix; [] if none."""
        toks = self.tokens
        k = self.draft_max if limit is None else min(self.draft_max, limit)
        if k < 1 or not toks:
            return []
        self._index_until(len(toks) - 1)  # the suffix itself is not an earlier occurrence
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(toks) < n:
                continue
            j = self._after[n].get(tuple(toks[-n:]))
            if j is not None:
                return toks[j:j + k]
        return []


@dataclass
class SpecStats:
    calls: int = 0          # model calls after the prefill (steps and verifies)
    verifies: int = 0       # of which checked a draft
    drafted: int = 0        # draft tokens proposed
    accepted: int = 0       # draft tokens kept
    decode_s: float = 0.0   # time after the prefill
    tokens: list = field(default_factory=list)

    @property
    def accept_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_call(self) -> float | None:
        return (len(self.tokens) - 1) / self.calls if self.calls else None


def generate(dec, prompt_ids: Sequence[int], n: int, eos: Sequence[int] = (), *, draft_max: int = DRAFT_MAX,
             max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM, adaptive: bool = ADAPTIVE,
             on_token=None) -> SpecStats:
    """Up to `n` greedy tokens after `prompt_ids` on `dec` (a GqaDecoder: prefill, step, verify, rewind),
    stopping at an `eos` token (kept) or the graph's last position. `on_token(token)` is called for each
    token as it is decided. The tokens are greedy decoding's over the graph's multi-row arithmetic
    (tests/test_speculative.py checks them against plain greedy decoding; benchmarks/speculative.py says
    where ONNX Runtime's int8 activations round a near-tie otherwise in a multi-row call than in a step).

    `adaptive`: the next draft's length follows the last one's fate (halved after a draft with nothing
    kept, doubled after one kept whole, one past what was kept otherwise), so text where drafts fail
    costs short verifies; else every draft is up to `draft_max` long."""
    why = dec.rewind_refusal()
    if why:
        raise ValueError(f"speculative decoding: {why}")
    stop = {int(t) for t in eos}
    drafter = NgramDrafter(draft_max, max_ngram, min_ngram)
    drafter.extend(prompt_ids)
    st = SpecStats()
    dec.reset()
    logits = dec.prefill(prompt_ids)
    t0 = time.perf_counter()
    nxt = int(np.argmax(logits))
    out = st.tokens

    def take(token: int) -> bool:
        """Emit `token`; True when generation stops there."""
        out.append(token)
        drafter.extend([token])
        if on_token is not None:
            on_token(token)
        return token in stop or len(out) >= n

    want = draft_max
    while not take(nxt):
        if dec.position >= dec.max_len:
            break
        room = dec.verify_room()  # rows a verify may write (window buffers: see GqaDecoder.verify_room)
        draft = drafter.draft(min(room - 1, n - len(out), want))
        st.calls += 1
        if not draft:
            nxt = int(np.argmax(dec.step(nxt)))
            continue
        rows = dec.verify([nxt] + draft)
        st.verifies += 1
        st.drafted += len(draft)
        choice = rows.argmax(axis=-1)  # choice[i]: greedy's token after [nxt] + draft[:i]
        a = 0
        while a < len(draft) and int(choice[a]) == draft[a]:
            a += 1
        dec.rewind(len(draft) - a)  # the rows of the rejected draft tokens
        st.accepted += a
        if adaptive:
            want = (max(1, want // 2) if a == 0 else min(draft_max, 2 * want) if a == len(draft)
                    else min(draft_max, a + 1))
        if any(take(t) for t in draft[:a]):
            break
        nxt = int(choice[a])
    st.decode_s = time.perf_counter() - t0
    return st
