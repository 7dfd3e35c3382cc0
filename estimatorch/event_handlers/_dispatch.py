"""Handler bookkeeping for one ``fit``: validation, default set, ordering, names, and the
per-event lists a step walks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional

from .._checks import is_real
from ..metrics.base import is_metric, metric_name
from .mixins import EVENTS

__all__ = ["Dispatch", "check_handlers", "handler_name", "order_handlers"]


def handler_name(handler: Any) -> str:
    name = getattr(handler, "name", None)
    return name if isinstance(name, str) and name else type(handler).__name__


def check_handlers(event_handlers: Any, arg: str = "event_handlers") -> list[Any]:
    """Normalise ``event_handlers`` to a list; each must inherit at least one event mixin."""
    if event_handlers is None:
        return []
    if isinstance(event_handlers, (str, bytes)) or not isinstance(event_handlers, Iterable):
        event_handlers = [event_handlers]
    handlers = list(event_handlers)
    mixins = tuple(EVENTS.values())
    for handler in handlers:
        if isinstance(handler, type):
            raise TypeError(f"{arg} holds the class {handler.__name__}; pass an instance: {handler.__name__}(...)")
        if not isinstance(handler, mixins):
            raise TypeError(
                f"{arg} holds {handler!r}, which inherits no event mixin; subclass one or more of "
                f"{', '.join(m.__name__ for m in mixins)} from estimatorch.event_handlers"
            )
        priority = getattr(handler, "priority", 0)
        if not is_real(priority) or priority != priority:
            raise ValueError(f"priority of {handler_name(handler)} must be a real number, got {priority!r}")
    return handlers


def order_handlers(user: Sequence[Any], defaults: Sequence[Any]) -> list[Any]:
    """Stable sort by priority (lower first): ties keep the user's order, users before defaults."""
    return sorted([*user, *defaults], key=lambda h: getattr(h, "priority", 0))


def unique_names(handlers: Sequence[Any]) -> dict[str, Any]:
    """``{name: handler}``; repeated names get ``_2``, ``_3``... in order (deterministic)."""
    names: dict[str, Any] = {}
    for handler in handlers:
        base = handler_name(handler)
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names[name] = handler
    return names


def check_metric_references(handlers: Sequence[Any], owned: Sequence[Any]) -> None:
    """Every metric a handler refers to (``monitor``, ``metrics``...) must be one the estimator
    owns, so that it is the object MetricHandler and evaluate update."""
    owned_ids = {id(m) for m in owned}
    for handler in handlers:
        for attr, value in getattr(handler, "__dict__", {}).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            for item in values:
                if is_metric(item) and id(item) not in owned_ids:
                    raise ValueError(
                        f"{handler_name(handler)}.{attr} refers to the metric "
                        f"{metric_name(item)!r}, which this estimator does not own. Pass one of "
                        f"est.train_metrics / est.val_metrics: "
                        f"{[metric_name(m) for m in owned]}"
                    )


class Dispatch:
    """One tuple of bound methods per event, holding only the handlers that subscribe."""

    __slots__ = (*EVENTS, "handlers", "by_name")
    # one tuple of bound methods per event, set from EVENTS in __init__
    train_begin: tuple[Callable[..., Any], ...]
    epoch_begin: tuple[Callable[..., Any], ...]
    batch_begin: tuple[Callable[..., Any], ...]
    forward_begin: tuple[Callable[..., Any], ...]
    forward_end: tuple[Callable[..., Any], ...]
    backward_begin: tuple[Callable[..., Any], ...]
    backward_end: tuple[Callable[..., Any], ...]
    batch_end: tuple[Callable[..., Any], ...]
    epoch_end: tuple[Callable[..., Any], ...]
    train_end: tuple[Callable[..., Any], ...]

    def __init__(self, handlers: Sequence[Any]):
        self.handlers = list(handlers)
        self.by_name = unique_names(self.handlers)
        for event, mixin in EVENTS.items():
            setattr(self, event, tuple(getattr(h, event) for h in self.handlers if isinstance(h, mixin)))

    def fire(self, event: str, estimator: Any, **kwargs: Any) -> bool:
        """Call every subscriber in order; True when any returned a truthy value."""
        stop = False
        for fn in getattr(self, event):
            if fn(estimator, **kwargs):
                stop = True
        return stop

    def fire_train_end(self, estimator: Any, failed: bool) -> None:
        """Fire ``train_end`` to every subscriber, even when one of them raises: the first error
        is raised afterwards, unless ``failed`` (another error propagates; each is logged)."""
        first: Optional[BaseException] = None
        for fn in self.train_end:
            try:
                fn(estimator)
            except Exception as err:  # noqa: BLE001 - every handler still gets its train_end
                if first is None:
                    first = err
                if failed:
                    estimator.logger.exception("train_end of %s failed while another error propagated",
                                               getattr(fn, "__self__", fn))
        if first is not None and not failed:
            raise first
