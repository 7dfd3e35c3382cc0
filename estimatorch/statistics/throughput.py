"""Throughput: samples (and tokens, for sequence batches) per second over an epoch (running,
callback-free)."""

from __future__ import annotations

import time
from typing import Any

import torch

from .._batches import batch_size_of
from .._checks import check_state_keys
from ..events import EstimatorView
from .base import RunningStatistic, Value

__all__ = ["Throughput"]


class Throughput(RunningStatistic):
    """Training samples per second over the epoch, summed over every process, written at the
    epoch's end as ``epoch/throughput``; for sequence batches (integer labels of shape
    ``(batch, length)``, a language model's targets) also tokens per second, as
    ``epoch/throughput/tokens``.

    Samples and tokens are counted from the labels' shapes (no device sync). The counts and
    seconds of an epoch cut by a checkpoint are its state, so a resumed epoch reports the whole
    epoch.

    Args:
        name: Defaults to ``"throughput"``.

    Example:
        >>> import torch
        >>> class Est: batch_axis = 0
        >>> s = Throughput()
        >>> s.reset(); s.batch_end(Est(), label=torch.zeros(32)); s.samples
        32
        >>> s.batch_end(Est(), label=torch.zeros(8, 128, dtype=torch.long)); s.samples, s.tokens
        (40, 1024)
    """

    default_name = "throughput"
    reduction = "sum"

    def reset(self) -> None:
        self.samples = 0
        self.tokens = 0
        self._seconds = 0.0
        self._since = time.perf_counter()

    def _elapsed(self) -> float:
        return self._seconds + (time.perf_counter() - self._since)

    def batch_end(self, estimator: EstimatorView, *, label: Any = None, **kwargs: Any) -> None:
        self.samples += batch_size_of(label, estimator.batch_axis)
        if isinstance(label, torch.Tensor) and label.dim() == 2 and not label.is_floating_point():
            self.tokens += label.numel()  # a sequence batch: (batch, length) targets

    def scalars(self) -> dict[str, Value]:
        elapsed = self._elapsed()
        per_second: dict[str, Value] = {"": self.samples / elapsed if elapsed > 0 else float("nan")}
        if self.tokens:
            per_second["tokens"] = self.tokens / elapsed if elapsed > 0 else float("nan")
        return per_second

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "tokens": self.tokens, "seconds": self._elapsed()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("samples", "seconds"), f"statistic {self.name!r}")
        self.samples, self._seconds = int(state["samples"]), float(state["seconds"])
        self.tokens = int(state.get("tokens", 0))  # absent from states of earlier versions
        self._since = time.perf_counter()
