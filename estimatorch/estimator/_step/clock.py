"""The step-time split's clock: the loop's pieces wrapped once per epoch so that each step adds
its parts to the fit's :class:`~estimatorch.events.timing.StepTimes` (see there for the parts).

Only a fit with a handler that declares ``times_steps`` is clocked; otherwise the loop runs its
pieces unwrapped and a step pays nothing for this module. Clocked, a step takes five
``time.perf_counter_ns`` readings and goes through three wrappers and one extra ``batch_end``
call (a few microseconds; on CUDA, two recorded events).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable

from ...events import declared
from ...events.timing import StepTimes
from .._fit_estimator import FitEstimator

__all__ = ["StepClock"]


class StepClock:
    """One epoch's clock: :meth:`wrap` the loop's pieces, iterate :meth:`batches`, then :meth:`close`.

    The parts follow each other: each reading ends the part before it and starts the next, so
    the parts add up to the steps' wall time by construction; ``mark`` is the last reading.
    """

    __slots__ = ("times", "ns", "mark", "open", "start")

    def __init__(self, times: StepTimes):
        self.times = times
        self.ns = times.ns
        self.mark = 0
        self.open = False  # a step began and its tail (the hooks after the optimizer) is not counted yet
        self.start: Any = None  # the CUDA event recorded as the current step's forward began

    def wrap(self, move: Callable[..., Any], fit_batch: Callable[..., Any], batch_end: tuple[Callable[..., Any], ...]
             ) -> tuple[Callable[..., Any], Callable[..., Any], tuple[Callable[..., Any], ...]]:
        """The move to the device, ``fit_batch`` and the ``batch_end`` hooks, clocked: a reading
        is inserted after the hook that steps the optimizer (the first handler declaring
        ``accumulation_steps``; at the front when none does). The batches: :meth:`batches`."""
        owners = [getattr(fn, "__self__", None) for fn in batch_end]
        at = next((i + 1 for i, h in enumerate(owners) if h is not None
                   and declared(h, "accumulation_steps") is not None), 0)
        hooks = (*batch_end[:at], self._optimizer_done, *batch_end[at:])
        return self._move(move), self._fit_batch(fit_batch), hooks

    def close(self) -> None:
        """The epoch's batches are done: count the last step's tail (after a stop, the loop
        asks for no next batch)."""
        if self.open:
            self.ns["handlers"] += time.perf_counter_ns() - self.mark
            self.open = False

    # -- the wrappers ---------------------------------------------------------------------------
    def batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, clocked: the wait for each is ``data``; the time from a step's optimizer
        reading to the next ask is that step's ``handlers``."""
        clock, ns, times = time.perf_counter_ns, self.ns, self.times
        iterator = iter(batches)
        while True:
            asked = clock()
            if self.open:  # the previous step's tail: hooks after the optimizer, the boundary
                ns["handlers"] += asked - self.mark
            try:
                batch = next(iterator)
            except StopIteration:
                self.open = False
                ns["data"] += clock() - asked
                return
            self.mark = got = clock()
            ns["data"] += got - asked
            times.steps += 1
            self.open = True
            yield batch

    def _move(self, move: Callable[..., Any]) -> Callable[..., Any]:
        clock, ns = time.perf_counter_ns, self.ns

        def to_device(batch: Any) -> Any:
            batch = move(batch)
            now = clock()
            ns["move"] += now - self.mark
            self.mark = now
            return batch

        return to_device

    def _fit_batch(self, fit_batch: Callable[..., Any]) -> Callable[..., Any]:
        clock, ns, times = time.perf_counter_ns, self.ns, self.times
        events = times.events

        def timed_fit_batch(estimator: FitEstimator, batch: Any, batch_axis: int) -> Any:
            begun = clock()
            ns["handlers"] += begun - self.mark  # the batch_begin hooks
            if events:
                self.start = times.event()
                self.start.record()
            out = fit_batch(estimator, batch, batch_axis)
            self.mark = clock()
            ns["step"] += self.mark - begun
            return out

        return timed_fit_batch

    def _optimizer_done(self, estimator: FitEstimator, **kwargs: Any) -> None:
        now = time.perf_counter_ns()
        self.ns["step"] += now - self.mark
        self.mark = now
        if self.start is not None:
            end = self.times.event()
            end.record()
            self.times.add_device_step(self.start, end)
            self.start = None
