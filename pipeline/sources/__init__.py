"""What a build reads: checkpoint files and their facts (model_facts, counted from
headers without loading), GGUF checkpoints, tensor files written a tensor at a time,
calibration and evaluation text (textdata, the built-in corpus), the KV a config needs
(kv_budget: what the deploy profile sizes and the default context is bounded by). Imports nothing else of
pipeline."""

import os
from pathlib import Path


def user_cache() -> Path:
    """The per-user folder outside any checkout ($EDGEKILN_HOME, default ~/.cache/edgekiln): the fetched
    llama.cpp converter (pipeline/toolchains/converter.py), the parsed corpus (corpus.py). Nothing a stage
    writes as its output lives here."""
    return Path(os.environ.get("EDGEKILN_HOME") or Path.home() / ".cache" / "edgekiln").expanduser()
