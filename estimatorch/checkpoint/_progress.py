"""The progress mark: a small file beside the checkpoints that tells the next attempt of a run how
the last one ended and the last step it completed, also when it ended without a word (SIGKILL, the
out-of-memory killer, a machine lost with its processes).

Global rank 0 writes it when its fit has opened ``model_dir`` (``.estimatorch-progress`` there,
under the directory's lock): the run's ledger so far, this attempt's entry last, as one JSON
document after a few counters. From then on the training thread writes only the counters, through
a memory map of the file's first bytes: stores into memory, no system call and no file write on the
step path. The operating system writes the page back; a process killed by any signal leaves it in
the page cache, so the next process reads the last step exactly (a machine that loses power may
lose the last seconds of it). When the fit ends the file is rewritten whole with the attempt's
closed entry, or removed where a checkpoint of its last step already says how it ended (the
plan's end, saved): a mark stays beside the checkpoints only while an attempt runs, and after one
whose end no checkpoint tells in full (killed, failed, stopped by a signal, whose checkpoint is
written in ``train_end``, or ended past its last save).

On an object store (an fsspec URL ``model_dir``) there is no file beside the checkpoints, and an
object cannot be written by memory stores: the mark is a file of the machine instead, in
``$ESTIMATORCH_PROGRESS_DIR`` (else the temporary directory's ``estimatorch-progress``), named by
the URL. A restart on the same machine (torchrun's agent restarting its workers, a requeued job
landing on the same node) finds it; one on another machine does not, and counts a killed attempt
to the step of the last checkpoint it wrote (its entry says ``exact: false``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import struct
import tempfile
import time
from typing import Any, Optional

from ._ledger import attempt_times
from ._store import is_url

__all__ = ["CELLS", "ENDED_CODES", "PROGRESS_NAME", "ProgressMark", "alive", "progress_path", "read_progress"]

PROGRESS_NAME = ".estimatorch-progress"
_MAGIC = b"ESTPRG\x00\x01"
#: the counters after the magic, each an int64 (times in nanoseconds: ``seen`` since the epoch,
#: the others durations; ``loop`` the time since the epoch the loop began, 0 before)
CELLS = ("step", "seen", "ended", "loop", "load", "save", "validation", "data", "end", "length")
_HEAD = 8 * (1 + len(CELLS))  # the bytes mapped: the magic and the counters; the JSON follows
#: the code of each ending in the ``ended`` counter (0: no word yet)
ENDED_CODES = {"running": 0, "finished": 1, "signal": 2, "failed": 3}
_ENDED = {code: name for name, code in ENDED_CODES.items()}


def progress_path(model_dir: str) -> str:
    """Where the progress mark of a fit writing to ``model_dir`` lives (see the module's notes
    for an object store's).

    Example:
        >>> progress_path("/runs/a")
        '/runs/a/.estimatorch-progress'
    """
    if not is_url(model_dir):
        return os.path.join(model_dir, PROGRESS_NAME)
    directory = os.environ.get("ESTIMATORCH_PROGRESS_DIR") or os.path.join(tempfile.gettempdir(),
                                                                              "estimatorch-progress")
    return os.path.join(directory, hashlib.sha256(model_dir.encode()).hexdigest()[:20] + PROGRESS_NAME)


def _file_bytes(cells: dict[str, int], document: dict[str, Any]) -> bytes:
    text = json.dumps(document).encode()
    values = [cells.get(name, 0) for name in CELLS[:-1]] + [len(text)]
    return _MAGIC + struct.pack(f"<{len(CELLS)}q", *values) + text


def _replace(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole (a temporary file renamed over it)."""
    directory = os.path.dirname(path) or "."
    fd, temporary = tempfile.mkstemp(prefix=PROGRESS_NAME + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


class ProgressMark:
    """This attempt's mark: :meth:`create` it, then :meth:`step` per step and :meth:`set` the
    other counters (memory stores into the mapped file), and :meth:`close` it at the end."""

    __slots__ = ("path", "document", "_file", "_map", "_cells")

    def __init__(self, path: str, document: dict[str, Any]):
        self.path, self.document = path, document
        self._file: Any = None
        self._map: Optional[mmap.mmap] = None
        self._cells: Any = None

    @classmethod
    def create(cls, path: str, document: dict[str, Any], step: int = 0) -> ProgressMark:
        """Write the mark of a new attempt at ``path`` (``document``: the ledger so far, this
        attempt's entry last, and what the reader needs; ``step``: the step it starts from) and
        map its counters."""
        if is_url(path):
            raise ValueError(f"a progress mark is a local file, got {path!r}")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _replace(path, _file_bytes({"step": step, "seen": time.time_ns(), "data": -1}, document))
        mark = cls(path, document)
        mark._file = open(path, "r+b")  # held open (mapped) until close()
        mark._map = mmap.mmap(mark._file.fileno(), _HEAD)
        mark._cells = memoryview(mark._map).cast("q")
        return mark

    def step(self, step: int) -> None:
        """Step ``step`` is complete (two stores into memory)."""
        cells = self._cells
        cells[1] = step
        cells[2] = time.time_ns()

    def set(self, name: str, value: int) -> None:
        """Set counter ``name`` (:data:`CELLS`) and the time of the last sign of life."""
        cells = self._cells
        cells[1 + CELLS.index(name)] = value
        cells[2] = time.time_ns()

    def close(self, document: Optional[dict[str, Any]] = None) -> None:
        """Unmap the counters; with ``document`` (the attempt's closed entry last), rewrite the
        file with it and the counters as they are."""
        if document is not None and self._cells is not None:
            self.set("ended", ENDED_CODES.get(document["attempts"][-1]["ended"], 0))
        cells = {name: self._cells[1 + i] for i, name in enumerate(CELLS)} if self._cells is not None else {}
        if self._cells is not None:
            self._cells.release()
            self._map.close()  # type: ignore[union-attr]
            self._file.close()
            self._cells = self._map = self._file = None
        if document is not None:
            self.document = document
            _replace(self.path, _file_bytes(cells, document))


def read_progress(path: str) -> Optional[dict[str, Any]]:
    """The mark at ``path``: ``{"ledger": {"run_id", "attempts"}, "pid", "host", "accumulation",
    "live"}``, the last attempt's entry brought up to date from the counters (``live``: it had
    not ended when they were last written: still running, or killed); None when there is no
    mark or it cannot be read (a mark is a hint: a damaged one is ignored)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < _HEAD or not data.startswith(_MAGIC):
        return None
    values = dict(zip(CELLS, struct.unpack(f"<{len(CELLS)}q", data[8:_HEAD])))
    try:
        document = json.loads(data[_HEAD:_HEAD + values["length"]].decode())
        attempts = list(document["attempts"])
        current = dict(attempts[-1])
        ended = _ENDED.get(values["ended"], "running")
        if current["ended"] == "running":  # not closed: the counters speak for it
            seconds = max(0.0, values["seen"] * 1e-9 - current["started"])
            current.update(last_step=values["step"], exact=True, ended=ended, seconds=seconds,
                           times=attempt_times(seconds, current["started"], **{
                               name: values[name] for name in ("loop", "load", "save", "validation", "data", "end")}))
        attempts[-1] = current
        return {"ledger": {"run_id": str(document["run_id"]), "attempts": attempts},
                "pid": document.get("pid"), "host": document.get("host"),
                "accumulation": int(document.get("accumulation", 1)), "live": current["ended"] == "running"}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


def alive(progress: dict[str, Any]) -> bool:
    """Whether the process that writes ``progress`` still runs here (on this host, its pid alive):
    what ``inspect`` says of an attempt that has not ended."""
    if not progress["live"] or progress.get("host") != socket.gethostname() or not isinstance(progress.get("pid"), int):
        return False
    try:
        os.kill(progress["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
