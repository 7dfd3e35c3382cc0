"""ProfilerHandler: ``torch.profiler`` traces of scheduled training steps, per rank."""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
from torch import profiler as torch_profiler

from .. import distributed
from .._checks import is_int
from ..events import BatchBegin, BatchEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd
from ._paths import check_output_dir, path_argument

__all__ = ["ProfilerHandler"]


class ProfilerHandler(StatefulHandler, TrainBegin, BatchBegin, BatchEnd, TrainEnd):
    """Profile scheduled training steps with ``torch.profiler``: CPU activity, and CUDA's where
    CUDA is available.

    The schedule counts the fit's steps from its first (a resumed fit continues the count): each
    cycle skips ``wait`` steps, runs the profiler without keeping ``warmup`` steps, and records
    ``active`` steps; ``repeat`` cycles (0: until the fit ends). Each recorded cycle writes two
    files in ``log_dir``: ``rank<r>.<time>.pt.trace.json`` for TensorBoard's profiler plugin
    (``tensorboard --logdir <log_dir>``), and ``chrome/rank<r>.steps<first>-<last>.<time>.json`` to open
    in ``chrome://tracing`` or Perfetto. In the traces each recorded step is a range named
    ``step N`` (N counts the fit's steps from 1), from its ``batch_begin`` to the end of its
    ``batch_end`` (the optimizer step included), and ``ProfilerStep#k`` marks the cycle's steps.
    A fit that ends in the middle of a cycle writes what that cycle recorded.

    Outside its cycles' steps the profiler is off: a step then costs one call to ``batch_begin`` and
    ``batch_end`` each, which compare the step with the next cycle's start (also after the last
    cycle); on the ranks not profiled the handler is not called at all (``listens_to``).

    Args:
        log_dir: the directory of the traces (created if missing; checked before any work).
        wait: steps skipped at the start of each cycle. Defaults to 1.
        warmup: steps the profiler runs without recording, before the recorded ones (its first
            steps are slower and skew the trace). Defaults to 1.
        active: steps recorded per cycle. Defaults to 3.
        repeat: cycles; 0 repeats them until the fit ends. Defaults to 1.
        ranks: the global ranks that profile (an iterable of ints), or None for every rank.
            Defaults to ``(0,)``.
        record_shapes, profile_memory, with_stack: passed to ``torch.profiler.profile``
            (input shapes, tensor memory allocated and freed, Python stacks). Default False.

    Example:
        >>> ProfilerHandler("runs/profile", wait=2, warmup=1, active=2).scheduled_steps(12)
        [4, 5]
    """

    priority = 1500  # the step's range closes after the optimizer step and the other handlers
    state_attributes = ()  # the schedule follows the fit's step count, which a resume restores

    def __init__(self, log_dir: Union[str, os.PathLike], *, wait: int = 1, warmup: int = 1, active: int = 3,
                 repeat: int = 1, ranks: Optional[Iterable[int]] = (0,), record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False):
        for name, value, least in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1),
                                   ("repeat", repeat, 0)):
            if not is_int(value) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
        if ranks is not None:
            ranks = tuple(ranks)
            if not ranks or not all(is_int(r) and r >= 0 for r in ranks):
                raise ValueError(f"ranks must be None or non-negative ints, got {ranks!r}")
        for name, flag in (("record_shapes", record_shapes), ("profile_memory", profile_memory),
                           ("with_stack", with_stack)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be a bool, got {flag!r}")
        self.log_dir = path_argument(log_dir, "log_dir")
        self.wait, self.warmup, self.active, self.repeat = int(wait), int(warmup), int(active), int(repeat)
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        #: the trace files this process wrote in the current (or last) fit, in order
        self.traces: list[str] = []
        self._profile: Optional[torch_profiler.profile] = None
        self._step_range: Optional[torch_profiler.record_function] = None
        self._start = math.inf  # 0-based step where the next cycle's profiler starts
        self._recorded: list[int] = []  # the current cycle's recorded steps (1-based)

    @property
    def diagnostics_location(self) -> Optional[str]:
        """``log_dir``: ``fit`` writes a CUDA memory snapshot here on an out-of-memory error."""
        return str(self.log_dir)

    # -- the schedule ----------------------------------------------------------------------
    @property
    def _cycle(self) -> int:
        return self.wait + self.warmup + self.active

    def _cycle_start(self, step: int) -> float:
        """The 0-based step where the first cycle starting at or after ``step`` starts its profiler."""
        cycle = max(0, (step - self.wait + self._cycle - 1) // self._cycle)
        if self.repeat and cycle >= self.repeat:
            return math.inf
        return cycle * self._cycle + self.wait

    def scheduled_steps(self, steps: int) -> list[int]:
        """The steps (counted from 1) that a fit of ``steps`` steps records."""
        return [s + 1 for s in range(steps) if self._phase(s) == "active"]

    def _phase(self, step: int) -> str:
        cycle, offset = divmod(step, self._cycle)
        if (self.repeat and cycle >= self.repeat) or offset < self.wait:
            return "off"
        return "warmup" if offset < self.wait + self.warmup else "active"

    # -- the contract ----------------------------------------------------------------------
    def listens_to(self, event: str) -> bool:
        """Every event on the profiled ranks; none elsewhere."""
        return self.ranks is None or distributed.get_rank() in self.ranks

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work: ``log_dir`` can be written, where this rank profiles."""
        if self.listens_to("train_begin"):
            check_output_dir(self.log_dir, "log_dir")

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.traces = []
        self._close()
        self._start = self._cycle_start(0)  # a resume: batch_begin finds the cycle of its step

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        step = estimator.position.step  # 0-based: the steps completed before this one
        if step < self._start:
            return
        if self._profile is None:
            if self._phase(step) == "off":  # a resume past this cycle's start
                self._start = self._cycle_start(step)
                if step < self._start:
                    return
            self._open(estimator, step)
        self._step_range = torch_profiler.record_function(f"step {step + 1}")
        self._step_range.__enter__()

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._profile is None:
            return
        step = estimator.position.step  # still the steps before this one
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._phase(step) == "active":
            self._recorded.append(step + 1)
        self._profile.step()  # after the cycle's last step the trace is written
        if step % self._cycle == self._cycle - 1:  # the cycle's last step: the profiler stops
            self._close()
            self._start = self._cycle_start(step + 1)

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._close()  # a cycle cut short writes what it recorded

    # -- the profiler ----------------------------------------------------------------------
    def _open(self, estimator: EstimatorView, step: int) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        activities = [torch_profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch_profiler.ProfilerActivity.CUDA)
        warmup = self.wait + self.warmup - step % self._cycle  # a resume may start inside the warmup
        with warnings.catch_warnings():  # torch warns about a schedule without warmup
            warnings.simplefilter("ignore", UserWarning)
            schedule = torch_profiler.schedule(wait=0, warmup=max(0, warmup), active=self.active
                                               - max(0, -warmup), repeat=1)
        self._recorded = []
        self._profile = torch_profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._write,
            record_shapes=self.record_shapes, profile_memory=self.profile_memory, with_stack=self.with_stack)
        self._profile.start()

    def _write(self, profile: torch_profiler.profile) -> None:
        if not self._recorded:
            return
        rank = distributed.get_rank()
        stamp = time.time_ns()
        board = os.path.join(self.log_dir, f"rank{rank}.{stamp}.pt.trace.json")
        chrome_dir = os.path.join(self.log_dir, "chrome")
        os.makedirs(chrome_dir, exist_ok=True)
        chrome = os.path.join(chrome_dir, f"rank{rank}.steps{self._recorded[0]}-{self._recorded[-1]}.{stamp}.json")
        profile.export_chrome_trace(board)  # a trace is saved once: the Chrome file is its copy
        shutil.copyfile(board, chrome)
        self.traces += [board, chrome]
        self._recorded = []

    def _close(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profile is not None:
            profile, self._profile = self._profile, None
            profile.stop()
