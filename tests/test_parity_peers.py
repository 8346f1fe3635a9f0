"""verify_parity's peers: llama.cpp's own Q4_0 / Q4_K_M and onnxruntime-genai's int4 build of the
same checkpoint, measured exactly as the artifact is (stages/verify_parity.py `_peers`)."""

from __future__ import annotations

from omegaconf import OmegaConf

from pipeline.toolchains import llamacpp

from pipeline.runtimes import ortgenai
from pipeline.engine.context import StageContext
from stages import verify_parity
from tests.conftest import needs_genai, save_tiny_qwen3

PROMPTS = [[1, 10, 11, 12, 13], [1, 40, 41, 42]]
DECODE = 6


def _peers(tmp_path):
    from pipeline.runtimes.reference import TorchReference

    hf = save_tiny_qwen3(tmp_path / "hf")
    ctx = StageContext(stage="verify_parity", build="t", cfg=OmegaConf.create({"export": {"context_length": 64}}),
                       inputs={}, out=tmp_path / "out")
    teacher = verify_parity._teacher(TorchReference(hf, threads=1), PROMPTS, DECODE, ctx)
    texts = [f"p{i}" for i in range(len(PROMPTS))]
    return verify_parity._peers(ctx, teacher, texts, PROMPTS, DECODE, hf)


def test_every_peer_that_cannot_run_says_why_in_place_of_its_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: (False, "llama-cpp-python not installed"))
    monkeypatch.setattr(ortgenai, "available", lambda: (False, "not installed (onnxruntime_genai)"))
    peers = _peers(tmp_path)
    assert set(peers) == {"llamacpp_q4_0", "llamacpp_q4_k_m", "ortgenai_int4"}
    assert peers["llamacpp_q4_k_m"] == {"skipped": "llama.cpp peer not run: llama-cpp-python not installed"}
    assert peers["ortgenai_int4"] == {"skipped": "onnxruntime-genai peer not run: not installed (onnxruntime_genai)"}


@needs_genai
def test_onnxruntime_genai_int4_is_measured_against_the_same_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "available", lambda: (False, "left out of this test"))
    genai = _peers(tmp_path)["ortgenai_int4"]
    m = genai["metrics"]
    assert m["steps"] == sum(len(p) + DECODE for p in PROMPTS) and m["prompts"] == len(PROMPTS)
    assert 10 < m["logits_snr_db"] < 60, m  # int4 round-to-nearest on random weights: close, never exact
    assert 0 <= m["greedy_match"] <= len(PROMPTS) and genai["version"] == ortgenai.version()
