"""The :class:`Perplexity` metric: ``exp`` of the mean cross-entropy per token."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.nn import functional

from .._checks import is_int
from .base import Metric

__all__ = ["Perplexity"]


class Perplexity(Metric):
    """``exp`` of the cross-entropy per predicted token over all updates, of scores ``(N, C, ...)``
    (the class axis at 1, as ``nn.CrossEntropyLoss`` takes them: what an estimator without a loss
    hands its metrics, shifted for a causal language model) and class indices ``(N, ...)``.

    Every token weighs the same, however the tokens fall into batches (the mean of batch
    perplexities, or ``exp`` of a per-batch mean loss weighted by sequences, differ from it), and
    tokens whose label is ``ignore_index`` (padding, a prompt) are skipped. The sums stay on the
    metric's device, in float64; the cross-entropy is taken in float32 whatever the scores' dtype.

    Args:
        name: Defaults to ``"perplexity"``.
        ignore_index: the label of tokens to skip (None: none). Defaults to -100, that of
            ``nn.CrossEntropyLoss`` and ``transformers``' collators.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = Perplexity()
        >>> m.update(torch.zeros(1, 4, 3), torch.tensor([[1, 2, -100]]))  # 4 classes alike: 4
        >>> round(m.compute(), 6)
        4.0
    """

    # accumulators (declared with add_state)
    total: torch.Tensor
    tokens: torch.Tensor

    default_name = "perplexity"
    higher_is_better = False
    capturable = True

    def __init__(self, name: Optional[str] = None, *, ignore_index: Optional[int] = -100, device: Any = None):
        super().__init__(name, device=device)
        if ignore_index is not None and not is_int(ignore_index):
            raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
        self.ignore_index = ignore_index
        self.add_state("total", torch.zeros((), dtype=torch.float64))
        self.add_state("tokens", torch.zeros((), dtype=torch.int64))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if preds.dim() != target.dim() + 1 or preds.shape[:1] + preds.shape[2:] != target.shape:
            raise ValueError(f"{self.name}: got preds {tuple(preds.shape)} and target {tuple(target.shape)}: "
                             "scores (N, C, ...) need class indices of shape "
                             f"{tuple(preds.shape[:1] + preds.shape[2:])} (move a last class axis to 1: "
                             "logits.movedim(-1, 1))")
        if target.is_floating_point() or target.is_complex():
            raise ValueError(f"{self.name}: class indices must be integers, got {target.dtype}; pass target.long()")
        ignore = -100 if self.ignore_index is None else self.ignore_index
        nll = functional.cross_entropy(preds.detach().float(), target, ignore_index=ignore, reduction="sum")
        self.total.add_(nll.to(self.total.device, torch.float64))
        counted = target.numel() if self.ignore_index is None else (target != self.ignore_index).sum()
        self.tokens.add_(torch.as_tensor(counted, device=self.tokens.device))

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        return torch.exp(states["total"] / states["tokens"])
