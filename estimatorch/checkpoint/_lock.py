"""One writer per checkpoint directory: an exclusive ``flock`` on a lock file that records who
holds it (host, pid, since when).

The kernel drops a ``flock`` when its process dies, however it dies: a lock file left by a dead
process is therefore free, and the next writer takes it over with a warning naming the process
that left it. Processes forked while the lock is held (``DataLoader`` workers) do not keep it.
Without ``fcntl`` (Windows) there is no lock; a warning says so once. On an object store (a URL
``model_dir``) the lease object of ``_lease.py`` stands for the lock, behind the same methods.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from typing import Any, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

from . import _store
from ._lease import LOCK_NAME, DirectoryLockedError, lease_of

__all__ = ["LOCK_NAME", "DirectoryLock", "DirectoryLockedError"]

logger = logging.getLogger("estimatorch")

#: locks this process holds: real path of the directory -> [fd, number of holders].
_HELD: dict[str, list[int]] = {}
_WARNED_NO_LOCK = False


def _drop_in_child() -> None:
    """After a fork: the child must not keep its parent's locks alive (closing its copies of the
    descriptors leaves the parent's lock in place)."""
    for fd, _ in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            continue
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


def _read_record(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0) if hasattr(os, "pread") else b""
        record = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict[str, Any]) -> str:
    if not record:
        return "a process that left no record"
    return f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, since {record.get('since', '?')}"


class DirectoryLock:
    """The write lock of one directory for this process (re-entrant within the process).

    Args:
        directory: the directory to lock (it must exist to :meth:`acquire`).

    Example:
        >>> import tempfile
        >>> lock = DirectoryLock(tempfile.mkdtemp())
        >>> lock.acquire()
        >>> lock.held
        True
        >>> lock.release()
        >>> lock.held
        False
    """

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self._key: Optional[str] = None
        #: on an object store, the prefix's lease (``_lease.py``) stands for the lock
        self._lease = lease_of(self.directory, LOCK_NAME) if _store.is_url(self.directory) else None
        self._leased = False

    @property
    def held(self) -> bool:
        """True between :meth:`acquire` and :meth:`release`."""
        if self._lease is not None:  # a lease another writer took over is not held
            return self._leased and self._lease.held
        return self._key is not None

    def _locked_error(self, fd: int) -> DirectoryLockedError:
        record: dict[str, Any] = {}
        for _ in range(20):  # the holder writes its record right after it locks
            record = _read_record(fd)
            if record:
                break
            time.sleep(0.05)
        return DirectoryLockedError(
            f"model_dir {self.directory!r} is in use by another fit ({_describe(record)}; lock file "
            f"{self.path}). One process writes to a checkpoint directory at a time: wait until that fit "
            "ends, or choose another model_dir.")

    def check(self) -> None:
        """Raise :class:`DirectoryLockedError` when another live process holds the lock (this
        process holding it is fine); change nothing."""
        if self._lease is not None:
            self._lease.check()
            return
        if fcntl is None or os.path.realpath(self.directory) in _HELD:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._locked_error(fd) from None
        finally:
            os.close(fd)

    def acquire(self) -> None:
        """Take the lock (a lock left by a dead process is taken over, with a warning).

        Raises:
            DirectoryLockedError: another live process holds it.
        """
        if self._lease is not None:
            if not self._leased:
                self._lease.acquire()
                self._leased = True
            return
        if self._key is not None:
            return
        key = os.path.realpath(self.directory)
        if key in _HELD:
            _HELD[key][1] += 1
            self._key = key
            return
        if fcntl is None:  # pragma: no cover - Windows
            _warn_no_lock()
            return
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                _lock_exclusive(fd)
            except BlockingIOError:
                error = self._locked_error(fd)
                os.close(fd)
                raise error from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:  # its holder removed it as it released it: try again
                same = False
            if not same:
                os.close(fd)
                continue
            previous = _read_record(fd)
            if previous:
                logger.warning("model_dir %s: taking over the lock left by %s, which ended without releasing it",
                               self.directory, _describe(previous))
            record = {"host": socket.gethostname(), "pid": os.getpid(),
                      "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
            _HELD[key] = [fd, 1]
            self._key = key
            return
        raise DirectoryLockedError(f"could not lock model_dir {self.directory!r}: its lock file keeps being replaced")

    def release(self) -> None:
        """Give the lock back (the last holder in this process removes the lock file)."""
        if self._lease is not None:
            if self._leased:
                self._leased = False
                self._lease.release()
            return
        key, self._key = self._key, None
        if key is None or key not in _HELD:
            return
        _HELD[key][1] -= 1
        if _HELD[key][1] > 0:
            return
        fd, _ = _HELD.pop(key)
        try:
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # while still locked: a waiting process then sees a new file
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("Could not remove the lock file %s: %s", self.path, err)
        finally:
            os.close(fd)


def _lock_exclusive(fd: int) -> None:
    """``flock(LOCK_EX)`` without blocking, retried for a moment: a :meth:`DirectoryLock.check`
    elsewhere holds a shared lock for microseconds."""
    for _ in range(10):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.02)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _warn_no_lock() -> None:  # pragma: no cover - Windows
    global _WARNED_NO_LOCK
    if not _WARNED_NO_LOCK:
        _WARNED_NO_LOCK = True
        warnings.warn("this platform has no fcntl.flock: checkpoint directories are not locked; "
                      "make sure one fit at a time writes to a model_dir", RuntimeWarning, stacklevel=3)
