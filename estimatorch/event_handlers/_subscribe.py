"""Handlers whose events depend on their arguments: subscribe to an event only when it is used.

``fit`` calls a handler for an event only if it inherits the event's mixin. A handler that needs
an event for an optional feature (gradient histograms at ``backward_end``, say) picks, in
``__new__``, a subclass of itself that also inherits that mixin, so the per-step path calls it
only when the feature is on.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from .mixins import EVENTS

__all__ = ["periodic_events", "with_events"]

_CLASSES: dict[tuple[type, frozenset], type] = {}


def with_events(cls: type, events: Iterable[str]) -> type:
    """``cls``, or a subclass of it (same name) that also inherits the mixins of ``events``.

    The subclass adds no method: ``cls`` implements the events; the mixins only subscribe it.

    Example:
        >>> from estimatorch.event_handlers.mixins import BackwardEnd, TrainBegin
        >>> class H(TrainBegin):
        ...     def backward_end(self, estimator, **kwargs): pass
        >>> sub = with_events(H, {"backward_end"})
        >>> issubclass(sub, BackwardEnd), sub.__name__, with_events(H, ()) is H
        (True, 'H', True)
    """
    wanted = set(events)
    unknown = sorted(wanted - set(EVENTS))
    if unknown:
        raise ValueError(f"unknown event {unknown[0]!r}; events are {list(EVENTS)}")
    missing = tuple(EVENTS[e] for e in EVENTS if e in wanted and not issubclass(cls, EVENTS[e]))
    if not missing:
        return cls
    key = (cls, frozenset(m.__name__ for m in missing))
    sub = _CLASSES.get(key)
    if sub is None:
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        sub = _CLASSES[key] = type(cls.__name__, (cls, *missing), body)
    return sub


def periodic_events(cls: type, args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """For a handler built with ``batch_period`` / ``epoch_period`` arguments: the events whose
    period is set (both when the arguments do not bind: ``__init__`` then reports the error).

    Example:
        >>> class H:
        ...     def __init__(self, data, epoch_period=1, batch_period=None): pass
        >>> periodic_events(H, ([],), {"batch_period": 5})
        ['batch_end', 'epoch_end']
        >>> periodic_events(H, ([],), {"epoch_period": None, "batch_period": 5})
        ['batch_end']
    """
    try:
        bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
    except TypeError:
        return ["batch_end", "epoch_end"]
    bound.apply_defaults()
    return [event for event, arg in (("batch_end", "batch_period"), ("epoch_end", "epoch_period"))
            if bound.arguments.get(arg) is not None]
