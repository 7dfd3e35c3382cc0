"""TerminateOnNaNHandler: stop when the loss or a monitored metric is not finite."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import distributed
from .._checks import check_bool, check_positive_int, check_state_keys
from .._schedule import EventFilter
from ..events import BatchEnd, EpochBegin, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, rank_identical_stop
from ..metrics.base import as_metric_list, metric_name

__all__ = ["NonFiniteError", "TerminateOnNaNHandler"]


class NonFiniteError(RuntimeError):
    """Raised by ``TerminateOnNaNHandler(raise_error=True)``: the loss or a monitored metric is
    nan or infinite.

    Attributes:
        reason: which value (``"loss"`` or the metric's name).
        batch: the batch (counted over the run, from 1) with the first non-finite value found.
    """

    def __init__(self, message: str, reason: str, batch: int):
        super().__init__(message)
        self.reason = reason
        self.batch = batch


class TerminateOnNaNHandler(StatefulHandler, TrainBegin, EpochBegin, BatchEnd, EpochEnd):
    """Stop training, or raise, when the loss or a monitored metric is nan or infinite.

    Every batch folds ``isfinite(loss)`` into a tally that stays on the loss's device (tensor
    ops, no host sync); the tally is read on the host every ``check_every`` batches, at every
    epoch's end, and at every boundary where work waits to run (a ``CheckpointHandler`` save:
    see :attr:`Estimator.boundary_actions_pending`), and tells which batch was the first with a
    non-finite loss. Monitored metrics are computed at the same checks (val metrics at the end
    of epochs that validated). On a non-finite value the handler logs which value and the batch,
    then stops training (after that batch, or that epoch when found at its end), or with
    ``raise_error=True`` raises :class:`NonFiniteError` there.

    Checkpoints: the handler runs at priority 1000, after the handlers that ask for a save at a
    boundary (``CheckpointHandler`` at 0), and checks whenever a save is pending. With
    ``raise_error=True`` no checkpoint of a non-finite state is written: the error leaves the
    loop before the save, the ``train_end`` handlers run, and the newest checkpoint is the last
    good one. Stopping instead (the default) lets the stop boundary's save run, so at most that
    one checkpoint holds the non-finite state.

    Under ``torch.distributed`` every rank checks at the same batches and a non-finite loss on
    any rank stops every rank; only rank 0 logs. (Every rank must then register the same
    boundary work, as ``CheckpointHandler`` does.)

    Args:
        check_every: read the tally every this many batches; 1 checks every batch at the cost
            of one host-device sync per step. Defaults to 100.
        monitor: a metric the estimator owns, or a list of them (e.g. ``est.val_metrics[0]``).
            Defaults to None (the loss only).
        raise_error: raise :class:`NonFiniteError` instead of stopping, so that a pipeline
            fails loudly (Keras' ``TerminateOnNaN(raise_error=True)``). Defaults to False.

    Attributes:
        stopped_batch: the batch (counted over the run, from 1) with the first non-finite value
            found, or None.
        reason: which value was not finite (``"loss"`` or a metric's name), or None.

    Example:
        >>> import logging, torch
        >>> class Est:  # what the handler reads from an Estimator
        ...     logger, val_metrics = logging.getLogger("example"), []
        ...     boundary_actions_pending = False
        >>> h = TerminateOnNaNHandler(check_every=2)
        >>> h.train_begin(Est())
        >>> [h.batch_end(Est(), batch=None, pred=None, label=None, loss=torch.tensor(v))
        ...  for v in (1.0, float("nan"), 2.0, 3.0)]
        [False, True, False, False]
        >>> h.stopped_batch, h.reason
        (2, 'loss')
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("total_batches", "batch_in_epoch", "checked")

    priority = 1000
    state_attributes = ("total_batches", "batch_in_epoch", "checked", "finite", "good")

    def __init__(self, check_every: int = 100, monitor: Any = None, *, raise_error: bool = False):
        self.check_every = check_positive_int(check_every, "check_every")
        self.monitor = as_metric_list(monitor, "monitor")
        check_bool(raise_error, "raise_error")
        self.raise_error = raise_error
        self._filter = EventFilter(every=check_every)
        self._val_ids: set[int] = set()
        self._reset()

    def _reset(self) -> None:
        self.total_batches = 0
        self.batch_in_epoch = 0
        self.checked = 0  # total_batches at the last check
        self.finite: Optional[torch.Tensor] = None  # all losses finite since the last check
        self.good: Optional[torch.Tensor] = None  # leading batches with a finite loss since then
        self.stopped_batch: Optional[int] = None
        self.reason: Optional[str] = None

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._reset()
        self._val_ids = {id(m) for m in estimator.val_metrics}

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.batch_in_epoch = 0

    @rank_identical_stop
    def batch_end(self, estimator: EstimatorView, *, loss: Any, **kwargs: Any) -> bool:
        self.total_batches += 1
        self.batch_in_epoch += 1
        if isinstance(loss, torch.Tensor):
            so_far, good = self.finite, self.good
            if so_far is None or good is None or so_far.device != loss.device:
                so_far, good = self._new_tally(loss.device)
            finite = torch.isfinite(loss.detach())
            so_far.logical_and_(finite.all() if finite.dim() else finite)
            good.add_(so_far)
        if self.reason is not None:
            return False
        # a save waiting for this boundary must not write a non-finite state: check first
        if not self._filter(self.total_batches) and not estimator.boundary_actions_pending:
            return False
        return self._check(estimator, at_epoch_end=False)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        if self.reason is not None:
            return True
        return self._check(estimator, at_epoch_end=True)

    # -- checks ----------------------------------------------------------------------------
    def _new_tally(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        finite = self.finite.to(device) if self.finite is not None else torch.ones((), dtype=torch.bool, device=device)
        good = self.good.to(device) if self.good is not None else torch.zeros((), dtype=torch.int64, device=device)
        self.finite, self.good = finite, good
        return finite, good

    def _check(self, estimator: EstimatorView, at_epoch_end: bool) -> bool:
        since = self.total_batches - self.checked
        if since and self.good is not None and self.finite is not None:
            good = int(self.good)
            if distributed.is_distributed():
                good = min(distributed.gather_objects(good))
            self.finite.fill_(True)
            self.good.zero_()
            self.checked = self.total_batches
            if good < since:
                bad = self.total_batches - since + good + 1
                return self._stop(estimator, "loss", math.nan, bad, self.batch_in_epoch - (self.total_batches - bad))
        for metric in self.monitor:
            if id(metric) in self._val_ids and not (at_epoch_end and estimator.validated):
                continue  # a val metric holds a value only after validation
            value = float(metric.compute())
            if not math.isfinite(value):
                return self._stop(estimator, metric_name(metric), value, self.total_batches, self.batch_in_epoch)
        return False

    def _stop(self, estimator: EstimatorView, what: str, value: float, batch: int, batch_in_epoch: int) -> bool:
        self.reason, self.stopped_batch = what, batch
        shown = "the loss is not finite (nan or inf)" if what == "loss" else f"{what} is {value}"
        found = "" if batch == self.total_batches else f", found at the check after batch {self.total_batches}"
        message = f"{shown} at batch {batch} (batch {batch_in_epoch} of the epoch){found}"
        estimator.logger.error("Terminating: %s", message)
        if self.raise_error:
            raise NonFiniteError(f"Training stopped: {message}", what, batch)
        return True

    # -- state -----------------------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self.state_attributes, self.name)
        super().load_state_dict(state)
        self.reason = self.stopped_batch = None
