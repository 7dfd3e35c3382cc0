"""Hugging Face ``datasets``' ``IterableDataset`` (``load_dataset(..., streaming=True)``,
``IterableDataset.from_generator``, ``Dataset.to_iterable_dataset``), given to ``fit`` in a
``DataLoader`` or alone.

Its epoch is set with ``set_epoch(epoch)`` before every epoch, as datasets' documentation asks:
the order of its shards and its shuffle buffer's draws are then a function of ``(seed, epoch)``.

- Without a shuffle buffer in its pipeline, its own ``state_dict()`` (the shard and the example
  in it each copy of the dataset had reached) resumes it exactly: it runs as any stateful
  ``IterableDataset`` (:class:`~._iterable_streams.StatefulIterableStream`, workers included),
  and a resume re-reads at most the start of the shard it stopped in.
- With one (``.shuffle(seed=..., buffer_size=...)``), its ``state_dict()`` does not hold the
  buffer's content (datasets warns that those examples are lost on resume). ``fit`` runs a copy
  whose buffers keep their content and generator in the state (:mod:`._shuffle_buffer`), so it
  resumes as above, restoring the buffer instead of reading the epoch again.
- Where what comes after the shuffle would not resume exactly from its own state (a batched
  ``.map()``, ...), a resume replays the epoch from its start instead (the epoch is a function
  of ``(seed, epoch)``) and discards the batches before the saved one: exact, at the cost of
  reading those batches, which ``fit`` says, with the reason, when it resumes.
- With a ``.map()`` or ``.filter()`` below a batched map (``.map(batched=True)``, and ``.batch()``,
  which is one), its ``state_dict()`` resumes the batched map by reading its map batch again from
  that batch's start, which runs the maps below it again on examples the run already drew for:
  their draws then come from the generators' state at the checkpoint, not before those examples.
  The epoch is replayed from its start as above: exact, said at the resume.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, Optional

from torch.utils.data import DataLoader

from .. import rng
from .._checks import warn_user
from ._adapters import DataSource
from ._hf_maps import async_maps, seed_batched_maps
from ._iterable_streams import StatefulIterableStream
from ._map_probe import drawing_steps, drawing_threaded_maps
from ._shuffle_buffer import BufferedStream, why_not_resumable
from ._stream_base import TrainStream
from ._warnings import warn_async_maps, warn_threaded_maps

__all__ = ["HFIterableAdapter", "hf_iterable_stream", "is_hf_iterable", "maps_below_batched_maps", "shuffle_buffers"]

_REPLAY_SALT = 0x4F1D


def is_hf_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset`` (told without importing datasets)."""
    return any(c.__module__.startswith("datasets.") and c.__name__ == "IterableDataset" for c in type(dataset).__mro__)


#: datasets' example iterables that pull from the ones below them in threads (datasets 5: one
#: per input shard of a .shuffle(), even a single one; one per source of interleave_datasets()).
_THREADED = {"InterleavedShardsExamplesIterable": "before its .shuffle()",
             "CyclingMultiSourcesExamplesIterable": "in a dataset given to interleave_datasets()",
             "RandomlyCyclingMultiSourcesExamplesIterable": "in a dataset given to interleave_datasets()"}


def _pipeline(dataset: Any) -> Iterator[tuple[Any, Optional[str]]]:
    """Each example iterable of ``dataset``'s pipeline (datasets' private chain: a change there
    shows as a buffer no longer found, which the tests catch), and, when datasets runs it in
    threads, where (``"before its .shuffle()"``), else None."""
    todo: list[tuple[Any, Optional[str]]] = [(getattr(dataset, "_ex_iterable", None), None)]
    while todo:
        node, threaded = todo.pop()
        if node is None:
            continue
        yield node, threaded
        kind = type(node).__name__
        if kind == "InterleavedShardsExamplesIterable" and min(node.ex_iterable.num_shards, node.max_input_shards) < 1:
            kind = ""  # no input shard: iterated in place, no thread
        threaded = threaded or _THREADED.get(kind)
        todo.append((getattr(node, "ex_iterable", None), threaded))
        todo.extend((child, threaded) for child in getattr(node, "ex_iterables", None) or ())


def shuffle_buffers(dataset: Any) -> list[int]:
    """The sizes of the shuffle buffers in ``dataset``'s pipeline."""
    return [int(node.buffer_size) for node, _ in _pipeline(dataset)
            if type(node).__name__ == "BufferShuffledExamplesIterable"]


_MAPS = ("MappedExamplesIterable", "FilteredExamplesIterable")


def maps_below_batched_maps(dataset: Any) -> list[str]:
    """The names of the functions of the ``.map()``/``.filter()`` steps that run below a batched
    map of ``dataset``'s pipeline (``.batch()`` is a batched map): datasets re-runs them when it
    resumes the batched map from its map batch's start."""
    below: list[str] = []
    for node, _ in _pipeline(dataset):
        if type(node).__name__ in _MAPS and getattr(node, "batched", False):
            below += [getattr(inner.function, "__name__", repr(inner.function))
                      for inner, _ in _pipeline(SimpleNamespace(_ex_iterable=node.ex_iterable))
                      if type(inner).__name__ in _MAPS and inner.function is not None]
    return list(dict.fromkeys(below))


class _EpochReplayStream(TrainStream):
    """A ``datasets.IterableDataset`` that its own state would not resume exactly (``why``: a
    shuffle buffer before a step that does not resume from its state, maps below a batched map):
    each epoch iterated from its start after ``set_epoch(epoch)``; a resume at batch k reads and
    discards the first k batches."""

    # positioned by a replay that set_epoch makes exact: said at the resume, not as a doubt at fit start
    exact = True
    kind = "a Hugging Face datasets.IterableDataset"

    def __init__(self, dataset: Any, loader: Optional[DataLoader[Any]], seed: int, buffers: list[int], why: str):
        super().__init__(seed)
        self.why = why
        self.dataset = dataset
        self.data: Any = loader if loader is not None else dataset
        self.buffers = buffers

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "dataset": type(self.dataset).__name__, "shuffle_buffers": self.buffers}

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        self.dataset.set_epoch(epoch)
        if start:
            buffered = f" with a shuffle buffer (size {self.buffers})" if self.buffers else ""
            warn_user(
                f"resuming a datasets.IterableDataset{buffered}: {self.why}, so fit replays epoch {epoch} from its "
                f"start and discards the {start} batches before the saved position (read, not trained). Exact; "
                "costs the time to read those batches.")
        # the draws of .map() functions and of the loader's worker seeds are a function of (seed, epoch)
        order = rng.separate_draws(self.data, rng.derive_seed(self.seed, epoch, _REPLAY_SALT))
        return itertools.islice(order, start, None)


def hf_iterable_stream(dataset: Any, loader: Optional[DataLoader[Any]], seed: int) -> TrainStream:
    """The training stream of a ``datasets.IterableDataset``, alone or in ``loader``."""
    workers = loader.num_workers if loader is not None else 0
    if workers and any(type(node).__name__ == "VerticallyConcatenatedMultiSourcesExamplesIterable"
                       for node, _ in _pipeline(dataset)):
        raise ValueError(
            f"train_data's datasets.IterableDataset is a concatenate_datasets() of iterable datasets, in a "
            f"DataLoader with num_workers={workers}: datasets' own load_state_dict() cannot resume it in a worker "
            "once an epoch has ended (IndexError in datasets.iterable_dataset, datasets 5.2; torchdata's "
            "StatefulDataLoader alone fails the same way), so fit could not resume it. Use num_workers=0 "
            "(exact) or interleave_datasets() of the sources.")
    # each threaded step probed on the first examples (_map_probe): one that draws nothing is not named
    warn_threaded_maps("train_data's datasets.IterableDataset", drawing_threaded_maps(_pipeline(dataset)))
    threaded = {id(node) for node, where in _pipeline(dataset) if where}
    # async steps run ahead of the training, concurrently: a random one is named (probed likewise)
    warn_async_maps("train_data's datasets.IterableDataset",
                    [what for what, _ in drawing_steps([(node, "") for node in async_maps(dataset, threaded)[::-1]])])
    # a resume re-runs the map batch it fell inside: the same draws (not in datasets' threads)
    seed_batched_maps(dataset, seed, threaded=threaded)
    buffers, rerun = shuffle_buffers(dataset), maps_below_batched_maps(dataset)
    if rerun:
        return _EpochReplayStream(dataset, loader, seed, buffers, (
            f"its .map()/.filter() {rerun} run below a batched map (.batch() or .map(batched=True)), and its "
            "state_dict() resumes a batched map by running the maps below it again on examples already drawn "
            "for, with other draws"))
    if not buffers:
        return StatefulIterableStream(dataset, loader, seed)
    why = why_not_resumable(dataset)
    if why is None:  # an earlier estimatorch's checkpoint (no buffer in it) resumes its epoch by the replay
        earlier = _EpochReplayStream(dataset, loader, seed, buffers, "the checkpoint was written without the "
                                     "buffer's content (by an earlier estimatorch, which replayed)")
        return BufferedStream(dataset, loader, seed, buffers, earlier)
    return _EpochReplayStream(dataset, loader, seed, buffers, f"{why} would not resume exactly from its own state "
                              "(without it, the buffer's content is saved in the checkpoint and a resume starts "
                              "from there)")


class HFIterableAdapter:
    """Opens a ``datasets.IterableDataset``, in a ``DataLoader`` or alone."""

    name = "hf-iterable"

    def recognises(self, source: DataSource) -> bool:
        return is_hf_iterable(source.dataset)

    def open(self, source: DataSource) -> TrainStream:
        return hf_iterable_stream(source.dataset, source.loader, source.seed)
