"""Whether a monitored metric improved: the one rule early stopping and the best checkpoint share."""

from __future__ import annotations

from typing import Any

from ..metrics.base import metric_name

__all__ = ["improved", "resolve_mode"]


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
