"""The one contract every runtime of a built artifact implements.

A runtime is made from an artifact (its constructor: the artifact's folder or file,
the threads, the context where the runtime needs one) and then decodes one stream:

    reset()                 forget the stream (position 0)
    prefill(token_ids)      feed a prompt; the logits after its last token (batched_prefill: in one call)
    step(token_id)          feed one token; the logits after it (float32 [vocab])
    kv_bytes()              bytes its KV cache holds (0 where it cannot say)
    resident_bytes()        this process's resident memory now (counted pages, not allocations)
    generate_greedy(ids, n) reset, prompt, then n greedy tokens

Parity (stages/verify_parity.py), the benchmark's arms (pipeline/measure/bench_arm.py),
deploy_profile's settings sweeps (pipeline/measure/tune.py) and `python -m pipeline
generate` use runtimes only through it. The runtimes: OnnxDecoder (the fp32 ONNX step
and QDQ graphs on ONNX Runtime; the QNN HTP binary through its session,
pipeline/graphs/qnn.py), GqaDecoder (the ORT GQA graph), TorchReference (eager PyTorch,
the reference), tinygemm (an HF model with tinygemm linears, wrapped by TorchReference),
LlamaCppDecoder (llama.cpp), GenaiDecoder (onnxruntime-genai).
"""

from __future__ import annotations

# Defined in the device-side package (runtime/edgekiln_runtime/contract.py) so that GqaDecoder, which
# derives from it, installs on a device without this project; one definition, imported here by the name
# the project's runtimes and stages use.
from edgekiln_runtime.contract import ContextFull, Runtime, resident_bytes

__all__ = ["ContextFull", "Runtime", "resident_bytes"]
