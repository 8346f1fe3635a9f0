"""The phone build's Genie bundle (pipeline/runtimes/genie.py, written by deploy_profile):
genie_config.json, htp_backend_ext_config.json and tokenizer.json, checked against the
schema Qualcomm publishes. Nothing here runs Genie or a phone: what Genie needs that
our binaries lack is listed in the profile's `genie.missing`, and tested to be there.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.graphs import qnn
from pipeline.runtimes import genie
from tests.test_deploy_profile import PHONE_QNN, phone_compiled, run

# Every key of Qualcomm's published configs, with its JSON type, learned from quic/ai-hub-apps v0.20.0
# tutorials/llm_on_genie/configs/genie/llama_v3_2_1b_instruct.json (the form with positional-encoding, which
# quic/ai-hub-models v0.46.1 utils/llm_helpers.py create_genie_config also writes) and
# configs/htp/htp_backend_ext_config.json.template. "greedy" is in the SDK's documented dialog schema
# (QAIRT docs, Genie dialog JSON configuration: sampler.greedy boolean), not in the templates.
NUMBER = (int, float)
GENIE_SCHEMA = {
    "dialog.version": int, "dialog.type": str,
    "dialog.context.version": int, "dialog.context.size": int, "dialog.context.n-vocab": int,
    "dialog.context.bos-token": int, "dialog.context.eos-token": (int, list),
    "dialog.sampler.version": int, "dialog.sampler.seed": int, "dialog.sampler.temp": NUMBER,
    "dialog.sampler.top-k": int, "dialog.sampler.top-p": NUMBER,
    "dialog.tokenizer.version": int, "dialog.tokenizer.path": str,
    "dialog.engine.version": int, "dialog.engine.n-threads": int,
    "dialog.engine.backend.version": int, "dialog.engine.backend.type": str,
    "dialog.engine.backend.extensions": str,
    **{f"dialog.engine.backend.QnnHtp.{k}": t for k, t in {
        "version": int, "use-mmap": bool, "spill-fill-bufsize": int, "mmap-budget": int, "poll": bool,
        "cpu-mask": str, "kv-dim": int, "allow-async-init": bool}.items()},
    "dialog.engine.model.version": int, "dialog.engine.model.type": str,
    "dialog.engine.model.binary.version": int, "dialog.engine.model.binary.ctx-bins": list,
    "dialog.engine.model.positional-encoding.type": str, "dialog.engine.model.positional-encoding.rope-dim": int,
    "dialog.engine.model.positional-encoding.rope-theta": NUMBER,
}
DOCUMENTED = {"dialog.sampler.greedy": bool}
ROPE_SCALING = {f"dialog.engine.model.positional-encoding.rope-scaling.{k}": t for k, t in {
    "rope-type": str, "factor": NUMBER, "low-freq-factor": NUMBER, "high-freq-factor": NUMBER,
    "original-max-position-embeddings": int}.items()}
# dialog.embedding as the Genie SDK's own validator takes it (the QAIRT SDK's Genie sources,
# examples/Genie/Genie/src/Dialog.cpp validateEmbeddingConfig, read in the public copy kyungraekim/qnn): version
# and size mandatory, type "lut" or "callback", a lut-path with type lut and only then, a datatype from its list.
EMBEDDING = {"dialog.embedding.version": int, "dialog.embedding.size": int, "dialog.embedding.type": str,
             "dialog.embedding.lut-path": str, "dialog.embedding.datatype": str,
             "dialog.embedding.quant-param.scale": float, "dialog.embedding.quant-param.offset": int}
SDK_LUT_DATATYPES = {"float32", "native", "ufixed4", "ufixed8", "ufixed16", "sfixed8", "sfixed16"}
# dialog.engine.cache-groups as the same validator takes them (Dialog.cpp validateCacheGroupConfig,
# validateLongContextConfig, validateSlidingWindowConfig): version and prefix mandatory; a sliding-window long
# context with its window-size; a mask tensor's name.
CACHE_GROUPS = {f"dialog.engine.cache-groups[].{k}": t for k, t in {
    "version": int, "prefix": str, "attention-mask-tensor-name": str, "longcontext.version": int,
    "longcontext.type": str, "longcontext.reserved-tokens": int, "longcontext.sliding-window.version": int,
    "longcontext.sliding-window.window-size": int}.items()}
# positional-encoding type absolute (Dialog.cpp validatePositionalEncodingConfig: rope, absolute or alibi): no
# rope-dim or rope-theta, the graph computes its rotary tables from the int32 positions Genie writes
ABSOLUTE = {k: t for k, t in GENIE_SCHEMA.items() if not k.endswith(("rope-dim", "rope-theta"))}
HTP_SCHEMA = {
    "devices[].soc_model": int, "devices[].dsp_arch": str, "devices[].cores[].core_id": int,
    "devices[].cores[].perf_profile": str, "devices[].cores[].rpc_control_latency": int,
    "memory.mem_type": str, "context.weight_sharing_enabled": bool,
}

# A Llama 3.2-shaped model (its rope: llama3 scaling, theta 500000), tiny
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 6, "hidden_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": 2,
         "bos_token_id": 2, "eos_token_id": 1,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
VOCAB = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<eot>": 3, "a": 4, "b": 5}
IO = {"context_length": 256, "head_dim": 32, "vocab_size": 6,
      "inputs": [{"name": "inputs_embeds", "shape": [1, 1, 64], "dtype": "float32"},
                 {"name": "position", "shape": [1], "dtype": "int64"},
                 {"name": "past_key_0", "shape": [1, 1, 15, 32], "dtype": "float32"}],
      "outputs": [{"name": "logits", "shape": [1, 1, 6], "dtype": "float32"},
                  {"name": "new_key_0", "shape": [1, 1, 1, 32], "dtype": "float32"}],
      "layers": [{"index": 0, "type": "sliding_attention", "cache_len": 15, "slot_rule": "position mod 15"},
                 {"index": 1, "type": "full_attention", "cache_len": 256, "slot_rule": "position"}],
      "embedding": {"model": "embed/model.onnx", "bits": 8, "block_size": 32}}


def tokenizer_files() -> dict[str, str]:
    """An HF tokenizer folder's files (tokenizer.json, tokenizer_config.json) and a generation config
    whose second EOS is an end-of-turn token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return {"tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps({"bos_token": "<bos>", "eos_token": {"content": "<eos>"}}),
            "generation_config.json": json.dumps({"eos_token_id": [1, 3]})}


def flat(obj, prefix="") -> dict:
    """Leaf paths of a JSON object: dicts joined with '.', a list of objects as '[]'."""
    out = {}
    for k, v in obj.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, path + "."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for x in v:
                out.update(flat(x, path + "[]."))
        else:
            out[path] = v
    return out


def check_schema(doc: dict, schema: dict) -> dict:
    got = flat(doc)
    assert set(got) == set(schema), (sorted(set(schema) - set(got)), sorted(set(got) - set(schema)))
    for path, want in schema.items():
        types = want if isinstance(want, tuple) else (want,)
        # JSON has no bool-is-an-int: a boolean key must hold true/false, an integer key no boolean
        ok = type(got[path]) is bool if bool in types else (type(got[path]) is not bool and isinstance(got[path], types))
        assert ok, (path, got[path], want)
    return got


def _bundle(tmp_path, config=LLAMA, io=IO, qnn_info=PHONE_QNN, device="galaxy_s25", spill_fill=0, extra=None):
    out, result = run(tmp_path, "qnn_graph", device={"name": device, "threads": 4},
                      compiled={**phone_compiled(io, qnn_info, spill_fill), **(extra or {})},
                      untie_files={"config.json": json.dumps(config), **tokenizer_files()})
    return out, result


def check_lut(lut_file, cfg: dict, embed_model, ids) -> np.ndarray:
    """The LUT holds, for each id, the row the phone runtime's lookup (the compiled embedding model, one id
    a call, as pipeline/runtimes/onnx.py runs it) feeds the binaries, to within half a step of its ufixed16
    encoding, in the layout Genie's LUT encoder reads (row-major, a row of `size` elements at id x size) and
    the encoding Genie's engine decodes: value = (q + offset) x scale. Returns the decoded table."""
    import onnxruntime as ort

    e = cfg["dialog"]["embedding"]
    assert e["type"] == "lut" and e["datatype"] in SDK_LUT_DATATYPES and e["datatype"] == "ufixed16"
    assert lut_file.name == e["lut-path"]
    scale, offset = e["quant-param"]["scale"], e["quant-param"]["offset"]
    assert scale > 0 and offset <= 0
    rows = (np.fromfile(lut_file, "<u2").reshape(-1, e["size"]).astype(np.float64) + offset) * scale
    sess = ort.InferenceSession(str(embed_model), providers=["CPUExecutionProvider"])
    for i in ids:
        ours = sess.run(None, {"input_ids": np.array([[i]], np.int64)})[0].reshape(-1)
        assert np.abs(rows[i] - ours).max() <= scale / 2 * (1 + 1e-9), i
    return rows


def test_the_bundle_carries_every_key_of_qualcomms_configs_with_the_models_values(tmp_path):
    out, result = _bundle(tmp_path)
    assert result["files"] == ["qnn.json", "genie_config.json", "htp_backend_ext_config.json", "tokenizer.json"]
    cfg = check_schema(json.loads((out / "genie_config.json").read_text()), {**GENIE_SCHEMA, **DOCUMENTED,
                                                                              **ROPE_SCALING})
    d = "dialog."
    assert cfg[d + "context.size"] == 256 and cfg[d + "context.n-vocab"] == 6  # the build's context, the logits' width
    # BOS / EOS: the tokenizer config's tokens looked up in tokenizer.json, then the generation config's stops
    assert cfg[d + "context.bos-token"] == VOCAB["<bos>"] and cfg[d + "context.eos-token"] == [1, 3]
    assert cfg[d + "sampler.greedy"] is True and cfg[d + "tokenizer.path"] == "tokenizer.json"
    assert cfg[d + "engine.backend.type"] == "QnnHtp" and cfg[d + "engine.backend.extensions"] == "htp_backend_ext_config.json"
    htp = d + "engine.backend.QnnHtp."
    assert cfg[htp + "kv-dim"] == 32 and cfg[htp + "spill-fill-bufsize"] == 0 and cfg[htp + "use-mmap"] is True
    assert cfg[d + "engine.model.type"] == "binary"
    # the deployed precision's binaries, in compile_qnn's order, relative to the profile folder
    assert cfg[d + "engine.model.binary.ctx-bins"] == ["../compile_qnn/w8a16/model_ctx_qnn.bin"]
    pe = d + "engine.model.positional-encoding."
    assert cfg[pe + "type"] == "rope" and cfg[pe + "rope-dim"] == 16 and cfg[pe + "rope-theta"] == 500000
    assert cfg[pe + "rope-scaling.rope-type"] == "llama3" and cfg[pe + "rope-scaling.factor"] == 32.0
    assert cfg[pe + "rope-scaling.original-max-position-embeddings"] == 8192

    htp_cfg = check_schema(json.loads((out / "htp_backend_ext_config.json").read_text()), HTP_SCHEMA)
    assert htp_cfg["devices[].soc_model"] == 69 and htp_cfg["devices[].dsp_arch"] == "v79"  # SM8750
    assert htp_cfg["context.weight_sharing_enabled"] is False  # one graph a binary: nothing to share

    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("a b a").ids == [4, 5, 4]


def test_the_profile_says_the_bundle_is_unverified_and_what_genie_lacks(tmp_path):
    out, result = _bundle(tmp_path)
    for entry in (json.loads((out / "qnn.json").read_text())["genie"], json.loads((out / "profile.json").read_text())["genie"]):
        assert entry["verified"] is False and "no" in entry["why"] and "tests/test_genie_bundle.py" in entry["checked"]
        assert "does not load as it stands" in entry["run"]  # our float I/O: Genie's rules missed
        # read from the compiled model_ctx.onnx
        assert entry["graphs"] == [{"name": "QNNExecutionProvider_QNN_0_0", "spill_fill_bytes": 0}]
        missing = "\n".join(entry["missing"])
        # our io.json against the rules of Genie's sources, one line a rule missed
        assert "inputs_embeds float32" in missing and "ufixed16" in missing  # the embeddings' type
        assert "attention_mask" in missing and "position_ids_cos" in missing  # fed by Genie, ours inside
        assert "ours past_key_0 ... new_key_0" in missing  # KV names
        assert "[1, 1, 15, 32], head_dim last" in missing  # keys not transposed
        assert "ring of 15 slots" in missing and "cache-groups" in missing  # the sliding layer's KV
        assert "embed/model.onnx" in missing and "does not fill from a LUT" in missing  # float embeddings: no LUT
        assert genie.LUT not in entry["files"]
        assert "part order" not in missing  # one graph: nothing to order


def test_the_embedding_lut_holds_the_rows_our_runtime_feeds_the_binaries(tmp_path, monkeypatch):
    """Where the binary takes fixed-point inputs_embeds (the Genie form's boundary; the table off the HTP,
    pack.qnn_embedding), the bundle carries Genie's embedding LUT, written from the compiled embedding model
    in that input's encoding, and genie_config.json names it."""
    import hashlib

    monkeypatch.setattr(genie, "LUT_CHUNK", 4)  # two lookups over the 6 ids: the chunk seam is crossed
    table = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    emb = qnn.write_embedding(table, tmp_path / "e", 8, [1, 1])
    info = {**PHONE_QNN, "embedding": {"dir": "embed", **{k: emb[k] for k in ("model", "bits", "bytes", "input",
                                                                               "output")}, "block_size": 32}}
    # the binary's input encoding: over the table's range, a little wider (the int8 rows stray past it)
    from pipeline.graphs import genie_io

    enc = genie_io.uint16_encoding(1.01 * float(table.min()), 1.01 * float(table.max()))
    scale, offset = enc["scale"], enc["offset"]
    io = {**IO, "inputs": [{**IO["inputs"][0], "dtype": "uint16"}] + IO["inputs"][1:],
          "boundary": {"inputs_embeds": enc}}
    out, result = _bundle(tmp_path, io=io, qnn_info=info,
                          extra={f"embed/{f}": (tmp_path / "e" / f).read_bytes() for f in emb["files"]})
    assert result["files"] == ["qnn.json", "genie_config.json", "htp_backend_ext_config.json", "tokenizer.json",
                               "embedding_lut.bin"]
    cfg = json.loads((out / "genie_config.json").read_text())
    check_schema(cfg, {**GENIE_SCHEMA, **DOCUMENTED, **ROPE_SCALING, **EMBEDDING})
    assert cfg["dialog"]["embedding"]["size"] == 64  # the hidden width (Genie's n-embd), not the vocabulary
    lut = out / "embedding_lut.bin"
    assert lut.stat().st_size == 6 * 64 * 2  # 16 bits an element
    rows = check_lut(lut, cfg, tmp_path / "compile_qnn" / "embed" / "model.onnx", range(6))
    # the int8 blocks' rows, not the float table's: the LUT carries what the binaries were verified with,
    # and its 16 bits sit far closer to those rows than the blocks to the table
    entry = json.loads((out / "qnn.json").read_text())["genie"]
    lut_e = entry["embedding_lut"]
    blocks_err, lut_err = np.abs(table - rows).max(), lut_e["max_abs_error"]
    assert lut_err <= cfg["dialog"]["embedding"]["quant-param"]["scale"] / 2 and 50 * lut_err < blocks_err
    assert lut_e["snr_db"] > 80 and lut_e["range"][0] < 0 < lut_e["range"][1]
    assert lut_e["sha256"] == hashlib.sha256(lut.read_bytes()).hexdigest()
    assert lut_e["rows"] == 6 and not any("token embedding" in m for m in entry["missing"])
    # in the binary's own encoding: Genie's requantization of a fixed-point LUT into its input is a copy
    assert cfg["dialog"]["embedding"]["quant-param"] == {"scale": scale, "offset": offset}
    codes = np.fromfile(lut, "<u2")
    assert 0 < codes.min() and codes.max() < 65535  # the widened range: nothing clipped


def test_parts_whose_names_sort_out_of_order_or_repeat_are_said(tmp_path):
    """Genie orders the parts of one graph by their names sorted as strings and keys buffers by name
    (its nsp-model.cpp): onnxruntime-qnn names each part's graph from a hash, so the order can come out wrong."""
    said = lambda names: [m for m in genie.missing(IO, names, tokenizer=True, lut=True, extra=[])
                          if m.startswith(("part order", "graph names repeat"))]
    assert said(["QNN_1_0", "QNN_2_0"]) == []
    assert said(["QNN_9_0", "QNN_10_0"])[0].startswith("part order")  # '10' sorts before '9'
    assert said(["QNN_1_0", "QNN_1_0"])[0].startswith("graph names repeat")


def test_a_prompt_binary_compiled_apart_is_said_only_where_the_deployed_precision_has_one():
    """Genie runs a prompt through an ar1 graph as well: a precision whose prompt graph the HTP refused
    (SmolLM2's w4a16) lacks nothing there; one with its own prompt binary has weights compiled apart."""
    io = {**IO, "prompt": {"tokens": 128}}
    said = lambda **kw: [m for m in genie.missing(io, ["g"], tokenizer=True, lut=True, extra=[], **kw)
                         if m.startswith("the prompt graph")]
    assert said(prompt_binary=False) == [] and "128 tokens a call" in said(prompt_binary=True)[0]


def test_the_spill_fill_buffer_is_the_one_the_binary_was_compiled_with(tmp_path):
    """onnxruntime-qnn records a binary's spill-fill buffer in its EPContext node (max_size): Genie is told
    that size, 0 where none was compiled (our compile's default)."""
    out, _ = _bundle(tmp_path, spill_fill=1 << 20)
    cfg = json.loads((out / "genie_config.json").read_text())
    assert cfg["dialog"]["engine"]["backend"]["QnnHtp"]["spill-fill-bufsize"] == 1 << 20


def test_soc_model_and_dsp_arch_per_device_are_qualcomms_published_ones(tmp_path):
    s24 = {**PHONE_QNN, "target": {"soc_model": "SM8650", "htp_arch": "v75", "soc_id": 57, "device": "galaxy_s24"}}
    out, _ = _bundle(tmp_path, qnn_info=s24, device="galaxy_s24")
    dev = json.loads((out / "htp_backend_ext_config.json").read_text())["devices"][0]
    assert (dev["soc_model"], dev["dsp_arch"]) == (57, "v75")
    with pytest.raises(genie.GenieError, match="Qualcomm publishes 69 / v79"):
        genie.htp_config({"soc_model": "SM8750", "htp_arch": "v75", "soc_id": 69})
    # the device configs agree with the published table
    from omegaconf import OmegaConf

    from tests.conftest import ROOT

    for name in ("galaxy_s24", "galaxy_s25"):
        q = OmegaConf.load(ROOT / "conf" / "device" / f"{name}.yaml").qnn
        assert genie.PUBLISHED_SOC[q.soc_model] == (q.soc_id, q.htp_arch)


def test_a_model_with_a_rotary_base_per_layer_type_says_which_one_genie_gets(tmp_path):
    gemma = {**{k: v for k, v in LLAMA.items() if k != "rope_parameters"}, "model_type": "gemma3_text",
             "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}
    enc, gaps = genie.positional_encoding(gemma, 32)
    assert enc == {"type": "rope", "rope-dim": 16, "rope-theta": 1000000} and "rope-scaling" not in enc
    assert len(gaps) == 1 and "one rope-theta" in gaps[0]
    # Phi-4-mini's: a partial rotary (3/4 of each head) with longrope, as Genie's sources read it (the
    # factor from the context extension: Genie's validator takes no max-position-embeddings)
    phi = {"head_dim": 128, "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    enc, gaps = genie.positional_encoding(phi, 128)
    assert enc["rope-dim"] == 48 and gaps == []
    assert enc["rope-scaling"] == {"rope-type": "longrope", "factor": 32.0, "short-factor": [1.0] * 48,
                                   "long-factor": [2.0] * 48, "original-max-position-embeddings": 4096}
    # factors that do not fit rope-dim, a scaling Genie does not take, a base with a fraction: each said
    phi["rope_scaling"]["short_factor"] = [1.0]
    assert "48" in genie.positional_encoding(phi, 128)[1][0]
    enc, gaps = genie.positional_encoding({"head_dim": 64, "rope_theta": 10000.5,
                                           "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 64)
    assert "rope-scaling" not in enc and "'yarn'" in gaps[0] and "int32" in gaps[1]


def test_a_tokenizer_without_bos_writes_minus_one_and_no_eos_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert genie.special_tokens(tmp_path) == {"bos": -1, "eos": [7], "source": genie.special_tokens(tmp_path)["source"]}
    (tmp_path / "config.json").write_text(json.dumps({}))
    with pytest.raises(genie.GenieError, match="no EOS token"):
        genie.special_tokens(tmp_path)


@pytest.mark.slow
@pytest.mark.optional
@pytest.mark.skipif(qnn.missing() is not None, reason=f"QNN toolchain absent: {qnn.missing()}")
def test_the_phone_builds_bundle_lists_its_binaries_in_order_and_ships_its_tokenizer(phone_build):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    repo, first = phone_build
    build = repo / "artifacts" / "galaxy_s25-embedded-speed"
    prof = build / "deploy_profile"
    for name in (genie.CONFIG, genie.HTP_CONFIG, genie.TOKENIZER, genie.LUT):
        assert (prof / name).is_file(), name
    # its sliding layers (5 of 6) in Genie's sliding-window cache group, its two rotary bases under Genie's
    # absolute positions: the bundle names the group and the encoding, and lists the Genie-form binary
    cfg = json.loads((prof / "genie_config.json").read_text())
    check_schema(cfg, {**ABSOLUTE, **DOCUMENTED, **EMBEDDING, **CACHE_GROUPS})
    check_schema(json.loads((prof / "htp_backend_ext_config.json").read_text()), HTP_SCHEMA)
    info = json.loads((build / "compile_qnn" / "qnn.json").read_text())
    form = info["genie"]
    assert form["built"] is True, form
    gio = json.loads((build / "compile_qnn" / form["io"]).read_text())
    engine = cfg["dialog"]["engine"]
    assert engine["model"]["positional-encoding"] == {"type": "absolute"} and "positions" in gio
    window = json.loads((build / "untie_head" / "config.json").read_text())["sliding_window"]
    assert engine["cache-groups"] == [
        {"version": 1, "prefix": "past_"},
        {"version": 1, "prefix": "swa_", "attention-mask-tensor-name": "swa_attention_mask",
         "longcontext": {"version": 1, "type": "sliding-window", "reserved-tokens": 0,
                         "sliding-window": {"version": 1, "window-size": window}}}]
    names = {v["name"]: v for v in gio["inputs"]}
    assert names["swa_attention_mask"]["dtype"] == names["attention_mask"]["dtype"] == "uint16"
    assert gio["boundary"]["swa_attention_mask"] == gio["boundary"]["attention_mask"]
    assert names["position_ids"]["dtype"] == "int32"
    bins = engine["model"]["binary"]["ctx-bins"]
    assert [(prof / b).resolve() for b in bins][:len(form["binaries"])] == [
        (build / "compile_qnn" / form["dir"] / b).resolve() for b in form["binaries"]]
    assert all((prof / b).is_file() for b in bins)
    ctx = cfg["dialog"]["context"]
    assert ctx["size"] == gio["context_length"] == 64 and ctx["n-vocab"] == 512
    assert ctx["bos-token"] == gio["bos_token_id"] and ctx["eos-token"] in (gio["eos_token_id"], gio["eos_token_id"][0])

    # tokenizer.json as Genie reads it (the tokenizers library) gives the build's own tokenizer's ids
    ours = AutoTokenizer.from_pretrained(str(build / "untie_head"), local_files_only=True)  # as `generate` loads it
    bundled = Tokenizer.from_file(str(prof / "tokenizer.json"))
    for text in ("def read_file(path):\n    return open(path).read()", "x = [1, 2, 3]  # ünïcode"):
        assert bundled.encode(text).ids == list(ours(text)["input_ids"]), text

    entry = json.loads((prof / "qnn.json").read_text())["genie"]
    assert entry["verified"] is False and entry["form"]["genie"] is True
    io_rules = ("first input", "inputs_embeds", "attention_mask", "swa_attention_mask", "position_ids", "KV",
                "key layout", "sliding", "token embedding")
    assert not [m for m in entry["missing"] if m.startswith(io_rules)], entry["missing"]
    assert "meets Genie's rules" in entry["run"]
    # one graph a part, named by onnxruntime-qnn; Genie orders the
    # parts by name, so the profile says so exactly where their names sort out of the parts' order
    names = [g["name"] for g in entry["graphs"]]
    assert all(n.startswith("QNNExecutionProvider") for n in names)
    assert len(set(names)) == len(names)
    assert any(m.startswith("part order") for m in entry["missing"]) == (names != sorted(names))
    assert cfg["dialog"]["engine"]["backend"]["QnnHtp"]["spill-fill-bufsize"] == 0
    assert "Genie bundle" in first.stderr + first.stdout and "UNVERIFIED" in first.stderr + first.stdout
