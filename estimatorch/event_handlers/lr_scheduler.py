"""LRSchedulerHandler: step a torch learning-rate scheduler per epoch or per batch."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

from .._checks import check_state_keys
from ..events import BatchEnd, EpochEnd, EstimatorView, StatefulHandler, TrainBegin
from ..events.monitor import check_monitor
from ..events.readings import epoch_learning_rates, learning_rate_names, optimizer_rates
from ..metrics.base import metric_name
from .gradient_update import GradientUpdateHandler

__all__ = ["LRSchedulerHandler", "epoch_learning_rates", "learning_rate_names"]


def _is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, ReduceLROnPlateau)


def _rates(optimizer: Any) -> list[float]:
    return optimizer_rates(optimizer)


def _rates_of(held: list[Any]) -> list[float]:
    return [float(rate) for rate in held]


def _held_rates(optimizer: Any) -> list[Any]:
    """The rates as they are now, without reading a tensor rate on the host (a per-step record:
    :func:`epoch_learning_rates` reads it once per epoch)."""
    return [group["lr"].clone() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            for group in optimizer.param_groups]


def _reset_plateau(scheduler: Any) -> None:
    """Start ``ReduceLROnPlateau``'s watch afresh (best value, patience and cooldown counters),
    as Keras does at every ``fit``; the learning rate itself is the optimizer's and stays."""
    scheduler.best = scheduler.mode_worse
    scheduler.num_bad_epochs = 0
    scheduler.cooldown_counter = 0
    scheduler.last_epoch = 0
    scheduler._last_lr = _rates(scheduler.optimizer)


def _describe_rates(before: list[float], after: list[float]) -> str:
    if len(after) == 1:
        return f"{before[0]:.6g} -> {after[0]:.6g}"
    return ", ".join(f"{name} {b:.6g} -> {a:.6g}" for name, b, a in zip(learning_rate_names(len(after)), before, after)
                     if b != a)


class LRSchedulerHandler(StatefulHandler, TrainBegin, BatchEnd, EpochEnd):
    """Step a learning-rate scheduler after every epoch (after validation) or after every
    optimizer step. ``ReduceLROnPlateau`` is stepped with ``monitor``'s value.

    With ``step_on="batch"`` the scheduler follows the optimizer: under gradient accumulation
    (``GradientUpdateHandler(accumulation_steps=k)``) it steps once per optimizer step (an
    epoch's leftover step included), not once per batch, so a schedule sized in optimizer steps
    (``OneCycleLR(total_steps=est.planned_steps(...))``) fits. ``Estimator(lr_scheduler=s,
    lr_scheduler_interval="batch")`` is the way to ask for it.

    When an epoch step changes a learning rate, a line says so after the epoch's line, e.g.
    ``[Epoch 5] Learning rate 0.1 -> 0.01 (ReduceLROnPlateau, val_loss 0.5321)``; per-batch
    steps are not logged one by one (``History`` and the epoch line show each epoch's rate, see
    :func:`epoch_learning_rates`).

    ``fit`` adds one for ``Estimator(lr_scheduler=...)``. The scheduler's state is saved: the
    estimator's own with the checkpoint, another one in this handler's state, and a resume
    continues it. A new ``fit`` continues a schedule where the last one left it (like the
    optimizer, its position is training state), but starts ``ReduceLROnPlateau``'s watch afresh:
    its best value, patience count and cooldown are reset (as Keras' ``ReduceLROnPlateau`` does),
    while the learning rate it reached stays the optimizer's.

    Args:
        scheduler: Defaults to the estimator's ``lr_scheduler``.
        step_on: ``"epoch"`` or ``"batch"``. Defaults to ``"epoch"``.
        monitor: the metric ``ReduceLROnPlateau`` watches: a metric's name (e.g. ``"val_loss"``,
            resolved at ``fit`` start) or the metric (e.g. ``est.val_metrics[0]``). Required
            for it, refused for other schedulers. Defaults to None.

    Example:
        >>> LRSchedulerHandler(step_on="batch").step_on
        'batch'
    """

    def __init__(self, scheduler: Any = None, *, step_on: str = "epoch", monitor: Any = None):
        if step_on not in ("epoch", "batch"):
            raise ValueError(f"step_on must be 'epoch' or 'batch', got {step_on!r}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must be a torch LR scheduler, got {scheduler!r}")
        self.monitor_name = check_monitor(monitor, "LRSchedulerHandler")
        if scheduler is not None:
            self._check_monitor(scheduler, monitor)
        self.scheduler = scheduler
        self.step_on = step_on
        self._updaters: list[Any] = []
        self.monitor = monitor
        self._scheduler: Any = scheduler
        #: (epoch index, rates) just before this handler's last epoch step, for epoch_rates
        self._before_step: Optional[tuple[int, list[Any]]] = None

    def listens_to(self, event: str) -> bool:
        """Only the events it steps on (per batch: also an epoch's leftover accumulation step)."""
        return event != "batch_end" or self.step_on == "batch"

    def stepped_schedule(self, estimator: EstimatorView) -> Optional[tuple[Any, str]]:
        """The scheduler it steps (its own, else the estimator's) and ``step_on``."""
        scheduler = self.scheduler if self.scheduler is not None else estimator.lr_scheduler
        return None if scheduler is None else (scheduler, self.step_on)

    def epoch_rates(self, epoch: int) -> Optional[list[float]]:
        """The rates epoch ``epoch`` trained with, when this handler stepped at its end (or after
        its last optimizer step): those just before that step."""
        if self._before_step is None or self._before_step[0] != epoch:
            return None
        return _rates_of(self._before_step[1])

    def resolve_monitor(self, metric: Any) -> None:
        """Watch ``metric``, the estimator's metric of the name given (at ``fit`` start)."""
        self.monitor = metric

    @staticmethod
    def _check_monitor(scheduler: Any, monitor: Any) -> None:
        if _is_plateau(scheduler) and monitor is None:
            raise ValueError("ReduceLROnPlateau needs monitor= (a metric, e.g. est.val_metrics[0])")
        if not _is_plateau(scheduler) and monitor is not None:
            raise ValueError(f"monitor= only applies to ReduceLROnPlateau, not {type(scheduler).__name__}")

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        scheduler = self.scheduler if self.scheduler is not None else estimator.lr_scheduler
        if scheduler is None and estimator.lr_scheduler_factory is not None:
            return  # built at fit start, after these checks
        if scheduler is None:
            raise ValueError("LRSchedulerHandler has no scheduler: pass one, or Estimator(lr_scheduler=...)")
        self._check_monitor(scheduler, self.monitor)

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._scheduler = self.scheduler if self.scheduler is not None else estimator.lr_scheduler
        self._updaters = [h for h in estimator.handlers if isinstance(h, GradientUpdateHandler)]
        self._before_step = None
        # A resume brings the watch back (this fit's resume is known here, or it is restored
        # after this: a CheckpointHandler later in train_begin, the handler states at the resume)
        if _is_plateau(self._scheduler) and not estimator.resume_pending:
            _reset_plateau(self._scheduler)

    def _step(self) -> Optional[float]:
        if self.monitor is not None:
            value = float(self.monitor.compute())
            self._scheduler.step(value)
            return value
        self._scheduler.step()
        return None

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Subscribed with ``step_on="batch"``: after each optimizer step."""
        if not self._updaters or any(u.stepped for u in self._updaters):
            self._step_after_batch(estimator)

    def _step_after_batch(self, estimator: EstimatorView) -> None:
        """Step, keeping the rates the step just trained with (what the epoch line shows)."""
        optimizer = getattr(self._scheduler, "optimizer", None)
        if optimizer is estimator.optimizer:
            self._before_step = (estimator.position.epoch, _held_rates(optimizer))
        self._step()

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """With ``step_on="epoch"``; with ``"batch"``, after an epoch's leftover accumulation step."""
        if self.step_on == "batch":
            if any(u.stepped for u in self._updaters):  # GradientUpdateHandler ran first (-2000)
                self._step_after_batch(estimator)
            return
        optimizer = getattr(self._scheduler, "optimizer", None)
        ours = optimizer is estimator.optimizer
        before = _rates(optimizer) if ours else []
        epoch = estimator.position.epoch
        if ours:
            self._before_step = (epoch, before)
        value = self._step()
        after = _rates(optimizer) if ours else []
        if before != after:  # said after the epoch's own line
            reason = type(self._scheduler).__name__
            if value is not None:
                reason += f", {metric_name(self.monitor)} {value:.6g}"
            message = f"[Epoch {epoch + 1}] Learning rate {_describe_rates(before, after)} ({reason})"
            estimator.at_boundary(lambda: estimator.logger.info(message))

    def state_dict(self) -> dict[str, Any]:
        own = self.scheduler is not None
        # the rates of the epoch's last step so far: a resume at an epoch's last batch shows them too
        trained = None if self._before_step is None else [self._before_step[0], _rates_of(self._before_step[1])]
        return {"scheduler": self.scheduler.state_dict() if own else None, "trained_rates": trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("scheduler",), self.name)
        trained = state.get("trained_rates")  # absent in a state saved by an older version
        self._before_step = None if trained is None else (int(trained[0]), [float(r) for r in trained[1]])
        if state["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
