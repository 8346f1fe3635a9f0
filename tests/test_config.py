"""Bad configs end in one line naming the file or override and the key, never a traceback."""

from __future__ import annotations

import shutil

import pytest

from pipeline.engine import config as config_mod
from pipeline.engine.config import ConfigError, compose, validate
from tests.conftest import ROOT, run_cli


def build(overrides):
    return validate(compose(overrides), overrides)


def test_default_composes_and_validates():
    cfg = build([])
    assert cfg["device"]["name"] == "auto"
    assert cfg["build"]["name"] == "auto-embedded-speed"
    assert len(cfg["parity"]["prompts"]) == 12


def test_every_device_class_composes():
    names = sorted(p.stem for p in (ROOT / "conf" / "device").glob("*.yaml"))
    for required in ("xeon_amx", "x86_avx512", "x86_avx2", "arm64_cpu", "jetson_orin",
                     "cuda_discrete", "galaxy_s24", "galaxy_s25", "auto"):
        assert required in names
    for name in names:
        cfg = build([f"device={name}"])
        assert cfg["device"]["name"] == name
    s24, s25 = build(["device=galaxy_s24"]), build(["device=galaxy_s25"])
    assert (s24["device"]["qnn"]["soc_model"], s24["device"]["qnn"]["htp_arch"]) == ("SM8650", "v75")
    assert (s25["device"]["qnn"]["soc_model"], s25["device"]["qnn"]["htp_arch"]) == ("SM8750", "v79")
    # a phone exports the prompt graph its qnn block asks for; the CPU devices none
    assert s24["export"]["prompt_tokens"] == s25["export"]["prompt_tokens"] == 128
    assert build(["device=x86_avx512"])["export"]["prompt_tokens"] == 0
    assert build(["device=galaxy_s25", "device.qnn.prompt_tokens=64"])["export"]["prompt_tokens"] == 64
    assert build(["device=galaxy_s25", "export.prompt_tokens=0"])["export"]["prompt_tokens"] == 0
    assert build(["device=galaxy_s25", "export.context_length=112", "benchmark.context_points=[32]"]  # the context
                 )["export"]["prompt_tokens"] == 112


def one_line(exc: ConfigError) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["device=pixel9"], ["unknown device 'pixel9'", "x86_avx512", "galaxy_s25"]),
        (["device.corse=3"], ["device.corse", "cores"]),
        (["+device.corse=3"], ["device.corse", "valid keys"]),
        (["device.cores=many"], ["device.cores", "many"]),
        (["model=hf"], ["conf/model/hf.yaml", "model.path", "required"]),
        (["model=hf", "model.path=relative/dir"], ["model.path", "absolute"]),
        (["export.context_length=1000000000"], ["export.context_length", "outside"]),
        (["benchmark.prompt_length=0"], ["benchmark.prompt_length"]),
        (["device=galaxy_s25", "export.prompt_tokens=1"], ["'export.prompt_tokens=1'", "0 (no prompt graph) or 2 up to"]),
        (["device=galaxy_s25", "device.qnn.prompt_tokens=1"], ["'device.qnn.prompt_tokens=1'", "export.context_length"]),
        (["device=galaxy_s25", "export.prompt_tokens=300"], ["'export.prompt_tokens=300'", "up to export.context_length (256)"]),
        (["benchmark.prompt_length=250"], ["exceeds export.context_length"]),
        (["build.name=../../etc"], ["build.name", "folder under artifacts"]),
        (["build.name=exp"], ["build.name"]),
        (["parity.min_greedy_match=13"], ["parity.min_greedy_match", "12 prompts"]),
        (["priority=turbo"], ["unknown priority 'turbo'", "fidelity", "speed"]),
        (["quantize.head_group_size=48"], ["quantize.head_group_size=48", "32, 64, 128, 256"]),
        (["quantize.head_bits=6"], ["quantize.head_bits=6", "4, 8 or null"]),
        (["quantize.eight_bit_budget=1.5"], ["quantize.eight_bit_budget=1.5", "0 to 1, or null"]),
        (["quantize.sensitivity_windows=0"], ["quantize.sensitivity_windows=0", "at least 1"]),
        (["device=x86_llamacpp", "pack.gguf_token_embedding=q2_k"], ["pack.gguf_token_embedding", "keep"]),
        (["pack.qnn_select=best"], ["pack.qnn_select", "measured", "first"]),
        (["pack.qnn_select_windows=0"], ["pack.qnn_select_windows=0", "at least 1"]),
        # the fuzz test's finds: a non-number where the embedded model's positions are derived from
        (["model.train.max_position_embeddings=[]"], ["model.train.max_position_embeddings", "whole number"]),
        (["model.train.max_position_embeddings=nan"], ["model.train.max_position_embeddings", "whole number"]),
        (["calibrate.dataset=relative.txt"], ["calibrate.dataset", "absolute"]),
        (["parity.eval_text=/nonexistent/held-out"], ["parity.eval_text", "no such file or folder"]),
    ],
)
def test_bad_overrides_are_one_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        build(overrides)
    msg = one_line(e.value)
    for part in expected:
        assert part in msg, msg


def test_typo_in_a_device_file_names_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    text = (conf / "device" / "x86_avx2.yaml").read_text().replace("cores: 4", "corse: 4")
    (conf / "device" / "x86_avx2.yaml").write_text(text)
    monkeypatch.setattr(config_mod, "CONF_DIR", conf)
    with pytest.raises(ConfigError) as e:
        build(["device=x86_avx2"])
    msg = one_line(e.value)
    assert "conf/device/x86_avx2.yaml" in msg and "device.corse" in msg


def test_wrong_type_in_a_file_names_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    p = conf / "benchmark" / "default.yaml"
    p.write_text(p.read_text().replace("passes: 5", "passes: five"))
    monkeypatch.setattr(config_mod, "CONF_DIR", conf)
    with pytest.raises(ConfigError) as e:
        build([])
    msg = one_line(e.value)
    assert "benchmark.passes" in msg and "five" in msg


def test_cli_prints_one_line_and_exits_2_without_traceback():
    proc = run_cli(ROOT, "--cfg", "device=pixel9")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "unknown device 'pixel9'" in proc.stderr


def test_cli_help_lists_groups_and_stages():
    proc = run_cli(ROOT, "--help")
    assert proc.returncode == 0
    for word in ("galaxy_s25", "x86_avx512", "dvc exp run -S", "probe -> model"):
        assert word in proc.stdout
