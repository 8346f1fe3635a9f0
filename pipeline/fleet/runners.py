"""Runners: a build's parity and benchmark stages measured on the device itself.

    python -m pipeline.fleet.runners set BUILD ssh://[user@]host[:port]/abs/workdir [--python PY] [--stages a,b]
    python -m pipeline.fleet.runners set BUILD local          # the same steps, in a scratch folder on this host
    python -m pipeline.fleet.runners unset BUILD              # back to running them in the build's own dvc repro
    python -m pipeline.fleet.runners show
    python -m pipeline.fleet.runners run STAGE --build BUILD  # what dvc.yaml runs for such a stage

`set` writes builds/_runners/<build>.yaml and regenerates dvc.yaml: the stages
it names (verify_parity and benchmark by default) get `python -m
pipeline.fleet.runners run ...` as their command, this module among their code
dependencies and the runner file among their params, so a figure measured on
the device never shares a cache entry with one measured on the builder.

A run copies over exactly what the stage reads: the code DVC keys the stage on
(its import closure and the probe's), the device spec sheets, the build's
config and its input artifacts with their manifests. There it runs the probe
(the device's own host facts and toolchain), then the stage, each through
`pipeline.engine.run_stage`, which verifies every input against its manifest first.
The output comes back into a hidden folder here; it is accepted only if its
manifest hashes the same as the remote's, every file re-hashes to the manifest
(pipeline/engine/manifest.py), and the manifest's key names this checkout's code and
these inputs' content hashes. Then `runner.json` (which runner, which host,
its probed facts) is added, the manifest rewritten to cover it, and the folder
renamed into place; the remote work folder is removed.

SSH credentials stay out of the build files (and so out of git and the cache
key): EDGEKILN_SSH_IDENTITY (a private key file; default: the agent and
~/.ssh keys) and EDGEKILN_SSH_KNOWN_HOSTS (default ~/.ssh/known_hosts). Host
keys are always checked. The remote needs a Python with the project's
toolchain installed (`--python`, default `python3`); nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.engine import manifest, narrate
from pipeline.engine.codedeps import RUNNER, closure
from pipeline.engine.context import StageError
from pipeline.engine.layout import (BUILDS, ROOT, RUNNERS_DIR, STAGES, build_device, declaration, output_dir, probe_dir,
                                    runner_file, runner_of, stage_inputs)

DEFAULT_STAGES = ("verify_parity", "benchmark")
PROVENANCE = "runner.json"
IDENTITY_ENV = "EDGEKILN_SSH_IDENTITY"
KNOWN_HOSTS_ENV = "EDGEKILN_SSH_KNOWN_HOSTS"
_HOST_TAG = "edgekiln-host:"


def parse_target(target: str) -> dict:
    if target == "local":
        return {"kind": "local"}
    url = urlsplit(target)
    if url.scheme != "ssh" or not url.hostname or not url.path.startswith("/"):
        raise ValueError(f"runner target {target!r}: write local or ssh://[user@]host[:port]/absolute/workdir")
    return {"kind": "ssh", "host": url.hostname, "port": url.port or 22, "user": url.username or "",
            "path": url.path.rstrip("/") or "/"}


def make(spec: dict) -> "Runner":
    if spec["kind"] == "local":
        return LocalRunner(spec.get("python") or sys.executable)
    if spec["kind"] == "ssh":
        return SshRunner(spec["host"], int(spec["port"]), spec.get("user") or "", spec["path"],
                         spec.get("python") or "python3")
    raise ValueError(f"unknown runner kind {spec['kind']!r}")


class Runner:
    """Where a stage runs: put files, execute a command, read files back."""

    kind = "?"
    python = "python3"

    def describe(self) -> str:
        raise NotImplementedError

    def workdir(self, name: str) -> str:
        raise NotImplementedError

    def put(self, files: dict[str, Path], dest: str) -> None:
        raise NotImplementedError

    def execute(self, command: str) -> tuple[int, str, str]:
        raise NotImplementedError

    def get(self, remote: str, local: Path) -> None:
        raise NotImplementedError

    def listdir(self, remote: str) -> list[str]:
        """Every file under `remote`, as posix paths relative to it."""
        raise NotImplementedError

    def remove(self, remote: str) -> None:
        self.execute(f"rm -rf {shlex.quote(remote)}")

    def close(self) -> None:
        pass


class LocalRunner(Runner):
    """A scratch folder on this host: the same steps as over SSH, without the network."""

    kind = "local"

    def __init__(self, python: str):
        self.python = python
        self.base = Path(tempfile.gettempdir()) / "edgekiln-runner"

    def describe(self) -> str:
        return "local"

    def workdir(self, name: str) -> str:
        return str(self.base / name)

    def put(self, files: dict[str, Path], dest: str) -> None:
        for rel, src in files.items():
            target = Path(dest) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)

    def execute(self, command: str) -> tuple[int, str, str]:
        proc = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)
        return proc.returncode, proc.stdout, proc.stderr

    def get(self, remote: str, local: Path) -> None:
        shutil.copy2(remote, local)

    def listdir(self, remote: str) -> list[str]:
        base = Path(remote)
        return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())


class SshRunner(Runner):
    """A device reached over SSH (asyncssh): SFTP for files, an exec channel for commands."""

    kind = "ssh"

    def __init__(self, host: str, port: int, user: str, path: str, python: str):
        import asyncio

        self.host, self.port, self.user, self.path, self.python = host, port, user, path, python
        self._loop = asyncio.new_event_loop()
        self._conn = None
        self._sftp = None

    def describe(self) -> str:
        return f"ssh://{self.user + '@' if self.user else ''}{self.host}:{self.port}{self.path}"

    def _await(self, coro):
        return self._loop.run_until_complete(coro)

    def _connection(self):
        if self._conn is None:
            import asyncssh

            identity = os.environ.get(IDENTITY_ENV)
            known = os.environ.get(KNOWN_HOSTS_ENV)
            options: dict = {"port": self.port}
            if self.user:  # else asyncssh's default, the local user name
                options["username"] = self.user
            if identity:
                options["client_keys"] = [identity]
            if known:
                options["known_hosts"] = known
            try:
                self._conn = self._await(asyncssh.connect(self.host, **options))
                self._sftp = self._await(self._conn.start_sftp_client())
            except (OSError, asyncssh.Error) as e:
                raise StageError(f"runner {self.describe()}: cannot connect: {e}") from None
        return self._conn

    def workdir(self, name: str) -> str:
        return posixpath.join(self.path, name)

    def put(self, files: dict[str, Path], dest: str) -> None:
        self._connection()

        async def send():
            made = set()
            for rel, src in files.items():
                target = posixpath.join(dest, rel)
                parent = posixpath.dirname(target)
                if parent not in made:
                    await self._sftp.makedirs(parent, exist_ok=True)
                    made.add(parent)
                await self._sftp.put(str(src), target)

        self._await(send())

    def execute(self, command: str) -> tuple[int, str, str]:
        result = self._await(self._connection().run(command, check=False))
        status = result.exit_status if result.exit_status is not None else 255
        return status, str(result.stdout or ""), str(result.stderr or "")

    def get(self, remote: str, local: Path) -> None:
        self._connection()
        self._await(self._sftp.get(remote, str(local)))

    def listdir(self, remote: str) -> list[str]:
        self._connection()

        async def walk(folder: str, prefix: str, out: list[str]):
            for entry in await self._sftp.readdir(folder):
                if entry.filename in (".", ".."):
                    continue
                path, rel = posixpath.join(folder, entry.filename), posixpath.join(prefix, entry.filename)
                if await self._sftp.isdir(path):
                    await walk(path, rel, out)
                else:
                    out.append(rel)
            return out

        return sorted(self._await(walk(remote, "", [])))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._await(self._conn.wait_closed())
        self._loop.close()


def bundle(stage: str, build: str) -> dict[str, Path]:
    """What the stage reads, by repo-relative path: keyed code, spec sheets, config, inputs."""
    # The probe runs first on the device and reads every stage's declaration (its TOOLCHAIN),
    # importing every stage module by name, which no import closure shows: so all of them,
    # with their imports. (Only the stage's own closure is its cache key.) On this host the
    # editable install let a missing module fall back to the checkout, which hid it.
    files = {rel: ROOT / rel for rel in closure(RUNNER, *(f"stages/{s}.py" for s in STAGES))}
    files["stages/__init__.py"] = ROOT / "stages" / "__init__.py"
    for sheet in sorted((ROOT / "conf" / "device").glob("*.yaml")):
        files[sheet.relative_to(ROOT).as_posix()] = sheet
    files[f"{BUILDS}/{build}.yaml"] = ROOT / BUILDS / f"{build}.yaml"
    for name in stage_inputs(stage, build_device(build)):
        folder = ROOT / output_dir(name, build)
        manifest.verify(folder, expect_stage=name)  # never ship a modified input
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                files[p.relative_to(ROOT).as_posix()] = p
    return files


def _sha256(path: Path) -> str:
    return manifest.sha256_file(path)


def fetch_output(runner: Runner, remote_folder: str, dest: Path, remote_manifest_sha256: str) -> dict:
    """Copy a remote artifact folder into `dest` and accept it only if it is
    exactly what the remote's manifest says (every file re-hashed here)."""
    dest.mkdir(parents=True)
    names = runner.listdir(remote_folder)
    if manifest.NAME not in names:
        raise StageError(f"{runner.describe()}: {remote_folder} has no {manifest.NAME}: the stage wrote no artifact")
    for rel in names:
        local = dest / rel
        local.parent.mkdir(parents=True, exist_ok=True)
        runner.get(posixpath.join(remote_folder, rel), local)
    got = _sha256(dest / manifest.NAME)
    if got != remote_manifest_sha256:
        raise StageError(f"{dest / manifest.NAME}: sha256 {got[:16]}... differs from the remote's "
                         f"{remote_manifest_sha256[:16]}...: damaged in transfer")
    return manifest.verify(dest)


def _remote_sha256(runner: Runner, path: str) -> str:
    code = "import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],'rb').read()).hexdigest())"
    rc, out, err = runner.execute(f"{shlex.quote(runner.python)} -c {shlex.quote(code)} {shlex.quote(path)}")
    if rc != 0:
        raise StageError(f"{runner.describe()}: cannot hash {path}: {err.strip() or out.strip()}")
    return out.strip().splitlines()[-1]


def run_on(runner: Runner, stage: str, build: str, say=None) -> Path:
    """Run `stage` of `build` through `runner`; the verified output lands in artifacts/."""
    from pipeline.engine.run_stage import _remove_stale, install

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    decl = declaration(stage)
    if decl.scope != "build" or stage == "probe":
        raise StageError(f"stage {stage} cannot go to a runner: only a build's own stages after the probe can")
    files = bundle(stage, build)
    final = ROOT / output_dir(stage, build)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    work = runner.workdir(f"{build}--{stage}-{uuid.uuid4().hex[:12]}")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    try:
        say(f"{stage} [{build}]: on {runner.describe()}: sending {len(files)} files to {work}")
        runner.put(files, work)
        py = shlex.quote(runner.python)
        hostname = f"import socket; print({_HOST_TAG!r}, socket.gethostname())"
        command = (f"cd {shlex.quote(work)} && {py} -c {shlex.quote(hostname)} && "
                   f"{py} -m pipeline.engine.run_stage probe --build {shlex.quote(build)} && "
                   f"{py} -m pipeline.engine.run_stage {shlex.quote(stage)} --build {shlex.quote(build)}")
        rc, out, err = runner.execute(command)
        own = narrate.label(stage, build) + ": ran"  # the device's line for the stage: said below, with its host
        for line in (out + err).splitlines():
            if not line.startswith((_HOST_TAG, own)):
                say(f"  [{runner.kind}] {line}")
        if rc != 0:
            raise StageError(f"{stage} failed on {runner.describe()} (exit {rc}; its output is above)")
        remote_host = next((l.split(None, 1)[1] for l in out.splitlines() if l.startswith(_HOST_TAG)), "?")
        remote_out = posixpath.join(work, output_dir(stage, build))
        m = fetch_output(runner, remote_out, tmp, _remote_sha256(runner, posixpath.join(remote_out, manifest.NAME)))
        _check_key(m, stage, build)
        facts = tmp.parent / f".{final.name}.host-{os.getpid()}.json"
        runner.get(posixpath.join(work, probe_dir(build), "host.json"), facts)
        host = json.loads(facts.read_text())
        facts.unlink()
        provenance = {
            "runner": runner.kind,
            "target": runner.describe(),
            "hostname": remote_host,
            "device_class": host.get("device_class"),
            "cpu_model": host.get("cpu_model"),
            "host": host,
            "remote_workdir": work,
            "remote_manifest_sha256": _sha256(tmp / manifest.NAME),
            "started": started,
            "seconds": round(time.perf_counter() - t0, 3),
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        manifest.write(tmp, stage=m["stage"], build=m["build"], key=m["key"], result=m["result"],
                       timings=m["timings"])
        manifest.verify(tmp, expect_stage=stage)
        install(tmp, final)
        say(narrate.ran_line(narrate.label(stage, build), final,
                             on=f"{remote_host} ({host.get('device_class')}, {host.get('cpu_model')})"))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            runner.remove(work)
        except Exception:  # noqa: BLE001 - a leftover remote folder is not worth a failed stage
            say(f"note: could not remove {work} on {runner.describe()}")
    return final


def _check_key(m: dict, stage: str, build: str) -> None:
    """The remote ran this checkout's code on these inputs (its key says so)."""
    if m.get("stage") != stage or m.get("build") != build:
        raise StageError(f"the remote returned stage {m.get('stage')!r} of {m.get('build')!r}, not {stage} of {build}")
    for rel, digest in m["key"]["code"].items():
        if _sha256(ROOT / rel) != digest:
            raise StageError(f"the remote ran another version of {rel} (sha256 {digest[:16]}...)")
    for name, digest in m["key"]["inputs"].items():
        local = manifest.read(ROOT / output_dir(name, build))["content_sha256"]
        if local != digest:
            raise StageError(f"the remote's {name} input hashed {digest[:16]}..., this checkout's {local[:16]}...")


def set_runner(build: str, spec: dict | None) -> Path:
    """Write (or with None remove) a build's runner file; regenerate dvc.yaml."""
    import yaml

    from pipeline.engine import dvcgen, locks

    path = ROOT / runner_file(build)
    with locks.hold(locks.REGISTRY):
        if spec is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            header = (f"# Runner of build {build}: `python -m pipeline.fleet.runners set` wrote it. The stages\n"
                      f"# listed run there; this file is part of their cache key.\n")
            path.write_text(header + yaml.safe_dump(spec, sort_keys=False))
        dvcgen.write()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.fleet.runners", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("set", help="run some stages of a build on a device")
    p.add_argument("build")
    p.add_argument("target", help="local, or ssh://[user@]host[:port]/absolute/workdir")
    p.add_argument("--python", help="the device's Python with the project's toolchain (ssh default: python3)")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES), help="comma-separated (default: %(default)s)")
    p = sub.add_parser("unset", help="run the build's stages on the builder again")
    p.add_argument("build")
    sub.add_parser("show", help="the builds that have a runner")
    p = sub.add_parser("run", help="run one stage through the build's runner (dvc.yaml's command)")
    p.add_argument("stage")
    p.add_argument("--build", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "set":
            spec = parse_target(args.target)
            stages = [s for s in args.stages.split(",") if s]
            for s in stages:
                if declaration(s).scope != "build" or s == "probe":
                    raise ValueError(f"stage {s} cannot go to a runner (only a build's own stages after the probe)")
            spec["python"] = args.python or (sys.executable if spec["kind"] == "local" else "python3")
            spec["stages"] = stages
            print(set_runner(args.build, spec).relative_to(ROOT))
        elif args.command == "unset":
            set_runner(args.build, None)
        elif args.command == "show":
            for path in sorted((ROOT / RUNNERS_DIR).glob("*.yaml")):
                spec = runner_of(path.stem) or {}
                print(f"{path.stem}: {spec.get('kind')} {spec.get('host', '')} stages {','.join(spec.get('stages', []))}")
        else:
            spec = runner_of(args.build)
            if spec is None:
                raise StageError(f"build {args.build} has no runner ({runner_file(args.build)})")
            runner = make(spec)
            try:
                run_on(runner, args.stage, args.build)
            finally:
                runner.close()
    except (ValueError, KeyError, StageError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2 if args.command in ("set", "unset") else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
