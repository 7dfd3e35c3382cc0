"""LRSchedulerHandler: step a torch learning-rate scheduler per epoch or per batch."""

from __future__ import annotations

from typing import Any

from ..metrics.base import is_metric
from ._base import StatefulHandler, check_state_keys
from ._subscribe import with_events
from .mixins import TrainBegin

__all__ = ["LRSchedulerHandler"]


def _is_plateau(scheduler: Any) -> bool:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    return isinstance(scheduler, ReduceLROnPlateau)


class LRSchedulerHandler(StatefulHandler, TrainBegin):
    """Step a learning-rate scheduler after every epoch (after validation) or after every
    optimizer step. ``ReduceLROnPlateau`` is stepped with ``monitor``'s value.

    With ``step_on="batch"`` the scheduler follows the optimizer: under gradient accumulation
    (``GradientUpdateHandler(accumulation_steps=k)``) it steps once per optimizer step, not once
    per batch, so a schedule sized in optimizer steps (``OneCycleLR(total_steps=...)``) fits.

    ``fit`` adds one for ``Estimator(lr_scheduler=...)``. The scheduler's state is saved: the
    estimator's own with the checkpoint, another one in this handler's state.

    Args:
        scheduler: Defaults to the estimator's ``lr_scheduler``.
        step_on: ``"epoch"`` or ``"batch"``. Defaults to ``"epoch"``.
        monitor: the metric ``ReduceLROnPlateau`` watches (e.g. ``est.val_metrics[0]``).
            Required for it, refused for other schedulers. Defaults to None.

    Example:
        >>> LRSchedulerHandler(step_on="batch").step_on
        'batch'
    """

    def __new__(cls, scheduler: Any = None, *, step_on: str = "epoch", monitor: Any = None) -> "LRSchedulerHandler":
        # called only on the event it steps on (an unknown step_on is refused by __init__)
        return super().__new__(with_events(cls, ["batch_end" if step_on == "batch" else "epoch_end"]))

    def __init__(self, scheduler: Any = None, *, step_on: str = "epoch", monitor: Any = None):
        if step_on not in ("epoch", "batch"):
            raise ValueError(f"step_on must be 'epoch' or 'batch', got {step_on!r}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must be a torch LR scheduler, got {scheduler!r}")
        if monitor is not None and not is_metric(monitor):
            raise TypeError(f"monitor must be a metric the estimator owns, got {monitor!r}")
        if scheduler is not None:
            self._check_monitor(scheduler, monitor)
        self.scheduler = scheduler
        self.step_on = step_on
        self._updaters: list[Any] = []
        self.monitor = monitor
        self._scheduler: Any = scheduler

    @staticmethod
    def _check_monitor(scheduler: Any, monitor: Any) -> None:
        if _is_plateau(scheduler) and monitor is None:
            raise ValueError("ReduceLROnPlateau needs monitor= (a metric, e.g. est.val_metrics[0])")
        if not _is_plateau(scheduler) and monitor is not None:
            raise ValueError(f"monitor= only applies to ReduceLROnPlateau, not {type(scheduler).__name__}")

    def _check_fit(self, estimator: Any, resume: bool) -> None:
        scheduler = self.scheduler if self.scheduler is not None else estimator.lr_scheduler
        if scheduler is None:
            raise ValueError("LRSchedulerHandler has no scheduler: pass one, or Estimator(lr_scheduler=...)")
        self._check_monitor(scheduler, self.monitor)

    def train_begin(self, estimator: Any, **kwargs: Any) -> None:
        from .gradient_update import GradientUpdateHandler

        self._scheduler = self.scheduler if self.scheduler is not None else estimator.lr_scheduler
        self._updaters = [h for h in estimator.handlers if isinstance(h, GradientUpdateHandler)]

    def _step(self) -> None:
        if self.monitor is not None:
            self._scheduler.step(float(self.monitor.compute()))
        else:
            self._scheduler.step()

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        """Subscribed with ``step_on="batch"``: after each optimizer step."""
        if not self._updaters or any(u.stepped for u in self._updaters):
            self._step()

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        """Subscribed with ``step_on="epoch"``."""
        self._step()

    def state_dict(self) -> dict[str, Any]:
        own = self.scheduler is not None
        return {"scheduler": self.scheduler.state_dict() if own else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("scheduler",), self.name)
        if state["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
