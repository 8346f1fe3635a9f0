"""Runtime settings chosen by measurement on the host that will run them.

A short sweep: every candidate setting gets its own session, loaded once; then
rounds of (prefill a fixed prompt, decode a fixed number of tokens) run
interleaved across candidates (A B C A B C ...), so drift hits all alike. The
pick is the best median decode tok/s; a candidate within the noise floor of a
cheaper one (fewer threads, no spinning) loses to it, so a figure that is no
difference never buys a core. Every candidate's spread is kept as evidence.

Run only where the host is the target (pipeline/engine/devices.py: the probed class
equals the build's device class); a cross-build takes the device config's
settings and says so.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from pipeline.measure.stats import spread


def candidates(physical_cores: int, spin_choices: Sequence[bool] = (False, True)) -> list[dict]:
    """Thread counts 1..cores (powers of two and the core count) x spinning."""
    counts = sorted({c for c in (1, 2, 4, 8, 16, 32, 64) if c <= physical_cores} | {max(1, physical_cores)})
    return [{"intra_op_num_threads": t, "allow_spinning": s} for t in counts for s in spin_choices
            if not (t == 1 and s)]  # spinning only matters when threads wait on each other


def with_accuracy_level(src_dir, level: int, dst_dir) -> None:
    """A copy of a GQA graph artifact (model.onnx + its data + io.json) with every MatMulNBits at `level`.

    The level is a node attribute: ONNX Runtime has no session option that
    overrides it (its `session.qdq_matmulnbits_accuracy_level` applies only to
    graphs it fuses from DequantizeLinear + MatMul), so a level is measured on
    its own copy of the graph."""
    import shutil
    from pathlib import Path

    import onnx

    from pipeline.sources.tensorfile import load_onnx

    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    model = load_onnx(src / "model.onnx")
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(attrs + [onnx.helper.make_attribute("accuracy_level", int(level))])
    # laid out as the artifact is (external data, which the runtime maps and pages out)
    onnx.save(model, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    shutil.copy2(src / "io.json", dst / "io.json")


def with_kv_dtype(src_dir, dtype: str, dst_dir) -> None:
    """A copy of a GQA graph artifact with its KV cache (and the attention's rope caches) in `dtype`
    ("float16" or "float32"): what pack.ort_kv_dtype would build, made from the built graph so the
    deploy profile can measure it on the target without the build's inputs.

    The builder (pipeline/graphs/gqa_graph.py) casts q/k/v to fp16 in front of each GroupQueryAttention
    and its output back to fp32 (an fp32-cache graph has no casts); here those casts are pointed at
    `dtype` (a cast to the type a tensor already has is one ONNX Runtime's optimizer removes) or, from
    fp32 to fp16, inserted; the rope caches and the KV inputs/outputs retyped, io.json's kv_dtype and
    I/O rewritten. tests/test_gqa_graph.py checks the copy computes what
    the builder's own graph of that dtype computes."""
    import json
    import shutil
    from pathlib import Path

    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper

    from pipeline.sources.tensorfile import load_onnx

    proto, np_dtype = {"float16": (TensorProto.FLOAT16, np.float16), "float32": (TensorProto.FLOAT, np.float32)}[dtype]
    src, dst = Path(src_dir), Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    io = json.loads((src / "io.json").read_text())
    model = load_onnx(src / "model.onnx")
    g = model.graph
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    rope = {name for n in gqa for name in n.input[7:9] if name}
    casts = {n.output[0]: n for n in g.node if n.op_type == "Cast"}
    consumed = {name for n in g.node for name in n.input}
    nodes = []
    for node in g.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        for j in range(3):  # q, k, v: the builder's casts pointed at dtype, or new ones where it has none
            name = node.input[j]
            if not name:  # q|k|v packed into `query`: `key` and `value` are empty
                continue
            if name in casts:
                cast = casts[name]
                attrs = [a for a in cast.attribute if a.name != "to"]
                del cast.attribute[:]
                cast.attribute.extend(attrs + [onnx.helper.make_attribute("to", proto)])
            elif proto == TensorProto.FLOAT16:
                nodes.append(onnx.helper.make_node("Cast", [name], [f"{name}.kv16"], f"{name}.kv16", to=proto))
                node.input[j] = f"{name}.kv16"
        nodes.append(node)
        out = node.output[0]
        if proto == TensorProto.FLOAT16 and not any(c.input[0] == out for c in casts.values()) and out in consumed:
            node.output[0] = f"{out}.kv16"
            nodes.append(onnx.helper.make_node("Cast", [f"{out}.kv16"], [out], f"{out}.kv32", to=TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)
    for i, init in enumerate(g.initializer):
        if init.name in rope:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np_dtype), init.name))
    kv = {v % i for i in range(len(io["layers"])) for v in io["kv_names"].values()} if "kv_names" in io else None
    for vi in list(g.input) + list(g.output):
        if (kv is not None and vi.name in kv) or (kv is None and ("past_" in vi.name or "present" in vi.name)):
            vi.type.tensor_type.elem_type = proto
    keep = [vi for vi in g.value_info if vi.type.tensor_type.elem_type not in (TensorProto.FLOAT16,)]
    del g.value_info[:]
    g.value_info.extend(keep)  # the retyped intermediates are inferred again by the runtime
    onnx.save(model, str(dst / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=1024)
    io["kv_dtype"] = dtype
    if isinstance(io.get("options"), dict):
        io["options"]["kv_dtype"] = dtype
    names = kv or set()
    for entry in io.get("inputs", []) + io.get("outputs", []):
        if entry["name"] in names:
            entry["dtype"] = dtype
    (dst / "io.json").write_text(json.dumps(io, indent=2) + "\n")
    for side in src.iterdir():  # the tokenizer and genai's config travel as they are
        if side.is_file() and side.name not in ("model.onnx", "model.onnx.data", "io.json", "manifest.json"):
            shutil.copy2(side, dst / side.name)


def _cost(c: dict) -> tuple:
    return (c["intra_op_num_threads"], c["allow_spinning"])


def sweep(make: Callable[[dict], object], settings: list[dict], prompt: Sequence[int], decode_tokens: int,
          rounds: int = 3, noise_floor: float = 0.08, progress: Callable[[str], None] | None = None,
          cost: Callable[[dict], tuple] = _cost) -> dict:
    """Measure each setting (make(setting) -> decoder with reset/step[/prefill]); pick one."""
    import numpy as np

    if rounds < 1 or decode_tokens < 1 or not settings:
        raise ValueError("need at least one round, one decode token and one setting")
    decoders = [make(s) for s in settings]
    rates: list[list[float]] = [[] for _ in settings]
    for r in range(rounds):
        for i, dec in enumerate(decoders):
            dec.reset()
            tok = int(np.argmax(dec.prefill(list(prompt))))
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                tok = int(np.argmax(dec.step(tok)))
            rates[i].append(decode_tokens / (time.perf_counter() - t0))
            if progress:
                progress(f"round {r + 1}/{rounds}: {settings[i]}")
    table = [{"setting": s, "decode_tok_s": spread(v)} for s, v in zip(settings, rates)]
    # Cheapest first; a costlier setting must beat the best so far by more than the noise floor.
    best = None
    for row in sorted(table, key=lambda row: cost(row["setting"])):
        if best is None or row["decode_tok_s"]["median"] > best["decode_tok_s"]["median"] * (1 + noise_floor):
            best = row
    return {"candidates": table, "chosen": best["setting"], "chosen_decode_tok_s": best["decode_tok_s"],
            "rounds": rounds, "prompt_tokens": len(prompt), "decode_tokens": decode_tokens,
            "noise_floor": noise_floor, "rule": "cheapest setting (the first, by cost) unless another is faster by "
                                                "more than the noise floor (median decode tok/s)"}
