"""The event mixins: one documented hook each, and no state.

A handler subscribes to an event by inheriting its mixin *and overriding* its hook: ``fit`` sorts
the handlers it is given into one list per event once, at its start (:class:`~.dispatch.Dispatch`),
keeping only those whose class overrides the mixin's no-op hook and whose
:meth:`~.handler.Handler.listens_to` agrees, so a step never calls a handler that does not listen.

The loop (see :meth:`estimatorch.Estimator.fit`)::

    train_begin
    for epoch:
        epoch_begin
        for batch in train_data:
            batch_begin
            forward_begin -> forward -> forward_end
            backward_begin -> backward -> backward_end
            batch_end          (a truthy return from any handler stops after this batch)
        epoch_end              (a truthy return from any handler stops after this epoch)
    train_end                  (always, also when an exception escapes)

Handlers receive the estimator first and everything else by keyword; accept ``**kwargs`` so new
keywords never break you. ``batch_end`` and ``epoch_end`` return a python bool (never a tensor:
testing a tensor would force a host-device sync).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # the estimator's side of the contract; typing only
    from .view import EstimatorView

__all__ = [
    "EVENTS",
    "NOTICES",
    "AfterTrainEnd",
    "CheckpointSaved",
    "BackwardBegin",
    "BackwardEnd",
    "BatchBegin",
    "BatchEnd",
    "EpochBegin",
    "EpochEnd",
    "ForwardBegin",
    "ForwardEnd",
    "TrainBegin",
    "TrainEnd",
    "ValidationEnd",
]


class TrainBegin:
    """Inherit it and override ``train_begin`` to hear that event."""

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Called once when ``fit`` starts, before any data is read. Reset per-run state here."""


class TrainEnd:
    """Inherit it and override ``train_end`` to hear that event."""

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Called once when ``fit`` ends, also when an exception escapes the loop."""


class EpochBegin:
    """Inherit it and override ``epoch_begin`` to hear that event."""

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Called at the start of every epoch (and of every ``evaluate`` pass)."""


class EpochEnd:
    """Inherit it and override ``epoch_end`` to hear that event."""

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> Optional[bool]:
        """Called at the end of every epoch, also one cut short by a stop. Return True to stop."""
        return None


class BatchBegin:
    """Inherit it and override ``batch_begin`` to hear that event."""

    def batch_begin(self, estimator: EstimatorView, *, batch: Any, **kwargs: Any) -> None:
        """Called before each batch is processed. ``batch`` is already on the device."""


class BatchEnd:
    """Inherit it and override ``batch_end`` to hear that event."""

    def batch_end(self, estimator: EstimatorView, *, batch: Any, pred: Any, label: Any, loss: Any,
                  **kwargs: Any) -> Optional[bool]:
        """Called after each batch's forward and backward. Return True to stop training."""
        return None


class ForwardBegin:
    """Inherit it and override ``forward_begin`` to hear that event."""

    def forward_begin(self, estimator: EstimatorView, *, batch: Any, **kwargs: Any) -> None:
        """Called before the network's forward pass."""


class ForwardEnd:
    """Inherit it and override ``forward_end`` to hear that event."""

    def forward_end(self, estimator: EstimatorView, *, batch: Any, pred: Any, loss: Any, **kwargs: Any) -> None:
        """Called after the forward pass and the loss, before backward."""


class BackwardBegin:
    """Inherit it and override ``backward_begin`` to hear that event."""

    def backward_begin(self, estimator: EstimatorView, *, batch: Any, loss: Any, **kwargs: Any) -> None:
        """Called before ``loss.backward()``."""


class BackwardEnd:
    """Inherit it and override ``backward_end`` to hear that event."""

    def backward_end(self, estimator: EstimatorView, *, batch: Any, **kwargs: Any) -> None:
        """Called after ``loss.backward()``, before ``batch_end`` (where the optimizer steps)."""


class CheckpointSaved:
    """Inherit it and override ``checkpoint_saved`` to hear that event."""

    def checkpoint_saved(self, estimator: EstimatorView, *, written: Sequence[str], removed: Sequence[str],
                         **kwargs: Any) -> None:
        """Called on the process that wrote them when a handler of the fit wrote checkpoint files
        or sharded checkpoint directories (``written``, absolute paths) and deleted others
        (``removed``: retention, a batch save an epoch end replaced). Also from a background
        writer thread (``async_save``), and during ``train_end`` (the checkpoint of a stop
        by a signal): keep it short, and do not assume the thread."""


class ValidationEnd:
    """Inherit it and override ``validation_end`` to hear that event."""

    def validation_end(self, estimator: EstimatorView, *, values: Mapping[str, float], step: int, epoch: int,
                       phase: str, **kwargs: Any) -> Optional[bool]:
        """Called on every rank once a validation of the fit has run (``ValidationHandler``, every
        ``epoch_period`` epochs and/or ``batch_period`` batches), with the values it measured
        (``{"val_loss": ..., ...}``: python floats, reduced over the ranks), the ``step`` it
        validated (the batches trained so far), the ``epoch`` it ran in (from 1) and the
        ``phase`` it ran in: ``"batch_end"`` (a step-level validation) or ``"epoch_end"``.
        ``History.validations`` holds it already. Return True to stop the fit at this boundary
        (early stopping); the handler that ran the validation returns it from its event."""


class AfterTrainEnd:
    """Inherit it and override ``after_train_end`` to hear that event."""

    def after_train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Called once after ``train_end`` has reached every handler (also when an exception
        escapes): report what the others' ``train_end`` did, such as the checkpoint written when
        a signal stopped the fit."""


#: event name -> mixin, in the order the loop first fires them.
EVENTS: dict[str, type] = {
    "train_begin": TrainBegin,
    "epoch_begin": EpochBegin,
    "batch_begin": BatchBegin,
    "forward_begin": ForwardBegin,
    "forward_end": ForwardEnd,
    "backward_begin": BackwardBegin,
    "backward_end": BackwardEnd,
    "batch_end": BatchEnd,
    "epoch_end": EpochEnd,
    "train_end": TrainEnd,
}

#: the events fired once per training batch (a handler counting them counts batches).
BATCH_EVENTS = ("batch_begin", "forward_begin", "forward_end", "backward_begin", "backward_end", "batch_end")

#: notices outside the step loop: name -> mixin. Subscribed like the events.
NOTICES: dict[str, type] = {
    "checkpoint_saved": CheckpointSaved,
    "validation_end": ValidationEnd,
    "after_train_end": AfterTrainEnd,
}
