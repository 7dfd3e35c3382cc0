"""Argument checks shared by every layer: each names the argument and the value it got.

Lowest layer (beside :mod:`estimatorch.distributed` and :mod:`estimatorch.rng`): it imports
nothing of the package, so samplers, metrics, the checkpoint store and the handlers all use the
same checks and the same messages.

Example:
    >>> check_positive_int(3, "patience", minimum=0)
    3
    >>> check_positive_int(-1, "patience", minimum=0)
    Traceback (most recent call last):
    ...
    ValueError: patience must be a non-negative int, got -1
    >>> is_int(True), is_int(2)
    (False, True)
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing_extensions comes with torch; only the type checker reads it here
    from typing_extensions import TypeGuard

__all__ = ["check_bool", "check_file_prefix", "check_positive_int", "check_real", "check_state_keys",
           "is_int", "is_real", "user_stacklevel", "warn_user"]


def is_int(value: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool`` (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> TypeGuard[float]:
    """A real number that is not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_bool(value: Any, arg: str) -> bool:
    """``value`` when it is a ``bool``; else ``TypeError`` naming ``arg``."""
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {value!r}")
    return value


def check_positive_int(value: Any, arg: str, *, allow_none: bool = False, minimum: int = 1) -> Any:
    """Validate an int argument, naming it and the value in the error."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{arg} must be {kind}{' or None' if allow_none else ''}, got {value!r}")
    return value


def check_real(value: Any, arg: str, *, allow_none: bool = False, minimum: float = 0.0,
               strict: bool = False) -> Any:
    """Validate a real argument ``>= minimum`` (``> minimum`` when ``strict``); NaN is refused."""
    if value is None and allow_none:
        return None
    if not is_real(value) or not (value > minimum if strict else value >= minimum):
        bound = f"{'>' if strict else '>='} {minimum:g}"
        raise ValueError(f"{arg} must be a number {bound}{' or None' if allow_none else ''}, got {value!r}")
    return value


def check_file_prefix(value: Any, arg: str) -> str:
    """A non-empty name that is not a path: the start of the files a handler writes."""
    if not isinstance(value, str) or not value or os.sep in value or (os.altsep and os.altsep in value):
        raise ValueError(f"{arg} must be a non-empty file-name prefix (no path separator), got {value!r}")
    return value


def check_state_keys(state: Any, keys: Iterable[str], owner: str) -> None:
    """Raise ``ValueError`` naming the first of ``keys`` missing from ``state``."""
    if not isinstance(state, dict):
        raise TypeError(f"state of {owner} must be a dict, got {type(state).__name__}")
    for key in keys:
        if key not in state:
            raise ValueError(f"state of {owner} is missing the key {key!r}")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` at which a warning raised by the caller of this function is reported at
    the first frame outside estimatorch (the user's line, e.g. their ``fit`` call), whatever the
    depth of the library's own calls. For ``warnings.warn(..., stacklevel=user_stacklevel())``."""
    frame = sys._getframe(1)  # the function about to warn: stacklevel 1
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` reported at the user's line (see :func:`user_stacklevel`)."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
