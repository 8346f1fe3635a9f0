"""python -m pipeline generate BUILD "prompt": stream text from a built artifact.

The artifact is run the way its deploy profile says (runtime, threads, pages), from
the build's own folders, after their manifests are verified: what a fleet
device would run, not a re-export. Greedy by default; `--temperature` samples.
A vLLM build (device=xeon_amx) runs through vLLM's server, started from its
deploy profile as `python -m pipeline serve` starts it (about a minute), then stopped.

    python -m pipeline generate x86_avx512-embedded-speed "def read_file(path):"
    python -m pipeline generate BUILD "prompt" --max-new-tokens 64 --temperature 0.8 --seed 1
    python -m pipeline generate BUILD "$(cat notes.txt) Fix the typos:" --speculate

Tokens are printed as they are decoded; prefill and decode speed go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from pipeline.engine.layout import ARTIFACTS, BUILD_NAME, ROOT


class GenerateError(Exception):
    """One line: why the build cannot be run."""


# deploy profile runtime -> the benchmark arm that runs that artifact
_ARMS = {"onnxruntime": "ort_int4", "torch": "tinygemm_w4a16", "llama.cpp": "gguf_q4_0"}


def open_build(build: str, threads: int | None = None):
    """(decoder, tokenizer, facts) for a built artifact, manifests verified."""
    from pipeline.engine import manifest
    from pipeline.runtimes.open import open_runtime
    from pipeline.engine.context import StageError

    if not BUILD_NAME.fullmatch(build) or ".." in build:
        raise GenerateError(f"{build!r} is not a build name")
    base = ROOT / ARTIFACTS / build
    if not base.is_dir():
        known = sorted(p.parent.name for p in (ROOT / ARTIFACTS).glob("*/deploy_profile") if p.is_dir())
        raise GenerateError(f"no build {build!r} under {ARTIFACTS}/ (built: {', '.join(known) or 'none'}); "
                            f"build it with `python -m pipeline ...` first")
    folders = {}
    stages = ["deploy_profile", "pack", "untie_head"]
    if (base / "compile_qnn" / "qnn.json").is_file():
        stages.append("compile_qnn")
    for stage in stages:
        try:
            folders[stage] = base / stage
            manifest.verify(folders[stage], expect_stage=stage)
        except StageError as e:
            raise GenerateError(str(e)) from None
    profile = json.loads((folders["deploy_profile"] / "profile.json").read_text())
    runtime = profile.get("runtime")
    if runtime == "onnxruntime-qnn":
        return _open_qnn(profile, folders)
    arm = _ARMS.get(runtime)
    if arm is None:
        files = ", ".join(profile.get("files") or []) or "none"
        raise GenerateError(f"build {build}: its runtime is {runtime!r} ({profile['weight_path']['path']}), "
                            f"which this command does not run here; the deploy profile's files: {files}")
    if runtime == "llama.cpp":
        from pipeline.toolchains.llamacpp import available

        ok, reason = available()
        if not ok:
            raise GenerateError(f"build {build} runs on llama.cpp: {reason}")
    llama = profile.get("llama.cpp", {}).get("settings", {})
    wanted = (profile.get("session", {}).get("intra_op_num_threads") or llama.get("n_threads")
              or profile.get("torch", {}).get("torch_num_threads") or 1)
    host = len(os.sched_getaffinity(0))
    threads = int(threads or min(int(wanted), host))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folders["untie_head"]), local_files_only=True)
    session = ({"session_config": profile["session"].get("session_config") or None,
                "huge_pages": bool(profile["session"].get("huge_pages"))}
               if runtime == "onnxruntime" else None)
    dec = open_runtime(arm, str(folders["pack"]), threads, n_ctx=int(llama.get("n_ctx", 0)), session=session)
    return dec, tok, {"runtime": runtime, "arm": arm, "threads": threads, "profile_threads": wanted,
                      "weight_path": profile["weight_path"]["path"]}


def _open_qnn(profile: dict, folders: dict):
    """A phone build's deployed context binary on this host's HTP backend
    (onnxruntime-qnn's x86 emulation: the phone's numerics, not its speed)."""
    from transformers import AutoTokenizer

    from pipeline.graphs import qnn
    from pipeline.runtimes.onnx import OnnxDecoder

    reason = qnn.missing()
    if reason:
        raise GenerateError(f"this phone build runs on the QNN HTP backend: {reason}")
    comp = folders["compile_qnn"]
    info = json.loads((comp / "qnn.json").read_text())
    deployed = info["deployed"]
    session = qnn.open_htp(comp, info, deployed)
    prompt = qnn.open_htp(comp, info, deployed, prompt=True)  # the prompt graph, where the build has one
    tok = AutoTokenizer.from_pretrained(str(folders["untie_head"]), local_files_only=True)
    return OnnxDecoder(comp, session=session, prompt_session=prompt), tok, {
        "runtime": f"{profile['runtime']}, HTP backend emulated on this host (speed is not the phone's)",
        "arm": f"qnn_{deployed}", "threads": 1, "profile_threads": 1, "weight_path": profile["weight_path"]["path"]}


def _pick(logits, temperature: float, rng) -> int:
    import numpy as np

    if temperature <= 0:
        return int(np.argmax(logits))
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))


def prompt_ids(tok, prompt: str, chat_template: bool = False) -> list[int]:
    """The prompt's token ids: as the tokenizer frames plain text, or, with `chat_template`, the prompt as
    one user message rendered by the checkpoint's own chat template with the assistant's turn opened
    (how an instruct checkpoint is meant to be prompted)."""
    if not chat_template:
        return list(tok(prompt, add_special_tokens=True)["input_ids"])
    if getattr(tok, "chat_template", None) is None:
        raise GenerateError("--chat-template: the checkpoint's tokenizer has no chat template")
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])  # a BatchEncoding on transformers 5


def generate(dec, tok, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             emit=None, chat_template: bool = False, speculate: bool = False) -> dict:
    """Prefill the prompt, then decode up to `max_new_tokens`, calling `emit`
    with each new piece of text. Returns the ids and timings. `speculate`: greedy tokens through
    prompt-lookup speculative decoding (edgekiln_runtime/speculative.py; the ONNX Runtime artifact's)."""
    import numpy as np

    from pipeline.runtimes.contract import ContextFull

    ids = prompt_ids(tok, prompt, chat_template)
    if not ids:
        raise GenerateError("the prompt encodes to no tokens")
    eos = set(filter(lambda x: x is not None, [tok.eos_token_id]))
    if speculate:
        return _generate_speculative(dec, tok, ids, max_new_tokens, temperature, eos, emit)
    rng = np.random.default_rng(seed)
    dec.reset()
    t0 = time.perf_counter()
    try:
        logits = dec.prefill(ids)
    except ContextFull as e:
        raise GenerateError(f"the prompt ({len(ids)} tokens) does not fit the artifact's context: {e}") from None
    t1 = time.perf_counter()
    stream = _Stream(tok, emit)
    stop = "max_new_tokens"
    for _ in range(max_new_tokens):
        nxt = _pick(logits, temperature, rng)
        if nxt in eos:
            stop = "eos"
            break
        stream.add(nxt)
        if len(stream.ids) == max_new_tokens:
            break
        try:
            logits = dec.step(nxt)
        except ContextFull:
            stop = "context full"
            break
    t2 = time.perf_counter()
    text = stream.finish()
    return {"prompt_tokens": len(ids), "new_tokens": len(stream.ids), "ids": stream.ids, "text": text,
            "stop": stop, "prefill_s": t1 - t0, "decode_s": t2 - t1}


class _Stream:
    """New tokens in, the text they add out through `emit`, a piece at a time."""

    def __init__(self, tok, emit):
        self.tok, self.emit = tok, emit
        self.ids: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.emit and text.startswith(self.shown):  # a piece can change earlier text (byte fallback): wait
            self.emit(text[len(self.shown):])
            self.shown = text

    def finish(self) -> str:
        """The whole text; emits what is left of it."""
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.emit and text != self.shown and text.startswith(self.shown):
            self.emit(text[len(self.shown):])
        return text


def _generate_speculative(dec, tok, ids: list[int], max_new_tokens: int, temperature: float, eos: set,
                          emit) -> dict:
    """generate() through edgekiln_runtime.speculative: greedy tokens (plain decoding's but where a near-tie
    falls the other way in a multi-row call), and its counts."""
    from edgekiln_runtime import speculative

    if temperature > 0:
        raise GenerateError("--speculate decodes greedily: it needs --temperature 0")
    if not hasattr(dec, "verify"):
        raise GenerateError("--speculate runs on the ONNX Runtime artifact's runtime (GqaDecoder) only")
    if len(ids) >= dec.max_len:
        raise GenerateError(f"the prompt ({len(ids)} tokens) does not fit the artifact's context ({dec.max_len})")
    stream = _Stream(tok, emit)
    t0 = time.perf_counter()
    try:
        st = speculative.generate(dec, ids, max_new_tokens, eos,
                                  on_token=lambda t: None if t in eos else stream.add(t))
    except ValueError as err:
        raise GenerateError(f"--speculate: {err}") from None
    total = time.perf_counter() - t0
    text = stream.finish()
    out = stream.ids
    stop = ("eos" if st.tokens and st.tokens[-1] in eos else
            "max_new_tokens" if len(st.tokens) >= max_new_tokens else "context full")
    rate = f"{st.accepted}/{st.drafted} draft tokens kept" if st.drafted else "no drafts"
    return {"prompt_tokens": len(ids), "new_tokens": len(out), "ids": out, "text": text, "stop": stop,
            "prefill_s": total - st.decode_s, "decode_s": st.decode_s,
            "decode_how": f" (speculative: {len(st.tokens) - 1} tokens in {st.calls} calls, {rate})"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("build", help="a built build's name (artifacts/<build>/)")
    parser.add_argument("prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="default: the deploy profile's, capped at this host's CPUs")
    parser.add_argument("--chat-template", action="store_true",
                        help="send the prompt as a user message through the checkpoint's chat template")
    parser.add_argument("--speculate", action="store_true",
                        help="prompt-lookup speculative decoding (greedy, ONNX Runtime builds): several tokens a "
                             "model call where the output repeats the prompt")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.max_new_tokens > 1_000_000:
        print("error: --max-new-tokens must be between 1 and 1000000", file=sys.stderr)
        return 2
    if args.temperature < 0:
        print("error: --temperature must be >= 0", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # A vLLM build's server runs in a session of its own: SIGTERM and SIGHUP (a service manager,
    # a closed terminal) unwind through `with server:`, which stops it, as Ctrl-C does; their
    # default would end this process and leave vLLM running.
    from pipeline.engine.stopping import Stopped, signal_name

    def stop(signum, _frame):
        raise Stopped(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if _runtime(args.build) == "vllm-cpu":
            if args.speculate:
                raise GenerateError("--speculate runs on the ONNX Runtime artifact; vLLM has speculative "
                                    "decoding of its own (its --speculative-config)")
            res = _generate_vllm(args)
        else:
            dec, tok, facts = open_build(args.build, args.threads)
            print(f"[{args.build}: {facts['weight_path']} on {facts['runtime']}, {facts['threads']} threads]",
                  file=sys.stderr, flush=True)
            sys.stdout.write(args.prompt)
            sys.stdout.flush()
            res = generate(dec, tok, args.prompt, args.max_new_tokens, args.temperature, args.seed,
                           emit=lambda piece: (sys.stdout.write(piece), sys.stdout.flush()),
                           chat_template=args.chat_template, speculate=args.speculate)
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"\nerror: generate {args.build}: stopped by {signal_name(e.signum)}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    print()
    pre = res["prompt_tokens"] / res["prefill_s"] if res["prefill_s"] > 0 else float("inf")
    # the tokens decode_s covers: all new ones here; over HTTP, those after the first
    timed = res.get("decode_tokens", res["new_tokens"])
    dec_rate = timed / res["decode_s"] if res["decode_s"] > 0 else float("inf")
    print(f"[{res['prompt_tokens']} prompt tokens at {pre:.1f} tok/s{res.get('prefill_how', '')}; "
          f"{res['new_tokens']} new at {dec_rate:.1f} tok/s{res.get('decode_how', '')}; stopped: {res['stop']}]",
          file=sys.stderr)
    return 0


def _runtime(build: str) -> str | None:
    """The deploy profile's runtime, if the build has one (open_build checks everything else)."""
    if not BUILD_NAME.fullmatch(build) or ".." in build:
        return None
    path = ROOT / ARTIFACTS / build / "deploy_profile" / "profile.json"
    try:
        return json.loads(path.read_text()).get("runtime")
    except (OSError, ValueError):
        return None


def _generate_vllm(args) -> dict:
    """Stream a completion from vLLM's server, started from the build's deploy profile;
    the same result keys as generate()'s. GenerateError says why it could not."""
    import urllib.request

    from transformers import AutoTokenizer

    from pipeline.runtimes import vllm
    from pipeline.toolchains import vllm_server

    try:
        folder = vllm.profile_dir(args.build)
        server = vllm.VllmServer(folder, vllm_server.find_python(), vllm.free_port())
    except vllm_server.ServeError as e:
        raise GenerateError(str(e)) from None
    with server:
        print(f"[{args.build}: starting vLLM from its deploy profile (about a minute); log: {server.log}]",
              file=sys.stderr, flush=True)
        try:
            server.wait_ready()
        except vllm_server.ServeError as e:
            raise GenerateError(str(e)) from None
        tok = AutoTokenizer.from_pretrained(str(folder.parent / "untie_head"), local_files_only=True)
        ids = prompt_ids(tok, args.prompt, args.chat_template)
        print(f"[{args.build}: w4a8_gptq_vllm on vLLM ({server.linear_kernel()}), ready in "
              f"{server.start_s:.0f} s]", file=sys.stderr, flush=True)
        body = {"model": server.model_name(), "prompt": ids, "max_tokens": args.max_new_tokens,
                "temperature": args.temperature, "seed": args.seed, "stream": True, "return_token_ids": True}
        req = urllib.request.Request(f"{server.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
        t0 = time.perf_counter()
        first = last = None
        new, finish = 0, None
        with urllib.request.urlopen(req, timeout=3600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("text"):
                    sys.stdout.write(choice["text"])
                    sys.stdout.flush()
                last = time.perf_counter()
                first = first or last
                # tokens, where vLLM returns their ids; else one per chunk (one engine step each)
                new += len(choice["token_ids"]) if choice.get("token_ids") is not None else 1
                finish = choice.get("finish_reason") or finish
    if first is None:
        raise GenerateError("vLLM streamed nothing back")
    return {"prompt_tokens": len(ids), "new_tokens": new, "decode_tokens": new - 1, "prefill_s": first - t0,
            "decode_s": last - first, "prefill_how": " (time to the first token, over HTTP)",
            "stop": "eos" if finish == "stop" else "max_new_tokens" if finish == "length" else finish}


if __name__ == "__main__":
    sys.exit(main())
