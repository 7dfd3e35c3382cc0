"""torchdata's ``StatefulDataLoader``: ``fit`` positions it as the ``DataLoader`` it replaces.

A ``StatefulDataLoader`` is a ``DataLoader`` subclass that saves where its iterator is (its
sampler's progress, each worker's dataset state) in its own ``state_dict()``. ``fit`` does not
use that state: it rebuilds the loader, as for any ``DataLoader``, and keeps the position in its
own checkpoint, so there is one position and it is never applied twice:

- over a map-style dataset, torchdata's stateful ``RandomSampler`` / ``BatchSampler`` /
  ``StatefulDistributedSampler`` give the orders of torch's classes of the same names, and are
  taken as those: the epoch is ordered by estimatorch's resumable sampler for ``(seed, epoch)``
  and a resume starts at the saved batch in O(1), without the replay of the sampler's indices
  torchdata's own resume does;
- over an ``IterableDataset`` with ``state_dict()``/``load_state_dict()``, ``fit`` runs the same
  protocol as torchdata (each worker's dataset state sent with every batch, a fixed round-robin
  over the workers) and saves it in its checkpoint;
- a ``StatefulDataLoader`` whose ``load_state_dict()`` was called before ``fit`` is refused: that
  state would position the data a second time, on top of the checkpoint's.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

__all__ = ["check_stateful_loader", "torch_sampler"]

_SAMPLERS = "torchdata.stateful_dataloader.sampler"


def torch_sampler(sampler: Any) -> Any:
    """torch's sampler of the same order for one of torchdata's stateful samplers (a
    ``BatchSampler`` with the inner sampler converted too), else ``sampler`` itself."""
    kind = type(sampler)
    if kind.__module__ != _SAMPLERS:
        return sampler
    if kind.__name__ == "RandomSampler":
        return RandomSampler(sampler.data_source, sampler.replacement, sampler._num_samples, sampler.generator)
    if kind.__name__ == "BatchSampler":
        return BatchSampler(torch_sampler(sampler.sampler), sampler.batch_size, sampler.drop_last)
    if kind.__name__ == "StatefulDistributedSampler":
        return DistributedSampler(sampler.dataset, sampler.num_replicas, sampler.rank, sampler.shuffle,
                                  sampler.seed, sampler.drop_last)
    return sampler


def check_stateful_loader(loader: Any) -> None:
    """Refuse a ``StatefulDataLoader`` that holds a state loaded with ``load_state_dict()``."""
    if not type(loader).__module__.startswith("torchdata.") or getattr(loader, "next_iter_state", None) is None:
        return
    raise ValueError(
        f"train_data is a {type(loader).__name__} with a state loaded by load_state_dict(): fit keeps the "
        "data position in its own checkpoint (CheckpointHandler(..., resume_from_checkpoint=True) or "
        "fit(..., resume=True)) and would position the loader a second time. Pass a loader built "
        "afresh (its own state_dict() need not be saved: the checkpoint holds the position).")
