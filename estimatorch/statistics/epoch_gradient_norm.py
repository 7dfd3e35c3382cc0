"""EpochGradientNorm: mean and max of the total gradient norm over an epoch (running)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._checks import check_state_keys
from ..events import EstimatorView
from .base import RunningStatistic, Value, check_names, select_parameters

__all__ = ["EpochGradientNorm"]


class EpochGradientNorm(RunningStatistic):
    """The total gradient 2-norm of every step, accumulated on the device over the epoch and
    written at its end as ``epoch/epoch_gradient_norm/mean`` and ``.../max``.

    Watches for exploding or vanishing gradients at the cost of one norm per step and no host
    sync. The accumulators (sum, max, count) are the state, so a resumed epoch continues them.

    Args:
        params: parameter names. Defaults to every trainable parameter.
        name: Defaults to ``"epoch_gradient_norm"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Est: net = nn.Linear(2, 1, bias=False)
        >>> s = EpochGradientNorm()
        >>> s.setup(Est())
        >>> for g in ([3.0, 4.0], [6.0, 8.0]):
        ...     Est.net.weight.grad = torch.tensor([g])
        ...     s.backward_end(Est())
        >>> {k: float(v) for k, v in s.scalars().items()}
        {'mean': 7.5, 'max': 10.0}
    """

    default_name = "epoch_gradient_norm"
    events = frozenset({"backward_end"})

    def __init__(self, params: Optional[list[str]] = None, *, name: Optional[str] = None):
        super().__init__(name)
        self.params = check_names(params, "params")

    def setup(self, estimator: EstimatorView) -> None:
        self._params = select_parameters(estimator.net, self.params, type(self).__name__)
        super().setup(estimator)

    def reset(self) -> None:
        self.total: Optional[torch.Tensor] = None
        self.max: Optional[torch.Tensor] = None
        self.count = 0

    def backward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        grads = [p.grad.detach() for _, p in self._params if p.grad is not None]
        if not grads:
            return
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
        if self.total is None or self.max is None:  # set together
            self.total, self.max = norm.clone(), norm.clone()
        else:
            self.total.add_(norm)
            torch.maximum(self.max, norm, out=self.max)
        self.count += 1

    def scalars(self) -> dict[str, Value]:
        if self.total is None or self.max is None:
            return {"mean": float("nan"), "max": float("nan")}
        return {"mean": self.total / self.count, "max": self.max}

    def state_dict(self) -> dict[str, Any]:
        return {"total": _clone(self.total), "max": _clone(self.max), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("total", "max", "count"), f"statistic {self.name!r}")
        device = self._params[0][1].device if getattr(self, "_params", None) else None
        self.total, self.max = _clone(state["total"], device), _clone(state["max"], device)
        self.count = int(state["count"])


def _clone(value: Any, device: Any = None) -> Any:
    """A detached copy of a saved tensor (on ``device`` when given); None stays None."""
    if value is None:
        return None
    return torch.as_tensor(value).detach().to(device).clone()
