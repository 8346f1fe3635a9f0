"""A build's pack folder generated from in onnxruntime-genai alone, against GqaDecoder and the fp32 reference.

    python benchmarks/genai_greedy.py --build x86_avx512-gemma3_270m-speed [--python PY]

What tests/test_genai_artifact.py checks on the tiny embedded build, on a real
one: a venv holding onnxruntime-genai and nothing of this project (made under
--work unless --python names one) loads `artifacts/<build>/pack` with
og.Model / og.Tokenizer and generates greedily from every parity prompt (the
same script as the test). Per prompt: whether genai's prompt ids are the
parity stage's, how many of its tokens GqaDecoder gives too (prompt prefilled,
then greedy), and how many match the fp32 reference's continuation beside
what the parity report found for the artifact. Prints a table and the
seconds genai took; --out writes every token.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import _fresh_venv  # noqa: E402
from tests.test_genai_artifact import SCRIPT  # noqa: E402


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from edgekiln_runtime.gqa import GqaDecoder
    from pipeline.runtimes.ortgenai import CHECKED
    from stages.verify_parity import _prompt_ids

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--python", type=Path, default=None, help="a python with onnxruntime-genai alone")
    ap.add_argument("--work", type=Path, default=Path("/tmp/edgekiln-genai-greedy"))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    art = ROOT / "artifacts" / a.build
    pack = art / "pack"
    per_prompt = json.loads((art / "verify_parity" / "report.json").read_text())["artifact"]["per_prompt"]
    n = len(per_prompt[0]["reference_continuation"])
    py = a.python
    if py is None:
        a.work.mkdir(parents=True, exist_ok=True)
        py, how = _fresh_venv(a.work, CHECKED.split("==", 1)[1])
        if py is None:
            raise SystemExit(f"genai_greedy: {how}")
        print(how, file=sys.stderr)
    script = a.work / "run_genai.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(SCRIPT.format(guard=False))
    t0 = time.perf_counter()
    proc = subprocess.run([str(py), "-I", str(script), str(pack), json.dumps([p["prompt"] for p in per_prompt]),
                           str(n)], capture_output=True, text=True, cwd=a.work)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"genai_greedy: onnxruntime-genai failed: {proc.stderr.strip().splitlines()[-1:]}")
    ran = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = AutoTokenizer.from_pretrained(str(pack))
    io = json.loads((pack / "io.json").read_text())
    dec = GqaDecoder(pack, threads=2)
    rows = []
    for want, got in zip(per_prompt, ran["results"]):
        ids = _prompt_ids(tok, want["prompt"], tok.bos_token_id, str(io.get("family", "")))
        mine = dec.generate_greedy(ids, len(got["tokens"]), prefilled=True)
        ref = want["reference_continuation"]
        rows.append({"prompt": want["prompt"], "ids_as_parity": got["prompt_ids"] == ids, "tokens": len(got["tokens"]),
                     "as_gqadecoder": _common(got["tokens"], mine), "as_reference": _common(got["tokens"], ref),
                     "parity_artifact_as_reference": len(ref) if want["greedy_match"]
                     else int(want["greedy_first_divergence"]), "genai_tokens": got["tokens"]})
    print(f"{a.build}: onnxruntime-genai {ran['onnxruntime_genai']} alone, {len(rows)} prompts x {n} greedy "
          f"tokens in {seconds:.1f} s (one process, loads included)")
    print("| prompt | ids as parity's | tokens | as GqaDecoder | as the fp32 reference | parity: artifact as reference |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt'][:40]} | {'yes' if r['ids_as_parity'] else 'NO'} | {r['tokens']} | {r['as_gqadecoder']} "
              f"| {r['as_reference']} | {r['parity_artifact_as_reference']} |")
    same = sum(r["as_gqadecoder"] == r["tokens"] for r in rows)
    print(f"genai's tokens are GqaDecoder's on {same} of {len(rows)} prompts; the reference's as far as parity "
          f"found the artifact's on {sum(r['as_reference'] >= min(r['parity_artifact_as_reference'], r['tokens']) for r in rows)}")
    if a.out:
        a.out.write_text(json.dumps({"build": a.build, "seconds": seconds, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
