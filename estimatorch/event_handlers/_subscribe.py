"""Handlers whose events depend on their arguments: subscribe to an event only when it is used.

``fit`` calls a handler for an event only if it inherits the event's mixin. A handler that needs
an event for an optional feature (gradient histograms at ``backward_end``, say) becomes an
instance of a subclass of itself that also inherits that mixin, so the per-step path calls it
only when the feature is on: :func:`subscribe` at the end of ``__init__`` (which sees the
arguments a subclass really passed), or :func:`with_events` in ``__new__``. Either way
``inspect.signature`` of the handler class shows its ``__init__`` arguments (see
``StatefulHandler``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

from .mixins import EVENTS

__all__ = ["periodic_events", "subscribe", "with_events"]

_CLASSES: dict[tuple[type, frozenset], type] = {}
_ORIGIN: dict[type, tuple[type, tuple[str, ...]]] = {}  # subclass -> (class, events it adds)


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
    if cls in _ORIGIN:  # subscribing a subscribed handler again: one subclass of the original
        cls, added = _ORIGIN[cls]
        wanted.update(added)
    names = tuple(e for e in EVENTS if e in wanted and not issubclass(cls, EVENTS[e]))
    if not names:
        return cls
    key = (cls, frozenset(names))
    sub = _CLASSES.get(key)
    if sub is None:
        body: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        if cls.__reduce__ is object.__reduce__ and cls.__reduce_ex__ is object.__reduce_ex__:
            body["__reduce__"] = _reduce  # pickle finds no such class under the module's name
        sub = _CLASSES[key] = type(cls.__name__, (cls, *(EVENTS[e] for e in names)), body)
        _ORIGIN[sub] = (cls, names)
    return sub


def _reduce(handler: Any) -> tuple:
    """Pickle a handler of a subscribed subclass as its original class plus the events added."""
    getstate = getattr(handler, "__getstate__", None)  # object.__getstate__ is Python 3.11+
    return _new_subscribed, _ORIGIN[type(handler)], getstate() if getstate is not None else handler.__dict__


def _new_subscribed(cls: type, events: tuple[str, ...]) -> Any:
    """An uninitialised instance of ``with_events(cls, events)`` (unpickling fills its state)."""
    return object.__new__(with_events(cls, events))


def subscribe(handler: Any, events: Iterable[str]) -> None:
    """Subscribe ``handler`` to ``events`` as well: its class becomes :func:`with_events`'s.

    Call it at the end of ``__init__``, once the options are known; unlike a choice made in
    ``__new__``, it sees what a subclass's own ``__init__`` passed on.

    Example:
        >>> from estimatorch.event_handlers.mixins import BatchEnd, TrainBegin
        >>> class H(TrainBegin):
        ...     def __init__(self, every=None):
        ...         self.every = every
        ...         subscribe(self, ["batch_end"] if every else [])
        ...     def batch_end(self, estimator, **kwargs): pass
        >>> isinstance(H(every=5), BatchEnd), isinstance(H(), BatchEnd), type(H(every=5)).__name__
        (True, False, 'H')
    """
    cls = type(handler)
    sub = with_events(cls, events)
    if sub is not cls:
        handler.__class__ = sub


def periodic_events(cls: type, args: tuple, kwargs: dict[str, Any]) -> list[str]:
    """For a handler built with ``batch_period`` / ``epoch_period`` arguments: the events whose
    period is set. Both when that cannot be told from the arguments: when they do not bind
    (``__init__`` then reports the error), or when ``cls.__init__`` does not take both periods
    (a subclass with its own ``__init__`` that sets them itself).

    Example:
        >>> class H:
        ...     def __init__(self, data, epoch_period=1, batch_period=None): pass
        >>> periodic_events(H, ([],), {"batch_period": 5})
        ['batch_end', 'epoch_end']
        >>> periodic_events(H, ([],), {"epoch_period": None, "batch_period": 5})
        ['batch_end']
        >>> class Mine(H):
        ...     def __init__(self, data): super().__init__(data, batch_period=5)
        >>> periodic_events(Mine, ([],), {})
        ['batch_end', 'epoch_end']
    """
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]  # the class's own, as defined
    if not {"batch_period", "epoch_period"} <= set(signature.parameters):
        return ["batch_end", "epoch_end"]
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return ["batch_end", "epoch_end"]
    bound.apply_defaults()
    return [event for event, arg in (("batch_end", "batch_period"), ("epoch_end", "epoch_period"))
            if bound.arguments.get(arg) is not None]
