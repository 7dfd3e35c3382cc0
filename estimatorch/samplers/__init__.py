"""Samplers that make data order a function of position, so training can resume anywhere.

- The Helios family (:mod:`.resumable`), used by ``fit`` automatically: the epoch's order is
  recomputed from ``(seed, epoch)`` and iteration starts at any batch.
- The Determined family (:mod:`.composable`), for composing a stream by hand in the order
  shuffle -> repeat -> shard -> skip. Its :class:`DistributedSampler` is not torch's (it shards
  any stream round-robin, without padding): import it qualified to avoid the clash.

The shuffled ones take ``permutation=``: ``"randperm"`` (today's ``torch.randperm`` order),
``"feistel"`` (a keyed bijection, :class:`IndexShuffle`: O(1) memory and O(1) work per index,
for a billion samples) or ``"auto"`` (the default: ``"feistel"`` above :data:`AUTO_THRESHOLD`
samples). An order is read through an :class:`EpochOrder`, computed where it is read.
"""

from ._index_shuffle import AUTO_THRESHOLD, PERMUTATIONS, IndexShuffle, check_permutation, order_fingerprint
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
    EpochOrder,
    ResumableDistributedSampler,
    ResumableRandomSampler,
    ResumableSampler,
    ResumableSequentialSampler,
)

__all__ = [
    "AUTO_THRESHOLD",
    "PERMUTATIONS",
    "DistributedBatchSampler",
    "DistributedSampler",
    "EpochOrder",
    "IndexShuffle",
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
