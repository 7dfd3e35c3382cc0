"""One writer per checkpoint prefix on an object store: a lease object, ``{url}/.estimatorch.lock``,
created with a conditional write (S3's ``If-None-Match: *``: of two writers, one wins).

The lease records who holds it (host, pid, since) and when it was last renewed; its holder renews
it every :data:`RENEW_SECONDS` from a thread of its own (``If-Match`` its entity tag: a lease
taken over meanwhile is never overwritten). An object outlives a killed process, unlike a
``flock``: a lease is free once its holder is known dead (same host, no such process) or has not
renewed it for :data:`EXPIRES_SECONDS`; the next writer takes it over with a warning, again by a
conditional write.

A lease taken over while its holder still runs (a holder cut off from the store for longer than
the expiry, or paused) is lost: a renewal or a write that finds another entity tag re-reads the
record, and unless it is still this holder's (its random token: a retried write that had
landed), the holder stops writing. Every write and deletion of a checkpoint under the prefix
checks the lease first (:func:`check_writer`, one HEAD request) and raises
:class:`LeaseLostError` naming the URL and the other holder, leaving that writer's objects alone.

Liveness is judged from the record alone, never from this machine's processes, except where
the holder's host name is this one: there a pid that no longer exists frees the lease at once.
This assumes one PID namespace per host name (two containers sharing a host name but not their
processes would each see the other's pid as gone); where that does not hold, set
``ESTIMATORCH_LEASE_HOST`` to a name unique per namespace (the container's id), or rely on the
expiry alone, which needs nothing of the kind.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Optional

from . import _store

__all__ = ["EXPIRES_SECONDS", "LOCK_NAME", "RENEW_SECONDS", "DirectoryLockedError", "Lease", "LeaseLostError",
           "check_writer", "lease_of"]

#: the lock file of a directory, the lease object of a prefix.
LOCK_NAME = ".estimatorch.lock"

logger = logging.getLogger("estimatorch")

#: a lease not renewed for this long is free (its holder is gone, or cut off).
EXPIRES_SECONDS = float(os.environ.get("ESTIMATORCH_LEASE_SECONDS", "300"))
#: how often the holder renews it.
RENEW_SECONDS = EXPIRES_SECONDS / 5


class DirectoryLockedError(RuntimeError):
    """Another live process holds the lock of a checkpoint directory (or the lease of a prefix)."""


class LeaseLostError(DirectoryLockedError):
    """Another writer took over the lease of a prefix this process was writing to."""


#: the leases of this process, by URL (one per prefix, shared by its holders).
_LEASES: dict[str, "Lease"] = {}


def lease_of(url: str, name: str = LOCK_NAME) -> "Lease":
    """This process's lease of the prefix ``url``."""
    key = url.rstrip("/")
    if key not in _LEASES:
        _LEASES[key] = Lease(key, name)
    return _LEASES[key]


def _host() -> str:
    """This process's host name for the record (``$ESTIMATORCH_LEASE_HOST`` where one host name
    covers several PID namespaces)."""
    return os.environ.get("ESTIMATORCH_LEASE_HOST") or socket.gethostname()


def check_writer(path: str) -> None:
    """Before a write or deletion at ``path``: the lease this process took of a prefix holding
    it is still its own (else :class:`LeaseLostError`); nothing when it holds none there."""
    for url, lease in list(_LEASES.items()):
        if path == url or path.startswith(url + "/"):
            lease.verify()


def _record(token: str) -> bytes:
    return json.dumps({"host": _host(), "pid": os.getpid(), "token": token,
                       "since": time.strftime("%Y-%m-%d %H:%M:%S"), "renewed": time.time()}).encode("utf-8")


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True


def _stale(record: dict[str, Any]) -> Optional[str]:
    """Why a lease is free, in words; None while its holder may be alive."""
    if not record:
        return "a lease object that holds no record"
    if record.get("host") == _host():
        if record.get("pid") == os.getpid():  # asked only while this process holds none
            return "this process, which could not remove it (the store was away)"
        if not _alive(record.get("pid")):
            return f"process {record.get('pid')} on this host, which is gone"
    renewed = record.get("renewed")
    if isinstance(renewed, (int, float)) and time.time() - renewed > EXPIRES_SECONDS:
        return f"a holder that has not renewed it for {time.time() - renewed:.0f} s"
    return None


def describe(record: dict[str, Any]) -> str:
    return (f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, since {record.get('since', '?')}"
            if record else "a process that left no record")


class Lease:
    """The lease of the prefix ``url`` for this process (re-entrant: ``acquire`` twice, release
    twice)."""

    def __init__(self, url: str, name: str):
        self.url = url.rstrip("/")
        self.path = f"{self.url}/{name}"
        self.etag: Optional[str] = None
        self.since = 0.0  # when this process took it: uploads begun before are not its own
        self.swept = False  # the incomplete uploads of earlier writers were aborted under it
        self.token = ""  # this holding's, in the record: a write of ours is told from another's
        self.lost: Optional[str] = None  # who took it over (in words), once another writer did
        self._holders = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._guard = threading.Lock()

    @property
    def held(self) -> bool:
        return self.etag is not None

    def _current(self) -> tuple[Optional[str], dict[str, Any]]:
        try:
            raw = _store.read_bytes(self.path)
        except FileNotFoundError:
            return None, {}
        return _store.etag_of(self.path), _parse(raw)

    def _locked_error(self, record: dict[str, Any]) -> DirectoryLockedError:
        return DirectoryLockedError(
            f"model_dir {self.url!r} is in use by another fit ({describe(record)}; lease object {self.path}). "
            "One process writes to a checkpoint prefix at a time: wait until that fit ends, or choose another "
            f"model_dir (a lease its holder stopped renewing is free after {EXPIRES_SECONDS:.0f} s).")

    def check(self) -> None:
        """Raise ``DirectoryLockedError`` while another live writer holds the lease."""
        if self.held:
            return
        etag, record = self._current()
        if etag is not None and _stale(record) is None:
            raise self._locked_error(record)

    def acquire(self) -> None:
        if self.held:
            self._holders += 1
            return
        self.lost, self.token = None, secrets.token_hex(8)
        for _ in range(10):
            self.since = time.time()
            etag = _store.create(self.path, _record(self.token))
            if etag is None:
                current, record = self._current()
                if current is None:
                    continue  # released meanwhile: try again
                why = _stale(record)
                if why is None:
                    raise self._locked_error(record)
                etag = _store.replace_if(self.path, _record(self.token), current)
                if etag is None:
                    continue  # another writer took it over first
                logger.warning("model_dir %s: taking over the lease left by %s (%s)", self.url, describe(record), why)
            self.etag, self._holders, self.swept = etag, 1, False
            self._stop.clear()
            self._thread = threading.Thread(target=self._renew, name="estimatorch-lease", daemon=True)
            self._thread.start()
            return
        raise self._locked_error({})

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            with self._guard:
                if self.etag is None:
                    return
                try:
                    etag = _store.replace_if(self.path, _record(self.token), self.etag)
                    if etag is None and not self._resolve():  # (a retried renewal that had landed is ours)
                        logger.error("model_dir %s: the lease %s was taken over by another writer (%s); this fit "
                                     "writes nothing more there", self.url, self.path, self.lost)
                        return
                except OSError as err:  # the store is away: the next renewal tries again
                    logger.warning("could not renew the lease %s: %s", self.path, err)
                    continue
                if etag is not None:
                    self.etag = etag

    def _resolve(self) -> bool:
        """After a conditional write failed or the entity tag moved (under ``_guard``): re-read
        the record; still ours (our token: a write of ours whose answer was lost and that was
        retried) takes its new entity tag, else the lease is lost (who holds it is kept)."""
        etag, record = self._current()
        if etag is not None and record.get("token") == self.token:
            self.etag = etag
            return True
        self.etag = None
        self.lost = describe(record) if etag is not None else "the lease object was deleted"
        return False

    def verify(self) -> None:
        """Raise :class:`LeaseLostError` when another writer took this lease over (one HEAD
        request to the store while it looks held)."""
        if self.lost is None and self.etag is not None:
            with self._guard:
                if self.etag is not None and _store.etag_of(self.path) != self.etag:
                    self._resolve()
        if self.lost is not None:
            raise LeaseLostError(
                f"model_dir {self.url!r}: another writer took over its lease ({self.lost}; lease object "
                f"{self.path}) while this fit was writing there, so this fit stopped: it writes and deletes "
                "nothing more there and left that writer's checkpoints untouched. One fit writes to a prefix at a "
                f"time: choose another model_dir for one of them (a lease is taken over only once its holder "
                f"has not renewed it for {EXPIRES_SECONDS:.0f} s: was this process cut off from the store?)")

    def release(self) -> None:
        if not self.held:
            return
        self._holders -= 1
        if self._holders > 0:
            return
        self._stop.set()
        with self._guard:
            etag, self.etag = self.etag, None
        if self._thread is not None:
            self._thread.join(timeout=RENEW_SECONDS)
            self._thread = None
        try:
            if etag is not None:
                _store.remove_if(self.path, etag, attempts=1)  # else it expires: no need to wait
        except OSError as err:
            logger.warning("Could not remove the lease %s: %s (it is free once it expires)", self.path, err)
