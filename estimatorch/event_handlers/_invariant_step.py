"""What ``GradientUpdateHandler`` sets up for a ``world_size_invariant`` fit: the canonical sum of
each step's slot gradients (:func:`estimatorch.distributed.slot_reduction`), DDP kept from
synchronising any backward (the sum is exchanged instead), and the warnings of what a split still
changes: BatchNorm's running statistics, and torch thread counts that differ between ranks."""

from __future__ import annotations

from typing import Any, Union

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import distributed
from .._checks import warn_user
from ..events import EstimatorView

__all__ = ["invariant_reduction", "release", "warn_thread_counts"]

Reduction = Union[distributed.SlotReduction, distributed.FsdpSlotReduction]


def invariant_reduction(estimator: EstimatorView, params: list[torch.nn.Parameter], accumulation_steps: int
                        ) -> Reduction:
    """The reduction of a ``world_size_invariant`` fit's steps (a collective at ``train_begin``:
    every rank compares its thread count)."""
    items = estimator.step_items
    assert items is not None, "a world_size_invariant fit weighs every micro-batch"
    net = estimator.train_net
    if isinstance(net, DistributedDataParallel):
        net.require_backward_grad_sync = False  # no backward synchronises: the step's sum is exchanged
    _warn_running_statistics(estimator.net)
    if distributed.is_distributed():
        warn_thread_counts(distributed.gather_objects(torch.get_num_threads()))
    trained = [p for p in params if p.requires_grad]  # a frozen parameter keeps no gradient (as under DDP)
    return distributed.slot_reduction(net, trained, accumulation_steps, lambda: items.weight)


def release(estimator: EstimatorView) -> None:
    """DDP's default back at the fit's end (every backward synchronises)."""
    net: Any = estimator.train_net
    if isinstance(net, DistributedDataParallel):
        net.require_backward_grad_sync = True


def warn_thread_counts(threads: list[int]) -> None:
    """Warn when the ranks' torch thread counts (``threads``, by rank) differ."""
    if len(set(threads)) > 1:
        warn_user(f"world_size_invariant=True, but the processes run torch on {threads} threads (by rank): a CPU "
                  "kernel's sums depend on its thread count, so the same micro-batch gives other gradient bits "
                  "on another rank; give every process the same torch.set_num_threads(n)")


def _warn_running_statistics(net: torch.nn.Module) -> None:
    """Running statistics (BatchNorm's) follow the micro-batches one process sees: named once."""
    names = [name for name, m in net.named_modules()
             if getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None]
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        warn_user(f"world_size_invariant=True trains the same parameters on any split, but the running statistics of "
                  f"{shown} are not: each process updates them with the micro-batches it trains (under DDP, "
                  "rank 0's are broadcast), so they depend on the split, and so does what evaluation computes "
                  "with them (docs/distributed.md, 'What a split still changes')")
