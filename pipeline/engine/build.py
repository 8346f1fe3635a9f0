"""Registering a build and running its stages through DVC.

`python -m pipeline` (pipeline/__main__.py) and a fleet sweep's workers
(pipeline/fleet/sweep.py) both build through these two functions: `register`
writes builds/<name>.yaml and regenerates dvc.yaml, `build` runs the build's
DVC stages under the model and build locks (pipeline/engine/locks.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipeline.engine import narrate
from pipeline.engine.files import write_whole
from pipeline.engine.layout import BUILDS, ROOT, build_stages, model_id, model_stage_ref, output_dir, stage_ref


def register(cfg: dict) -> Path:
    """Write builds/<name>.yaml and regenerate dvc.yaml from the registry."""
    import yaml

    from pipeline.engine import dvcgen

    name = cfg["build"]["name"]
    path = ROOT / BUILDS / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    header = (
        f"# Build {name}: registered by `python -m pipeline`; the resolved config every\n"
        f"# stage of this build reads (each stage sees only the sections it declares).\n"
    )
    text = header + yaml.safe_dump(cfg, sort_keys=False, width=100)
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    dvcgen.write()
    return path


def atomic_dvc_files() -> None:
    """Make this process's DVC write its YAML files (dvc.lock above all) by rename.

    DVC 3.67 writes them in place (dvc/utils/serialize/_common.py `_dump_data`:
    open "w+", dump), and dvc.lock is shared by every build of the checkout:
    when a sweep's worker dies, the launcher tears the other workers down too,
    and one caught writing dvc.lock left it truncated, every build's record
    gone (seen in CI). Written by hand because DVC has no option for it: the
    one function swapped for a temp-file-fsync-rename version, so a kill leaves
    the previous whole file or the new one. Once per process."""
    from dvc.utils.serialize import _common

    if getattr(_common._dump_data, "edgekiln_atomic", False):
        return
    in_place = _common._dump_data

    def dump_by_rename(path, data, dumper, fs=None, **dumper_args):
        from dvc.fs import LocalFileSystem

        if fs is not None and not isinstance(fs, LocalFileSystem):
            return in_place(path, data, dumper, fs=fs, **dumper_args)
        write_whole(Path(os.fspath(path)), lambda fd: dumper(data, fd, **dumper_args))

    dump_by_rename.edgekiln_atomic = True
    _common._dump_data = dump_by_rename
    _atomic_rwlock()
    _lock_parsed_plain()


def _lock_parsed_plain() -> None:
    """DVC rewrites dvc.lock after each stage it runs, first parsing it in ruamel's round-trip mode
    (dvc/dvcfile.py `Lockfile.dump_stages` through `modify_yaml`), pure Python and kept for comments,
    which dvc.lock, written by DVC alone, never has: 1.7-2.1 s a stage for the 330 kB lock of six tiny
    builds here, against 0.3 s in the safe mode's C parser (ruamel.yaml.clib), which DVC's own reads
    use. The data parsed either way dumps to the same bytes (tests/test_build_e2e.py checks it on a
    real lock). Only this process's writes of dvc.lock change; dvc.yaml keeps its round trip."""
    from dvc import dvcfile
    from dvc.utils.serialize import _common, _yaml

    if getattr(dvcfile.modify_yaml, "edgekiln_plain_lock", False):
        return
    round_trip = dvcfile.modify_yaml

    def modify(path, fs=None):
        if os.path.basename(os.fspath(path)) != "dvc.lock":
            return round_trip(path, fs=fs)
        return _common._modify_data(path, _yaml.parse_yaml, _yaml._dump, fs=fs)

    modify.edgekiln_plain_lock = True
    dvcfile.modify_yaml = modify


def _atomic_rwlock() -> None:
    """DVC's `.dvc/tmp/rwlock` (which build holds which output) by rename too.

    dvc/rwlock.py `_edit_rwlock` rewrites it in place under its lock file; a
    sweep worker killed in that write left it empty, and every later build of
    the checkout failed with "Unable to read RWLock-file ... JSON structure is
    corrupted" (seen in CI: the killed-worker sweep's re-run). The same steps
    as DVC's (read under rwlock.lock, validate, yield, write), the write made a
    temp file fsynced and renamed."""
    import json
    from collections import defaultdict
    from contextlib import contextmanager

    from dvc import rwlock
    from dvc.fs import LocalFileSystem

    if getattr(rwlock._edit_rwlock, "edgekiln_atomic", False):
        return
    in_place = rwlock._edit_rwlock

    @contextmanager
    def edit_by_rename(lock_dir, fs, hardlink):
        if not isinstance(fs, LocalFileSystem):
            with in_place(lock_dir, fs, hardlink) as lock:
                yield lock
            return
        path = fs.join(lock_dir, rwlock.RWLOCK_FILE)
        guard = rwlock.make_lock(fs.join(lock_dir, rwlock.RWLOCK_LOCK), tmp_dir=lock_dir, hardlink_lock=hardlink)
        with guard:
            try:
                with fs.open(path, encoding="utf-8") as fobj:
                    lock = rwlock.SCHEMA(json.load(fobj))
            except FileNotFoundError:
                lock = rwlock.SCHEMA({})
            except json.JSONDecodeError as exc:
                raise rwlock.RWLockFileCorruptedError(path) from exc
            except rwlock.Invalid as exc:
                raise rwlock.RWLockFileFormatError(path) from exc
            lock["read"] = defaultdict(list, lock["read"])
            lock["write"] = defaultdict(dict, lock["write"])
            yield lock
            write_whole(Path(path), lambda fobj: json.dump(lock, fobj))

    edit_by_rename.edgekiln_atomic = True
    rwlock._edit_rwlock = edit_by_rename


def _run_dvc(args: list[str]) -> int:
    from dvc.cli import main as dvc_main

    return dvc_main(args)


def _repro(refs: list[str], say) -> int:
    """`dvc repro --single-item` of these stages, through the shared cache
    when EDGEKILN_CACHE_REMOTE names a DVC remote (pipeline/engine/cache_remote.py)."""
    from pipeline.engine import cache_remote

    # For DVC's CLI and, with a cache remote, its Python API in this process alike:
    # dvc.yaml's commands say `python`: made this interpreter (the venv's) without
    # writing a machine-specific path into the cache key; dvc.lock written by
    # rename; a stop reaches the running stage; one line per stage (pipeline/engine/narrate.py).
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    atomic_dvc_files()
    from pipeline.engine import stopping

    stopping.patch_dvc()  # a stop signal reaches the running stage (pipeline/engine/stopping.py)
    if not narrate.verbose():
        narrate.quiet_dvc()
    return cache_remote.repro(refs, _run_dvc, say)


def _stale(stage_name: str) -> bool:
    """Is this DVC stage out of date? `dvc status` takes only read locks, so
    asking does not disturb builds reading the stage's output."""
    from dvc.repo import Repo

    # `_wait_for_lock` is what DVC's own CLI passes for `--wait-for-lock`.
    with Repo(str(ROOT), _wait_for_lock=True) as repo:
        return bool(repo.status(targets=[stage_name]))


def build(name: str, cfg: dict, say) -> int:
    """Run the build's DVC stages (`cfg`: its registered config): the shared model
    first, then its own, those that fit its device (layout.build_stages).

    Builds of different devices run side by side (pipeline/engine/locks.py): the
    model they share is brought up to date by one of them at a time and read
    by all under a shared lock; everything else each build writes or reads is
    its own. `--single-item` keeps each `dvc repro` to the stages named, in
    the order given (the pipeline's), so no build re-runs another's probe.
    """
    from pipeline.engine import locks

    model = cfg["model"]
    mid = model_id(model)
    refresh, use = locks.model_locks(mid)
    about = f"model {mid}"
    with locks.hold(refresh, say=say, what=about, waits_for="another build bringing it up to date"):
        rc = _repro([model_stage_ref("probe", model)], say)
        if rc == 0 and _stale(model_stage_ref("model", model)):
            with locks.hold(use, say=say, what=about,
                            waits_for="the builds reading its previous version to finish"):
                rc = _repro([model_stage_ref("model", model)], say)
        elif rc == 0:  # not handed to DVC at all: its one line said here
            say(narrate.kept_line(narrate.label("model", mid), "up to date", ROOT / output_dir("model", None, model)))
    if rc != 0:
        return rc
    with locks.hold(use, shared=True, say=say, what=about, waits_for="it to be rewritten"):
        locks.note_dvc_lock(ROOT, say)
        own = [stage_ref(name, s) for s in build_stages(cfg["device"])]
        return _repro(own, say)
