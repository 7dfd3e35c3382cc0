"""Resumable samplers (the Helios family): an epoch's order is a function of ``(seed, epoch)``,
and iteration can start at any batch without generating or loading what comes before.

``fit`` rebuilds a plain :class:`~torch.utils.data.DataLoader` with one of these automatically:
:class:`ResumableDistributedSampler` under ``torch.distributed``, else
:class:`ResumableRandomSampler` when the loader shuffles, else
:class:`ResumableSequentialSampler`. Pass one as the loader's ``sampler`` to choose yourself.

Positioning costs the same at batch 10 and at batch 1,000,000: the epoch's permutation is
recomputed from its seed and sliced; nothing before the start is yielded or fetched.

Example:
    >>> s = ResumableRandomSampler(10, seed=3, batch_size=2)
    >>> full = list(s)
    >>> s.set_start_iter(3)          # skip 3 batches, in the next iteration only
    >>> list(s) == full[6:]
    True
    >>> list(s) == full              # the start was used once: Helios's trap avoided
    True
    >>> s.start_iter = 4             # the Helios way: the same as set_start_iter(4)
    >>> list(s) == full[8:]
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Optional, Union

import torch
from torch.utils.data import Sampler

from .. import distributed, rng
from .._checks import check_positive_int, check_state_keys, is_int

__all__ = [
    "ResumableDistributedSampler",
    "ResumableRandomSampler",
    "ResumableSampler",
    "ResumableSequentialSampler",
]

_CHUNK = 4096  # indices converted to python ints at a time


def _length(data_source: Union[Sized, int], arg: str = "data_source") -> int:
    if isinstance(data_source, bool):
        raise TypeError(f"{arg} must be a sized dataset or an int, got {data_source!r}")
    if isinstance(data_source, int):
        if data_source < 0:
            raise ValueError(f"{arg} must be a non-negative length, got {data_source!r}")
        return data_source
    if not isinstance(data_source, Sized):
        raise TypeError(f"{arg} must be a sized dataset or an int, got {type(data_source).__name__}")
    return len(data_source)


class ResumableSampler(Sampler[int]):
    """Base class: settable epoch and starting batch, and a ``state_dict``.

    Subclasses implement :meth:`epoch_indices`, the full order of an epoch for this rank, as a
    pure function of the epoch. :meth:`set_start_iter` (or assigning :attr:`start_iter`) skips
    whole batches (``batch_size`` samples each) in the next iteration only; later iterations
    start at 0 again.

    Args:
        batch_size: samples per batch, so that a start counted in batches skips the right number
            of samples. Defaults to 1.
    """

    def __init__(self, batch_size: int = 1):
        self.batch_size = check_positive_int(batch_size, "batch_size")
        self.epoch = 0
        self._start_index = 0

    # -- positioning -----------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields."""
        self.epoch = check_positive_int(epoch, "epoch", minimum=0)

    @property
    def start_iter(self) -> int:
        """Whole batches the next iteration skips (0 once an iteration has started).

        Assigning it positions the sampler exactly like :meth:`set_start_iter` (Helios users
        resume with ``sampler.start_iter = k``).
        """
        return self._start_index // self.batch_size

    @start_iter.setter
    def start_iter(self, start_iter: int) -> None:
        self.set_start_iter(start_iter)

    def set_start_iter(self, start_iter: int) -> None:
        """Skip ``start_iter`` batches in the next iteration (and only that one)."""
        self._start_index = check_positive_int(start_iter, "start_iter", minimum=0) * self.batch_size

    def set_start_index(self, start_index: int) -> None:
        """Skip ``start_index`` samples in the next iteration (and only that one)."""
        self._start_index = check_positive_int(start_index, "start_index", minimum=0)

    # -- order -----------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in a full epoch for this rank."""
        raise NotImplementedError

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """Every index of ``epoch`` for this rank, in order (an int64 tensor)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        # A generator: the start is taken when iteration begins, not when iter() is called, so an
        # iterator created and dropped unused (DataLoader does so with workers) does not spend it.
        start, self._start_index = self._start_index, 0
        if start < self.num_samples:
            yield from _iterate(self.epoch_indices(self.epoch)[start:])

    def __len__(self) -> int:
        """Samples the next iteration yields (a full epoch minus the start)."""
        return max(self.num_samples - self._start_index, 0)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start_index": self._start_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("epoch", "start_index"), type(self).__name__)
        self.set_epoch(state["epoch"])
        self.set_start_index(state["start_index"])


def _iterate(indices: torch.Tensor) -> Iterator[int]:
    for chunk in indices.split(_CHUNK):
        yield from chunk.tolist()


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(rng.derive_seed(seed, epoch))
    return torch.randperm(n, generator=generator)


class ResumableSequentialSampler(ResumableSampler):
    """Indices ``0 .. n-1`` in order, every epoch.

    Args:
        data_source: a sized dataset or its length.
        batch_size: Defaults to 1.
    """

    def __init__(self, data_source: Union[Sized, int], batch_size: int = 1):
        super().__init__(batch_size)
        self.n = _length(data_source)

    @property
    def num_samples(self) -> int:
        return self.n

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        return torch.arange(self.n)


class ResumableRandomSampler(ResumableSampler):
    """A fresh permutation every epoch, drawn from a generator seeded with ``(seed, epoch)``.

    Args:
        data_source: a sized dataset or its length.
        seed: Defaults to :data:`estimatorch.rng.DEFAULT_SEED`.
        batch_size: Defaults to 1.
    """

    def __init__(self, data_source: Union[Sized, int], seed: Optional[int] = None, batch_size: int = 1):
        super().__init__(batch_size)
        self.n = _length(data_source)
        self.seed = rng.DEFAULT_SEED if seed is None else rng._check_seed(seed)

    @property
    def num_samples(self) -> int:
        return self.n

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        return _permutation(self.n, self.seed, epoch)


class ResumableDistributedSampler(ResumableSampler):
    """This rank's share of each epoch, like :class:`torch.utils.data.DistributedSampler`.

    The epoch's order (shuffled from ``(seed, epoch)`` or sequential) is padded by repeating its
    head, or truncated with ``drop_last``, to a multiple of ``num_replicas``; rank ``r`` takes
    every ``num_replicas``-th index from ``r``. A start counted in batches skips
    ``batch_size`` of *this rank's* samples per batch (not global samples: Helios's trap).

    Args:
        data_source: a sized dataset or its length.
        num_replicas: Defaults to the world size.
        rank: Defaults to this process's rank.
        shuffle: Defaults to True.
        seed: Defaults to :data:`estimatorch.rng.DEFAULT_SEED`.
        drop_last: drop the tail instead of padding. Defaults to False.
        batch_size: per-rank batch size. Defaults to 1.
    """

    def __init__(self, data_source: Union[Sized, int], num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: Optional[int] = None,
                 drop_last: bool = False, batch_size: int = 1):
        super().__init__(batch_size)
        self.n = _length(data_source)
        self.num_replicas = check_positive_int(
            distributed.get_world_size() if num_replicas is None else num_replicas, "num_replicas")
        self.rank = distributed.get_rank() if rank is None else rank
        if not is_int(self.rank) or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank must be an int in [0, {self.num_replicas}), got {rank!r}")
        self.shuffle = bool(shuffle)
        self.seed = rng.DEFAULT_SEED if seed is None else rng._check_seed(seed)
        self.drop_last = bool(drop_last)
        if self.drop_last:
            self._per_rank = self.n // self.num_replicas
        else:
            self._per_rank = -(-self.n // self.num_replicas)

    @property
    def num_samples(self) -> int:
        return self._per_rank

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The whole order of ``epoch`` before padding and sharding: what one process would see
        (``evaluate`` and ``predict`` split it over the ranks without padding)."""
        return _permutation(self.n, self.seed, epoch) if self.shuffle else torch.arange(self.n)

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        order = self.epoch_order(epoch)
        total = self._per_rank * self.num_replicas
        if total > self.n:
            repeats = -(-total // max(self.n, 1))
            order = order.repeat(repeats)
        return order[:total][self.rank::self.num_replicas]
