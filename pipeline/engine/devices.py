"""Device classes: the spec sheets in conf/device/, how a probed host maps onto one, and the host's CPU flags."""

from __future__ import annotations

from pathlib import Path

from pipeline.engine.layout import ROOT

DEVICE_DIR = ROOT / "conf" / "device"


def device_classes() -> list[str]:
    return sorted(p.stem for p in DEVICE_DIR.glob("*.yaml"))


def spec_sheet(name: str) -> dict:
    from omegaconf import OmegaConf

    path = DEVICE_DIR / f"{name}.yaml"
    doc = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    # A device option that also picks another group's option is written in the
    # global package: its spec sheet is the `device:` block.
    return doc["device"] if "defaults" in doc and "device" in doc else doc


def classify(host: dict) -> str:
    """The device class a probed host belongs to (the notes' path table keys on it)."""
    isa = set(host.get("isa", ()))
    accel = set(host.get("accelerators", ()))
    if host.get("arch") == "x86_64":
        if "cuda" in accel:
            return "cuda_discrete"
        if {"amx_tile", "amx_int8"} <= isa:
            return "xeon_amx"
        if "avx512f" in isa:
            return "x86_avx512"
        return "x86_avx2"
    if host.get("arch") == "aarch64":
        return "jetson_orin" if "cuda" in accel else "arm64_cpu"
    raise ValueError(f"no device class for architecture {host.get('arch')!r}")


def resolve(device: dict, host: dict | None) -> dict:
    """The device spec a stage sees. `auto` becomes the probed class, with the
    host's own cores, threads, memory and ISA in place of the class's typical ones."""
    if device.get("name") != "auto":
        return dict(device)
    if host is None:
        raise ValueError("device=auto needs the probe's host facts")
    cls = host["device_class"]
    spec = spec_sheet(cls)
    spec.update(
        name=cls,
        resolved_from="auto",
        description=f"{spec.get('description', cls)} (probed: {host.get('cpu_model', '?')})",
        isa=sorted(host.get("isa", [])),
        cores=host["physical_cores"],
        threads=host["physical_cores"],
        numa_nodes=host["numa_nodes"],
        memory_gib=host["memory_gib"],
    )
    return spec


def host_memory_gib(meminfo: str | None = None) -> float:
    """This host's memory (MemTotal) in GiB, as the probe stage records it; 0.0 where unreadable."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return 0.0
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return 0.0


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """This host's x86 CPU flags, as /proc/cpuinfo names them; None where there is no `flags`
    line (ARM lists "Features") or no /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    return next((set(line.partition(":")[2].split()) for line in cpuinfo.splitlines()
                 if line.lower().startswith("flags")), None)
