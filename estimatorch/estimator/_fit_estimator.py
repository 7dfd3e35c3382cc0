"""What the loop's helpers read and call on the estimator beyond what a batch processor may
(:class:`~estimatorch.estimator.batch_processor.StepEstimator`, itself what a handler may,
:class:`~estimatorch.events.EstimatorView`, and the step's tools): :class:`FitEstimator`, a
``Protocol`` that :class:`~estimatorch.Estimator` satisfies (mypy checks it wherever ``fit``
passes ``self``). It holds the settings that no contract of users' code names.

Why a protocol and not the ``Estimator`` class: the helpers are modules the class imports, so
naming the class would need an import cycle under ``TYPE_CHECKING`` in each, and would let them
read anything of the class, its private state included. The protocol lists what they use,
nothing private: what one fit leaves to the next (the snapshot ``fit(resume=True)`` continues
from, the default optimizer ``fit`` warns about once) the class passes to them as arguments.
"""

from __future__ import annotations

from typing import Optional, Protocol

from ..distributed import Watchdog
from .batch_processor import BatchProcessor, StepEstimator

__all__ = ["FitEstimator"]


class FitEstimator(StepEstimator, Protocol):
    """The estimator as the loop's helpers (``estimator/``'s private modules) see it."""

    batch_processor: BatchProcessor
    deterministic: bool
    cudnn_benchmark: bool
    watchdog: Optional[Watchdog]
    #: steps between the ranks' stop-flag exchanges (None: the default)
    agree_every: Optional[int]
    #: optimizer steps between the replica checks (``Estimator(check_replicas_every=)``), None: off
    check_replicas_every: Optional[int]
    lr_scheduler_interval: str
