"""Checkpoints written by a process of their own: the training process pays for the copy only.

A writer thread (:class:`~estimatorch.checkpoint.BackgroundWriter`) pickles and writes while
holding the GIL the training thread needs, so the steps after a save run slower for as long as
the write takes. :class:`ProcessWriter` keeps the thread's contract (one write in flight, a
failure raised at the next save or at the end) but hands the pickling and the writing to a
writer process:

- :class:`SharedStaging` copies the state's tensors into one shared memory area (an anonymous
  ``memfd``, pinned with ``cudaHostRegister`` when a tensor comes from CUDA, the copies then on a
  side stream the next kernels wait for), laid out once and reused while the tensors keep their
  shapes and dtypes. The training process's whole cost of a save is that copy.
- The writer process is started (``subprocess``, the same interpreter, never your script's
  ``__main__``) at the first save of a fit and stopped at its end. It receives the area once per
  layout (its file descriptor over a socket) and, per save, a small pickle of the payload whose
  tensors are references into the area; it writes each file with
  :func:`~estimatorch.checkpoint.atomic_save` (temporary file, fsync, rename, directory fsync,
  or one upload to an object store) and answers.
- A thread of the training process waits for that answer (a blocking read, without the GIL),
  then runs what follows the file (the pointer, retention, the ``checkpoint_saved`` event).
- The writer process ignores SIGINT and SIGTERM and lives in its own session (a Ctrl-C or a
  signal to the job does not cut its write short: the training process waits for it) and is
  killed with the training process (``PR_SET_PDEATHSIG``). One that dies is an error naming its
  pid and how it ended, raised like a failed write, never a hang; what it was writing is left a
  temporary file, removed by the next cleanup.

Linux only (``os.memfd_create``); :func:`process_writer_supported` says whether it runs here.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import json
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import weakref
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

import torch

from . import _files, _store
from ._async import BackgroundWriter, Staging
from ._lease import check_writer

__all__ = ["ProcessWriter", "SharedStaging", "WriterProcessError", "make_writer", "process_writer_supported"]

logger = logging.getLogger("estimatorch")

_ALIGN = 64  # bytes: every buffer starts on a cache line (and on any dtype's alignment)
#: seconds to wait for an idle writer process to exit when told to, before it is killed.
STOP_SECONDS = 60.0


class WriterProcessError(RuntimeError):
    """The checkpoint writer process died (killed, out of memory...) or could not start."""


def process_writer_supported() -> bool:
    """True where :class:`ProcessWriter` runs (Linux: ``os.memfd_create`` and fd passing)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class _Area:
    """One anonymous shared memory file, mapped here; its descriptor goes to the writer process."""

    def __init__(self, size: int, pinned: bool) -> None:
        self.size = max(size, 1)
        self.fd = os.memfd_create("estimatorch-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self._finalizers = [weakref.finalize(self, os.close, self.fd)]
        if pinned:  # page-locked for asynchronous copies from the GPU
            cudart, ptr = torch.cuda.cudart(), self.bytes.data_ptr()
            check = int(cudart.cudaHostRegister(ptr, self.size, 1))  # cudaHostRegisterPortable
            if check != 0:
                raise RuntimeError(f"cudaHostRegister of {self.size} bytes of staging memory failed (error {check})")
            self._finalizers.append(weakref.finalize(self, cudart.cudaHostUnregister, ptr))

    def view(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self.bytes[offset:offset + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Unpin and close the descriptor now (the mapping goes with its last view)."""
        for finalizer in reversed(self._finalizers):
            finalizer()


class SharedStaging(Staging):
    """:class:`~estimatorch.checkpoint.Staging` whose buffers are views of shared memory areas
    another process can map: :attr:`areas` by id, and :attr:`table`, where each buffer is
    (area id, offset, shape, dtype). A buffer keeps its place while its tensor keeps its path,
    shape and dtype; the tensors that are new (the first save, a metric's growing list) are laid
    out in one new area; an area no buffer uses any more is dropped.

    Example:
        >>> staging = SharedStaging()
        >>> copy, _ = staging.stage({"w": torch.ones(2), "step": 3})
        >>> copy["w"].tolist(), staging.nbytes, staging.table
        ([1.0, 1.0], 8, [(1, 0, torch.Size([2]), torch.float32)])
    """

    def __init__(self) -> None:
        super().__init__()
        self.areas: dict[int, _Area] = {}
        self.table: list[tuple[int, int, torch.Size, torch.dtype]] = []
        self.slots: dict[int, int] = {}  # id of a staging buffer -> its index in table
        self._places: dict[Any, tuple[int, int, torch.Size, torch.dtype, bool]] = {}  # path -> its place
        self._next = 1

    def stage(self, obj: Any) -> tuple[Any, list[Any]]:
        entries = [(path, tensor, tensor.device.type == "cuda") for path, tensor in self.tensors(obj)]
        places = {path: self._places.get(path) for path, _, _ in entries}
        new = [(path, t, cuda) for path, t, cuda in entries
               if places[path] is None or places[path][2:] != (t.shape, t.dtype, cuda)]  # type: ignore[index]
        if new or len(places) != len(self._places):
            offset = 0
            for path, tensor, _ in new:
                places[path] = (self._next, offset, tensor.shape, tensor.dtype, tensor.device.type == "cuda")
                offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
            areas = {}
            if new:
                areas[self._next] = _Area(offset, pinned=any(cuda for *_, cuda in new))
                self._next += 1
            for area_id, *_ in places.values():  # type: ignore[misc]
                areas[area_id] = areas.get(area_id) or self.areas[area_id]
            for area_id, area in self.areas.items():
                if area_id not in areas:
                    area.release()
            self.areas, self._places = areas, places  # type: ignore[assignment]
            self.table = [place[:4] for place in places.values()]  # type: ignore[index]
            buffers = [areas[area_id].view(offset, shape, dtype) for area_id, offset, shape, dtype in self.table]
            self._buffers = dict(zip(places, buffers))
            self.slots = {id(buf): i for i, buf in enumerate(buffers)}
        return super().stage(obj)

    def __getstate__(self) -> dict[str, Any]:
        return SharedStaging().__dict__


class _Pickler(pickle.Pickler):
    """Pickles a staged payload with its staging buffers as references (their index)."""

    def __init__(self, file: Any, slots: dict[int, int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._slots = slots

    def persistent_id(self, obj: Any) -> Optional[int]:
        return self._slots.get(id(obj)) if isinstance(obj, torch.Tensor) else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        return self._tensors[pid]


class ProcessWriter(BackgroundWriter):
    """A :class:`~estimatorch.checkpoint.BackgroundWriter` whose files are written by a writer
    process (see the module's docstring); :meth:`submit` (any write function, e.g. a sharded
    directory's) still runs on the thread.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "state.pt")
        >>> writer = ProcessWriter()
        >>> writer.submit_files({"w": torch.ones(2)}, [path], then=lambda: None)
        >>> writer.wait(); writer.close(); torch.load(path)["w"].tolist()
        [1.0, 1.0]
    """

    def __init__(self, what: str = "checkpoint") -> None:
        super().__init__(what)
        self.staging: SharedStaging = SharedStaging()
        self._plain = Staging()  # for submit(): a write function of the thread's
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._sent: tuple[set[int], Any] = (set(), None)  # the areas and the table the writer process has
        self._at_exit = False

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {**state, "staging": SharedStaging(), "_plain": Staging(), "_proc": None, "_conn": None,
                "_sent": (set(), None), "_at_exit": False}

    @property
    def pid(self) -> Optional[int]:
        """The writer process's pid while it runs (None before the first save of a fit)."""
        return self._proc.pid if self._proc is not None else None

    def submit(self, payload: Any, write: Callable[[Any], None]) -> None:
        self.finish_previous()
        self._start(self._plain, payload, write)

    def submit_files(self, payload: Any, paths: list[str], then: Callable[[], None]) -> None:
        """Copy ``payload``'s tensors into the shared staging area and return; the writer
        process writes ``payload`` to each of ``paths`` (:func:`atomic_save`), then ``then()``
        runs on the thread. Waits first for the previous write (raising its error, if any)."""
        self.finish_previous()
        self._ensure_running()  # on this thread: the writer process dies with it

        def write(staged: Any) -> None:
            self._write(staged, paths)
            then()

        self._start(self.staging, payload, write)

    def close(self) -> None:
        """The fit ends: wait for the write in flight (keeping its error for :meth:`wait`),
        then stop the writer process."""
        self.join()
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        _stop(proc, conn)

    # -- the writer process ------------------------------------------------------------------
    def _ensure_running(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            self._proc = self._conn = None
            _stop(proc, None)
            raise WriterProcessError(f"the {self.what} writer process (pid {proc.pid}) {_ended(proc.returncode)} "
                                     "between two saves")
        if proc is None:
            self._proc, self._conn = _launch()
            self._sent = (set(), None)
            if not self._at_exit:  # once per writer: the interpreter waits for the write in flight
                self._at_exit = True
                atexit.register(_stop_at_exit, weakref.ref(self))

    def _write(self, staged: Any, paths: list[str]) -> None:
        """On the writer thread: hand the staged payload to the process, wait for its answer."""
        proc, conn, staging = self._proc, self._conn, self.staging
        assert proc is not None and conn is not None, "the writer process was not started"
        for path in paths:  # the lease lives in this process: a lease another writer took over writes nothing
            if _store.is_url(path):
                check_writer(path)
        buffer = io.BytesIO()
        _Pickler(buffer, staging.slots).dump(staged)
        temporaries = [None if _store.is_url(path) else _files.reserve_temporary(path) for path in paths]
        try:
            try:
                self._send_layout(proc, conn)
                conn.send(("write", buffer.getvalue(), list(zip(paths, temporaries)), dict(_store._OPTIONS)))
                answer = conn.recv()
            except (EOFError, OSError) as err:
                raise self._died(proc, paths) from err
        finally:
            for tmp in temporaries:
                if tmp is not None:
                    _files.release_temporary(tmp)
        if answer[0] == "error":
            raise answer[1]

    def _send_layout(self, proc: subprocess.Popen, conn: Connection) -> None:
        """The areas the writer process has not mapped yet, and where the buffers are, if that changed."""
        areas, table = self._sent
        staging = self.staging
        if table is staging.table:
            return
        for area_id, area in staging.areas.items():
            if area_id not in areas:
                conn.send(("area", area_id, area.size))
                reduction.send_handle(conn, area.fd, proc.pid)
        conn.send(("layout", staging.table))
        self._sent = (set(staging.areas), staging.table)

    def _died(self, proc: subprocess.Popen, paths: list[str]) -> WriterProcessError:
        try:
            proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:  # it closed its end and lives on: end it
            proc.kill()
            proc.wait()
        return WriterProcessError(f"the {self.what} writer process (pid {proc.pid}) {_ended(proc.returncode)} "
                                  f"while writing {paths[0]!r}: that file was not written (the earlier ones and the "
                                  "pointer are kept)")


def _ended(returncode: Optional[int]) -> str:
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with status {returncode}"


def _launch() -> tuple[subprocess.Popen, Connection]:
    """Start a writer process of this interpreter, connected by a socket pair."""
    ours, theirs = socket.socketpair()
    try:
        code = ("import json, os, sys; sys.path[:] = json.loads(os.environ['ESTIMATORCH_WRITER_PATH']); "
                "from estimatorch.checkpoint._writer_process import serve; serve()")
        env = dict(os.environ, ESTIMATORCH_WRITER_FD=str(theirs.fileno()), ESTIMATORCH_WRITER_PARENT=str(os.getpid()),
                   ESTIMATORCH_WRITER_PATH=json.dumps(sys.path))
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env,
                                start_new_session=True, stdin=subprocess.DEVNULL)
    except OSError as err:
        ours.close()
        raise WriterProcessError(f"cannot start the checkpoint writer process: {err}") from err
    finally:
        theirs.close()
    return proc, Connection(ours.detach())


def _stop(proc: Optional[subprocess.Popen], conn: Optional[Connection]) -> None:
    """Tell an idle writer process to exit and wait for it (killed after :data:`STOP_SECONDS`)."""
    if conn is not None:
        try:
            conn.send(("stop",))
        except OSError:
            pass  # it is gone already
        conn.close()
    if proc is None:
        return
    try:
        proc.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        logger.warning("The checkpoint writer process (pid %d) did not exit in %.0f s: killing it", proc.pid,
                       STOP_SECONDS)
        proc.kill()
        proc.wait()


def _stop_at_exit(ref: Callable[[], Optional[ProcessWriter]]) -> None:
    writer = ref()
    if writer is not None:
        writer.close()  # the interpreter exits once the write in flight is durable


# -- in the writer process ---------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """Be killed with the training process (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError) as err:
        logger.warning("checkpoint writer process: cannot ask to die with its parent: %s", err)
    if os.getppid() != parent:  # it died before the request
        os._exit(1)


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles (to be raised in the training process), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any failure to pickle: send its text instead
        return RuntimeError(f"{type(err).__name__}: {err}")


def _tensors(areas: dict[int, mmap.mmap], table: list[tuple[int, int, torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """The staging buffers, each a tensor of its own storage over a shared area (no copy), so
    that ``torch.save`` writes each one alone."""
    return [torch.frombuffer(areas[area_id], dtype=dtype, count=shape.numel(), offset=offset).view(shape)
            if shape.numel() else torch.empty(shape, dtype=dtype) for area_id, offset, shape, dtype in table]


def serve() -> None:
    """The writer process's loop (started by :class:`ProcessWriter`): map the area, write each
    payload it is sent, answer ``("ok",)`` or ``("error", exception)``; exit when told to or
    when the training process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent(int(os.environ["ESTIMATORCH_WRITER_PARENT"]))
    torch.set_num_threads(1)
    conn = Connection(int(os.environ["ESTIMATORCH_WRITER_FD"]))
    tensors: list[torch.Tensor] = []
    areas: dict[int, mmap.mmap] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "stop":
            return
        if message[0] == "area":
            area_id, size = message[1:]
            fd = reduction.recv_handle(conn)
            try:
                areas[area_id] = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            continue
        if message[0] == "layout":
            table = message[1]
            tensors = _tensors(areas, table)
            areas = {area_id: areas[area_id] for area_id, *_ in table}  # the others are unmapped with their tensors
            continue
        _, data, files, stores = message
        try:
            _store._OPTIONS.clear()
            _store._OPTIONS.update(stores)
            payload = _Unpickler(io.BytesIO(data), tensors).load()
            for path, tmp in files:
                _files.atomic_save(payload, path, temporary=tmp)
            del payload
            answer: tuple = ("ok",)
        except BaseException as err:  # noqa: BLE001 - raised in the training process
            answer = ("error", _portable(err))
        conn.send(answer)


def make_writer(async_save: Any) -> Optional[BackgroundWriter]:
    """The background writer ``CheckpointHandler(async_save=...)`` asks for: None for False; a
    :class:`ProcessWriter` for True or ``"process"`` (True falls back to the thread, logged,
    where no writer process runs); a :class:`BackgroundWriter` (thread) for ``"thread"``.

    Raises:
        ValueError: another value, or ``"process"`` where no writer process runs.
    """
    if async_save not in (False, True, "thread", "process") or type(async_save) not in (bool, str):
        raise ValueError(f"async_save must be False, True, 'process' or 'thread', got {async_save!r}")
    if async_save is False:
        return None
    if async_save == "thread":
        return BackgroundWriter()
    if process_writer_supported():
        return ProcessWriter()
    if async_save == "process":
        raise ValueError(f"async_save='process' needs Linux (os.memfd_create), not {sys.platform}: use "
                         "async_save='thread'")
    logger.info("async_save=True writes checkpoints on a thread on %s (the writer process needs Linux)", sys.platform)
    return BackgroundWriter()
