"""The handlers ``fit`` adds to the user's (the default set, which only this package knows of):
``Estimator.fit`` calls :func:`default_handlers` with what it knows of the estimator."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional

from .gradient_update import GradientUpdateHandler
from .logging_handler import LoggingHandler
from .lr_scheduler import LRSchedulerHandler
from .metric import MetricHandler
from .progress_bar import ProgressBarHandler
from .stopping import StoppingHandler
from .validation import ValidationHandler

__all__ = ["default_handlers"]


def default_handlers(user: list[Any], *, train_metrics: list[Any], evaluate: Callable[..., Any],
                     val_data: Optional[Iterable[Any]], lr_scheduler: Any, scheduled: bool,
                     lr_scheduler_interval: str, progress_bar: bool) -> list[Any]:
    """Each default whose type none of ``user`` has: ``StoppingHandler``,
    ``GradientUpdateHandler``, ``MetricHandler(train_metrics)``, ``ValidationHandler(val_data,
    evaluate)`` with ``val_data``, an ``LRSchedulerHandler`` when the estimator has a schedule
    (``scheduled``) none of ``user`` steps, ``LoggingHandler``, and ``ProgressBarHandler`` when
    ``progress_bar``."""
    def missing(cls: type) -> bool:
        return not any(isinstance(h, cls) for h in user)

    defaults: list[Any] = []
    if missing(StoppingHandler):
        defaults.append(StoppingHandler())
    if missing(GradientUpdateHandler):
        defaults.append(GradientUpdateHandler())
    if missing(MetricHandler):
        defaults.append(MetricHandler(train_metrics))
    if val_data is not None and missing(ValidationHandler):
        defaults.append(ValidationHandler(val_data, evaluate))
    if scheduled and not any(
            isinstance(h, LRSchedulerHandler) and h.scheduler in (None, lr_scheduler) for h in user):
        # unless one of yours already steps it
        defaults.append(LRSchedulerHandler(step_on=lr_scheduler_interval))
    if missing(LoggingHandler):
        defaults.append(LoggingHandler())
    if missing(ProgressBarHandler) and progress_bar:
        defaults.append(ProgressBarHandler())
    return defaults
