"""The GQA graph (pipeline/graphs/gqa_graph.py) against the ORT int4 artifact and llama.cpp Q4_K_M, side by side.

    python benchmarks/gqa_speed.py --build x86_avx512-embedded-speed --prompts 32,512 \
        --decode-tokens 64 --threads 2 --passes 5

Per prompt length, every arm runs once per pass, interleaved (A B C A B C ...,
the arm order rotated each pass), each arm-pass in a fresh process (this file
with --worker). Inside a pass: load, one warm-up run (a prefill of the same
length + 8 decode steps: every arm sees its prompt shape once before the
clock), then `--reps` timed runs of reset -> prefill(prompt) -> greedy decode
of `--decode-tokens` (pipeline.measure.bench_arm._run); the pass's figure is the median
of its reps. Figures across passes: median [min-max].

Arms (default gqa and llamacpp; `--arms` picks, `--arm label=kind:path` adds any):
- gqa:       GqaDecoder on the graph built here from the build's untie_head +
             quantize artifacts (accuracy_level 4, max_len --max-len), batched prefill.
- ort_int4:  runtimes.onnx.OnnxDecoder on artifacts/<build>/pack (token-by-token
             prefill, its own context length); when prompt + decode does not fit that
             context, the same pack recipe (export_decode_step + quantize_onnx_matmuls,
             accuracy_level 4) is rebuilt under --work with the smallest context that fits.
- llamacpp:  llama.cpp Q4_K_M (pipeline/toolchains/llamacpp.py), n_ctx = --max-len, batched prefill.
- with --huge-pages, two more: gqa_thp and llamacpp_thp, the same arms in processes
             started with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (runtime/edgekiln_runtime/pages.py), so
             both runtimes' malloc'ed weights get transparent huge pages: like for like.
Kinds for --arm: gqa, gqa_thp, gqa_collapse (GqaDecoder(huge_pages=True): MADV_COLLAPSE
after load), gqa_nospin (allow_spinning 0), gqa_basic (graph optimization level
basic), ort_int4, llamacpp, llamacpp_thp.

Writes every pass to <work>/<build>/gqa_speed.json and prints the table;
`--report <that json>` prints the table of a saved run again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LLAMA_SRC = "/tmp/llama_src/llama_cpp_python-0.3.36/vendor/llama.cpp"
WARM_DECODE = 8


# --------------------------------------------------------------------------
# worker: one arm, one pass, this process
# --------------------------------------------------------------------------


def make_decoder(kind: str, path: str, threads: int, n_ctx: int):
    if kind.startswith("gqa"):
        from edgekiln_runtime.gqa import GqaDecoder

        kw = {}
        if kind == "gqa_collapse":
            kw["huge_pages"] = True
        elif kind == "gqa_nospin":
            kw["spinning"] = False
        elif kind == "gqa_spin":
            kw["spinning"] = True
        elif kind == "gqa_basic":
            kw["opt_level"] = "basic"
        elif kind == "gqa_extended":
            kw["opt_level"] = "extended"
        elif kind not in ("gqa", "gqa_thp"):
            raise SystemExit(f"unknown kind {kind}")
        return GqaDecoder(path, threads=threads, **kw)
    if kind == "ort_int4":
        from pipeline.runtimes.onnx import OnnxDecoder

        return OnnxDecoder(path, threads=threads)
    if kind in ("llamacpp", "llamacpp_thp"):
        from pipeline.runtimes.llamacpp import LlamaCppDecoder

        return LlamaCppDecoder(path, threads=threads, n_ctx=n_ctx)
    raise SystemExit(f"unknown arm kind {kind!r}")


def worker(a) -> dict:
    import numpy as np

    from pipeline.measure import bench_arm

    if a.kind.startswith("llamacpp"):
        import llama_cpp  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    t0 = time.perf_counter()
    dec = make_decoder(a.kind, a.path, int(a.threads), a.n_ctx)
    load_s = time.perf_counter() - t0
    prompt = np.random.default_rng(a.seed).integers(4, dec.vocab_size, size=a.prompt_length).tolist()
    bench_arm._run(dec, prompt, WARM_DECODE)  # warm-up: this prompt shape and the decode shape, once
    reps = [bench_arm._run(dec, prompt, a.decode_tokens) for _ in range(a.reps)]
    pre = [a.prompt_length / tp for tp, _ in reps]
    dcd = [a.decode_tokens / td for _, td in reps]
    return {"kind": a.kind, "path": a.path, "prompt_length": a.prompt_length, "threads": int(a.threads),
            "prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dcd),
            "reps_prefill": pre, "reps_decode": dcd, "load_s": load_s,
            "kv_bytes": dec.kv_bytes(), "resident_mib": dec.resident_bytes() / 2**20,
            "peak_rss_mib": bench_arm.peak_rss_mib(), "pid": os.getpid()}


# --------------------------------------------------------------------------
# preparation
# --------------------------------------------------------------------------


def prepare_gqa(art: Path, work: Path, max_len: int, accuracy_level: int, rebuild: bool) -> Path:
    from pipeline.graphs.gqa_graph import build_gqa_graph

    out = work / f"gqa_acc{accuracy_level}_L{max_len}"
    if rebuild or not (out / "io.json").is_file():
        facts = build_gqa_graph(art / "untie_head", art / "quantize", out, max_len=max_len,
                                accuracy_level=accuracy_level)
        print(f"built {out}: {facts['nodes']} nodes, {facts['bytes'] / 2**20:.1f} MiB, ops {facts['ops']}",
              flush=True)
    return out


def prepare_ort_int4(art: Path, work: Path, need: int) -> Path:
    """The build's pack if its context fits `need` positions, else the same recipe rebuilt with a larger one."""
    pack = art / "pack"
    ctx = int(json.loads((pack / "io.json").read_text())["context_length"])
    if ctx >= need:
        return pack
    ctx = ((need + 63) // 64) * 64
    out = work / f"ort_int4_ctx{ctx}"
    if not (out / "io.json").is_file():
        import shutil

        from pipeline.graphs.decode_graph import export_decode_step
        from pipeline.runtimes.tinygemm import quantize_onnx_matmuls

        exp = work / f"export_ctx{ctx}"
        export_decode_step(art / "untie_head", exp, context_length=ctx)
        quantize_onnx_matmuls(exp / "model.onnx", art / "quantize", out / "model.onnx", accuracy_level=4)
        shutil.copy2(exp / "io.json", out / "io.json")
        print(f"rebuilt the ort_int4 recipe with context {ctx}: {out}", flush=True)
    return out


def prepare_gguf(art: Path, work: Path) -> Path:
    from pipeline.toolchains.llamacpp import Q4_K_M, build_quantized

    gguf = work / "gguf" / "model-q4_k_m.gguf"
    if not gguf.is_file():
        build_quantized(art / "untie_head", work / "gguf", {"model-q4_k_m": Q4_K_M}, threads=2, src=LLAMA_SRC)
    return gguf


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------


def run_pass(kind, path, prompt, decode, threads, n_ctx, reps, seed) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--kind", kind, "--path", str(path),
           "--prompt-length", str(prompt), "--decode-tokens", str(decode), "--threads", str(threads),
           "--n-ctx", str(n_ctx), "--reps", str(reps), "--seed", str(seed)]
    from edgekiln_runtime import pages

    env = pages.hugetlb_env(dict(os.environ)) if kind.endswith("_thp") else dict(os.environ)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {path} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt(vals: list[float], digits: int = 1) -> str:
    return f"{statistics.median(vals):.{digits}f} [{min(vals):.{digits}f}-{max(vals):.{digits}f}]"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind")
    p.add_argument("--path")
    p.add_argument("--build", default="x86_avx512-embedded-speed")
    p.add_argument("--prompts", default="32,512")
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--threads", default="2", help="comma list: every thread count is measured")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--accuracy-level", type=int, default=4)
    p.add_argument("--arms", default="gqa,llamacpp", help="gqa, ort_int4 (the older exported-step graph: "
                   "4-bit layers only, so not for a build with an 8-bit head), llamacpp")
    p.add_argument("--arm", action="append", default=[], help="extra arm: label=kind:path")
    p.add_argument("--work", default="/tmp/gqa_work")
    p.add_argument("--rebuild", action="store_true", help="rebuild the GQA graph even if present")
    p.add_argument("--huge-pages", action="store_true", help="add the gqa_thp and llamacpp_thp arms")
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run (<work>/<build>/gqa_speed.json)")
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    if a.report:
        doc = json.loads(Path(a.report).read_text())
        res = doc["results"]
        arms = list(dict.fromkeys(r["arm"] for r in res))
        print(f"{doc.get('build', '')} (argv: {' '.join(doc['argv'][1:])}); load average at the end of the run "
              f"{doc.get('loadavg_end', 'n/a')}")
        print(summary(res, arms, sorted({r["threads"] for r in res}), sorted({r["prompt_length"] for r in res})))
        return 0

    art = ROOT / "artifacts" / a.build
    work = Path(a.work) / a.build
    work.mkdir(parents=True, exist_ok=True)
    prompts = [int(x) for x in a.prompts.split(",")]
    threads = [int(x) for x in str(a.threads).split(",")]
    need = max(prompts) + a.decode_tokens + WARM_DECODE + 1
    arms: dict[str, tuple[str, Path]] = {}
    for name in filter(None, a.arms.split(",")):
        if name == "gqa":
            arms["gqa"] = ("gqa", prepare_gqa(art, work, a.max_len, a.accuracy_level, a.rebuild))
        elif name == "ort_int4":
            arms["ort_int4"] = ("ort_int4", None)  # per prompt length, below
        elif name == "llamacpp":
            arms["llamacpp"] = ("llamacpp", prepare_gguf(art, work))
        else:
            raise SystemExit(f"unknown arm {name}")
    if a.huge_pages:
        if "gqa" in arms:
            arms["gqa_thp"] = ("gqa_thp", arms["gqa"][1])
        if "llamacpp" in arms:
            arms["llamacpp_thp"] = ("llamacpp_thp", arms["llamacpp"][1])
    for spec in a.arm:
        label, _, rest = spec.partition("=")
        kind, _, path = rest.partition(":")
        arms[label] = (kind, Path(path))

    results = []
    for t in threads:
        for prompt in prompts:
            paths = {}
            for label, (kind, path) in arms.items():
                paths[label] = (kind, path if kind != "ort_int4" or path is not None
                                else prepare_ort_int4(art, work, prompt + a.decode_tokens + WARM_DECODE + 1))
            labels = list(paths)
            for ps in range(a.passes):
                order = labels[ps % len(labels):] + labels[:ps % len(labels)]
                for label in order:
                    kind, path = paths[label]
                    r = run_pass(kind, path, prompt, a.decode_tokens, t, a.n_ctx, a.reps, a.seed)
                    r.update({"arm": label, "pass": ps})
                    results.append(r)
                    print(f"  t{t} P{prompt} pass {ps} {label:>12}: prefill {r['prefill_tok_s']:8.1f}  "
                          f"decode {r['decode_tok_s']:8.1f} tok/s", flush=True)
    (work / "gqa_speed.json").write_text(json.dumps({"build": a.build, "argv": sys.argv, "results": results,
                                                     "loadavg_end": round(os.getloadavg()[0], 2)}, indent=1))

    print(f"\n{a.build}: decode {a.decode_tokens} tokens, {a.passes} passes (one process each, "
          f"interleaved), {a.reps} reps/pass; tok/s median [min-max]; load average at the end "
          f"{os.getloadavg()[0]:.2f}")
    print(summary(results, list(arms), threads, prompts))
    return 0


def summary(results: list[dict], arms: list[str], threads: list[int], prompts: list[int]) -> str:
    """The side-by-side table: per arm, tok/s median [min-max] over passes, then two ratios to llama.cpp
    on the same page size (arms ending in _thp to llamacpp_thp, the others to llamacpp, its default
    4 KiB pages): the ratio of the medians, and the median [min-max] of the per-pass ratios (both arms
    of a pass ran back to back, so host drift cancels there)."""
    head = (f"{'thr':>3} {'prompt':>6} {'arm':>12} | {'prefill tok/s':>26} | {'decode tok/s':>24} | "
            f"{'prefill/llama':>13} {'decode/llama':>12} | {'per-pass prefill/llama':>22} {'per-pass decode/llama':>22}")
    lines = [head]
    for t in threads:
        for prompt in prompts:
            rows = {lab: [r for r in results if r["arm"] == lab and r["prompt_length"] == prompt
                          and r["threads"] == t] for lab in arms}
            for lab, rs in rows.items():
                if not rs:
                    continue
                pre = [r["prefill_tok_s"] for r in rs]
                dec = [r["decode_tok_s"] for r in rs]
                base_lab = "llamacpp_thp" if lab.endswith("_thp") else "llamacpp"
                base = rows.get(base_lab)
                ratio = ""
                if base and lab != base_lab:
                    rp = statistics.median(pre) / statistics.median([r["prefill_tok_s"] for r in base])
                    rd = statistics.median(dec) / statistics.median([r["decode_tok_s"] for r in base])
                    by_pass = {r["pass"]: r for r in base}
                    pp = [r["prefill_tok_s"] / by_pass[r["pass"]]["prefill_tok_s"] for r in rs if r["pass"] in by_pass]
                    pd = [r["decode_tok_s"] / by_pass[r["pass"]]["decode_tok_s"] for r in rs if r["pass"] in by_pass]
                    ratio = f"{rp:13.2f} {rd:12.2f} | {fmt(pp, 2):>22} {fmt(pd, 2):>22}"
                lines.append(f"{t:>3} {prompt:>6} {lab:>12} | {fmt(pre):>26} | {fmt(dec):>24} | {ratio}")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
