"""Two pack folders' decode speed side by side in one process, interleaved A B A B: greedy decode tok/s
after a prompt of each given length, median [min-max] over the passes, and B's time over A's.

    python benchmarks/decode_ab.py OLD_PACK NEW_PACK --prompts 32,512 --new 64 --passes 7

For a graph change on the same weights (a pack folder built before it against one built after): the
noise floor of this host is what A against A measures (pass the same folder twice).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

import numpy as np  # noqa: E402

from edgekiln_runtime.gqa import GqaDecoder  # noqa: E402


def decode_s(dec, prompt: list[int], n: int) -> float:
    dec.reset()
    logits = dec.prefill(prompt)
    t0 = time.perf_counter()
    dec.decode_greedy(n, logits)  # the runtime contract's decode loop, as the benchmark stage's arms run it
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--prompts", default="32,512", help="prompt lengths, comma-separated")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    decs = {"A": GqaDecoder(args.a, threads=args.threads), "B": GqaDecoder(args.b, threads=args.threads)}
    vocab = min(d.vocab_size for d in decs.values())
    rng = np.random.default_rng(0)
    print(f"A {args.a}\nB {args.b}\n{args.passes} passes, {args.threads} threads, {args.new} tokens decoded")
    for length in (int(x) for x in args.prompts.split(",")):
        prompt = rng.integers(10, vocab, length).tolist()
        for d in decs.values():
            decode_s(d, prompt, 4)  # warm
        times = {k: [] for k in decs}
        for _ in range(args.passes):
            for k, d in decs.items():
                times[k].append(decode_s(d, prompt, args.new))
        rate = {k: [args.new / s for s in v] for k, v in times.items()}
        ratio = [b / a for a, b in zip(times["A"], times["B"])]
        line = "  ".join(f"{k} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}] tok/s" for k, v in rate.items())
        print(f"prompt {length:5d}: {line}  B/A time {statistics.median(ratio):.3f} "
              f"[{min(ratio):.3f}-{max(ratio):.3f}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
