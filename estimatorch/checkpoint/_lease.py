"""One writer per checkpoint prefix on an object store: a lease object, ``{url}/.estimatorch.lock``,
created with a conditional write (S3's ``If-None-Match: *``: of two writers, one wins).

The lease records who holds it (host, pid, since) and when it was last renewed; its holder renews
it every :data:`RENEW_SECONDS` from a thread of its own (``If-Match`` its entity tag: a lease
taken over meanwhile is never overwritten). An object outlives a killed process, unlike a
``flock``: a lease is free once its holder is known dead (same host, no such process) or has not
renewed it for :data:`EXPIRES_SECONDS`; the next writer takes it over with a warning, again by a
conditional write.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Optional

from . import _store

__all__ = ["EXPIRES_SECONDS", "LOCK_NAME", "RENEW_SECONDS", "DirectoryLockedError", "Lease", "lease_of"]

#: the lock file of a directory, the lease object of a prefix.
LOCK_NAME = ".estimatorch.lock"

logger = logging.getLogger("estimatorch")

#: a lease not renewed for this long is free (its holder is gone, or cut off).
EXPIRES_SECONDS = float(os.environ.get("ESTIMATORCH_LEASE_SECONDS", "300"))
#: how often the holder renews it.
RENEW_SECONDS = EXPIRES_SECONDS / 5


class DirectoryLockedError(RuntimeError):
    """Another live process holds the lock of a checkpoint directory (or the lease of a prefix)."""


#: the leases of this process, by URL (one per prefix, shared by its holders).
_LEASES: dict[str, "Lease"] = {}


def lease_of(url: str, name: str = LOCK_NAME) -> "Lease":
    """This process's lease of the prefix ``url``."""
    key = url.rstrip("/")
    if key not in _LEASES:
        _LEASES[key] = Lease(key, name)
    return _LEASES[key]


def _record() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
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
    if record.get("host") == socket.gethostname():
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
        for _ in range(10):
            self.since = time.time()
            etag = _store.create(self.path, _record())
            if etag is None:
                current, record = self._current()
                if current is None:
                    continue  # released meanwhile: try again
                why = _stale(record)
                if why is None:
                    raise self._locked_error(record)
                etag = _store.replace_if(self.path, _record(), current)
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
                    etag = _store.replace_if(self.path, _record(), self.etag)
                except OSError as err:  # the store is away: the next renewal tries again
                    logger.warning("could not renew the lease %s: %s", self.path, err)
                    continue
                if etag is None:
                    logger.error("the lease %s was taken over by another writer", self.path)
                    self.etag = None
                    return
                self.etag = etag

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
