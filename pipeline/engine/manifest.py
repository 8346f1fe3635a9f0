"""manifest.json: the contract between stages (as GGUF is between llama.cpp's tools).

Every artifact folder carries one. It names what made the folder (stage,
build, the full sha256 of the config the stage saw, its code and toolchain,
the content hashes of its inputs) and what is in it (every file's sha256 and
size). A stage reads an input only after `verify` has re-hashed every file
against the input's manifest: a modified, truncated, missing or extra file is
refused by name before anything uses it.

`timings` is what the run cost, never part of either hash (the content hash
covers the files, the config hash the key): {"started", "seconds",
"cpu_seconds", "peak_rss_bytes", "peak_rss_children_bytes"} (the kernel's
peak of the stage's process and the largest of its subprocesses' peaks:
pipeline/engine/run_stage.py `_cost`). Older manifests have only the first two.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from pipeline.engine.context import StageError
from pipeline.engine.layout import canonical_json, sha256_text

NAME = "manifest.json"
FORMAT = "edgekiln-manifest/1"
_CHUNK = 1 << 20


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """The file's sha256; `progress(n)` told of every n bytes read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return h.hexdigest()


def list_files(folder: Path, progress: Callable[[int], None] | None = None) -> dict[str, dict]:
    files = {}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for n in sorted(names):
            p = Path(root) / n
            rel = p.relative_to(folder).as_posix()
            if rel == NAME:
                continue
            files[rel] = {"sha256": sha256_file(p, progress), "bytes": p.stat().st_size}
    return files


def content_hash(files: dict[str, dict]) -> str:
    """One sha256 for a folder's content: what downstream manifests record."""
    return sha256_text(canonical_json({k: v["sha256"] for k, v in files.items()}))


def config_hash(key: dict) -> str:
    """Full sha256 (never truncated) of everything that shapes a stage's output."""
    return sha256_text(canonical_json(key))


def write(folder: Path, *, stage: str, build: str, key: dict, result: dict, timings: dict,
          progress: Callable[[int], None] | None = None) -> dict:
    files = list_files(folder, progress)
    manifest = {
        "format": FORMAT,
        "stage": stage,
        "build": build,
        "config_hash": config_hash(key),
        "content_sha256": content_hash(files),
        "key": key,
        "files": files,
        "result": result,
        "timings": timings,
    }
    (folder / NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read(folder: Path) -> dict:
    path = folder / NAME
    if not path.is_file():
        raise StageError(f"{folder}: no {NAME}: not an artifact of this pipeline (or a half-written one)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StageError(f"{path}: unreadable manifest ({e.__class__.__name__}): refusing the artifact")
    if manifest.get("format") != FORMAT:
        raise StageError(f"{path}: manifest format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify(folder: Path, expect_stage: str | None = None, progress: Callable[[int], None] | None = None) -> dict:
    """Re-hash every file against the manifest; refuse any mismatch by name. `progress(n)`: as sha256_file's."""
    manifest = read(folder)
    if expect_stage and manifest.get("stage") != expect_stage:
        raise StageError(
            f"{folder}: manifest says stage {manifest.get('stage')!r}, expected {expect_stage!r}"
        )
    recorded = manifest["files"]
    actual_names = set()
    for root, dirs, names in os.walk(folder):
        for n in names:
            rel = (Path(root) / n).relative_to(folder).as_posix()
            if rel != NAME:
                actual_names.add(rel)
    missing = sorted(set(recorded) - actual_names)
    if missing:
        raise StageError(f"{folder / missing[0]}: listed in the manifest but missing")
    extra = sorted(actual_names - set(recorded))
    if extra:
        raise StageError(f"{folder / extra[0]}: not in the manifest (added after the stage ran)")
    for rel, meta in sorted(recorded.items()):
        p = folder / rel
        if p.stat().st_size != meta["bytes"] or sha256_file(p, progress) != meta["sha256"]:
            raise StageError(f"{p}: sha256 does not match its manifest (modified or truncated)")
    if content_hash(recorded) != manifest["content_sha256"]:
        raise StageError(f"{folder / NAME}: content hash does not match its file list (edited manifest)")
    return manifest
