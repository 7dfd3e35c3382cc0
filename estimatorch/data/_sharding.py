"""What ``evaluate`` and ``predict`` iterate on this rank: under ``torch.distributed``, the batches
one process would see, shared out over the ranks without padding.

A map-style :class:`~torch.utils.data.DataLoader` is rebuilt (its settings kept) so that rank ``r``
of ``w`` iterates batches ``r, r + w, r + 2w, ...`` of the sequence one process would iterate:

- with torch's ``DistributedSampler`` or a
  :class:`~estimatorch.samplers.ResumableDistributedSampler`: that sampler's epoch order before
  it pads and shards (its seed, epoch and shuffle kept; its ``drop_last`` does not apply: every
  sample is evaluated once), in batches of the loader's ``batch_size`` and ``drop_last``;
- with a ``SequentialSampler``: ``0 .. n-1``;
- with any other sampler or batch sampler: what it yields on rank 0 (every rank iterates it,
  rank 0's order is broadcast, so a random order agrees across ranks).

Every batch is then evaluated exactly once, as in one process, so metric values equal the
single-process ones (up to the order of float additions); ranks may get different numbers of
batches (one at most), which is fine for a net each rank holds whole (``evaluate`` runs the
plain module, and metrics reduce once, in ``compute()``). A sharded net (FSDP2) gathers its
parameters from every rank in each forward, so every rank must run as many forwards: with
``pad=True`` a rank with one batch fewer iterates one more, a copy of a batch another rank
evaluates (:attr:`InferenceData.own` says how many are its own), whose forward runs and whose
result is discarded.

Used as it is, each rank iterating its own data: a loader whose sampler already shards without
padding (:class:`estimatorch.samplers.DistributedSampler` / ``DistributedBatchSampler``) or
looks distributed but unknown (it has ``num_replicas`` and ``rank``: a warning), and anything that
is not a map-style loader (a list of batches, a loader over an ``IterableDataset``, a
generator), as ``fit`` does with its training data. Their lengths are unknown in advance, so for
a sharded net :func:`in_step` makes the ranks agree before each batch whether any of them still
has one (one all-reduce of ``2 * world`` ints on the CPU per batch, only then), and a rank that
has run out pads with its last batch (or, if it had none, one another rank sends once).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, Callable, Optional, cast

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from .. import distributed
from ..samplers import composable
from ..samplers.resumable import ResumableDistributedSampler
from ._stream_base import loader_kwargs as _loader_kwargs

__all__ = ["InferenceData", "for_inference", "in_step"]


@dataclasses.dataclass
class InferenceData:
    """The batches this rank iterates, and how they relate to the other ranks'.

    ``split`` is True when they are this rank's round-robin share of ``total`` global batches
    (global batch ``i`` on rank ``i % world``); False when they are this rank's own data.
    ``own``: how many of the batches are this rank's (None: all); those after it are padding,
    run for a sharded net's collectives only.
    """

    batches: Iterable[Any]
    split: bool = False
    total: int = 0
    rank: int = 0
    world: int = 1
    own: Optional[int] = None

    def merge(self, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
        """Per-batch results of every rank (in rank order) back in the global batch order."""
        return [per_rank[i % self.world][i // self.world] for i in range(self.total)]


class _RoundRobin:
    """Rank ``rank``'s share of ``units`` (index batches, or single indices): unit ``i`` goes to
    rank ``i % world``. ``units`` can be replaced between iterations (persistent workers).
    With ``pad``, every rank iterates as many units: a rank with one fewer ends with a copy of
    unit ``i % len(units)`` (as ``DistributedSampler`` pads)."""

    def __init__(self, units: Sequence[Any], rank: int, world: int, pad: bool = False):
        self.units, self.rank, self.world, self.pad = units, rank, world, pad

    def __len__(self) -> int:
        return len(self._indices())

    def _indices(self) -> range:
        end = -(-len(self.units) // self.world) * self.world if self.pad else len(self.units)
        return range(self.rank, end, self.world)

    def __iter__(self) -> Iterator[Any]:
        for i in self._indices():
            unit = self.units[i % len(self.units)]
            yield unit.tolist() if isinstance(unit, torch.Tensor) else unit


#: rebuilt loaders of sources with persistent workers, so their workers persist across calls.
_REBUILT: "weakref.WeakKeyDictionary[DataLoader[Any], tuple[tuple[int, int, bool], DataLoader[Any], _RoundRobin]]" = \
    weakref.WeakKeyDictionary()


def _active_sampler(loader: DataLoader[Any]) -> Any:
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def _shards_itself(loader: DataLoader[Any]) -> bool:
    """True when the loader's sampler already gives each rank its own share (used as it is)."""
    for obj in composable.sampler_chain(_active_sampler(loader)):
        if type(obj) in (DistributedSampler, ResumableDistributedSampler):
            return False  # known: its unpadded order is reconstructed
        if isinstance(obj, composable.DistributedSampler):
            return True  # shards round-robin without padding
        if hasattr(obj, "num_replicas") and hasattr(obj, "rank"):
            warnings.warn(
                f"{type(obj).__name__} looks like a distributed sampler that estimatorch cannot see "
                "through: each rank evaluates what it yields, as it is (samples it pads count twice). "
                "Use torch's DistributedSampler, estimatorch's samplers or a plain loader to have every "
                "sample evaluated once.", stacklevel=6)
            return True
    return False


def _known_order(sampler: Any) -> Optional[torch.Tensor]:
    """The order one process would iterate, computed without a collective; None if unknown."""
    if type(sampler) is SequentialSampler:
        return torch.arange(len(sampler))
    if type(sampler) is DistributedSampler:  # torch's own recipe, before padding and sharding
        n = len(cast(Sized, sampler.dataset))
        if not sampler.shuffle:
            return torch.arange(n)
        generator = torch.Generator()
        generator.manual_seed(sampler.seed + sampler.epoch)
        return torch.randperm(n, generator=generator)
    if type(sampler) is ResumableDistributedSampler:
        return sampler.epoch_order(sampler.epoch)
    return None


def _rank0s(make: Callable[[], list[Any]]) -> list[Any]:
    """``make()`` as rank 0 computed it: every rank runs it (random generators stay in step
    across ranks), rank 0's result is broadcast."""
    made: list[Any] = distributed.broadcast_object(make())
    return made


def _global_units(loader: DataLoader[Any]) -> Sequence[Any]:
    """What one process would iterate: index batches (or single indices without batching)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:  # a custom one
        return _rank0s(lambda: [b.tolist() if isinstance(b, torch.Tensor) else list(b) for b in batch_sampler])
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    known = _known_order(sampler)
    order: Any = known if known is not None else _rank0s(lambda: list(sampler))  # a tensor or a list
    if batch_sampler is None:
        return cast(Sequence[Any], order)  # a tensor indexes, slices and counts like one
    size = batch_sampler.batch_size
    units = [order[i:i + size] for i in range(0, len(order), size)]
    if units and batch_sampler.drop_last and len(units[-1]) < size:
        units.pop()
    return units


def _rebuilt(loader: DataLoader[Any], units: Sequence[Any], rank: int, world: int, pad: bool) -> DataLoader[Any]:
    key = (rank, world, pad)
    if loader.persistent_workers:
        cached = _REBUILT.get(loader)
        if cached is not None and cached[0] == key:
            cached[2].units = units
            return cached[1]
    share = _RoundRobin(units, rank, world, pad)
    kwargs = dict(collate_fn=loader.collate_fn, generator=loader.generator, **_loader_kwargs(loader))
    if loader.batch_sampler is not None:
        rebuilt = DataLoader(loader.dataset, batch_sampler=share, **kwargs)
    else:
        rebuilt = DataLoader(loader.dataset, batch_size=None, sampler=share, **kwargs)
    if loader.persistent_workers:
        _REBUILT[loader] = (key, rebuilt, share)
    return rebuilt


def for_inference(data: Iterable[Any], arg: str, pad: bool = False) -> InferenceData:
    """This rank's batches of ``data`` for ``evaluate`` / ``predict`` (see the module notes).

    Args:
        pad: every rank iterates as many batches (for a sharded net): a rank with fewer ends
            with padding ones, after :attr:`InferenceData.own` of its own. Defaults to False.

    Raises:
        ValueError: a map-style loader that yields no batches at all (on every rank alike).
    """
    if not distributed.is_distributed() or not isinstance(data, DataLoader) \
            or isinstance(data.dataset, IterableDataset) or _shards_itself(data):
        return InferenceData(data)
    units = _global_units(data)
    if len(units) == 0:
        raise ValueError(f"{arg} yields no batches: {len(cast(Sized, data.dataset))} samples with batch_size="
                         f"{data.batch_size} and drop_last={data.drop_last}")
    rank, world = distributed.get_rank(), distributed.get_world_size()
    own = len(range(rank, len(units), world))
    return InferenceData(_rebuilt(data, units, rank, world, pad), split=True, total=len(units), rank=rank,
                         world=world, own=own)


_END = object()


def in_step(batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """This rank's own ``batches`` as ``(batch, True)``, then padding ``(batch, False)`` until
    every rank has run out: every rank yields as many (a sharded net's forward is a collective).

    Before each batch the ranks exchange whether they still have one (an all-reduce of
    ``2 * world`` ints on a CPU group: :func:`estimatorch.distributed.all_reduce_max_async`),
    and one more time when all have run out. A rank that has run out pads with its last batch;
    a rank that never had one gets the batch of the lowest rank that has one, broadcast once
    (every rank takes part). Every rank must iterate it to the end, at the same point.
    """
    rank, world = distributed.get_rank(), distributed.get_world_size()
    it: Optional[Iterator[Any]] = iter(batches)
    last: Any = _END
    while True:
        batch = next(it, _END) if it is not None else _END
        if batch is _END:
            it = None
        flags = [0] * (2 * world)
        flags[rank] = int(batch is not _END)
        flags[world + rank] = int(batch is _END and last is _END)  # needs a batch to pad with
        agreed = distributed.all_reduce_max_async(flags).wait()
        if not any(agreed[:world]):
            return
        if any(agreed[world:]):
            src = agreed.index(1)  # the lowest rank holding a batch
            sent = distributed.broadcast_object(batch if rank == src else None, src=src)
            if last is _END and batch is _END:
                last = sent
        if batch is _END:
            yield last, False
        else:
            last = batch
            yield batch, True
