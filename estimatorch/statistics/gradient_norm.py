"""GradientNorm: the 2-norm of each parameter's gradient (instantaneous, callback-free)."""

from __future__ import annotations

from typing import Any

import torch

from ..events import EstimatorView
from .base import ParameterStatistic

__all__ = ["GradientNorm"]


class GradientNorm(ParameterStatistic):
    """``||dL/dW||`` of each parameter right after backward (before the optimizer step and any
    clipping), as ``gradient_norm/<parameter>``, and their total as ``gradient_norm/total``.

    Parameters without a gradient are left out.

    Args:
        params: parameter names (as in ``net.named_parameters()``). Defaults to every
            trainable parameter.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to ``"gradient_norm"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Est: net = nn.Linear(2, 1, bias=False)
        >>> Est.net.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> s = GradientNorm(period=1)
        >>> s.setup(Est()); s.backward_end(Est())
        >>> {k: float(v) for k, v in s.scalars().items()}
        {'weight': 5.0, 'total': 5.0}
    """

    default_name = "gradient_norm"
    events = frozenset({"backward_end"})

    def backward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        norms = {n: torch.linalg.vector_norm(p.grad.detach()) for n, p in self._params if p.grad is not None}
        if norms:
            norms["total"] = torch.linalg.vector_norm(torch.stack([v.float() for v in norms.values()]))
        self._values = norms
