"""EarlyStoppingHandler: stop when a monitored metric stops improving."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from .._checks import check_bool, check_positive_int, is_real, warn_user
from ..checkpoint import load_model_state, model_state
from ..events import EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd, ValidationEnd
from ..events.monitor import check_monitor, improved, resolve_mode
from ..metrics.base import metric_name

__all__ = ["EarlyStoppingHandler", "improved", "resolve_mode"]


class EarlyStoppingHandler(StatefulHandler, TrainBegin, EpochEnd, TrainEnd, ValidationEnd):
    """Stop once ``monitor`` has not improved for ``patience`` validations (or epochs) in a row.

    A val metric is read at every validation (``validation_end``): after each epoch's with the
    default ``ValidationHandler``, after each step-level one with ``batch_period=N`` (Trainer's
    ``EarlyStoppingCallback``, which counts evaluations); ``patience`` then counts validations
    and a stop takes effect at the boundary of the validation that decided it. Any other metric
    (a train metric) is read once per epoch, and ``patience`` counts epochs. A ``nan`` value
    counts as no improvement, with a warning. With a ``baseline``, a value counts as an
    improvement only when it beats both the best value so far and the baseline, so training
    stops when the baseline is not beaten within ``patience`` readings; the best value
    (``best``, ``best_epoch``, ``best_step``) is tracked all the same.

    Args:
        monitor: the name of one of the estimator's metrics (e.g. ``"val_loss"``, resolved at
            ``fit`` start) or the metric object itself (e.g. ``est.val_metrics[0]``).
        min_delta: the smallest change that counts as an improvement. Defaults to 0.
        patience: readings without improvement before stopping (validations for a val metric,
            epochs otherwise; 0 and 1 both stop at the first one without improvement).
            Defaults to 0.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the metric's ``higher_is_better``: min for
            losses). Defaults to ``"auto"``.
        baseline: a finite value the monitor must beat; None starts from the first value.
            Defaults to None.
        restore_best_weights: load the weights of the best reading at the end of training (those
            the best validation measured: taken right after it, a step-level one included),
            whether or not it stopped early, also when the ``baseline`` was never beaten: the best
            is then the best of those that did not beat it. A fit cut short by an exception or
            Ctrl-C keeps its current weights, so that ``fit(..., resume=True)`` continues
            exactly. (``CheckpointHandler(save_best=True, restore_best=True)`` restores the best
            checkpoint's weights from its file instead, keeping no copy in memory.) Defaults to
            False.
        start_from_epoch: ignore the first this many epochs (a warm-up in which no improvement
            is expected): their readings neither count towards ``patience`` nor set the best
            value or weights. Defaults to 0.

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
        self._follows_validations = False  # decided at train_begin: a val metric is read at validations
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
        #: the step (batches trained) of the best reading: of its validation, or its epoch's last
        self.best_step = 0
        self.wait = 0
        self.stopped_epoch = 0
        self.best_weights: Optional[dict[str, torch.Tensor]] = None
        self._validations = 0  # validations read in this fit (none: a val monitor never computed)

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._reset()
        self._follows_validations = any(m is self.monitor for m in estimator.val_metrics)

    def _beats_baseline(self, value: float) -> bool:
        return self.baseline is None or improved(value, self.baseline, self.mode, self.min_delta)

    def validation_end(self, estimator: EstimatorView, *, values: Mapping[str, float], step: int, epoch: int,
                       phase: str, **kwargs: Any) -> bool:
        """A val monitor's reading: at every validation, step-level ones included."""
        if not self._follows_validations or epoch <= self.start_from_epoch:
            return False
        self._validations += 1
        name = metric_name(self.monitor)
        value = float(values[name]) if name in values else float(self.monitor.compute())
        where = f"epoch {epoch}" if phase == "epoch_end" else f"step {step}"
        return self._read(estimator, value, epoch, step, where, "epoch(s)" if phase == "epoch_end" else "validation(s)")

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        self.current_epoch += 1
        if self._follows_validations:  # read at its validations
            if self._validations == 0 and self.current_epoch == max(1, self.start_from_epoch + 1):
                warn_user(f"EarlyStoppingHandler: no validation ran in epoch {self.current_epoch}, so "
                          f"{metric_name(self.monitor)} was never read: pass val_data to fit (or a "
                          "ValidationHandler), or monitor a train metric")
            return False
        if self.current_epoch <= self.start_from_epoch:
            return False  # warming up: not even read
        value = float(self.monitor.compute())
        return self._read(estimator, value, self.current_epoch, estimator.position.step,
                          f"epoch {self.current_epoch}", "epoch(s)")

    def _read(self, estimator: EstimatorView, value: float, epoch: int, step: int, where: str, unit: str) -> bool:
        """One reading of the monitor: the best so far, the patience; True to stop."""
        if math.isnan(value):
            warn_user(f"EarlyStoppingHandler: {metric_name(self.monitor)} is nan at {where}; "
                      "counted as no improvement (TerminateOnNaNHandler stops a run at its first nan loss)")
        elif improved(value, self.best, self.mode, self.min_delta):
            self.best, self.best_epoch, self.best_step = value, epoch, step
            if self.restore_best_weights:
                self.best_weights = _plain_weights(estimator.net)
            if self._beats_baseline(value):
                self.wait = 0
                return False
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            if self._beats_baseline(self.best):
                why = f"has not improved for {self.wait} {unit}"
            else:
                why = f"has not beaten the baseline {self.baseline:.6g} in {self.wait} {unit}"
            best_at = f"epoch {self.best_epoch}" if unit == "epoch(s)" else f"step {self.best_step}"
            label = f"[Epoch {epoch}]" if unit == "epoch(s)" else f"[Epoch {epoch}][Step {step}]"
            estimator.logger.info("%s Early stopping: %s %s (best %.6g at %s)", label, metric_name(self.monitor),
                                  why, self.best, best_at)
            return True
        return False

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if not estimator.position.stop:
            return  # interrupted: the weights must stay those a resume continues from
        if self.restore_best_weights and self.best_weights is not None:
            _load_plain_weights(estimator.net, self.best_weights)
            where = f"epoch {self.best_epoch}" if not self._follows_validations else \
                f"step {self.best_step} (epoch {self.best_epoch})"
            estimator.logger.info("Restored the weights of %s (best %s: %.6g)", where, metric_name(self.monitor),
                                  self.best)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The declared state, and ``best_step`` and ``validations`` (optional on load: states
        saved before they were kept resume as before)."""
        return {**super().state_dict(), "best_step": self.best_step, "validations": self._validations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.best_step = check_positive_int(state.get("best_step", 0), f"state of {self.name}: best_step", minimum=0)
        self._validations = check_positive_int(state.get("validations", 0), f"state of {self.name}: validations",
                                               minimum=0)


def _plain_weights(net: Any) -> dict[str, Any]:
    """A CPU copy of ``net``'s weights under the plain module's keys (no ``_orig_mod.`` of
    ``torch.compile``), so that they restore into a compiled or a plain net after a resume."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model_state(net).items()}


def _load_plain_weights(net: Any, weights: dict[str, Any]) -> None:
    load_model_state(net, weights)
