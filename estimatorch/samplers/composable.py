"""Composable samplers (the Determined family): build a training stream by hand, in the order
shuffle -> repeat -> shard -> (batch) -> skip.

- :class:`ReproducibleShuffleSampler`: a fresh permutation of its sampler per ``(seed, epoch)``.
- :class:`RepeatSampler` / :class:`RepeatBatchSampler`: an infinite stream, calling the inner
  sampler's ``set_epoch(0, 1, 2, ...)`` on each pass.
- :class:`DistributedSampler` / :class:`DistributedBatchSampler`: item ``i`` goes to rank
  ``i % num_workers``, without padding.
- :class:`SkipSampler` / :class:`SkipBatchSampler`: skip the first ``skip`` items once, to resume.

The rules are checked at construction, with a ``ValueError`` where one is broken:

1. Shuffle first: shuffling an infinite (repeated) stream is refused.
2. Repeat when training, after the shuffle. Repeating an infinite stream is refused.
3. Shard after repeating. Sharding first and repeating each shard is allowed, but the shards
   then may have unequal epoch boundaries (a shard of 10 items over 3 ranks has 4, 3 and 3), so
   ranks drift apart by a pass over time.
4. Skip last: wrapping a skip sampler in any of these classes is refused (only a torch
   ``BatchSampler`` may wrap a :class:`SkipSampler`). Prefer skipping batches.

Positioning computes indices and never loads data. Through these classes, torch's
``BatchSampler`` / ``SequentialSampler`` / ``DistributedSampler``, ranges and resumable samplers,
a skip costs one pass's permutation whatever its size: the pass and the offset in it are
computed, not replayed. Under any other inner sampler (say a ``RandomSampler`` with a generator)
the skipped indices are replayed: exact, but in time proportional to the skip.

Example:
    >>> from itertools import islice
    >>> from torch.utils.data import BatchSampler
    >>> def make_batch_sampler(skip):
    ...     sampler = ReproducibleShuffleSampler(range(10), seed=0)     # shuffle first
    ...     sampler = RepeatSampler(sampler)                             # repeat when training
    ...     sampler = DistributedSampler(sampler, num_workers=2, rank=0) # shard after the repeat
    ...     batches = BatchSampler(sampler, batch_size=3, drop_last=False)
    ...     return SkipBatchSampler(batches, skip)                      # skip last
    >>> uninterrupted = list(islice(make_batch_sampler(0), 8))
    >>> list(islice(make_batch_sampler(5), 3)) == uninterrupted[5:]
    True
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sized
from typing import Any, Optional

from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data import DistributedSampler as _TorchDistributedSampler

from .. import distributed, rng
from .._checks import check_positive_int, check_state_keys, is_int
from ._index_shuffle import check_permutation, order_fingerprint, resolve_permutation
from .resumable import ResumableSampler, _iterate, _shuffled

__all__ = [
    "DistributedBatchSampler",
    "DistributedSampler",
    "RepeatBatchSampler",
    "RepeatSampler",
    "ReproducibleShuffleSampler",
    "SkipBatchSampler",
    "SkipSampler",
]

_ORDER = "shuffle -> repeat -> shard -> skip"


def _inner(obj: Any) -> Any:
    if isinstance(obj, _Wrapper):
        return obj._inner
    return obj.sampler if isinstance(obj, BatchSampler) else None


def sampler_chain(obj: Any) -> Iterator[Any]:
    """``obj``, the sampler it wraps, and so on down to the leaf."""
    while obj is not None:
        yield obj
        obj = _inner(obj)


def _positional(obj: Any) -> bool:
    """Whether ``obj``'s order is a function of ``set_epoch`` alone, so passes can be jumped."""
    for o in sampler_chain(obj):
        if isinstance(o, _Wrapper) or type(o) is BatchSampler:
            continue
        if isinstance(o, ResumableSampler):
            return len(o) == o.num_samples  # no pending start
        return isinstance(o, (range, list, tuple)) or type(o) in (SequentialSampler, _TorchDistributedSampler)
    return False


def _length(obj: Any) -> Optional[int]:
    try:
        return len(obj)
    except TypeError:
        return None


def _set_epoch(obj: Any, epoch: int) -> None:
    if hasattr(obj, "set_epoch"):
        obj.set_epoch(epoch)
    elif isinstance(obj, BatchSampler) and hasattr(obj.sampler, "set_epoch"):
        obj.sampler.set_epoch(epoch)


def _iter_from(source: Any, start: int) -> Iterator[Any]:
    """Iterate ``source`` from its item ``start``: computed through known samplers, else replayed."""
    if isinstance(source, _Wrapper):
        return source._iter_from(start)
    if type(source) is BatchSampler and start:  # batches are consecutive chunks: skip k * size
        size = source.batch_size
        return _batches(_iter_from(source.sampler, start * size), size, source.drop_last)
    return itertools.islice(iter(source), start, None)


def _batches(items: Iterator[int], size: int, drop_last: bool) -> Iterator[list[int]]:
    while True:
        batch = list(itertools.islice(items, size))
        if not batch or (drop_last and len(batch) < size):
            return
        yield batch


def _state_of(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, BatchSampler):
        return {"batch_size": obj.batch_size, "drop_last": obj.drop_last, "sampler": _state_of(obj.sampler)}
    return {}


def _load_state(obj: Any, state: Any) -> None:
    name = type(obj).__name__
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    elif isinstance(obj, BatchSampler):
        check_state_keys(state, ("batch_size", "drop_last", "sampler"), name)
        _check_same(state, "batch_size", obj.batch_size, name)
        _check_same(state, "drop_last", obj.drop_last, name)
        _load_state(obj.sampler, state["sampler"])
    elif state != {}:
        raise ValueError(f"state of {name} must be empty (it has no state), got {state!r}")


def _check_same(state: dict[str, Any], key: str, value: Any, owner: str) -> None:
    if state[key] != value:
        raise ValueError(f"state of {owner} has {key}={state[key]!r} but this one has "
                         f"{key}={value!r}: the stream would shift")


class _Wrapper(Sampler[Any]):
    """Base: checks and stores the wrapped sampler under ``_arg`` (``sampler``/``batch_sampler``)."""

    _arg = "sampler"

    def __init__(self, inner: Iterable[Any]):
        name = type(self).__name__
        if isinstance(inner, Iterator) or not isinstance(inner, Iterable):
            raise TypeError(f"{self._arg} must be a re-iterable sampler, got {type(inner).__name__}")
        for o in sampler_chain(inner):
            if isinstance(o, SkipSampler):
                raise ValueError(f"{name} cannot wrap a {type(o).__name__}: skip must be the last "
                                 f"step ({_ORDER})")
        leaf = inner.sampler if isinstance(inner, BatchSampler) else inner
        if type(leaf) is RandomSampler and leaf.generator is None:
            warnings.warn(f"{name} wraps a RandomSampler without a generator: its order comes from "
                          "the global torch RNG, so a resumed stream differs. Use "
                          "ReproducibleShuffleSampler.", stacklevel=3)
        setattr(self, self._arg, inner)

    @property
    def _inner(self) -> Any:
        return getattr(self, self._arg)

    def _iter_from(self, start: int) -> Iterator[Any]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        yield from self._iter_from(0)  # lazy: nothing is computed for an iterator left unused

    def state_dict(self) -> dict[str, Any]:
        """This sampler's values (plain ints), with the wrapped sampler's state nested."""
        return {**self._own_state(), self._arg: _state_of(self._inner)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` on a missing key or a different stream."""
        check_state_keys(state, (*self._own_state(), self._arg), type(self).__name__)
        self._load_own(state)
        _load_state(self._inner, state[self._arg])

    def _own_state(self) -> dict[str, Any]:
        return {}

    def _load_own(self, state: dict[str, Any]) -> None:
        pass


class ReproducibleShuffleSampler(_Wrapper):
    """Permute the indices of ``sampler``, a fresh permutation per epoch from ``(seed, epoch)``.

    The order is a pure function of ``(seed, epoch, the inner indices)``: iterating twice
    without :meth:`set_epoch` yields the same order. :class:`RepeatSampler` sets the epoch of
    each pass. Shuffling an infinite stream (a :class:`RepeatSampler`) is refused.

    Args:
        sampler: a finite sampler (or range, list) whose indices are permuted.
        seed: Defaults to :data:`estimatorch.rng.DEFAULT_SEED`.
        permutation: how the order is computed, as for
            :class:`~estimatorch.samplers.ResumableRandomSampler` (``"randperm"``, ``"feistel"``
            or ``"auto"``: ``"feistel"`` above 2**24 items). With ``"feistel"``, a ``range``,
            list or tuple is read where the order points, never copied. Defaults to ``"auto"``.

    Example:
        >>> s = ReproducibleShuffleSampler(range(6), seed=1)
        >>> first = list(s)
        >>> sorted(first), list(s) == first
        ([0, 1, 2, 3, 4, 5], True)
        >>> s.set_epoch(1)
        >>> list(s) == first
        False
    """

    def __init__(self, sampler: Iterable[Any], seed: Optional[int] = None, *, permutation: str = "auto"):
        super().__init__(sampler)
        if any(isinstance(o, RepeatSampler) for o in sampler_chain(sampler)):
            raise ValueError(f"ReproducibleShuffleSampler cannot shuffle an infinite stream: its "
                             f"{type(sampler).__name__} is or holds a RepeatSampler ({_ORDER})")
        self.seed = rng.DEFAULT_SEED if seed is None else rng.check_seed(seed)
        self.epoch = 0
        self._permutation = permutation
        resolve_permutation(permutation, 0)  # checked now, resolved by the length when iterated

    @property
    def permutation(self) -> str:
        """How the order is computed for the wrapped sampler's length: ``"randperm"`` or ``"feistel"``
        (``"auto"`` decides by ``len(sampler)``, as ``"randperm"`` for a sampler without one)."""
        return resolve_permutation(self._permutation, _length(self._inner) or 0)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation the next iteration yields."""
        self.epoch = check_positive_int(epoch, "epoch", minimum=0)

    def __len__(self) -> int:
        return len(self._inner)

    def _iter_from(self, start: int) -> Iterator[Any]:
        inner = self._inner
        items = inner if isinstance(inner, (range, list, tuple)) else list(inner)
        order = _shuffled(len(items), self.seed, self.epoch, self.permutation)
        return map(items.__getitem__, _iterate(order, start))

    def _own_state(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self.epoch, **order_fingerprint(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` on a missing key, another permutation or a
        different stream."""
        if isinstance(state, dict):
            check_permutation(state.get("permutation"), self.permutation, f"a state of {type(self).__name__}")
        super().load_state_dict(state)

    def _load_own(self, state: dict[str, Any]) -> None:
        _check_same(state, "seed", self.seed, type(self).__name__)
        self.set_epoch(state["epoch"])


class RepeatSampler(_Wrapper):
    """Repeat ``sampler`` forever, calling its ``set_epoch(0)``, ``set_epoch(1)``, ... per pass.

    Infinite, so it has no length. A pass that yields nothing raises ``RuntimeError`` instead
    of spinning. Repeating an infinite stream is refused.

    Args:
        sampler: a finite, non-empty sampler.

    Example:
        >>> from itertools import islice
        >>> list(islice(RepeatSampler(range(3)), 7))
        [0, 1, 2, 0, 1, 2, 0]
    """

    def __init__(self, sampler: Iterable[Any]):
        super().__init__(sampler)
        name = type(self).__name__
        if any(isinstance(o, RepeatSampler) for o in sampler_chain(sampler)):
            raise ValueError(f"{name} cannot repeat a stream that is already infinite "
                             f"(it holds a RepeatSampler)")
        if isinstance(sampler, Sized) and _length(sampler) == 0:
            raise ValueError(f"{self._arg} must not be empty: {name} would never yield, got "
                             f"a {type(sampler).__name__} of length 0")

    def _iter_from(self, start: int) -> Iterator[Any]:
        n = _length(self._inner) if start and _positional(self._inner) else None
        if n:  # jump to the pass and offset; nothing before is generated
            return self._passes(*divmod(start, n))
        return itertools.islice(self._passes(0, 0), start, None)

    def _passes(self, epoch: int, offset: int) -> Iterator[Any]:
        while True:
            _set_epoch(self._inner, epoch)
            empty = True
            for item in _iter_from(self._inner, offset):
                empty = False
                yield item
            if empty and offset == 0:
                raise RuntimeError(f"{self._arg} yielded nothing in pass {epoch}: "
                                   f"{type(self).__name__} would never end")
            epoch, offset = epoch + 1, 0


class RepeatBatchSampler(RepeatSampler):
    """Repeat ``batch_sampler`` forever, setting the epoch of each pass like :class:`RepeatSampler`.

    Args:
        batch_sampler: a finite, non-empty batch sampler.

    Example:
        >>> from itertools import islice
        >>> from torch.utils.data import BatchSampler
        >>> list(islice(RepeatBatchSampler(BatchSampler(range(5), 2, drop_last=True)), 5))
        [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]
    """

    _arg = "batch_sampler"

    def __init__(self, batch_sampler: Iterable[Any]):
        super().__init__(batch_sampler)


class DistributedSampler(_Wrapper):
    """This rank's shard of ``sampler``: item ``i`` of the stream goes to rank ``i % num_workers``.

    Not :class:`torch.utils.data.DistributedSampler` (same name): this one shards any stream
    round-robin and neither shuffles nor pads, so on a finite stream the ranks' lengths may
    differ by one. Shard after a :class:`RepeatSampler` so that every rank gets as many items.

    Args:
        sampler: the stream to shard.
        num_workers: ranks sharing the stream (not DataLoader workers). Defaults to the world size.
        rank: this rank, in ``[0, num_workers)``. Defaults to this process's rank.

    Example:
        >>> list(DistributedSampler(range(7), num_workers=3, rank=1))
        [1, 4]
    """

    def __init__(self, sampler: Iterable[Any], num_workers: Optional[int] = None,
                 rank: Optional[int] = None):
        super().__init__(sampler)
        self.num_workers = check_positive_int(
            distributed.get_world_size() if num_workers is None else num_workers, "num_workers")
        self.rank = distributed.get_rank() if rank is None else rank
        if not is_int(self.rank) or not 0 <= self.rank < self.num_workers:
            raise ValueError(f"rank must be an int in [0, {self.num_workers}), got {rank!r}")

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` on to the wrapped sampler (when it has ``set_epoch``)."""
        _set_epoch(self._inner, epoch)

    def __len__(self) -> int:
        n = len(self._inner)
        return n // self.num_workers + int(self.rank < n % self.num_workers)

    def _iter_from(self, start: int) -> Iterator[Any]:
        inner = _iter_from(self._inner, start * self.num_workers + self.rank)
        return itertools.islice(inner, 0, None, self.num_workers)

    def _own_state(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers}

    def _load_own(self, state: dict[str, Any]) -> None:
        _check_same(state, "num_workers", self.num_workers, type(self).__name__)


class DistributedBatchSampler(DistributedSampler):
    """This rank's shard of ``batch_sampler``: batch ``i`` goes to rank ``i % num_workers``.

    Not a torch class; see :class:`DistributedSampler` for the semantics.

    Args:
        batch_sampler: the stream of batches to shard.
        num_workers: ranks sharing the stream. Defaults to the world size.
        rank: this rank. Defaults to this process's rank.

    Example:
        >>> from torch.utils.data import BatchSampler
        >>> list(DistributedBatchSampler(BatchSampler(range(7), 2, False), num_workers=2, rank=1))
        [[2, 3], [6]]
    """

    _arg = "batch_sampler"

    def __init__(self, batch_sampler: Iterable[Any], num_workers: Optional[int] = None,
                 rank: Optional[int] = None):
        super().__init__(batch_sampler, num_workers, rank)


class SkipSampler(_Wrapper):
    """Skip the first ``skip`` items of ``sampler``, once: in the next iteration only.

    Always last (nothing of this module may wrap it). The skipped items are jumped over, not
    produced, where the stream is positional (see the module notes). ``skip`` is what the next
    iteration skips: it is 0 once an iteration has started.

    Args:
        sampler: the stream to resume.
        skip: items to skip. Defaults to 0.

    Example:
        >>> s = SkipSampler(range(5), skip=2)
        >>> list(s), list(s)
        ([2, 3, 4], [0, 1, 2, 3, 4])
    """

    def __init__(self, sampler: Iterable[Any], skip: int = 0):
        super().__init__(sampler)
        self.skip = skip

    @property
    def skip(self) -> int:
        """What the next iteration skips; assigning it is checked like the argument."""
        return self._skip

    @skip.setter
    def skip(self, skip: int) -> None:
        self._skip = check_positive_int(skip, "skip", minimum=0)

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` on to the wrapped sampler (when it has ``set_epoch``)."""
        _set_epoch(self._inner, epoch)

    def __len__(self) -> int:
        return max(len(self._inner) - self.skip, 0)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the skip is spent when iteration begins, not when iter() is called, so an
        # iterator created and dropped unused (DataLoader does so with workers) does not spend it.
        start, self._skip = self._skip, 0
        yield from _iter_from(self._inner, start)

    def _own_state(self) -> dict[str, Any]:
        return {"skip": self.skip}

    def _load_own(self, state: dict[str, Any]) -> None:
        self.skip = state["skip"]


class SkipBatchSampler(SkipSampler):
    """Skip the first ``skip`` batches of ``batch_sampler``, once: the batches already trained.

    Args:
        batch_sampler: the stream of batches to resume.
        skip: batches to skip. Defaults to 0.

    Example:
        >>> from torch.utils.data import BatchSampler
        >>> list(SkipBatchSampler(BatchSampler(range(7), 2, False), skip=2))
        [[4, 5], [6]]
    """

    _arg = "batch_sampler"

    def __init__(self, batch_sampler: Iterable[Any], skip: int = 0):
        super().__init__(batch_sampler, skip)
