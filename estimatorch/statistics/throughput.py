"""Throughput: samples per second over an epoch (running, callback-free)."""

from __future__ import annotations

import time
from typing import Any

from .._batches import batch_size_of
from .._checks import check_state_keys
from .base import RunningStatistic, Value

__all__ = ["Throughput"]


class Throughput(RunningStatistic):
    """Training samples per second over the epoch, summed over every process, written at the
    epoch's end as ``epoch/throughput``.

    Samples are counted from the labels' shapes (no device sync). The samples and seconds of
    an epoch cut by a checkpoint are its state, so a resumed epoch reports the whole epoch.

    Args:
        name: Defaults to ``"throughput"``.

    Example:
        >>> import torch
        >>> class Est: batch_axis = 0
        >>> s = Throughput()
        >>> s.reset(); s.batch_end(Est(), label=torch.zeros(32)); s.samples
        32
    """

    default_name = "throughput"
    reduction = "sum"

    def reset(self) -> None:
        self.samples = 0
        self._seconds = 0.0
        self._since = time.perf_counter()

    def _elapsed(self) -> float:
        return self._seconds + (time.perf_counter() - self._since)

    def batch_end(self, estimator: Any, *, label: Any = None, **kwargs: Any) -> None:
        self.samples += batch_size_of(label, estimator.batch_axis)

    def scalars(self) -> dict[str, Value]:
        elapsed = self._elapsed()
        return {"": self.samples / elapsed if elapsed > 0 else float("nan")}

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "seconds": self._elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("samples", "seconds"), f"statistic {self.name!r}")
        self.samples, self._seconds = int(state["samples"]), float(state["seconds"])
        self._since = time.perf_counter()
