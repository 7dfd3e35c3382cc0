"""ValidationHandler: evaluate every few epochs and/or batches."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Optional

from .._checks import check_positive_int, check_state_keys
from .._schedule import EventFilter
from ..events import BatchEnd, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, check_handlers

__all__ = ["ValidationHandler"]


class ValidationHandler(StatefulHandler, TrainBegin, BatchEnd, EpochEnd):
    """Call ``eval_fn(val_data, batch_axis=..., event_handlers=...)`` on a schedule.

    Runs at priority -1000: after the optimizer step and metric updates, before checkpoints and
    early stopping, which then see fresh validation values. It subscribes only to the events
    of the periods set, so with ``epoch_period`` alone a step calls nothing; the counts it keeps
    for its periods (epochs, and batches over the run) are its state, restored on resume (None
    for a period not set). ``est.position`` tells where training stands.

    **Every validation is recorded**, a step-level one (``batch_period``) as an epoch's: after
    ``eval_fn`` it calls ``est.record_validation(values)`` (the values ``eval_fn`` returned, or
    the val metrics'), which keeps them in ``History.validations`` with the step validated and
    sends the notice ``validation_end``: ``LoggingHandler`` logs a step-level one when it runs
    (``[Epoch 1/2][Step 30] Validation: val_loss: ...``), ``TensorBoardHandler`` and the
    trackers write it at its step, ``EarlyStoppingHandler`` and ``CheckpointHandler(save_best=True)``
    follow the validations of a val monitor (patience counted in validations; the best file
    written at the boundary of the validation that found it, with the weights it measured). When
    a handler asks to stop there (early stopping), this handler's event returns True.

    Args:
        val_data: the validation batches: a re-iterable (a ``DataLoader``, a list), not empty; or
            a dict of named eval sets (``est.evaluate`` gives each its metrics ``val_<set>_<name>``).
        eval_fn: normally ``est.evaluate``.
        epoch_period: evaluate every this many epochs; None for never. Defaults to 1.
        batch_period: evaluate every this many batches (counted over the run). Defaults to None.
        event_handlers: handlers ``eval_fn`` passes its events to. Defaults to None.

    Example:
        >>> calls = []
        >>> h = ValidationHandler([1], lambda data, **kw: calls.append(len(data)), epoch_period=2)
        >>> class Est:
        ...     batch_axis = 0
        ...     def record_validation(self, values=None): return False
        >>> h.train_begin(Est())
        >>> for _ in range(4):
        ...     _ = h.epoch_end(Est())
        >>> calls
        [1, 1]
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("current_batch",)

    priority = -1000

    def __init__(self, val_data: Iterable[Any], eval_fn: Callable[..., Any], epoch_period: Optional[int] = 1,
                 batch_period: Optional[int] = None, event_handlers: Any = None):
        sets = val_data.items() if isinstance(val_data, Mapping) else [(None, val_data)]
        if isinstance(val_data, Mapping) and not val_data:
            raise ValueError("val_data is an empty dict: give it named eval sets, e.g. {'valid': loader}")
        for name, data in sets:
            _check_val_data(data, "val_data" if name is None else f"val_data[{name!r}]")
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable (e.g. est.evaluate), got {eval_fn!r}")
        self.val_data = val_data
        self.eval_fn = eval_fn
        self.epoch_period = check_positive_int(epoch_period, "epoch_period", allow_none=True)
        self.batch_period = check_positive_int(batch_period, "batch_period", allow_none=True)
        if epoch_period is None and batch_period is None:
            raise ValueError("epoch_period and batch_period are both None: it would never evaluate")
        self.event_handlers = check_handlers(event_handlers, "event_handlers")
        self._epoch_filter = EventFilter(every=epoch_period) if epoch_period else None
        self._batch_filter = EventFilter(every=batch_period) if batch_period else None
        self._reset()

    def listens_to(self, event: str) -> bool:
        """Only the events of the periods set."""
        if event == "batch_end":
            return self.batch_period is not None
        if event == "epoch_end":
            return self.epoch_period is not None
        return True

    def _reset(self) -> None:
        # counted only for a period that is set: the events of the others are not heard
        self._epochs: Optional[int] = 0 if self._epoch_filter is not None else None
        self._batches: Optional[int] = 0 if self._batch_filter is not None else None

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._reset()

    def _evaluate(self, estimator: EstimatorView) -> bool:
        """Validate, record it (``validation_end`` to every listener); True: one asks to stop."""
        values = self.eval_fn(self.val_data, batch_axis=estimator.batch_axis, event_handlers=self.event_handlers)
        return estimator.record_validation(values if isinstance(values, Mapping) else None)

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        if self._batch_filter is None:
            return False
        if self._batches is None:  # resumed from a state that did not count them
            self._batches = estimator.position.step
        self._batches += 1
        return self._batch_filter(self._batches) and self._evaluate(estimator)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> bool:
        if self._epoch_filter is None:
            return False
        if self._epochs is None:  # resumed from a state that did not count them
            self._epochs = estimator.position.epoch
        self._epochs += 1
        return self._epoch_filter(self._epochs) and self._evaluate(estimator)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"current_epoch": epochs, "current_batch": batches}`` counted for the periods (None
        for a period not set)."""
        return {"current_epoch": self._epochs, "current_batch": self._batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("current_epoch", "current_batch"), self.name)
        for key, attr, counted in (("current_epoch", "_epochs", self._epoch_filter is not None),
                                   ("current_batch", "_batches", self._batch_filter is not None)):
            value = state[key]
            if value is not None:
                value = check_positive_int(value, f"state of {self.name}: {key}", minimum=0)
            setattr(self, attr, value if counted else None)


def _check_val_data(data: Any, arg: str) -> None:
    if not isinstance(data, Iterable) or isinstance(data, (str, bytes, Mapping)):
        raise TypeError(f"{arg} must be an iterable of batches, got {type(data).__name__}")
    if isinstance(data, Iterator):
        raise TypeError(f"{arg} is an iterator ({type(data).__name__}), which can be read only once; "
                        "pass a list or a DataLoader")
    if _length(data) == 0:
        raise ValueError(f"{arg} is empty: a {type(data).__name__} of length 0")


def _length(data: Any) -> Optional[int]:
    try:
        return len(data)
    except TypeError:  # no length (e.g. a DataLoader over an IterableDataset)
        return None
