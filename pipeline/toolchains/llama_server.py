"""llama.cpp's `llama-server`: where it is, and building it the way its users do.

The llama.cpp device path deploys a GGUF that llama.cpp's own programs run
(`llama-server`, `llama-cli`; deploy_profile's llama.cpp.json). llama-server's
draftless speculative decoding (`--spec-type ngram-simple`, `ngram-mod`, ...)
exists in llama-server and llama-cli only: llama-cpp-python does not expose it.
So measuring it (pipeline/measure/speculative.py, `measure_llama_server`)
needs the binary. No wheel ships it, so

    python -m pipeline.toolchains.llama_server build

downloads the same pinned llama-cpp-python sdist the converter comes from
(converter.download_sdist) and builds its vendor/llama.cpp as llama.cpp's
README says (`cmake -B build && cmake --build build --config Release`), the
llama-server target only, statically linked so the one file can be kept:
`$EDGEKILN_HOME/llama-server/<version>/llama-server` (default
`~/.cache/edgekiln`). The CPU build is llama.cpp's default, -march=native,
except on a CPU with AMX, where its AMX kernels crash batched decoding (the
same exception as llamacpp.AMX_REBUILD, said in the build's log). About 5
minutes on two cores (291 s in a clean CI run, 360 s beside other work).

Where a lookup goes, in order: `$EDGEKILN_LLAMA_SERVER` (a path to the
binary), `llama-server` on PATH, the built copy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from pipeline.toolchains import converter

BINARY = "llama-server"
ENV = "EDGEKILN_LLAMA_SERVER"
PINNED = converter.PINNED


def built_path(version: str = PINNED) -> Path:
    return converter.home() / "llama-server" / version / BINARY


def find() -> Path | None:
    """The llama-server binary, by the lookup order above; None where there is none."""
    env = os.environ.get(ENV)
    if env:
        p = Path(env).expanduser()
        return p if p.is_file() and os.access(p, os.X_OK) else None
    on_path = shutil.which(BINARY)
    if on_path:
        return Path(on_path)
    p = built_path()
    return p if p.is_file() else None


def missing_message() -> str:
    if os.environ.get(ENV):
        return f"{ENV}={os.environ[ENV]} is not an executable llama-server"
    return (f"no llama-server here (no wheel ships it): `python -m pipeline.toolchains.llama_server build` builds "
            f"llama.cpp's from the llama-cpp-python {PINNED} sdist (~5 min on 2 cores), or set {ENV}")


def identity() -> str:
    """sha256 (first 16 hex) of the binary find() finds, 'absent' without one: in the benchmark stage's
    toolchain key (pipeline/toolchains/toolchain.py), so another llama-server, or a first one, re-measures."""
    import hashlib

    found = find()
    if found is None:
        return "absent"
    h = hashlib.sha256()
    with open(found, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return f"sha256:{h.hexdigest()[:16]}"


def version(binary: Path) -> str:
    """`llama-server --version`'s line naming the build ('unknown' where it prints none)."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def _cmake_args() -> list[str]:
    from pipeline.engine.devices import cpu_flags
    from pipeline.toolchains.llamacpp import _NO_AMX

    args = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF"]
    if "amx_int8" in (cpu_flags() or set()):  # llamacpp.amx_crash: these kernels crash batched decoding
        args += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
    return args


def _run_showing_progress(cmd: list[str], log, t0: float) -> None:
    """Run a cmake step, saying where the compile is about every tenth of it (its `[n/N]` lines); the
    output's last line in the RuntimeError where it fails."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    said = -1
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        m = re.match(r"\[(\d+)/(\d+)\]", line)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            if done * 10 // total > said:
                said = done * 10 // total
                log(f"compiling llama-server: {done}/{total}, {time.perf_counter() - t0:.0f} s")
    if proc.wait() != 0:
        errors = [ln for ln in tail if "error" in ln.lower()] or tail or ["no output"]
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {errors[-1]}")


def build(version_: str = PINNED, *, force: bool = False, jobs: int | None = None, log=print) -> Path:
    """Build llama-server from the llama-cpp-python `version_` sdist into built_path(); written next to
    the target and renamed into place, so an interrupted build leaves nothing a lookup would take."""
    dest = built_path(version_)
    if dest.is_file() and not force:
        log(f"llama-server already at {dest}")
        return dest
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} on PATH (Debian: apt-get install cmake g++)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        sdist = converter.download_sdist(version_, tmp / "dl", log)
        prefix = f"llama_cpp_python-{version_}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(prefix):] or "."
            tar.extractall(tmp / "src", members=members, filter="data")
        args = _cmake_args()
        log(f"cmake {' '.join(args)} (llama.cpp's default CPU build for this host)")
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        t0 = time.perf_counter()
        for cmd in (["cmake", "-S", str(tmp / "src"), "-B", str(tmp / "build"), *gen, *args],
                    ["cmake", "--build", str(tmp / "build"), "--target", BINARY, "-j", str(jobs or os.cpu_count() or 2)]):
            _run_showing_progress(cmd, log, t0)
        made = tmp / "build" / "bin" / BINARY
        if not made.is_file():
            raise RuntimeError(f"the build finished without {made}")
        shutil.copy2(made, tmp / BINARY)
        (tmp / BINARY).replace(dest)
    (dest.parent / "SOURCE").write_text(f"llama-cpp-python {version_} sdist ({sdist.name}): vendor/llama.cpp, "
                                        f"cmake {' '.join(_cmake_args())}\n")
    log(f"llama-server at {dest} ({version(dest)}), built in {time.perf_counter() - t0:.0f} s")
    return dest


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipeline.toolchains.llama_server", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build llama-server (llama-cpp-python {PINNED} sdist) into {built_path()}")
    b.add_argument("--force", action="store_true", help="build again even if present")
    b.add_argument("--jobs", type=int, help="parallel compile jobs (default: the CPU count)")
    sub.add_parser("show", help="where llama-server is found, and its version")
    args = ap.parse_args(argv)
    return converter.command(lambda: build(force=args.force, jobs=args.jobs) if args.cmd == "build" else None,
                             find, missing_message, lambda found: f"{found} {version(found)}")


if __name__ == "__main__":
    sys.exit(main())
