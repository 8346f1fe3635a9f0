"""Text for calibration and evaluation: the embedded corpus's held-out tail, or the user's own files.

A text source is either the built-in name `stdlib_docstrings_heldout` (the
embedded corpus's held-out tail: pipeline/sources/corpus.py) or a local path:

- a `.txt` / `.md` file: one document (its whole text);
- a `.jsonl` file: one document per record, the record's `field` (default
  "text"); with `chat_template=True` the record's `field` holds a chat
  (a list of {"role", "content"} messages) rendered with the checkpoint's own
  chat template (`tokenizer.apply_chat_template`), as an instruct model is
  meant to read it;
- a folder: every such file in it, sorted by name.

Each document is framed as the tokenizer frames one: BOS before it where the
tokenizer has one, EOS after it (the embedded corpus is framed the same way),
then the documents are joined into one token stream that windows are cut from.
A chat rendered by the template carries its own special tokens, so it gets no
extra BOS.

`overlap(a, b, n)` says whether two token streams share any run of `n`
tokens: the evaluation text must not contain calibration text (an overlap is
refused by the parity stage).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

BUILTIN = "stdlib_docstrings_heldout"
TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
OVERLAP_TOKENS = 32  # a shared run this long is the same text, not a common phrase


class TextDataError(ValueError):
    """A text source that cannot be read as asked (one line, naming the file and the fix)."""


def is_builtin(source: str) -> bool:
    return str(source) == BUILTIN


def files_of(source: str | Path) -> list[Path]:
    """The text files a user source names (a file, or a folder's files), or TextDataError."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix not in TEXT_SUFFIXES + JSONL_SUFFIXES:
            raise TextDataError(f"{p}: not a text file this reads ({', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)})")
        return [p]
    if p.is_dir():
        found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in TEXT_SUFFIXES + JSONL_SUFFIXES)
        if not found:
            raise TextDataError(f"{p}: no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files in the folder")
        return found
    raise TextDataError(f"{p}: no such file or folder (a text source is {BUILTIN!r} or a local path)")


def _records(path: Path, field: str) -> Iterable:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise TextDataError(f"{path}:{n}: not JSON ({err.msg})") from None
            if not isinstance(rec, dict) or field not in rec:
                raise TextDataError(f"{path}:{n}: no field {field!r} (set the source's field to the one "
                                    f"holding the text)")
            yield rec[field]


def documents(tokenizer, source: str | Path, field: str = "text", chat_template: bool = False) -> list[list[int]]:
    """Token ids of every document of a user source, each framed with BOS / EOS (module docstring)."""
    if chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise TextDataError("chat_template=true but the checkpoint's tokenizer has no chat template")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for path in files_of(source):
        if path.suffix in TEXT_SUFFIXES:
            texts, chats = [path.read_text(encoding="utf-8")], []
        elif chat_template:
            texts, chats = [], list(_records(path, field))
        else:
            texts, chats = list(_records(path, field)), []
        for t in texts:
            if not isinstance(t, str):
                raise TextDataError(f"{path}: field {field!r} holds {type(t).__name__}, not text (a chat needs "
                                    f"chat_template=true)")
            ids = tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]
            if ids:
                out.append(([bos] if bos is not None else []) + list(ids) + ([eos] if eos is not None else []))
        for chat in chats:
            if not isinstance(chat, list):
                raise TextDataError(f"{path}: with chat_template=true, field {field!r} must hold a list of "
                                    f"{{role, content}} messages")
            ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=False)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding (a mapping, not a dict)
                ids = ids["input_ids"]
            if ids:
                out.append(list(ids) + ([eos] if eos is not None and ids[-1] != eos else []))
    if not out:
        raise TextDataError(f"{source}: no text in it")
    return out


def stream(tokenizer, source: str | Path, field: str = "text", chat_template: bool = False) -> tuple[list[int], dict]:
    """The source's documents joined into one token stream, and facts to record (files, sha256 of the ids)."""
    docs = documents(tokenizer, source, field, chat_template)
    ids = [t for d in docs for t in d]
    return ids, {"source": str(source), "files": [str(p) for p in files_of(source)], "documents": len(docs),
                 "tokens": len(ids), "field": field, "chat_template": bool(chat_template),
                 "ids_sha256": ids_sha256(ids)}


def prompts(source: str | Path, field: str = "text") -> list[str]:
    """Parity prompts from a user's file: a .txt / .md file's non-empty lines, or a .jsonl file's `field` per
    record (a prompt may then hold newlines)."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise TextDataError(f"{path}: no such file (a prompts file is one prompt a line, or .jsonl records)")
    if path.suffix in JSONL_SUFFIXES:
        out = [str(p) for p in _records(path, field)]
    elif path.suffix in TEXT_SUFFIXES:
        out = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    else:
        raise TextDataError(f"{path}: not a prompts file this reads ({', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)})")
    out = [p for p in out if p.strip()]
    if not out:
        raise TextDataError(f"{path}: no prompts in it")
    return out


def ids_sha256(ids: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def _runs(ids: Sequence[int], n: int) -> set[bytes]:
    a = np.asarray(ids, dtype="<i4")
    if a.size < n:
        return set()
    view = np.lib.stride_tricks.sliding_window_view(a, n)
    return {hashlib.blake2b(row.tobytes(), digest_size=12).digest() for row in view}


def overlaps(texts: Sequence[Sequence[int]], reference: Sequence[int], n: int = OVERLAP_TOKENS) -> list[int]:
    """For each token sequence of `texts`, how many of its n-token runs also occur in `reference` (0: none);
    the reference's runs are hashed once."""
    other = _runs(reference, n)
    return [sum(1 for r in _runs(a, n) if r in other) for a in texts]


def overlap(a: Sequence[int], b: Sequence[int], n: int = OVERLAP_TOKENS) -> int:
    """How many n-token runs of `a` also occur in `b` (0: the two texts share no such run)."""
    return overlaps([a], b, n)[0]


def heldout(src: Path, tokenizer, log=None) -> tuple[list[int], dict]:
    """The embedded corpus's held-out token ids under this checkpoint's tokenizer, framed as training framed
    them ([BOS, *ids, EOS] per docstring), and facts to record. For the embedded model (training_report.json
    beside the checkpoint) the held-out fraction is the one it was trained with, and the corpus hash and
    held-out token count are checked against it: this text was never trained on."""
    from pipeline.sources import corpus

    src = Path(src)
    report_path = src / "training_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    fraction = corpus.DEFAULT_HELDOUT_FRACTION
    if report is not None:
        fraction = float(report.get("recipe", {}).get("heldout_fraction", fraction))
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None or eos is None:
        raise TextDataError("the checkpoint's tokenizer has no BOS or EOS token: cannot frame the corpus as training did")

    def encode(docs):
        return tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]

    try:
        held, facts = corpus.heldout_tokens(encode, bos, eos, fraction)
    except corpus.CorpusError as e:
        raise TextDataError(str(e)) from None
    facts["trained_on_this_corpus"] = report is not None
    if report is not None:
        trained_sha = report.get("corpus", {}).get("sha256")
        if trained_sha and trained_sha != facts["corpus_sha256"]:
            raise TextDataError(
                f"this Python's stdlib docstrings (sha256 {facts['corpus_sha256'][:12]}) are not the corpus the model "
                f"was trained on ({trained_sha[:12]}): the held-out split would not be held out"
            )
        trained_held = report.get("split", {}).get("heldout_tokens")
        if trained_held is not None and int(trained_held) != len(held):
            raise TextDataError(
                f"held-out split has {len(held)} tokens under the checkpoint's tokenizer, training held out "
                f"{trained_held}: the split does not reproduce"
            )
    elif log is not None:
        log("no training_report.json: the checkpoint was not trained here; using the corpus tail "
            f"({fraction:.0%}) as calibration text")
    return held, facts
