"""The learning-rate schedules of a fit's plan: a schedule's own horizon (where it ends), checked
against the plan once the resume is known (:func:`check_horizons`), and a callable ``lr_scheduler``
built with the steps the plan takes (:func:`build_scheduler`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LambdaLR,
    LinearLR,
    OneCycleLR,
    SequentialLR,
)

from ..._checks import is_int, warn_user
from ...events import Handler
from .._fit_estimator import FitEstimator
from .._state.run import Run
from .counts import PlanCounts

__all__ = ["build_scheduler", "check_horizons", "schedule_length", "scheduler_horizon"]


def scheduler_horizon(scheduler: Any) -> Optional[int]:
    """The number of steps after which ``scheduler`` has reached its end: ``T_max`` of
    ``CosineAnnealingLR``, ``total_steps`` of ``OneCycleLR``, ``total_iters`` of ``LinearLR``,
    the last milestone plus its last scheduler's for a ``SequentialLR``, ``num_training_steps``
    of a ``LambdaLR`` whose functions are partials naming it (``transformers``'
    ``get_*_schedule_with_warmup``); None for others.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> warmup = torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=10)
        >>> cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=90)
        >>> scheduler_horizon(torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[10]))
        100
    """
    if isinstance(scheduler, CosineAnnealingLR):
        return int(scheduler.T_max)
    if isinstance(scheduler, OneCycleLR):
        return int(scheduler.total_steps)
    if isinstance(scheduler, LinearLR):
        return int(scheduler.total_iters)
    if isinstance(scheduler, SequentialLR):
        last = scheduler_horizon(scheduler._schedulers[-1])
        return None if last is None else int(scheduler._milestones[-1]) + last
    if isinstance(scheduler, LambdaLR):  # transformers' get_*_schedule_with_warmup: a partial naming its length
        lengths = {getattr(f, "keywords", {}).get("num_training_steps") for f in scheduler.lr_lambdas}
        if len(lengths) == 1 and is_int(next(iter(lengths))):
            return int(next(iter(lengths)))  # type: ignore[arg-type]
    return None


def _stepped_schedules(estimator: FitEstimator, handlers: list[Any]) -> list[tuple[Any, str]]:
    """``(scheduler, "batch" | "epoch")`` for every schedule a handler of the fit steps, as each
    declares it (:meth:`~estimatorch.events.Handler.stepped_schedule`)."""
    found = []
    for handler in handlers:
        schedule = handler.stepped_schedule(estimator) if isinstance(handler, Handler) else None
        if schedule is not None:
            found.append(schedule)
    return found


def check_horizons(estimator: FitEstimator, run: Run) -> None:
    """Warn when a schedule the fit steps ends before or after its plan does (both numbers
    said); a resumed run extended past the end of its restored schedule gets its own warning.
    Called once ``train_begin`` has restored a checkpoint (if any)."""
    pending = run.pending
    position = pending["position"] if pending is not None else dataclasses.asdict(run.pos)
    resumed = pending is not None
    for scheduler, interval in _stepped_schedules(estimator, list(run.dispatch.handlers)):
        horizon = scheduler_horizon(scheduler)
        if horizon is None:
            continue
        epoch, done = position["epoch"], position["step"]
        batch = position["batch"] if position["phase"] == "batch_end" else 0
        try:
            left = run.counts.steps(epoch, batch, done) if interval == "batch" else run.counts.epoch_ends(epoch, done)
        except ValueError:
            continue  # data of unknown length: nothing to compare with
        ends_at = int(scheduler.last_epoch) + left
        if ends_at == horizon or (resumed and left == 0):
            continue
        name = type(scheduler).__name__
        unit = "optimizer steps" if interval == "batch" else "epochs"
        if resumed and ends_at > horizon:
            message = (f"this fit continues a run whose {name} ends after {horizon} {unit}, but the new plan runs "
                       f"to {ends_at}: {_past_the_end(scheduler)}. To train further, "
                       "start a new run with a schedule sized for it (Estimator(lr_scheduler=lambda optimizer, "
                       "total_steps: ...) sizes it from the plan), or keep the plan the run finished")
        else:
            what = "planned_steps" if interval == "batch" else "the epochs planned"
            message = (f"{name} is stepped every {interval} and ends after {horizon} {unit}, but this fit's plan "
                       f"takes {ends_at} ({what}: every process's share of the data, gradient accumulation and "
                       "batches_per_epoch counted): size it with est.planned_steps(train_data, epochs=...), or "
                       "pass Estimator(lr_scheduler=lambda optimizer, total_steps: ...) to have fit size it")
            if interval == "epoch" and horizon > ends_at:
                message += (". A schedule counted in optimizer steps (a warm-up) is stepped per epoch here: pass "
                            "Estimator(..., lr_scheduler_interval='batch') to step it after every optimizer step")
        warn_user(message)


def _past_the_end(scheduler: Any) -> str:
    """What a schedule does when it is stepped past its horizon, in words."""
    last = scheduler._schedulers[-1] if isinstance(scheduler, SequentialLR) else scheduler
    if isinstance(last, CosineAnnealingLR):
        return "past its end a cosine raises the learning rate again"
    if isinstance(last, OneCycleLR):
        return "OneCycleLR raises a ValueError once stepped past its total_steps"
    return "the steps past its end keep its last learning rate"


def schedule_length(estimator: FitEstimator, counts: PlanCounts) -> Optional[int]:
    """The steps a schedule built from ``Estimator(lr_scheduler=callable)`` will take in this
    fit's whole plan (None when there is nothing to build). ``fit`` calls it before any work.

    Raises:
        ValueError: the plan cannot be counted (data without a length), saying what to pass.
    """
    if estimator.lr_scheduler_factory is None or estimator.lr_scheduler is not None:
        return None
    try:
        return counts.steps() if estimator.lr_scheduler_interval == "batch" else counts.epoch_ends()
    except ValueError as err:
        raise ValueError(f"lr_scheduler is a callable sized from the plan, but {err}") from None


def build_scheduler(estimator: FitEstimator, run: Run) -> None:
    """Call ``Estimator(lr_scheduler=callable)`` with the optimizer and the steps the schedule
    will take in this fit's whole plan, once (a later fit continues that scheduler)."""
    total = schedule_length(estimator, run.counts)
    factory = estimator.lr_scheduler_factory
    if total is None or factory is None:  # (schedule_length is None without a factory)
        return
    scheduler = factory(estimator.optimizer, total)
    if not all(callable(getattr(scheduler, method, None)) for method in ("step", "state_dict")) \
            or getattr(scheduler, "optimizer", None) is not estimator.optimizer:
        raise TypeError(f"lr_scheduler(optimizer, total_steps) must return a torch LR scheduler of that optimizer, "
                        f"got {scheduler!r}")
    estimator.lr_scheduler = scheduler
