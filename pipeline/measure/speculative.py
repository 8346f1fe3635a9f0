"""Prompt-lookup speculative decoding (edgekiln_runtime/speculative.py) against plain greedy decoding on
one pack folder, in one process, the two interleaved pass by pass: decode tok/s of each, the speedup,
the share of draft tokens kept and tokens per model call, on input-grounded prompts (the output repeats
text that is in the prompt) and on free text. The benchmark stage runs it on an ONNX Runtime artifact
(its report's `speculative`); benchmarks/speculative.py is its command line:

    python benchmarks/speculative.py artifacts/x86_avx512-embedded-speed/pack
    python benchmarks/speculative.py PACK --passes 5 --threads 2 --new 128 --draft-max 8,8f --json out.json
    python benchmarks/speculative.py model.gguf --modes ngram-simple,ngram-mod    # llama-server's own modes

The prompts are PROMPTS below (plain text, framed by the pack folder's tokenizer as the device runtime
frames them). Figures: median [min-max] over the passes; the speedup is each pass's plain decode time a
token over its speculative one.

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
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from edgekiln_runtime import speculative
from edgekiln_runtime.gqa import GqaDecoder
from edgekiln_runtime.text import FolderTokenizer
from pipeline.measure.stats import fmt, spread

# Input-grounded prompts (the continuation repeats or edits text that is in the prompt) and free text,
# written for this benchmark.
PROMPTS = [
 {
  "name": "code_rename",
  "kind": "grounded",
  "text": "def mean_and_spread(values, trim=0):\n    \"\"\"Return the mean of values and the spread between their smallest and largest.\n\n    With trim, drop that many values from each end of the sorted list first.\n    \"\"\"\n    ordered = sorted(values)\n    if trim:\n        ordered = ordered[trim:len(ordered) - trim]\n    if not ordered:\n        raise ValueError(\"no values left after trimming\")\n    total = 0.0\n    for v in ordered:\n        total += v\n    mean = total / len(ordered)\n    spread = ordered[-1] - ordered[0]\n    return mean, spread\n\n\n# The same function, with the loop replaced by sum():\n\n"
 },
 {
  "name": "code_continue",
  "kind": "grounded",
  "text": "class Inventory:\n    \"\"\"Items on the shelves of one shop, counted by name.\"\"\"\n\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, name, amount=1):\n        \"\"\"Put amount more of name on the shelves.\"\"\"\n        if amount < 0:\n            raise ValueError(\"amount must not be negative\")\n        self.counts[name] = self.counts.get(name, 0) + amount\n        return self.counts[name]\n\n    def remove(self, name, amount=1):\n        \"\"\"Take amount of name off the shelves.\"\"\"\n        if amount < 0:\n            raise ValueError(\"amount must not be negative\")\n        if self.counts.get(name, 0) < amount:\n            raise KeyError(f\"only {self.counts.get(name, 0)} of {name} left\")\n        self.counts[name] = self.counts.get(name, 0) - amount\n        return self.counts[name]\n\n    def move(self, name, other, amount=1):\n        \"\"\"Move amount of name from these shelves to other's.\"\"\"\n"
 },
 {
  "name": "summarize",
  "kind": "grounded",
  "text": "The harbour town of Lenmouth grew up around a single stone pier built in the fourteenth century. For three hundred years its boats caught herring in the autumn and mackerel in the spring, and the catch was salted in sheds along the quay before it was carried inland by cart. When the railway reached the town in 1861, fresh fish could be sent to the cities overnight, and the salting sheds closed within a decade. The fleet grew to more than eighty boats by 1900, but the herring shoals moved north after the First World War, and by 1950 only a handful of boats still fished from the pier. Today the old sheds hold a museum, two restaurants and a sailing school, and the town's population doubles each summer with visitors.\n\nIn short: the harbour town of Lenmouth"
 },
 {
  "name": "fix_typos",
  "kind": "grounded",
  "text": "Plese make sure the door is lockd when you leave the offise. The key shuold be returned to the front desk befor six o'clock. If the alarm goes of, call the number on the card by the door and wait outsid until somone arrives.\n\nThe same notice with its spelling corrected:\n\n"
 },
 {
  "name": "story",
  "kind": "free",
  "text": "Once upon a time, in a small village by the sea,"
 },
 {
  "name": "essay",
  "kind": "free",
  "text": "The most important invention of the twentieth century was"
 },
 {
  "name": "howto",
  "kind": "free",
  "text": "Here is how to bake a loaf of bread at home:\n\n1."
 },
 {
  "name": "code_free",
  "kind": "free",
  "text": "def parse_date(text):\n    \"\"\""
 }
]


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


def measure(pack: Path, passes: int = 5, threads: int = 2, new: int = 128, drafts: Sequence[str] = ("8",),
            prompts: Sequence[dict] = PROMPTS, say=print) -> dict:
    """Every prompt's plain and speculative runs (`drafts`: "8" adaptive up to 8, "8f" fixed), interleaved;
    the figures by prompt and by kind. A prompt that leaves fewer than 16 positions, or whose greedy text
    ends at once, is skipped (said). Raises ValueError where the graph cannot speculate."""
    dec = GqaDecoder(pack, threads=threads)
    why = dec.rewind_refusal()
    if why:
        raise ValueError(f"{pack}: {why}")
    tok = FolderTokenizer(pack, dec.io)
    eos = set(dec.io.get("eos_token_id") or [])
    rows, skipped = [], []
    for p in prompts:
        ids = tok.prompt_ids(p["text"])
        n = _room(p, len(ids), dec.max_len, f"the graph's {dec.max_len}", new, skipped, say)
        if n is None:
            continue
        plain(dec, ids, 4, eos)  # warm the session
        margins: list[float] = []
        want, _ = plain(dec, ids, n, eos, margins)
        steps = len(want) - 1
        if steps < 1:
            skipped.append(f"{p['name']}: greedy decoding ends at its first token")
            say(f"{p['kind']:9s} {p['name']:14s} skipped: greedy decoding ends at its first token")
            continue
        runs = {"plain": []} | {f"draft {k}": [] for k in drafts}
        stats = {k: None for k in runs}
        for _ in range(passes):
            toks, s = plain(dec, ids, n, eos)
            if toks != want:
                raise RuntimeError(f"{p['name']}: plain greedy decoding changed between passes")
            runs["plain"].append(s)
            for k in drafts:
                st = speculative.generate(dec, ids, n, eos, draft_max=int(k.rstrip("f")), adaptive=not k.endswith("f"))
                if stats[f"draft {k}"] is not None and st.tokens != stats[f"draft {k}"].tokens:
                    raise RuntimeError(f"{p['name']}: draft {k} decoded other tokens than in its first pass")
                runs[f"draft {k}"].append((st.decode_s, max(1, len(st.tokens) - 1)))
                stats[f"draft {k}"] = st
        row = {"name": p["name"], "kind": p["kind"], "prompt_tokens": len(ids), "new_tokens": len(want),
               "plain_tok_s": spread([steps / s for s in runs["plain"]]), "arms": {}}
        for k in drafts:
            st = stats[f"draft {k}"]
            same = next((i for i, (a, b) in enumerate(zip(st.tokens, want)) if a != b), min(len(st.tokens), len(want)))
            row["arms"][k] = {
                # per token: a divergence from plain greedy changes the text after it (see `same_as_greedy`)
                "tok_s": spread([m / s for s, m in runs[f"draft {k}"]]),
                "speedup": spread([(a / steps) / (s / m) for a, (s, m) in zip(runs["plain"], runs[f"draft {k}"])]),
                "accepted": st.accepted, "drafted": st.drafted, "calls": st.calls,
                "accept_rate": st.accept_rate, "tokens_per_call": st.tokens_per_call,
                # greedy's tokens up to `same_as_greedy`; where it differs, plain's lead of its token there
                "same_as_greedy": same, "of": len(want),
                "greedy_margin_there": margins[same] if st.tokens != want and same < len(margins) else None}
        rows.append(row)
        arms = "  ".join(f"draft {k}: {fmt(a['tok_s'])} tok/s, x{fmt(a['speedup'], 2)}, kept "
                         f"{a['accepted']}/{a['drafted']}, {a['tokens_per_call'] or 0:.2f} tok/call, "
                         + ("greedy's tokens" if a["greedy_margin_there"] is None else
                            f"greedy's first {a['same_as_greedy']} (a near-tie then: lead {a['greedy_margin_there']:.3f})")
                         for k, a in row["arms"].items())
        say(f"{p['kind']:9s} {p['name']:14s} {len(ids):4d}+{len(want):3d} tok  plain {fmt(row['plain_tok_s'])} "
            f"tok/s  {arms}")
    by_kind = _by_kind(rows, drafts)
    return {"pack": str(pack), "host": _host(), "threads": threads, "passes": passes, "new_tokens": new,
            "draft_max": speculative.DRAFT_MAX, "ngram": [speculative.MAX_NGRAM, speculative.MIN_NGRAM],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "prompts": rows, "by_kind": by_kind, "skipped": skipped}


def _room(p: dict, n_prompt: int, limit: int, positions: str, new: int, skipped: list, say) -> int | None:
    """The new tokens prompt `p` can have within `limit` positions (at most `new`), or None where that is
    fewer than 16: the prompt is skipped and said (`positions` names them in the message)."""
    n = min(new, limit - n_prompt)
    if n >= 16:
        return n
    skipped.append(f"{p['name']}: {n_prompt} prompt tokens leave {max(n, 0)} of {positions} positions")
    say(f"{p['kind']:9s} {p['name']:14s} skipped: {skipped[-1].split(': ', 1)[1]}")
    return None


def _by_kind(rows: list[dict], arms: Sequence[str]) -> dict:
    """Per kind of prompt and arm: the spread of the prompts' median speedups and the draft tokens kept."""
    by_kind: dict = {}
    for kind in sorted({r["kind"] for r in rows}):
        for k in arms:
            sp = [r["arms"][k]["speedup"]["median"] for r in rows if r["kind"] == kind]
            kept = sum(r["arms"][k]["accepted"] for r in rows if r["kind"] == kind)
            drafted = sum(r["arms"][k]["drafted"] for r in rows if r["kind"] == kind)
            by_kind.setdefault(kind, {})[k] = {
                "speedup": spread(sp),
                "kept": kept, "drafted": drafted, "accept_rate": kept / drafted if drafted else None,
                "prompts": len(sp)}
    return by_kind


def _host() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# llama-server's draftless modes measured against its plain greedy decoding (the llama.cpp device path's
# runtime; llama-cpp-python has no such mode). `ngram-simple` drafts what followed the last match of the
# current n-gram in this sequence, as the project's prompt lookup does; `ngram-mod` keeps a hash pool of
# n-grams shared by every request the server has seen, so each pass starts a fresh server: a pool that
# had seen a prompt's own output in the pass before would draft it back (a figure no user gets).
SERVER_MODES = ("ngram-simple", "ngram-mod")


def measure_llama_server(gguf: Path, binary: Path, passes: int = 5, threads: int = 2, new: int = 128,
                         modes: Sequence[str] = SERVER_MODES, prompts: Sequence[dict] = PROMPTS, ctx: int = 4096,
                         say=print) -> dict:
    """llama-server's plain greedy decoding and each draftless `--spec-type` mode on one GGUF, over PROMPTS
    (the prompt's text as a llama-server user sends it, the server's own tokenization), interleaved pass by
    pass, a fresh server for each arm and pass: decode tok/s from the server's own timings, the speedup
    pass by pass, the draft tokens kept (timings' draft_n_accepted of draft_n), and how many of plain
    greedy's tokens each mode reproduced."""
    from pipeline.runtimes.llama_server import LlamaServer

    arms = [None, *modes]
    srv = LlamaServer(binary, gguf, threads, ctx, None)
    try:
        lengths = {p["name"]: srv.prompt_tokens(p["text"]) for p in prompts}
    finally:
        srv.close()
    fit, skipped = [], []
    for p in prompts:
        n = _room(p, lengths[p["name"]], ctx, f"the {ctx}", new, skipped, say)
        if n is not None:
            fit.append((p, n))
    got: dict = {(a, p["name"]): [] for a in arms for p, _ in fit}
    for i in range(passes):
        for a in arms:
            srv = LlamaServer(binary, gguf, threads, ctx, a)
            try:
                srv.complete("Hello", 4)  # a first request, on text that is none of the prompts
                for p, n in fit:
                    got[(a, p["name"])].append(srv.complete(p["text"], n))
            finally:
                srv.close()
        say(f"pass {i + 1}/{passes} done")
    rows = []
    for p, _ in fit:
        plain_runs = got[(None, p["name"])]
        want = plain_runs[0]["tokens"]
        if any(r["tokens"] != want for r in plain_runs):
            raise RuntimeError(f"{p['name']}: llama-server's plain greedy decoding changed between passes")
        rate = lambda r: r["timings"]["predicted_n"] / (r["timings"]["predicted_ms"] / 1e3)  # noqa: E731
        row = {"name": p["name"], "kind": p["kind"], "prompt_tokens": plain_runs[0]["timings"]["prompt_n"],
               "new_tokens": len(want), "plain_tok_s": spread([rate(r) for r in plain_runs]), "arms": {}}
        for a in modes:
            runs = got[(a, p["name"])]
            toks = runs[0]["tokens"]
            same = next((j for j, (x, y) in enumerate(zip(toks, want)) if x != y), min(len(toks), len(want)))
            drafted = runs[0]["timings"].get("draft_n", 0)
            accepted = runs[0]["timings"].get("draft_n_accepted", 0)
            row["arms"][a] = {"tok_s": spread([rate(r) for r in runs]),
                              "speedup": spread([rate(r) / rate(q) for r, q in zip(runs, plain_runs)]),
                              "accepted": accepted, "drafted": drafted,
                              "accept_rate": accepted / drafted if drafted else None,
                              "same_as_greedy": same, "of": len(want),
                              "drafted_by_pass": [r["timings"].get("draft_n", 0) for r in runs]}
        rows.append(row)
        say(f"{p['kind']:9s} {p['name']:14s} {row['prompt_tokens']:4d}+{len(want):3d} tok  plain "
            f"{fmt(row['plain_tok_s'])} tok/s  " + "  ".join(
                f"{a}: {fmt(x['tok_s'])} tok/s, x{fmt(x['speedup'], 2)}, kept {x['accepted']}/{x['drafted']}, "
                + ("greedy's tokens" if x["same_as_greedy"] == len(want) else f"greedy's first {x['same_as_greedy']}")
                for a, x in row["arms"].items()))
    from pipeline.toolchains import llama_server

    return {"gguf": str(gguf), "runtime": f"llama-server {llama_server.version(binary)}", "binary": str(binary),
            "host": _host(), "threads": threads, "passes": passes, "new_tokens": new, "context": ctx,
            "modes": list(modes), "prompts": rows, "by_kind": _by_kind(rows, modes), "skipped": skipped}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/speculative.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("pack", type=Path, help="a build's pack folder (the GQA graph with row_logits), or a .gguf "
                                            "file: llama-server's draftless modes on it")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128, help="new tokens a prompt at most (fewer at an end token)")
    ap.add_argument("--draft-max", default=str(speculative.DRAFT_MAX),
                    help="comma-separated: one arm each; a trailing 'f' (8f) drafts a fixed length, not adaptive")
    ap.add_argument("--modes", default=",".join(SERVER_MODES), help="a .gguf: llama-server --spec-type modes, one arm each")
    ap.add_argument("--context", type=int, default=4096, help="a .gguf: the server's context (-c)")
    ap.add_argument("--server", type=Path, help="a .gguf: the llama-server binary (default: pipeline/toolchains/llama_server.py's lookup)")
    ap.add_argument("--prompts", type=Path, help="a JSON list of {name, kind, text} (default: PROMPTS here)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    prompts = json.loads(args.prompts.read_text()) if args.prompts else PROMPTS
    say = lambda line: print(line, flush=True)  # noqa: E731
    try:
        if args.pack.suffix == ".gguf":
            from pipeline.toolchains import llama_server

            binary = args.server or llama_server.find()
            if binary is None:
                raise RuntimeError(llama_server.missing_message())
            arms = [x.strip() for x in args.modes.split(",")]
            out = measure_llama_server(args.pack, binary, args.passes, args.threads, args.new, arms, prompts,
                                       ctx=args.context, say=say)
        else:
            arms = [x.strip() for x in args.draft_max.split(",")]
            out = measure(args.pack, args.passes, args.threads, args.new, arms, prompts, say=say)
    except (ValueError, RuntimeError) as err:
        print(f"speculative: {err}", file=sys.stderr)
        return 2
    print("\nby kind (median over prompts of each prompt's median speedup):")
    for kind, by_arm in out["by_kind"].items():
        for k, a in by_arm.items():
            sp = a["speedup"]
            rate = f"{a['accept_rate']:.2f}" if a["accept_rate"] is not None else "-"
            name = k if args.pack.suffix == ".gguf" else f"draft {k:>3s}"
            print(f"  {kind:9s} {name}: x{sp['median']:.2f} [{sp['min']:.2f}-{sp['max']:.2f}], "
                  f"draft tokens kept {a['kept']}/{a['drafted']} ({rate})")
    peak = f"peak resident {out['peak_rss_mib']:.0f} MiB; " if "peak_rss_mib" in out else ""
    print(f"\n{peak}{args.passes} passes, {args.threads} threads, host {out['host']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
