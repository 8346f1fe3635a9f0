"""The embedded model's corpus and its held-out split, shared by training and calibration.

The embedded model (stages/model.py) is trained on the docstrings of Python's
own pure-Python standard library; the calibrate stage feeds GPTQ from the
*held-out* part of the same corpus, so calibration data is real text of the
model's domain that the model was never trained on. Both sides must therefore
agree exactly on the text and on where the split falls; this module is that
single definition.

The split is token-level, not text-level: the corpus is tokenized document by
document, each document framed as ``[BOS, *ids, EOS]`` and concatenated into
one stream, and the held-out set is the *tail* of that stream,
``int(len(stream) * fraction)`` tokens (the last modules alphabetically).
A character-level split would not fall on the same token boundary, so it
could not reproduce the training split; the held-out part may start in the
middle of a docstring, exactly as in training.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from pathlib import Path
from typing import Callable, Sequence

# The held-out fraction of the embedded recipe's defaults (TRAIN_DEFAULTS in
# stages/model.py). A trained checkpoint records the value it used in
# training_report.json (recipe.heldout_fraction); prefer that.
DEFAULT_HELDOUT_FRACTION = 0.05

# Top-level stdlib folders that are not library prose: tests, the IDLE app and
# demos, installed third-party packages, vendored wheels.
STDLIB_SKIP = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo",
    "lib2to3", "ensurepip", "pydoc_data", "__pycache__", "config-3",
})

DOC_SEPARATOR = "\n\n"


class CorpusError(Exception):
    """The corpus cannot be built or split (no stdlib sources, too short a stream)."""


def stdlib_root() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The pure-Python stdlib sources the corpus reads, sorted by relative path."""
    root = stdlib_root() if root is None else Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames
            if d not in STDLIB_SKIP and not d.startswith((".", "config-")) and not d.startswith("test")
        ]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith("test_")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return files


def stdlib_docstrings(root: Path | None = None) -> tuple[list[str], int]:
    """Docstrings of the standard library (see `_parse_docstrings`), a fresh list each call: parsed once per
    process and root, and kept on disk under the sources' own hash (`_memo`), since parsing the stdlib
    takes 3-4 s and a build's stages each read the corpus."""
    docs, n_files = _stdlib_docstrings(str(stdlib_root() if root is None else root))
    return list(docs), n_files


def _memo(files: list[Path], root: Path) -> Path:
    """The memo of these sources' docstrings: a file named by the sha256 of this module's own source (what
    extracts them), the Python that parses them (its ast) and every source's path and bytes (0.03 s to read
    and hash): a stale memo is never read, it is another file."""
    import sys

    from pipeline.sources import user_cache

    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(f"\0{sys.implementation.name}\0{sys.version}\0".encode())
    for path in files:
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return user_cache() / "corpus" / f"stdlib-docstrings-{h.hexdigest()[:32]}.json"


@functools.lru_cache(maxsize=2)
def _stdlib_docstrings(root: str) -> tuple[tuple[str, ...], int]:
    """The parsed docstrings, from the memo where it holds these exact sources, else parsed and the memo
    written (atomically; an unwritable cache folder only costs the parse next time)."""
    import json

    files = stdlib_files(Path(root))
    if not files:
        raise CorpusError(f"no standard-library sources under {root}: the embedded corpus needs them")
    memo = _memo(files, Path(root))
    try:
        kept = json.loads(memo.read_text(encoding="utf-8"))
        return tuple(kept["docs"]), int(kept["files"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, or unreadable: parse
    docs = _parse_docstrings(files)
    tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"docs": docs, "files": len(files)}), encoding="utf-8")
        os.replace(tmp, memo)
    except OSError:  # unwritable or full: parsed again next time, and no partial file left behind
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return tuple(docs), len(files)


def _parse_docstrings(files: list[Path]) -> list[str]:
    """Docstrings of the standard library's pure-Python modules, in a fixed order.

    Files sorted by path; within a file, module, class and function docstrings
    in source order. Whitespace is cleaned (`ast.get_docstring` dedents;
    trailing spaces and runs of blank lines are dropped) and exact duplicates
    are kept once, so boilerplate ("Return self.") neither dominates the corpus
    nor leaks into the held-out split.
    """
    import ast
    import re

    def in_order(node):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        for child in ast.iter_child_nodes(node):
            yield from in_order(child)

    docs, seen = [], set()
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are deliberately unparsable or not UTF-8
        for node in in_order(tree):
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                continue
            doc = "\n".join(line.rstrip() for line in doc.splitlines())
            doc = re.sub(r"\n{3,}", "\n\n", doc).strip()
            if len(doc) < 8 or doc in seen:
                continue
            seen.add(doc)
            docs.append(doc)
    return docs


def stdlib_docstring_corpus() -> str:
    """The corpus as one text: the docstrings joined by a blank line.

    Its sha256 (`corpus_sha256`) is what training_report.json records as
    corpus.sha256.
    """
    docs, _ = stdlib_docstrings()
    return DOC_SEPARATOR.join(docs)


def corpus_sha256(docs: Sequence[str]) -> str:
    return hashlib.sha256(DOC_SEPARATOR.join(docs).encode("utf-8")).hexdigest()


def token_stream(encoded: Sequence[Sequence[int]], bos_id: int, eos_id: int) -> list[int]:
    """Per-document token ids framed as [BOS, *ids, EOS] and concatenated."""
    stream: list[int] = []
    for ids in encoded:
        stream += [bos_id, *ids, eos_id]
    return stream


def heldout_size(n_tokens: int, fraction: float) -> int:
    """How many tokens of a stream of `n_tokens` are held out: int(n * fraction)."""
    if not 0 < fraction < 1:
        raise CorpusError(f"held-out fraction {fraction} must be in (0, 1)")
    n_held = int(n_tokens * fraction)
    if n_held < 1 or n_held >= n_tokens:
        # tokens[:-0] would be empty and tokens[-0:] the whole stream: the
        # held-out set would silently be everything that was trained on.
        raise CorpusError(f"a stream of {n_tokens} tokens has no proper held-out split at fraction {fraction}")
    return n_held


def heldout_split(tokens, fraction: float):
    """(train, held-out) for a token stream (list or 1-D tensor): the tail is held out."""
    n_held = heldout_size(len(tokens), fraction)
    return tokens[:-n_held], tokens[-n_held:]


def heldout_tokens(
    encode: Callable[[list[str]], list[list[int]]],
    bos_id: int,
    eos_id: int,
    fraction: float = DEFAULT_HELDOUT_FRACTION,
    docs: list[str] | None = None,
) -> tuple[list[int], dict]:
    """The held-out tail of the corpus as token ids, plus facts to record.

    `encode` maps a list of documents to their ids with no special tokens
    (SentencePiece's `encode`, or an HF tokenizer with add_special_tokens=False).
    """
    if docs is None:
        docs, _ = stdlib_docstrings()
    stream = token_stream(encode(docs), bos_id, eos_id)
    train, held = heldout_split(stream, fraction)
    facts = {
        "corpus_sha256": corpus_sha256(docs),
        "docstrings": len(docs),
        "stream_tokens": len(stream),
        "train_tokens": len(train),
        "heldout_tokens": len(held),
        "heldout_fraction": fraction,
    }
    return list(held), facts
