"""Samplers that make data order a function of position, so training can resume anywhere.

- The Helios family (:mod:`.resumable`), used by ``fit`` automatically: the epoch's order is
  recomputed from ``(seed, epoch)`` and iteration starts at any batch.
- The Determined family (:mod:`.composable`), for composing a stream by hand in the order
  shuffle -> repeat -> shard -> skip. Its :class:`DistributedSampler` is not torch's (it shards
  any stream round-robin, without padding): import it qualified to avoid the clash.
"""

from .composable import (
    DistributedBatchSampler,
    DistributedSampler,
    RepeatBatchSampler,
    RepeatSampler,
    ReproducibleShuffleSampler,
    SkipBatchSampler,
    SkipSampler,
)
from .resumable import (
    ResumableDistributedSampler,
    ResumableRandomSampler,
    ResumableSampler,
    ResumableSequentialSampler,
)

__all__ = [
    "DistributedBatchSampler",
    "DistributedSampler",
    "RepeatBatchSampler",
    "RepeatSampler",
    "ReproducibleShuffleSampler",
    "ResumableDistributedSampler",
    "ResumableRandomSampler",
    "ResumableSampler",
    "ResumableSequentialSampler",
    "SkipBatchSampler",
    "SkipSampler",
]
