"""One owner per run folder: a lease object, ``<output>/lease.json`` (docs/scheduled-audits.md).

A job takes the lease before its first stage (before any cluster work) and holds it while it
runs: a thread rewrites the heartbeat every :data:`HEARTBEAT_S` seconds, and the job removes the
lease when it ends (also when a stage fails). A second job on the same output finds a **fresh**
lease and is refused (:class:`LeaseHeld`, one line: the owner and the heartbeat's age). A lease is
**stale** when its heartbeat is older than :data:`STALE_AFTER_S`, or at once when its owner ran
on this host and its process is gone (killed); a stale lease is taken over (the caller logs it)
and the run resumes from its stage markers as any re-submission does.

Taking and taking over are compare-and-swap operations, so two jobs starting at the same moment
cannot both win:

- local folders: every read-decide-write happens under an exclusive ``flock`` of
  ``<output>/.lease.lock``, the lease itself written atomically (temporary file + ``os.replace``);
- S3: a new lease is one PUT with ``If-None-Match: *`` (refused with 412 when one exists), a
  takeover and each heartbeat a PUT with ``If-Match: <ETag read>`` (refused when another job
  rewrote it in between). AWS S3 (since 2024) and moto 5.2.5 honour both. A store that answers
  501 (conditional writes not implemented) falls back to read-check-write: a second job is
  still refused once the first one's lease is written, but two jobs that start within the same
  moment could both proceed. A store that silently ignores the headers behaves the same way
  (the last writer wins).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from pipelines.storage import uris as storage

__all__ = ["LEASE_FILE", "HEARTBEAT_S", "STALE_AFTER_S", "LeaseHeld", "Lease", "lease_uri", "read_lease",
           "is_stale", "acquire"]

LEASE_FILE = "lease.json"
#: Seconds between two heartbeats of a running job.
HEARTBEAT_S = 20.0
#: A heartbeat older than this marks the lease stale (generous against clock skew between hosts).
STALE_AFTER_S = 120.0


class LeaseHeld(Exception):
    """Another job holds a fresh lease on the output (one line)."""


def lease_uri(output: str) -> str:
    return storage.join(output, LEASE_FILE)


def _owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _doc(owner: str, started: float) -> dict[str, Any]:
    now = time.time()
    return {"owner": owner, "host": socket.gethostname(), "pid": os.getpid(), "started_at": started,
            "heartbeat_at": now, "heartbeat_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "stale_after_s": STALE_AFTER_S}


def _pid_gone(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_stale(doc: dict[str, Any], now: float | None = None, stale_after_s: float = STALE_AFTER_S) -> str | None:
    """Why ``doc`` (a lease) is stale, or None while it is fresh."""
    age = (time.time() if now is None else now) - float(doc.get("heartbeat_at") or 0.0)
    if age > stale_after_s:
        return f"its last heartbeat was {age:.0f} s ago (stale after {stale_after_s:.0f} s)"
    if doc.get("host") == socket.gethostname() and _pid_gone(doc.get("pid")):
        return f"its process {doc.get('pid')} on this host is gone"
    return None


# --------------------------------------------------------------------------- backends
class _Local:
    """Compare-and-swap on a local lease file under an exclusive ``flock`` (the token: the bytes read)."""

    def __init__(self, uri: str):
        self.path = storage.get_fs(uri)[1]
        self.lock = os.path.join(os.path.dirname(self.path), ".lease.lock")

    def _locked(self):
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.lock, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _read(self) -> bytes | None:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read(self) -> tuple[bytes | None, Any]:
        raw = self._read()
        return raw, raw

    def put(self, data: bytes, token: Any, create: bool) -> Any:
        """Write ``data`` when the lease is absent (``create``) or still ``token``; its new token, or None."""
        fd = self._locked()
        try:
            now = self._read()
            if (now is not None) if create else (now != token):
                return None
            storage.write_bytes_atomic(self.path, data)
            return data
        finally:
            os.close(fd)

    def delete(self, token: Any) -> None:
        fd = self._locked()
        try:
            if self._read() == token:
                os.remove(self.path)
        finally:
            os.close(fd)


class _S3:
    """Compare-and-swap on S3 with conditional PUTs (the token: the object's ETag)."""

    def __init__(self, uri: str, options: Any):
        self.fs, self.path = storage.get_fs(uri, options)
        self.bucket, self.key = self.path.split("/", 1)
        self.conditional = True

    def read(self) -> tuple[bytes | None, Any]:
        from fsspec.asyn import sync

        async def get():
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
            async with resp["Body"] as body:
                return await body.read(), resp["ETag"]
        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None, None

    def put(self, data: bytes, token: Any, create: bool) -> Any:
        if not self.conditional:
            return self._put_unconditional(data, token, create)
        cond = {"mode": "create"} if create else {"IfMatch": token}
        try:
            out = self.fs.pipe_file(self.path, data, **cond)
        except (FileExistsError, FileNotFoundError):  # there already / removed since it was read
            return None
        except OSError as e:
            code = _error_code(e)
            if code == "PreconditionFailed":
                return None
            if code not in ("NotImplemented", "501"):
                raise
            self.conditional = False  # the store has no conditional writes: check, then write
            return self._put_unconditional(data, token, create)
        return _etag(out) or self.read()[1]

    def _put_unconditional(self, data: bytes, token: Any, create: bool) -> Any:
        raw, now = self.read()
        if (raw is not None) if create else (now != token):
            return None
        self.fs.pipe_file(self.path, data)
        return self.read()[1]

    def delete(self, token: Any) -> None:
        if self.read()[1] == token:
            self.fs.rm_file(self.path)


def _error_code(e: BaseException) -> str | None:
    cause = e.__cause__
    resp = getattr(cause, "response", None) or {}
    return (resp.get("Error") or {}).get("Code") or (str((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode"))
                                                      if resp else None)


def _etag(out: Any) -> str | None:
    return out.get("ETag") if isinstance(out, dict) else None


def _backend(uri: str, options: Any):
    return _S3(uri, options) if storage.is_remote(uri) else _Local(uri)


def read_lease(output: str, options: Any = None) -> dict[str, Any] | None:
    """The lease on ``output`` (None when there is none)."""
    raw, _ = _backend(lease_uri(output), options).read()
    return None if raw is None else json.loads(raw.decode("utf-8"))


# --------------------------------------------------------------------------- the lease
class Lease:
    """A lease this process holds on ``output``: :meth:`refresh` rewrites the heartbeat (False: the
    lease was taken over by another job), :meth:`start` refreshes it on a thread, :meth:`release`
    stops that thread and removes the lease. Use ``with acquire(...) as lease:``."""

    def __init__(self, output: str, backend: Any, owner: str, token: Any, started: float,
                 log: Callable[[str], None]):
        self.output, self.uri, self.owner = output, lease_uri(output), owner
        self._backend, self._token, self._started, self._log = backend, token, started, log
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def refresh(self) -> bool:
        if self.lost:
            return False
        token = self._backend.put(_encode(_doc(self.owner, self._started)), self._token, create=False)
        if token is None:
            self.lost = True
            self._log(f"lease: {self.uri} was taken over by another job; this job no longer owns {self.output}")
            return False
        self._token = token
        return True

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                if not self.refresh():
                    return
            except Exception as e:  # a store hiccup: try again at the next beat
                self._log(f"lease: heartbeat of {self.uri} failed ({type(e).__name__}: {e}); retrying")

    def start(self, every_s: float = HEARTBEAT_S) -> "Lease":
        self._thread = threading.Thread(target=self._beat, args=(every_s,), name="infoform-lease", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self.lost:
            self._backend.delete(self._token)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _encode(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, sort_keys=True) + "\n").encode("utf-8")


def _held_line(uri: str, doc: dict[str, Any], now: float) -> str:
    age = now - float(doc.get("heartbeat_at") or 0.0)
    return (f"{uri} is held by another job ({doc.get('owner')}, last heartbeat {age:.0f} s ago): one job per "
            f"output; wait for it, use another --output, or remove the lease if that job is gone")


def acquire(output: str, options: Any = None, *, stale_after_s: float = STALE_AFTER_S,
            log: Callable[[str], None] = print, owner: str | None = None) -> Lease:
    """Take the lease on ``output``: create it, or take over a stale one (logged); raises
    :class:`LeaseHeld` while another job's lease is fresh. Call :meth:`Lease.start` to keep it fresh."""
    uri, owner, started = lease_uri(output), owner or _owner_id(), time.time()
    backend = _backend(uri, options)
    for _ in range(5):  # each round loses only to another job that changed the lease in between
        token = backend.put(_encode(_doc(owner, started)), None, create=True)
        if token is not None:
            return Lease(output, backend, owner, token, started, log)
        raw, held = backend.read()
        if raw is None:
            continue  # removed in between: try to create it again
        doc = json.loads(raw.decode("utf-8"))
        why = is_stale(doc, stale_after_s=stale_after_s)
        if why is None:
            raise LeaseHeld(_held_line(uri, doc, time.time()))
        token = backend.put(_encode(_doc(owner, started)), held, create=False)
        if token is not None:
            log(f"lease: taking over {uri} from {doc.get('owner')}: {why}; resuming from the stage markers")
            return Lease(output, backend, owner, token, started, log)
    raise LeaseHeld(f"{uri} changed hands repeatedly while this job tried to take it; try again")
