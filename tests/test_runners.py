"""Runners (pipeline/fleet/runners.py) against a real SSH server on loopback: asyncssh
in a thread of the test, a generated host key, a client key, SFTP, and an exec
handler that runs each command in a shell (so the remote side really executes
the stage). The end-to-end test sends a build's parity and benchmark stages
through it and back."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from pipeline.engine import manifest
from pipeline.engine.context import StageError
from pipeline.fleet.runners import IDENTITY_ENV, KNOWN_HOSTS_ENV, PROVENANCE, SshRunner, fetch_output
from tests.conftest import FAST_RUN, TINY_MODEL, ran_stages, run_cli, venv_env

asyncssh = pytest.importorskip("asyncssh", reason="asyncssh is in the test extra: pip install -e '.[test]'")


class LoopbackSsh:
    """An SSH server on 127.0.0.1 that accepts one client key and checks nothing else."""

    def __init__(self, tmp):
        self.commands: list[tuple[str, int]] = []
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        self.identity = tmp / "id_ed25519"
        client_key.write_private_key(str(self.identity))
        self._host_key, self._client_pub = host_key, client_key.convert_to_public()
        self._tmp = tmp
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(30), "the SSH server did not start"
        self.known_hosts = tmp / "known_hosts"
        self.known_hosts.write_text(
            f"[127.0.0.1]:{self.port} {host_key.export_public_key().decode().strip()}\n")

    def _serve(self, started):
        asyncio.set_event_loop(self.loop)

        async def run_command(process):
            proc = await asyncio.create_subprocess_shell(
                process.command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=venv_env())
            out, err = await proc.communicate()
            self.commands.append((process.command, proc.returncode))
            process.stdout.write(out.decode(errors="replace"))
            process.stderr.write(err.decode(errors="replace"))
            process.exit(proc.returncode)

        async def start():
            self.server = await asyncssh.create_server(
                asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[self._host_key],
                authorized_client_keys=asyncssh.import_authorized_keys(
                    self._client_pub.export_public_key().decode()),
                process_factory=run_command, sftp_factory=True)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def env(self) -> dict:
        return {IDENTITY_ENV: str(self.identity), KNOWN_HOSTS_ENV: str(self.known_hosts)}

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def ssh(tmp_path_factory):
    server = LoopbackSsh(tmp_path_factory.mktemp("ssh"))
    yield server
    server.close()


@pytest.fixture
def runner(ssh, tmp_path, monkeypatch):
    for k, v in ssh.env().items():
        monkeypatch.setenv(k, v)
    r = SshRunner("127.0.0.1", ssh.port, "", str(tmp_path / "device"), sys.executable)
    yield r
    r.close()


def _artifact(folder):
    (folder / "sub").mkdir(parents=True)
    (folder / "report.json").write_text('{"decode_tok_s": 100.0}\n')
    (folder / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    return manifest.write(folder, stage="benchmark", build="b", key={"k": 1}, result={}, timings={})


def test_output_comes_back_checked_by_hash(runner, tmp_path):
    remote = tmp_path / "device" / "out"
    _artifact(remote)
    sha = manifest.sha256_file(remote / manifest.NAME)
    m = fetch_output(runner, str(remote), tmp_path / "back", sha)
    assert m["stage"] == "benchmark"
    assert (tmp_path / "back" / "sub" / "weights.bin").read_bytes() == (remote / "sub" / "weights.bin").read_bytes()
    # A file changed after the stage wrote its manifest is refused by name.
    (remote / "sub" / "weights.bin").write_bytes(b"\0" * 100)
    with pytest.raises(StageError, match="weights.bin"):
        fetch_output(runner, str(remote), tmp_path / "back2", sha)
    # A manifest that does not hash as the remote said is refused (damaged in transfer).
    with pytest.raises(StageError, match="damaged in transfer"):
        fetch_output(runner, str(remote), tmp_path / "back3", "0" * 64)


def test_an_unknown_host_key_is_refused(ssh, tmp_path, monkeypatch):
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    (tmp_path / "kh").write_text(f"[127.0.0.1]:{ssh.port} {other}\n")
    monkeypatch.setenv(IDENTITY_ENV, str(ssh.identity))
    monkeypatch.setenv(KNOWN_HOSTS_ENV, str(tmp_path / "kh"))
    r = SshRunner("127.0.0.1", ssh.port, "", str(tmp_path), sys.executable)
    try:
        with pytest.raises(StageError, match="cannot connect"):
            r.execute("true")
    finally:
        r.close()


@pytest.mark.slow
def test_parity_and_benchmark_run_on_the_device_over_ssh(built_repo, ssh, tmp_path):
    repo, _ = built_repo
    build = "x86_avx512-embedded-speed"
    device_dir = tmp_path / "device"
    target = f"ssh://127.0.0.1:{ssh.port}{device_dir}"
    env = dict(venv_env(), **ssh.env())
    set_ = subprocess.run([sys.executable, "-m", "pipeline.fleet.runners", "set", build, target, "--python", sys.executable],
                          cwd=repo, capture_output=True, text=True, env=env)
    assert set_.returncode == 0, set_.stderr
    assert f"python -m pipeline.fleet.runners run benchmark --build {build}" in (repo / "dvc.yaml").read_text()
    before = len(ssh.commands)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "device=x86_avx512", *TINY_MODEL, *FAST_RUN],
                          cwd=repo, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    own = [r for r in ran_stages(proc.stdout + proc.stderr) if not r.endswith("--probe") and not r.startswith("probe--")]
    assert own == [f"{build}--verify_parity", f"{build}--benchmark"], own
    # The device really ran each stage (after its own probe), through the SSH server.
    ran_remote = [c for c, rc in ssh.commands[before:] if "pipeline.engine.run_stage" in c and rc == 0]
    assert any(f"run_stage verify_parity --build {build}" in c for c in ran_remote), ssh.commands[before:]
    assert any(f"run_stage benchmark --build {build}" in c for c in ran_remote)
    assert all("run_stage probe" in c for c in ran_remote)
    host_class = json.loads((repo / "artifacts" / build / "probe" / "host.json").read_text())["device_class"]
    for stage in ("verify_parity", "benchmark"):
        out = repo / "artifacts" / build / stage
        m = manifest.verify(out, expect_stage=stage)
        assert PROVENANCE in m["files"]
        prov = json.loads((out / PROVENANCE).read_text())
        assert prov["runner"] == "ssh" and prov["target"] == f"ssh://127.0.0.1:{ssh.port}{device_dir}"
        # the "device" is this machine over SSH: whatever class it probes as (x86_avx512 on the
        # AMD builders, xeon_amx on an Intel host with AMX)
        assert prov["hostname"] and prov["device_class"] == host_class and prov["remote_workdir"].startswith(
            str(device_dir))
    report = json.loads((repo / "artifacts" / build / "benchmark" / "report.json").read_text())
    assert report["host"]["device_class"] == host_class and report["on_target"] is (host_class == "x86_avx512")
    assert not list(device_dir.glob("*")), "the remote work folder was left behind"
    # Back on the builder: its own earlier results are restored from DVC's run-cache, not re-run.
    unset = subprocess.run([sys.executable, "-m", "pipeline.fleet.runners", "unset", build], cwd=repo, env=env,
                           capture_output=True, text=True)
    assert unset.returncode == 0, unset.stderr
    back = run_cli(repo, "device=x86_avx512", *TINY_MODEL, *FAST_RUN)
    assert back.returncode == 0, back.stderr[-3000:]
    assert [r for r in ran_stages(back.stdout + back.stderr) if not r.endswith("--probe") and not r.startswith("probe--")] == []
    assert not (repo / "artifacts" / build / "benchmark" / PROVENANCE).exists()
