"""Kept for handlers written against earlier releases: :func:`subscribe` is deprecated.

A handler now subscribes by overriding the hooks of the mixins it inherits, and leaves out the
events its options do not use with :meth:`estimatorch.events.Handler.listens_to`; ``fit``
decides once, at its start (:func:`estimatorch.events.subscribes`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from ..events import EVENTS

__all__ = ["subscribe"]


def subscribe(handler: Any, events: Iterable[str]) -> None:
    """Deprecated: ``fit`` also calls ``handler`` for ``events`` (hooks its class defines
    without inheriting their mixins). Inherit the mixins and override
    :meth:`~estimatorch.events.Handler.listens_to` instead."""
    wanted = set(events)
    unknown = sorted(wanted - set(EVENTS))
    if unknown:
        raise ValueError(f"unknown event {unknown[0]!r}; events are {list(EVENTS)}")
    warnings.warn("subscribe() is deprecated: inherit the events' mixins and override Handler.listens_to",
                  DeprecationWarning, stacklevel=2)
    handler.__dict__["_legacy_events"] = frozenset(handler.__dict__.get("_legacy_events", ())) | wanted
