"""What a handler monitors: a metric object or a metric's name (resolved at ``fit`` start), and
whether its value improved: the one rule early stopping and the best checkpoint share (and the
check of the threshold a best file waits for)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from .._checks import is_real
from ..metrics.base import is_metric, metric_name

__all__ = ["check_monitor", "check_threshold", "improved", "resolve_mode", "resolve_monitors"]


def check_monitor(monitor: Any, owner: str) -> Optional[str]:
    """Check a handler's ``monitor`` argument (a metric object, a metric's name, or None);
    returns the name when one was given (the handler keeps it and is resolved at ``fit`` start)."""
    if isinstance(monitor, str):
        if not monitor:
            raise ValueError(f"{owner}: monitor must name a metric (e.g. 'val_loss'), got ''")
        return monitor
    if monitor is not None and not is_metric(monitor):
        raise TypeError(f"{owner}: monitor must be a metric's name (e.g. 'val_loss') or a metric the estimator owns "
                        f"(e.g. est.val_metrics[0]), got {monitor!r}")
    return None


def resolve_monitors(handlers: Sequence[Any], metrics: Sequence[Any], aliases: Optional[Mapping[Any, Any]] = None,
                     logger: Optional[logging.Logger] = None) -> None:
    """At ``fit`` start, give every handler that monitors a metric by name (its
    ``monitor_name``) the estimator's metric of that name (its ``resolve_monitor(metric)``).

    ``aliases`` maps a name, or the ``id`` of a metric object, that is not among ``metrics`` to
    the metric it stands for (several eval sets: ``"val_loss"`` and the estimator's own
    ``val_loss`` stand for the first set's ``val_<set>_loss``); a handler following one is logged.

    Raises:
        ValueError: no metric has that name; the message lists the names there are.
    """
    by_name = {metric_name(m): m for m in metrics}
    aliases = aliases or {}
    for handler in handlers:
        wanted = getattr(handler, "monitor_name", None)
        if wanted is None:
            given = getattr(handler, "monitor", None)
            if id(given) in aliases and callable(getattr(handler, "resolve_monitor", None)):
                _follow(handler, metric_name(given), aliases[id(given)], logger)
            continue
        if wanted not in by_name and wanted in aliases:
            _follow(handler, wanted, aliases[wanted], logger)
            continue
        if wanted not in by_name:
            hint = ""
            if f"val_{wanted}" in by_name or f"train_{wanted}" in by_name:
                hint = f" (metric names carry a train_ or val_ prefix: val_{wanted}?)"
            raise ValueError(f"{type(handler).__name__}: monitor {wanted!r} is not a metric of this estimator{hint}; "
                             f"its metrics are {', '.join(repr(n) for n in by_name)}")
        handler.resolve_monitor(by_name[wanted])


def _follow(handler: Any, given: str, metric: Any, logger: Optional[logging.Logger]) -> None:
    handler.resolve_monitor(metric)
    if logger is not None:
        logger.info("%s monitors %s: the first eval set's %s (name another set's to choose it)",
                    type(handler).__name__, given, metric_name(metric))


def resolve_mode(mode: str, monitor: Any, owner: str, *, unresolved: bool = False) -> str:
    """``"min"`` or ``"max"``; ``"auto"`` follows the monitor's ``higher_is_better`` (and stays
    ``"auto"`` while the monitor is ``unresolved``, a name not yet resolved)."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode != "auto" or unresolved:
        return mode
    higher = getattr(monitor, "higher_is_better", None)
    if not isinstance(higher, bool):
        raise ValueError(f"{owner}: mode='auto' needs the monitor's higher_is_better, which "
                         f"{metric_name(monitor)!r} does not declare; pass mode='min' or mode='max'")
    return "max" if higher else "min"


def improved(value: float, best: float, mode: str, min_delta: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``min_delta`` in ``mode`` (``nan`` never does).

    Example:
        >>> improved(0.8, 1.0, "min"), improved(0.95, 1.0, "min", min_delta=0.1), improved(2.0, 1.0, "max")
        (True, False, True)
    """
    if mode == "min":
        return value < best - min_delta
    return value > best + min_delta


def check_threshold(value: Any, keeps_best: bool) -> None:
    """Check ``initial_value_threshold``: None, or a number for a handler that keeps the best file."""
    if value is None:
        return
    if not is_real(value):
        raise TypeError(f"initial_value_threshold must be a number or None, got {value!r}")
    if math.isnan(float(value)):
        raise ValueError(f"initial_value_threshold must be a number, got {value!r}")
    if not keeps_best:
        raise ValueError(f"initial_value_threshold={value!r} applies to the best file: pass save_best=True or "
                         "save_best_only=True (with monitor=)")
