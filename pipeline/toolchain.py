"""The toolchain fingerprint: versions of what shapes a stage's output.

DVC's run-cache key leaves out the environment (interpreter, packages, SDKs):
reproduced in the field notes. So the probe stage, which runs on every
`dvc repro`, writes one small file per stage with the versions that stage
declares (`TOOLCHAIN`), and the stage depends on that file. An upgraded
package changes the file, and only the stages that use it re-run.

Read from package metadata, never by importing the package: the probe must stay
cheap (it runs on every repro) and must not crash on a broken install.
"""

from __future__ import annotations

import platform
from importlib import metadata

# Always part of every stage's fingerprint.
BASE = ("python", "edgekiln-format")
FORMAT_VERSION = "1"


def version_of(dist: str) -> str:
    if dist == "python":
        return platform.python_version()
    if dist == "edgekiln-format":
        return FORMAT_VERSION
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def qnn_sdk_version() -> str:
    """The QNN SDK bundled by onnxruntime-qnn: a context binary is tied to it."""
    try:
        dist = metadata.distribution("onnxruntime-qnn")
    except metadata.PackageNotFoundError:
        return "absent"
    for f in dist.files or ():
        name = str(f)
        # The wheel ships the SDK's build id in its libraries' folder or a version file.
        if name.endswith(("QNN_SDK_VERSION", "qnn_version.txt")):
            try:
                return f.read_text().strip()
            except OSError:
                pass
    return f"bundled-with-onnxruntime-qnn-{dist.version}"


def fingerprint(dists: tuple[str, ...]) -> dict[str, str]:
    names = list(BASE) + sorted(set(dists) - set(BASE))
    out = {}
    for d in names:
        out[d] = qnn_sdk_version() if d == "qnn-sdk" else version_of(d)
    return out
