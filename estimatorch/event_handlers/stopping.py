"""StoppingHandler: stop after a number of epochs or batches."""

from __future__ import annotations

from typing import Any, Optional

from .._checks import check_positive_int
from ..events import BatchEnd, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, rank_identical_stop

__all__ = ["StoppingHandler"]


class StoppingHandler(StatefulHandler, TrainBegin, BatchEnd, EpochEnd):
    """Stop training after ``max_epoch`` epochs or ``max_batch`` batches in total.

    The estimator's plan (``fit(epochs=...)`` / ``fit(batches=...)``, read at ``train_begin``)
    always holds: a limit given here can end training earlier, never later, so a run never goes
    past the plan that resuming and the history are checked against. ``fit`` adds one when you
    pass none.

    Args:
        max_epoch: stop after this many epochs (or the plan's ``epochs``, whichever is smaller).
            Defaults to None (the plan's ``epochs``).
        max_batch: stop after this many batches in total (or the plan's ``batches``, whichever
            is smaller). Defaults to None (the plan's ``batches``).

    Example:
        >>> h = StoppingHandler(max_batch=2)
        >>> class Est: max_epoch, max_batch = None, None
        >>> h.train_begin(Est())
        >>> [h.batch_end(Est(), batch=None, pred=None, label=None, loss=None) for _ in range(2)]
        [False, True]
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("current_batch",)

    state_attributes = ("current_epoch", "current_batch")

    def __init__(self, max_epoch: Optional[int] = None, max_batch: Optional[int] = None):
        self.max_epoch = check_positive_int(max_epoch, "max_epoch", allow_none=True)
        self.max_batch = check_positive_int(max_batch, "max_batch", allow_none=True)
        self.current_epoch = 0
        self.current_batch = 0
        self._max_epoch = max_epoch
        self._max_batch = max_batch

    def stop_limits(self) -> tuple[Optional[int], Optional[int]]:
        """``(max_epoch, max_batch)``."""
        return self.max_epoch, self.max_batch

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.current_epoch = 0
        self.current_batch = 0
        self._max_epoch = _tighter(self.max_epoch, estimator.max_epoch)
        self._max_batch = _tighter(self.max_batch, estimator.max_batch)

    @rank_identical_stop
    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        self.current_batch += 1
        return self._max_batch is not None and self.current_batch >= self._max_batch

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        self.current_epoch += 1
        return self._max_epoch is not None and self.current_epoch >= self._max_epoch


def _tighter(own: Optional[int], plan: Optional[int]) -> Optional[int]:
    """The smaller of two optional limits (None: no limit)."""
    if own is None:
        return plan
    return own if plan is None else min(own, plan)
