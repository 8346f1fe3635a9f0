"""llama.cpp's llama-server on this host, as a llama.cpp build's users run it: one process on a free local
port, greedy completions over its HTTP API with the server's own timings (decode tok/s, draft tokens made
and kept). Not a step runtime (pipeline/runtimes/contract.py): the server schedules its own decoding,
speculative or not. pipeline/measure/speculative.py measures its `--spec-type` modes with it; the binary
is built and found by pipeline/toolchains/llama_server.py.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from pipeline.runtimes.vllm import free_port


class LlamaServer:
    """One llama-server process on a free local port; `complete` is a greedy /completion request."""

    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int, mode: str | None, timeout: float = 180):
        self.port = free_port()
        self.args = [str(binary), "-m", str(gguf), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
                     "-np", "1", "--host", "127.0.0.1", "--port", str(self.port)] + (["--spec-type", mode] if mode else [])
        # its log to a file, not a pipe: a server logs every request, and a pipe nobody reads fills and blocks it
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().strip().splitlines()[-3:]
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} at start ({' '.join(self.args[1:])}): "
                                   + " | ".join(tail))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                self.close()
                raise RuntimeError(f"llama-server not ready after {timeout:.0f} s ({' '.join(self.args[1:])})")
            time.sleep(0.2)

    def complete(self, text: str, n: int) -> dict:
        body = {"prompt": text, "n_predict": n, "temperature": 0.0, "top_k": 1, "seed": 0, "cache_prompt": False,
                "return_tokens": True}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def prompt_tokens(self, text: str) -> int:
        """How many tokens the server makes of `text` as a prompt (its special tokens included)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/tokenize",
                                     json.dumps({"content": text, "add_special": True}).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return len(json.loads(r.read())["tokens"])

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001 - a server that ignores SIGTERM
            self.proc.kill()
            self.proc.wait()
        self.log.close()
