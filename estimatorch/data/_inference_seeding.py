"""The samples ``evaluate``, ``predict`` and ``fit``'s sanity pass load: seeded from their index, so
that a random ``__getitem__`` (augmentation) gives the same values whenever it runs, also after a
resume, and never shifts the training's random stream."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from .. import rng
from .._checks import is_int
from ._stream_base import loader_kwargs
from ._streams import draws_no_randomness

__all__ = ["seeded_for_inference"]

#: the "epoch" of an evaluated sample's seed: ``(seed, _INFERENCE_EPOCH, index)``.
_INFERENCE_EPOCH = -0x5EED
#: loaders with persistent workers keep their rebuilt copy (and its workers) between evaluations.
_SEEDED: "weakref.WeakKeyDictionary[DataLoader[Any], tuple[int, DataLoader[Any]]]" = weakref.WeakKeyDictionary()


class _SeededSamples(Dataset[Any]):
    """A map-style dataset whose every sample's random draws (torch, python ``random``, numpy's
    legacy global generator and :func:`estimatorch.rng.default_numpy_rng`) are seeded from
    ``(seed, index)``, as training samples are from ``(seed, epoch, index)``: evaluating gives
    the same values whenever it runs, also after a resume. In the training process your
    generators are put back after each sample."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        with rng.sample_seeding(self.seed, _INFERENCE_EPOCH, restore=get_worker_info() is None) as seed_sample:
            if is_int(index):
                seed_sample(index)
            return self.dataset[index]


def seeded_for_inference(data: Iterable[Any], seed: int) -> Iterable[Any]:
    """``data`` as evaluated: a map-style DataLoader over a dataset that may draw randomness is
    rebuilt (sampler, batching and settings kept) around :class:`_SeededSamples`."""
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset) \
            or isinstance(data.dataset, _SeededSamples) or draws_no_randomness(data.dataset):
        return data
    cached: Optional[tuple[int, DataLoader[Any]]] = _SEEDED.get(data)
    if cached is not None and cached[0] == seed:
        return cached[1]
    kwargs = dict(collate_fn=data.collate_fn, generator=data.generator, **loader_kwargs(data))
    dataset = _SeededSamples(data.dataset, seed)
    if data.batch_sampler is not None:
        rebuilt = DataLoader(dataset, batch_sampler=data.batch_sampler, **kwargs)
    else:
        rebuilt = DataLoader(dataset, batch_size=None, sampler=data.sampler, **kwargs)
    if data.persistent_workers:
        _SEEDED[data] = (seed, rebuilt)
    return rebuilt
