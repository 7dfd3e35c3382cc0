"""EarlyStoppingHandler: stop when a monitored metric stops improving."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .._checks import check_bool, check_positive_int, is_real, warn_user
from ..checkpoint import load_model_state, model_state
from ..events import EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd
from ..events.monitor import check_monitor, improved, resolve_mode
from ..metrics.base import metric_name

__all__ = ["EarlyStoppingHandler", "improved", "resolve_mode"]


class EarlyStoppingHandler(StatefulHandler, TrainBegin, EpochEnd, TrainEnd):
    """Stop once ``monitor`` has not improved for ``patience`` epochs in a row.

    The monitor's value is read once per epoch (after validation, which runs first). A ``nan``
    value counts as no improvement, with a warning. With a ``baseline``, an epoch counts as an
    improvement only when its value beats both the best value so far and the baseline, so
    training stops when the baseline is not beaten within ``patience`` epochs; the best value
    (``best``, ``best_epoch``) is tracked all the same.

    Args:
        monitor: the name of one of the estimator's metrics (e.g. ``"val_loss"``, resolved at
            ``fit`` start) or the metric object itself (e.g. ``est.val_metrics[0]``).
        min_delta: the smallest change that counts as an improvement. Defaults to 0.
        patience: epochs without improvement before stopping (0 and 1 both stop at the first
            one without improvement). Defaults to 0.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric's ``higher_is_better``: min for
            losses). Defaults to ``"auto"``.
        baseline: a finite value the monitor must beat; None starts from the first value.
            Defaults to None.
        restore_best_weights: load the weights of the best epoch seen at the end of training
            (whether or not it stopped early), also when the ``baseline`` was never beaten: the
            best epoch is then the best of those that did not beat it. A fit cut short by an
            exception or Ctrl-C keeps its current weights, so that ``fit(..., resume=True)``
            continues exactly. Defaults to False.
        start_from_epoch: ignore the first this many epochs (a warm-up in which no improvement
            is expected): they neither count towards ``patience`` nor set the best value or
            weights. Defaults to 0.

    Example:
        >>> from estimatorch.metrics import Loss
        >>> EarlyStoppingHandler(Loss(), patience=2, start_from_epoch=3).mode
        'min'
    """

    state_attributes = ("current_epoch", "best", "best_epoch", "wait", "stopped_epoch", "best_weights")
    shared_state = True  # decided on reduced values; best weights are DDP's common weights

    def __init__(self, monitor: Any, min_delta: float = 0, patience: int = 0, mode: str = "auto",
                 baseline: Optional[float] = None, restore_best_weights: bool = False, *,
                 start_from_epoch: int = 0):
        self.monitor_name = check_monitor(monitor, "EarlyStoppingHandler")
        if monitor is None:
            raise TypeError("EarlyStoppingHandler: monitor must be a metric's name (e.g. 'val_loss') or a metric "
                            "the estimator owns (e.g. est.val_metrics[0]), got None")
        if not is_real(min_delta) or not min_delta >= 0:
            raise ValueError(f"min_delta must be a non-negative number, got {min_delta!r}")
        check_positive_int(patience, "patience", minimum=0)
        if baseline is not None and (not is_real(baseline)
                                     or not math.isfinite(baseline)):
            raise ValueError(f"baseline must be a finite number or None, got {baseline!r}")
        check_bool(restore_best_weights, "restore_best_weights")
        self.start_from_epoch = check_positive_int(start_from_epoch, "start_from_epoch", minimum=0)
        self.monitor = monitor
        self.min_delta = float(min_delta)
        self.patience = patience
        self._mode = mode
        self.mode = resolve_mode(mode, monitor, "EarlyStoppingHandler") if self.monitor_name is None \
            else resolve_mode(mode, None, "EarlyStoppingHandler", unresolved=True)
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = restore_best_weights
        self._reset()

    def resolve_monitor(self, metric: Any) -> None:
        """Monitor ``metric``, the estimator's metric of the name given (at ``fit`` start)."""
        self.monitor = metric
        self.mode = resolve_mode(self._mode, metric, "EarlyStoppingHandler")
        self._reset()

    def _reset(self) -> None:
        self.current_epoch = 0
        self.best = math.inf if self.mode == "min" else -math.inf  # the best value seen
        self.best_epoch = 0
        self.wait = 0
        self.stopped_epoch = 0
        self.best_weights: Optional[dict[str, torch.Tensor]] = None

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._reset()

    def _beats_baseline(self, value: float) -> bool:
        return self.baseline is None or improved(value, self.baseline, self.mode, self.min_delta)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        self.current_epoch += 1
        if self.current_epoch <= self.start_from_epoch:
            return False  # warming up: not even read
        value = float(self.monitor.compute())
        if math.isnan(value):
            warn_user(f"EarlyStoppingHandler: {metric_name(self.monitor)} is nan in epoch {self.current_epoch}; "
                      "counted as no improvement (TerminateOnNaNHandler stops a run at its first nan loss)")
        elif improved(value, self.best, self.mode, self.min_delta):
            self.best, self.best_epoch = value, self.current_epoch
            if self.restore_best_weights:
                self.best_weights = _plain_weights(estimator.net)
            if self._beats_baseline(value):
                self.wait = 0
                return False
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = self.current_epoch
            if self._beats_baseline(self.best):
                why = f"has not improved for {self.wait} epoch(s)"
            else:
                why = f"has not beaten the baseline {self.baseline:.6g} in {self.wait} epoch(s)"
            estimator.logger.info("[Epoch %d] Early stopping: %s %s (best %.6g at epoch %d)",
                                  self.current_epoch, metric_name(self.monitor), why, self.best, self.best_epoch)
            return True
        return False

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if not estimator.position.stop:
            return  # interrupted: the weights must stay those a resume continues from
        if self.restore_best_weights and self.best_weights is not None:
            _load_plain_weights(estimator.net, self.best_weights)
            estimator.logger.info("Restored the weights of epoch %d (best %s: %.6g)",
                                  self.best_epoch, metric_name(self.monitor), self.best)


def _plain_weights(net: Any) -> dict[str, Any]:
    """A CPU copy of ``net``'s weights under the plain module's keys (no ``_orig_mod.`` of
    ``torch.compile``), so that they restore into a compiled or a plain net after a resume."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model_state(net).items()}


def _load_plain_weights(net: Any, weights: dict[str, Any]) -> None:
    load_model_state(net, weights)
