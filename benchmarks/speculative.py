"""Prompt-lookup speculative decoding (edgekiln_runtime/speculative.py) against plain greedy decoding on
one pack folder, in one process, the two interleaved pass by pass: decode tok/s of each, the speedup,
the share of draft tokens kept and tokens per model call, on input-grounded prompts (the output repeats
text that is in the prompt) and on free text. Every pass checks that both decoded the same tokens.

    python benchmarks/speculative.py artifacts/x86_avx512-embedded-speed/pack
    python benchmarks/speculative.py PACK --passes 5 --threads 2 --new 128 --draft-max 4,8,16 --json out.json

The prompts are benchmarks/speculative_prompts.json (plain text, framed by the pack folder's tokenizer as
the device runtime frames them). Figures: median [min-max] over the passes; the speedup is each pass's
plain decode time a token over its speculative one.

Token for token: at ONNX Runtime's accuracy_level 4 (the builds' default) MatMulNBits rounds a multi-row
call (a verify, a prefill) otherwise than a one-row step, so where greedy's top two logits nearly tie the
verified token can be the other one, and the text goes on from there; each arm reports how many of
greedy's tokens it reproduced and greedy's lead at the first one it did not.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

import numpy as np  # noqa: E402

from edgekiln_runtime import speculative  # noqa: E402
from edgekiln_runtime.gqa import GqaDecoder  # noqa: E402
from edgekiln_runtime.text import FolderTokenizer  # noqa: E402

PROMPTS = Path(__file__).with_name("speculative_prompts.json")


def plain(dec, ids, n, eos, margins=None):
    """Greedy decoding as the device runtime's loop runs it: (tokens, decode seconds after the prefill);
    `margins`: a list to fill with each token's lead over the runner-up logit."""
    dec.reset()
    logits = dec.prefill(ids)
    t0 = time.perf_counter()
    out = []
    while True:
        t = int(np.argmax(logits))
        out.append(t)
        if margins is not None:
            top2 = np.partition(logits, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
        if t in eos or len(out) >= n or dec.position >= dec.max_len:
            break
        logits = dec.step(t)
    return out, time.perf_counter() - t0


def span(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt(s, digits=1):
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pack", type=Path, help="a build's pack folder (the GQA graph with row_logits)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128, help="new tokens a prompt at most (fewer at an end token)")
    ap.add_argument("--draft-max", default=str(speculative.DRAFT_MAX),
                    help="comma-separated: one arm each; a trailing 'f' (8f) drafts a fixed length, not adaptive")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--json", type=Path, help="write every pass here")
    args = ap.parse_args(argv)

    dec = GqaDecoder(args.pack, threads=args.threads)
    why = dec.rewind_refusal()
    if why:
        print(f"speculative.py: {args.pack}: {why}", file=sys.stderr)
        return 2
    tok = FolderTokenizer(args.pack, dec.io)
    eos = set(dec.io.get("eos_token_id") or [])
    drafts = [x.strip() for x in args.draft_max.split(",")]
    prompts = json.loads(args.prompts.read_text())
    rows = []
    for p in prompts:
        ids = tok.prompt_ids(p["text"])
        n = min(args.new, dec.max_len - len(ids))
        if n < 16:
            print(f"{p['kind']:9s} {p['name']:14s} skipped: {len(ids)} prompt tokens leave {max(n, 0)} of the "
                  f"graph's {dec.max_len} positions", flush=True)
            continue
        plain(dec, ids, 4, eos)  # warm the session
        runs = {"plain": []} | {f"draft {k}": [] for k in drafts}
        stats = {k: None for k in runs}
        margins: list[float] = []
        want, _ = plain(dec, ids, n, eos, margins)
        for _ in range(args.passes):
            toks, s = plain(dec, ids, n, eos)
            if toks != want:
                raise SystemExit(f"{p['name']}: plain greedy decoding changed between passes")
            runs["plain"].append(s)
            for k in drafts:
                st = speculative.generate(dec, ids, n, eos, draft_max=int(k.rstrip("f")), adaptive=not k.endswith("f"))
                if stats[f"draft {k}"] is not None and st.tokens != stats[f"draft {k}"].tokens:
                    raise SystemExit(f"{p['name']}: draft {k} decoded other tokens than in its first pass")
                runs[f"draft {k}"].append((st.decode_s, len(st.tokens) - 1))
                stats[f"draft {k}"] = st
        steps = len(want) - 1
        row = {"name": p["name"], "kind": p["kind"], "prompt_tokens": len(ids), "new_tokens": len(want),
               "plain_tok_s": span([steps / s for s in runs["plain"]]), "arms": {}}
        for k in drafts:
            st = stats[f"draft {k}"]
            same = next((i for i, (a, b) in enumerate(zip(st.tokens, want)) if a != b), min(len(st.tokens), len(want)))
            row["arms"][k] = {
                # per token: a divergence from plain greedy changes the text after it (see `same`)
                "tok_s": span([m / s for s, m in runs[f"draft {k}"]]),
                "speedup": span([(a / steps) / (s / m) for a, (s, m) in zip(runs["plain"], runs[f"draft {k}"])]),
                "accepted": st.accepted, "drafted": st.drafted, "calls": st.calls,
                "accept_rate": st.accept_rate, "tokens_per_call": st.tokens_per_call,
                # greedy's tokens up to `same`; where it differs, plain's lead of its token over the runner-up
                "same_as_greedy": same, "of": len(want), "greedy_margin_there": margins[same] if same < len(want) and
                same < len(margins) and st.tokens != want else None}
        rows.append(row)
        arms = "  ".join(f"draft {k}: {fmt(a['tok_s'])} tok/s, x{fmt(a['speedup'], 2)}, kept "
                         f"{a['accepted']}/{a['drafted']}, {a['tokens_per_call'] or 0:.2f} tok/call, "
                         + ("greedy's tokens" if a["greedy_margin_there"] is None else
                            f"greedy's first {a['same_as_greedy']} (a near-tie then: lead {a['greedy_margin_there']:.3f})")
                         for k, a in row["arms"].items())
        print(f"{p['kind']:9s} {p['name']:14s} {len(ids):4d}+{len(want):3d} tok  plain {fmt(row['plain_tok_s'])} "
              f"tok/s  {arms}", flush=True)
    print("\nby kind (median over prompts of each prompt's median speedup):")
    for kind in sorted({r["kind"] for r in rows}):
        for k in drafts:
            sp = [r["arms"][k]["speedup"]["median"] for r in rows if r["kind"] == kind]
            kept = sum(r["arms"][k]["accepted"] for r in rows if r["kind"] == kind)
            drafted = sum(r["arms"][k]["drafted"] for r in rows if r["kind"] == kind)
            rate = f"{kept / drafted:.2f}" if drafted else "-"
            print(f"  {kind:9s} draft {k:>3s}: x{statistics.median(sp):.2f} [{min(sp):.2f}-{max(sp):.2f}], "
                  f"draft tokens kept {kept}/{drafted} ({rate})")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    host = platform.processor() or platform.machine()
    try:
        host = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\npeak resident {peak:.0f} MiB; {args.passes} passes, {args.threads} threads, host {host}")
    if args.json:
        args.json.write_text(json.dumps({"pack": str(args.pack), "host": host, "threads": args.threads,
                                         "passes": args.passes, "peak_rss_mib": peak, "prompts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
