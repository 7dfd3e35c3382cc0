"""Precision, recall and F1 (:class:`Precision`, :class:`Recall`, :class:`F1Score`): binary,
multiclass (``average="micro"``, ``"macro"``, ``"weighted"``) and multi-label, equal to
scikit-learn's ``precision_score`` / ``recall_score`` / ``f1_score`` over the same samples.

They take the label formats :class:`~estimatorch.metrics.Accuracy` takes: scores ``(N, C, ...)``
with class indices ``(N, ...)`` (``ignore_index`` skipped: the tokens a language model's loss
skips) or one-hot / probability targets of the scores' shape; binary probabilities (or 0/1
predictions) beside binary labels of their shape; with ``multilabel=True``, 0/1 labels of the
predictions' shape, each column a label. Their accumulators are per-class counts of true
positives, false positives and false negatives, int64 tensors on the metric's device, summed
across ranks in :meth:`~estimatorch.metrics.Metric.compute` and saved with every checkpoint, so a
resumed run and a run on several ranks give the value of one uninterrupted process, exactly.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np
import torch

from .. import distributed
from .._checks import is_int, is_real
from .accuracy import _class_layout, _held_bytes, _unnormalised
from .base import Metric

__all__ = ["F1Score", "Precision", "Recall"]

AVERAGES = ("binary", "micro", "macro", "weighted")


class _ClassCounts(Metric):
    """Per-class true positives, false positives and false negatives (``tp``, ``fp``, ``fn``,
    ``(K,)`` int64: K classes, or labels with ``multilabel``), and ``unnormalised``, the target
    rows of the scores' shape that are neither one-hot nor probabilities. K is ``num_classes``,
    or read from the first update's shapes (then, under torch.distributed, the ranks agree on it
    in ``compute``: a rank that saw nothing holds none)."""

    # accumulators (declared with add_state)
    tp: torch.Tensor
    fp: torch.Tensor
    fn: torch.Tensor
    unnormalised: torch.Tensor

    higher_is_better = True
    max_pending = 32
    _fold_order_free = True
    _score_name = "score"

    def __init__(self, name: Optional[str] = None, *, average: str = "binary", num_classes: Optional[int] = None,
                 multilabel: bool = False, threshold: float = 0.5, ignore_index: Optional[int] = -100,
                 pos_label: int = 1, zero_division: float = 0.0, device: Any = None):
        super().__init__(name, device=device)
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {list(AVERAGES)}, got {average!r}")
        if num_classes is not None and (not is_int(num_classes) or num_classes < 1):
            raise ValueError(f"num_classes must be a positive int or None, got {num_classes!r}")
        if not isinstance(multilabel, bool):
            raise ValueError(f"multilabel must be a bool, got {multilabel!r}")
        if multilabel and average == "binary":
            raise ValueError("average='binary' scores one class of single-label targets; multi-label targets "
                             "take average='micro', 'macro' or 'weighted'")
        if not is_real(threshold) or not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold!r}")
        if ignore_index is not None and not is_int(ignore_index):
            raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
        if not is_int(pos_label) or pos_label < 0:
            raise ValueError(f"pos_label must be a non-negative class index, got {pos_label!r}")
        if not is_real(zero_division) or not 0.0 <= zero_division <= 1.0:
            raise ValueError(f"zero_division must be a number in [0, 1], got {zero_division!r}")
        self.average, self.num_classes, self.multilabel = average, num_classes, multilabel
        self.threshold, self.ignore_index, self.pos_label = float(threshold), ignore_index, pos_label
        self.zero_division = float(zero_division)
        size = num_classes or 0
        for attr in ("tp", "fp", "fn"):
            self.add_state(attr, torch.zeros(size, dtype=torch.int64))
        self.add_state("unnormalised", torch.zeros((), dtype=torch.int64))

    # -- the classes ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """K: the classes (or labels) counted so far."""
        return int(self.tp.numel())

    def _grow(self, size: int) -> None:
        """Count ``size`` classes (padding the counts with zeros): on the device, no sync."""
        if size <= self.size:
            return
        for attr in ("tp", "fp", "fn"):
            value = getattr(self, attr)
            setattr(self, attr, torch.cat([value, value.new_zeros(size - value.numel())]))

    def _classes(self, preds: torch.Tensor, target: torch.Tensor, layout: str) -> int:
        if self.multilabel:
            return int(preds.shape[1]) if preds.dim() >= 2 else 1
        if layout == "labels":
            return 2
        classes = int(preds.shape[1])
        return 2 if classes == 1 else classes

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        preds, target = preds.detach(), target.detach()
        if preds.dim() == target.dim() + 1 and preds.dim() >= 2 and preds.shape[1] == 1:  # one column: binary
            preds = preds.squeeze(1)
        layout = self._layout(preds, target)
        classes = self._classes(preds, target, layout)
        if self.num_classes is not None and classes > self.num_classes:
            raise ValueError(f"{self.name}: num_classes={self.num_classes}, but the predictions hold {classes} "
                             "classes")
        if self.average == "binary" and classes > 2:
            raise ValueError(f"{self.name}: average='binary' scores class {self.pos_label} of two, but the "
                             f"predictions hold {classes} classes; pass average='micro', 'macro' or 'weighted'")
        if self.average == "binary" and self.pos_label >= 2:
            raise ValueError(f"{self.name}: pos_label={self.pos_label} is not a class of binary targets (0 or 1)")
        self._grow(max(classes, self.num_classes or 0))
        self._defer((preds, target), _held_bytes(preds))

    def _layout(self, preds: torch.Tensor, target: torch.Tensor) -> str:
        if self.multilabel:
            if preds.shape != target.shape:
                raise ValueError(
                    f"{self.name}: multilabel=True needs targets of the predictions' shape, got preds "
                    f"{tuple(preds.shape)} and target {tuple(target.shape)}; pass 0/1 labels of shape "
                    f"{tuple(preds.shape)}")
            return "multilabel"
        return _class_layout(self.name, preds, target, binary=True)

    # -- counting ------------------------------------------------------------------------------
    def _binary(self, values: torch.Tensor, target_side: bool) -> torch.Tensor:
        """0/1 labels: probabilities thresholded (``threshold`` for predictions, 0.5 for targets)."""
        if values.is_floating_point():
            return (values >= (0.5 if target_side else self.threshold)).long()
        return values.long()

    def _counts(self, preds: torch.Tensor, target: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[tp, fp, fn]`` per class ``(3, size)`` and the unnormalised rows, for one update."""
        unnormalised = torch.zeros((), dtype=torch.int64, device=preds.device)
        layout = self._layout(preds, target)
        if layout == "multilabel":
            labels = preds.shape[1] if preds.dim() >= 2 else 1
            pred = self._binary(preds, False).movedim(1, -1).reshape(-1, labels) if preds.dim() >= 2 \
                else self._binary(preds, False).reshape(-1, 1)
            true = target.movedim(1, -1).reshape(-1, labels) if target.dim() >= 2 else target.reshape(-1, 1)
            keep = (true != self.ignore_index) if self.ignore_index is not None and not true.is_floating_point() \
                else torch.ones_like(true, dtype=torch.bool)
            true = self._binary(true, True)
            tp = ((pred == 1) & (true == 1) & keep).sum(0)
            fp = ((pred == 1) & (true == 0) & keep).sum(0)
            fn = ((pred == 0) & (true == 1) & keep).sum(0)
            counts = torch.stack([tp, fp, fn])
            return torch.cat([counts, counts.new_zeros(3, size - labels)], dim=1), unnormalised
        if layout == "labels":
            pred, true = self._binary(preds, False).reshape(-1), target.reshape(-1)
        elif layout == "distribution":
            pred, true = preds.argmax(dim=1).reshape(-1), target.argmax(dim=1).reshape(-1)
            unnormalised = _unnormalised(target)
        else:  # class indices
            pred, true = preds.argmax(dim=1).reshape(-1), target.reshape(-1)
        cells = size * size
        if layout == "labels":
            index = self._binary(true, True) * size + pred.long()
        else:
            index = true.long() * size + pred.long()
        if self.ignore_index is not None and not true.is_floating_point():  # to a bin of their own: no sync
            index = torch.where(true == self.ignore_index, torch.full_like(index, cells), index)
        confusion = torch.bincount(index, minlength=cells + 1)[:cells].reshape(size, size)
        tp = confusion.diagonal()
        return torch.stack([tp, confusion.sum(0) - tp, confusion.sum(1) - tp]), unnormalised

    def _fold(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        size = self.size
        total, unnormalised = None, None
        for preds, target in items:
            counts, rows = self._counts(preds, target, size)
            total = counts if total is None else total + counts
            unnormalised = rows if unnormalised is None else unnormalised + rows
        assert total is not None and unnormalised is not None
        return {"tp": total[0], "fp": total[1], "fn": total[2], "unnormalised": unnormalised}

    def _commit_pending(self) -> None:
        self._grow(max(self.size, self.num_classes or 0))
        super()._commit_pending()

    def reset(self) -> None:
        """Clear the counts, keeping the classes counted so far (the model's classes)."""
        size = self.size
        super().reset()
        self._grow(size)

    def compute(self, *, sync: bool = True) -> float:
        """The score over every sample so far (``nan`` before any update); under torch.distributed
        (``sync``) over every rank's, the ranks first agreeing on the classes counted when
        ``num_classes`` was not given."""
        if sync and distributed.is_distributed() and self.num_classes is None:
            agreed = distributed.all_reduce_states({"size": torch.tensor(self.size, device=self.device)},
                                                   {"size": "max"}, self.device)
            self._grow(int(agreed["size"]))
        return super().compute(sync=sync)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._grow(self.num_classes or 0)

    def combine_rank_states(self, states: Any, world_size: int) -> list[dict[str, Any]]:
        """The base's combination, every rank's counts first grown to the classes of the widest."""
        size = max([int(torch.as_tensor(s["tp"]).numel()) for s in states] + [self.size])
        grown = []
        for state in states:
            scratch = copy.deepcopy(self)
            scratch.load_state_dict(state)
            scratch._grow(size)
            grown.append(scratch.state_dict())
        return super().combine_rank_states(grown, world_size)

    # -- the value -----------------------------------------------------------------------------
    def _scores(self, tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def _divide(self, numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
        """scikit-learn's ``_prf_divide``: ``zero_division`` where the denominator is 0."""
        mask = denominator == 0
        denominator = denominator.astype(np.float64, copy=True)
        denominator[mask] = 1
        result = numerator.astype(np.float64) / denominator
        result[mask] = self.zero_division
        return result

    def _value(self, states: dict[str, Any]) -> Any:
        if int(states["unnormalised"]):  # compute() reads values anyway: no extra sync per update
            raise ValueError(f"{self.name}: {int(states['unnormalised'])} target rows of the scores' shape do not "
                             "sum to 1, so they are neither one-hot nor class probabilities: for multi-label "
                             "targets pass multilabel=True (0/1 labels of the predictions' shape), else class "
                             "indices")
        tp, fp, fn = (states[k].cpu().numpy() for k in ("tp", "fp", "fn"))  # compute(): the host reads it
        if tp.size == 0 or int(tp.sum() + fp.sum() + fn.sum()) == 0:
            return float("nan")
        if self.average == "binary":
            tp, fp, fn = tp[self.pos_label:self.pos_label + 1], fp[self.pos_label:self.pos_label + 1], \
                fn[self.pos_label:self.pos_label + 1]
        elif not self.multilabel:  # the classes seen in the targets or the predictions (scikit-learn's labels)
            seen = (tp + fp + fn) > 0
            tp, fp, fn = tp[seen], fp[seen], fn[seen]
        if self.average == "micro":
            tp, fp, fn = tp.sum(keepdims=True), fp.sum(keepdims=True), fn.sum(keepdims=True)
        scores = self._scores(tp, fp, fn)
        if self.average == "weighted":
            weights = tp + fn
            if weights.sum() > 0:
                return float(np.average(scores, weights=weights))
        return float(np.mean(scores))


class Precision(_ClassCounts):
    """Precision, ``tp / (tp + fp)``: of the samples predicted in a class, the fraction that are.

    Args:
        name: Defaults to ``"precision"``.
        average: ``"binary"`` (class ``pos_label`` of binary targets), ``"micro"`` (counts summed
            over the classes), ``"macro"`` (the mean of the classes' values, over the classes seen
            in the targets or predictions; every label with ``multilabel``) or ``"weighted"``
            (weighted by each class's support): scikit-learn's. Defaults to ``"binary"``.
        num_classes: the classes (labels) there are; None reads them from the predictions'
            shape. Defaults to None.
        multilabel: predictions and targets of one shape ``(N, L, ...)`` hold L independent binary
            labels. Defaults to False.
        threshold: what binary probabilities are thresholded at. Defaults to 0.5.
        ignore_index: the target value to skip (padding, the tokens a loss skips). Defaults to -100.
        pos_label: the class ``average="binary"`` scores. Defaults to 1.
        zero_division: the value of a class whose denominator is 0 (scikit-learn's
            ``zero_division=0``, without its warning). Defaults to 0.0.
        device: Defaults to the CPU.

    Example:
        >>> import torch
        >>> m = Precision(average="macro")
        >>> m.update(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 3.0, 1.0]]), torch.tensor([0, 1, 2]))
        >>> round(m.compute(), 4)  # class 0: 1/1, class 1: 1/2, class 2: 0 predicted
        0.5
    """

    default_name = "precision"

    def _scores(self, tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        return self._divide(tp, tp + fp)


class Recall(_ClassCounts):
    """Recall, ``tp / (tp + fn)``: of the samples of a class, the fraction predicted in it.

    Args: as :class:`Precision` (``name`` defaults to ``"recall"``).

    Example:
        >>> import torch
        >>> m = Recall()  # binary: probabilities against 0/1 labels
        >>> m.update(torch.tensor([0.9, 0.2, 0.7, 0.4]), torch.tensor([1, 1, 0, 1]))
        >>> round(m.compute(), 4)
        0.3333
    """

    default_name = "recall"

    def _scores(self, tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        return self._divide(tp, tp + fn)


class F1Score(_ClassCounts):
    """F1, ``2 tp / (2 tp + fp + fn)``: the harmonic mean of precision and recall.

    Args: as :class:`Precision` (``name`` defaults to ``"f1"``).

    Example:
        >>> import torch
        >>> m = F1Score(average="weighted")
        >>> m.update(torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0]]), torch.tensor([0, 1, 1]))
        >>> round(m.compute(), 4)
        0.6667
    """

    default_name = "f1"

    def _scores(self, tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> np.ndarray:
        return self._divide(2 * tp.astype(np.float64), (tp + fn).astype(np.float64) + (tp + fp))
