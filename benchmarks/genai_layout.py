"""The ORT artifact's two I/O layouts and onnxruntime-genai on the same weights, one host, interleaved.

    python benchmarks/genai_layout.py --build x86_avx512-embedded-speed [--passes 5] [--threads 2]

Arms, each pass a fresh process (pipeline/measure/bench_arm.py), interleaved A B C A B C:
  (a) edgekiln layout, GqaDecoder: the graph rebuilt from the build's own untie_head and quantize
      artifacts in the layout before genai's (io_layout='edgekiln': seqlens_k / total_sequence_length fed);
  (b) genai layout, GqaDecoder: the build's pack folder as it is;
  (c) genai layout, onnxruntime-genai: the same folder through og.Model / og.Generator's own greedy loop
      (the folder itself: the threads are an overlay on genai's config, nothing is written there).
Decode tok/s after a 32-token prompt (the headline) and after a 512-token one, 64 tokens each, and the
resident memory after the run; median [min-max] over the passes. The build needs export.context_length
of at least 576 (512 + 64). Prints one table and writes --out (JSON, every pass).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.measure.stats import compare, fmt, interleave, spread  # noqa: E402

PROMPT, CONTEXT, DECODE = 32, 512, 64


def _edgekiln_graph(art: Path, work: Path) -> Path:
    """The build's graph in the edgekiln layout, from the same codes, at the pack's positions and level."""
    from pipeline.graphs.gqa_graph import build_gqa_graph
    from pipeline.sources.checkpoint_files import copy_side_files

    io = json.loads((art / "pack" / "io.json").read_text())
    out = work / "edgekiln"
    if not (out / "io.json").is_file():
        build_gqa_graph(art / "untie_head", art / "quantize", out, max_len=int(io["max_len"]),
                        accuracy_level=int(io["accuracy_level"]), io_layout="edgekiln")
        copy_side_files(art / "pack", out)
    return out


def _genai_folder(pack: Path) -> Path:
    """The pack folder as the benchmark stage's genai arm runs it: itself."""
    from stages.benchmark import _artifact_in_genai

    folder, why = _artifact_in_genai(pack)
    if folder is None:
        raise SystemExit(f"genai_layout: {why}")
    return folder


def _pass(arm: str, artifact: Path, threads: int) -> dict:
    cmd = [sys.executable, "-m", "pipeline.measure.bench_arm", "--arm", arm, "--artifact", str(artifact),
           "--prompt-length", str(PROMPT), "--decode-tokens", str(DECODE), "--warmup-tokens", "4",
           "--threads", str(threads), "--context-points", str(CONTEXT), "--context-decode-tokens", str(DECODE)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} on {artifact}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"decode_32": r["decode_tok_s"], "decode_512": r["context"][0]["decode_tok_s"],
            "prefill_32": r["prefill_tok_s"], "resident_mib": r["resident_mib"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True, help="a build whose pack is the genai layout (artifacts/<build>)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgekiln-genai-layout"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    art = ROOT / "artifacts" / a.build
    io = json.loads((art / "pack" / "io.json").read_text())
    if io.get("io_layout") != "genai":
        raise SystemExit(f"{art / 'pack'}: io_layout {io.get('io_layout')!r}; rebuild its pack stage")
    if int(io["max_len"]) < CONTEXT + DECODE:
        raise SystemExit(f"the graph serves {io['max_len']} positions; build with export.context_length="
                         f"{CONTEXT + DECODE} or more")
    arms = {"a: edgekiln layout, GqaDecoder": ("ort_int4", _edgekiln_graph(art, a.work)),
            "b: genai layout, GqaDecoder": ("ort_int4", art / "pack"),
            "c: genai layout, onnxruntime-genai": ("ortgenai_int4", _genai_folder(art / "pack"))}
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    for i, name in interleave(list(arms), a.passes):
        runs[name].append(_pass(*arms[name], a.threads))
        print(f"pass {i + 1} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    rows = {name: {k: spread([r[k] for r in rs]) for k in rs[0]} for name, rs in runs.items()}
    print(f"{a.build}, {a.threads} threads, {a.passes} passes interleaved, median [min-max]")
    print("| arm | decode @32 tok/s | decode @512 tok/s | prefill @32 tok/s | resident MiB |")
    print("|---|---|---|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {fmt(s['decode_32'])} | {fmt(s['decode_512'])} | {fmt(s['prefill_32'])} | "
              f"{fmt(s['resident_mib'], 0)} |")
    names = list(arms)
    for key in ("decode_32", "decode_512"):
        for other in names[1:]:
            c = compare([r[key] for r in runs[other]], [r[key] for r in runs[names[0]]], 0.08)
            print(f"{key}: {other.split(':')[0]} / a = {c['ratio']:.3f} ({c['verdict']}, noise floor 8%)")
    if a.out:
        a.out.write_text(json.dumps({"build": a.build, "threads": a.threads, "passes": runs, "summary": rows},
                                    indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
