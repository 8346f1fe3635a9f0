"""The small files that let an artifact folder serve on its own: the model's
config and its tokenizer, copied beside the weights or graph a stage writes."""

from __future__ import annotations

import shutil
from pathlib import Path

SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def copy_side_files(src: Path, dst: Path, names: tuple[str, ...] = SIDE_FILES) -> list[str]:
    """Copy those of `names` that exist in `src` into `dst`; the names copied."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
