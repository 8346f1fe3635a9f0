"""The health check a device runs on a freshly installed version: the pack folder in onnxruntime-genai alone.

The deploy_profile stage copies this file, byte for byte, to `deploy_profile/health_check.py` of an
`x86_avx512` build (whose pack folder is an onnxruntime-genai model), and profile.json's
`on_device.health.command` runs it from the version folder (pack/ and deploy_profile/ side by side):

    PYTHON deploy_profile/health_check.py --model pack --ids 2,17,40 --new-tokens 16 --threads 4

It loads the model with og.Model, appends the prompt's ids in one call (the prefill, genai's order),
decodes greedily up to N tokens (genai stops early at an end-of-sequence token, which is kept) and
times those decode calls as the benchmark's `ort_int4_genai` arm does (pipeline/measure/bench_arm.py:
N generate_next_token calls after the prefill, N / their seconds). It does that `--runs` times, each
run a fresh generator; the tokens must be the same every time, and the speed is the median. Its
last stdout line is one JSON object: {"tokens": [...], "decode_tok_s": float or null, ...}.
A failure is a non-zero exit status (a traceback, or one line on stderr).

The standard library and onnxruntime_genai only, never this project: the device's interpreter has
onnxruntime-genai and nothing else (tests/test_genai_artifact.py runs it so). onnxruntime_genai is
imported in main(), so the project imports this module (deploy_profile does, which puts the file in
that stage's code deps) without genai installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _ids(text: str) -> list[int]:
    ids = [int(t) for t in text.split(",") if t.strip()]
    if not ids:
        raise argparse.ArgumentTypeError("--ids: no token ids")
    return ids


def _run(og, model, ids: list[int], n: int) -> tuple[list[int], float]:
    """(the new tokens, seconds of their decode calls): a fresh generator, the ids prefilled in one call."""
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False)  # greedy, whatever the config's search says
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    made = 0
    t0 = time.perf_counter()
    while made < n and not gen.is_done():
        gen.generate_next_token()
        made += 1
    seconds = time.perf_counter() - t0
    seq = [int(t) for t in gen.get_sequence(0)]
    return seq[len(ids):len(ids) + made], seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="health_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the onnxruntime-genai model folder (the version's pack/)")
    p.add_argument("--ids", required=True, type=_ids, help="the prompt's token ids, comma-separated")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens to decode (fewer at an EOS)")
    p.add_argument("--threads", type=int, default=0,
                   help="onnxruntime intra-op threads (inter-op 1, as GenaiDecoder runs it); 0: the config's")
    p.add_argument("--runs", type=int, default=3, help="decodes, each a fresh generator: same tokens, median speed")
    a = p.parse_args(argv)
    if a.new_tokens < 1 or a.runs < 1:
        print("health_check: --new-tokens and --runs must be >= 1", file=sys.stderr)
        return 2

    import onnxruntime_genai as og

    config = og.Config(a.model)
    if a.threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": int(a.threads), "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    runs = [_run(og, model, a.ids, a.new_tokens) for _ in range(a.runs)]
    tokens = runs[0][0]
    if not tokens:
        print("health_check: the model generated no token", file=sys.stderr)
        return 1
    for k, (other, _) in enumerate(runs[1:], start=2):
        if other != tokens:
            print(f"health_check: run {k} decoded {other}, run 1 {tokens}: the same greedy decode differs "
                  "between runs", file=sys.stderr)
            return 1
    speeds = [len(tokens) / s for _, s in runs if s > 0]
    print(json.dumps({
        "tokens": tokens,
        "decode_tok_s": statistics.median(speeds) if speeds else None,
        "decode_tok_s_runs": speeds,
        "prompt_tokens": len(a.ids),
        "threads": a.threads or None,
        "onnxruntime_genai": og.__version__,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
