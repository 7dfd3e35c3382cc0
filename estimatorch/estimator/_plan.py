"""How many optimizer steps a fit will take, known before it starts, and whether a learning-rate
schedule's own horizon agrees with that plan.

``Estimator.planned_steps`` and a callable ``lr_scheduler`` (``(optimizer, total_steps) ->
scheduler``) both read :func:`plan_counts`; ``fit`` checks every per-batch (and per-epoch)
schedule it steps against the plan once the resume (if any) is known (:func:`check_horizons`).

What a step is: an optimizer step of this process. ``GradientUpdateHandler(accumulation_steps=k)``
steps once per ``k`` batches and once more for an epoch's leftover; the data is this process's
share (a DataLoader is sharded over the processes of ``torchrun``, known from its environment
before the process group exists); ``fit(batches_per_epoch=...)`` caps each epoch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from typing import Any, Optional

from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    OneCycleLR,
    SequentialLR,
)

from .._checks import check_positive_int, warn_user
from ..data import configure_elastic, make_train_stream
from ..event_handlers import LRSchedulerHandler
from ..events import accumulation_steps, check_handlers

__all__ = ["PlanCounts", "build_scheduler", "check_horizons", "count_epoch_ends", "count_steps", "limited",
           "plan_counts", "planned_steps", "schedule_length", "scheduler_horizon"]


class PlanCounts:
    """What a fit's plan amounts to for this process.

    Attributes:
        per_epoch: batches an epoch trains (the data's, capped by ``batches_per_epoch``), None
            when the data has no length.
        accumulation: batches per optimizer step.
        epochs / batches: the plan, tightened by a ``StoppingHandler``'s own limits.
    """

    def __init__(self, per_epoch: Optional[int], accumulation: int, epochs: Optional[int],
                 batches: Optional[int]):
        self.per_epoch = per_epoch
        self.accumulation = accumulation
        self.epochs = epochs
        self.batches = batches

    def steps(self, epoch: int = 0, batch: int = 0, done: int = 0) -> int:
        """Optimizer steps from a position (``epoch`` index, ``batch`` in it, ``done`` batches
        in all) to the plan's end."""
        return count_steps(self.per_epoch, self.accumulation, self.epochs, self.batches,
                           epoch=epoch, batch=batch, done=done)

    def epoch_ends(self, epoch: int = 0, done: int = 0) -> int:
        """``epoch_end`` events from a position to the plan's end (per-epoch schedule steps)."""
        return count_epoch_ends(self.per_epoch, self.epochs, self.batches, epoch=epoch, done=done)


def _tighter(own: Optional[int], plan: Optional[int]) -> Optional[int]:
    if own is None:
        return plan
    return own if plan is None else min(own, plan)


def plan_counts(per_epoch: Optional[int], handlers: list[Any], epochs: Optional[int], batches: Optional[int],
                batches_per_epoch: Optional[int]) -> PlanCounts:
    """The plan of a fit over data of ``per_epoch`` batches with ``handlers`` (its
    ``accumulation_steps``, their ``stop_limits``)."""
    if batches_per_epoch is not None:
        per_epoch = batches_per_epoch if per_epoch is None else min(per_epoch, batches_per_epoch)
    accumulation = accumulation_steps(handlers)
    for handler in handlers:
        limits = getattr(handler, "stop_limits", None)
        if callable(limits):
            max_epoch, max_batch = limits()
            epochs, batches = _tighter(max_epoch, epochs), _tighter(max_batch, batches)
    return PlanCounts(per_epoch, accumulation, epochs, batches)


def count_steps(per_epoch: Optional[int], accumulation: int, epochs: Optional[int], batches: Optional[int], *,
                epoch: int = 0, batch: int = 0, done: int = 0) -> int:
    """Optimizer steps from a position to the end of a plan of ``epochs`` epochs and/or
    ``batches`` batches in all, with epochs of ``per_epoch`` batches and a step every
    ``accumulation`` batches (plus one for an epoch's leftover).

    Raises:
        ValueError: ``per_epoch`` unknown where the count needs it.

    Example:
        >>> count_steps(10, 1, 3, None), count_steps(10, 4, 2, None), count_steps(10, 1, None, 25)
        (30, 6, 25)
        >>> count_steps(10, 1, 3, None, epoch=1, batch=4, done=14)
        16
    """
    if per_epoch is None:
        if epochs is None and batches is not None and accumulation == 1:
            return max(batches - done, 0)
        raise ValueError("train_data has no length, so the batches of an epoch are unknown: pass "
                         "batches_per_epoch= (or batches= without gradient accumulation)")
    steps = 0
    while (epochs is None or epoch < epochs) and (batches is None or done < batches):
        n = per_epoch - batch
        if batches is not None:
            n = min(n, batches - done)
        if n > 0:
            steps += math.ceil((batch + n) / accumulation) - batch // accumulation
            done += n
        epoch, batch = epoch + 1, 0
        if per_epoch == 0:  # epochs without batches: nothing ever trains
            break
    return steps


def count_epoch_ends(per_epoch: Optional[int], epochs: Optional[int], batches: Optional[int], *,
                     epoch: int = 0, done: int = 0) -> int:
    """``epoch_end`` events from a position to the end of the plan.

    Example:
        >>> count_epoch_ends(10, 3, None), count_epoch_ends(10, None, 25), count_epoch_ends(10, 3, None, epoch=1)
        (3, 3, 2)
    """
    if epochs is not None and batches is None:
        return max(epochs - epoch, 0)
    if per_epoch is None:
        raise ValueError("train_data has no length, so the epochs of a batches= plan are unknown: "
                         "pass batches_per_epoch=")
    assert batches is not None  # one of the two is set
    left = max(math.ceil(max(batches - done, 0) / per_epoch), 0)
    return left if epochs is None else min(left, max(epochs - epoch, 0))


def scheduler_horizon(scheduler: Any) -> Optional[int]:
    """The number of steps after which ``scheduler`` has reached its end: ``T_max`` of
    ``CosineAnnealingLR``, ``total_steps`` of ``OneCycleLR``, ``total_iters`` of ``LinearLR``,
    the last milestone plus its last scheduler's for a ``SequentialLR``; None for others.

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
    return None


def _stepped_schedules(estimator: Any, handlers: list[Any]) -> list[tuple[Any, str]]:
    """``(scheduler, "batch" | "epoch")`` for every schedule a handler of the fit steps."""
    found = []
    for handler in handlers:
        if isinstance(handler, LRSchedulerHandler):
            scheduler = handler.scheduler if handler.scheduler is not None else estimator.lr_scheduler
            if scheduler is not None:
                found.append((scheduler, handler.step_on))
    return found


def check_horizons(estimator: Any, run: Any) -> None:
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
        warn_user(message)


def _past_the_end(scheduler: Any) -> str:
    """What a schedule does when it is stepped past its horizon, in words."""
    last = scheduler._schedulers[-1] if isinstance(scheduler, SequentialLR) else scheduler
    if isinstance(last, CosineAnnealingLR):
        return "past its end a cosine raises the learning rate again"
    if isinstance(last, OneCycleLR):
        return "OneCycleLR raises a ValueError once stepped past its total_steps"
    return "the steps past its end keep its last learning rate"


def schedule_length(estimator: Any, counts: PlanCounts) -> Optional[int]:
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


def build_scheduler(estimator: Any, run: Any) -> None:
    """Call ``Estimator(lr_scheduler=callable)`` with the optimizer and the steps the schedule
    will take in this fit's whole plan, once (a later fit continues that scheduler)."""
    total = schedule_length(estimator, run.counts)
    if total is None:
        return
    scheduler = estimator.lr_scheduler_factory(estimator.optimizer, total)
    if not all(callable(getattr(scheduler, method, None)) for method in ("step", "state_dict")) \
            or getattr(scheduler, "optimizer", None) is not estimator.optimizer:
        raise TypeError(f"lr_scheduler(optimizer, total_steps) must return a torch LR scheduler of that optimizer, "
                        f"got {scheduler!r}")
    estimator.lr_scheduler = scheduler


def limited(batches: Iterator[Any], start: int, limit: Optional[int]) -> Iterator[Any]:
    """An epoch's batches from batch ``start`` on, up to ``fit(batches_per_epoch=limit)``."""
    if limit is None:
        return batches
    return itertools.islice(batches, max(limit - start, 0))


def planned_steps(estimator: Any, train_data: Any, epochs: Optional[int], batches: Optional[int],
                  batches_per_epoch: Optional[int], event_handlers: Any) -> int:
    """``Estimator.planned_steps``: the data wrapped as ``fit`` wraps it (this process's share),
    counted with the handlers given (``fit``'s defaults accumulate nothing and stop at the plan)."""
    if (epochs is None) == (batches is None):
        raise ValueError(f"pass exactly one of epochs and batches, got epochs={epochs!r} and batches={batches!r}")
    check_positive_int(epochs, "epochs", allow_none=True)
    check_positive_int(batches, "batches", allow_none=True)
    check_positive_int(batches_per_epoch, "batches_per_epoch", allow_none=True)
    handlers = check_handlers(event_handlers)
    stream = make_train_stream(train_data, estimator.seed)
    try:
        configure_elastic(stream, handlers, estimator.device)
        return plan_counts(stream.batches_per_epoch, handlers, epochs, batches, batches_per_epoch).steps()
    finally:
        stream.close()
