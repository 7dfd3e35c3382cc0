"""Samplers that make data order a function of position, so training can resume anywhere.

- The Helios family (:mod:`.resumable`), used by ``fit`` automatically: the epoch's order is
  recomputed from ``(seed, epoch)`` and iteration starts at any batch.
- The Determined family (:mod:`.composable`), for composing a stream by hand in the order
  shuffle -> repeat -> shard -> skip.
"""

from .resumable import (
    ResumableDistributedSampler,
    ResumableRandomSampler,
    ResumableSampler,
    ResumableSequentialSampler,
)

__all__ = [
    "ResumableDistributedSampler",
    "ResumableRandomSampler",
    "ResumableSampler",
    "ResumableSequentialSampler",
]
