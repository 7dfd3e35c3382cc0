"""SpeedMonitor: where a step's time goes, model FLOP/s and MFU, and peak memory, per log
interval and per epoch, in the epoch line, the History, TensorBoard and the trackers."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional, Union

import torch
from torch.utils.flop_counter import FlopCounterMode

from .. import distributed
from .._checks import check_real, is_int
from ..events import (
    PARTS,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    EstimatorView,
    Handler,
    StepSplit,
    TrainBegin,
    TrainEnd,
)
from ..events.readings import epoch_readings
from ._peak_flops import matmul_precision, peak_flops

__all__ = ["SpeedMonitor", "SplitReader", "epoch_speed_values", "format_speed", "speed_values"]

_logger = logging.getLogger(__name__)

_GIB = 2**30
#: ``memory_history=True`` keeps this many allocator events (PyTorch's default)
HISTORY_ENTRIES = 100_000


def speed_values(estimator: EstimatorView, split: StepSplit) -> dict[str, float]:
    """The values of ``split`` (steps of this process): seconds per step of each part
    (``time_data``, ``time_move``, ``time_step``, ``time_handlers``; ``time_device`` on CUDA),
    and with a :class:`SpeedMonitor` in the fit that knows the FLOPs of a batch, ``flops_per_sec``
    (model FLOPs over the steps' wall time) and, with a peak, ``mfu`` (a fraction of 1).

    Example:
        >>> class Est: handlers = ()
        >>> speed_values(Est(), StepSplit(steps=4, data=0.4, step=1.6))
        {'time_data': 0.1, 'time_move': 0.0, 'time_step': 0.4, 'time_handlers': 0.0}
    """
    values = {f"time_{part}": seconds for part, seconds in split.per_step().items()}
    monitor = next((h for h in estimator.handlers if isinstance(h, SpeedMonitor)), None)
    if monitor is not None and monitor.flops is not None and split.steps and split.wall > 0:
        values["flops_per_sec"] = monitor.flops * split.steps / split.wall
        if monitor.peak is not None:
            values["mfu"] = values["flops_per_sec"] / monitor.peak
    return values


def epoch_speed_values(estimator: EstimatorView) -> dict[str, float]:
    """The epoch that is ending, as the fit's :class:`SpeedMonitor` measured it at its
    ``epoch_end`` (every rank's mean; FLOP/s summed; memory the largest rank's); empty without
    one. What ``History``, ``LoggingHandler``, ``TensorBoardHandler`` and the trackers show
    (the handlers' :meth:`~estimatorch.events.Handler.epoch_readings`).

    Call it from ``epoch_end`` at a priority above -750 (or after it).
    """
    return epoch_readings(estimator)


def format_speed(values: dict[str, float]) -> str:
    """The values of :func:`speed_values` or :func:`epoch_speed_values` as a log line shows them.

    Example:
        >>> format_speed({"time_data": 0.0005, "time_move": 0.0, "time_step": 0.004, "time_handlers": 0.0005})
        'step 5.00ms = data 0.50ms (10%) + move 0.00ms (0%) + step 4.00ms (80%) + handlers 0.50ms (10%)'
        >>> format_speed({"flops_per_sec": 2.5e12, "mfu": 0.0125, "memory_allocated_peak": 1.5})
        '2.50 TFLOP/s, MFU 1.2%; memory peak 1.50 GiB allocated'
    """
    parts = []
    times = [values[f"time_{p}"] for p in PARTS if f"time_{p}" in values]
    if len(times) == len(PARTS):
        wall = sum(times)
        shares = [f"{p} {t * 1e3:.2f}ms ({t / wall if wall > 0 else 0:.0%})" for p, t in zip(PARTS, times)]
        device = f", on the device {values['time_device'] * 1e3:.2f}ms" if "time_device" in values else ""
        parts.append(f"step {wall * 1e3:.2f}ms = {' + '.join(shares)}{device}")
    if "flops_per_sec" in values:
        mfu = f", MFU {values['mfu']:.1%}" if "mfu" in values else ""
        parts.append(f"{_flops(values['flops_per_sec'])}/s{mfu}")
    memory = [f"{values[k]:.2f} GiB {k.split('_')[1]}" for k in ("memory_allocated_peak", "memory_reserved_peak")
              if k in values]
    if memory:
        parts.append(f"memory peak {', '.join(memory)}")
    return "; ".join(parts)


def _flops(value: float) -> str:
    for size, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} FLOP"


class SplitReader:
    """The values of the steps since its last read, for a handler that writes them every N
    batches: :meth:`start` at the interval's start, :meth:`read` at its end. Empty when the fit
    measures no split (no handler declares ``times_steps``). No collective: this process's steps.
    """

    def __init__(self) -> None:
        self._last: Optional[StepSplit] = None

    def start(self, estimator: EstimatorView) -> None:
        times = estimator.step_times
        self._last = times.split() if times is not None else None

    def read(self, estimator: EstimatorView) -> dict[str, float]:
        times = estimator.step_times
        if times is None:
            return {}
        now = times.split()
        split = now - self._last if self._last is not None else now
        self._last = now
        return speed_values(estimator, split)


class SpeedMonitor(Handler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchBegin, BatchEnd):
    """Where a step's time goes, model FLOP/s and MFU, and peak memory on CUDA.

    With this handler in the fit, ``fit`` measures each step's wall time in four parts that add
    up to it: waiting for the data (``time_data``), moving the batch to the device
    (``time_move``), the step itself: forward, backward and optimizer (``time_step``; on CUDA
    also ``time_device``, the device's time, from CUDA events read without a synchronisation),
    and the other hooks (``time_handlers``), in seconds per step. It costs a few microseconds
    per step; without this handler, nothing (see :mod:`estimatorch.events.timing`).

    Model FLOPs per second (``flops_per_sec``) are the FLOPs of one training batch (forward and
    backward, counted once in the fit's first batch with ``torch.utils.flop_counter.FlopCounterMode``,
    or ``flops_per_batch``) times the steps, over their wall time. MFU (``mfu``, a fraction) is
    that over the device's peak: ``peak_flops``, else the peak of the GPU at the step's matmul
    precision from the table in ``estimatorch/event_handlers/_peak_flops.py`` (H100 SXM/PCIe/NVL,
    H200, A100, L40S, L40, L4, A10G, A10, V100, T4; bf16/fp16 under mixed precision, TF32 when
    float32 matmuls may use it, else fp32). On the CPU, MFU only with ``peak_flops``.

    On CUDA, the epoch's peak memory (``memory_allocated_peak``, ``memory_reserved_peak``, GiB;
    ``torch.cuda.max_memory_allocated``, reset at each epoch's start: no synchronisation). With
    ``memory_history``, the allocator's history is recorded from the fit's start, so that the
    snapshot ``fit`` writes on a CUDA out-of-memory error shows where each block came from
    (open it at https://pytorch.org/memory_viz).

    Per epoch, at priority -750 (after validation, before TensorBoard and the trackers), the
    values are averaged over the ranks (FLOP/s summed, memory the largest rank's) and go to the
    epoch line, ``History``, ``TensorBoardHandler`` (``epoch/<key>``) and ``MLflowHandler`` /
    ``WandbHandler``; every ``log_interval`` batches of those handlers, this process's values of
    the batches since (``batch/<key>`` in TensorBoard and the trackers). A fit resumed in the
    middle of an epoch reports that epoch's steps since the resume.

    Args:
        flops_per_batch: the FLOPs of one training batch (forward and backward) on this process.
            Defaults to None: counted in the fit's first batch (a compiled net may count 0: then
            pass it).
        peak_flops: the device's peak FLOP/s, for MFU. Defaults to None: the table's peak for
            the GPU (none on the CPU).
        memory_history: record the CUDA allocator's history from the fit's start: True, or the
            number of events to keep (``True`` keeps 100,000). Ignored on the CPU. Defaults to
            False.

    Example:
        >>> monitor = SpeedMonitor(flops_per_batch=6 * 32 * 1000, peak_flops=1e12)
        >>> monitor.flops, monitor.peak_flops
        (192000, 1000000000000.0)
    """

    priority = -750
    times_steps = True

    def __init__(self, *, flops_per_batch: Union[int, float, None] = None, peak_flops: Optional[float] = None,
                 memory_history: Union[bool, int] = False):
        self.flops_per_batch = _positive(flops_per_batch, "flops_per_batch", "a number of FLOPs")
        self.peak_flops = _positive(peak_flops, "peak_flops", "a number of FLOP/s")
        if not (isinstance(memory_history, bool) or (is_int(memory_history) and memory_history > 0)):
            raise ValueError(f"memory_history must be True, False or a positive number of events, got "
                             f"{memory_history!r}")
        self.memory_history = memory_history
        #: FLOPs of one training batch (given, or counted in the fit's first batch), else None
        self.flops: Optional[float] = flops_per_batch
        #: the peak FLOP/s MFU is taken against (given, or from the table), else None
        self.peak: Optional[float] = self.peak_flops
        #: the values of the last epoch measured, and its number (counted from 0)
        self.epoch_values: dict[str, float] = {}
        self.epoch_values_of: Optional[int] = None
        self._counter: Optional[FlopCounterMode] = None
        self._counting = False
        self._cuda: Optional[torch.device] = None
        self._recording = False
        self._epoch_start: Optional[StepSplit] = None
        self._in_fit = False  # evaluate() fires epoch and batch events too: measured only in fit

    def listens_to(self, event: str) -> bool:
        """``batch_begin`` and ``batch_end`` only to count the FLOPs of the first batch."""
        return event not in ("batch_begin", "batch_end") or self.flops_per_batch is None

    def epoch_readings(self, epoch: int) -> dict[str, float]:
        """The values of epoch ``epoch`` (:attr:`epoch_values`), once its ``epoch_end`` measured them."""
        return dict(self.epoch_values) if self.epoch_values_of == epoch else {}

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.flops, self.peak = self.flops_per_batch, self.peak_flops
        self.epoch_values, self.epoch_values_of = {}, None
        self._counting, self._in_fit = self.flops_per_batch is None, True
        device = estimator.device
        self._cuda = device if device.type == "cuda" else None
        if self.peak is None and self._cuda is not None:
            name = torch.cuda.get_device_name(self._cuda)
            precision = matmul_precision(str(estimator.precision), estimator.net)
            self.peak = peak_flops(name, precision)
            if self.peak is None:
                estimator.logger.info("SpeedMonitor: no peak FLOP/s known for %s at %s: pass peak_flops= for MFU",
                                      name, precision)
        if self.memory_history and self._cuda is not None:
            entries = HISTORY_ENTRIES if self.memory_history is True else int(self.memory_history)
            torch.cuda.memory._record_memory_history(max_entries=entries)
            self._recording = True

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if not self._in_fit:
            return
        times = estimator.step_times
        self._epoch_start = times.split() if times is not None else None
        if self._cuda is not None:
            torch.cuda.reset_peak_memory_stats(self._cuda)

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Count the FLOPs of the fit's first batch (subscribed without ``flops_per_batch``)."""
        if self._counting and self._counter is None:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        counter = self._counter
        if counter is None:
            return
        self._counter, self._counting = None, False
        counter.__exit__(None, None, None)
        self.flops = counter.get_total_flops() or None
        if self.flops is None:
            estimator.logger.warning("SpeedMonitor counted no FLOPs in the first batch (a compiled net, or "
                                     "operations FlopCounterMode does not know): pass flops_per_batch= for "
                                     "FLOP/s and MFU")

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        times = estimator.step_times
        if times is None or not self._in_fit:  # evaluate's epoch events: nothing measured
            return
        start = self._epoch_start or StepSplit()
        values = speed_values(estimator, times.split(wait=True) - start)  # one wait per epoch on CUDA
        if distributed.is_distributed():  # every rank's mean (FLOP/s summed), in one collective
            world = distributed.get_world_size()
            keys = sorted(values)
            summed = distributed.all_reduce_sum({k: float(values[k]) for k in keys}, device=torch.device("cpu"))
            values = {k: float(summed[k]) / (1 if k == "flops_per_sec" else world) for k in keys}
        if self._cuda is not None:
            peaks = distributed.all_reduce_max_async([torch.cuda.max_memory_allocated(self._cuda),
                                                      torch.cuda.max_memory_reserved(self._cuda)]).wait()
            values["memory_allocated_peak"], values["memory_reserved_peak"] = (p / _GIB for p in peaks)
        self.epoch_values, self.epoch_values_of = values, estimator.position.epoch

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._in_fit = self._counting = False
        if self._counter is not None:  # the first batch failed while counting
            self._counter.__exit__(None, None, None)
            self._counter = None
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False


def _positive(value: Any, arg: str, what: str) -> Any:
    check_real(value, arg, allow_none=True, strict=True)
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{arg} must be {what} > 0 or None, got {value!r}")
    return value
