"""onnxruntime-genai as a baseline arm: the peer a CPU user would pick instead.

Its model builder makes an int4 CPU model from the same untied checkpoint
(round-to-nearest, symmetric, block 32, MatMulNBits at the accuracy level
given, attention as GroupQueryAttention); its own C++ generator runs it. An
optional component (`pip install -e '.[peers]'`): when it is absent, or its
builder cannot read the model's config, the arm is skipped and the reason is
reported, never replaced by another figure.

Its builder (0.18, with transformers 5) sometimes wires the head to the
wrong tensor: on the small test Qwen3 models here (1-2 layers, hidden 128)
the logits MatMul read the last layer's post-attention norm, skipping that
layer's MLP and the final norm (its fp32 build disagreed with the HF model at
the very first token; with the one edge rewired it agrees to 128 dB); the
8-layer ~100M Qwen3 was wired right. `repair_head` rewires exactly that edge
where it is wrong and says so, so the baseline is the model its builder meant
to build, doing the same work as ours.

Two ways to drive it, both its public API:
- `prefill(ids)` / `step(token)`: append tokens and read the logits (what the
  parity comparison needs: teacher-forced logits against the fp32 reference);
- `decode_greedy(n)`: its own greedy loop (`generate_next_token`), which is
  what its users run and what the speed figures time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.runtimes.contract import Runtime


class GenaiUnavailable(RuntimeError):
    """One line: why the onnxruntime-genai arm cannot run."""


def available() -> tuple[bool, str]:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        return False, f"not installed ({e.name or e}); pip install -e '.[peers]' adds it"
    return True, ""


# The release the genai route is checked with (the `peers` extra pins the same; tests/test_genai_artifact.py
# installs it alone and runs a build's folder through it).
CHECKED = "onnxruntime-genai==0.18.0"


def version() -> str:
    import onnxruntime_genai as og

    return og.__version__


def build_int4(hf_dir: Path, out_dir: Path, accuracy_level: int = 4, timeout: int = 1800) -> Path:
    """Its model builder on a local checkpoint; GenaiUnavailable with the builder's
    own last error line when it cannot build this model."""
    out_dir = Path(out_dir)
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out_dir),
           "-p", "int4", "-e", "cpu", "-c", str(out_dir / "_cache"),
           "--extra_options", f"accuracy_level={int(accuracy_level)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0 or not (out_dir / "genai_config.json").is_file():
        lines = [l.strip() for l in (proc.stderr or proc.stdout).splitlines() if l.strip()]
        last = lines[-1] if lines else f"exit code {proc.returncode}"
        raise GenaiUnavailable(f"onnxruntime-genai {version()}: its model builder "
                               f"cannot build this checkpoint ({last[:300]})")
    return out_dir


def repair_head(out_dir: Path) -> str | None:
    """Rewire the logits MatMul to the final norm's output where the builder
    fed it something else; the note saying what was changed, or None."""
    import onnx

    path = Path(out_dir) / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)  # the weights file is left as it is
    head = [n for n in model.graph.node if "logits" in n.output]
    final = [n for n in model.graph.node if "final_norm" in n.name]
    if len(head) != 1 or len(final) != 1:
        raise GenaiUnavailable(f"onnxruntime-genai: cannot find its head and final norm in {path} "
                               f"({len(head)} logits nodes, {len(final)} final norms)")
    want = final[0].output[0]
    if head[0].input[0] == want:
        return None
    was = head[0].input[0]
    head[0].input[0] = want
    onnx.save(model, str(path))
    return (f"onnxruntime-genai {version()} builder fed its head {was!r} instead of the final norm; "
            f"rewired to {want!r} (otherwise the last MLP and the final norm are skipped)")


class GenaiDecoder(Runtime):
    """Same API as the other decoders (reset/prefill/step/kv_bytes), plus
    `decode_greedy(n)`, the generator's own loop."""

    def __init__(self, model_dir, threads: int, n_ctx: int):
        import onnxruntime_genai as og

        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "genai_config.json").read_text())
        # The threads as an overlay on genai's own reading of the folder: the folder is never written
        # (it may be a build's pack output, or a device's installed version, hashed into its manifest).
        config = og.Config(str(model_dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": int(threads), "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        self.n_ctx = int(n_ctx) if n_ctx else int(cfg["model"]["context_length"])
        self._og = og
        self.vocab_size = int(cfg["model"]["vocab_size"])
        self._dec = cfg["model"]["decoder"]
        io = model_dir / "io.json"  # a pack folder of this project's (its KV: io.json's dtype, windowed layers smaller)
        self._io = json.loads(io.read_text()) if io.is_file() else None
        self.reset()

    def reset(self) -> None:
        params = self._og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.n_ctx, do_sample=False, past_present_share_buffer=True)
        self.gen = self._og.Generator(self.model, params)
        self.position = 0

    def _logits(self) -> np.ndarray:
        return np.asarray(self.gen.get_logits(), dtype=np.float32).reshape(-1, self.vocab_size)[-1]

    def prefill(self, token_ids) -> np.ndarray:
        ids = np.asarray([int(t) for t in token_ids], dtype=np.int32)
        self.gen.append_tokens(ids)
        self.position += len(ids)
        return self._logits()

    def step(self, token_id: int) -> np.ndarray:
        return self.prefill([token_id])

    def decode_greedy(self, n: int, logits=None) -> None:
        """n tokens by its own loop, after a prefill (the token picked from the
        prefill's logits is the first)."""
        for _ in range(n):
            self.gen.generate_next_token()
        self.position += n

    def kv_bytes(self) -> int:
        """Its KV buffers as allocated: past_present_share_buffer preallocates
        max_length per layer, fp32 on CPU (the builder's io dtype here); for this project's pack folder,
        the graph's buffers (io.json's kv_dtype), max_length rows on full layers and window + slack on windowed ones."""
        if self._io is not None:
            io = self._io
            rows = [min(int(layer["cache_len"]), self.n_ctx) for layer in io["layers"]]
            width = np.dtype(io.get("kv_dtype", "float16")).itemsize
            return int(2 * width * io["n_kv_heads"] * io["head_dim"] * sum(rows))
        d = self._dec
        return int(2 * d["num_hidden_layers"] * d["num_key_value_heads"] * d["head_size"] * self.n_ctx * 4)
