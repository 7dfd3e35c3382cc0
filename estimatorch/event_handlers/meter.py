"""MeterHandler: drive statistics (QuantLab's meter) from the loop's events and write them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from .. import distributed
from .._checks import check_state_keys
from ..events import (
    BackwardBegin,
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    EstimatorView,
    ForwardBegin,
    ForwardEnd,
    StatefulHandler,
    TrainBegin,
    TrainEnd,
)
from ..statistics.base import STEP_EVENTS, Statistic
from ..statistics.callback import CallbackStatistic
from .tensorboard import EPOCH_PREFIX, TensorBoardHandler

__all__ = ["MeterHandler"]


def _as_list(statistics: Any) -> list[Any]:
    return list(statistics) if isinstance(statistics, (list, tuple)) else [statistics]


def _to_host(values: dict[str, Any]) -> dict[str, float]:
    """Python floats of a dict of tensors and numbers: one transfer per device."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[str]] = {}
    for tag, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(tag)
        else:
            out[tag] = float(value)
    for tags in by_device.values():
        floats = torch.stack([values[t].detach().double().reshape(()) for t in tags]).tolist()
        out.update(zip(tags, floats))
    return {tag: out[tag] for tag in values}


class MeterHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchBegin, ForwardBegin, ForwardEnd,
                   BackwardBegin, BackwardEnd, BatchEnd):
    """Measure :mod:`estimatorch.statistics` during training and write them (QuantLab's meter).

    The handler forwards the loop's events to its statistics: every step to running statistics
    (accumulated over the epoch, written at its end under ``epoch/<name>`` at step = epoch
    number), and only firing steps to instantaneous ones (written at that step's ``batch_end``
    under ``<name>/...`` at step = global batch count). Callback-based statistics have their
    hooks registered on firing steps only and removed within the step, and at the end of
    ``fit`` whatever happened. The handler subscribes only to the per-step events its
    statistics use, so a step calls nothing else.

    Values are combined over every rank (a mean, or a sum for throughput) in one collective,
    then written by global rank 0 only. Every rank must therefore run the same statistics with
    the same keys. Runs at priority -500: after the optimizer step, before handlers at 0.

    Args:
        statistics: a :class:`~estimatorch.statistics.Statistic` or a list of them, with unique
            names.
        writer: where values go: a :class:`TensorBoardHandler` of the same ``fit`` (its run
            and its resume rules), an object with ``add_scalar(tag, value, step)`` and
            ``add_histogram(tag, values, step)`` (only rank 0 calls it), or a function that
            creates one (called on rank 0 at ``fit`` start; closed at its end).

    Example:
        >>> from estimatorch.statistics import GradientNorm, Throughput
        >>> class Recorder:
        ...     def add_scalar(self, tag, value, step): print(tag, step)
        ...     def add_histogram(self, tag, values, step): pass
        >>> meter = MeterHandler([GradientNorm(period=10), Throughput()], writer=Recorder())
        >>> [s.name for s in meter.statistics]
        ['gradient_norm', 'throughput']
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("step",)

    priority = -500

    def __init__(self, statistics: Any, *, writer: Any):
        items = _as_list(statistics)
        if not items:
            raise ValueError("statistics must hold at least one statistic, got none")
        for stat in items:
            if not isinstance(stat, Statistic):
                raise TypeError(f"statistics must hold estimatorch.statistics.Statistic objects, got {stat!r}")
        names = [s.name for s in items]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"statistics must have unique names, got {duplicated[0]!r} more than once; pass name=")
        is_writer = callable(getattr(writer, "add_scalar", None)) and callable(getattr(writer, "add_histogram", None))
        if not (isinstance(writer, TensorBoardHandler) or is_writer or callable(writer)):
            raise TypeError("writer must be a TensorBoardHandler, an object with add_scalar and add_histogram, "
                            f"or a function that creates one, got {writer!r}")
        self.statistics = items
        self.writer = writer
        self.step = 0
        self.epoch = 0
        self._writer: Any = None
        self._firing: tuple = ()
        self._instant: tuple = ()
        self._on: dict[str, tuple] = dict.fromkeys(STEP_EVENTS, ())
        self._running = tuple(s for s in items if s.running)
        self._hooked = tuple(s for s in items if isinstance(s, CallbackStatistic))
        events: set[str] = set()
        for stat in items:
            events |= set(getattr(stat, "events", ())) & STEP_EVENTS
        self._events = frozenset(events)

    def listens_to(self, event: str) -> bool:
        """The per-step events besides ``batch_end`` only when a statistic needs them."""
        return event not in STEP_EVENTS or event in self._events

    # -- schedule --------------------------------------------------------------------------
    def _schedule(self, force: bool = False) -> None:
        """Which statistics act on the next step, and on which of its events."""
        step = self.step + 1
        firing = tuple(s for s in self.statistics if s.running or s.fires(step))
        if force or firing != self._firing:
            self._firing = firing
            self._instant = tuple(s for s in firing if not s.running)
            self._on = {e: tuple(s for s in firing if e in s.events) for e in STEP_EVENTS}

    def _detach(self) -> None:
        for stat in self._hooked:
            stat.detach()

    # -- writing ---------------------------------------------------------------------------
    def _target(self) -> Any:
        if isinstance(self.writer, TensorBoardHandler):
            return self.writer.writer
        if self._writer is None:
            source: Any = self.writer
            factory: Callable[[], Any] = source if not hasattr(source, "add_scalar") else (lambda: source)
            self._writer = distributed.rank_zero_writer(factory)
        return self._writer

    def _write(self, stats: tuple, prefix: str, step: int) -> None:
        scalars: dict[str, Any] = {}
        summed: set[str] = set()
        hists: dict[str, torch.Tensor] = {}
        for stat in stats:
            head = f"{prefix}{stat.name}"
            for key, value in stat.scalars().items():
                tag = f"{head}/{key}" if key else head
                scalars[tag] = value
                if stat.reduction == "sum":
                    summed.add(tag)
            for key, value in stat.histograms().items():
                hists[f"{head}/{key}" if key else head] = value
        if distributed.is_distributed():
            world = distributed.get_world_size()
            scalars = distributed.all_reduce_sum(scalars)
            scalars = {t: v if t in summed else v / world for t, v in scalars.items()}
            hists = {t: torch.cat([h.reshape(-1) for h in distributed.gather_objects(v.detach().cpu())])
                     for t, v in hists.items()}
        writer = self._target()
        for tag, value in _to_host(scalars).items():
            writer.add_scalar(tag, value, step)
        for tag, value in hists.items():
            writer.add_histogram(tag, value.detach(), step)

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._detach()
        self.step = self.epoch = 0
        for stat in self.statistics:
            stat.setup(estimator)
        self._schedule(force=True)

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for stat in self._running:
            stat.epoch_begin(estimator)

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for stat in self._on["batch_begin"]:
            stat.batch_begin(estimator, **kwargs)

    def forward_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for stat in self._on["forward_begin"]:
            stat.forward_begin(estimator, **kwargs)

    def forward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for stat in self._on["forward_end"]:
            stat.forward_end(estimator, **kwargs)

    def backward_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for stat in self._on["backward_begin"]:
            stat.backward_begin(estimator, **kwargs)

    def backward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for stat in self._on["backward_end"]:
            stat.backward_end(estimator, **kwargs)

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        instant = self._instant
        try:
            for stat in self._firing:
                stat.batch_end(estimator, **kwargs)
        finally:
            if instant and self._hooked:
                self._detach()
        self.step += 1
        if instant:
            self._write(instant, "", self.step)
            for stat in instant:
                stat.reset()
        self._schedule()

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.epoch += 1
        if self._running:
            self._write(self._running, EPOCH_PREFIX, self.epoch)

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        try:
            for stat in self.statistics:
                stat.teardown()
        finally:
            self._detach()
            if self._writer is not None and not hasattr(self.writer, "add_scalar"):
                self._writer.close()  # created by our factory: ours to close
            self._writer = None

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch,
                "statistics": {s.name: s.state_dict() for s in self.statistics}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("step", "epoch", "statistics"), self.name)
        saved = state["statistics"]
        if not isinstance(saved, Mapping):
            raise TypeError(f"state of {self.name}: statistics must be a dict, got {type(saved).__name__}")
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        for stat in self.statistics:
            if stat.name in saved:
                stat.load_state_dict(saved[stat.name])
        self._schedule(force=True)
