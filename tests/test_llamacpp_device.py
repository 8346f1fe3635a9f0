"""llama.cpp devices: the device classes, the converter lookup and fetch, and a whole build.

The whole build (pack writes our GPTQ codes as GGUF Q4_0 inside llama.cpp's own
conversion) needs llama.cpp's converter, which no wheel ships:
`python -m pipeline.toolchains.converter fetch` (CI runs it) puts it where the stages look.
Without it that test is skipped, saying so. llama-cpp-python (the runtime) is
optional: without it the parity stage runs the file's weights in PyTorch and
says so, and the benchmark says why the artifact was not timed.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from pipeline.toolchains import converter, llama_server, toolchain
from pipeline.engine import devices
from pipeline.quant import weight_path
from pipeline.engine.config import compose, validate
from tests.conftest import FAST_RUN, TINY_MODEL, ran_stages, repo_copy, run_cli

LLAMA_DEVICES = ("x86_llamacpp", "arm64_llamacpp")


@pytest.mark.parametrize("name", LLAMA_DEVICES)
def test_llamacpp_devices_pick_the_q4_0_quantization_and_path(name):
    cfg = validate(compose([f"device={name}"]))
    assert cfg["device"]["name"] == name and cfg["device"]["runtime"] == "llama.cpp"
    q = cfg["quantize"]
    assert (q["group_size"], q["sym"], q["scale_dtype"], q["method"]) == (32, True, "fp16", "gptq")
    assert devices.spec_sheet(name) == {k: v for k, v in cfg["device"].items()}
    sel = weight_path.select(cfg["device"], "speed")
    assert sel["path"] == "gguf_q4_0" and sel["runtime"] == "llama.cpp"
    assert sel["verified"] is (name == "x86_llamacpp")


def test_an_explicit_quantize_choice_still_wins_and_other_devices_keep_the_default():
    # quantize=default leaves the group size to the kernel (null: stages/quantize.py resolves it)
    assert validate(compose(["device=x86_llamacpp", "quantize=default"]))["quantize"]["group_size"] is None
    assert validate(compose(["device=x86_llamacpp", "quantize.group_size=64"]))["quantize"]["group_size"] == 64
    for name in ("x86_avx512", "xeon_amx", "galaxy_s25"):
        q = validate(compose([f"device={name}"]))["quantize"]
        assert (q["group_size"], q["scale_dtype"]) == (None, "fp32"), name


def _fake_tree(root, body="print('convert')\n"):
    (root / "conversion").mkdir(parents=True)
    (root / converter.SCRIPT).write_text(body)
    (root / "conversion" / "__init__.py").write_text("X = 1\n")
    (root / "gguf-py" / "gguf").mkdir(parents=True)
    (root / "gguf-py" / "gguf" / "__init__.py").write_text("Y = 2\n")
    return root


def test_lookup_order_and_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(converter.ENV_SRC, raising=False)
    monkeypatch.setattr(converter, "_installed_tree", lambda: None)
    assert converter.find() is None and converter.identity() == "absent"
    assert "python -m pipeline.toolchains.converter fetch" in converter.missing_message()
    fetched = _fake_tree(converter.fetched_tree())
    assert converter.find() == fetched
    other = _fake_tree(tmp_path / "elsewhere")
    monkeypatch.setenv(converter.ENV_SRC, str(other))
    assert converter.find() == other
    # the same files in another place: the same identity (the key names the converter, not its path)
    assert converter.identity() == converter.identity(str(fetched)) != "absent"
    (other / "conversion" / "__init__.py").write_text("X = 2\n")
    assert converter.identity() != converter.identity(str(fetched))
    assert toolchain.fingerprint((toolchain.CONVERTER,))[toolchain.CONVERTER] == converter.identity()
    monkeypatch.setenv(converter.ENV_SRC, str(tmp_path / "nothing"))
    assert converter.find() is None and str(tmp_path / "nothing") in converter.missing_message()


def _sdist(path, version):
    """A llama-cpp-python-shaped sdist: the converter's files and a lot we do not keep."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    files = {prefix + converter.SCRIPT: b"print(1)\n", prefix + "conversion/base.py": b"B = 1\n",
             prefix + "gguf-py/gguf/__init__.py": b"G = 1\n", prefix + "LICENSE": b"MIT\n",
             prefix + "src/llama.cpp": b"int main(){}\n", f"llama_cpp_python-{version}/setup.py": b"\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_fetch_keeps_only_the_converter_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKILN_HOME", str(tmp_path / "home"))
    calls = []

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        dl = cmd[cmd.index("-d") + 1]
        from pathlib import Path

        Path(dl).mkdir(parents=True, exist_ok=True)
        _sdist(Path(dl) / "llama_cpp_python-9.9.9.tar.gz", "9.9.9")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(converter.subprocess, "run", fake_pip)
    dest = converter.fetch("9.9.9", log=lambda *_: None)
    assert "llama-cpp-python==9.9.9" in calls[0] and "--no-binary" in calls[0]
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == ["LICENSE", "SOURCE", "conversion/base.py", converter.SCRIPT, "gguf-py/gguf/__init__.py"]
    assert converter.fetch("9.9.9", log=lambda *_: None) == dest and len(calls) == 1  # already there

    def failing_pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(converter.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match="No matching distribution"):
        converter.fetch("1.2.3", log=lambda *_: None)
    assert not converter.fetched_tree("1.2.3").exists()
    assert [p.name for p in converter.fetched_tree("1.2.3").parent.iterdir()] == ["9.9.9"]


@pytest.mark.slow
@pytest.mark.optional
def test_llamacpp_build_end_to_end_writes_our_codes_as_q4_0(tmp_path):
    if converter.find() is None:
        pytest.skip(converter.missing_message())
    from pipeline.quant import gguf_q4
    from pipeline.toolchains import llamacpp

    repo = repo_copy(tmp_path / "repo")
    build = repo / "artifacts" / "x86_llamacpp-embedded-speed"
    first = run_cli(repo, "device=x86_llamacpp", *TINY_MODEL, *FAST_RUN)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    quant = json.loads((build / "quantize" / "quant.json").read_text())
    assert quant["group_size"] == 32 and quant["scale_dtype"] == "fp16"
    info = json.loads((build / "pack" / "gguf.json").read_text())
    types = info["tensor_types"]
    assert info["file_type"] == "MOSTLY_Q4_0" and types["Q4_0"] + types.get("Q8_0", 0) == info["checked_bit_exact"]
    assert info["converter"]["identity"] == converter.identity()
    # the head is quantized too, its width measured (Q8_0 at 8 bits); the embedded model is tied, so the
    # head's tensor is the token embedding and the file has no f16 table and no output.weight
    assert quant["head"]["measured"] and types.get("Q8_0", 0) == (quant["head"]["chosen"] == 8)
    assert info["layers"]["token_embd.weight"] == "lm_head" and "F16" not in types
    assert info["token_embedding"].startswith("shared")
    # the file itself, read back here: every Q4_0 tensor is the quantize stage's weights
    assert gguf_q4.verify_file(build / "pack" / "model.gguf", build / "quantize", info) == info["checked_bit_exact"]

    art = json.loads((build / "verify_parity" / "report.json").read_text())["artifact"]
    assert art["path"] == "gguf_q4_0" and art["metrics"]["steps"] > 0
    ran_llama, _ = llamacpp.available()
    if ran_llama:
        assert art["runtime"].startswith("llama.cpp") and art["note"] == ""
        assert {"llamacpp_q4_0", "llamacpp_q4_k_m"} <= {n for n, p in art["peers"].items() if "metrics" in p}
        assert set(art["versus_peers"]) >= {"llamacpp_q4_0", "llamacpp_q4_k_m"}
    else:
        assert "llama.cpp not run" in art["note"] and "PyTorch" in art["runtime"]
        assert all(art["peers"][n]["skipped"].startswith("llama.cpp peer not run")
                   for n in ("llamacpp_q4_0", "llamacpp_q4_k_m"))
    genai = art["peers"]["ortgenai_int4"]  # its builder cannot read this Gemma 3 config (README)
    assert "metrics" in genai or genai["skipped"].startswith("onnxruntime-genai peer not run: "), genai

    profile = json.loads((build / "deploy_profile" / "llama.cpp.json").read_text())
    assert profile["model"] == "../pack/model.gguf" and profile["settings"]["n_ctx"] == 64
    assert profile["llama_cli"].startswith("llama-cli -m ../pack/model.gguf -c 64")

    bench = json.loads((build / "benchmark" / "report.json").read_text())
    if ran_llama:
        assert bench["artifact_arm"] == "gguf_q4_0" and "llamacpp_q4_0" in bench["arms"]
        assert bench["artifact_vs_llamacpp_q4_0"]["decode_tok_s"]["ratio"] > 0
    else:
        assert "gguf_q4_0" not in bench["arms"]
        assert any("GGUF Q4_0 artifact not benchmarked" in n for n in bench["notes"])
    # llama-server's draftless modes on the file against its own plain greedy, where a llama-server is here
    # (llama-cpp-python not needed); the prompts longer than this build's 64 positions are skipped, said
    spec = bench["speculative"]
    if llama_server.find() is not None:
        assert spec["ran"] and spec["runtime"].startswith("llama-server") and spec["context"] == 64, spec
        assert spec["prompts"] and spec["skipped"] and set(spec["modes"]) == {"ngram-simple", "ngram-mod"}
        for row in spec["prompts"]:
            assert row["prompt_tokens"] + row["new_tokens"] <= 64
            for arm in row["arms"].values():
                assert arm["of"] == row["new_tokens"] and 0 <= arm["same_as_greedy"] <= arm["of"]
                assert 0 <= arm["accepted"] <= arm["drafted"] and arm["speedup"]["n"] == 1
    else:
        assert not spec["ran"] and "llama_server build" in spec["skipped"]

    gen = run_cli(repo, "generate", "x86_llamacpp-embedded-speed", "def f(x):", "--max-new-tokens", "4")
    if ran_llama:
        assert gen.returncode == 0, gen.stderr[-2000:]
        assert "llama.cpp" in gen.stderr
    else:
        assert gen.returncode != 0 and "llama.cpp" in gen.stderr and "Traceback" not in gen.stderr

    again = run_cli(repo, "device=x86_llamacpp", *TINY_MODEL, *FAST_RUN)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not [s for s in ran_stages(again.stdout + again.stderr) if not s.endswith("--probe")
                and not s.startswith("probe--")], "a rebuild with nothing changed converts nothing"


def test_a_llama_cpp_build_with_its_amx_kernels_is_refused_on_a_cpu_with_amx(monkeypatch):
    """llama.cpp's AMX kernels crashed every batched decode on the AMX builders (SIGSEGV in
    ggml_backend_amx_mul_mat): such a build is not run there, and the reason is the rebuild."""
    import sys
    import types

    from pipeline.toolchains import llamacpp

    amx_build = "CPU : AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | OPENMP = 1 |"
    why = llamacpp.amx_crash(amx_build, {"avx512f", "amx_tile", "amx_int8"})
    assert "ggml_backend_amx_mul_mat" in why and "-mno-amx-int8" in why and "--force-reinstall" in why
    assert llamacpp.amx_crash(amx_build, {"avx512f", "avx512_vnni"}) == ""  # no AMX here: llama.cpp never uses them
    assert llamacpp.amx_crash(amx_build, None) == ""  # not x86
    assert llamacpp.amx_crash(amx_build.replace("AMX_INT8 = 1 | ", ""), {"amx_int8"}) == ""  # built without them

    fake = types.SimpleNamespace(llama_print_system_info=lambda: amx_build.encode())
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(devices, "cpu_flags", lambda cpuinfo=None: {"amx_int8"})
    assert llamacpp.available() == (False, why)
    monkeypatch.setattr(devices, "cpu_flags", lambda cpuinfo=None: {"avx512f"})
    assert llamacpp.available() == (True, "")


def test_a_source_built_package_is_keyed_by_its_native_libraries(tmp_path, monkeypatch):
    """Two builds of one llama-cpp-python version (with and without the AMX kernels) are two
    toolchains: the hashes its RECORD lists for its native libraries are in the fingerprint."""
    from importlib import metadata

    info = tmp_path / "llama_cpp_python-0.3.36.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llama-cpp-python\nVersion: 0.3.36\n")

    def installed(lib_hash):
        (info / "RECORD").write_text(f"llama_cpp/__init__.py,sha256=py,10\n"
                                     f"llama_cpp/lib/libggml-cpu.so,sha256={lib_hash},100\n")
        return toolchain.fingerprint(("llama-cpp-python",))["llama-cpp-python"]

    real = metadata.distribution
    monkeypatch.setattr(metadata, "distribution",
                        lambda name: metadata.PathDistribution(info) if name == "llama-cpp-python" else real(name))
    monkeypatch.setattr(metadata, "version", lambda name: metadata.distribution(name).version)
    amx, no_amx = installed("aaaa"), installed("bbbb")
    assert amx.startswith("0.3.36 (native ") and no_amx.startswith("0.3.36 (native ") and amx != no_amx
    assert installed("aaaa") == amx  # the same build, the same key
    assert toolchain.fingerprint(("onnxruntime",))["onnxruntime"] == metadata.version("onnxruntime")  # wheels: the version
