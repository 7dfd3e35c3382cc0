"""What the loop's helpers read and call on the estimator beyond what a handler may
(:class:`~estimatorch.events.EstimatorView`): :class:`FitEstimator`, a ``Protocol`` that
:class:`~estimatorch.Estimator` satisfies (mypy checks it wherever ``fit`` passes ``self``).

Why a protocol and not the ``Estimator`` class: the helpers are modules the class imports, so
naming the class would need an import cycle under ``TYPE_CHECKING`` in each, and would let them
read anything of the class, its private state included. The protocol lists what they use,
nothing private: what one fit leaves to the next (the snapshot ``fit(resume=True)`` continues
from, the default optimizer ``fit`` warns about once) the class passes to them as arguments.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch
from torch import nn

from ..distributed import Watchdog
from ..events import EstimatorView
from .batch_processor import BatchProcessor, StepEstimator

__all__ = ["FitEstimator"]


class FitEstimator(EstimatorView, StepEstimator, Protocol):
    """The estimator as the loop's helpers (``estimator/``'s private modules) see it."""

    val_net: nn.Module
    val_loss: Optional[Callable[..., torch.Tensor]]  # None: the model computes its own loss
    batch_processor: BatchProcessor
    deterministic: bool
    cudnn_benchmark: bool
    #: ``"ddp"``, ``"fsdp"`` or None (``Estimator(strategy=)``)
    strategy: Optional[str]
    watchdog: Optional[Watchdog]
    #: steps between the ranks' stop-flag exchanges (None: the default)
    agree_every: Optional[int]
    #: optimizer steps between the replica checks (``Estimator(check_replicas_every=)``), None: off
    check_replicas_every: Optional[int]
    #: a callable ``lr_scheduler`` (``(optimizer, total_steps) -> scheduler``), built by the first fit
    lr_scheduler_factory: Optional[Callable[[torch.optim.Optimizer, int], object]]
    lr_scheduler_interval: str
