"""The step: :class:`BatchProcessor` runs forward and backward for one batch."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from .._batches import call_loss, call_net, split_batch, split_inputs
from .._checks import check_bool, is_real
from .._items import loss_items, own_loss_items, passes_num_items, sums_items
from .._model_loss import is_causal_lm, logits_of, model_inputs, own_loss_step
from ..events import Dispatch, EstimatorView

__all__ = ["BatchProcessor", "StepEstimator"]


class StepEstimator(EstimatorView, Protocol):
    """What a :class:`BatchProcessor` uses of the estimator (``Estimator`` satisfies it): what a
    handler may use (:class:`~estimatorch.events.EstimatorView`: ``net``, ``train_net``, ``loss``,
    ``fire``...), since a processor fires the step's events and hands the estimator to their
    handlers; and the step's own tools: the evaluation net and loss, mixed precision, the backward
    pass, and the question of who listens to an event (:attr:`dispatch`)."""

    #: the loss evaluation and prediction compute; None: the model computes its own
    val_loss: Optional[Callable[..., torch.Tensor]]
    #: the module evaluation and prediction call
    val_net: nn.Module

    @property
    def dispatch(self) -> Dispatch:
        """The current fit's handlers per event: ``dispatch.forward_end`` is falsy when none listens."""

    @property
    def weighs_items(self) -> bool:
        """Whether :meth:`backward` weighs the loss by its items (an optimizer step of several
        micro-batches): a processor then counts them (:mod:`estimatorch._items`)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of the estimator's ``precision``."""

    def backward(self, loss: torch.Tensor, items: Any = None, *, mean: bool = True) -> None:
        """``loss.backward()``, scaled under ``"16-mixed"``, weighed by ``items`` where a step
        spans several micro-batches (None: the batch's samples; ``mean=False``: ``loss`` is
        their sum)."""


class BatchProcessor:
    """Forward and backward for one training batch, and the forward of one evaluation or
    prediction batch.

    Replace it (``Estimator(..., batch_processor=MyProcessor())``) to change the step, e.g. for
    several inputs or a custom loss, without subclassing :class:`~estimatorch.Estimator`. A
    custom ``fit_batch`` fires the forward and backward events with ``estimator.fire(...)`` and
    uses ``estimator.autocast()`` and ``estimator.backward(loss)`` to keep mixed precision
    working (and may skip an event nobody listens to: ``if estimator.dispatch.forward_end:``). It
    does not step the optimizer: ``GradientUpdateHandler`` does, at ``batch_end``.
    Where an optimizer step spans several micro-batches (``estimator.weighs_items``), the step
    trains on the mean over all its items: ``estimator.backward(loss, items)`` weighs the loss
    by its count (``fit_batch`` passes the count of :mod:`estimatorch._items`: labels other than
    the loss's ``ignore_index``, else samples); a custom ``fit_batch`` that passes none gets
    its batch's samples, and one whose loss is a sum passes ``mean=False``.
    A processor that reads batches its own way overrides ``predict_batch`` too (``predict``
    calls it; one without a ``predict_batch`` method gets ``evaluate_batch``'s ``pred``).

    An estimator built without a loss (``Estimator(model, optimizer=...)``) trains on the loss the
    model returns: the whole batch goes to the model, labels included, and the metrics read the
    logits and the labels (:mod:`estimatorch._model_loss`; docs/loop.md, "The batch").

    Args:
        shift_labels: without a loss, whether the metrics compare the logits at token t with the
            label at t + 1 (the shift of a causal language model's loss). Defaults to None: for
            the ``transformers`` causal LM classes (those ``AutoModelForCausalLM`` builds).
        label_smoothing: without a loss, train and evaluate on the label-smoothed cross-entropy
            of the model's logits instead of its own loss (``Trainer``'s
            ``label_smoothing_factor``: the model is called without ``labels``; shifted for a
            causal LM, -100 skipped). A number in [0, 1). Defaults to 0 (the model's loss).

    Example:
        >>> class TwoInputs(BatchProcessor):
        ...     def fit_batch(self, estimator, batch, batch_axis=0):
        ...         (a, b), label = batch
        ...         estimator.fire("forward_begin", batch=batch)
        ...         with estimator.autocast():
        ...             pred = estimator.train_net(a, b)
        ...             loss = estimator.loss(pred, label)
        ...         estimator.fire("forward_end", batch=batch, pred=pred, loss=loss)
        ...         estimator.fire("backward_begin", batch=batch, loss=loss)
        ...         estimator.backward(loss)
        ...         estimator.fire("backward_end", batch=batch)
        ...         return (a, b), label, pred, loss
    """

    shift_labels: Optional[bool] = None
    _causal: Optional[tuple[Any, bool]] = None  # (the net, whether it is a causal LM)

    label_smoothing: float = 0.0

    def __init__(self, *, shift_labels: Optional[bool] = None, label_smoothing: float = 0.0):
        if shift_labels is not None:
            check_bool(shift_labels, "shift_labels")
        if not is_real(label_smoothing) or not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
        self.shift_labels = shift_labels
        self.label_smoothing = float(label_smoothing)

    def fit_batch(self, estimator: StepEstimator, batch: Any, batch_axis: int = 0) -> tuple[Any, Any, Any, Any]:
        """Forward, loss and backward for one batch (already on the device).

        Returns:
            ``(data, label, pred, loss)``, which ``batch_end`` handlers receive (without a loss:
            the whole batch, the labels and the logits metrics read, the model's loss).
        """
        listeners = estimator.dispatch  # events nobody listens to are not fired at all
        if listeners.forward_begin:
            estimator.fire("forward_begin", batch=batch)
        items, mean, loss_fn = None, True, estimator.loss
        with estimator.autocast():
            if loss_fn is None:
                data, shift = batch, self._shift(estimator.net)
                if estimator.weighs_items:  # the model divides its loss by these items (as Trainer has it)
                    items = own_loss_items(batch, shift, batch_axis)
                    if not self.label_smoothing and passes_num_items(estimator.net, batch):
                        batch = {**batch, "num_items_in_batch": items.clamp(min=1)
                                 if isinstance(items, torch.Tensor) else max(items, 1)}
                pred, label, loss = own_loss_step(estimator.train_net, estimator.net, batch, "train_data", shift,
                                                  self.label_smoothing)
                batch = data
            else:
                data, label = split_batch(batch)
                pred = call_net(estimator.train_net, data)
                loss = call_loss(loss_fn, pred, label, "train_data")
                if estimator.weighs_items or sums_items(loss_fn):
                    items, mean = loss_items(loss_fn, label, batch_axis), not sums_items(loss_fn)
        if listeners.forward_end:
            estimator.fire("forward_end", batch=batch, pred=pred, loss=loss)
        if listeners.backward_begin:
            estimator.fire("backward_begin", batch=batch, loss=loss)
        estimator.backward(loss, items, mean=mean)
        if listeners.backward_end:
            estimator.fire("backward_end", batch=batch)
        return data, label, pred, loss

    def evaluate_batch(self, estimator: StepEstimator, batch: Any, batch_axis: int = 0) -> tuple[Any, Any, Any, Any]:
        """The forward of one evaluation batch; ``evaluate`` runs it under ``torch.no_grad()``.

        Returns:
            ``(data, label, pred, loss)``.
        """
        with estimator.autocast():
            if estimator.val_loss is None:
                pred, label, loss = own_loss_step(estimator.val_net, estimator.val_net, batch, "val_data",
                                                  self._shift(estimator.val_net), self.label_smoothing)
                return batch, label, pred, loss
            data, label = split_batch(batch)
            pred = call_net(estimator.val_net, data)
            loss = call_loss(estimator.val_loss, pred, label, "val_data")
        return data, label, pred, loss

    def predict_batch(self, estimator: StepEstimator, batch: Any, batch_axis: int = 0) -> Any:
        """The forward of one prediction batch; ``predict`` runs it under ``torch.no_grad()``
        with ``val_net`` in eval mode.

        The inputs are the batch without its label: a bare tensor, ``x`` of ``(x,)``, a dict
        without its ``"label"``/``"labels"`` key, or ``(inputs..., label)`` without its last
        element (the convention of ``evaluate_batch``). Without a loss, the whole batch, as
        ``fit_batch`` gives it (labels, when there, included).

        Returns:
            ``pred``, the network's output (in the autocast dtype under mixed precision); without
            a loss, its logits as the model returns them (no shift, class axis last).
        """
        with estimator.autocast():
            if estimator.val_loss is None:
                return logits_of(call_net(estimator.val_net, model_inputs(batch)))
            return call_net(estimator.val_net, split_inputs(batch))

    def _shift(self, net: Any) -> bool:
        """``shift_labels``, or whether ``net`` is a causal LM (remembered for the net)."""
        if self.shift_labels is not None:
            return self.shift_labels
        causal = self._causal
        if causal is None or causal[0] is not net:
            causal = self._causal = (net, is_causal_lm(net))
        return causal[1]
