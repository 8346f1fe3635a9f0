"""The pack folder's contract as the runtime reads it: io.json's format and the KV names of each
input/output layout. The graph builder (pipeline/graphs/gqa_graph.py) writes folders to it and imports
these names from here, so the writer and the reader cannot drift apart."""

from __future__ import annotations

import json
from pathlib import Path

IO_FORMAT = "edgekiln-gqa/1"
# The KV inputs and outputs of each layout, %d the layer. "genai": onnxruntime-genai's default names (its
# Config::Defaults: past_key_values.%d.key in, present.%d.key out), so its config needs no name map.
KV_NAMES = {
    "genai": {"past_key": "past_key_values.%d.key", "past_value": "past_key_values.%d.value",
              "present_key": "present.%d.key", "present_value": "present.%d.value"},
    "edgekiln": {"past_key": "past_key_%d", "past_value": "past_value_%d",
                 "present_key": "present_key_%d", "present_value": "present_value_%d"},
}

# The speculative decoder's graph input (how many of the last rows get logits; an overridable initializer,
# 1 when not fed) and its output, those rows' logits [1, R, V] (pipeline/graphs/gqa_graph.py: _last_rows).
ROW_LOGITS_IO = {"input": "logits_rows", "output": "row_logits"}


class ArtifactError(ValueError):
    """A folder this runtime cannot run (not a pack folder, or one of another format)."""


def read_io(folder) -> dict:
    """The folder's io.json, checked to be one this runtime reads."""
    path = Path(folder) / "io.json"
    if not path.is_file():
        raise ArtifactError(f"{folder}: no io.json (point at a build's pack folder, "
                            "artifacts/<build>/pack, or the pack/ of a pulled version)")
    io = json.loads(path.read_text())
    if io.get("format") != IO_FORMAT:
        raise ArtifactError(f"{folder}: io.json format {io.get('format')!r}, expected {IO_FORMAT!r} "
                            "(a GQA graph's pack folder: the x86 and ARM ONNX Runtime builds)")
    return io
