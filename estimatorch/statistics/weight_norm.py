"""WeightNorm: the 2-norm of each parameter (instantaneous, callback-free)."""

from __future__ import annotations

from typing import Any

import torch

from ..events import EstimatorView
from .base import ParameterStatistic

__all__ = ["WeightNorm"]


class WeightNorm(ParameterStatistic):
    """``||W||`` of each parameter after the optimizer step, as ``weight_norm/<parameter>``.

    Args:
        params: parameter names (as in ``net.named_parameters()``). Defaults to every
            trainable parameter.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to ``"weight_norm"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Est: net = nn.Linear(3, 1, bias=False)
        >>> _ = nn.init.constant_(Est.net.weight, 2.0)
        >>> s = WeightNorm(period=1)
        >>> s.setup(Est()); s.batch_end(Est())
        >>> round(float(s.scalars()["weight"]), 4)  # sqrt(3 * 2**2)
        3.4641
    """

    default_name = "weight_norm"

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._values = {n: torch.linalg.vector_norm(p.detach()) for n, p in self._params}
