"""Regression metrics: :class:`MeanSquaredError` and :class:`MeanAbsoluteError`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .base import Metric, _ratio

__all__ = ["MeanAbsoluteError", "MeanSquaredError"]


def _aligned(name: str, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``preds`` in the target's shape; only size-1 dimensions may differ ((N, 1) vs (N,))."""
    preds = preds.detach()
    if preds.shape == target.shape:
        return preds
    if [d for d in preds.shape if d != 1] == [d for d in target.shape if d != 1]:
        return preds.reshape(target.shape)
    raise ValueError(
        f"{name}: preds of shape {tuple(preds.shape)} do not match target of shape "
        f"{tuple(target.shape)}"
    )


class _ElementwiseError(Metric):
    higher_is_better = False
    capturable = True
    # accumulators (declared with add_state)
    total: torch.Tensor
    count: int

    def __init__(self, name: Optional[str] = None, *, device: Any = None):
        super().__init__(name, device=device)
        self.add_state("total", torch.zeros((), dtype=torch.float64))
        self.add_state("count", 0)

    def _error(self, diff: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        diff = _aligned(self.name, preds, target) - target
        self.total.add_(self._error(diff).sum())
        self.count += target.numel()

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        return _ratio(states["total"], states["count"])


class MeanSquaredError(_ElementwiseError):
    """Mean of ``(preds - target) ** 2`` over every element.

    Args:
        name: Defaults to ``"mse"``.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = MeanSquaredError()
        >>> m.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        >>> m.compute()
        2.0
    """

    default_name = "mse"

    def _error(self, diff: torch.Tensor) -> torch.Tensor:
        return diff.square()


class MeanAbsoluteError(_ElementwiseError):
    """Mean of ``|preds - target|`` over every element.

    Args:
        name: Defaults to ``"mae"``.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = MeanAbsoluteError()
        >>> m.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        >>> m.compute()
        1.0
    """

    default_name = "mae"

    def _error(self, diff: torch.Tensor) -> torch.Tensor:
        return diff.abs()
