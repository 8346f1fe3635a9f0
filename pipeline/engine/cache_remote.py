"""One cache for many builders: DVC's run-cache shared through a DVC remote (opt-in).

    EDGEKILN_CACHE_REMOTE=storage python -m pipeline device=x86_avx512
    EDGEKILN_CACHE_REMOTE=storage python -m pipeline -m device=xeon_amx,x86_avx512

With the variable naming a DVC remote (`dvc remote add storage /mnt/store`,
any kind DVC supports), every stage a build runs is reproduced with DVC's
`--pull` against that remote (it fetches the remote's run-cache entries, and
the objects of the one matching the stage), so a stage another worker or
checkout already computed is restored ("Stage '...' is cached - skipping run,
checking out outputs") instead of run; and `dvc push --run-cache -r REMOTE
<stage>` follows it, so the next worker finds it. The run-cache key is DVC's
(command, dependencies' hashes, params, output paths), which pipeline/engine/dvcgen.py
makes the whole of what shapes an output, so a restore is never of another graph.

The probes are not shared: they always run (they record the host) and DVC
never caches them. A remote that cannot be read is a warning from DVC and the stage is computed
here; a failed push is a warning, not a failed build (the stage stays unshared).
Without the variable a build runs its stages in one `dvc repro`, as before.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

ENV = "EDGEKILN_CACHE_REMOTE"


def remote() -> str | None:
    """The DVC remote builders share, or None (the default: nothing shared)."""
    name = os.environ.get(ENV, "").strip()
    return name or None


def _is_probe(ref: str) -> bool:
    # pipeline/engine/layout.py names them `probe--<model id>` and `<build>--probe`.
    return ref.startswith("probe--") or ref.endswith("--probe")


def repro(refs: list[str], run_dvc: Callable[[list[str]], int], say: Callable[[str], None] | None = None) -> int:
    """Bring these DVC stages up to date in order, through the shared cache when
    set. DVC works in the repository of the working directory, as its CLI does."""
    name = remote()
    if not name:
        return run_dvc(["--wait-for-lock", "repro", "--single-item", *refs])
    for ref in refs:
        if _is_probe(ref):
            rc = run_dvc(["--wait-for-lock", "repro", "--single-item", ref])
        else:
            rc = _repro_pulling(ref, name)
        if rc != 0:
            return rc
        if not _is_probe(ref) and run_dvc(["--wait-for-lock", "push", "--run-cache", "-r", name, ref]) != 0 and say:
            say(f"{ref}: could not push to the shared cache {name!r} (see above): other builders will compute it")
    return 0


def _repro_pulling(ref: str, name: str) -> int:
    """`dvc repro --pull --single-item REF` with REMOTE as the default remote.

    Through DVC's Python API, not its CLI: `dvc repro --pull` pulls the
    run-cache and its objects from the *default* remote only (it has no `-r`),
    and making REMOTE the default would mean rewriting .dvc/config under
    builds running beside this one. `Repo(remote=...)` sets it for this one
    repository object. DVC's logging (set up when dvc is imported) prints the
    same "Running stage" / "is cached" lines the CLI does, which a `python -m
    pipeline` build turns into its one line per stage (pipeline/engine/narrate.py)."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        # `_wait_for_lock` is what DVC's own CLI passes for `--wait-for-lock`.
        with Repo(remote=name, _wait_for_lock=True) as repo:
            repo.reproduce(ref, single_item=True, pull=True)
    except DvcException as e:
        from pipeline.engine import stopping

        if not stopping.requested():  # a stopped stage: its line and the build's say so
            cause = f": {e.__cause__}" if e.__cause__ else ""
            print(f"ERROR: {e}{cause}", file=sys.stderr, flush=True)
        return 1
    return 0
