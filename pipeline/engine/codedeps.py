"""A stage's code, as DVC dependencies: the stage module plus every project
module it imports, followed transitively (imports inside functions included).

Hand-listing code deps is how a changed helper module ends up outside the
cache key (reproduced in the field notes: `dvc status` said "up to date" over a
stale output). Reading the imports from the source makes the list complete by
construction.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from pipeline.engine.layout import ROOT

# The project's packages and the folder each lives in: edgekiln_runtime, the device-side package that
# installs alone (runtime/pyproject.toml), is the stages' code too (GqaDecoder), so it is in their keys.
PACKAGE_ROOTS = {"pipeline": ROOT, "stages": ROOT, "edgekiln_runtime": ROOT / "runtime"}
LOCAL_PACKAGES = tuple(PACKAGE_ROOTS)


def _module_file(dotted: str) -> Path | None:
    parts = dotted.split(".")
    if parts[0] not in LOCAL_PACKAGES:
        return None
    base = PACKAGE_ROOTS[parts[0]].joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _package_of(path: Path) -> str:
    root = PACKAGE_ROOTS["edgekiln_runtime"] if path.is_relative_to(PACKAGE_ROOTS["edgekiln_runtime"]) else ROOT
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    else:
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """Dotted names of the project modules that `path` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = _package_of(path).split(".")
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(p for p in pkg + ([node.module] if node.module else []) if p)
            else:
                base = node.module or ""
            found.add(base)
            for alias in node.names:
                found.add(f"{base}.{alias.name}")
    return {m for m in found if m.split(".")[0] in LOCAL_PACKAGES}


@lru_cache(maxsize=None)
def closure(*entry_files: str) -> tuple[str, ...]:
    """Repo-relative paths of the entry files and all project code they import."""
    seen: set[Path] = set()
    todo = [ROOT / f for f in entry_files]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for dotted in imported_modules(path):
            # `import pipeline.x` also runs pipeline/__init__.py
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):
                f = _module_file(".".join(parts[:i]))
                if f is not None and f not in seen:
                    todo.append(f)
    return tuple(sorted(str(p.relative_to(ROOT)) for p in seen))


RUNNER = "pipeline/engine/run_stage.py"


def stage_code(stage: str) -> tuple[str, ...]:
    """Everything that runs when DVC runs this stage: runner + stage module."""
    return closure(RUNNER, f"stages/{stage}.py")
