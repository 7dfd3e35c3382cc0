"""Any other iterable of batches (a generator function's iterable, a ``DataLoader`` over an
``IterableDataset`` without a state of its own...): re-iterated each epoch, and positioned by a
replay: the batches before the saved one are loaded and discarded. Exact only if the data yields
the same batches each time it is iterated, so ``fit`` warns when it may resume such data."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from .. import rng
from .._checks import warn_user
from ._adapters import DataSource
from ._stream_base import TrainStream, length_of

__all__ = ["ReplayAdapter"]

_REPLAY_SALT = 0x4E9A


class _ReplayStream(TrainStream):
    """Any other iterable: re-iterated each epoch, skipped batches are loaded and discarded."""

    exact = False
    kind = "an iterable of batches without indices (a generator, an IterableDataset...)"

    def __init__(self, data: Iterable[Any], seed: int):
        super().__init__(seed)
        self.data = data
        self.batches_per_epoch = length_of(data)

    def fingerprint(self) -> dict[str, Any]:
        fp = {**super().fingerprint(), "data": type(self.data).__name__}
        if self.batches_per_epoch is not None:
            fp["dataset_len"] = self.batches_per_epoch
        return fp

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        if start:
            warn_user(
                f"resuming a {type(self.data).__name__} without state_dict(): replaying {start} "
                "batches (loaded and discarded) to reach the saved position; exact only if it "
                "yields the same batches each time it is iterated")
        # Its draws from the global generators (a DataLoader's base seed for its workers, a
        # dataset's augmentation in the training process) are a function of (seed, epoch), and
        # iterating it shifts nothing of the model's random stream.
        order = rng.separate_draws(self.data, rng.derive_seed(self.seed, epoch, _REPLAY_SALT))
        return itertools.islice(order, start, None)


class ReplayAdapter:
    """Opens any iterable of batches no other adapter recognised: the last one tried."""

    name = "replay"

    def recognises(self, source: DataSource) -> bool:
        return True

    def open(self, source: DataSource) -> TrainStream:
        if source.loader is None and length_of(source.data) == 0:
            raise ValueError(f"train_data is empty: a {type(source.data).__name__} of length 0")
        return _ReplayStream(source.data, source.seed)
