"""LearningRate: each param group's learning rate (instantaneous, callback-free)."""

from __future__ import annotations

from typing import Any

import torch

from ..events import EstimatorView
from .base import InstantaneousStatistic, Value

__all__ = ["LearningRate"]


class LearningRate(InstantaneousStatistic):
    """The learning rate of each of the optimizer's param groups, as ``lr/group<i>``.

    Read at the firing step's ``batch_end``: the rate that step used (the meter runs before the
    handlers at priority 0, such as a per-batch LR scheduler).

    Args:
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to ``"lr"``.

    Example:
        >>> import torch
        >>> class Est:
        ...     optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        >>> s = LearningRate(period=1)
        >>> s.setup(Est()); s.batch_end(Est()); s.scalars()
        {'group0': 0.5}
    """

    default_name = "lr"

    def setup(self, estimator: EstimatorView) -> None:
        self._optimizer = estimator.optimizer
        super().setup(estimator)

    def reset(self) -> None:
        self._values: dict[str, Value] = {}

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        values: dict[str, Value] = {}
        for i, group in enumerate(self._optimizer.param_groups):
            lr = group["lr"]
            values[f"group{i}"] = lr.detach() if isinstance(lr, torch.Tensor) else float(lr)
        self._values = values

    def scalars(self) -> dict[str, Value]:
        return dict(self._values)
