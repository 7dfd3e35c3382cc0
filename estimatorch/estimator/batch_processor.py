"""The step: :class:`BatchProcessor` runs forward and backward for one batch."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .._batches import call_loss, call_net, split_batch, split_inputs
from ..events import Dispatch

__all__ = ["BatchProcessor", "StepEstimator"]


class StepEstimator(Protocol):
    """What a :class:`BatchProcessor` uses of the estimator (``Estimator`` satisfies it): the nets
    and losses, mixed precision, the backward pass, and the events of a step with the question
    of who listens (:attr:`dispatch`)."""

    loss: Callable[..., torch.Tensor]
    val_loss: Callable[..., torch.Tensor]

    @property
    def train_net(self) -> nn.Module:
        """The module the training step calls."""

    @property
    def val_net(self) -> nn.Module:
        """The module evaluation and prediction call."""

    @property
    def dispatch(self) -> Dispatch:
        """The current fit's handlers per event: ``dispatch.forward_end`` is falsy when none listens."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of the estimator's ``precision``."""

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled under ``"16-mixed"``."""

    def fire(self, event: str, **kwargs: Any) -> bool:
        """Call the current fit's handlers of ``event``."""


class BatchProcessor:
    """Forward and backward for one training batch, and the forward of one evaluation or
    prediction batch.

    Replace it (``Estimator(..., batch_processor=MyProcessor())``) to change the step, e.g. for
    several inputs or a custom loss, without subclassing :class:`~estimatorch.Estimator`. A
    custom ``fit_batch`` fires the forward and backward events with ``estimator.fire(...)`` and
    uses ``estimator.autocast()`` and ``estimator.backward(loss)`` to keep mixed precision
    working (and may skip an event nobody listens to: ``if estimator.dispatch.forward_end:``). It
    does not step the optimizer: ``GradientUpdateHandler`` does, at ``batch_end``.
    A processor that reads batches its own way overrides ``predict_batch`` too (``predict``
    calls it; one without a ``predict_batch`` method gets ``evaluate_batch``'s ``pred``).

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

    def fit_batch(self, estimator: StepEstimator, batch: Any, batch_axis: int = 0) -> tuple[Any, Any, Any, Any]:
        """Forward, loss and backward for one batch (already on the device).

        Returns:
            ``(data, label, pred, loss)``, which ``batch_end`` handlers receive.
        """
        data, label = split_batch(batch)
        listeners = estimator.dispatch  # events nobody listens to are not fired at all
        if listeners.forward_begin:
            estimator.fire("forward_begin", batch=batch)
        with estimator.autocast():
            pred = call_net(estimator.train_net, data)
            loss = call_loss(estimator.loss, pred, label, "train_data")
        if listeners.forward_end:
            estimator.fire("forward_end", batch=batch, pred=pred, loss=loss)
        if listeners.backward_begin:
            estimator.fire("backward_begin", batch=batch, loss=loss)
        estimator.backward(loss)
        if listeners.backward_end:
            estimator.fire("backward_end", batch=batch)
        return data, label, pred, loss

    def evaluate_batch(self, estimator: StepEstimator, batch: Any, batch_axis: int = 0) -> tuple[Any, Any, Any, Any]:
        """The forward of one evaluation batch; ``evaluate`` runs it under ``torch.no_grad()``.

        Returns:
            ``(data, label, pred, loss)``.
        """
        data, label = split_batch(batch)
        with estimator.autocast():
            pred = call_net(estimator.val_net, data)
            loss = call_loss(estimator.val_loss, pred, label, "val_data")
        return data, label, pred, loss

    def predict_batch(self, estimator: StepEstimator, batch: Any, batch_axis: int = 0) -> Any:
        """The forward of one prediction batch; ``predict`` runs it under ``torch.no_grad()``
        with ``val_net`` in eval mode.

        The inputs are the batch without its label: a bare tensor, ``x`` of ``(x,)``, a dict
        without its ``"label"``/``"labels"`` key, or ``(inputs..., label)`` without its last
        element (the convention of ``evaluate_batch``).

        Returns:
            ``pred``, the network's output (in the autocast dtype under mixed precision).
        """
        with estimator.autocast():
            return call_net(estimator.val_net, split_inputs(batch))
