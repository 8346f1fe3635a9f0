"""The layout of pipeline/ is the architecture: each part imports only the parts
below it, and no module is part of an import circle (imports inside functions
counted, as codedeps counts them for the cache key)."""

from __future__ import annotations

from pathlib import Path

from pipeline.engine.codedeps import imported_modules
from pipeline.engine.layout import ROOT

# What each part may import besides itself (pipeline/<part>/__init__.py says why).
ALLOWED = {
    "engine": {"sources", "toolchains"},
    "sources": set(),
    "toolchains": {"engine"},
    "quant": {"engine", "sources", "toolchains"},
    "graphs": {"engine", "sources", "quant", "toolchains", "runtimes"},
    "runtimes": {"engine", "sources", "quant", "graphs", "toolchains"},
    "measure": {"engine", "sources", "quant", "graphs", "runtimes", "toolchains"},
    "fleet": {"engine", "sources", "toolchains", "measure"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        if "hydra_plugins" in rel.parts:
            continue
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for dotted in imported_modules(path):
            # `from pipeline.x import y`: y is a module or a name in pipeline.x
            while dotted and dotted not in mods:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name and dotted.count(".") >= 1:
                deps.add(dotted)
        graph[name] = deps
    return graph


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pipeline" and len(parts) > 2 else None


def test_every_module_lives_in_a_part():
    loose = [m for m, path in _modules().items()
             if m.count(".") == 1 and path.name != "__init__.py" and m != "pipeline.__main__"]
    assert loose == [], f"modules directly in pipeline/ (put each in its part): {loose}"
    assert {_part(m) for m in _modules()} - {None} == set(ALLOWED)


def test_each_part_imports_only_the_parts_it_may():
    wrong = []
    for mod, deps in _graph().items():
        part = _part(mod)
        if part is None:
            continue
        for dep in deps:
            other = _part(dep)
            if other and other != part and other not in ALLOWED[part]:
                wrong.append(f"{mod} imports {dep}")
    assert wrong == []


def test_stages_import_no_other_stage():
    for path in sorted((ROOT / "stages").glob("*.py")):
        others = {m for m in imported_modules(path) if m.startswith("stages.") and m != f"stages.{path.stem}"}
        assert not others, f"{path.name} imports {others}"


def test_no_import_circles():
    import graphlib

    try:
        graphlib.TopologicalSorter(_graph()).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"an import circle: {' -> '.join(e.args[1])}") from None


def test_a_runtime_says_whether_its_prefill_is_batched():
    """The benchmark reports a prefill as batched only where the runtime has its own (the
    contract's default feeds the prompt token by token)."""
    import numpy as np

    from pipeline.runtimes.contract import Runtime
    from edgekiln_runtime.gqa import GqaDecoder
    from pipeline.runtimes.onnx import OnnxDecoder
    from pipeline.runtimes.reference import TorchReference

    class Steps(Runtime):
        def reset(self):
            self.fed = []

        def step(self, token_id):
            self.fed.append(token_id)
            return np.full(3, float(token_id))

    dec = Steps()
    dec.reset()
    assert not dec.batched_prefill
    assert dec.prefill([4, 5, 6]).tolist() == [6.0, 6.0, 6.0] and dec.fed == [4, 5, 6]
    # (made without loading an artifact: the answer is the class's)
    assert not object.__new__(OnnxDecoder).batched_prefill
    assert object.__new__(GqaDecoder).batched_prefill and object.__new__(TorchReference).batched_prefill


def test_every_runtime_lives_in_the_runtimes_folder():
    """A class that runs a built artifact (a Runtime subclass, a *Decoder, *Reference or
    *Server) is defined in pipeline/runtimes/ and nowhere else."""
    import ast

    strays = []
    for mod, path in _modules().items():
        if _part(mod) == "runtimes":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if "Runtime" in bases or node.name.endswith(("Decoder", "Reference", "Server")):
                    strays.append(f"{mod}.{node.name}")
    assert strays == []
