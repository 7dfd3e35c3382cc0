"""How a fit weighs its micro-batches (the items rule): the :class:`~estimatorch.distributed.StepItems`
of a fit whose optimizer steps span several micro-batches, and the count of a batch processor
that passes none to ``backward`` (its batch's samples).

One micro-batch per step (one process, no accumulation) needs nothing: its loss is the step's,
the mean over its items already, so the default fit's step is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ... import distributed
from ..._batches import batch_size_of
from ...data import TrainStream
from ...events import accumulation_steps
from .._fit_estimator import FitEstimator
from ..batch_processor import BatchProcessor

__all__ = ["counting_step", "step_items"]


def step_items(estimator: FitEstimator, handlers: list[Any], stream: TrainStream) -> Optional[distributed.StepItems]:
    """The items of the fit's optimizer steps, or None when a step is one micro-batch."""
    world, k = distributed.get_world_size(), accumulation_steps(handlers)
    invariant = estimator.world_size_invariant
    if world * k == 1 and not invariant:
        return None
    layout = stream.layout
    unit = layout.batch_size if layout is not None else stream.batch_size
    # a distributed sampler gives every rank as many samples (padded), so every rank's batch i
    # holds as many; an elastic layout knows the samples of each step; anything else is counted
    agree = world == 1 or (layout is None and stream.even_shares)
    return distributed.StepItems(world, unit, agree, leaves=invariant, accumulation_steps=k,
                                 step_total=layout.step_samples if layout is not None else None)


def counting_step(fit_batch: Callable[..., Any], processor: Any,
                  items: Optional[distributed.StepItems]) -> Callable[..., Any]:
    """``fit_batch`` of a processor of the user's, where steps weigh their items: each batch's
    samples are the count its ``estimator.backward(loss)`` uses when it passes none
    (``BatchProcessor`` passes its own). Else ``fit_batch`` itself."""
    if items is None or type(processor).fit_batch is BatchProcessor.fit_batch:
        return fit_batch

    def fit_counted(estimator: FitEstimator, batch: Any, batch_axis: int) -> Any:
        items.default = batch_size_of(batch, batch_axis)
        return fit_batch(estimator, batch, batch_axis)

    return fit_counted
