"""When a periodic action fires: one helper for ``every=`` / ``once=`` / ``before=`` /
``after=`` / a predicate, and for ``epoch_period`` / ``batch_period``.

Counts are 1-based occurrence numbers: the first batch of a run is batch 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional, Union

from ._checks import check_positive_int

__all__ = ["EventFilter"]


class EventFilter:
    """Decide from an occurrence count whether an action fires. All given conditions must hold.

    Conditions that no count can meet together (``before=3, after=5``; ``once=3, every=2``) are
    refused with a ``ValueError``: such a filter would never fire.

    Args:
        every: fire on counts divisible by ``every``. Defaults to None (no condition).
        once: fire only on this count, or on each count of an iterable. Defaults to None.
        before: fire only on counts < ``before``. Defaults to None.
        after: fire only on counts > ``after``. Defaults to None.
        predicate: fire only when ``predicate(count)`` is true. Defaults to None.

    Example:
        >>> f = EventFilter(every=2, after=3)
        >>> [n for n in range(1, 10) if f(n)]
        [4, 6, 8]
        >>> [n for n in range(1, 10) if EventFilter(once=[2, 5])(n)]
        [2, 5]
    """

    __slots__ = ("every", "once", "before", "after", "predicate", "_always")

    def __init__(self, every: Optional[int] = None, once: Union[int, Iterable[int], None] = None,
                 before: Optional[int] = None, after: Optional[int] = None,
                 predicate: Optional[Callable[[int], bool]] = None):
        self.every = check_positive_int(every, "every", allow_none=True)
        if once is None or isinstance(once, int):
            once_set = None if once is None else frozenset([check_positive_int(once, "once")])
        elif not isinstance(once, Iterable):
            raise TypeError(f"once must be a positive int or an iterable of them, got {once!r}")
        else:
            once_set = frozenset(check_positive_int(n, "once") for n in once)
            if not once_set:
                raise ValueError(f"once must name at least one count, got {once!r}")
        self.once = once_set
        self.before = check_positive_int(before, "before", allow_none=True)
        self.after = check_positive_int(after, "after", allow_none=True, minimum=0)
        if predicate is not None and not callable(predicate):
            raise TypeError(f"predicate must be callable, got {predicate!r}")
        self.predicate = predicate
        self._always = every is None and once is None and before is None and after is None and predicate is None
        if not self._can_fire():
            given = ", ".join(f"{k}={v!r}" for k, v in (("every", every), ("once", once), ("before", before),
                                                         ("after", after)) if v is not None)
            raise ValueError(f"{given} can never fire: no count (1, 2, ...) is > after, < before, "
                             "divisible by every and one of once at the same time")

    def _can_fire(self) -> bool:
        """Whether some count passes every/once/before/after (the predicate is not asked)."""
        if self.once is not None:
            return any(self._passes(n) for n in self.once)
        first = (self.after or 0) + 1
        if self.every is not None:
            first = -(-first // self.every) * self.every  # the first multiple of every from there
        return self.before is None or first < self.before

    def _passes(self, count: int) -> bool:
        return ((self.every is None or count % self.every == 0)
                and (self.before is None or count < self.before)
                and (self.after is None or count > self.after))

    def __call__(self, count: int) -> bool:
        if self._always:
            return True
        if self.every is not None and count % self.every:
            return False
        if self.once is not None and count not in self.once:
            return False
        if self.before is not None and count >= self.before:
            return False
        if self.after is not None and count <= self.after:
            return False
        return self.predicate is None or bool(self.predicate(count))

    def __repr__(self) -> str:
        parts = [f"{k}={getattr(self, k)!r}" for k in ("every", "once", "before", "after", "predicate")
                 if getattr(self, k) is not None]
        return f"EventFilter({', '.join(parts)})"
