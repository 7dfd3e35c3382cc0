"""The items a micro-batch's loss averages over: what an optimizer step of several micro-batches
divides its summed gradient by, so that its loss is the mean over the step's items (docs/handlers.md,
"GradientUpdateHandler").

The rule, by loss:

=================================================  ===============================================
the loss                                           its items
=================================================  ===============================================
a loss with an int ``ignore_index`` and            the labels other than ``ignore_index`` (with a
``reduction="mean"`` (``CrossEntropyLoss``,        ``weight=``: their weights' sum, the divisor
``NLLLoss``), given class indices per token        the loss uses); a mean over them
(labels of two or more dimensions)
``reduction="sum"``                                as above, or the samples: the loss is their sum
the model's own loss (``Estimator(model)``)        the labels other than -100 (a causal LM's
with per-token labels                              shifted ones, ``labels[..., 1:]``, or the
                                                   batch's ``shift_labels``), as transformers'
                                                   ``Trainer`` counts ``num_items_in_batch``
anything else                                      the samples along ``batch_axis`` (from shapes)
=================================================  ===============================================

A count of labels stays a device tensor (no host-device sync); a count of samples is a Python int.
One label per sample (class indices of shape ``(N,)``) counts samples: a label equal to the
``ignore_index`` there is not told apart (it is one in a million in classification data, and
counting it would cost every DDP step of such a fit a collective: samples are counted alike on
every rank, labels need summing).

Lowest layer: the step (``BatchProcessor``) counts, the estimator weighs.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Union

import torch

from ._batches import batch_size_of
from ._model_loss import labels_of, unwrap_model

__all__ = ["Count", "loss_items", "own_loss_items", "passes_num_items", "sums_items"]

#: a micro-batch's items: a device tensor (a count of labels) or a Python int (samples)
Count = Union[torch.Tensor, int]

#: the label transformers' losses ignore (``-100``, PyTorch's default ``ignore_index`` too)
IGNORED = -100


def sums_items(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` returns the sum over its items (``reduction="sum"``), not their mean.

    Example:
        >>> sums_items(torch.nn.MSELoss(reduction="sum")), sums_items(torch.nn.CrossEntropyLoss())
        (True, False)
    """
    return getattr(loss_fn, "reduction", None) == "sum"


def loss_items(loss_fn: Any, label: Any, batch_axis: int = 0) -> Count:
    """The items ``loss_fn(pred, label)`` averages (or sums) over (see the module's table).

    Example:
        >>> loss_items(torch.nn.CrossEntropyLoss(), torch.tensor([[1, -100, 2]]))
        tensor(2)
        >>> loss_items(torch.nn.MSELoss(), torch.zeros(5, 3))
        5
    """
    ignore = getattr(loss_fn, "ignore_index", None)
    if type(ignore) is int and getattr(loss_fn, "reduction", "mean") in ("mean", "sum") \
            and _per_token(label):
        kept = label != ignore
        weight = getattr(loss_fn, "weight", None)
        if isinstance(weight, torch.Tensor) and not sums_items(loss_fn):  # the mean's divisor: the weights' sum
            return (weight[label.masked_fill(~kept, 0)] * kept).sum()
        return kept.sum()
    return batch_size_of(label, batch_axis)


def own_loss_items(batch: Any, shift: bool, batch_axis: int = 0) -> Count:
    """The items of a model's own loss on ``batch``: labels other than -100 (``shift``: a causal
    LM's, ``labels[..., 1:]``; a batch's ``shift_labels`` as they are), else the samples.

    Example:
        >>> own_loss_items({"labels": torch.tensor([[5, 6, -100]])}, shift=True)
        tensor(1)
    """
    if isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), torch.Tensor):
        return (batch["shift_labels"] != IGNORED).sum()
    labels = labels_of(batch)
    if _per_token(labels):
        return ((labels[..., 1:] if shift else labels) != IGNORED).sum()
    return batch_size_of(batch, batch_axis)


def _per_token(label: Any) -> bool:
    """Class indices of two or more dimensions: a label per token (or pixel), some ignored."""
    return isinstance(label, torch.Tensor) and label.dim() >= 2 and not label.is_floating_point() \
        and not label.is_complex()


def passes_num_items(model: Any, batch: Any) -> bool:
    """Whether ``model`` takes ``num_items_in_batch`` with ``batch`` (a dict of keyword inputs):
    a ``transformers`` model whose ``accepts_loss_kwargs`` is not False and whose forward takes
    ``**kwargs`` (as ``Trainer`` decides), or any module whose forward names the argument."""
    if not isinstance(batch, Mapping) or "num_items_in_batch" in batch:
        return False
    plain = unwrap_model(model)
    try:
        params = inspect.signature(plain.forward).parameters
    except (TypeError, ValueError, AttributeError):  # no signature to read
        return False
    if "num_items_in_batch" in params:
        return True
    if not _is_transformers_model(plain):
        return False
    accepts = getattr(type(plain), "accepts_loss_kwargs", None)
    if isinstance(accepts, bool):
        return accepts
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _is_transformers_model(model: Any) -> bool:
    """A ``transformers`` ``PreTrainedModel``, told by its classes (never importing the library)."""
    return any(cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
               for cls in type(model).__mro__)
