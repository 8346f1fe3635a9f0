"""edgekiln-runtime: runs an edgekiln build's ONNX Runtime artifact (a pack folder: the GQA graph, io.json,
the tokenizer) on a device, with onnxruntime, numpy and tokenizers and nothing of the build toolchain.

    python -m edgekiln_runtime PACK_FOLDER "prompt"        # greedy text, streamed
    from edgekiln_runtime import GqaDecoder                 # the decode API the build's benchmark measures

The same folder also runs in onnxruntime-genai (its genai_config.json): this package is for a device that
wants the build's own runner (the one its parity and benchmark stages ran) instead.
"""

from __future__ import annotations

__version__ = "0.1.0"

from edgekiln_runtime.contract import ContextFull, Runtime  # noqa: E402
from edgekiln_runtime.gqa import GqaDecoder  # noqa: E402
from edgekiln_runtime.io import ArtifactError, read_io  # noqa: E402

__all__ = ["ArtifactError", "ContextFull", "GqaDecoder", "Runtime", "read_io", "__version__"]
