"""Cache by construction, checked over the whole schema (not a hand-picked list).

For every leaf of the composed config and every stage: the stage sees a changed
value (so its manifest config_hash and DVC's params record change, and DVC
re-runs it) exactly when the leaf is in a section the stage declares in READS;
a leaf it does not declare changes nothing it sees. The generated dvc.yaml
records exactly the declared sections, so DVC's key and what the stage sees are
the same set.
"""

from __future__ import annotations

import copy

import pytest

from pipeline.engine.config import compose, validate
from pipeline.engine.dvcgen import generate
from pipeline.engine.layout import (
    PROBED_SECTIONS,
    STAGES,
    canonical_json,
    declaration,
    model_id,
    params_file,
    stage_applies,
    stage_ref,
)
from pipeline.engine.run_stage import visible_params

HOST = {
    "arch": "x86_64", "cpu_model": "test", "isa": ["avx2", "avx512f"], "physical_cores": 2,
    "logical_cpus": 2, "numa_nodes": 1, "memory_gib": 24.0, "accelerators": [], "device_class": "x86_avx512",
}


def leaves(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from leaves(v, prefix + (k,))
    else:
        yield prefix, d


def mutated(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 0.25
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return value + (value[:1] or ["x"])
    if value is None:
        return "set"
    raise TypeError(value)


def set_leaf(cfg, path, value):
    cfg = copy.deepcopy(cfg)
    d = cfg
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return cfg


BASES = {
    "x86_avx512": validate(compose(["device=x86_avx512"])),
    "galaxy_s25": validate(compose(["device=galaxy_s25"])),
}
BUILD_STAGES = [s for s in STAGES if declaration(s).scope == "build"]


def seen(stage, cfg):
    return canonical_json(visible_params(stage, cfg, cfg["build"]["name"], lambda: HOST))


def all_leaves():
    out = []
    for base_name, base in BASES.items():
        for path, value in leaves(base):
            if path[0] == "build":
                continue  # the build name is the folder, not an input
            out.append((base_name, path, value))
    return out


@pytest.mark.parametrize("base_name, path, value", all_leaves(), ids=lambda x: ".".join(x) if isinstance(x, tuple) else str(x))
def test_leaf_reaches_exactly_its_readers(base_name, path, value):
    base = BASES[base_name]
    changed = set_leaf(base, path, mutated(value))
    section = path[0]
    for stage in BUILD_STAGES:
        reads = declaration(stage).reads
        differs = seen(stage, base) != seen(stage, changed)
        # a dotted read (pack's parity.artifact) reaches the leaves under it, and no other of its section
        reached = any(tuple(r.split(".")) == tuple(path[:r.count(".") + 1]) for r in reads)
        assert differs == reached, (stage, ".".join(path), reads)
    # The shared model stage is keyed by the model section alone.
    assert (model_id(base["model"]) != model_id(changed["model"])) == (section == "model")


# Sections that no stage reads yet, each with the reason. Keep this empty where possible.
NOT_YET_READ: dict[str, str] = {}


def test_schema_sections_are_all_read_by_someone():
    base = BASES["x86_avx512"]
    read = {s.split(".")[0] for stage in STAGES for s in declaration(stage).reads}
    unread = set(base) - read - {"build"} - set(NOT_YET_READ)
    assert not unread, f"config sections no stage reads (dead config): {unread}"


def test_dvc_params_are_exactly_the_declared_sections():
    builds = {"b1": BASES["x86_avx512"], "b2": BASES["galaxy_s25"]}
    doc = generate(builds, with_exp=True)["stages"]
    for build in ("b1", "b2", "exp"):
        for stage in BUILD_STAGES:
            if not stage_applies(stage, builds[build]["device"] if build in builds else None):
                continue  # test_the_stage_list_fits_the_device
            entry = doc[stage_ref(build, stage)]
            declared = [s for s in declaration(stage).reads if s not in PROBED_SECTIONS or s == "device"]
            recorded = entry.get("params", [{}])[0].get(params_file(build), []) if declared else []
            assert recorded == declared, (build, stage)
            assert f"stages/{stage}.py" in entry["deps"]
            # Each build reads its own probe: no output is shared between builds.
            assert f"artifacts/{build}/probe/toolchain/{stage}.json" in entry["deps"]
            assert not any(d.startswith("artifacts/_probe") for d in entry["deps"]), (build, stage)
            reads_host = "host" in declaration(stage).reads or (
                "device" in declaration(stage).reads and build == "exp"
            )
            assert (f"artifacts/{build}/probe/host.json" in entry["deps"]) == reads_host, (build, stage)
            assert entry["outs"] == [f"artifacts/{build}/{stage}"]
        probe = doc[stage_ref(build, "probe")]
        assert probe["always_changed"] and probe["outs"] == [{f"artifacts/{build}/probe": {"cache": False}}]


def test_no_output_is_written_by_two_builds_or_read_across_builds():
    """What lets builds of different devices run side by side under DVC's
    per-output lock: a build's stages write and read only their own folders,
    the shared model's stage and its own probe; nothing else is shared."""
    builds = {"b1": BASES["x86_avx512"], "b2": BASES["galaxy_s25"]}
    stages = generate(builds, with_exp=True)["stages"]
    owner: dict[str, str] = {}
    for name, entry in stages.items():
        for out in entry["outs"]:
            path = next(iter(out)) if isinstance(out, dict) else out
            assert path not in owner, (path, name, owner.get(path))
            owner[path] = name

    def writers(entry):  # the stages whose output each dep lies in
        return {owner[o] for d in entry["deps"] for o in owner if d == o or d.startswith(o + "/")}

    mid = model_id(BASES["x86_avx512"]["model"])
    for build in builds:
        for stage in (s for s in BUILD_STAGES if stage_applies(s, builds[build]["device"])):
            foreign = {w for w in writers(stages[stage_ref(build, stage)]) if not w.startswith(f"{build}--")}
            assert foreign <= {f"model--{mid}"}, (build, stage, foreign)
        assert writers(stages[stage_ref(build, "untie_head")]) == {f"model--{mid}", f"{build}--probe"}
    assert writers(stages[f"model--{mid}"]) == {f"probe--{mid}"}


def test_the_stage_list_fits_the_device():
    """A CPU build has no compile_qnn stage and nothing of it depends on one; a phone
    build has it, read by deploy_profile, verify_parity and benchmark; the exp build,
    whose device dvc.yaml cannot know, has every stage."""
    builds = {"cpu": BASES["x86_avx512"], "phone": BASES["galaxy_s25"]}
    stages = generate(builds, with_exp=True)["stages"]
    readers = ("deploy_profile", "verify_parity", "benchmark")
    assert stage_ref("cpu", "compile_qnn") not in stages
    assert not any("compile_qnn" in d for k, e in stages.items() if k.startswith("cpu--") for d in e["deps"])
    for build in ("phone", "exp"):
        assert stage_ref(build, "compile_qnn") in stages
        for stage in readers:
            assert f"artifacts/{build}/compile_qnn" in stages[stage_ref(build, stage)]["deps"], (build, stage)
    cpu = [k.split("--", 1)[1] for k in stages if k.startswith("cpu--")]
    assert cpu == [s for s in STAGES if declaration(s).scope != "model" and s != "compile_qnn"]


def test_builds_never_share_an_output():
    builds = {"a": BASES["x86_avx512"], "b": BASES["galaxy_s25"]}
    outs = [o if isinstance(o, str) else next(iter(o)) for e in generate(builds)["stages"].values() for o in e["outs"]]
    assert len(outs) == len(set(outs))


def test_different_models_get_different_model_stages_same_model_shares_one():
    a = BASES["x86_avx512"]
    b = set_leaf(a, ("model", "train", "steps"), 7)
    same = {"x": a, "y": BASES["galaxy_s25"]}
    differ = {"x": a, "y": b}
    n_same = [k for k in generate(same)["stages"] if k.startswith("model--")]
    n_diff = [k for k in generate(differ)["stages"] if k.startswith("model--")]
    assert len(n_same) == 1 and len(n_diff) == 2
