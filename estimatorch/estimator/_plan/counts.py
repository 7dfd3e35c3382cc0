"""How many batches and optimizer steps a fit will take, known before it starts.

``Estimator.planned_steps`` and a callable ``lr_scheduler`` (``(optimizer, total_steps) ->
scheduler``) both read :func:`plan_counts`; ``fit`` checks every per-batch (and per-epoch)
schedule it steps against the plan (:mod:`.schedules`).

What a step is: an optimizer step of this process. ``GradientUpdateHandler(accumulation_steps=k)``
steps once per ``k`` batches and once more for an epoch's leftover; the data is this process's
share (a DataLoader is sharded over the processes of ``torchrun``, known from its environment
before the process group exists); ``fit(batches_per_epoch=...)`` caps each epoch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, Optional

from ..._checks import check_positive_int
from ...events import accumulation_steps, check_handlers, declared
from .._fit_estimator import FitEstimator
from .._setup.train_stream import open_train_stream

__all__ = ["PlanCounts", "count_epoch_ends", "count_steps", "limited", "plan_counts", "planned_steps"]


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
        max_epoch, max_batch = declared(handler, "stop_limits")()
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


def limited(batches: Iterator[Any], start: int, limit: Optional[int]) -> Iterator[Any]:
    """An epoch's batches from batch ``start`` on, up to ``fit(batches_per_epoch=limit)``."""
    if limit is None:
        return batches
    return itertools.islice(batches, max(limit - start, 0))


def planned_steps(estimator: FitEstimator, train_data: Any, epochs: Optional[int], batches: Optional[int],
                  batches_per_epoch: Optional[int], event_handlers: Any) -> int:
    """``Estimator.planned_steps``: the data wrapped as ``fit`` wraps it (this process's share),
    counted with the handlers given (``fit``'s defaults accumulate nothing and stop at the plan)."""
    if (epochs is None) == (batches is None):
        raise ValueError(f"pass exactly one of epochs and batches, got epochs={epochs!r} and batches={batches!r}")
    check_positive_int(epochs, "epochs", allow_none=True)
    check_positive_int(batches, "batches", allow_none=True)
    check_positive_int(batches_per_epoch, "batches_per_epoch", allow_none=True)
    handlers = check_handlers(event_handlers)
    stream = open_train_stream(estimator, train_data, handlers)
    try:
        return plan_counts(stream.batches_per_epoch, handlers, epochs, batches, batches_per_epoch).steps()
    finally:
        stream.close()
