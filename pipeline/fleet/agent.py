#!/usr/bin/env python3
"""edgekiln device agent: keeps one device on the version of its build that the rollout service assigns.

    python3 agent.py --service https://fleet.example:8470 --token-file /etc/edgekiln/token \\
        --device-id phone-007 --device-class galaxy_s25 --model embedded \\
        --store s3://fleet-store/edgekiln --root /opt/edgekiln [--python /opt/venv/bin/python] [--once]
    python -m pipeline.fleet.agent ...          # the same, from a clone of the repository

A device (a phone, a board, a server) runs this to learn which version to run, fetch it, verify it,
switch to it, check its health and roll itself back when the check fails. Each step:

1. Check in: `POST {service}/v1/checkin` with `Authorization: Bearer <device token>` and
   `{"device_id", "device_class", "model", "current": <bundle sha256 running> | null, "report": null |
   {"bundle_sha256", "outcome": "healthy"|"unchecked"|"failed", "detail", "decode_tok_s", "rolled_back_to",
   "at"}, "agent": "edgekiln-agent/1"}`. The answer: `{"assigned": null | {"bundle_sha256", "version",
   "record_sha256"}, "rollout": null | {"id", "stage", "state"}, "interval_s"}`; 401/403 with
   `{"error": "..."}` when the service refuses the device. Nothing assigned, or the version running:
   done.
2. The version's record (what `registry publish` wrote as registry/versions/<bundle sha256>.json):
   `GET {service}/v1/records/{record_sha256}`. Its bytes must hash to the record_sha256 the check-in
   pinned, it must name the assigned bundle sha256, and its files must hash to that bundle sha256
   (pipeline.engine.manifest.content_hash, written again below): a device refuses a manifest the
   registry did not publish.
3. Install into a hidden `.staging-*` folder under --root: every file of the record fetched from the
   store (the DVC remote the registry pushed to; blobs by md5 at `<store>/files/md5/<md5[:2]>/<md5[2:]>`,
   DVC 3's layout), its size and sha256 checked while it streams, then the bundle sha256 over them all;
   then one rename into `versions/<bundle sha256>/` (with RELEASE.json: version, bundle_sha256,
   record_sha256, installed_at, the health spec). A mismatch refuses the version by file name, blob and
   both hashes, removes the staging folder, leaves `current` alone and reports "failed" with a detail
   starting "integrity:". A version already under versions/ is switched to without fetching.
4. Switch: `previous` -> the old current, `current` -> `versions/<sha>` (relative symlinks, each made
   at a temporary name and moved over the old one with os.replace: a reader sees the old or the new
   one, never none).
5. Health check, from the record's `health`: `{"command": ["{python}", "deploy_profile/health_check.py",
   ...], "tokens": [...], "decode_tok_s": float|null, "noise_floor": 0.08, "timeout_s": 300}`, run in
   the version folder (`{python}`: --python, the device's runtime interpreter; `{dir}`: the version
   folder). Its last non-empty stdout line is `{"tokens": [...], "decode_tok_s": float|null}`. It fails
   on a non-zero exit, a timeout, output that does not parse, other tokens, or decode_tok_s below the
   recorded figure x (1 - noise_floor). No health spec: outcome "unchecked".
6. Failed: `current` and `previous` go back to what they were (atomically) and the report says
   "failed" with `rolled_back_to`; else "healthy" (or "unchecked"). The report is written to
   agent.json first, then delivered by a second check-in right away, and cleared only once a check-in
   took it: an agent killed in between delivers it on its next check-in. A switch interrupted before
   its report (power loss during the health check) is finished on the next start: the health check is
   run again. Then versions/ is pruned to current and previous.

A version that failed here (integrity or health) is not fetched or switched to again for the same
record for --retry-failed-after seconds (1 hour), so a device does not flap while the service still
assigns it (the service itself gives a device that reported a failure its baseline back).

State under --root: `versions/<sha>/`, `current`, `previous`, `agent.json` (the pending report, the
switch in progress, the last assignment, the versions that failed here), `.agent.lock` (one agent per
root: a second one is refused rather than racing the first).

Why the standard library only, and why some of it is written by hand: this file is what goes onto the
device, often a phone or a board with a bare `python3` and no pip, no git, no DVC and no copy of this
repository. So it imports nothing but the standard library (Python 3.9+): copy the one file and run it
(tests/test_fleet_agent.py runs it alone under `python -I -S`). That is why the bundle hash is written
again here instead of imported from pipeline.engine.manifest (a test holds the two equal), why HTTP is
urllib, and why S3 requests are signed with AWS Signature Version 4 written out with hmac and hashlib
(boto3 and botocore are not on a device, and are ~35 MB for one GET).

Stores (--store): a folder (`/srv/store` or `file:///srv/store`); `http://` or `https://` (any static
server over the remote's folder: nginx, `python -m http.server`); `s3://bucket/prefix`, signed when
AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY are set (AWS_SESSION_TOKEN optional; region AWS_REGION or
AWS_DEFAULT_REGION, us-east-1 by default; AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL for an S3-compatible
endpoint, path-style then), unsigned otherwise (a public bucket).

Output: one line per step on stdout (`agent phone-007: assigned v2 (3f2a9c1e) by rollout 4 stage 1;
fetched 9 files, 3.1 MB; health: 16/16 tokens match, decode 812 tok/s (build 800, floor 8%); running
v2; report delivered`), `error: agent: ...` on stderr. Without --once it loops, sleeping the service's
interval_s (or --interval); a failed step is logged and retried with a backoff, never a traceback.
Exit codes with --once: 0 ok, 1 error, 2 usage, 3 health check failed (rolled back), 4 integrity
refused, 5 refused by the service (401/403).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import hmac
import http.client
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

try:  # one agent per root; fcntl is POSIX (every device this targets), absent on Windows
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

AGENT = "edgekiln-agent/1"
STATE_FORMAT = "edgekiln-agent-state/1"
STATE_FILE = "agent.json"
RELEASE_FILE = "RELEASE.json"
VERSIONS = "versions"
CHUNK = 1 << 20
MAX_RESPONSE = 64 << 20  # a check-in answer or a record; a blob streams
DEFAULT_NOISE_FLOOR = 0.08
DEFAULT_HEALTH_TIMEOUT_S = 300.0
RETRY_FAILED_AFTER_S = 3600.0
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
# Not passed on to a health check: it needs none of the agent's credentials.
SECRET_ENV = ("EDGEKILN_DEVICE_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


class AgentError(Exception):
    """A one-line error; exit 1."""

    code = 1


class ServiceRefused(AgentError):
    """The service answered 401 or 403: this device's token or identity is refused."""

    code = 5


class IntegrityRefused(AgentError):
    """A record or a blob that is not what the registry published; the version is refused."""

    code = 4


class _BlobMissing(Exception):
    pass


# ---------------------------------------------------------------- hashing


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def content_hash(files: dict) -> str:
    """A bundle's sha256: over every file's path and sha256. Written again from
    pipeline.engine.manifest.content_hash (this file imports nothing of the project);
    tests/test_fleet_agent.py holds the two equal on a real registry.bundle_files dict."""
    return hashlib.sha256(canonical_json({k: v["sha256"] for k, v in files.items()}).encode()).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    if n < 1000 ** 2:
        return f"{n / 1000:.1f} kB"
    if n < 1000 ** 3:
        return f"{n / 1000 ** 2:.1f} MB"
    return f"{n / 1000 ** 3:.2f} GB"


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _tok(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fsync_dir(path: str) -> None:
    """Make a rename or a new link in `path` durable (a device loses power); best effort off POSIX."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


# ---------------------------------------------------------------- HTTP


def _error_text(e: urllib.error.HTTPError) -> str:
    """The one-line reason in an error response: the service's {"error": ...}, S3's <Code>/<Message>."""
    try:
        body = e.read(65536) or b""
    except Exception:  # noqa: BLE001 - a broken error body still has its status
        body = b""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and (doc.get("error") or doc.get("detail")):
            return _one_line(doc.get("error") or doc.get("detail"))
    except ValueError:
        pass
    code = re.search(rb"<Code>(.*?)</Code>", body)
    if code:
        msg = re.search(rb"<Message>(.*?)</Message>", body)
        return _one_line(code.group(1).decode(errors="replace")
                         + (": " + msg.group(1).decode(errors="replace") if msg else ""))
    return _one_line(body.decode(errors="replace")) or (e.reason if isinstance(e.reason, str) else "") or "no detail"


def _reason(e: BaseException) -> str:
    r = getattr(e, "reason", None) or e
    return _one_line(getattr(r, "strerror", None) or str(r) or type(r).__name__)


def _open(req: urllib.request.Request, timeout: float):
    return urllib.request.urlopen(req, timeout=timeout)


# ---------------------------------------------------------------- AWS Signature V4


def sigv4_headers(method: str, url: str, *, region: str, access_key: str, secret_key: str,
                  session_token: str | None = None, headers: dict | None = None,
                  payload_sha256: str = EMPTY_SHA256, service: str = "s3", now: _dt.datetime | None = None) -> dict:
    """The headers that sign one request with AWS Signature Version 4 (header form).

    Written by hand with hmac/hashlib because boto3 is not on a device. The steps are AWS's
    (docs.aws.amazon.com/IAM/latest/UserGuide/create-signed-request.html): a canonical request
    (method, the URI path exactly as sent, the sorted query, the lower-cased sorted headers, the
    signed header names, the payload's sha256), the string to sign (algorithm, time, scope, the
    canonical request's sha256), a key derived by HMAC chaining date -> region -> service ->
    "aws4_request", and the HMAC of the string with it. S3 takes the path as sent (encoded once, not
    normalized) and wants x-amz-content-sha256 (the empty body's sha256 for a GET). Every header
    passed in is signed, and Host is set explicitly, so what urllib sends is what was signed.
    """
    parts = urllib.parse.urlsplit(url)
    stamp = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    day = stamp[:8]
    h = {k.lower(): " ".join(str(v).split()) for k, v in (headers or {}).items()}
    h["host"] = parts.netloc.rsplit("@", 1)[-1]
    h["x-amz-date"] = stamp
    h["x-amz-content-sha256"] = payload_sha256
    if session_token:
        h["x-amz-security-token"] = session_token
    names = sorted(h)
    signed = ";".join(names)
    query = sorted((urllib.parse.quote(k, safe="-_.~"), urllib.parse.quote(v, safe="-_.~"))
                   for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    canonical = "\n".join([
        method.upper(),
        parts.path or "/",
        "&".join(f"{k}={v}" for k, v in query),
        "".join(f"{n}:{h[n]}\n" for n in names),
        signed,
        payload_sha256,
    ])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out = {("Host" if n == "host" else n): h[n] for n in names}
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, "
                            f"Signature={signature}")
    return out


# ---------------------------------------------------------------- stores


class LocalStore:
    """A DVC remote on a path (a mount, a USB stick, a synced folder)."""

    def __init__(self, path: str):
        self.base = os.path.abspath(path)

    def where(self, md5: str) -> str:
        return os.path.join(self.base, "files", "md5", md5[:2], md5[2:])

    def open(self, md5: str, timeout: float):
        try:
            return open(self.where(md5), "rb")
        except FileNotFoundError:
            raise _BlobMissing()
        except OSError as e:
            raise AgentError(f"store: {self.where(md5)}: {_reason(e)}")


class HttpStore:
    """A DVC remote's folder behind any static HTTP(S) server; blobs stream in chunks."""

    def __init__(self, url: str):
        self.base = url.rstrip("/")

    def where(self, md5: str) -> str:
        return f"{self.base}/files/md5/{md5[:2]}/{md5[2:]}"

    def _request(self, md5: str) -> urllib.request.Request:
        return urllib.request.Request(self.where(md5), headers={"User-Agent": AGENT})

    def open(self, md5: str, timeout: float):
        req = self._request(md5)
        try:
            return _open(req, timeout)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise _BlobMissing()
            raise AgentError(f"store: GET {self.where(md5)}: HTTP {e.code}: {_error_text(e)}")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise AgentError(f"store: GET {self.where(md5)}: {_reason(e)}")


class S3Store(HttpStore):
    """s3://bucket/prefix, GETs signed with SigV4 (sigv4_headers) when credentials are set."""

    def __init__(self, url: str, env):
        parts = urllib.parse.urlsplit(url)
        self.bucket, self.prefix = parts.netloc, parts.path.strip("/")
        if not self.bucket:
            raise AgentError(f"store {url!r}: no bucket (s3://bucket/prefix)")
        self.region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.access_key = env.get("AWS_ACCESS_KEY_ID") or None
        self.secret_key = env.get("AWS_SECRET_ACCESS_KEY") or None
        self.session_token = env.get("AWS_SESSION_TOKEN") or None
        self.endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "").rstrip("/") or None
        self.url = url

    def key(self, md5: str) -> str:
        return "/".join(p for p in (self.prefix, "files", "md5", md5[:2], md5[2:]) if p)

    def where(self, md5: str) -> str:
        return f"s3://{self.bucket}/{self.key(md5)}"

    def http_url(self, md5: str) -> str:
        path = urllib.parse.quote(self.key(md5), safe="/")
        bucket = urllib.parse.quote(self.bucket, safe="")
        if self.endpoint:  # an S3-compatible endpoint (MinIO, Ceph, moto...): path-style
            return f"{self.endpoint}/{bucket}/{path}"
        if "." in self.bucket:  # a dotted bucket breaks the wildcard certificate of virtual-hosted style
            return f"https://s3.{self.region}.amazonaws.com/{bucket}/{path}"
        return f"https://{self.bucket}.s3.{self.region}.amazonaws.com/{path}"

    def _request(self, md5: str) -> urllib.request.Request:
        url = self.http_url(md5)
        headers = {"User-Agent": AGENT}
        if self.access_key and self.secret_key:
            headers.update(sigv4_headers("GET", url, region=self.region, access_key=self.access_key,
                                         secret_key=self.secret_key, session_token=self.session_token))
        return urllib.request.Request(url, headers=headers)


def open_store(spec: str, env=None):
    env = os.environ if env is None else env
    scheme = urllib.parse.urlsplit(spec).scheme.lower()
    if scheme in ("http", "https"):
        return HttpStore(spec)
    if scheme == "s3":
        return S3Store(spec, env)
    if scheme == "file":
        return LocalStore(urllib.request.url2pathname(urllib.parse.urlsplit(spec).path))
    if scheme and len(scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise AgentError(f"store {spec!r}: unsupported scheme {scheme}:// (a path, file://, http(s)://, s3://)")
    return LocalStore(spec)


# ---------------------------------------------------------------- the agent


def _check_assigned(a) -> dict | None:
    if a is None:
        return None
    if not isinstance(a, dict) or not all(isinstance(a.get(k), str) for k in ("bundle_sha256", "record_sha256")) \
            or not _HEX64.fullmatch(a["bundle_sha256"]) or not _HEX64.fullmatch(a["record_sha256"]):
        raise AgentError(f"service: malformed assignment {_one_line(json.dumps(a), 200)}")
    return {"bundle_sha256": a["bundle_sha256"], "record_sha256": a["record_sha256"],
            "version": str(a.get("version") or a["bundle_sha256"][:8])}


def _check_record(record, a: dict) -> dict:
    """The record's files, once it is shown to be the assigned version's (else IntegrityRefused)."""
    sha, name = a["bundle_sha256"], a["version"]
    if not isinstance(record, dict):
        raise IntegrityRefused(f"record of {name}: not a JSON object")
    if record.get("bundle_sha256") != sha:
        raise IntegrityRefused(f"record of {name}: names bundle {str(record.get('bundle_sha256'))[:16]}..., "
                               f"not the assigned {sha[:16]}...")
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        raise IntegrityRefused(f"record of {name}: lists no files")
    for rel, meta in files.items():
        parts = rel.split("/") if isinstance(rel, str) else []
        # the paths become paths on the device: nothing absolute, no "..", no backslash, not RELEASE.json
        if not parts or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts) \
                or rel == RELEASE_FILE:
            raise IntegrityRefused(f"record of {name}: unsafe file path {rel!r}")
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) \
                or not _HEX64.fullmatch(meta["sha256"]) or not isinstance(meta.get("md5"), str) \
                or not _HEX32.fullmatch(meta["md5"]) or not isinstance(meta.get("bytes"), int) \
                or isinstance(meta.get("bytes"), bool) or meta["bytes"] < 0:
            raise IntegrityRefused(f"record of {name}: {rel}: needs sha256, md5 and bytes")
    got = content_hash(files)
    if got != sha:
        raise IntegrityRefused(f"record of {name}: its files hash to bundle {got[:16]}..., "
                               f"not the assigned {sha[:16]}...")
    return files


class Agent:
    """One device's agent. `step()` is one check-in and what follows from it.

    No process-wide state (no chdir, no signals, no globals written): many agents run as threads
    in one process, each on its own root. Concurrent step() calls on one instance take turns."""

    def __init__(self, *, service: str, device_id: str, device_class: str, model: str, store: str, root: str,
                 token: str | None = None, token_file: str | None = None, python: str | None = None,
                 env=None, retry_failed_after_s: float = RETRY_FAILED_AFTER_S, http_timeout_s: float = 30.0):
        if not token and not token_file:
            raise AgentError("no device token (--token, --token-file or EDGEKILN_DEVICE_TOKEN)")
        if urllib.parse.urlsplit(service).scheme not in ("http", "https"):
            raise AgentError(f"--service {service!r}: an http:// or https:// URL")
        self.service = service.rstrip("/")
        self.device_id, self.device_class, self.model = device_id, device_class, model
        self.store = open_store(store, env)
        self.root = os.path.abspath(root)
        self.token, self.token_file = token, token_file
        self.python = python or sys.executable
        self.retry_failed_after_s = float(retry_failed_after_s)
        self.http_timeout_s = float(http_timeout_s)
        self._lock = threading.Lock()
        self._tag = f"{os.getpid()}-{threading.get_ident()}"

    # ------------------------------------------------------------ paths, links, state

    def _p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _vdir(self, sha: str) -> str:
        return self._p(VERSIONS, sha)

    def _link(self, name: str) -> str | None:
        """The bundle sha256 a link (current, previous) points at, if it points at an installed version."""
        try:
            target = os.readlink(self._p(name))
        except OSError:
            return None
        sha = os.path.basename(target.rstrip("/\\"))
        return sha if _HEX64.fullmatch(sha) and os.path.isdir(self._vdir(sha)) else None

    def _point(self, name: str, sha: str | None) -> None:
        """Point `name` at versions/<sha> atomically: a new link at a temporary name moved over the old one."""
        path = self._p(name)
        if sha is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        else:
            tmp = self._p(f".{name}.tmp-{self._tag}")
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            os.symlink(f"{VERSIONS}/{sha}", tmp, target_is_directory=True)
            os.replace(tmp, path)
        _fsync_dir(self.root)

    def _release(self, sha: str | None) -> dict | None:
        if not sha:
            return None
        try:
            with open(os.path.join(self._vdir(sha), RELEASE_FILE), encoding="utf-8") as f:
                rel = json.load(f)
        except (OSError, ValueError):
            return None
        return rel if isinstance(rel, dict) and rel.get("bundle_sha256") == sha else None

    def _name(self, sha: str | None) -> str:
        if not sha:
            return "nothing"
        rel = self._release(sha) or {}
        return f"{rel.get('version') or '?'} ({sha[:8]})"

    def _load_state(self, res: dict) -> dict:
        st = {"format": STATE_FORMAT, "device_id": self.device_id, "pending_report": None, "in_progress": None,
              "assignment": None, "failed": {}}
        path = self._p(STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
            if not isinstance(loaded, dict):
                raise ValueError("not an object")
            st.update(loaded)
            if not isinstance(st.get("failed"), dict):
                st["failed"] = {}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            # A state file that does not parse must not wedge the device: keep it aside and start over.
            aside = f"{path}.corrupt-{int(time.time())}"
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            res["notes"].append(f"{STATE_FILE} unreadable ({_one_line(e, 80)}), kept as {os.path.basename(aside)}")
        return st

    def _save_state(self, st: dict) -> None:
        _atomic_write(self._p(STATE_FILE), json.dumps(st, indent=2, sort_keys=True) + "\n")

    @contextlib.contextmanager
    def _root_lock(self):
        if fcntl is None:  # pragma: no cover
            yield
            return
        fd = os.open(self._p(".agent.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise AgentError(f"another agent is working in {self.root} (it holds .agent.lock there)")
            yield
        finally:
            os.close(fd)

    def _clean(self) -> None:
        """Leftovers of an agent killed mid-step (under the root lock, so none is in use)."""
        for n in os.listdir(self.root):
            if n.startswith((".staging-", ".trash-")):
                shutil.rmtree(self._p(n), ignore_errors=True)
            elif n.startswith((".current.tmp-", ".previous.tmp-", f"{STATE_FILE}.tmp-")):
                with contextlib.suppress(OSError):
                    os.remove(self._p(n))

    def _prune(self) -> None:
        keep = {self._link("current"), self._link("previous")}
        for n in os.listdir(self._p(VERSIONS)):
            if n not in keep:
                trash = self._p(f".trash-{n[:16]}-{self._tag}")
                with contextlib.suppress(OSError):
                    os.rename(self._p(VERSIONS, n), trash)
                    shutil.rmtree(trash, ignore_errors=True)

    # ------------------------------------------------------------ service

    def _bearer(self) -> str:
        if self.token:
            return self.token
        try:  # read at each request: a token rotated on disk is picked up without a restart
            with open(self.token_file, encoding="utf-8") as f:
                tok = f.read().strip()
        except OSError as e:
            raise AgentError(f"token file {self.token_file}: {_reason(e)}")
        if not tok:
            raise AgentError(f"token file {self.token_file}: empty")
        return tok

    def _call(self, what: str, path: str, body: dict | None = None) -> bytes:
        url = self.service + path
        headers = {"Authorization": f"Bearer {self._bearer()}", "User-Agent": AGENT, "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
        try:
            with _open(req, self.http_timeout_s) as r:
                raw = r.read(MAX_RESPONSE + 1)
        except urllib.error.HTTPError as e:
            msg = _error_text(e)
            if e.code in (401, 403):
                raise ServiceRefused(f"{what}: the service refused device {self.device_id} ({e.code}): {msg}")
            raise AgentError(f"{what}: HTTP {e.code} from {url}: {msg}")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise AgentError(f"{what}: cannot reach {url}: {_reason(e)}")
        if len(raw) > MAX_RESPONSE:
            raise AgentError(f"{what}: the answer from {url} is over {_size(MAX_RESPONSE)}")
        return raw

    def _checkin(self, report: dict | None) -> dict:
        body = {"device_id": self.device_id, "device_class": self.device_class, "model": self.model,
                "current": self._link("current"), "report": report, "agent": AGENT}
        raw = self._call("check-in", "/v1/checkin", body)
        try:
            resp = json.loads(raw)
        except ValueError:
            raise AgentError(f"check-in: the answer is not JSON: {_one_line(raw.decode(errors='replace'), 120)}")
        if not isinstance(resp, dict):
            raise AgentError("check-in: the answer is not a JSON object")
        resp["assigned"] = _check_assigned(resp.get("assigned"))
        return resp

    def _fetch_record(self, a: dict) -> dict:
        raw = self._call("record", f"/v1/records/{a['record_sha256']}")
        got = hashlib.sha256(raw).hexdigest()
        if got != a["record_sha256"]:
            raise IntegrityRefused(f"record of {a['version']}: its bytes hash to {got[:16]}..., not the "
                                   f"record_sha256 {a['record_sha256'][:16]}... the service pinned")
        try:
            return json.loads(raw)
        except ValueError:
            raise IntegrityRefused(f"record of {a['version']}: not JSON")

    def _report(self, sha: str, outcome: str, detail: str, decode_tok_s=None, rolled_back_to=None) -> dict:
        return {"bundle_sha256": sha, "outcome": outcome, "detail": detail,
                "decode_tok_s": float(decode_tok_s) if _num(decode_tok_s) else None,
                "rolled_back_to": rolled_back_to, "at": _now()}

    def _deliver(self, st: dict, res: dict) -> None:
        """Check in again right away with the pending report; it stays in agent.json if that fails."""
        try:
            resp = self._checkin(st["pending_report"])
        except AgentError as e:
            res["reported"], res["report_error"] = False, str(e)
            return
        res["delivered"].append(st["pending_report"])
        res["reported"] = True
        res["interval_s"] = resp.get("interval_s", res["interval_s"])
        st["pending_report"] = None
        self._save_state(st)

    # ------------------------------------------------------------ install

    def _fetch_file(self, rel: str, meta: dict, target: str) -> str:
        """One blob into target, size and sha256 checked while it streams; its sha256."""
        md5, want = meta["md5"], meta["bytes"]
        where = self.store.where(md5)
        try:
            src = self.store.open(md5, self.http_timeout_s * 2)
        except _BlobMissing:
            raise IntegrityRefused(f"{rel}: blob {where} is not on the store")
        h, n = hashlib.sha256(), 0
        try:
            with open(target, "wb") as out:
                while True:
                    try:
                        chunk = src.read(CHUNK)
                    except (OSError, http.client.HTTPException) as e:
                        raise AgentError(f"store: reading {where}: {_reason(e)}")
                    if not chunk:
                        break
                    n += len(chunk)
                    if n > want:  # stop early: a replaced blob must not fill the device's disk
                        raise IntegrityRefused(f"{rel}: more than the recorded {want} bytes on the store "
                                               f"(replaced blob {where})")
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        finally:
            src.close()
        if n != want:
            raise IntegrityRefused(f"{rel}: {n} bytes on the store, {want} recorded "
                                   f"(truncated or replaced blob {where})")
        got = h.hexdigest()
        if got != meta["sha256"]:
            raise IntegrityRefused(f"{rel}: sha256 {got[:16]}... does not match the recorded "
                                   f"{meta['sha256'][:16]}... (tampered blob {where})")
        return got

    def _install(self, a: dict, record: dict, files: dict, res: dict) -> dict:
        sha = a["bundle_sha256"]
        staging = tempfile.mkdtemp(prefix=f".staging-{sha[:12]}-", dir=self.root)
        try:
            total, got = 0, {}
            for rel, meta in sorted(files.items()):
                target = os.path.join(staging, *rel.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                got[rel] = {"sha256": self._fetch_file(rel, meta, target)}
                total += meta["bytes"]
            bundle = content_hash(got)
            if bundle != sha:
                raise IntegrityRefused(f"the fetched files hash to bundle {bundle[:16]}..., "
                                       f"not the assigned {sha[:16]}...")
            release = self._release_doc(a, record)
            _atomic_write(os.path.join(staging, RELEASE_FILE), json.dumps(release, indent=2, sort_keys=True) + "\n")
            vdir = self._vdir(sha)
            if os.path.lexists(vdir):  # an incomplete copy (no RELEASE.json): replaced by the verified one
                trash = self._p(f".trash-{sha[:16]}-{self._tag}")
                os.rename(vdir, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(staging, vdir)
            _fsync_dir(self._p(VERSIONS))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        res.update(installed=True, fetched_files=len(files), fetched_bytes=total)
        return release

    def _release_doc(self, a: dict, record: dict) -> dict:
        return {"version": a["version"], "bundle_sha256": a["bundle_sha256"], "record_sha256": a["record_sha256"],
                "installed_at": _now(), "device": record.get("device"), "model": record.get("model"),
                "build": record.get("build"), "health": record.get("health")}

    def _obtain(self, a: dict, res: dict) -> dict:
        """The assigned version on disk (fetched unless already there): its RELEASE.json."""
        sha = a["bundle_sha256"]
        release = self._release(sha)
        if release and release.get("record_sha256") == a["record_sha256"]:
            return release
        record = self._fetch_record(a)
        files = _check_record(record, a)
        if release:  # the same files under another record (a re-published health spec): no fetch
            release = {**self._release_doc(a, record), "installed_at": release.get("installed_at")}
            _atomic_write(os.path.join(self._vdir(sha), RELEASE_FILE),
                          json.dumps(release, indent=2, sort_keys=True) + "\n")
            return release
        return self._install(a, record, files, res)

    # ------------------------------------------------------------ health

    def health_check(self, spec, vdir: str) -> tuple[str, str, float | None]:
        """(outcome, detail, decode tok/s) of a version's health check, run in its folder."""
        if not spec:
            return "unchecked", "no health check was recorded for this build", None
        cmd = spec.get("command") if isinstance(spec, dict) else None
        if not isinstance(cmd, list) or not cmd or not all(isinstance(c, str) for c in cmd):
            return "failed", "health: the recorded health spec has no command", None
        argv = [c.replace("{python}", self.python).replace("{dir}", vdir) for c in cmd]
        timeout = float(spec.get("timeout_s") or DEFAULT_HEALTH_TIMEOUT_S)
        try:
            proc = subprocess.Popen(argv, cwd=vdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=(os.name == "posix"),
                                    env={k: v for k, v in os.environ.items() if k not in SECRET_ENV})
        except OSError as e:
            return "failed", f"health: cannot run {argv[0]}: {_reason(e)}", None
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # its own session: the whole group goes, a runtime's worker processes included
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL) if os.name == "posix" else proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            return "failed", f"health: timed out after {timeout:g} s", None
        if proc.returncode != 0:
            last = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
            status = f"exit status {proc.returncode}" + (
                f" (signal {-proc.returncode})" if proc.returncode < 0 else "")
            return "failed", f"health: {status}: {_one_line(last[-1]) if last else 'nothing on stderr'}", None
        lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
        try:
            got = json.loads(lines[-1])
            if not isinstance(got, dict) or not isinstance(got.get("tokens"), list):
                raise ValueError
        except (IndexError, ValueError):
            shown = _one_line(lines[-1], 120) if lines else "no output"
            return "failed", ("health: the last stdout line is not the JSON {\"tokens\": [...], "
                              f"\"decode_tok_s\": ...}}: {shown!r}"), None
        tokens, mine = spec.get("tokens"), got["tokens"]
        tok_s = got.get("decode_tok_s") if _num(got.get("decode_tok_s")) else None
        said = []
        if isinstance(tokens, list):
            for i, (want, have) in enumerate(zip(tokens, mine)):
                if want != have:
                    return "failed", (f"health: tokens differ at position {i}: recorded {want}, got {have} "
                                      f"({i}/{len(tokens)} match before it)"), tok_s
            if len(mine) != len(tokens):
                return "failed", (f"health: {len(mine)} tokens, {len(tokens)} recorded (the first "
                                  f"{min(len(mine), len(tokens))} match)"), tok_s
            said.append(f"{len(tokens)}/{len(tokens)} tokens match")
        else:
            said.append(f"{len(mine)} tokens (none recorded to compare)")
        build = spec.get("decode_tok_s")
        floor = spec.get("noise_floor")
        floor = float(floor) if _num(floor) else DEFAULT_NOISE_FLOOR
        if tok_s is not None and _num(build):
            limit = build * (1 - floor)
            if tok_s < limit:
                return "failed", (f"health: decode {_tok(tok_s)} tok/s below the floor {_tok(limit)} "
                                  f"(build {_tok(build)}, floor {floor:.0%})"), tok_s
            said.append(f"decode {_tok(tok_s)} tok/s (build {_tok(build)}, floor {floor:.0%})")
        elif tok_s is not None:
            said.append(f"decode {_tok(tok_s)} tok/s (no build figure recorded)")
        return "healthy", ", ".join(said), tok_s

    def _finish(self, st: dict, res: dict, ip: dict, release: dict | None) -> None:
        """After a switch to ip's version: its health check, the rollback when it fails, the report saved."""
        sha = ip["bundle_sha256"]
        outcome, detail, tok_s = self.health_check((release or {}).get("health"), self._vdir(sha))
        back = None
        if outcome == "failed":
            old, old_prev = ip.get("old_current"), ip.get("old_previous")
            old = old if old and os.path.isdir(self._vdir(old)) else None
            old_prev = old_prev if old_prev and os.path.isdir(self._vdir(old_prev)) and old_prev != sha else None
            self._point("current", old)
            self._point("previous", old_prev)
            back = old
            st["failed"][sha] = {"record_sha256": ip["record_sha256"], "at_epoch": time.time(), "at": _now(),
                                 "detail": detail}
            res["code"] = 3
        st["pending_report"] = self._report(sha, outcome, detail, tok_s, back)
        st["in_progress"] = None
        self._save_state(st)
        res.update(outcome=outcome, detail=detail, decode_tok_s=tok_s, rolled_back_to=back)

    # ------------------------------------------------------------ one step

    def step(self) -> dict:
        """One check-in and what it asks for. Returns what happened: checked_in, assigned, installed,
        outcome (None, healthy, unchecked, failed, held), detail, current, and `line` (the log line)
        and `code` (the --once exit code). Raises AgentError (ServiceRefused: 401/403) when the check-in
        itself or a transfer fails; nothing is switched then."""
        with self._lock:
            os.makedirs(self._p(VERSIONS), exist_ok=True)
            with self._root_lock():
                res = {"device_id": self.device_id, "checked_in": False, "assigned": None, "rollout": None,
                       "installed": False, "fetched_files": 0, "fetched_bytes": 0, "outcome": None,
                       "detail": None, "decode_tok_s": None, "rolled_back_to": None, "reported": None,
                       "delivered": [], "current": None, "previous": None, "code": 0, "interval_s": None,
                       "notes": [], "resumed": None, "new": False, "pending_delivered": None}
                self._clean()
                st = self._load_state(res)
                if st.get("in_progress"):
                    self._resume(st, res)
                self._step(st, res)
                res["current"], res["previous"] = self._link("current"), self._link("previous")
                res["line"] = self._line(res)
                return res

    def _resume(self, st: dict, res: dict) -> None:
        """A switch that an earlier run did not finish (killed during the health check, or before)."""
        ip = st["in_progress"]
        sha = ip.get("bundle_sha256")
        if sha and self._link("current") == sha:
            res["resumed"] = sha
            res["assigned"] = {k: ip.get(k) for k in ("bundle_sha256", "record_sha256", "version")}
            self._finish(st, res, ip, self._release(sha))
        else:  # killed before `current` moved: put `previous` back, the check-in assigns it again
            prev = ip.get("old_previous")
            if self._link("previous") != prev:
                self._point("previous", prev if prev and os.path.isdir(self._vdir(prev)) else None)
            st["in_progress"] = None
            self._save_state(st)

    def _step(self, st: dict, res: dict) -> None:
        pending = st.get("pending_report")
        resp = self._checkin(pending)
        res["checked_in"] = True
        res["interval_s"] = resp.get("interval_s")
        if pending:
            st["pending_report"] = None
            res["delivered"].append(pending)
            res["pending_delivered"] = pending
            if res["resumed"]:
                res["reported"] = True
        a = resp["assigned"]
        st["assignment"] = {"assigned": a, "rollout": resp.get("rollout"), "at": _now()}
        now = time.time()
        st["failed"] = {k: v for k, v in st["failed"].items()
                        if isinstance(v, dict) and _num(v.get("at_epoch"))
                        and now - v["at_epoch"] < self.retry_failed_after_s}
        self._save_state(st)
        cur = self._link("current")
        if not res["resumed"]:
            res["assigned"], res["rollout"] = a, resp.get("rollout")
        if a is None or a["bundle_sha256"] == cur:
            self._prune()
            return
        sha = a["bundle_sha256"]
        res.update(assigned=a, rollout=resp.get("rollout"), new=True, outcome=None, detail=None,
                   decode_tok_s=None, rolled_back_to=None, reported=None, resumed=None, code=0)
        held = st["failed"].get(sha)
        if held and held.get("record_sha256") == a["record_sha256"]:
            wait = self.retry_failed_after_s - (now - float(held["at_epoch"]))
            res.update(outcome="held", detail=f"it failed here at {held.get('at')} ({held.get('detail')}); "
                                              f"tried again in {max(wait, 0) / 60:.0f} min")
            return
        try:
            release = self._obtain(a, res)
        except IntegrityRefused as e:
            detail = f"integrity: {e}"
            st["failed"][sha] = {"record_sha256": a["record_sha256"], "at_epoch": time.time(), "at": _now(),
                                 "detail": detail}
            st["pending_report"] = self._report(sha, "failed", detail)
            self._save_state(st)
            res.update(outcome="failed", detail=detail, code=4)
            self._deliver(st, res)
            return
        ip = {"bundle_sha256": sha, "record_sha256": a["record_sha256"], "version": a["version"],
              "old_current": cur, "old_previous": self._link("previous"), "rollout": resp.get("rollout"),
              "at": _now()}
        st["in_progress"] = ip  # saved before the switch: a run killed after it finishes the switch (_resume)
        self._save_state(st)
        if cur:
            self._point("previous", cur)
        self._point("current", sha)
        self._finish(st, res, ip, release)
        self._deliver(st, res)
        self._prune()

    def _line(self, res: dict) -> str:
        parts = list(res["notes"])
        a, cur, outcome, detail = res["assigned"], res["current"], res["outcome"], res["detail"] or ""
        if res["resumed"]:
            parts.append(f"finished the interrupted switch to {a['version']} ({a['bundle_sha256'][:8]})")
        if res["pending_delivered"] and not res["resumed"]:
            r = res["pending_delivered"]
            parts.append(f"delivered the report kept from before ({r.get('outcome')} on "
                         f"{str(r.get('bundle_sha256'))[:8]})")
        integrity = outcome == "failed" and detail.startswith("integrity:")
        if res["new"]:
            ro = res["rollout"]
            by = f" by rollout {ro.get('id')} stage {ro.get('stage')}" if isinstance(ro, dict) else ""
            parts.append(f"assigned {a['version']} ({a['bundle_sha256'][:8]}){by}")
            if outcome == "held":
                parts.append(f"not tried again: {detail}")
            elif integrity:
                parts.append(f"refused {a['version']}: {detail[len('integrity: '):]}")
            elif res["installed"]:
                parts.append(f"fetched {res['fetched_files']} files, {_size(res['fetched_bytes'])}")
            else:
                parts.append("already installed, nothing fetched")
        if outcome == "failed" and not integrity:
            back = res["rolled_back_to"]
            why = detail[len("health: "):] if detail.startswith("health: ") else detail
            parts.append(f"health check failed: {why}; "
                         + (f"rolled back to {self._name(back)}" if back else "no version to roll back to"))
        elif outcome == "healthy":
            parts.append(f"health: {detail}")
        elif outcome == "unchecked":
            parts.append(f"health: not checked ({detail})")
        if outcome == "failed" and not integrity and res["rolled_back_to"]:
            pass  # "rolled back to v1 (...)" says what runs
        elif cur:
            v = (self._release(cur) or {}).get("version") or "?"
            parts.append(f"running {v}" if outcome in ("healthy", "unchecked") else f"running {v} ({cur[:8]})")
        else:
            parts.append("no version running")
        if not res["new"] and not res["resumed"]:
            parts.append("up to date" if a else "nothing assigned")
        if res["reported"] is True:
            parts.append("report delivered")
        elif res["reported"] is False:
            parts.append(f"report kept for the next check-in ({res.get('report_error')})")
        return f"agent {self.device_id}: " + "; ".join(parts)


# ---------------------------------------------------------------- CLI


def run(agent: Agent, *, once: bool = False, interval: float | None = None, stdout=None, stderr=None,
        stop: threading.Event | None = None, backoff_s: float = 5.0) -> int:
    """Step once (exit code) or forever (until `stop` is set): sleep the service's interval_s (or
    `interval`) between steps; a failed step is logged and retried after a jittered backoff, doubling
    from backoff_s up to the interval (at least 5 minutes)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    stop = stop or threading.Event()
    backoff, last = 0.0, None
    while True:
        try:
            res = agent.step()
        except AgentError as e:
            if once:
                print(f"error: agent: {e}", file=stderr, flush=True)
                return e.code
            backoff = min(max(backoff * 2, backoff_s), max(interval or 0, 300.0))
            wait = backoff * random.uniform(0.5, 1.0)  # a fleet back from an outage does not come back in step
            print(f"error: agent: {e}; retrying in {wait:.0f} s", file=stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - a daemon logs one line, never a traceback
            if once:
                print(f"error: agent: {type(e).__name__}: {_one_line(e)}", file=stderr, flush=True)
                return 1
            backoff = min(max(backoff * 2, backoff_s), max(interval or 0, 300.0))
            wait = backoff * random.uniform(0.5, 1.0)
            print(f"error: agent: {type(e).__name__}: {_one_line(e)}; retrying in {wait:.0f} s", file=stderr,
                  flush=True)
        else:
            backoff = 0.0
            if once or res["line"] != last:  # a daemon says "up to date" once, not every interval
                print(res["line"], file=stdout, flush=True)
            last = res["line"]
            if once:
                return res["code"]
            wait = interval or (res["interval_s"] if _num(res["interval_s"]) and res["interval_s"] > 0 else 60)
        if stop.wait(wait):
            return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agent.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="edgekiln device agent: run the version of this device's build that the rollout service "
                    "assigns (fetch, verify, switch, health check, roll back).",
        epilog="exit codes with --once: 0 ok, 1 error, 2 usage, 3 health check failed (rolled back), "
               "4 integrity refused, 5 refused by the service (401/403)")
    p.add_argument("--service", required=True, help="the rollout service, e.g. https://fleet.example:8470")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--token", help="this device's token (visible in ps: prefer --token-file)")
    g.add_argument("--token-file", help="a file holding this device's token (re-read at every check-in)")
    p.add_argument("--device-id", required=True)
    p.add_argument("--device-class", required=True, help="e.g. galaxy_s25, x86_avx512")
    p.add_argument("--model", required=True, help="the model the device runs, as the registry names it")
    p.add_argument("--store", required=True,
                   help="the DVC remote holding the blobs: a path, file://, http(s)://, s3://bucket/prefix")
    p.add_argument("--root", required=True, help="the agent's folder: versions/, current, previous, agent.json")
    p.add_argument("--python", help="the interpreter a health check runs with ({python}; default this one)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--once", action="store_true", help="one step, then exit with its code")
    m.add_argument("--interval", type=float, help="seconds between check-ins (default: the service's interval_s)")
    p.add_argument("--retry-failed-after", type=float, default=RETRY_FAILED_AFTER_S, metavar="S",
                   help="seconds before a version that failed here is tried again (default 3600)")
    return p


def main(argv: list[str] | None = None, *, stdout=None, stderr=None, stop: threading.Event | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    token = args.token or (None if args.token_file else os.environ.get("EDGEKILN_DEVICE_TOKEN"))
    if not token and not args.token_file:
        p.error("no device token: pass --token or --token-file, or set EDGEKILN_DEVICE_TOKEN")
    if args.interval is not None and args.interval <= 0:
        p.error("--interval: seconds > 0")
    stderr = stderr or sys.stderr
    try:
        agent = Agent(service=args.service, device_id=args.device_id, device_class=args.device_class,
                      model=args.model, store=args.store, root=args.root, token=token, token_file=args.token_file,
                      python=args.python, retry_failed_after_s=args.retry_failed_after)
        return run(agent, once=args.once, interval=args.interval, stdout=stdout, stderr=stderr, stop=stop)
    except AgentError as e:
        print(f"error: agent: {e}", file=stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print("error: agent: interrupted", file=stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
