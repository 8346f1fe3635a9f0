"""Our GPTQ weights as GGUF Q4_0 against llama.cpp's own Q4_0 and Q4_K_M of the same model.

    python benchmarks/gguf_fidelity.py --model artifacts/B/untie_head --quant DIR \\
        --llamacpp-src /path/to/llama.cpp [--work /tmp/gguf_fidelity] [--passes 5] [--threads 2]

`--quant` is a quantize-stage output with group_size 32, sym and
scale_dtype fp16 (pipeline/quant/gguf_q4.py refuses anything else). From one f16
conversion of `--model` (llama.cpp's converter) it builds:

- ours_q4_0: our GPTQ codes and scales as Q4_0 (pipeline/quant/gguf_q4.py); the
  token embedding, which our quantizer does not touch, left f16 as converted;
- ours_q4_0_emb_q4_0: the same with the token embedding rounded to Q4_0 by
  gguf's quantizer, as llama.cpp's Q4_0 file holds it;
- llamacpp_q4_0 / llamacpp_q4_k_m: llama_model_quantize of the f16 file
  (round to nearest per block, no calibration data; output.weight becomes
  Q6_K in both, llama.cpp's rule);
- llamacpp_q4_0_pure: llama_model_quantize Q4_0 with `pure` (every 2-D
  tensor Q4_0, output.weight included): the same tensor types as
  ours_q4_0_emb_q4_0, whose token embedding is byte-identical to it, so those
  two differ only in GPTQ vs round-to-nearest codes for the 43 linears;
- and, as the ceiling our file can reach, gptq_dequant_fp32: the HF model in
  PyTorch fp32 holding our dequantized weights.

Fidelity, each against the fp32 eager model (TorchReference) on the parity
prompts (conf/parity/default.yaml), by the verify_parity stage's own code:
the reference decodes each prompt plus `decode_tokens` greedy tokens; every
arm is fed that same sequence (teacher forcing) and compared at every step:
logits SNR dB (over all steps of all prompts), top-1 agreement, KL; then
decodes freely: greedy prompts reproduced of N.

Speed: decode tok/s of each GGUF by pipeline.measure.bench_arm (the benchmark stage's
runner: one fresh process per pass, arms interleaved A B C A B C), median
[min-max] over the passes, at `--threads`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))




class _Progress:
    """The little of StageContext that verify_parity's _teacher/_compare use: progress bars, as lines."""

    @contextlib.contextmanager
    def progress(self, total, label):
        t0 = time.perf_counter()
        print(f"  {label} ...", flush=True, file=sys.stderr)

        class _Bar:
            def advance(self, **_):
                pass

        yield _Bar()
        print(f"  {label}: {time.perf_counter() - t0:.1f} s", flush=True, file=sys.stderr)


def build_files(model: Path, quant: Path, work: Path, src: str | None) -> dict[str, dict]:
    from pipeline.quant import gguf_q4
    from pipeline.toolchains import llamacpp

    work.mkdir(parents=True, exist_ok=True)
    f16 = llamacpp.convert(model, work / "model-f16.gguf", outtype="f16", src=src)
    files = {
        "ours_q4_0": gguf_q4.write_q4_0(f16, model, quant, work / "ours-q4_0.gguf"),
        "ours_q4_0_emb_q4_0": gguf_q4.write_q4_0(f16, model, quant, work / "ours-q4_0-emb-q4_0.gguf",
                                                 others="q4_0"),
    }
    for arm, ftype, name in (("llamacpp_q4_0", llamacpp.Q4_0, "llamacpp-q4_0.gguf"),
                             ("llamacpp_q4_0_pure", llamacpp.Q4_0, "llamacpp-q4_0-pure.gguf"),
                             ("llamacpp_q4_k_m", llamacpp.Q4_K_M, "llamacpp-q4_k_m.gguf")):
        if arm.endswith("_pure"):
            out = _quantize_pure(f16, work / name, ftype)
        else:
            out = llamacpp.quantize(f16, work / name, ftype=ftype, threads=2)
        files[arm] = {"file": str(out), "bytes": out.stat().st_size, "tensor_types": _tensor_types(out)}
    return files


def _quantize_pure(f16: Path, out: Path, ftype: int) -> Path:
    """llama_model_quantize with params.pure (pipeline.runtimes.llamacpp.quantize has no switch for it)."""
    import ctypes

    import llama_cpp

    from pipeline.toolchains.llamacpp import _NativeStderrSilenced

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.pure = ftype, 2, True
    with _NativeStderrSilenced():
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0 or not out.is_file():
        raise SystemExit(f"llama_model_quantize (pure) returned {rc}")
    return out


def _tensor_types(path: Path) -> dict[str, int]:
    import gguf

    types: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return dict(sorted(types.items()))


def fidelity(model: Path, quant: Path, files: dict[str, dict], decode_tokens: int, n_prompts: int,
             n_ctx: int) -> dict[str, dict]:
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from pipeline.quant import gguf_q4
    from pipeline.engine.config import CONF_DIR
    from pipeline.runtimes.reference import TorchReference
    from stages.verify_parity import REF_THREADS, _compare, _prompt_ids, _teacher

    prompts = [str(p) for p in OmegaConf.load(CONF_DIR / "parity" / "default.yaml").prompts][:n_prompts]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    model_type = json.loads((model / "config.json").read_text()).get("model_type", "")
    encoded = [_prompt_ids(tokenizer, p, tokenizer.bos_token_id, model_type) for p in prompts]
    longest = max(len(e) for e in encoded) + decode_tokens
    if longest > n_ctx:
        raise SystemExit(f"--n-ctx {n_ctx} is shorter than the longest prompt + decode_tokens ({longest})")
    ctx = _Progress()
    ref = TorchReference(model, threads=REF_THREADS)
    teacher = _teacher(ref, encoded, decode_tokens, ctx)
    out = {}
    ceiling = TorchReference(gguf_q4.dequantized_model(model, quant), threads=REF_THREADS)
    out["gptq_dequant_fp32"], _ = _compare(teacher, ceiling, prompts, encoded, decode_tokens, ctx,
                                           "gptq_dequant_fp32")
    for arm, info in files.items():
        from pipeline.runtimes.llamacpp import LlamaCppDecoder

        dec = LlamaCppDecoder(info["file"], threads=2, n_ctx=n_ctx)
        out[arm], _ = _compare(teacher, dec, prompts, encoded, decode_tokens, ctx, arm)
        del dec
    return out


def speed(files: dict[str, dict], passes: int, threads: int, prompt_length: int, decode_tokens: int,
          n_ctx: int) -> dict[str, dict]:
    from pipeline.measure import bench_arm
    from pipeline.measure.stats import interleave, spread

    runs: dict[str, list[float]] = {a: [] for a in files}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    for _, arm in interleave(list(files), passes):
        # bench_arm's llama.cpp loader takes any GGUF; its arm name is the benchmark stage's
        cmd = [sys.executable, "-m", bench_arm.__name__, "--arm", "llamacpp_q4_k_m", "--artifact", files[arm]["file"],
               "--prompt-length", str(prompt_length), "--decode-tokens", str(decode_tokens),
               "--warmup-tokens", "4", "--threads", str(threads), "--n-ctx", str(n_ctx)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{arm}: bench_arm failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        runs[arm].append(json.loads(proc.stdout.strip().splitlines()[-1])["decode_tok_s"])
        print(f"  speed {arm}: {runs[arm][-1]:.0f} tok/s", file=sys.stderr, flush=True)
    return {a: spread(v) for a, v in runs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the untied fp32 HF checkpoint (untie_head output)")
    p.add_argument("--quant", type=Path, required=True, help="quantize output: group_size 32, sym, scale_dtype fp16")
    p.add_argument("--work", type=Path, default=Path("/tmp/gguf_fidelity"))
    p.add_argument("--llamacpp-src", default=os.environ.get("EDGEKILN_LLAMACPP_SRC"),
                   help="llama.cpp tree with convert_hf_to_gguf.py (default $EDGEKILN_LLAMACPP_SRC)")
    p.add_argument("--prompts", type=int, default=12, help="the first N parity prompts")
    p.add_argument("--decode-tokens", type=int, default=80, help="greedy tokens per prompt (as parity)")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--speed-prompt", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=256, help="decode tokens per speed pass")
    p.add_argument("--n-ctx", type=int, default=512)
    p.add_argument("--skip-fidelity", action="store_true", help="speed only (e.g. re-measured on a quieter host)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = p.parse_args(argv)

    from pipeline.measure.stats import fmt

    t0 = time.perf_counter()
    files = build_files(a.model, a.quant, a.work, a.llamacpp_src)
    fid = {} if a.skip_fidelity else fidelity(a.model, a.quant, files, a.decode_tokens, a.prompts, a.n_ctx)
    spd = speed(files, a.passes, a.threads, a.speed_prompt, a.speed_tokens, a.n_ctx)

    base = fid.get("gptq_dequant_fp32")
    n = base["prompts"] if base else a.prompts
    where = (f"against fp32 eager, {n} prompts, {base['steps']} teacher-forced steps; " if base
             else "fidelity skipped; ")
    print(f"\n{where}decode tok/s at {a.threads} threads ({a.speed_prompt}-token prompt, {a.speed_tokens} "
          f"tokens), median [min-max] of {a.passes} passes\n")
    print(f"| arm | file MiB | tensor types | SNR dB | top-1 | KL nats | greedy /{n} | decode tok/s |")
    print("|" + "---|" * 8)
    for arm in (["gptq_dequant_fp32"] if base else []) + list(files):
        m = fid.get(arm)
        f = files.get(arm)
        size = f"{f['bytes'] / 2**20:.2f}" if f else "-"
        types = ", ".join(f"{k} {v}" for k, v in f["tensor_types"].items()) if f else "fp32 (torch)"
        tok = fmt(spd[arm], 0) if arm in spd else "-"
        figs = (f"{m['logits_snr_db']:.2f} | {m['top1_agreement']:.4f} | {m['kl_nats']:.5f} | {m['greedy_match']}"
                if m else "- | - | - | -")
        print(f"| {arm} | {size} | {types} | {figs} | {tok} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps({"files": files, "fidelity": fid, "decode_tok_s": spd,
                                      "settings": {k: str(v) for k, v in vars(a).items()}}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
