"""llama.cpp as a runtime: a GGUF file decoded through llama-cpp-python (an optional
extra, imported only when a decoder is made). Building the GGUF is
pipeline/toolchains/llamacpp.py."""

from __future__ import annotations

from pipeline.runtimes.contract import Runtime


class LlamaCppDecoder(Runtime):
    """reset/step/prefill over llama_cpp.Llama, the same API as OnnxDecoder.

    n_ctx and threads explicit; use_mmap off, so the weights are read into the
    process and count as resident like the other arms' (no page-cache sharing
    that would make the arm look smaller than it is).
    """

    def __init__(self, gguf: str, threads: int, n_ctx: int):
        import llama_cpp

        if n_ctx < 1:
            raise ValueError("LlamaCppDecoder needs an explicit n_ctx")
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=int(n_ctx), n_batch=int(n_ctx), n_threads=int(threads),
            n_threads_batch=int(threads), use_mmap=False, logits_all=False, verbose=False,
        )
        self.n_ctx = int(n_ctx)
        self.vocab_size = int(self.llm.n_vocab())

    def reset(self) -> None:
        self.llm.reset()

    def _eval(self, ids):
        """The last token's logits, read from the context (llama_get_logits_ith(ctx,
        -1)), which logits_all=False does compute. Not `Llama.scores`: 0.3.36
        fills that only with logits_all=True and leaves it at zero otherwise
        (found by the GGUF fidelity work: every logit read that way was 0)."""
        import numpy as np

        self.llm.eval(list(ids))
        ptr = self.llm._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).astype(np.float32, copy=True)

    def step(self, token_id: int):
        return self._eval([int(token_id)])

    def prefill(self, token_ids):
        return self._eval([int(t) for t in token_ids])

    def kv_bytes(self) -> int:
        """f16 K and V for n_ctx positions, from the GGUF's own metadata (llama.cpp allocates n_ctx up front)."""
        md = self.llm.metadata or {}
        arch = md.get("general.architecture", "")

        def get(key, default=0):
            return int(md.get(f"{arch}.{key}", default) or default)

        layers = get("block_count")
        kv_heads = get("attention.head_count_kv", get("attention.head_count"))
        head_dim = get("attention.key_length", get("embedding_length") // max(get("attention.head_count", 1), 1))
        return 2 * layers * self.n_ctx * kv_heads * head_dim * 2
