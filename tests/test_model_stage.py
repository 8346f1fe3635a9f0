"""The model stage: the embedded recipe trains and saves a loadable checkpoint;
a local HF checkpoint is accepted when sound and refused, in one line, when not.

Fast: a tiny recipe (~10 s, mostly parsing the stdlib) and tiny checkpoints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.engine.context import StageContext, StageError
from stages import model as stage

TINY_RECIPE = {
    "seed": 0,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "sliding_window": 16,
    "full_attention_every": 2,
    "max_position_embeddings": 128,
    "seq_len": 32,
    "batch_size": 8,
    "steps": 30,
    "warmup_steps": 3,
    "lr": 3.0e-3,
}


def make_ctx(tmp_path: Path, model: dict) -> StageContext:
    out = tmp_path / "out"
    out.mkdir()
    cfg = OmegaConf.create({"model": {"name": model.get("source"), "trust_remote_code": False, **model}})
    return StageContext(stage="model", build="t", cfg=cfg, inputs={}, out=out)


def test_declarations():
    assert stage.READS == ("model",)
    assert stage.INPUTS == ()
    assert "torch" in stage.TOOLCHAIN and "sentencepiece" in stage.TOOLCHAIN


def test_layer_types_every_fourth_is_full():
    types = stage.layer_types(8, 4)
    assert [i + 1 for i, t in enumerate(types) if t == "full_attention"] == [4, 8]
    assert types.count("sliding_attention") == 6


def test_conf_recipe_is_known_and_fits_the_kernels():
    conf = OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / "embedded.yaml")
    recipe = stage._recipe(conf.train)  # raises on unknown keys or bad shapes
    assert recipe["hidden_size"] % 128 == 0 and recipe["intermediate_size"] % 128 == 0
    assert recipe["head_dim"] == 64


def test_recipe_refuses_unknown_key_and_bad_shape():
    with pytest.raises(StageError, match="unknown key.*hiden_size"):
        stage._recipe(OmegaConf.create({"hiden_size": 256}))
    with pytest.raises(StageError, match="hidden_size=200 must be a multiple of 128"):
        stage._recipe(OmegaConf.create({"hidden_size": 200}))


# ---------------------------------------------------------------- embedded


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embedded")
    ctx = make_ctx(tmp, {"source": "embedded", "train": TINY_RECIPE})
    result = stage.run(ctx)
    return ctx.out, result


def test_embedded_writes_safetensors_checkpoint(embedded):
    out, result = embedded
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
            "tokenizer_config.json", "training_report.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert result["model"] == {
        "architecture": "Gemma3ForCausalLM",
        "parameters": result["metrics"]["parameters"],
        "tied_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention"],
    }


def test_embedded_checkpoint_and_tokenizer_load(embedded):
    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = embedded
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    cfg = model.config

    text = "Return a new list.\n\n    Args:  x — the dict’s keys, 日本 42\t"
    ids = tok(text)["input_ids"]
    assert ids[0] == cfg.bos_token_id == sp.bos_id()
    assert tok.decode(ids, skip_special_tokens=True) == text  # exact round trip
    assert ids[1:] == sp.encode(text)  # tokenizer.json agrees with tokenizer.model
    assert (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        cfg.eos_token_id, cfg.pad_token_id, sp.unk_id())
    assert sp.eos_id() == cfg.eos_token_id and sp.pad_id() == cfg.pad_token_id
    assert len(tok) == sp.get_piece_size() == cfg.vocab_size
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_embedded_training_report(embedded):
    out, result = embedded
    report = json.loads((out / "training_report.json").read_text())
    held = report["metrics"]["heldout_loss"]
    assert math.isfinite(held)
    assert held < math.log(TINY_RECIPE["vocab_size"]) - 0.5  # learned something in 30 steps
    assert report["metrics"]["heldout_top1_accuracy"] > 1 / TINY_RECIPE["vocab_size"]
    assert len(report["corpus"]["sha256"]) == 64
    assert report["corpus"]["chars"] > 500_000  # the stdlib's docstrings: ~1.5 MB
    assert report["split"]["heldout_tokens"] > 0 and report["split"]["train_tokens"] > 0
    assert report["steps"] == 30 and report["seed"] == 0
    assert result["metrics"]["heldout_loss"] == held


# ---------------------------------------------------------------- hf


def _tiny_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _tiny_checkpoint(path: Path, family: str) -> Path:
    import torch
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True))
    else:
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True))
    model.save_pretrained(path)
    _tiny_tokenizer(100).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.mark.parametrize("family,arch,tied", [
    ("llama", "LlamaForCausalLM", False),
    ("qwen3", "Qwen3ForCausalLM", True),
    ("gemma3", "Gemma3ForCausalLM", True),
])
def test_hf_accepts_supported_family(tmp_path, family, arch, tied):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _tiny_checkpoint(tmp_path / "src", family)
    ctx = make_ctx(tmp_path, {"source": "hf", "path": str(src)})
    result = stage.run(ctx)
    assert result["model"]["architecture"] == arch
    assert result["model"]["tied_embeddings"] is tied
    assert len(result["model"]["layer_types"]) == 2
    assert result["metrics"]["parameters"] == result["model"]["parameters"] > 0

    reloaded = AutoModelForCausalLM.from_pretrained(ctx.out)
    original = AutoModelForCausalLM.from_pretrained(src)
    ids = AutoTokenizer.from_pretrained(ctx.out)("w5 w7 w9", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, original(input_ids=ids).logits)
    assert sum(p.numel() for p in reloaded.parameters()) == result["model"]["parameters"]


def _copy_ckpt(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _pickle_only(p: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(p / "model.safetensors"), p / "pytorch_model.bin")
    (p / "model.safetensors").unlink()


def _drop_tensor(t: dict) -> None:
    del t["model.layers.1.mlp.down_proj.weight"]


def _reshape_tensor(t: dict) -> None:
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()


def _gptq_tensor_names(t: dict) -> None:
    import torch

    w = t.pop("model.layers.0.self_attn.q_proj.weight")
    t["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(w.shape[1] // 8, w.shape[0], dtype=torch.int32)
    t["model.layers.0.self_attn.q_proj.qzeros"] = torch.zeros(1, w.shape[0] // 8, dtype=torch.int32)
    t["model.layers.0.self_attn.q_proj.scales"] = torch.ones(1, w.shape[0], dtype=torch.float16)


REFUSALS = {
    "pickle_only": (_pickle_only, r"pickle weights \(pytorch_model\.bin\); safetensors only"),
    "auto_map": (lambda p: _edit_config(p, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}),
                 r"custom code \(auto_map.*model\.trust_remote_code=true"),
    "missing_tensor": (lambda p: _edit_tensors(p, _drop_tensor),
                       r"tensor model\.layers\.1\.mlp\.down_proj\.weight \[64, 128\] is missing"),
    "wrong_shape_tensor": (lambda p: _edit_tensors(p, _reshape_tensor),
                           r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \[16, 64\], config\.json implies \[32, 64\]"),
    "wrong_shape_config": (lambda p: _edit_config(p, intermediate_size=192),
                           r"mlp\.(gate|up|down)_proj\.weight has shape .*config\.json implies"),
    "unsupported_arch": (lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"]),
                         r"unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                         r"Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM, SmolLM3ForCausalLM, "
                         r"GraniteForCausalLM"),
    "quantized_config": (lambda p: _edit_config(p, quantization_config={"quant_method": "gptq", "bits": 4}),
                         r"already quantized \(gptq\); point model\.path at the unquantized checkpoint"),
    "quantized_tensors": (lambda p: _edit_tensors(p, _gptq_tensor_names),
                          r"already quantized \(gptq: tensor .*q_proj\.(qweight|qzeros|scales)\)"),
    "no_config": (lambda p: (p / "config.json").unlink(), r"no config\.json in .*not a Hugging Face checkpoint"),
    "no_tokenizer": (lambda p: [(p / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
                     r"no tokenizer files"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_hf_refuses(tmp_path, llama_dir, case):
    breaker, message = REFUSALS[case]
    src = _copy_ckpt(llama_dir, tmp_path / "src")
    breaker(src)
    ctx = make_ctx(tmp_path, {"source": "hf", "path": str(src)})
    with pytest.raises(StageError, match=message) as info:
        stage.run(ctx)
    assert "\n" not in str(info.value)  # one line for the user
    assert not any(ctx.out.iterdir())  # nothing half-copied


def test_hf_missing_path(tmp_path):
    ctx = make_ctx(tmp_path, {"source": "hf", "path": str(tmp_path / "nowhere")})
    with pytest.raises(StageError, match=r"model\.path .*nowhere does not exist"):
        stage.run(ctx)


def test_hf_path_not_a_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    ctx = make_ctx(tmp_path, {"source": "hf", "path": str(f)})
    with pytest.raises(StageError, match="is not a directory"):
        stage.run(ctx)


def test_hf_path_unset(tmp_path):
    ctx = make_ctx(tmp_path, {"source": "hf", "path": None})
    with pytest.raises(StageError, match=r"model\.path is not set"):
        stage.run(ctx)


def test_hf_auto_map_allowed_when_trusted_is_then_checked(tmp_path, llama_dir):
    # With trust_remote_code=true the auto_map refusal lifts; the rest of the
    # validation still runs (here: a supported architecture whose code is
    # transformers' own, since the auto_map module does not exist).
    src = _copy_ckpt(llama_dir, tmp_path / "src")
    _edit_config(src, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    ctx = make_ctx(tmp_path, {"source": "hf", "path": str(src), "trust_remote_code": True})
    with pytest.raises(StageError, match="does not build a model") as info:
        stage.run(ctx)
    assert "trust_remote_code" not in str(info.value)


def test_unknown_source(tmp_path):
    ctx = make_ctx(tmp_path, {"source": "onnx"})
    with pytest.raises(StageError, match="model.source='onnx' is not known"):
        stage.run(ctx)


def test_the_stdlib_docstrings_are_parsed_once_and_kept_under_their_sources_hash(tmp_path, monkeypatch):
    """pipeline/sources/corpus.py: the parse (3-4 s of the real stdlib, once per stage that reads the corpus)
    is kept on disk under the hash of the sources; the same sources read it back, changed ones parse anew."""
    from pipeline.sources import corpus

    monkeypatch.setenv("EDGEKILN_HOME", str(tmp_path / "home"))
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_text('"""Module a does things."""\n\ndef f():\n    """Return the answer."""\n')
    (root / "pkg" / "b.py").write_text('class B:\n    """A class called B."""\n')
    parsed = []
    real = corpus._parse_docstrings
    monkeypatch.setattr(corpus, "_parse_docstrings", lambda files: parsed.append(len(files)) or real(files))

    def read():
        corpus._stdlib_docstrings.cache_clear()  # a new process: only the disk memo is left
        return corpus.stdlib_docstrings(root)

    want = (["Module a does things.", "Return the answer.", "A class called B."], 2)
    assert read() == want and parsed == [2]
    memos = list((tmp_path / "home" / "corpus").glob("stdlib-docstrings-*.json"))
    assert len(memos) == 1
    assert read() == want and parsed == [2]  # read back, not parsed
    (root / "a.py").write_text('"""Module a, edited."""\n')
    assert read() == (["Module a, edited.", "A class called B."], 2) and parsed == [2, 2]
    assert len(list((tmp_path / "home" / "corpus").glob("stdlib-docstrings-*.json"))) == 2
    memos[0].write_text("{not json")  # a torn memo is parsed over, never trusted
    (root / "a.py").write_text('"""Module a does things."""\n\ndef f():\n    """Return the answer."""\n')
    assert read() == want and parsed == [2, 2, 2]
    corpus._stdlib_docstrings.cache_clear()
