"""Fleet sweeps before anything runs: how `-m` overrides expand into jobs, what
stops a sweep before any build starts, and the launcher configs in conf/hydra/launcher/
(Slurm can only be composed here: there is no Slurm cluster on the builders)."""

from __future__ import annotations

import importlib.util

import pytest

from pipeline.engine.config import CONF_DIR, ConfigError
from pipeline.fleet.sweep import expand, plan


def test_a_sweep_expands_like_hydras_basic_sweeper():
    jobs = expand(["device=xeon_amx,x86_avx512", "priority=speed,fidelity", "export.opset=21"])
    assert jobs == [
        ["device=xeon_amx", "priority=speed", "export.opset=21"],
        ["device=xeon_amx", "priority=fidelity", "export.opset=21"],
        ["device=x86_avx512", "priority=speed", "export.opset=21"],
        ["device=x86_avx512", "priority=fidelity", "export.opset=21"],
    ]


def test_every_job_is_validated_before_any_build_starts():
    names = [cfg["build"]["name"] for _, cfg in plan(["device=xeon_amx,x86_avx512,galaxy_s25"])]
    assert names == ["xeon_amx-embedded-speed", "x86_avx512-embedded-speed", "galaxy_s25-embedded-speed"]
    with pytest.raises(ConfigError, match=r"job #1 \(device=nosuch\): unknown device 'nosuch'"):
        plan(["device=x86_avx512,nosuch"])


def test_two_jobs_writing_the_same_build_stop_the_sweep():
    with pytest.raises(ConfigError, match="jobs #0, #1 all build 'x': two jobs would write the same outputs"):
        plan(["device=x86_avx512,x86_avx2", "build.name=x"])


def test_a_malformed_sweep_is_one_line():
    with pytest.raises(ConfigError, match="malformed sweep") as e:
        plan(["device=[x86_avx512"])
    assert "\n" not in str(e.value)


def _compose_launcher(choice: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from pipeline.engine.schema import register

    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            return compose(config_name="config", overrides=[f"hydra/launcher={choice}"],
                           return_hydra_config=True).hydra.launcher
    finally:
        GlobalHydra.instance().clear()


def _plugin(name: str) -> bool:
    return importlib.util.find_spec(f"hydra_plugins.{name}") is not None


@pytest.mark.skipif(not _plugin("hydra_joblib_launcher"), reason="hydra-joblib-launcher absent: pip install -e '.[test]'")
def test_the_local_launcher_is_joblib_in_processes():
    launcher = _compose_launcher("local")
    assert launcher._target_.endswith("JoblibLauncher") and launcher.n_jobs == -1 and launcher.prefer == "processes"


@pytest.mark.skipif(not _plugin("hydra_submitit_launcher"),
                    reason="hydra-submitit-launcher absent: pip install -e '.[fleet]'")
def test_the_slurm_launcher_composes():
    launcher = _compose_launcher("slurm")
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.cpus_per_task == 8 and launcher.mem_gb == 32 and launcher.timeout_min == 180
    assert launcher.partition is None  # the cluster's, given on the command line


@pytest.mark.skipif(not _plugin("hydra_ray_launcher"), reason="hydra-ray-launcher absent: pip install -e '.[ray]'")
def test_the_ray_launcher_composes():
    launcher = _compose_launcher("ray_cluster")
    assert launcher._target_.endswith("RayLauncher")
    assert launcher.ray.init.address is None and launcher.ray.remote.num_cpus == 1
