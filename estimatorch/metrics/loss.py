"""The :class:`Loss` metric: the running mean of a loss over samples."""

from __future__ import annotations

from typing import Any, Optional, cast

import torch

from .base import Metric, _ratio

__all__ = ["Loss"]


class Loss(Metric):
    """Running mean of a loss, weighted by the number of samples in each batch.

    ``update(loss, target)`` takes the loss the step computed: a scalar (a batch mean, weighted
    by ``target.shape[0]``) or one value per sample (averaged over all of them). With a batch
    dimension other than the first (``fit(batch_axis=1)``), use a per-sample loss
    (``reduction="none"``) so that the weights are right. The accumulator
    stays on the metric's device (the estimator's), in float64; updates are batched
    (``max_pending``, see :class:`Metric`).

    Args:
        name: Defaults to ``"loss"``.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = Loss()
        >>> m.update(torch.tensor(1.0), torch.zeros(2))
        >>> m.update(torch.tensor(4.0), torch.zeros(1))
        >>> m.compute()
        2.0
    """

    # accumulators (declared with add_state)
    total: torch.Tensor
    count: int

    default_name = "loss"
    higher_is_better = False
    #: updated with the loss the step computed, not the predictions (see ``split_loss_metrics``).
    is_loss_metric = True
    max_pending = 32
    capturable = True

    def __init__(self, name: Optional[str] = None, *, device: Any = None):
        super().__init__(name, device=device)
        self.add_state("total", torch.zeros((), dtype=torch.float64))
        self.add_state("count", 0)

    def update(self, preds: torch.Tensor, target: Any = None) -> None:
        loss = preds.detach()
        if loss.dim() == 0:  # a batch mean: weighted by the batch size
            n = target.shape[0] if isinstance(target, torch.Tensor) and target.dim() > 0 else 1
            self._defer((loss, n), 8)
        else:  # one value per sample
            n = loss.numel()
            self._defer((loss.sum(), 1), 8)
        self.count += n

    def _fold(self, items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
        by_weight: dict[int, list[torch.Tensor]] = {}
        for loss, weight in items:  # usually one batch size, plus a last partial batch
            by_weight.setdefault(weight, []).append(loss)
        total = sum(torch.stack(losses).double().sum() * weight for weight, losses in by_weight.items())
        return {"total": cast(torch.Tensor, total)}  # items is never empty: a tensor

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        return _ratio(states["total"], states["count"])
