"""The replica check of ``Estimator(check_replicas_every=N)``: the ranks that hold copies of the
same state (DDP's replicas; under FSDP2 the ranks of the replicated mesh dimension, HSDP) compare
the exact fingerprint of their parameters and optimizer state every ``N`` optimizer steps and before
every checkpoint save, and a difference stops the run on every rank before the diverged state is
saved (once one rank's weights differ, every rank's next update carries its gradients).

A check is one ``all_gather`` of one int64 per rank and one read of the result on the host; the
steps between checks run nothing of it (a ``batch_end`` hook the loop adds only when the check is
on compares the step count with the period). Every rank receives every fingerprint and decides the
same, so all raise together: no rank waits in a collective for one that stopped.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from ... import distributed
from ...checkpoint import is_sharded_module
from ...distributed import ReplicaDivergenceError
from .._fit_estimator import FitEstimator

__all__ = ["ReplicaCheck", "ReplicaDivergenceError", "check_replica_setting", "replica_check"]


def _replicated(net: Any) -> Optional[tuple[Any, int]]:
    """A sharded net's mesh and the first dimension every parameter is replicated over, if any."""
    from torch.distributed.tensor import DTensor  # heavy (DTensor): a sharded net only

    mesh, dims = None, None
    for param in net.parameters():
        if not isinstance(param, DTensor):
            return None
        if mesh is not None and param.device_mesh is not mesh:
            return None
        mesh = param.device_mesh
        replicated = {i for i, placement in enumerate(param.placements) if placement.is_replicate()}
        dims = replicated if dims is None else dims & replicated
    return (mesh, min(dims)) if mesh is not None and dims else None


def check_replica_setting(estimator: FitEstimator) -> None:
    """At ``fit`` start: refuse ``check_replicas_every`` where each rank holds the only copy of
    its shard (FSDP2 over one mesh dimension): there is nothing to compare it with."""
    if estimator.check_replicas_every is None:
        return
    why = None
    if is_sharded_module(estimator.net) and _replicated(estimator.net) is None:  # (DTensor imported: sharded)
        why = "net is sharded with fully_shard over every mesh dimension"
    elif not is_sharded_module(estimator.net) and estimator.strategy == "fsdp" and dist.is_available() \
            and dist.is_initialized():  # fit will shard it over the group's one dimension
        why = "strategy='fsdp' shards every parameter over all the ranks"
    if why is not None:
        raise ValueError(
            f"check_replicas_every={estimator.check_replicas_every} compares the ranks that hold copies of the same "
            f"state, but {why}: each rank holds the only copy of its shard. Shard over a 2-D mesh (HSDP: "
            "fully_shard(module, mesh=init_device_mesh(device, (replicas, shards))), whose replicated dimension is "
            "then checked), train with strategy='ddp', or pass check_replicas_every=None")


class ReplicaCheck:
    """The check of one fit: :meth:`batch_end` (the loop's hook) every ``period`` batches,
    :meth:`check` before each save."""

    def __init__(self, every: int, accumulation: int, pos: Any, group: Any = None, start: int = 0):
        self.every, self.period = every, every * accumulation
        self.group = group  # None: the default group
        self.ranks = list(range(distributed.get_world_size())) if group is None else \
            list(dist.get_process_group_ranks(group))
        self.good = start  # the last step the replicas were found the same (or the fit's first)
        self.checks = 0
        self._pos = pos

    def batch_end(self, estimator: FitEstimator, **kwargs: Any) -> None:
        """After every ``batch_end`` handler: check when the step count reaches the period."""
        step = self._pos.step + 1
        if step % self.period == 0:
            self.check(estimator, step, f"the check every {self.every} optimizer steps")

    def check(self, estimator: FitEstimator, step: int, when: str) -> int:
        """Compare the ranks' fingerprints now (a collective); returns the one they share.

        Raises:
            ReplicaDivergenceError: on every rank, when some rank's differs.
        """
        fingerprint = distributed.state_fingerprint(distributed.state_tensors(estimator.net, estimator.optimizer))
        values = distributed.gather_fingerprints(fingerprint, self.group)
        self.checks += 1
        reference, odd = distributed.differing_ranks(values)
        if odd:  # every rank holds the same values: all raise the same error at once
            raise distributed.mark_agreed(_divergence(values, [self.ranks[i] for i in odd], self.ranks,
                                                      (self.good, step), when))
        self.good = step
        return reference


def _hex(value: int) -> str:
    return f"{value & (2**64 - 1):#018x}"


def _divergence(values: list[int], odd: list[int], ranks: list[int], steps: tuple[int, int],
                when: str) -> ReplicaDivergenceError:
    same = [rank for rank in ranks if rank not in odd]
    who = f"rank {odd[0]}'s" if len(odd) == 1 else f"ranks {', '.join(map(str, odd))}'"
    other = f"rank {same[0]}'s" if len(same) == 1 else f"those of the {len(same)} other ranks"
    shown = ", ".join(f"rank {rank} {_hex(value)}" for rank, value in zip(ranks, values))
    good, bad = steps
    since = f"the same at step {good}" if good else "not checked before"
    return ReplicaDivergenceError(
        f"the replicas diverged between step {good} and step {bad}: {who} parameters and optimizer state differ from "
        f"{other} (found by {when}; they were {since}; fingerprints: {shown}). The run stops on every rank before "
        "any checkpoint of this state is written: resume from the last checkpoint (saved while the replicas were "
        f"the same), and look at the device and host of rank{'s' if len(odd) > 1 else ''} "
        f"{', '.join(map(str, odd))} (memory errors, a faulty GPU) or at code that changes one rank's weights",
        odd, steps, values)


def replica_check(estimator: FitEstimator, run: Any) -> Optional[ReplicaCheck]:
    """The check of ``run`` once the net is wrapped or sharded (None when off, or in one process)."""
    every = estimator.check_replicas_every
    if every is None or not distributed.is_distributed():
        return None
    group = None
    if is_sharded_module(estimator.net):
        mesh, dim = _replicated(estimator.net)  # type: ignore[misc]  # refused at fit start without one
        group = mesh.get_group(dim)
    start = run.pending["position"]["step"] if run.pending is not None else 0
    return ReplicaCheck(every, run.counts.accumulation, run.pos, group, start)
