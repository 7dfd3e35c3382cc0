"""The canonical sum of an optimizer step's slot gradients for a net sharded with FSDP2, through
FSDP2's public hook for its gradient reduction (``FSDPModule.set_custom_reduce_scatter``).

FSDP2 reduce-scatters each FSDP module's gradients at every backward (gradient sync stays on): it
hands the hook one flat buffer per module, laid out as ``W`` chunks, chunk ``j`` holding every
parameter's rows of rank ``j`` (dim-0 shards, padded), and takes back this rank's chunk of the
reduction, which it turns into the sharded ``.grad``. The hook here replaces the sum by the tree
(:mod:`._grad_tree`): it weighs this rank's chunks by the micro-batch's items, sends chunk ``j``
to rank ``j`` (one ``all_to_all``: the bytes of a reduce-scatter), and folds the ``W`` chunks it
receives, slot ``r k + t`` from rank ``r`` at this rank's micro-batch ``t``, into one
:class:`~._grad_tree.Frontier` per source rank. At the window's last micro-batch it combines
the sources' frontiers up the tree and returns that, this rank's shard of the step's sum; the
other micro-batches' ``.grad`` (uninitialised) is dropped before the next backward. Per step a
rank sends ``k (W - 1)/W`` times the gradient's bytes, as FSDP2's own reduce-scatter of every
micro-batch does, and holds up to ``W x (log2 k + 1)`` shards per module between micro-batches
(``log2 k + 1`` times the unsharded gradient; one with ``k = 1``).

In a process group of one (nothing to exchange) FSDP2 calls no hook; the step folds the gradient
each backward left, as in one process (:class:`~._slot_reduction.SlotReduction`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from torch import nn

from ._grad_tree import Frontier, Node, combine

__all__ = ["FsdpSlotReduction"]


class FsdpSlotReduction:
    """The canonical sum of each step's slots for a sharded net on ``world_size > 1`` ranks.

    Args:
        net: the sharded net (its FSDP modules get the hook).
        params: the optimizer's parameters.
        world_size: the ranks of the FSDP mesh.
        accumulation_steps: micro-batches per rank and step.
        weight: ``weight()``, the weight of the micro-batch under way (its items).
    """

    def __init__(self, net: nn.Module, params: list[nn.Parameter], world_size: int, accumulation_steps: int,
                 weight: Callable[[], Any]):
        self.params, self.world_size, self.k, self.weight = params, world_size, accumulation_steps, weight
        self.slots = world_size * accumulation_steps
        self.within, self.closing = 0, accumulation_steps == 1
        self.bytes_sent = 0
        self.collectives = 0
        self.hooks: list[_SlotReduceScatter] = []
        from torch.distributed.fsdp import FSDPModule  # heavy: imported where a net is sharded (it is by now)

        for module in net.modules():
            if isinstance(module, FSDPModule):
                hook = _SlotReduceScatter(self)
                module.set_custom_reduce_scatter(cast(Any, hook))  # FSDP2's ReduceScatter interface
                module.set_reduce_scatter_unused_params(True, recurse=False)  # the same layout every backward
                self.hooks.append(hook)

    def begin(self, within: int, closing: bool) -> None:
        """Micro-batch ``within`` of this rank's window begins (the last one when ``closing``):
        the gradients FSDP made of the one before are not this step's."""
        if within:
            for p in self.params:
                p.grad = None
        self.within, self.closing = within, closing

    def fold(self, within: int, weight: Any = 1.0) -> None:
        """Nothing to do: the hook folded this micro-batch's shards during its backward."""

    def finish(self, done: int) -> None:
        """The window's end: ``.grad`` holds this rank's shard of the step's sum (combined by the
        hook at the last backward; here for a window cut short after ``done`` micro-batches)."""
        if done < self.k:
            for hook in self.hooks:
                hook.close()

    def state_dict(self) -> list[list[list[dict[str, Any]]]]:
        """Per FSDP module and source rank, the shards folded in this window so far."""
        return [[[{"start": n.start, "size": n.size, "tensors": [t.clone() for t in n.tensors]} for n in f.nodes]
                 for f in hook.sources] for hook in self.hooks]

    def load_state_dict(self, state: Optional[Sequence[Any]]) -> None:
        for i, hook in enumerate(self.hooks):
            for source, nodes in zip(hook.sources, state[i] if state else [[]] * self.world_size):
                source.nodes = [Node(n["start"], n["size"], [t.clone() for t in n["tensors"]]) for n in nodes]


class _SlotReduceScatter:
    """One FSDP module's reduce-scatter, as the canonical sum of the step's slots (FSDP2's
    ``ReduceScatter`` interface: ``allocate`` and the call)."""

    def __init__(self, owner: FsdpSlotReduction):
        self.owner = owner
        self.sources = [Frontier() for _ in range(owner.world_size)]
        self.output: Optional[torch.Tensor] = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        owner = self.owner
        world, k = owner.world_size, owner.k
        weight = owner.weight()
        if isinstance(weight, torch.Tensor) or weight != 1.0:
            input_tensor.mul_(weight)
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)
        rows = received.view(world, -1)
        for rank, source in enumerate(self.sources):
            source.push(rank * k + owner.within, [rows[rank] if k == 1 else rows[rank].clone()])
        owner.bytes_sent += (world - 1) * rows.shape[1] * rows.element_size()
        owner.collectives += 1
        self.output = output_tensor
        if owner.closing:
            self.close()

    def close(self) -> None:
        """This rank's shard of the sum of the slots folded so far, into the last output."""
        total = combine([node for source in self.sources for node in source.nodes], self.owner.slots)
        if total is not None and self.output is not None:
            self.output.copy_(total[0])
        for source in self.sources:
            source.clear()
