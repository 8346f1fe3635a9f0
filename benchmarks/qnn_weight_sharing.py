"""Weight sharing between a phone build's token graph and its prompt graph: what it saves, and whether it runs here.

    python benchmarks/qnn_weight_sharing.py --build artifacts/galaxy_s25-embedded-speed [--precision w4a16]

Qualcomm's LLM exports link the prompt processor and the token generator into one context binary that
holds the weights once (HTP v73 and newer). ONNX Runtime's QNN EP does it at compile time: sessions
created with `ep.share_ep_contexts=1` write their graphs into one shared context, and the last one
(`ep.stop_share_ep_contexts=1`) writes the binary, which every EPContext model then names. This
compiles the pack's token and prompt graph of one precision both ways (separately, as compile_qnn
does, and shared), prints the bytes, and then tries to load the shared pair on this host's HTP
backend (onnxruntime-qnn's x86 emulation, with `ep.share_ep_contexts=1` at load as well) and decode
the same tokens as the separate pair: the greatest difference of the logits, or the error that
stopped the load.

Measured on the embedded model's tiny phone build (onnxruntime-qnn 2.7.0, QNN SDK 2.51.0, 2026-12-06):
separate 536,576 + 557,056 bytes, shared 675,840 (38% less); loading the shared binary failed with
"contextCreateFromBinary failed ... QNN_COMMON_ERROR_NOT_SUPPORTED" whether or not the loading
session shares contexts. So compile_qnn keeps one binary per graph: a shared one could not be
verified on this host before it ships (docs/phone.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.graphs import qnn  # noqa: E402
from pipeline.runtimes.onnx import OnnxDecoder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="a phone build's folder (artifacts/<build>)")
    ap.add_argument("--precision", default=None, help="the pack's precision (default: the deployed one)")
    ap.add_argument("--default-mode", action="store_true", help="compile at QNN's default finalization mode, not the prompt graph's 3")
    args = ap.parse_args()
    reason = qnn.missing()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    pack = args.build / "pack"
    npu = json.loads((pack / "npu.json").read_text())
    precision = args.precision or npu["deployed"]
    graph = npu["graphs"][precision]
    if "prompt_graph" not in graph:
        print(f"{precision} has no prompt graph in {pack}: nothing to share")
        return 2
    token, prompt = pack / graph["graph"], pack / graph["prompt_graph"]
    comp = json.loads((args.build / "compile_qnn" / "qnn.json").read_text())
    target = comp["target"]
    ort, _ = qnn._module()
    options = {} if "--default-mode" in sys.argv else qnn.PROMPT_COMPILE_OPTIONS
    with tempfile.TemporaryDirectory(prefix="share-") as tmp:
        tmp = Path(tmp)
        sep = {n: qnn.compile_context(g, tmp / "separate" / n, target, precision, options)
               for n, g in (("token", token), ("prompt", prompt))}
        shared = tmp / "shared"
        shared.mkdir()
        for i, (n, g) in enumerate((("token", token), ("prompt", prompt))):
            so = qnn.session_options(target, precision, context_file=shared / f"{n}_ctx.onnx", options=options)
            so.add_session_config_entry("ep.share_ep_contexts", "1")
            if i == 1:
                so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
            ort.InferenceSession(str(g), sess_options=so)
        bins = sorted(shared.glob("*.bin"))
        sep_bytes = sum(f["bytes"] for f in sep.values())
        shared_bytes = sum(b.stat().st_size for b in bins)
        print(f"{precision}: separate {sep['token']['bytes']:,} + {sep['prompt']['bytes']:,} = {sep_bytes:,} bytes; "
              f"shared {shared_bytes:,} bytes in {len(bins)} binary ({1 - shared_bytes / sep_bytes:.0%} less)")

        def decoder(tok: Path, prm: Path, share: bool) -> OnnxDecoder:
            def session(p: Path):
                so = qnn.session_options(target, precision)
                if share:
                    so.add_session_config_entry("ep.share_ep_contexts", "1")
                return ort.InferenceSession(str(p), sess_options=so)
            return OnnxDecoder(pack, session=session(tok), prompt_session=session(prm))

        ids = [int(npu.get("bos_token_id") or 1)] + list(range(40, 80))

        def run(dec: OnnxDecoder) -> np.ndarray:
            dec.reset()
            first = dec.prefill(ids[:33])
            return np.stack([first] + [dec.step(t) for t in ids[33:]])

        want = run(decoder(tmp / "separate" / "token" / qnn.CONTEXT_MODEL,
                           tmp / "separate" / "prompt" / qnn.CONTEXT_MODEL, False))
        for share in (False, True):
            try:
                got = run(decoder(shared / "token_ctx.onnx", shared / "prompt_ctx.onnx", share))
            except Exception as err:  # noqa: BLE001 - ORT raises its own pybind types
                print(f"shared binary, loaded with ep.share_ep_contexts={int(share)}: does not load here: "
                      f"{str(err).strip().splitlines()[-1][:300]}")
                continue
            print(f"shared binary, loaded with ep.share_ep_contexts={int(share)}: largest logit difference from the "
                  f"separate pair {float(np.abs(got - want).max()):.3g} over {len(want)} calls")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
