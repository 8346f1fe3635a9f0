"""probe: what machine is building, and with which toolchain.

Runs on every `dvc repro` (it is DVC's `always_changed` stage), because DVC's
run-cache key leaves out the environment. It is cheap (reads /proc, /sys and
package metadata; ~0.2 s) and writes only stable facts, so downstream stages
re-run only when something real changed:

- host.json: CPU model, ISA features that pick a kernel (AVX2, AVX-512, VNNI,
  AVX512-BF16, AMX on x86; NEON, dotprod, i8mm, SVE on ARM), physical cores,
  NUMA nodes, memory, accelerators, and the device class they map to. Stages
  that measure read it (`host`), and so does any stage of a `device=auto` build.
- toolchain/<stage>.json: the versions each stage declared in TOOLCHAIN.

torch is not imported: its CPU capability follows from the same flags, and a
torch import (~1.5 s) here would double the cost of a no-op rebuild.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

READS: tuple[str, ...] = ()
INPUTS: tuple[str, ...] = ()
TOOLCHAIN: tuple[str, ...] = ()
SCOPE = "host"

# Flags that decide a kernel, by the names /proc/cpuinfo uses.
X86_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
)
ARM_FLAGS = {"asimd": "neon", "asimddp": "asimddp", "i8mm": "i8mm", "sve": "sve", "sve2": "sve2", "bf16": "bf16"}


def read_cpuinfo(text: str) -> dict:
    flags: set[str] = set()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
    return {"flags": flags, "model": model}


def physical_cores(cpuinfo: str) -> int:
    """Distinct (physical id, core id) pairs; falls back to the logical count."""
    pairs, phys = set(), None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            pairs.add((phys, value.strip()))
    return len(pairs) or (os.cpu_count() or 1)


def numa_nodes(sys_root: Path = Path("/sys/devices/system/node")) -> int:
    return max(1, len(list(sys_root.glob("node[0-9]*"))))


def memory_gib(meminfo: str) -> float:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return 0.0


def accelerators() -> list[str]:
    found = []
    if Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists():
        found.append("cuda")
    if Path("/dev/fastrpc-cdsp").exists() or Path("/dev/adsprpc-smd").exists():
        found.append("qnn_htp")
    return found


def probe_host() -> dict:
    from pipeline.engine.devices import classify

    cpuinfo = Path("/proc/cpuinfo").read_text()
    info = read_cpuinfo(cpuinfo)
    arch = platform.machine()
    if arch == "x86_64":
        isa = sorted(f for f in X86_FLAGS if f in info["flags"])
    else:
        isa = sorted(ARM_FLAGS[f] for f in ARM_FLAGS if f in info["flags"])
    host = {
        "cpu_model": info["model"],
        "arch": arch,
        "isa": isa,
        "physical_cores": physical_cores(cpuinfo),
        "logical_cpus": os.cpu_count(),
        "numa_nodes": numa_nodes(),
        "memory_gib": memory_gib(Path("/proc/meminfo").read_text()),
        "accelerators": accelerators(),
    }
    host["device_class"] = classify(host)
    return host


def run(ctx) -> dict:
    from pipeline.engine.layout import declarations
    from pipeline.toolchains.toolchain import fingerprint

    host = probe_host()
    (ctx.out / "host.json").write_text(json.dumps(host, indent=2, sort_keys=True) + "\n")
    tc = ctx.out / "toolchain"
    tc.mkdir()
    for decl in declarations():
        (tc / f"{decl.name}.json").write_text(
            json.dumps(fingerprint(decl.toolchain), indent=2, sort_keys=True) + "\n"
        )
    ctx.log(
        f"{host['cpu_model'] or host['arch']}: {host['physical_cores']} cores, "
        f"{', '.join(host['isa']) or 'no SIMD flags'} -> {host['device_class']}"
    )
    return {"host": host}
