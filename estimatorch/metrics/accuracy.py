"""Classification metrics: :class:`Accuracy` and :class:`TopKAccuracy`."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._checks import is_int, is_real
from .base import Metric, _ratio

__all__ = ["Accuracy", "TopKAccuracy"]


class Accuracy(Metric):
    """Fraction of samples whose predicted class equals the target.

    ``preds`` may be scores with a class dimension at axis 1 (``(N, C, ...)``, argmax is taken),
    class indices of the target's shape, or probabilities of the target's shape for binary
    problems (thresholded at ``threshold``). A class dimension of size 1 (``(N, 1)`` for an
    ``(N,)`` target) holds binary probabilities too.

    Args:
        name: Defaults to ``"accuracy"``.
        threshold: for binary probabilities. Defaults to 0.5.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = Accuracy()
        >>> m.update(torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 0]))
        >>> m.compute()
        0.5
    """

    # accumulators (declared with add_state)
    correct: torch.Tensor
    count: int

    default_name = "accuracy"
    higher_is_better = True
    max_pending = 32
    _fold_order_free = True

    def __init__(self, name: Optional[str] = None, *, threshold: float = 0.5, device: Any = None):
        super().__init__(name, device=device)
        if not is_real(threshold) or not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        self.threshold = float(threshold)
        self.add_state("correct", torch.zeros((), dtype=torch.int64))
        self.add_state("count", 0)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = preds.detach()
        if preds.dim() == target.dim() + 1 and preds.shape[1] == 1:  # one column: binary
            preds = preds.squeeze(1)
        if preds.dim() != target.dim() + 1 and preds.shape != target.shape:
            raise ValueError(
                f"{self.name}: preds of shape {tuple(preds.shape)} do not match target of shape "
                f"{tuple(target.shape)}; expected (N, C, ...) scores or the target's shape"
            )
        self._defer((preds, target), _held_bytes(preds))
        self.count += target.numel()

    def _correct(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if preds.dim() == target.dim() + 1:
            labels = preds.argmax(dim=1)
        else:
            labels = preds >= self.threshold if preds.is_floating_point() else preds
        return (labels == target).sum()

    def _fold(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"correct": _fold_counts(self._correct, items)}

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        return _ratio(states["correct"].double(), states["count"])


class TopKAccuracy(Metric):
    """Fraction of samples whose target is among the ``top_k`` highest scores (axis 1).

    Args:
        top_k: how many classes count as a hit. Defaults to 5.
        name: Defaults to ``"top{k}_accuracy"``.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = TopKAccuracy(top_k=2)
        >>> m.update(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]), torch.tensor([1, 2]))
        >>> m.compute()
        0.5
    """

    # accumulators (declared with add_state)
    correct: torch.Tensor
    count: int

    higher_is_better = True
    max_pending = 32
    _fold_order_free = True

    def __init__(self, top_k: int = 5, name: Optional[str] = None, *, device: Any = None):
        if not is_int(top_k) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        super().__init__(name or f"top{top_k}_accuracy", device=device)
        self.add_state("correct", torch.zeros((), dtype=torch.int64))
        self.add_state("count", 0)

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = preds.detach()
        if preds.dim() != target.dim() + 1:
            raise ValueError(
                f"{self.name}: preds must be (N, C, ...) scores for a target of shape "
                f"{tuple(target.shape)}, got {tuple(preds.shape)}"
            )
        self._defer((preds, target), _held_bytes(preds))
        self.count += target.numel()

    def _correct(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        top = preds.topk(min(self.top_k, preds.shape[1]), dim=1).indices
        return (top == target.unsqueeze(1)).any(dim=1).sum()

    def _fold(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"correct": _fold_counts(self._correct, items)}

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        return _ratio(states["correct"].double(), states["count"])


def _held_bytes(preds: torch.Tensor) -> int:
    """What keeping ``preds`` pending keeps alive: its whole storage (a view of last-token logits
    holds every token's), which the pending cap must count."""
    return preds.untyped_storage().nbytes()


def _fold_counts(correct: Any, items: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Hits over pending ``(preds, target)`` pairs: one vectorised pass when they concatenate."""
    try:
        preds, target = torch.cat([p for p, _ in items]), torch.cat([t for _, t in items])
    except RuntimeError:  # trailing shapes differ (e.g. sequences of several lengths)
        return torch.stack([correct(p, t) for p, t in items]).sum()
    return correct(preds, target)
