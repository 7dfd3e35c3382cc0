"""The files of a checkpoint directory: names, atomic writes, the latest pointer and orphaned
temporaries.

A directory holds, per prefix: periodic checkpoints ``{prefix}-epoch{E}batch{B}.pt`` (or, for a
net sharded across ranks, directories ``{prefix}-epoch{E}batch{B}.dcp``), the best checkpoint
``{prefix}-best.pt``, the pointer ``{prefix}-latest``, and weights exports (the model's state
dict alone) ``{prefix}-epoch{E}batch{B}.weights.pt`` and ``{prefix}-best.weights.pt``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import time
from typing import Any, Callable, Optional, Union

import torch

from . import _store
from ._lease import check_writer, lease_of

__all__ = [
    "atomic_save",
    "best_name",
    "best_weights_name",
    "checkpoint_name",
    "latest_name",
    "list_checkpoints",
    "list_weights",
    "prune",
    "read_latest",
    "remove_checkpoint",
    "remove_orphan_temporaries",
    "sharded_checkpoint_name",
    "weights_name",
    "write_latest",
]

logger = logging.getLogger("estimatorch")
PathLike = Union[str, "os.PathLike[str]"]

#: the file that marks a sharded checkpoint directory complete, written last (``_sharded.py``).
MARKER = "estimatorch.json"
#: ``.{target}.{12 hex digits}.tmp``: the temporary file :func:`atomic_save` writes first.
_TEMPORARY = re.compile(r"\.(?P<target>.+)\.[0-9a-f]{12}\.tmp")
#: the targets estimatorch writes (any prefix): periodic, best and pointer files, weights exports, and
#: sharded checkpoint directories.
_TARGET = re.compile(r".+-(?:epoch\d+batch\d+(?:(?:\.weights)?\.pt|\.dcp)|best(?:\.weights)?\.pt|latest)")
#: temporaries this process is writing right now (never orphans).
_IN_FLIGHT: set[str] = set()
#: errors of a directory fsync that mean "not supported here", not "failed".
_NO_DIR_FSYNC = {errno.EINVAL, errno.EBADF, errno.EACCES, getattr(errno, "ENOTSUP", errno.EINVAL)}


# -- names --------------------------------------------------------------------------------------
def checkpoint_name(prefix: str, epoch: int, batch: int) -> str:
    """``{prefix}-epoch{E}batch{B}.pt``: E epochs completed and B batches trained when written."""
    return f"{prefix}-epoch{epoch}batch{batch}.pt"


def sharded_checkpoint_name(prefix: str, epoch: int, batch: int) -> str:
    """``{prefix}-epoch{E}batch{B}.dcp``: the directory of a sharded checkpoint (FSDP2), E epochs
    completed and B batches trained when written."""
    return f"{prefix}-epoch{epoch}batch{batch}.dcp"


def best_name(prefix: str) -> str:
    """``{prefix}-best.pt``: the checkpoint where the monitored metric was best."""
    return f"{prefix}-best.pt"


def latest_name(prefix: str) -> str:
    """``{prefix}-latest``: a text file naming the newest periodic checkpoint."""
    return f"{prefix}-latest"


def weights_name(prefix: str, epoch: int, batch: int) -> str:
    """``{prefix}-epoch{E}batch{B}.weights.pt``: the model's weights alone, E epochs completed and
    B batches trained when written."""
    return f"{prefix}-epoch{epoch}batch{batch}.weights.pt"


def best_weights_name(prefix: str) -> str:
    """``{prefix}-best.weights.pt``: the model's weights alone where the monitored metric was best."""
    return f"{prefix}-best.weights.pt"


def _pattern(prefix: str, weights: bool = False) -> re.Pattern:
    suffix = r"\.weights\.pt" if weights else r"\.(?:pt|dcp)"
    return re.compile(re.escape(prefix) + r"-epoch(\d+)batch(\d+)" + suffix)


def list_checkpoints(model_dir: PathLike, prefix: str) -> list[tuple[int, int, str]]:
    """The periodic checkpoints of ``prefix`` in ``model_dir``, files and sharded checkpoint
    directories, oldest first, as ``(epoch, batch, path)``. Names must match exactly:
    ``model-epoch1batch10x.pt``, a weights export or another prefix's files are never listed (so
    never deleted by retention); a ``.dcp`` name is listed only for a directory (complete or
    not: reading it says)."""
    return _list(model_dir, _pattern(prefix))


def list_weights(model_dir: PathLike, prefix: str) -> list[tuple[int, int, str]]:
    """The periodic weights exports of ``prefix`` in ``model_dir``, oldest first, as
    ``(epoch, batch, path)``."""
    return _list(model_dir, _pattern(prefix, weights=True))


def _list(model_dir: PathLike, pattern: re.Pattern) -> list[tuple[int, int, str]]:
    model_dir = os.fspath(model_dir)
    url = _store.is_url(model_dir)
    if not url and not os.path.isdir(model_dir):
        return []
    found = []
    for name in _store.listdir(model_dir):
        match = pattern.fullmatch(name)
        if match and (not name.endswith(".dcp") or _store.isdir(os.path.join(model_dir, name))):
            found.append((int(match.group(1)), int(match.group(2)), os.path.join(model_dir, name)))
    return sorted(found)


# -- writing ------------------------------------------------------------------------------------
def _write_error(path: str, err: OSError) -> OSError:
    """``err`` restated so that it names the file being written and keeps its errno."""
    if err.errno is None:
        return OSError(f"cannot write {path!r}: {err}")
    return OSError(err.errno, f"cannot write {path!r}: {err.strerror or os.strerror(err.errno)}")


def _fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (where the platform and filesystem allow it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIR_FSYNC:
            raise _write_error(path, err) from err
    finally:
        os.close(fd)


def _create_temporary(directory: str, name: str) -> tuple[int, str]:
    """Create ``.{name}.<random>.tmp`` in ``directory`` with the permissions ``open()`` would
    give (``tempfile.mkstemp`` makes files readable by their owner only), marked in flight before
    it exists: a background writer's cleanup of orphans never takes it for one."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        _IN_FLIGHT.add(tmp)
        try:
            return os.open(tmp, flags, 0o666), tmp
        except BaseException as err:
            _IN_FLIGHT.discard(tmp)
            if not isinstance(err, FileExistsError):
                raise
            continue
    raise FileExistsError(f"no free temporary file name for {name!r} in {directory!r}")


class _Sink:
    """The file torch writes to, remembering an ``OSError`` that torch would hide: on a full
    disk ``torch.save`` reports only ``RuntimeError: [enforce fail ...] unexpected pos``."""

    def __init__(self, file: Any):
        self.file = file
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def reserve_temporary(path: PathLike) -> str:
    """A temporary file name for :func:`atomic_save` of ``path`` by another process (the
    background writer process), marked in flight in this one until :func:`release_temporary`:
    this process's cleanup of orphans never takes it for one while it is being written."""
    path = os.path.abspath(os.fspath(path))
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    _IN_FLIGHT.add(tmp)
    return tmp


def release_temporary(tmp: str) -> None:
    """The write of a :func:`reserve_temporary` name ended (renamed, discarded, or orphaned by a
    writer that died: then the next cleanup removes it)."""
    _IN_FLIGHT.discard(tmp)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as err:  # e.g. the filesystem went read-only: say so, the first error matters more
        logger.warning("Could not remove the temporary file %s: %s", path, err)


def atomic_save(obj: Any, path: PathLike, *, writer: Callable[[Any, Any], None] = torch.save,
                temporary: Optional[str] = None) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either the old file or the complete new one.

    The bytes go to a temporary file in the same directory (``temporary``, a name from
    :func:`reserve_temporary`, when another process writes for this one; else a new random
    name), which is flushed and fsynced, then renamed over ``path`` with ``os.replace``; the
    directory is fsynced last.

    At a URL (an object store), the bytes are made in memory and uploaded as one object, which
    appears whole or not at all (``_store.write_bytes``).

    Raises:
        OSError: the write failed (a full disk, an I/O error, a read-only filesystem, an upload
            that failed after its retries): the message names ``path`` and the reason, the errno
            is kept, ``path`` is unchanged and no temporary file is left behind.
    """
    path = os.fspath(path)
    if _store.is_url(path):
        check_writer(path)  # a lease another writer took over: write nothing
        _store.save_to(path, obj, writer)
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        if temporary is None:
            fd, tmp = _create_temporary(directory, os.path.basename(path))
        else:
            tmp, fd = temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                                         0o666)
    except OSError as err:
        raise _write_error(path, err) from err
    try:
        with os.fdopen(fd, "wb") as f:
            sink = _Sink(f)
            try:
                writer(obj, sink)
            except OSError:
                raise
            except Exception as err:  # torch's stand-in for the OSError its writer met
                if sink.error is None:
                    raise
                raise sink.error from err
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        _discard(tmp)
        raise _write_error(path, err) from err
    except BaseException:
        _discard(tmp)
        raise
    finally:
        _IN_FLIGHT.discard(tmp)
    _fsync_dir(directory)


def _write_text(text: str, f: Any) -> None:
    f.write(text.encode("utf-8"))


def write_latest(model_dir: PathLike, prefix: str, path: PathLike) -> None:
    """Point ``{prefix}-latest`` at ``path`` (atomically; written after the checkpoint)."""
    atomic_save(os.path.basename(os.fspath(path)) + "\n",
                os.path.join(os.fspath(model_dir), latest_name(prefix)), writer=_write_text)


def read_latest(model_dir: PathLike, prefix: str) -> Optional[str]:
    """The file name ``{prefix}-latest`` names, or None when it is missing or unreadable."""
    path = os.path.join(os.fspath(model_dir), latest_name(prefix))
    try:
        if _store.is_url(path):
            name = _store.read_bytes(path).decode("utf-8").strip()
        else:
            with open(path, encoding="utf-8") as f:
                name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name or None


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint file, or a sharded checkpoint directory: renamed first to a temporary
    name (atomically, so that no half-deleted directory is ever taken for a checkpoint), then
    removed; a kill in between leaves a temporary that :func:`remove_orphan_temporaries` clears.
    Nothing happens when it is gone already."""
    path = os.fspath(path)
    if _store.is_url(path):  # one object, deleted at once; a sharded directory's marker first: a kill
        check_writer(path)
        sharded = path.endswith(".dcp")  # in between leaves an incomplete directory, never a damaged one
        if sharded:
            _store.remove(os.path.join(path, MARKER))
        _store.remove(path, prefix=sharded)
        return
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            os.remove(path)
            return
        parent, name = os.path.split(os.path.abspath(path))
        doomed = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
        os.rename(path, doomed)
    except FileNotFoundError:
        return
    _fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)


def prune(saved: list[str], limit: Optional[int], keep: str) -> None:
    """Retention: delete the oldest of ``saved`` (paths, oldest first; the list is updated)
    beyond ``limit`` (None keeps all), never ``keep`` (the file the pointer names)."""
    if limit is None:
        return
    while len(saved) > limit:
        old = next(path for path in saved if path != keep)
        saved.remove(old)
        remove_checkpoint(old)


def remove_orphan_temporaries(model_dir: PathLike) -> list[str]:
    """Delete the temporary files of writers that are gone (and the temporary directories of
    sharded checkpoints); return their names.

    Only estimatorch's own pattern (``.{prefix}-epoch{E}batch{B}.pt.<hex>.tmp``, and the same
    for ``.dcp``, ``-best.pt`` and ``-latest``) is touched, never a temporary this process is
    writing. The caller holds the directory's lock, so no other live process writes here.

    On an object store, a killed writer leaves no temporary object but an incomplete multipart
    upload (never listed as an object), and a sharded checkpoint directory without its marker
    (written in place: there is no rename): those begun before this process took the prefix's
    lease are removed, once per lease.
    """
    model_dir = os.fspath(model_dir)
    if _store.is_url(model_dir):  # once per lease: this process leaves nothing incomplete but by dying
        lease = lease_of(model_dir)
        if lease.held and lease.swept:
            return []
        lease.swept = lease.held
        removed = _store.abort_incomplete_uploads(model_dir, lease.since or time.time())
        for name in _store.listdir(model_dir):
            path = os.path.join(model_dir, name)
            if name.endswith(".dcp") and _TARGET.fullmatch(name) and path not in _IN_FLIGHT \
                    and _store.isdir(path) and not _store.isfile(os.path.join(path, MARKER)):
                _store.remove(path, prefix=True)
                removed.append(name)
        return removed
    try:
        names = os.listdir(model_dir)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        match = _TEMPORARY.fullmatch(name)
        path = os.path.join(model_dir, name)
        if match is None or not _TARGET.fullmatch(match.group("target")) or path in _IN_FLIGHT:
            continue
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed
