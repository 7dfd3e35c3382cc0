"""LambdaHandler: plain functions as handlers, with ``every`` / ``once`` / ... filters."""

from __future__ import annotations

from typing import Any, Callable, Optional

from .._checks import check_state_keys, is_real
from .._schedule import EventFilter
from ..events import (
    BATCH_EVENTS,
    EVENTS,
    BackwardBegin,
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    EstimatorView,
    ForwardBegin,
    ForwardEnd,
    StatefulHandler,
    TrainBegin,
    TrainEnd,
)

__all__ = ["LambdaHandler"]


def _event_method(event: str) -> Callable[..., Any]:
    def method(self: "LambdaHandler", estimator: EstimatorView, **kwargs: Any) -> Any:
        count = self.counts[event] = self.counts[event] + 1
        if self._filter(count):
            return self._fns[event](estimator, **kwargs)
        return None

    method.__name__ = event
    return method


class LambdaHandler(StatefulHandler, TrainBegin, EpochBegin, BatchBegin, ForwardBegin, ForwardEnd, BackwardBegin,
                    BackwardEnd, BatchEnd, EpochEnd, TrainEnd):
    """Run plain functions on events: ``LambdaHandler(batch_end=fn, every=100)``.

    Each function is called as ``fn(estimator, **kwargs)`` with the event's keywords; a
    ``batch_end``/``epoch_end`` function may return True to stop. The handler subscribes only to
    the events given, and to ``train_begin`` to start its counts afresh in every ``fit``. Filters
    count each event's occurrences from 1: batches for batch-level events, epochs for
    epoch-level events. The counts are the handler's state (restored on resume).

    Args:
        train_begin, epoch_begin, batch_begin, forward_begin, forward_end, backward_begin,
            backward_end, batch_end, epoch_end, train_end: functions. At least one is required.
        every: fire on every ``every``-th occurrence. Defaults to None.
        once: fire only on this occurrence (or these). Defaults to None.
        before: fire only on occurrences < ``before``. Defaults to None.
        after: fire only on occurrences > ``after``. Defaults to None.
        predicate: fire only when ``predicate(count)`` is true. Defaults to None.
        priority: Defaults to 0.

    Example:
        >>> seen = []
        >>> h = LambdaHandler(batch_end=lambda est, **kw: seen.append(kw["loss"]), every=2)
        >>> for i in range(5):
        ...     _ = h.batch_end(None, batch=None, pred=None, label=None, loss=i)
        >>> seen
        [1, 3]
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = tuple(f"counts.{event}" for event in BATCH_EVENTS)

    state_attributes = ("counts",)

    def __init__(self, *, every: Optional[int] = None, once: Any = None, before: Optional[int] = None,
                 after: Optional[int] = None, predicate: Optional[Callable[[int], bool]] = None,
                 priority: float = 0, **functions: Optional[Callable[..., Any]]):
        unknown = sorted(set(functions) - set(EVENTS))
        if unknown:
            raise TypeError(f"LambdaHandler got an unknown event {unknown[0]!r}; events are {list(EVENTS)}")
        self._fns = {e: fn for e, fn in functions.items() if fn is not None}
        if not self._fns:
            raise ValueError(f"LambdaHandler needs at least one event function, one of {list(EVENTS)}")
        for event, fn in self._fns.items():
            if not callable(fn):
                raise TypeError(f"{event} must be callable, got {fn!r}")
        self._filter = EventFilter(every=every, once=once, before=before, after=after, predicate=predicate)
        if not is_real(priority) or priority != priority:
            raise ValueError(f"priority must be a real number, got {priority!r}")
        self.priority = priority
        self.counts = dict.fromkeys(self._fns, 0)

    def listens_to(self, event: str) -> bool:
        """The events it has functions for, and ``train_begin`` (every fit counts afresh)."""
        return event == "train_begin" or event in self._fns

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counts; the next events continue from them."""
        check_state_keys(state, self.state_attributes, self.name)
        counts = state["counts"]
        check_state_keys(counts, self._fns, f"{self.name}.counts")
        self.counts = {event: int(counts[event]) for event in self._fns}

    def __reduce__(self) -> Any:
        raise TypeError("LambdaHandler holds plain functions and cannot be pickled")

    def __deepcopy__(self, memo: dict) -> "LambdaHandler":
        new = object.__new__(type(self))
        new.__dict__.update({k: (dict(v) if k == "counts" else v) for k, v in self.__dict__.items()})
        return new

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.counts = dict.fromkeys(self._fns, 0)  # every fit counts afresh
        if "train_begin" in self._fns:
            _fire_train_begin(self, estimator, **kwargs)


_fire_train_begin = _event_method("train_begin")
for _event in EVENTS:  # one method per event; listens_to keeps only the given events
    if _event != "train_begin":
        setattr(LambdaHandler, _event, _event_method(_event))
