"""Checkpoints written in the background: the step waits only for a copy of the state.

:class:`Staging` copies a payload's tensors into CPU buffers it keeps from one save to the next
(at most one copy of the state: a buffer is reused while its tensor keeps its shape and dtype,
and dropped when its tensor is gone). From CUDA the buffers are pinned and the copies run on a
side stream, which the training stream waits for: the host does not wait at all, the next
kernels (the next optimizer step among them) wait for the copy, and the writer waits for it
before it reads the buffers.

:class:`BackgroundWriter` runs one write at a time on a thread of its own. A save that finds the
previous write still running waits for it (logged once per fit, counted in :attr:`waits`); a
write that failed is kept and raised by the next :meth:`~BackgroundWriter.submit` or
:meth:`~BackgroundWriter.wait`, on the training thread. The writer thread is not a daemon: the
interpreter does not exit before the write in flight is complete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

__all__ = ["BackgroundWriter", "Staging"]

logger = logging.getLogger("estimatorch")

Path = tuple[Any, ...]


class Staging:
    """One reused CPU copy of the tensors of a payload (dicts, lists and tuples of tensors and
    plain values, as a checkpoint holds).

    Example:
        >>> staging = Staging()
        >>> live = {"w": torch.zeros(3), "step": 1}
        >>> copy, ready = staging.stage(live)
        >>> _ = live["w"].add_(1)  # the training goes on: the copy keeps the value it had
        >>> copy["w"].tolist(), copy["step"], ready, staging.nbytes
        ([0.0, 0.0, 0.0], 1, [], 12)
    """

    def __init__(self) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}

    @property
    def nbytes(self) -> int:
        """The bytes the staging buffers hold (at most one copy of the state)."""
        return sum(buf.numel() * buf.element_size() for buf in self._buffers.values())

    def stage(self, obj: Any) -> tuple[Any, list[Any]]:
        """A copy of ``obj`` whose tensors live in the staging buffers, and the CUDA events the
        copies from the GPU complete at (none when every tensor was copied on the host)."""
        used: dict[Path, torch.Tensor] = {}
        memo: dict[int, torch.Tensor] = {}  # a tensor met twice (tied weights) is copied once
        streams: dict[torch.device, Any] = {}
        copy = self._walk(obj, (), used, memo, streams)
        self._buffers = used  # buffers of tensors that are gone are dropped
        events = []
        for stream in streams.values():
            torch.cuda.current_stream(stream.device).wait_stream(stream)  # the next step waits for the copy
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return copy, events

    @staticmethod
    def tensors(obj: Any, path: Path = (), memo: Optional[set] = None) -> Any:
        """``(path, tensor)`` of each tensor of ``obj`` that :meth:`stage` copies into a reused
        buffer (strided, not quantized), once per tensor, in the order :meth:`stage` copies them."""
        memo = set() if memo is None else memo
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo.add(id(obj))
                if obj.layout == torch.strided and not obj.is_quantized:
                    yield path, obj
        elif type(obj) in (dict, OrderedDict):
            for key, value in obj.items():
                yield from Staging.tensors(value, (*path, key), memo)
        elif type(obj) in (list, tuple):
            for i, value in enumerate(obj):
                yield from Staging.tensors(value, (*path, i), memo)

    def _walk(self, obj: Any, path: Path, used: dict, memo: dict, streams: dict) -> Any:
        if isinstance(obj, torch.Tensor):
            staged = memo.get(id(obj))
            if staged is None:
                staged = memo[id(obj)] = self._copy(obj, path, used, streams)
            return staged
        if type(obj) in (dict, OrderedDict):
            return type(obj)((key, self._walk(value, (*path, key), used, memo, streams)) for key, value in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(self._walk(value, (*path, i), used, memo, streams) for i, value in enumerate(obj))
        return obj  # plain values (str, int, float, None...) do not change under the writer

    def _copy(self, tensor: torch.Tensor, path: Path, used: dict, streams: dict) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout != torch.strided or tensor.is_quantized:  # rare: a fresh copy each time
            staged = tensor.to("cpu", copy=True)
            used[path] = staged
            return staged
        cuda = tensor.device.type == "cuda"
        buf = self._buffers.get(path)
        # a CPU tensor may use a pinned buffer (one in a shared area registered for a CUDA tensor
        # beside it): only a copy from the GPU needs one
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype or (cuda and not buf.is_pinned()):
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=cuda)
        used[path] = buf
        if not cuda:
            buf.copy_(tensor)
            return buf
        stream = streams.get(tensor.device)
        if stream is None:
            stream = self._streams.get(tensor.device)
            if stream is None:
                stream = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the values of the step just done
            streams[tensor.device] = stream
        with torch.cuda.stream(stream):
            buf.copy_(tensor, non_blocking=True)
        return buf


class BackgroundWriter:
    """Writes staged payloads on a background thread, one at a time.

    Args:
        what: what it writes, in the log line of a save that waits. Defaults to ``"checkpoint"``.

    Example:
        >>> written = []
        >>> writer = BackgroundWriter()
        >>> writer.submit({"w": torch.ones(2)}, lambda staged: written.append(staged["w"].tolist()))
        >>> writer.wait(); written
        [[1.0, 1.0]]
    """

    def __init__(self, what: str = "checkpoint") -> None:
        self.what = what
        self.staging = Staging()
        #: saves that found the previous write still running, and the seconds they waited.
        self.waits, self.waited_seconds = 0, 0.0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._logged = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a handler sent to a spawned process): without buffers, streams or thread."""
        self.join()
        return {**self.__dict__, "staging": Staging(), "_thread": None, "_error": None}

    def reset(self) -> None:
        """A new fit: log the next wait again (counters start from zero)."""
        self.join()
        self.waits, self.waited_seconds, self._logged = 0, 0.0, False

    @property
    def busy(self) -> bool:
        """True while a write runs."""
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        """Wait for the write in flight, keeping its error for :meth:`wait`."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def wait(self) -> None:
        """Wait for the write in flight; raise the error of a write that failed (once)."""
        self.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def finish_previous(self) -> None:
        """Wait for the write in flight (logged once per fit, counted in :attr:`waits`) and raise
        its error, if it failed."""
        if self.busy:
            start = time.perf_counter()
            if not self._logged:
                self._logged = True
                logger.info("Waiting for the previous %s write to finish before the next save (saves come "
                            "faster than the disk writes them; logged once per fit)", self.what)
            self.join()
            self.waits += 1
            self.waited_seconds += time.perf_counter() - start
        self.wait()

    def close(self) -> None:
        """The fit ends: wait for the write in flight (keeping its error for :meth:`wait`)."""
        self.join()

    def submit(self, payload: Any, write: Callable[[Any], None]) -> None:
        """Copy ``payload``'s tensors into the staging buffers and call ``write(copy)`` on the
        writer thread. Waits first for the previous write (raising its error, if it failed)."""
        self.finish_previous()
        self._start(self.staging, payload, write)

    def _start(self, staging: Staging, payload: Any, write: Callable[[Any], None]) -> None:
        staged, ready = staging.stage(payload)
        self._thread = threading.Thread(target=self._run, args=(write, staged, ready),
                                        name="estimatorch-checkpoint-writer")
        self._thread.start()

    def _run(self, write: Callable[[Any], None], staged: Any, ready: list[Any]) -> None:
        try:
            for event in ready:
                event.synchronize()
            write(staged)
        except BaseException as err:  # noqa: BLE001 - raised on the training thread
            self._error = err
