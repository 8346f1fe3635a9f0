"""llama.cpp as a toolchain: GGUF conversion, Q4_K_M quantization, its perplexity tool.
(Its decoder, the runtime, is pipeline/runtimes/llamacpp.py.)

llama-cpp-python is an optional extra (source only, ~15 min to build on two
cores), so nothing here imports it at module level. What it provides, per the
field notes: the llama.cpp tree with `convert_hf_to_gguf.py` (plus its
`conversion/` package and gguf-py) and `llama_model_quantize`, whose Q4_K_M
output is byte-identical to `llama-quantize`'s. The converter runs as a
subprocess of the same interpreter; the quantizer in process.

Run here with llama-cpp-python 0.3.36 built from source: its wheel does not
ship the converter, so `benchmark.llamacpp_src` points at a llama.cpp tree
(the sdist's vendor/llama.cpp); the Gemma 3 embedded model converts and runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SKIP_REASON = "llama-cpp-python not installed (pip install llama-cpp-python, ~15 min build)"
CONVERTER = "convert_hf_to_gguf.py"
Q4_0 = 2  # LLAMA_FTYPE_MOSTLY_Q4_0 in llama.h
Q4_K_M = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M in llama.h


class LlamaCppUnavailable(RuntimeError):
    """The baseline cannot run here; the message says why (shown in the report)."""


# llama.cpp's AMX int8 kernels, which a -march=native build compiles in on a CPU with AMX, crashed
# every batched decode on the project's AMX builders: SIGSEGV in ggml_backend_amx_mul_mat from a
# 2-token prompt up, with the embedded model and Gemma 3 270M alike, in Q4_0 and Q4_K_M; single-token
# steps ran (llama-cpp-python 0.3.36, measured 2026-12-01 and 2026-12-04; llama.cpp's issue 20824
# reports the same on other Xeons). A stage that ran into it died after minutes of work, so such a
# build is refused where it would run, with the rebuild that leaves the AMX kernels out (the rest of
# -march=native kept; that build ran Gemma 3 270M's peers and benchmark arms here).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
AMX_REBUILD = (f"CMAKE_ARGS=\"-DCMAKE_C_FLAGS='{_NO_AMX}' -DCMAKE_CXX_FLAGS='{_NO_AMX}'\" "
               "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36")


def amx_crash(system_info: str, flags: set[str] | None) -> str:
    """Why this llama.cpp build must not run on this CPU ('' where it may): its AMX kernels compiled
    in (`AMX_INT8 = 1` in llama_print_system_info) and a CPU with AMX, which makes llama.cpp use them."""
    if "AMX_INT8 = 1" not in system_info or not flags or "amx_int8" not in flags:
        return ""
    return ("llama-cpp-python was built with llama.cpp's AMX kernels, which crash this CPU at the first "
            f"batched matmul (SIGSEGV in ggml_backend_amx_mul_mat, llama.cpp issue 20824): {AMX_REBUILD}")


def available() -> tuple[bool, str]:
    """(usable here, why not): the reason bare, each caller says what it skips."""
    try:
        import llama_cpp
    except Exception as e:  # ImportError, or a broken native library
        if isinstance(e, ImportError):
            return False, SKIP_REASON
        return False, f"import llama_cpp failed ({type(e).__name__}: {e})"
    from pipeline.engine.devices import cpu_flags

    crash = amx_crash(llama_cpp.llama_print_system_info().decode(errors="replace"), cpu_flags())
    return (False, crash) if crash else (True, "")


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return "absent"


def find_converter(src: str | None = None) -> Path | None:
    """convert_hf_to_gguf.py: in `src` (a llama.cpp tree), else where pipeline/toolchains/converter.py looks."""
    from pipeline.toolchains import converter

    tree = converter.find(src)
    return tree / CONVERTER if tree is not None else None


def convert(hf_dir: Path, out_file: Path, outtype: str = "f16", src: str | None = None) -> Path:
    """HF checkpoint -> GGUF with llama.cpp's own converter."""
    from pipeline.toolchains import converter

    conv = find_converter(src)
    if conv is None:
        raise LlamaCppUnavailable(converter.missing_message(src))
    env = dict(os.environ)
    # The converter imports `gguf` (gguf-py beside it in the llama.cpp tree) and its `conversion/` package.
    extra = [str(d) for d in (conv.parent / "gguf-py", conv.parent) if d.is_dir()]
    env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, str(conv), str(hf_dir), "--outfile", str(out_file), "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not out_file.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise LlamaCppUnavailable(f"{CONVERTER} failed on this checkpoint: {last}")
    return out_file


class _NativeStderrSilenced:
    """llama.cpp's loader prints every GGUF key to fd 2 from C: keep it out of the stage log."""

    def __enter__(self):
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self._saved, 2)
        os.close(self._saved)


def quantize(f16_file: Path, out_file: Path, ftype: int = Q4_K_M, threads: int = 0) -> Path:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = int(threads)
    with _NativeStderrSilenced():
        rc = llama_cpp.llama_model_quantize(str(f16_file).encode(), str(out_file).encode(), ctypes.byref(params))
    if rc != 0 or not out_file.is_file():
        raise LlamaCppUnavailable(f"llama_model_quantize returned {rc}")
    return out_file


def build_quantized(hf_dir: Path, work: Path, ftypes: dict[str, int], threads: int = 0,
                    src: str | None = None) -> dict[str, Path]:
    """llama.cpp's own files of `hf_dir`: one f16 conversion, then `work/<name>.gguf` per
    {name: llama ftype} (e.g. {"llamacpp_q4_k_m": Q4_K_M}); the f16 intermediate removed."""
    work.mkdir(parents=True, exist_ok=True)
    f16 = convert(hf_dir, work / "model-f16.gguf", src=src)
    try:
        return {name: quantize(f16, work / f"{name}.gguf", ftype=ftype, threads=threads)
                for name, ftype in ftypes.items()}
    finally:
        f16.unlink(missing_ok=True)


# --------------------------------------------------------------------------
# llama.cpp's own perplexity tool, for cross-checking pipeline/measure/kld.py
# --------------------------------------------------------------------------

PERPLEXITY_ENV = "EDGEKILN_LLAMA_PERPLEXITY"  # the llama-perplexity binary (benchmarks/build_llama_perplexity.sh)
PERPLEXITY_TRIES = 5  # comparison runs before giving up on a complete summary (perplexity_kld)
_STAT_LINES = {  # llama-perplexity --kl-divergence's summary line -> pipeline/measure/kld.py's key (value, uncertainty)
    "Mean PPL(Q)": ("ppl", "ppl_err"),
    "Mean PPL(base)": ("ppl_base", "ppl_base_err"),
    "Mean ln(PPL(Q)/PPL(base))": ("ln_ppl_ratio", "ln_ppl_ratio_err"),
    "Mean    KLD": ("kld_mean", "kld_mean_err"),
    "Maximum KLD": ("kld_max", None),
    "99.9%   KLD": ("kld_p99_9", None),
    "99.0%   KLD": ("kld_p99", None),
    "95.0%   KLD": ("kld_p95", None),
    "90.0%   KLD": ("kld_p90", None),
    "Median  KLD": ("kld_median", None),
    "Minimum KLD": ("kld_min", None),
    "RMS Δp    ": ("rms_dp_pct", "rms_dp_pct_err"),
    "Same top p": ("same_top1_pct", "same_top1_pct_err"),
}


def perplexity_tool() -> Path | None:
    """llama.cpp's `llama-perplexity`: $EDGEKILN_LLAMA_PERPLEXITY, else on PATH; None where neither has it
    (llama-cpp-python ships the library, not the tools)."""
    import shutil

    env = os.environ.get(PERPLEXITY_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    found = shutil.which("llama-perplexity")
    return Path(found) if found else None


def parse_kld_report(text: str) -> dict[str, float]:
    """The summary statistics llama-perplexity --kl-divergence prints, under pipeline/measure/kld.py's keys."""
    import re

    number = r"(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|-?nan|-?inf)"
    out: dict[str, float] = {}
    for line in text.splitlines():
        for label, (key, err) in _STAT_LINES.items():
            if line.startswith(label):
                m = re.match(re.escape(label) + r"\s*:\s*" + number + r"\s*%?\s*(?:±\s*" + number + ")?", line)
                if m:
                    out[key] = float(m.group(1))
                    if err and m.group(2) is not None:
                        out[err] = float(m.group(2))
    return out


def perplexity_kld(tool: Path, base_gguf: Path, q_gguf: Path, text_file: Path, n_ctx: int, chunks: int,
                   work: Path, threads: int = 1) -> dict[str, float]:
    """llama-perplexity's own KL-divergence statistics of `q_gguf` against `base_gguf` on `text_file`: the base
    run saves its log-probabilities (--kl-divergence-base), the second run compares (--kl-divergence)."""
    base_file, log = Path(work) / "base.kld", Path(work) / "llama-perplexity.log"
    common = ["-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(chunks), "-t", str(threads)]

    def run(cmd) -> str:
        # into a file, not a pipe (a pipe lost the summary more often)
        with log.open("w") as out:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
        if rc != 0:
            raise LlamaCppUnavailable(f"{Path(tool).name} exited {rc}: {log.read_text()[-300:].strip()}")
        return log.read_text()

    run([str(tool), "-m", str(base_gguf), "-f", str(text_file), "--kl-divergence-base", str(base_file), *common])
    # llama-perplexity prints through llama.cpp's asynchronous log thread, which at exit sometimes drops the
    # last lines (the summary, seen 1 run in 3 here): the comparison run is repeated until it is complete
    for _ in range(PERPLEXITY_TRIES):
        stats = parse_kld_report(run([str(tool), "-m", str(q_gguf), "--kl-divergence-base", str(base_file),
                                      "--kl-divergence", *common]))
        if "kld_mean" in stats and "same_top1_pct" in stats:
            return stats
    raise LlamaCppUnavailable(f"{Path(tool).name} printed no complete KL-divergence summary in "
                              f"{PERPLEXITY_TRIES} runs: {log.read_text()[-300:].strip()}")
