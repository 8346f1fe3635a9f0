"""The output head alone, one decode step (M = 1): every row at 8 bits against 8 bits on a share of the rows
and 4 on the rest, the logits put back in vocabulary order by GatherElements (what pipeline/graphs/gqa_graph.py
builds) or by Gather (what it does not: ONNX Runtime's CPU Gather along the last axis copies one element at a
time), and every row at 4 bits. Random codes of the model's head shape; passes interleaved; ms median
[min-max] and the bytes each reads.

    python benchmarks/head_rows.py --vocab 262144 --hidden 640     # Gemma 3 270M's head
    python benchmarks/head_rows.py --vocab 49152 --hidden 576      # SmolLM2-135M's
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def _matmul(helper, numpy_helper, rng, name: str, n: int, k: int, bits: int, group: int):
    blocks = k // group
    node = helper.make_node("MatMulNBits", ["x", f"{name}.B", f"{name}.scales"], [name], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=group, accuracy_level=4)
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, blocks, group * bits // 8), dtype=np.uint8), f"{name}.B"),
             numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 0.01, f"{name}.scales")]
    return [node], inits, n * k * bits // 8 + n * blocks * 4


def _session(v: int, k: int, n8: int, reorder: str, threads: int, group: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if n8 in (0, v):
        nodes, inits, nbytes = _matmul(helper, numpy_helper, rng, "logits", v, k, 8 if n8 else 4, group)
    else:
        n1, i1, b1 = _matmul(helper, numpy_helper, rng, "rows8", n8, k, 8, group)
        n2, i2, b2 = _matmul(helper, numpy_helper, rng, "rows4", v - n8, k, 4, group)
        pos = rng.permutation(v)
        nodes = n1 + n2 + [helper.make_node("Concat", ["rows8", "rows4"], ["both"], axis=-1)]
        if reorder == "GatherElements":
            inits_pos = [numpy_helper.from_array(pos.astype(np.int32).reshape(1, 1, v), "pos")]
            nodes.append(helper.make_node("GatherElements", ["both", "pos"], ["logits"], axis=-1))
        else:
            inits_pos = [numpy_helper.from_array(pos.astype(np.int64), "pos")]
            nodes.append(helper.make_node("Gather", ["both", "pos"], ["logits"], axis=-1))
        inits, nbytes = i1 + i2 + inits_pos, b1 + b2
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, v])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]), nbytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--group", type=int, default=32)
    ap.add_argument("--shares", default="16,8,4", help="the 8-bit rows as 1/n of the vocabulary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--passes", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20, help="calls timed per pass")
    a = ap.parse_args(argv)
    v, k = a.vocab, a.hidden
    arms = {"every row 8-bit": (v, "")}
    for share in (int(s) for s in a.shares.split(",")):
        arms[f"1/{share} 8-bit, GatherElements"] = (v // share, "GatherElements")
        arms[f"1/{share} 8-bit, Gather"] = (v // share, "Gather")
    arms["every row 4-bit"] = (0, "")
    sessions = {name: _session(v, k, n8, how, a.threads, a.group) for name, (n8, how) in arms.items()}
    x = np.random.default_rng(1).standard_normal((1, 1, k), dtype=np.float32)
    times = {name: [] for name in sessions}
    for _ in range(a.passes):
        for name, (sess, _) in sessions.items():
            sess.run(None, {"x": x})
            t = time.perf_counter()
            for _ in range(a.calls):
                sess.run(None, {"x": x})
            times[name].append((time.perf_counter() - t) / a.calls * 1e3)
    print(f"head [{v}, {k}], blocks of {a.group}, {a.threads} threads, {a.passes} passes of {a.calls} calls")
    print("| arm | MB read | ms a step, median [min-max] |\n|---|---|---|")
    for name, (_, nbytes) in sessions.items():
        ts = sorted(times[name])
        print(f"| {name} | {nbytes / 1e6:.1f} | {ts[len(ts) // 2]:.2f} [{ts[0]:.2f}-{ts[-1]:.2f}] |")


if __name__ == "__main__":
    main()
