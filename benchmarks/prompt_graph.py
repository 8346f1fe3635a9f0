"""A phone build's prompt graph against its token graph and the fp32 export, on a prompt past the window.

    python benchmarks/prompt_graph.py --build artifacts/galaxy_s25-gemma3_270m-speed [--tokens 640] [--json F]

The prompt: the BOS, then the last `--tokens` - 1 tokens of the calibrate stage's windows (past the
windows the QDQ calibration used, which are the first ones), longer than Gemma 3's sliding window of 512
by default, so the ring wraps inside it. It is fed three ways per QDQ precision of the pack:
- the fp32 export's decode step, a token a call: the reference, its logits at every position;
- the precision's QDQ token graph on ONNX Runtime's CPU EP (the HTP's quantization arithmetic; the pack's
  `session.disable_quant_qdq` stand-in), a token a call;
- the same precision's QDQ prompt graph on the CPU EP, its `tokens` a call (the last chunk padded).
At every chunk's end (where the prompt graph outputs logits) both are compared with the reference: logit
SNR, top-1 and KL; and the float prompt graph (the fp16 binary's source, in fp32 here) likewise. Printed
with the graph executions each needed and their seconds on this host's CPU (not the phone's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _figures(refs: list[np.ndarray], outs: list[np.ndarray]) -> dict:
    """verify_parity's own figures (its running sums over steps) at the chunk ends."""
    from stages.verify_parity import _rows, _Sums

    total = _Sums()
    total.add(_rows(np.stack(refs).astype(np.float64), np.stack(outs).astype(np.float64)))
    return {"snr_db": total.snr_db(), "top1": total.top1 / total.steps, "kl_nats": total.kl / total.steps}


def main() -> int:
    from pipeline.graphs import qnn
    from pipeline.runtimes.onnx import OnnxDecoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", required=True, type=Path, help="artifacts/<build> of a phone build")
    ap.add_argument("--tokens", type=int, default=640, help="prompt length, the BOS included")
    ap.add_argument("--json")
    a = ap.parse_args()
    art = a.build
    io = json.loads((art / "export" / "io.json").read_text())
    if "prompt" not in io:
        print(f"{art}: the build has no prompt graph (export.prompt_tokens=0)")
        return 2
    T = int(io["prompt"]["tokens"])
    flat = np.load(art / "calibrate" / "token_ids.npy").astype(np.int64).ravel().tolist()
    bos = io.get("bos_token_id")
    ids = ([] if bos is None else [int(bos)]) + flat[-(a.tokens - (bos is not None)):]
    ids = ids[: min(a.tokens, int(io["context_length"]))]
    ends = [min(i + T, len(ids)) - 1 for i in range(0, len(ids), T)]

    t0 = time.perf_counter()
    ref = OnnxDecoder(art / "export", threads=2)
    logits = {}
    for k, t in enumerate(ids):
        r = ref.step(t)
        if k in ends:
            logits[k] = r.copy()
    ref_s = time.perf_counter() - t0
    del ref
    refs = [logits[k] for k in ends]
    print(f"{art.name}: a {len(ids)}-token prompt, the prompt graph {T} tokens a call ({len(ends)} chunks; "
          f"the fp32 export token by token: {len(ids)} executions, {ref_s:.1f} s)")

    out = {"tokens": len(ids), "prompt_tokens": T, "chunk_ends": ends, "reference_s": ref_s, "precisions": {}}
    npu = json.loads((art / "pack" / "npu.json").read_text())
    pack = art / "pack"
    arms = [("float (fp16's source in fp32, with the shipped embedding lookup)", pack / "float", "", {})] + [
        (p, pack, f"{p}/", qnn.CPU_QDQ_CONFIG) for p in npu["precisions"] if p != "fp16"]
    for label, d, sub, config in arms:
        if not (d / sub / "prompt.onnx").is_file():
            print(f"{label}: no prompt graph in {d / sub}")
            continue
        row = {}
        tok = OnnxDecoder(d, threads=2, model_file=f"{sub}model.onnx", config=config)
        t0 = time.perf_counter()
        got = {}
        for k, t in enumerate(ids):
            o = tok.step(t)
            if k in ends:
                got[k] = o.copy()
        row["token_graph"] = {**_figures(refs, [got[k] for k in ends]), "executions": tok.calls["token"],
                              "seconds": time.perf_counter() - t0}
        del tok
        pg = OnnxDecoder(d, threads=2, model_file=f"{sub}model.onnx", config=config, prompt_file=f"{sub}prompt.onnx")
        t0 = time.perf_counter()
        outs = [pg.prefill(ids[i:i + T]).copy() for i in range(0, len(ids), T)]
        row["prompt_graph"] = {**_figures(refs, outs), "executions": pg.calls["prompt"],
                               "seconds": time.perf_counter() - t0}
        del pg
        out["precisions"][label] = row
        for graph in ("token_graph", "prompt_graph"):
            f = row[graph]
            print(f"  {label} {graph}: {f['snr_db']:.2f} dB, top-1 {f['top1']:.3f}, KL {f['kl_nats']:.4f} at the "
                  f"{len(ends)} chunk ends; {f['executions']} executions, {f['seconds']:.1f} s on this host's CPU EP")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
