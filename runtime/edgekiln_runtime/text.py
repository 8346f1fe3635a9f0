"""Text in and out of a pack folder: its tokenizer.json through the `tokenizers` library (no
transformers on the device), prompts framed as the build's parity stage framed them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, List, Optional

from edgekiln_runtime.io import ArtifactError


def frame_prompt(encode: Callable[[str, bool], List[int]], text: str, bos_id: Optional[int],
                 add_bos_token: bool, family: str) -> List[int]:
    """`text`'s ids with BOS prepended where the model uses one: its tokenizer adds it by itself
    (`encode(text, True)` starts with it), its tokenizer config says add_bos_token, or it is a Gemma
    (trained with BOS always). `encode(text, add_special_tokens)` is any tokenizer's; the parity
    stage (stages/verify_parity.py) frames its prompts with this rule through transformers' tokenizer,
    so a device framing a prompt here feeds the ids parity checked."""
    plain = [int(i) for i in encode(text, False)]
    if bos_id is None:
        return plain
    special = list(encode(text, True))
    uses_bos = special[:1] == [bos_id] or bool(add_bos_token) or str(family).startswith("gemma")
    return ([int(bos_id)] if uses_bos else []) + plain


class FolderTokenizer:
    """The pack folder's tokenizer.json (and tokenizer_config.json's BOS settings), as `tokenizers` reads it."""

    def __init__(self, folder, io: dict):
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ArtifactError(f"{folder}: no tokenizer.json (a pack folder built since the genai layout has one)")
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        entry = self.config.get("bos_token")
        entry = entry.get("content") if isinstance(entry, dict) else entry
        bos = self.tok.token_to_id(entry) if isinstance(entry, str) else None
        if bos is None and io.get("bos_token_id") is not None:
            bos = int(io["bos_token_id"])
        self.bos_id = bos
        self.family = str(io.get("family", ""))

    def encode(self, text: str, add_special_tokens: bool) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def prompt_ids(self, text: str) -> List[int]:
        return frame_prompt(self.encode, text, self.bos_id, bool(self.config.get("add_bos_token")), self.family)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)
