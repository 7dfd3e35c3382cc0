"""A map-style :class:`~torch.utils.data.DataLoader` as a training stream that starts any epoch at
any batch in O(1) (the batch conventions themselves are in :mod:`estimatorch._batches`).

The loader is rebuilt around a resumable sampler (settings kept) and a fetch that seeds every
sample from ``(seed, epoch, index)``: only the exact torch sampler classes (and estimatorch's
resumable ones) are positioned; any other sampler's indices are replayed, with a warning. A
``datasets.Dataset`` (Hugging Face's map-style dataset, ``with_transform`` included) is a
map-style dataset like any other. Under ``elastic=True`` its batches are laid out in global
optimizer steps (:mod:`._elastic`). The other kinds of data have modules of their own, each
with its adapter (:mod:`._adapters` lists them).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sized
from typing import Any, Callable, Optional, cast

import torch
from torch.utils.data import (
    BatchSampler,
    ConcatDataset,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
    get_worker_info,
)
from torch.utils.data._utils.collate import default_collate, default_convert

from .. import distributed, rng
from .._checks import warn_user
from ..samplers import order_fingerprint
from ..samplers.resumable import (
    ResumableDistributedSampler,
    ResumableRandomSampler,
    ResumableSampler,
    ResumableSequentialSampler,
)
from ._adapters import DataSource
from ._elastic import elastic_layout
from ._stream_base import LOADER_SALT, TrainStream, identity, loader_kwargs
from ._torchdata import torch_sampler

__all__ = ["MapLoaderAdapter", "draws_no_randomness"]

_SAMPLER_SALT = 0x5A3D


def draws_no_randomness(dataset: Any) -> bool:
    """Whether fetching from ``dataset`` draws no random numbers (then it is not seeded per
    sample): a ``TensorDataset`` (or a ``Subset``/``ConcatDataset`` of them), or a dataset whose
    ``estimatorch_sample_seeding`` attribute is False."""
    flag = getattr(dataset, "estimatorch_sample_seeding", None)
    if flag is not None:
        return not flag
    if isinstance(dataset, TensorDataset):
        return True
    if isinstance(dataset, Subset):
        return draws_no_randomness(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return all(draws_no_randomness(d) for d in dataset.datasets)
    return False


def _as_index(key: Any) -> Optional[int]:
    """``key`` as an int when it is one index (python, numpy or a one-element tensor), else None."""
    if isinstance(key, bool):
        return None
    try:
        return operator.index(key)
    except TypeError:
        return None


class _SeededFetch(torch.utils.data.Dataset[Any]):
    """Fetch and collate one batch of ``(epoch, indices)``; every sample's random draws (torch,
    python ``random``, :func:`estimatorch.rng.default_numpy_rng`) are seeded from
    ``(seed, epoch, index)`` so they do not depend on the worker or on the resume point."""

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any], seed: int, seeding: bool,
                 auto_collate: bool):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.seed = seed
        self.seeding = seeding
        self.auto_collate = auto_collate

    def __len__(self) -> int:
        return len(self.dataset)

    def _collate(self, samples: list[Any]) -> Any:
        return self.collate_fn(samples) if self.auto_collate else self.collate_fn(samples[0])

    def __getitem__(self, key: tuple[int, int, list[Any]]) -> Any:
        epoch, position, keys = key
        dataset = self.dataset
        if not self.seeding:
            getitems = getattr(dataset, "__getitems__", None)
            samples = getitems(keys) if getitems and self.auto_collate else [dataset[k] for k in keys]
            return self._collate(samples)
        # In the main process (num_workers=0) the caller's generators are restored afterwards,
        # so loading data never shifts the model's random stream (dropout).
        with rng.sample_seeding(self.seed, epoch, restore=get_worker_info() is None) as seed_sample:
            samples = []
            for k in keys:
                index = _as_index(k)
                if index is None:  # a key that is not one index (a list of them: a BatchSampler as sampler)
                    seed_sample(position, salt=2)
                else:
                    seed_sample(index)
                samples.append(dataset[k])
            first = _as_index(keys[0])
            if first is None:
                seed_sample(position, salt=3)  # the collate function's draws
            else:
                seed_sample(first, salt=1)
            return self._collate(samples)


class _KeyBatches:
    """The rebuilt loader's sampler: yields ``(epoch, position, [keys])`` per batch, from ``start``."""

    def __init__(self, index_batches: Callable[[int, int], Iterator[list[int]]],
                 length: Optional[int]):
        self._index_batches = index_batches
        self._length = length
        self.epoch = 0
        self.start = 0

    def __iter__(self) -> Iterator[tuple[int, int, list[Any]]]:
        epoch = self.epoch
        for position, keys in enumerate(self._index_batches(epoch, self.start), self.start):
            yield epoch, position, keys

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this sampler has no length")
        return max(self._length - self.start, 0)


class _LoaderStream(TrainStream):
    """A map-style DataLoader rebuilt so that any (epoch, batch) is reachable in O(1)."""

    kind = "a map-style DataLoader"

    def __init__(self, loader: DataLoader[Any], seed: int):
        super().__init__(seed)
        dataset = loader.dataset
        self.dataset_len = len(cast(Sized, dataset))  # map-style: open_stream checked
        # As DataLoader decides: with a batch sampler (built from batch_size, or the user's own)
        # each of its index lists is one batch of samples to collate; without one, each item the
        # sampler yields is one key of the dataset (a BatchSampler given as sampler yields lists).
        batch_sampler = torch_sampler(loader.batch_sampler)  # torchdata's stateful classes: torch's
        auto_collate = batch_sampler is not None
        plain_batches = type(batch_sampler) is BatchSampler
        unit = cast(BatchSampler, batch_sampler).batch_size if plain_batches else 1
        self.batch_size = unit if auto_collate else None
        self.drop_last = cast(BatchSampler, batch_sampler).drop_last if plain_batches else loader.drop_last
        length: Optional[int]
        self._user_batches: Any = None
        self.sampler = None
        if not auto_collate or plain_batches:
            inner = cast(BatchSampler, batch_sampler).sampler if plain_batches else torch_sampler(loader.sampler)
            self.sampler = self._resumable_sampler(inner, unit)
        if self.sampler is not None:
            self.even_shares = isinstance(self.sampler, ResumableDistributedSampler)
            per_epoch = self.sampler.num_samples
            length = per_epoch // unit if self.drop_last and auto_collate else -(-per_epoch // unit)
            index_batches = self._sampler_batches
            self.sampler_name = type(self.sampler).__name__
        else:
            self._user_batches = loader.batch_sampler if auto_collate else loader.sampler
            length = len(self._user_batches) if isinstance(self._user_batches, Sized) else None
            index_batches = self._replayed_batches
            self.sampler_name = type(self._user_batches).__name__
            order = cast(BatchSampler, batch_sampler).sampler if plain_batches else self._user_batches
            warn_user(
                f"train_data's {type(order).__name__} is not a sampler estimatorch knows how to position: "
                "its order is what trains, and a resume replays its indices (no data is loaded for "
                "skipped batches), which is exact only if its order is a function of set_epoch() "
                "(torch's global generator, if it draws from it, is seeded from the epoch for it). "
                "Use a estimatorch.samplers.ResumableSampler for a guaranteed resume.")
        self.batches_per_epoch = length
        collate = loader.collate_fn
        seeding = not (draws_no_randomness(dataset) and collate in (default_collate, default_convert))
        self._keys = _KeyBatches(index_batches, length)
        self._generator = torch.Generator()
        self.loader: Optional[DataLoader[Any]] = DataLoader(
            _SeededFetch(dataset, collate, seed, seeding, auto_collate),
            batch_size=None,
            sampler=self._keys,
            collate_fn=identity,
            generator=self._generator,
            **loader_kwargs(loader),
        )

    def _resumable_sampler(self, sampler: Any, unit: int) -> Optional[ResumableSampler]:
        """The resumable sampler that gives ``sampler``'s order, or None when it is not one of the
        exact classes whose order estimatorch knows (a subclass keeps its own order: replayed)."""
        n, seed = self.dataset_len, self.seed
        if isinstance(sampler, ResumableSampler):
            return sampler
        if type(sampler) is DistributedSampler:
            return ResumableDistributedSampler(n, sampler.num_replicas, sampler.rank, sampler.shuffle,
                                               seed, sampler.drop_last, unit)
        plain_random = (type(sampler) is RandomSampler and not sampler.replacement
                        and sampler._num_samples is None)
        if not plain_random and type(sampler) is not SequentialSampler:
            return None
        if distributed.get_world_size() > 1:
            return ResumableDistributedSampler(n, shuffle=plain_random, seed=seed, batch_size=unit)
        if plain_random:
            return ResumableRandomSampler(n, seed=seed, batch_size=unit)
        return ResumableSequentialSampler(n, batch_size=unit)

    def _sampler_batches(self, epoch: int, start: int) -> Iterator[list[int]]:
        unit = self.batch_size or 1
        sampler = self.sampler
        assert sampler is not None, "_sampler_batches is the index source only with a sampler"
        sampler.set_epoch(epoch)
        sampler.set_start_index(start * unit)
        it = iter(sampler)
        while True:
            batch = list(itertools.islice(it, unit))
            if not batch or (self.drop_last and len(batch) < unit):
                return
            yield batch

    def _replayed_batches(self, epoch: int, start: int) -> Iterator[list[Any]]:
        source = self._user_batches
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)
        elif hasattr(getattr(source, "sampler", None), "set_epoch"):
            source.sampler.set_epoch(epoch)
        auto_collate = self.batch_size is not None
        # its draws from the global generators are a function of (seed, epoch), and shift nothing
        order = rng.separate_draws(source, rng.derive_seed(self.seed, epoch, _SAMPLER_SALT))
        for batch in itertools.islice(order, start, None):
            yield list(batch) if auto_collate else [batch]  # without a batch sampler: one key

    def use_elastic(self, accumulation_steps: int, device: Optional[torch.device] = None) -> None:
        """Take this rank's batches from an :class:`~estimatorch.data.ElasticLayout` of the
        sampler's order instead of the sampler's shard."""
        layout = elastic_layout(self.sampler, self.sampler_name, self.dataset_len, self.batch_size, self.drop_last,
                                self.seed, accumulation_steps, device)
        self.layout = layout
        self.batches_per_epoch = self._keys._length = layout.batches_per_epoch
        self._keys._index_batches = layout.index_batches

    def fingerprint(self) -> dict[str, Any]:
        if self.layout is not None:  # the same on any world size of the same global batch
            return self.layout.fingerprint()
        return {**super().fingerprint(), "dataset_len": self.dataset_len,
                "batch_size": self.batch_size, "drop_last": self.drop_last,
                "sampler": self.sampler_name, **order_fingerprint(self.sampler)}

    def close(self) -> None:
        self.loader = None  # its persistent workers, if any, shut down with it

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        if self.batches_per_epoch is not None and start >= self.batches_per_epoch:
            return iter(())
        self._keys.epoch, self._keys.start = epoch, start
        self._generator.manual_seed(rng.derive_seed(self.seed, epoch, LOADER_SALT))
        loader = self.loader
        if loader is None:
            raise RuntimeError("this training stream was closed: fit builds a new one")
        if self.layout is not None:  # elastic: each batch's random draws follow its place in the step
            return self.layout.reseeding(iter(loader), epoch, start)
        return iter(loader)


class MapLoaderAdapter:
    """Opens a ``DataLoader`` over a map-style dataset (one that is not an ``IterableDataset``)."""

    name = "map-loader"

    def recognises(self, source: DataSource) -> bool:
        return source.loader is not None and not isinstance(source.dataset, IterableDataset)

    def open(self, source: DataSource) -> TrainStream:
        loader = source.loader
        assert loader is not None, "recognised: a DataLoader"
        n = len(cast(Sized, source.dataset))
        if n == 0:
            raise ValueError("train_data is empty: its dataset has length 0")
        stream = _LoaderStream(loader, source.seed)
        if stream.batches_per_epoch == 0:
            raise ValueError(
                f"train_data yields no batches: {n} samples with batch_size={loader.batch_size} and drop_last=True")
        return stream
