"""MosaicML ``streaming``'s ``StreamingDataset`` (MDS shards), in a ``DataLoader`` or a
``StreamingDataLoader``, or alone.

A ``StreamingDataset``'s order for an epoch is a function of its shuffle seed, its canonical
nodes and the epoch; each rank's share is laid out over the loader's workers batch by batch in
turn, and its ``load_state_dict`` positions an epoch at any sample, computing that epoch's
order without reading the data skipped. ``fit`` uses exactly that, from its own checkpoint:

- before every epoch, the dataset's epoch counter is set to the epoch and its resume state to
  ``(epoch, start batch x batch_size x world size)`` samples: the same epoch, positioned in
  O(1) reads (the order of the epoch is computed, nothing skipped is read); both live in memory
  shared by a node's ranks, written by its first rank (``LOCAL_RANK`` 0) while the others wait;
- the rebuilt loader makes the batches in its workers (the loader's ``batch_size``, which must be
  the dataset's) and reseeds the workers' generators before each batch from
  ``(seed, epoch, batch index in the epoch)``: a random ``__getitem__`` (augmentation) draws the
  same after a resume, whichever worker makes that batch; with ``num_workers=0`` its draws are
  your generators', saved and restored with the run;
- its workers are not kept between epochs (``persistent_workers`` is dropped): each epoch's
  workers are given that epoch's position.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .. import distributed, rng
from ._stream_base import LOADER_SALT, TrainStream, identity, loader_kwargs

__all__ = ["is_streaming_dataset", "streaming_stream"]

_BATCH_SALT = 0x5D57


def is_streaming_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``streaming.StreamingDataset`` (told without importing streaming)."""
    return any(c.__module__.startswith("streaming.") and c.__name__ == "StreamingDataset"
               for c in type(dataset).__mro__)


class _Batches(IterableDataset[Any]):
    """What the rebuilt loader iterates: the dataset's samples batched (and collated) in the
    worker that reads them, the generators reseeded before each batch (in a worker)."""

    def __init__(self, dataset: Any, batch_size: Optional[int], drop_last: bool,
                 collate_fn: Callable[[Any], Any], seed: int):
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.collate_fn, self.seed = collate_fn, seed
        self.epoch = self.start = 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        wanted = self.batch_size or 1
        it = iter(self.dataset)
        with rng.sample_seeding(self.seed, self.epoch, restore=False) as seed_batch:
            for made in itertools.count():
                if info is not None:  # the batch's index in the epoch: the same after a resume
                    seed_batch(self.start + worker + made * workers, salt=_BATCH_SALT)
                samples = list(itertools.islice(it, wanted))
                if not samples or (self.drop_last and self.batch_size is not None and len(samples) < wanted):
                    return
                yield self.collate_fn(samples) if self.batch_size is not None else self.collate_fn(samples[0])


class _StreamingStream(TrainStream):
    """A ``StreamingDataset``: every epoch positioned by the dataset's own resume state."""

    def __init__(self, dataset: Any, loader: Optional[DataLoader[Any]], seed: int):
        super().__init__(seed)
        self.dataset = dataset
        batch_size = loader.batch_size if loader is not None else None
        self.samples_per_batch = batch_size or 1
        own = getattr(dataset, "batch_size", None)
        workers = loader.num_workers if loader is not None else 0
        if workers and own != batch_size:
            raise ValueError(
                f"train_data's StreamingDataset has batch_size={own} and its DataLoader batch_size="
                f"{batch_size}: with num_workers={workers} the dataset lays its samples out over the "
                "workers in batches of its own batch_size, which must be the loader's for the batches "
                "to follow its order. Pass StreamingDataset(..., batch_size=<the loader's>).")
        collate = loader.collate_fn if loader is not None else identity
        drop_last = loader.drop_last if loader is not None else False
        self._batches = _Batches(dataset, batch_size, drop_last, collate, seed)
        self._generator = torch.Generator()
        self.loader: Optional[DataLoader[Any]] = None
        if loader is not None:
            kwargs = loader_kwargs(loader)
            kwargs["persistent_workers"] = False  # each epoch's workers are given its position
            self.loader = DataLoader(self._batches, batch_size=None, collate_fn=identity,
                                     generator=self._generator, **kwargs)
        per_rank = len(dataset)  # this rank's samples per epoch (the epoch is padded to be even)
        unit = self.samples_per_batch
        self.batches_per_epoch = per_rank // unit if drop_last and batch_size else -(-per_rank // unit)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "dataset": type(self.dataset).__name__,
                "samples": int(self.dataset.num_samples), "batch_size": self.samples_per_batch,
                "shuffle": bool(self.dataset.shuffle), "shuffle_seed": int(self.dataset.shuffle_seed)}

    def close(self) -> None:
        self.loader = None

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        if self.batches_per_epoch is not None and start >= self.batches_per_epoch:
            return iter(())  # the checkpoint was at the epoch's last batch
        dataset = self.dataset
        # Its epoch counter and resume state are in memory shared by the ranks of a node: the
        # node's first rank writes them, the others wait until it has.
        if distributed.get_local_rank() == 0:
            dataset.next_epoch = epoch
            state = dataset.state_dict(0, True)  # its canonical nodes and seed, as it resumes them
            samples = start * self.samples_per_batch * distributed.get_world_size()
            state.update(epoch=epoch, sample_in_epoch=samples)
            dataset.load_state_dict(state)
        distributed.barrier()
        self._batches.epoch, self._batches.start = epoch, start
        if self.loader is None:
            return iter(self._batches)
        self._generator.manual_seed(rng.derive_seed(self.seed, epoch, LOADER_SALT))
        return iter(self.loader)


def streaming_stream(dataset: Any, loader: Optional[DataLoader[Any]], seed: int) -> TrainStream:
    """The training stream of a ``StreamingDataset``, alone or in ``loader``."""
    return _StreamingStream(dataset, loader, seed)
