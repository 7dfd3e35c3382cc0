"""UpdateToWeightRatio: ``||dW|| / ||W||`` of each parameter (instantaneous, callback-free)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..events import EstimatorView
from .base import ParameterStatistic, Value

__all__ = ["UpdateToWeightRatio"]


class UpdateToWeightRatio(ParameterStatistic):
    """How much the optimizer step moved each parameter relative to its size:
    ``||W_after - W_before|| / ||W_before||``, as ``update_ratio/<parameter>``.

    On a firing step the parameters are copied (on their device) at ``batch_begin`` and
    compared after the optimizer step. Around 1e-3 is the usual healthy order of magnitude;
    0 on steps where gradient accumulation skips the optimizer.

    Args:
        params: parameter names (as in ``net.named_parameters()``). Defaults to every
            trainable parameter.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to ``"update_ratio"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Est: net = nn.Linear(1, 1, bias=False)
        >>> _ = nn.init.constant_(Est.net.weight, 4.0)
        >>> s = UpdateToWeightRatio(period=1)
        >>> s.setup(Est()); s.batch_begin(Est())
        >>> with torch.no_grad():
        ...     _ = Est.net.weight.sub_(1.0)  # the optimizer step
        >>> s.batch_end(Est()); float(s.scalars()["weight"])
        0.25
    """

    default_name = "update_ratio"
    events = frozenset({"batch_begin"})

    def reset(self) -> None:
        super().reset()
        self._before: Optional[list[torch.Tensor]] = None

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._before = [p.detach().clone() for _, p in self._params]

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._before is None:  # resumed between this step's batch_begin and batch_end
            return
        values: dict[str, Value] = {}
        for (name, param), before in zip(self._params, self._before):
            values[name] = torch.linalg.vector_norm(param.detach() - before) / torch.linalg.vector_norm(before)
        self._values, self._before = values, None
