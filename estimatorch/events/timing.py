"""Where the training steps' time goes: what ``estimator.step_times`` holds while a handler that
declares ``times_steps`` (:class:`~estimatorch.event_handlers.SpeedMonitor`) is in the fit.

The loop adds, per step of this process, the wall time of four parts that follow each other
(they add up to the wall time of the steps, from asking the data for a batch to asking for the
next one):

- ``data``: waiting for the data (``next()`` of the batch iterator);
- ``move``: moving the batch to the device;
- ``step``: forward, loss and backward (with the hooks of their events) and the optimizer step
  (``GradientUpdateHandler``'s ``batch_end``, with any ``batch_end`` ranked before it);
- ``handlers``: the other ``batch_begin`` and ``batch_end`` hooks, the work they leave for the
  step's boundary (a checkpoint's save) and the loop's own bookkeeping.

On a CUDA device, the host time of ``step`` is mostly the time to queue the kernels; the time the
device spent on them (``device``) is measured with CUDA events around each step, read without a
synchronisation when a split is taken (steps the device has not finished yet count at a later
one).

A reader takes :meth:`StepTimes.split` now and then; the difference of two splits is the split
of the steps between them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Optional

import torch

__all__ = ["PARTS", "StepSplit", "StepTimes"]

#: the parts of a step, in the order they follow each other
PARTS = ("data", "move", "step", "handlers")

_NS = 1e-9
#: steps between two reads of the finished steps' CUDA events by the loop itself
DRAIN = 64


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """The time of ``steps`` training steps, in seconds, by part (:data:`PARTS`); ``device``:
    the device time of their forward, backward and optimizer step on CUDA (else None), of the
    ``device_steps`` steps the device had finished.

    Example:
        >>> a = StepSplit(steps=10, data=0.25, move=0.0, step=1.0, handlers=0.25)
        >>> b = StepSplit(steps=30, data=0.75, move=0.0, step=4.0, handlers=0.5)
        >>> b - a
        StepSplit(steps=20, data=0.5, move=0.0, step=3.0, handlers=0.25, device=None, device_steps=0)
        >>> (b - a).wall, (b - a).per_step()
        (3.75, {'data': 0.025, 'move': 0.0, 'step': 0.15, 'handlers': 0.0125})
    """

    steps: int = 0
    data: float = 0.0
    move: float = 0.0
    step: float = 0.0
    handlers: float = 0.0
    device: Optional[float] = None
    device_steps: int = 0

    @property
    def wall(self) -> float:
        """The wall time of the steps: the sum of the parts."""
        return self.data + self.move + self.step + self.handlers

    def per_step(self) -> dict[str, float]:
        """Seconds per step of each part (and ``device``, per finished step, on CUDA); empty
        without steps."""
        if not self.steps:
            return {}
        values = {part: getattr(self, part) / self.steps for part in PARTS}
        if self.device is not None and self.device_steps:
            values["device"] = self.device / self.device_steps
        return values

    def __sub__(self, other: StepSplit) -> StepSplit:
        device = None if self.device is None else self.device - (other.device or 0.0)
        return StepSplit(self.steps - other.steps, self.data - other.data, self.move - other.move,
                         self.step - other.step, self.handlers - other.handlers, device,
                         self.device_steps - other.device_steps)


class StepTimes:
    """The running totals the loop adds to (in nanoseconds), for one ``fit`` of this process.

    ``events``: measure the device time of each step with CUDA events (on a CUDA device).
    """

    def __init__(self, events: bool = False):
        self.steps = 0
        self.ns = dict.fromkeys(PARTS, 0)
        self.events = events
        self.device_ms = 0.0
        self.device_steps = 0
        self._pending: deque[tuple[Any, Any]] = deque()  # (start, end) events of steps not read yet
        self._free: list[Any] = []  # events read already, recorded again by later steps

    def event(self) -> Any:
        """A CUDA event with timing, from the pool of those read already."""
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def add_device_step(self, start: Any, end: Any) -> None:
        """A step's events, recorded on the stream (read once the device has passed ``end``).
        Every :data:`DRAIN` steps the finished ones are read, so that an epoch without a reader
        keeps a bounded pool of events (a query per pending event, no synchronisation)."""
        self._pending.append((start, end))
        if len(self._pending) % DRAIN == 0:
            self._read_events(wait=False)

    def _read_events(self, wait: bool) -> None:
        """Add the device time of every finished step (in order); with ``wait``, wait for the
        last recorded one first (a synchronisation on that event only)."""
        pending = self._pending
        if wait and pending:
            pending[-1][1].synchronize()
        while pending and pending[0][1].query():
            start, end = pending.popleft()
            self.device_ms += start.elapsed_time(end)
            self.device_steps += 1
            self._free += (start, end)

    def split(self, wait: bool = False) -> StepSplit:
        """The totals so far. ``wait``: on CUDA, wait for the device to finish the last step's
        events first (once per epoch, not per step), so that every step's device time counts."""
        if self.events:
            self._read_events(wait)
        ns = self.ns
        return StepSplit(self.steps, ns["data"] * _NS, ns["move"] * _NS, ns["step"] * _NS, ns["handlers"] * _NS,
                         self.device_ms * 1e-3 if self.events else None, self.device_steps)
