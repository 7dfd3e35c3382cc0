"""Classification metrics: :class:`Accuracy` and :class:`TopKAccuracy`.

Both follow the format of the labels (the formats ``nn.CrossEntropyLoss`` accepts, and binary or
multi-label targets for :class:`Accuracy`); a pair of shapes or a dtype they cannot interpret is
a ``ValueError`` naming the metric, both shapes and the fix, never a silent number.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from .._checks import is_int, is_real
from .base import Metric, _ratio

__all__ = ["Accuracy", "TopKAccuracy"]

FORMATS = ("class indices (N, ...) of an integer dtype for scores (N, C, ...), one-hot or probability "
           "targets of the scores' shape, or binary labels of the predictions' shape")


class Accuracy(Metric):
    """Fraction of samples whose predicted class equals the target's.

    ``preds`` are scores with a class dimension at axis 1 (``(N, C, ...)``, argmax is taken),
    class indices, or binary probabilities (thresholded at ``threshold``; a class dimension of
    size 1, ``(N, 1)``, holds them too). The target may be:

    - class indices ``(N, ...)`` of an integer dtype (``.long()`` them when they are floats);
    - one-hot or soft (probability, label-smoothed, mixed) targets of the scores' shape
      ``(N, C, ...)``: their argmax over axis 1 is the class, when every target row (over axis
      1) sums to 1;
    - binary labels of the probabilities' shape (0/1, or probabilities thresholded at 0.5):
      ``(N,)``, ``(N, 1)``, a binary mask ``(N, H, W)``, or multi-hot rows ``(N, L)``. Targets
      of the scores' shape some of whose rows do not sum to 1 are read this way, each element
      compared with its thresholded prediction (as ``multilabel=True``), with a warning
      naming the metric; which reading applies is decided at :meth:`compute`, from counts
      kept on the device, so an update never waits for the device;
    - with ``multilabel=True``: 0/1 labels of the predictions' shape, each compared with its
      thresholded probability (the fraction of right (sample, label) pairs).

    Class indices equal to ``ignore_index`` (padding, the tokens a language model's loss skips)
    count neither as right nor as samples, as ``nn.CrossEntropyLoss`` skips them.

    Args:
        name: Defaults to ``"accuracy"``.
        threshold: for binary probabilities. Defaults to 0.5.
        multilabel: predictions and targets of one shape hold independent binary labels.
            Defaults to False.
        ignore_index: the class index of targets to skip (None: none). Defaults to -100, the
            ``ignore_index`` of ``nn.CrossEntropyLoss`` and of ``transformers``' collators.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = Accuracy()
        >>> m.update(torch.tensor([[2.0, 1.0], [0.0, 3.0]]), torch.tensor([0, 0]))
        >>> m.compute()
        0.5
        >>> m.update(torch.tensor([[2.0, 1.0]]), torch.tensor([[0.9, 0.1]]))  # a soft target
        >>> m.compute()
        0.6666666666666666
    """

    # accumulators (declared with add_state)
    correct: torch.Tensor
    count: int
    unnormalised: torch.Tensor
    label_correct: torch.Tensor
    label_count: int
    ignored: torch.Tensor

    default_name = "accuracy"
    higher_is_better = True
    max_pending = 32
    _fold_order_free = True
    capturable = True

    def __init__(self, name: Optional[str] = None, *, threshold: float = 0.5, multilabel: bool = False,
                 ignore_index: Optional[int] = -100, device: Any = None):
        super().__init__(name, device=device)
        if not is_real(threshold) or not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        if not isinstance(multilabel, bool):
            raise ValueError(f"multilabel must be a bool, got {multilabel!r}")
        if ignore_index is not None and not is_int(ignore_index):
            raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
        self.threshold = float(threshold)
        self.multilabel = multilabel
        self.ignore_index = ignore_index
        self.add_state("correct", torch.zeros((), dtype=torch.int64))
        self.add_state("count", 0)
        self.add_state("unnormalised", torch.zeros((), dtype=torch.int64))  # target rows not summing to 1
        # the same updates read as binary labels, element by element: what compute() gives when
        # some target rows of the scores' shape do not sum to 1 (multi-hot rows, binary masks)
        self.add_state("label_correct", torch.zeros((), dtype=torch.int64))
        self.add_state("label_count", 0)
        self.add_state("ignored", torch.zeros((), dtype=torch.int64))  # targets of ignore_index, counted above

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = preds.detach()
        if preds.dim() == target.dim() + 1 and preds.shape[1] == 1:  # one column: binary
            preds = preds.squeeze(1)
        layout = self._layout(preds, target)
        self._defer((preds, target.detach()), _held_bytes(preds))
        self.count += target.numel() // (target.shape[1] if layout == "distribution" else 1)
        self.label_count += target.numel()

    def _layout(self, preds: torch.Tensor, target: torch.Tensor) -> str:
        if self.multilabel:
            if preds.shape != target.shape:
                raise ValueError(
                    f"{self.name}: multilabel=True needs targets of the predictions' shape, got preds "
                    f"{tuple(preds.shape)} and target {tuple(target.shape)}; pass 0/1 labels of shape "
                    f"{tuple(preds.shape)}, or Accuracy(multilabel=False) for one class per sample")
            return "labels"
        return _class_layout(self.name, preds, target, binary=True)

    def _hits(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``[right, target rows not summing to 1, right as binary labels, ignored targets]`` for
        one (or concatenated) update(s)."""
        layout = "labels" if self.multilabel else _class_layout(self.name, preds, target, binary=True)
        if layout == "indices":
            hit = preds.argmax(dim=1) == target
            if self.ignore_index is None:
                right = hit.sum()
                return torch.stack([right, torch.zeros_like(right), right, torch.zeros_like(right)])
            ignored = target == self.ignore_index  # argmax is never negative: no hit among them when < 0
            right = (hit & ~ignored).sum()
            return torch.stack([right, torch.zeros_like(right), right, ignored.sum()])
        as_labels = self._label_hits(preds, target)
        none = torch.zeros_like(as_labels)
        if layout == "labels":
            return torch.stack([as_labels, none, as_labels, none])
        return torch.stack([(preds.argmax(dim=1) == target.argmax(dim=1)).sum(), _unnormalised(target), as_labels,
                            none])

    def _label_hits(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not preds.is_floating_point():
            return (preds == target).sum()
        labels = preds >= self.threshold  # probabilities: the targets are binary labels too
        return (labels == (target >= 0.5 if target.is_floating_point() else target.bool())).sum()

    def _fold(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        hits = _fold_hits(self._hits, items)
        return {"correct": hits[0], "unnormalised": hits[1], "label_correct": hits[2], "ignored": hits[3]}

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        unnormalised = int(states["unnormalised"])  # compute() reads values anyway: no extra sync per update
        if unnormalised:
            warnings.warn(f"{self.name}: {unnormalised} target rows of the scores' shape do not sum to 1, so they "
                          "are not one-hot or class probabilities: read as binary labels, element by element "
                          "(multi-label). Pass Accuracy(multilabel=True) to say so, or class indices for one "
                          "class per sample", stacklevel=3)
            return _ratio(states["label_correct"].double(), states["label_count"] - states["ignored"])
        return _ratio(states["correct"].double(), states["count"] - states["ignored"])

    def upgrade_state(self, state: dict[str, Any]) -> dict[str, Any]:
        # a state saved before targets were checked for normalisation has no such counts; its
        # updates were read as one class per sample (or binary labels without a class axis); one
        # saved before ignore_index counted no ignored targets
        defaults = {"unnormalised": torch.zeros((), dtype=torch.int64), "ignored": torch.zeros((), dtype=torch.int64)}
        if "label_correct" not in state:
            defaults.update(label_correct=torch.as_tensor(state.get("correct", 0)).clone(),
                            label_count=state.get("count", 0))
        return {**defaults, **state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(self.upgrade_state(state))


class TopKAccuracy(Metric):
    """Fraction of samples whose target class is among the ``top_k`` highest scores (axis 1).

    The target is class indices ``(N, ...)`` of an integer dtype, or one-hot or soft targets of
    the scores' shape ``(N, C, ...)`` (their argmax is the class; each row must sum to 1).

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
    unnormalised: torch.Tensor

    higher_is_better = True
    max_pending = 32
    _fold_order_free = True
    capturable = True

    def __init__(self, top_k: int = 5, name: Optional[str] = None, *, device: Any = None):
        if not is_int(top_k) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        self.top_k = top_k
        super().__init__(name or f"top{top_k}_accuracy", device=device)
        self.add_state("correct", torch.zeros((), dtype=torch.int64))
        self.add_state("count", 0)
        self.add_state("unnormalised", torch.zeros((), dtype=torch.int64))

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds = preds.detach()
        layout = _class_layout(self.name, preds, target, binary=False)
        self._defer((preds, target.detach()), _held_bytes(preds))
        self.count += target.numel() // (target.shape[1] if layout == "distribution" else 1)

    def _hits(self, preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        unnormalised = torch.zeros((), dtype=torch.int64, device=preds.device)
        if _class_layout(self.name, preds, target, binary=False) == "distribution":
            target, unnormalised = target.argmax(dim=1), _unnormalised(target)
        top = preds.topk(min(self.top_k, preds.shape[1]), dim=1).indices
        return torch.stack([(top == target.unsqueeze(1)).any(dim=1).sum(), unnormalised])

    def _fold(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        hits = _fold_hits(self._hits, items)
        return {"correct": hits[0], "unnormalised": hits[1]}

    def _value(self, states: dict[str, Any]) -> torch.Tensor:
        _refuse_unnormalised(self.name, states["unnormalised"])
        return _ratio(states["correct"].double(), states["count"])

    def upgrade_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"unnormalised": torch.zeros((), dtype=torch.int64), **state}  # saved before targets were checked

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(self.upgrade_state(state))


def _class_layout(name: str, preds: torch.Tensor, target: torch.Tensor, *, binary: bool) -> str:
    """How ``target`` holds the classes of ``preds``: ``"indices"`` (scores ``(N, C, ...)``, target
    ``(N, ...)``), ``"distribution"`` (one-hot or soft targets of the scores' shape) or, when
    ``binary``, ``"labels"`` (labels or probabilities of one shape without a class dimension).
    Anything else is a ``ValueError`` naming ``name``, both shapes and the fix."""
    shapes = f"preds {tuple(preds.shape)} and target {tuple(target.shape)} ({target.dtype})"
    if preds.dim() == target.dim() + 1 and preds.dim() >= 2:
        if preds.shape[:1] + preds.shape[2:] != target.shape:
            raise ValueError(f"{name}: got {shapes}: scores (N, C, ...) need class indices of shape "
                             f"{tuple(preds.shape[:1] + preds.shape[2:])}; the batch or trailing sizes differ")
        if target.is_floating_point() or target.is_complex():
            raise ValueError(f"{name}: got {shapes}: class indices must be integers; pass target.long() "
                             f"(or a one-hot/probability target of shape {tuple(preds.shape)})")
        return "indices"
    if preds.shape == target.shape:
        if preds.is_floating_point() and preds.dim() >= 2 and preds.shape[1] > 1:
            return "distribution"
        if binary:
            return "labels"
    hint = f"expected {FORMATS}" if binary else "expected scores (N, C, ...) with class indices (N, ...) " \
        "or one-hot/probability targets (N, C, ...)"
    raise ValueError(f"{name}: cannot interpret {shapes}; {hint}")


def _unnormalised(target: torch.Tensor) -> torch.Tensor:
    """How many target rows (over axis 1) do not sum to 1: not one-hot nor a distribution."""
    total = target.double().sum(dim=1)
    tolerance = 1e-2 if target.is_floating_point() and target.element_size() < 4 else 1e-4
    return ((total - 1).abs() > tolerance).sum()


def _refuse_unnormalised(name: str, unnormalised: torch.Tensor) -> None:
    if int(unnormalised):  # compute() reads values anyway: no extra sync per update
        raise ValueError(f"{name}: {int(unnormalised)} target rows of the scores' shape do not sum to 1, so "
                         "they are neither one-hot nor class probabilities, and multi-label targets have no "
                         "top-k accuracy; pass class indices (or use Accuracy(multilabel=True))")


def _held_bytes(preds: torch.Tensor) -> int:
    """What keeping ``preds`` pending keeps alive: its whole storage (a view of last-token logits
    holds every token's), which the pending cap must count."""
    return preds.untyped_storage().nbytes()


def _fold_hits(hits: Any, items: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Summed ``hits`` over pending ``(preds, target)`` pairs: one vectorised pass when they
    concatenate without changing a dtype."""
    if len({(p.dtype, t.dtype) for p, t in items}) == 1:
        try:
            preds, target = torch.cat([p for p, _ in items]), torch.cat([t for _, t in items])
        except RuntimeError:  # trailing shapes differ (e.g. sequences of several lengths)
            pass
        else:
            return hits(preds, target)
    return torch.stack([hits(p, t) for p, t in items]).sum(dim=0)
