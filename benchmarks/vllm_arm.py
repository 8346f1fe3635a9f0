"""vLLM as an arm: a vLLM build served from its deploy profile, beside the ONNX Runtime
artifact of the same model, on this host, in one run.

    python benchmarks/vllm_arm.py --vllm-build xeon_amx-gemma3_270m-speed \
        --ort-build x86_avx512-gemma3_270m-speed --prompts 32,512 --decode 64 --passes 5

vLLM: `python -m pipeline serve`'s server (pipeline/runtimes/vllm.py), as the deploy
profile says (env.sh's binding, vllm.yaml's settings), measured as its users see it:
streamed completions of a seeded random prompt of each length, ignoring EOS:
prefill tok/s = prompt / time to the first token, decode tok/s = (tokens - 1) /
(last token - first token); resident memory = the server's whole process tree
(API server, engine core, worker), in PSS (each shared page split among the
processes mapping it; RSS beside it counts the three processes' shared libraries
three times). ORT's is the RSS of its one process. With `--w4a16` a second server runs with
VLLM_CPU_INT4_W4A8=0: the W4A16 fallback beside AMX's W4A8, same weights; with
`--no-tcmalloc` one with VLLM_TCMALLOC=none (env.sh's tcmalloc preload off).
ORT: pipeline.measure.bench_arm's `ort_int4` arm, a fresh process per pass (as the benchmark
stage runs it), 2 threads.

The arms do not interleave pass by pass: a vLLM server left up keeps its engine
processes on the cores, so each vLLM arm runs its passes with its server up, then
stops it, and the ORT passes run after. On a host that is not the device class
the figures are cross-measured (printed as such).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.runtimes import vllm  # noqa: E402
from pipeline.toolchains import vllm_server  # noqa: E402
from pipeline.quant import weight_path
from pipeline.measure.stats import fmt, spread  # noqa: E402


def _spreads(rows: dict) -> dict:
    """Per prompt length: the spread of the passes' decode and prefill rates."""
    return {p: {"decode": spread([r["decode_tok_s"] for r in rs]), "prefill": spread([r["prefill_tok_s"] for r in rs])}
            for p, rs in rows.items()}


def vllm_arm(build: str, prompts: list[int], decode: int, passes: int, env: dict | None, label: str) -> dict:
    import numpy as np

    folder = vllm.profile_dir(build)
    server = vllm.VllmServer(folder, vllm_server.find_python(), vllm.free_port(), env=env)
    with server:
        start = server.wait_ready()
        print(f"{label}: ready in {start:.0f} s ({server.linear_kernel()})", file=sys.stderr)
        vocab = json.loads((folder.parent / "pack" / "gptq" / "config.json").read_text())["vocab_size"]
        rng = np.random.default_rng(0)
        server.stream(rng.integers(4, vocab, size=8).tolist(), 8)  # warm-up: first-request compiles
        rows = {p: [] for p in prompts}
        for k in range(passes):
            for p in prompts:
                rows[p].append(server.stream(np.random.default_rng(k).integers(4, vocab, size=p).tolist(), decode))
        resident = server.resident_mib()
    return {"arm": label, "start_s": start, "resident_mib": resident["pss"], "resident": resident,
            "by_prompt": _spreads(rows)}


def ort_arm(build: str, prompts: list[int], decode: int, passes: int, threads: int) -> dict:
    pack = Path(build) if Path(build).is_dir() else ROOT / "artifacts" / build / "pack"
    rows = {p: [] for p in prompts}
    resident = []
    for k in range(passes):
        for p in prompts:
            out = subprocess.run([sys.executable, "-m", "pipeline.measure.bench_arm", "--arm", "ort_int4", "--artifact",
                                  str(pack), "--prompt-length", str(p), "--decode-tokens", str(decode),
                                  "--warmup-tokens", "4", "--threads", str(threads), "--seed", str(k)],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows[p].append(r)
            resident.append(r["resident_mib"])
    return {"arm": "onnxruntime MatMulNBits (the x86_avx512 artifact)", "resident_mib": max(resident),
            "by_prompt": _spreads(rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-build", required=True)
    ap.add_argument("--ort-build", default=None, help="a build name, or a pack folder (another checkout's)")
    ap.add_argument("--prompts", default="32,512")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--w4a16", action="store_true", help="also vLLM with VLLM_CPU_INT4_W4A8=0")
    ap.add_argument("--no-tcmalloc", action="store_true",
                    help="also vLLM with VLLM_TCMALLOC=none (env.sh then preloads no tcmalloc): the preload's effect")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    prompts = [int(x) for x in a.prompts.split(",")]
    host = json.loads((ROOT / "artifacts" / a.vllm_build / "probe" / "host.json").read_text())
    kernel = weight_path.vllm_cpu_kernel(host["isa"])
    arms = [vllm_arm(a.vllm_build, prompts, a.decode, a.passes, None,
                     f"vLLM GPTQ, {kernel['gemm']} ({kernel['activations']})")]
    if a.w4a16:
        arms.append(vllm_arm(a.vllm_build, prompts, a.decode, a.passes, {"VLLM_CPU_INT4_W4A8": "0"},
                             "vLLM GPTQ, cpu_gemm_wna16 (bf16 (W4A16), W4A8 off)"))
    if a.no_tcmalloc:
        arms.append(vllm_arm(a.vllm_build, prompts, a.decode, a.passes, {"VLLM_TCMALLOC": "none"},
                             f"vLLM GPTQ, {kernel['gemm']}, no tcmalloc preload"))
    if a.ort_build:
        arms.append(ort_arm(a.ort_build, prompts, a.decode, a.passes, a.threads))
    where = (f"host {host['cpu_model']}, {host['physical_cores']} cores, class {host['device_class']}"
             + ("" if host["device_class"] == "xeon_amx" else " (cross-measured: not the xeon_amx device)"))
    print(f"# {where}; {a.passes} passes; decode {a.decode} tokens; median [min-max]")
    print("| arm | prompt | decode tok/s | prefill tok/s | resident MiB |")
    print("|---|---|---|---|---|")
    for arm in arms:
        for p in prompts:
            b = arm["by_prompt"][p]
            print(f"| {arm['arm']} | {p} | {fmt(b['decode'])} | {fmt(b['prefill'], 0)} | {arm['resident_mib']:.0f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"host": host, "kernel": kernel, "arms": arms, "passes": a.passes,
                                            "decode": a.decode}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
