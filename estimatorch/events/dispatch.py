"""Handler bookkeeping for one ``fit``: validation, ordering, names, and the per-event lists a
step walks, decided once by which hooks each handler overrides (see :func:`subscribes`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._checks import is_real
from ..metrics.base import is_metric, metric_name
from .handler import Handler, declared
from .mixins import EVENTS, NOTICES

if TYPE_CHECKING:  # the estimator's side of the contract; typing only
    from .view import EstimatorView

__all__ = ["Dispatch", "accumulation_steps", "check_fit", "check_handlers", "check_metric_references",
           "handler_name", "order_handlers", "state_attributes", "subscribes", "unique_names"]

#: every hook a handler may subscribe to: the loop's events, then the notices.
HOOKS: dict[str, type] = {**EVENTS, **NOTICES}


def handler_name(handler: Any) -> str:
    """The handler's ``name`` when it has a non-empty one, else its class name."""
    name = getattr(handler, "name", None)
    return name if isinstance(name, str) and name else type(handler).__name__


def check_handlers(event_handlers: Any, arg: str = "event_handlers") -> list[Any]:
    """Normalise ``event_handlers`` to a list; each must inherit at least one event mixin."""
    if event_handlers is None:
        return []
    if isinstance(event_handlers, (str, bytes)) or not isinstance(event_handlers, Iterable):
        event_handlers = [event_handlers]
    handlers = list(event_handlers)
    mixins = tuple(HOOKS.values())
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


def subscribes(handler: Any, event: str) -> bool:
    """Whether ``fit`` calls ``handler`` for ``event``: it inherits the event's mixin, its class
    overrides the mixin's no-op hook, and its ``listens_to(event)`` (if it has one) agrees.

    Example:
        >>> from estimatorch.events import BatchEnd, EpochEnd
        >>> class H(BatchEnd, EpochEnd):
        ...     def epoch_end(self, estimator, **kwargs): pass
        >>> subscribes(H(), "epoch_end"), subscribes(H(), "batch_end")
        (True, False)
    """
    mixin = HOOKS[event]
    legacy = event in getattr(handler, "__dict__", {}).get("_legacy_events", ())
    if not (isinstance(handler, mixin) or legacy) or getattr(type(handler), event, None) is getattr(mixin, event):
        return False
    listens = getattr(handler, "listens_to", None)
    return bool(listens(event)) if callable(listens) else True


def check_fit(handlers: Sequence[Any], estimator: EstimatorView, resume: bool) -> None:
    """Call every handler's ``check_fit`` (before any work of ``fit``)."""
    for handler in handlers:
        check = getattr(handler, "check_fit", None)
        if check is None and callable(getattr(handler, "_check_fit", None)):
            warnings.warn(f"{type(handler).__qualname__}._check_fit is deprecated: subclass "
                          "estimatorch.events.Handler and override check_fit", DeprecationWarning, stacklevel=2)
            check = handler._check_fit
        if check is not None:
            check(estimator, resume=resume)


def state_attributes(handler: Any) -> tuple[str, ...]:
    """The attributes ``handler`` declares as its state (empty when it declares none: its
    ``load_state_dict`` is then the only judge of a saved state)."""
    if not isinstance(handler, Handler) and getattr(handler, "_state_attrs", None):
        warnings.warn(f"{type(handler).__qualname__}._state_attrs is deprecated: subclass "
                      "estimatorch.events.Handler and declare state_attributes", DeprecationWarning, stacklevel=2)
        return tuple(handler._state_attrs)
    return tuple(declared(handler, "state_attributes"))


def accumulation_steps(handlers: Sequence[Any]) -> int:
    """Batches per optimizer step: the ``accumulation_steps`` of the handler that steps the
    optimizer (the first that declares one), else 1."""
    return next((steps for steps in (declared(h, "accumulation_steps") for h in handlers) if steps is not None), 1)


class Dispatch:
    """One tuple of bound methods per event (and notice), holding only the handlers that
    subscribe (:func:`subscribes`), in priority order. Built once per ``fit``."""

    __slots__ = (*HOOKS, "handlers", "by_name")
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
    checkpoint_saved: tuple[Callable[..., Any], ...]
    validation_end: tuple[Callable[..., Any], ...]
    after_train_end: tuple[Callable[..., Any], ...]

    def __init__(self, handlers: Sequence[Any]):
        self.handlers = list(handlers)
        self.by_name = unique_names(self.handlers)
        for event in HOOKS:
            setattr(self, event, tuple(getattr(h, event) for h in self.handlers if subscribes(h, event)))

    def fire(self, event: str, estimator: EstimatorView, **kwargs: Any) -> bool:
        """Call every subscriber in order; True when any returned a truthy value."""
        stop = False
        for fn in getattr(self, event):
            if fn(estimator, **kwargs):
                stop = True
        return stop

    def fire_train_end(self, estimator: EstimatorView, failed: bool) -> None:
        """Fire ``train_end``, then ``after_train_end``, to every subscriber, even when one of
        them raises: the first error is raised afterwards, unless ``failed`` (another error
        propagates; each is logged)."""
        first: Optional[BaseException] = None
        for fn in (*self.train_end, *self.after_train_end):
            try:
                fn(estimator)
            except Exception as err:  # every handler still gets its train_end
                if first is None:
                    first = err
                if failed:
                    estimator.logger.exception("train_end of %s failed while another error propagated",
                                               getattr(fn, "__self__", fn))
        if first is not None and not failed:
            raise first
