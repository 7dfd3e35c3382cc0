"""Resumable samplers (the Helios family): an epoch's order is a function of ``(seed, epoch)``,
and iteration can start at any batch without generating or loading what comes before.

``fit`` rebuilds a plain :class:`~torch.utils.data.DataLoader` with one of these automatically:
:class:`ResumableDistributedSampler` under ``torch.distributed``, else
:class:`ResumableRandomSampler` when the loader shuffles, else
:class:`ResumableSequentialSampler`. Pass one as the loader's ``sampler`` to choose yourself.

Positioning costs the same at batch 10 and at batch 1,000,000: the epoch's order is recomputed
from its seed and read from the start; nothing before the start is yielded or fetched. The
shuffled samplers' ``permutation`` argument chooses how an order is computed (see
:mod:`estimatorch.samplers._index_shuffle`): ``torch.randperm`` (O(n) memory and time at each
epoch start) or a keyed bijection (``"feistel"``: O(1) memory, O(1) work per index, for a
billion samples); ``"auto"``, the default, takes ``randperm`` up to 2**24 samples.

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
from typing import Any, Callable, Optional, Union

import torch
from torch.utils.data import Sampler

from .. import distributed, rng
from .._checks import check_positive_int, check_state_keys, is_int
from ._index_shuffle import IndexShuffle, check_permutation, order_fingerprint, resolve_permutation

__all__ = [
    "EpochOrder",
    "ResumableDistributedSampler",
    "ResumableRandomSampler",
    "ResumableSampler",
    "ResumableSequentialSampler",
]

_CHUNK = 4096  # indices computed and converted to python ints at a time


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


class EpochOrder:
    """An epoch's order of ``len(order)`` indices, read like a 1-D int64 tensor but computed only
    where it is read: ``order[i]`` (a 0-d tensor), ``order[a:b]`` (any step) and
    ``order[positions]`` (a list or tensor of positions) are int64 tensors.

    Args:
        source: the whole order as a tensor, or a function from a 1-D int64 tensor of positions
            in ``[0, length)`` to the indices there.
        length: the order's length; only with a function.

    Example:
        >>> import torch
        >>> order = EpochOrder(lambda positions: positions * 10, length=5)
        >>> order[1:4].tolist(), order[[4, 0]].tolist(), int(order[-1]), len(order)
        ([10, 20, 30], [40, 0], 40, 5)
    """

    def __init__(self, source: Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
                 length: Optional[int] = None):
        self._tensor: Optional[torch.Tensor] = None
        if isinstance(source, torch.Tensor):
            self._tensor, self._length = source, len(source)
        else:
            self._at, self._length = source, check_positive_int(length, "length", minimum=0)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, key: Any) -> torch.Tensor:
        if self._tensor is not None:
            return self._tensor[key]
        n = self._length
        if isinstance(key, slice):
            return self._at(torch.arange(*key.indices(n)))
        if is_int(key):
            if not -n <= key < n:
                raise IndexError(f"position {key} is out of range for an order of {n} indices")
            return self._at(torch.tensor([key % n]))[0]
        positions = torch.as_tensor(key, dtype=torch.int64).reshape(-1)
        if positions.numel() and not (-n <= int(positions.min()) and int(positions.max()) < n):
            raise IndexError(f"positions must lie in [-{n}, {n}) for an order of {n} indices")
        return self._at(positions.remainder(n) if positions.numel() else positions)


class ResumableSampler(Sampler[int]):
    """Base class: settable epoch and starting batch, and a ``state_dict``.

    Subclasses implement :meth:`epoch_indices`, the full order of an epoch for this rank, as a
    pure function of the epoch, and may implement :meth:`epoch_view`, the same order computed
    where it is read (iteration reads it, a chunk at a time). :meth:`set_start_iter` (or
    assigning :attr:`start_iter`) skips whole batches (``batch_size`` samples each) in the next
    iteration only; later iterations start at 0 again.

    Args:
        batch_size: samples per batch, so that a start counted in batches skips the right number
            of samples. Defaults to 1.
    """

    #: how a shuffled order is computed, ``"randperm"`` or ``"feistel"``; None: not shuffled.
    permutation: Optional[str] = None

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
        """Every index of ``epoch`` for this rank, in order (an int64 tensor of ``num_samples``)."""
        raise NotImplementedError

    def epoch_view(self, epoch: int) -> EpochOrder:
        """This rank's order of ``epoch``, computed where it is read (by default: all of
        :meth:`epoch_indices` at once)."""
        return EpochOrder(self.epoch_indices(epoch))

    def __iter__(self) -> Iterator[int]:
        # A generator: the start is taken when iteration begins, not when iter() is called, so an
        # iterator created and dropped unused (DataLoader does so with workers) does not spend it.
        start, self._start_index = self._start_index, 0
        if start < self.num_samples:
            yield from _iterate(self.epoch_view(self.epoch), start)

    def __len__(self) -> int:
        """Samples the next iteration yields (a full epoch minus the start)."""
        return max(self.num_samples - self._start_index, 0)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The epoch and the start, and the ``permutation`` when it is not ``"randperm"``."""
        return {"epoch": self.epoch, "start_index": self._start_index, **order_fingerprint(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` on a missing key or another permutation."""
        name = type(self).__name__
        check_state_keys(state, ("epoch", "start_index"), name)
        check_permutation(state.get("permutation"), self.permutation, f"a state of {name}")
        self.set_epoch(state["epoch"])
        self.set_start_index(state["start_index"])


def _iterate(order: EpochOrder, start: int) -> Iterator[int]:
    for low in range(start, len(order), _CHUNK):
        yield from order[low:low + _CHUNK].tolist()


def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(rng.derive_seed(seed, epoch))
    return torch.randperm(n, generator=generator)


def _shuffled(n: int, seed: int, epoch: int, permutation: str) -> EpochOrder:
    """The shuffled order of ``n`` indices in ``epoch``, as ``permutation`` computes it."""
    if permutation == "randperm":
        return EpochOrder(_permutation(n, seed, epoch))
    return EpochOrder(IndexShuffle(n, seed, epoch), n)


def _identity(positions: torch.Tensor) -> torch.Tensor:
    return positions


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

    def epoch_view(self, epoch: int) -> EpochOrder:
        return EpochOrder(_identity, self.n)


class ResumableRandomSampler(ResumableSampler):
    """A fresh permutation every epoch, a function of ``(seed, epoch)``.

    Args:
        data_source: a sized dataset or its length.
        seed: Defaults to :data:`estimatorch.rng.DEFAULT_SEED`.
        batch_size: Defaults to 1.
        permutation: how the order is computed: ``"randperm"`` (``torch.randperm`` from a
            generator seeded with ``(seed, epoch)``), ``"feistel"`` (a keyed bijection: O(1)
            memory and O(1) work per index) or ``"auto"`` (``"feistel"`` above 2**24 samples).
            Defaults to ``"auto"``.

    Example:
        >>> s = ResumableRandomSampler(10**9, seed=0, batch_size=4)  # nothing of size 10**9 is built
        >>> s.permutation
        'feistel'
        >>> s.set_start_iter(10**8)  # 4 * 10**8 samples in, positioned in O(1)
        >>> len(s)
        600000000
        >>> 0 <= next(iter(s)) < 10**9
        True
    """

    def __init__(self, data_source: Union[Sized, int], seed: Optional[int] = None, batch_size: int = 1, *,
                 permutation: str = "auto"):
        super().__init__(batch_size)
        self.n = _length(data_source)
        self.seed = rng.DEFAULT_SEED if seed is None else rng.check_seed(seed)
        self.permutation: str = resolve_permutation(permutation, self.n)

    @property
    def num_samples(self) -> int:
        return self.n

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        return self.epoch_view(epoch)[:]

    def epoch_view(self, epoch: int) -> EpochOrder:
        return _shuffled(self.n, self.seed, epoch, self.permutation)


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
        permutation: how a shuffled order is computed, as for :class:`ResumableRandomSampler`
            (``"randperm"``, ``"feistel"`` or ``"auto"``). Defaults to ``"auto"``.
    """

    def __init__(self, data_source: Union[Sized, int], num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: Optional[int] = None,
                 drop_last: bool = False, batch_size: int = 1, *, permutation: str = "auto"):
        super().__init__(batch_size)
        self.n = _length(data_source)
        self.num_replicas = check_positive_int(
            distributed.get_world_size() if num_replicas is None else num_replicas, "num_replicas")
        self.rank = distributed.get_rank() if rank is None else rank
        if not is_int(self.rank) or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank must be an int in [0, {self.num_replicas}), got {rank!r}")
        self.shuffle = bool(shuffle)
        self.seed = rng.DEFAULT_SEED if seed is None else rng.check_seed(seed)
        resolved = resolve_permutation(permutation, self.n)
        self.permutation = resolved if self.shuffle else None
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
        return self.order_view(epoch)[:]

    def order_view(self, epoch: int) -> EpochOrder:
        """:meth:`epoch_order`, computed where it is read."""
        if self.permutation is None:
            return EpochOrder(_identity, self.n)
        return _shuffled(self.n, self.seed, epoch, self.permutation)

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        return self.epoch_view(epoch)[:]

    def epoch_view(self, epoch: int) -> EpochOrder:
        # The padded order repeats the head: position q of it holds the order's q mod n.
        order, n, step, rank = self.order_view(epoch), self.n, self.num_replicas, self.rank
        return EpochOrder(lambda positions: order[(positions * step + rank).remainder_(n)], self._per_rank)
