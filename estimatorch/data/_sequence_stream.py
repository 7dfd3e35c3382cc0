"""A list or tuple of batches given to ``fit``: indexed directly, so any batch is reachable in O(1)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from ._adapters import DataSource
from ._stream_base import TrainStream

__all__ = ["SequenceAdapter"]


class _SequenceStream(TrainStream):
    """A list or tuple of batches: indexed directly."""

    kind = "a list or tuple of batches"

    def __init__(self, batches: Sequence[Any], seed: int):
        super().__init__(seed)
        self.batches = batches
        self.batches_per_epoch = len(batches)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "dataset_len": len(self.batches)}

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        return itertools.islice(self.batches, start, None)


class SequenceAdapter:
    """Opens a ``Sequence`` of batches (a list, a tuple) given to ``fit`` directly."""

    name = "sequence"

    def recognises(self, source: DataSource) -> bool:
        return source.loader is None and isinstance(source.data, Sequence)

    def open(self, source: DataSource) -> TrainStream:
        if len(source.data) == 0:
            raise ValueError("train_data is empty: a sequence of length 0")
        return _SequenceStream(source.data, source.seed)
