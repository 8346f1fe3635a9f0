"""llama.cpp's HF -> GGUF converter: where it is, what it is, and fetching it.

The converter (`convert_hf_to_gguf.py`, its `conversion/` package and the
gguf-py beside it) is Python, but no wheel ships it: not `gguf`, not
llama-cpp-python's wheel. Its source distribution does (vendor/llama.cpp), and
the package registry serves that. So

    python -m pipeline.toolchains.converter fetch

downloads the pinned llama-cpp-python sdist with pip (whatever index pip is
configured with) and keeps only the converter's files (about 2 MB) under
`$EDGEKILN_HOME/llama.cpp-converter/<version>/` (default
`~/.cache/edgekiln`). Building llama-cpp-python itself (the runtime, a
~15-minute compile) is not needed for conversion.

Where a stage looks, in order: `$EDGEKILN_LLAMACPP_SRC` (any llama.cpp tree),
the fetched copy, the installed llama-cpp-python package. `identity()` is the
sha256 of the converter's Python files: the probe records it in the toolchain
key of the stages that convert, so a different converter re-runs them and the
path it lives at does not (stdlib only, cheap: it runs on every probe).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SCRIPT = "convert_hf_to_gguf.py"
# The llama-cpp-python release whose vendored llama.cpp tree is fetched: the
# version this project measured (it converts Gemma 3, Llama and Qwen3).
PINNED = "0.3.36"
KEEP = (SCRIPT, "conversion", "gguf-py", "LICENSE")
ENV_SRC = "EDGEKILN_LLAMACPP_SRC"


def home() -> Path:
    from pipeline.engine.layout import user_cache

    return user_cache()


def fetched_tree(version: str = PINNED) -> Path:
    return home() / "llama.cpp-converter" / version


def _installed_tree() -> Path | None:
    """The converter inside an installed llama-cpp-python, found from its file list (no import)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(SCRIPT):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p.parent
    return None


def find(src: str | None = None) -> Path | None:
    """The llama.cpp tree holding the converter: `src` if given, else the lookup order above."""
    if src:
        tree = Path(src).expanduser()
        return tree if (tree / SCRIPT).is_file() else None
    env = os.environ.get(ENV_SRC)
    if env:
        tree = Path(env).expanduser()
        return tree if (tree / SCRIPT).is_file() else None
    tree = fetched_tree()
    if (tree / SCRIPT).is_file():
        return tree
    return _installed_tree()


def missing_message(src: str | None = None) -> str:
    where = src or os.environ.get(ENV_SRC)
    if where:
        return f"llama.cpp's {SCRIPT} is not in {where}"
    return (f"llama.cpp's {SCRIPT} not found (no wheel ships it): run `python -m pipeline.toolchains.converter fetch` "
            f"(pip downloads the llama-cpp-python {PINNED} sdist, ~75 MB, and keeps its 2 MB converter), "
            f"or set {ENV_SRC} to a llama.cpp tree")


def _files(tree: Path) -> list[Path]:
    out = [tree / SCRIPT]
    for sub in ("conversion", "gguf-py/gguf"):
        d = tree / sub
        if d.is_dir():
            out += sorted(p for p in d.rglob("*.py") if "__pycache__" not in p.parts)
    return out


def identity(src: str | None = None) -> str:
    """sha256 (first 16 hex) of the converter's Python files, by path relative to the tree; "absent" if none."""
    tree = find(src)
    if tree is None:
        return "absent"
    h = hashlib.sha256()
    for p in _files(tree):
        h.update(str(p.relative_to(tree)).encode() + b"\0")
        h.update(p.read_bytes())
    return f"sha256:{h.hexdigest()[:16]}"


def download_sdist(version: str, into: Path, log=print) -> Path:
    """The llama-cpp-python `version` source distribution (~75 MB), downloaded by pip (whatever index it is
    configured with) into `into`: the one place the llama.cpp tree comes from (the converter here, the
    llama-server build in llama_server.py). RuntimeError with pip's last line where it cannot."""
    log(f"pip download llama-cpp-python=={version} (source distribution, ~75 MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
           "--no-binary", ":all:", "--no-build-isolation", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sdists = sorted(into.glob("llama_cpp_python-*.tar.gz")) if into.is_dir() else []
    if not sdists:
        # --no-build-isolation needs the sdist's build backend installed; pip may still
        # have saved the archive before failing on its metadata, else retry isolated.
        proc = subprocess.run([c for c in cmd if c != "--no-build-isolation"], capture_output=True, text=True)
        sdists = sorted(into.glob("llama_cpp_python-*.tar.gz")) if into.is_dir() else []
    if not sdists:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip could not download the llama-cpp-python {version} sdist: {last}")
    return sdists[0]


def fetch(version: str = PINNED, *, force: bool = False, log=print) -> Path:
    """Download the llama-cpp-python `version` sdist with pip and keep the converter's files.

    Written into a hidden folder next to the target and renamed into place, so
    an interrupted fetch leaves nothing a lookup would take for a converter.
    """
    dest = fetched_tree(version)
    if (dest / SCRIPT).is_file() and not force:
        log(f"converter already at {dest}")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        tmp = Path(tmp)
        sdist = download_sdist(version, tmp / "dl", log)
        stage = tmp / "tree"
        stage.mkdir()
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].split("/")[0] in KEEP
                       and (m.isfile() or m.isdir())]
            if not any(m.name == prefix + SCRIPT for m in members):
                raise RuntimeError(f"{sdist.name} holds no vendor/llama.cpp/{SCRIPT}")
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(stage, members=members, filter="data")
        (stage / "SOURCE").write_text(f"llama-cpp-python {version} sdist ({sdist.name}): vendor/llama.cpp\n")
        if dest.exists():
            shutil.rmtree(dest)
        stage.rename(dest)
    log(f"converter at {dest} ({identity(str(dest))})")
    return dest


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipeline.toolchains.converter", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help=f"download the converter (llama-cpp-python {PINNED} sdist) into {fetched_tree()}")
    f.add_argument("--force", action="store_true", help="fetch again even if present")
    sub.add_parser("show", help="where the converter is found, and its identity")
    args = ap.parse_args(argv)
    return command(lambda: fetch(force=args.force) if args.cmd == "fetch" else None,
                   find, missing_message, lambda tree: f"{tree} {identity()}")


def command(make, find_, missing, describe) -> int:
    """A toolchain command's exit: `make()` (fetch, build; None for `show`) with its RuntimeError as one
    line, else what `find_()` finds described, or why nothing is found (llama_server.py's too)."""
    try:
        if make() is not None:
            return 0
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    found = find_()
    if found is None:
        print(missing(), file=sys.stderr)
        return 1
    print(describe(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
