"""python -m edgekiln_runtime PACK_FOLDER "prompt": greedy text from a build's pack folder, streamed.

Settings come from the build's deploy profile beside the folder (../deploy_profile/onnxruntime.json:
the threads, spinning and pages its sweep chose for the device) unless --profile names another or
--no-profile is given; --threads overrides. --json prints one JSON line instead of text (the prompt's
ids, the tokens, the text, the decode speed): what a script or a fleet check compares. --speculate
decodes greedily with prompt-lookup drafts (edgekiln_runtime/speculative.py): faster where the output
repeats the prompt, level where it does not; its tokens are plain decoding's but where a near-tie falls
the other way (a multi-row call rounds otherwise than a step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from edgekiln_runtime import __version__
from edgekiln_runtime.io import ArtifactError, read_io


def _profile_settings(path: Path) -> dict:
    """GqaDecoder settings from a deploy profile's onnxruntime.json (stages/deploy_profile.py writes it)."""
    prof = json.loads(path.read_text())
    spin = (prof.get("session_config") or {}).get("session.intra_op.allow_spinning")
    return {"threads": int(prof.get("intra_op_num_threads") or 1),
            "spinning": None if spin is None else spin == "1",
            "huge_pages": bool(prof.get("huge_pages"))}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m edgekiln_runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a build's pack folder (artifacts/<build>/pack, or a pulled version's pack/)")
    p.add_argument("prompt", help="the prompt, as text (a chat model's template is the caller's to apply)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=128,
                   help="new tokens at most (fewer at an end-of-sequence token or the graph's last position); default 128")
    p.add_argument("--threads", type=int, help="intra-op threads (default: the deploy profile's, else the CPUs this process may use)")
    p.add_argument("--profile", type=Path, help="a deploy profile's onnxruntime.json (default: FOLDER/../deploy_profile/onnxruntime.json)")
    p.add_argument("--no-profile", action="store_true", help="ignore any deploy profile")
    p.add_argument("--json", action="store_true", help="print one JSON line (prompt_ids, tokens, text, decode_tok_s) instead of text")
    p.add_argument("--speculate", action="store_true",
                   help="prompt-lookup speculative decoding: greedy tokens, several a model call where the output "
                        "repeats the prompt (editing or continuing given code or text); off by default")
    p.add_argument("--draft-max", type=int, default=None, help="with --speculate: draft tokens a call at most (default 8)")
    p.add_argument("--version", action="version", version=f"edgekiln-runtime {__version__}")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        io = read_io(args.folder)
        from edgekiln_runtime.gqa import GqaDecoder
        from edgekiln_runtime.text import FolderTokenizer

        settings = {}
        prof = args.profile or args.folder / ".." / "deploy_profile" / "onnxruntime.json"
        if not args.no_profile and (args.profile or prof.is_file()):
            if not prof.is_file():
                raise ArtifactError(f"--profile {prof}: no such file")
            settings = _profile_settings(prof)
        if args.threads:
            settings["threads"] = args.threads
        settings.setdefault("threads", len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
        tok = FolderTokenizer(args.folder, io)
        ids = tok.prompt_ids(args.prompt)
        if not ids:
            raise ArtifactError("the prompt tokenizes to nothing")
        room = int(io["max_len"]) - len(ids)
        if room < 1:
            raise ArtifactError(f"the prompt is {len(ids)} tokens; the graph holds {io['max_len']} positions")
        n = min(args.max_new_tokens, room)
        eos = set(io.get("eos_token_id") or [])
        dec = GqaDecoder(args.folder, **settings)
    except (ArtifactError, OSError, ValueError) as err:
        print(f"edgekiln-runtime: {err}", file=sys.stderr)
        return 2

    import numpy as np

    tokens: list = []
    shown = ""

    def show(token: int) -> None:
        nonlocal shown
        if not args.json:  # stream: print what the text gained (decoding the whole tail keeps multi-byte runes whole)
            text = tok.decode(tokens + [token])
            if text.startswith(shown) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

    spec = None
    if args.speculate:
        from edgekiln_runtime import speculative

        try:
            spec = speculative.generate(dec, ids, n, eos, draft_max=args.draft_max or speculative.DRAFT_MAX,
                                        on_token=lambda t: (show(t), tokens.append(t)))
        except ValueError as err:
            print(f"edgekiln-runtime: --speculate: {err}", file=sys.stderr)
            return 2
        took = spec.decode_s
    else:
        logits = dec.prefill(ids)
        t0 = time.perf_counter()
        while len(tokens) < n:
            token = int(np.argmax(logits))
            show(token)
            tokens.append(token)
            if token in eos or len(tokens) == n:
                break
            logits = dec.step(token)
        took = time.perf_counter() - t0
    text = tok.decode(tokens)
    steps = len(tokens) - 1  # the first token comes from the prefill's logits
    speed = steps / took if steps > 0 and took > 0 else None
    if args.json:
        extra = ({"speculative": {"calls": spec.calls, "drafted": spec.drafted, "accepted": spec.accepted}}
                 if spec else {})
        print(json.dumps({"prompt_ids": ids, "tokens": tokens, "text": text, "decode_tok_s": speed,
                          "threads": settings["threads"], "runtime": f"edgekiln-runtime {__version__}", **extra}))
    else:
        sys.stdout.write(text[len(shown):] if text.startswith(shown) else "")
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
