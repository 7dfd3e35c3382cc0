"""Whether a monitored metric improved: the one rule early stopping and the best checkpoint share (and the
check of the threshold a best file waits for)."""

from __future__ import annotations

import math
from typing import Any

from .._checks import is_real
from ..metrics.base import metric_name

__all__ = ["check_threshold", "improved", "resolve_mode"]


def resolve_mode(mode: str, monitor: Any, owner: str) -> str:
    """``"min"`` or ``"max"``; ``"auto"`` follows the monitor's ``higher_is_better``."""
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    if mode != "auto":
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
