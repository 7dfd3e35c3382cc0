"""The estimator's one way into the data layer (:mod:`estimatorch.data`): the training stream of
a fit's ``train_data``, opened by ``fit`` and by ``Estimator.planned_steps`` alike."""

from __future__ import annotations

from typing import Any

from ...data import TrainStream, open_stream
from ...events import accumulation_steps, declared
from .._fit_estimator import FitEstimator

__all__ = ["open_train_stream"]


def open_train_stream(estimator: FitEstimator, train_data: Any, handlers: list[Any]) -> TrainStream:
    """The training stream of ``train_data`` for a fit with ``handlers``. Laid out in global
    optimizer steps when a handler asks for elastic checkpoints (``CheckpointHandler(...,
    elastic=True)``) or the estimator is ``world_size_invariant``, with the handlers'
    accumulation steps."""
    elastic = estimator.world_size_invariant or any(declared(h, "elastic_checkpoints") for h in handlers)
    return open_stream(train_data, estimator.seed, elastic_steps=accumulation_steps(handlers) if elastic else None,
                       device=estimator.device)
