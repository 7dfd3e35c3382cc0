"""The gradient of an optimizer step as the canonical sum of its slots' gradients (the tree:
:mod:`._grad_tree`), on one process or over the ranks of DDP (``world_size_invariant``).

Each micro-batch's gradient is computed alone (``.grad`` is None before its backward, and no
rank synchronises: DDP runs every backward under ``no_sync``), weighed by its items and folded
into this rank's :class:`~._grad_tree.Frontier` (:meth:`SlotReduction.fold`). At the window's
end (:meth:`SlotReduction.finish`):

- **one process**: the frontier is combined up the tree, and the parameters' ``.grad`` hold it;
- **several** (DDP), by shards: every rank flattens its frontier nodes (one for a power-of-two
  ``accumulation_steps`` at an aligned start) into ``W`` equal shards; one ``all_to_all`` hands
  rank ``j`` shard ``j`` of every rank's nodes; rank ``j`` combines them up the tree (the
  frontier nodes of all ranks, in slot order, are a cut through the same tree), which is shard
  ``j`` of the sum; one ``all_gather`` gives every rank the whole sum. Per rank that sends
  ``(n + 1)(W - 1)/W`` times the gradient's bytes, ``n`` the most frontier nodes a rank holds:
  for one node, ``2 (W - 1)/W``, what a ring all-reduce sends;
- **several**, whole: where that sends no fewer bytes (``W = 2`` with one node: ``(W - 1) n``
  gradients, the same) or under :attr:`SlotReduction.gather_below` bytes (latency, not bytes,
  is then the cost), one ``all_gather`` of every rank's frontier and each rank combines the
  whole tree: one collective instead of two. :attr:`SlotReduction.bytes_sent` counts either.

The sum is the same floats on any split of the same ``S`` slots: each element's additions
follow the same tree, whichever rank adds them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ._fsdp_slots import FsdpSlotReduction
from ._grad_tree import Frontier, Node, blocks, combine

__all__ = ["SlotReduction", "is_dtensor", "slot_reduction"]


class SlotReduction:
    """This rank's side of the canonical sum of each optimizer step's slot gradients.

    Args:
        params: the parameters whose gradients are summed (every rank's, in the same order).
        world_size: the ranks (1: one process, nothing exchanged).
        rank: this rank: it holds slots ``rank * accumulation_steps`` onwards of every step.
        accumulation_steps: micro-batches per rank and step.
        group: the process group of the exchange. Defaults to None (the default group).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> tree = SlotReduction([w], world_size=1, rank=0, accumulation_steps=2)
        >>> for slot, g in enumerate([torch.ones(2), torch.full((2,), 2.0)]):
        ...     w.grad = g  # what slot's backward left
        ...     tree.fold(slot)
        >>> tree.finish(2)
        >>> w.grad
        tensor([3., 3.])
    """

    def __init__(self, params: list[torch.nn.Parameter], world_size: int, rank: int, accumulation_steps: int,
                 group: Any = None):
        self.params, self.world_size, self.rank, self.group = params, world_size, rank, group
        self.k = accumulation_steps
        self.slots = world_size * accumulation_steps
        self.frontier = Frontier()
        self._sharded = any(is_dtensor(p) for p in params)  # (FSDP2 over one rank)
        #: bytes this rank has sent to the others in the exchanges, and the collectives they took
        self.bytes_sent = 0
        self.collectives = 0

    #: below these bytes per rank the frontiers travel whole (one all_gather, each rank combines
    #: the whole tree): a small gradient's exchange costs the latency of its collectives, not its bytes
    gather_below = 1 << 16

    def begin(self, within: int, closing: bool) -> None:
        """Micro-batch ``within`` of the window begins: nothing to do (``.grad`` is None)."""

    def fold(self, within: int, weight: Any = 1.0) -> None:
        """Fold the gradient the backward of this rank's micro-batch ``within`` (of its window)
        left in ``.grad``, times ``weight``, into the frontier; ``.grad`` is None again."""
        grads = [local_grad(p) for p in self.params] if self._sharded else \
            [p.grad if p.grad is not None else local_grad(p) for p in self.params]
        if isinstance(weight, torch.Tensor) or weight != 1.0:
            torch._foreach_mul_(grads, weight)
        self.frontier.push(self.rank * self.k + within, grads)
        for p in self.params:
            p.grad = None

    def finish(self, done: int) -> None:
        """The window's end, after ``done`` micro-batches on every rank: the step's sum in ``.grad``."""
        if self.world_size == 1:
            total = combine(self.frontier.nodes, self.slots)
            self.frontier.clear()
            if total is not None:
                for p, g in zip(self.params, total):
                    if self._sharded:
                        set_grad(p, g)
                    else:
                        p.grad = g
            return
        flat = self._exchange(done)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    def _exchange(self, done: int) -> torch.Tensor:
        """The step's sum on every rank, from every rank's frontier after ``done`` micro-batches:
        whole, or by shards (see the module notes)."""
        world, k = self.world_size, self.k
        total = sum(p.numel() for p in self.params)
        counts = [len(blocks(r * k, r * k + done)) for r in range(world)]  # every rank's, known to all
        size = self.params[0].element_size()
        whole = (world - 1) * max(counts) * total * size
        by_shards = (world - 1) * (max(counts) + 1) * -(-total // world) * size
        if whole <= max(by_shards, self.gather_below):
            return self._gather_whole(total, counts, done)
        return self._by_shards(total, counts, done)

    def _gather_whole(self, total: int, counts: list[int], done: int) -> torch.Tensor:
        """Every rank's frontier, whole, to every rank (one all_gather), combined on each."""
        world, k, ref = self.world_size, self.k, self.params[0]
        most = max(counts)
        send = torch.zeros(most, total, dtype=ref.dtype, device=ref.device)
        for i, node in enumerate(self.frontier.nodes):
            torch.cat([g.reshape(-1) for g in node.tensors], out=send[i])
        self.frontier.clear()
        every = torch.empty(world * most * total, dtype=ref.dtype, device=ref.device)
        dist.all_gather_single(every, send.view(-1), group=self.group)
        rows = every.view(world, most, total)
        received = [Node(start, size, [rows[r, i]]) for r in range(world)
                    for i, (start, size) in enumerate(blocks(r * k, r * k + done))]
        summed = combine(received, self.slots)
        assert summed is not None, "every rank folds at least one micro-batch before a step"
        self.bytes_sent += (world - 1) * most * total * ref.element_size()
        self.collectives += 1
        return summed[0]

    def _by_shards(self, total: int, counts: list[int], done: int) -> torch.Tensor:
        """Shard ``j`` of every rank's frontier to rank ``j``, combined there; every shard to every rank."""
        world, k = self.world_size, self.k
        nodes, ref = self.frontier.nodes, self.params[0]
        shard = -(-total // world)
        mine = len(nodes)
        send = torch.zeros(mine, world * shard, dtype=ref.dtype, device=ref.device)
        for i, node in enumerate(nodes):
            torch.cat([g.reshape(-1) for g in node.tensors], out=send[i, :total])
        self.frontier.clear()
        send = send.view(mine, world, shard).transpose(0, 1).contiguous() if mine > 1 else send
        recv = torch.empty(sum(counts) * shard, dtype=ref.dtype, device=ref.device)
        dist.all_to_all_single(recv, send.view(-1), [c * shard for c in counts], [mine * shard] * world,
                               group=self.group)
        received: list[Node] = []
        offset = 0
        for r in range(world):
            for start, size in blocks(r * k, r * k + done):
                received.append(Node(start, size, [recv[offset:offset + shard]]))
                offset += shard
        summed = combine(received, self.slots)
        assert summed is not None, "every rank folds at least one micro-batch before a step"
        full = torch.empty(world * shard, dtype=ref.dtype, device=ref.device)
        dist.all_gather_single(full, summed[0], group=self.group)
        size = ref.element_size()
        self.bytes_sent += (world - 1) * (mine + 1) * shard * size
        self.collectives += 2
        return full

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> list[dict[str, Any]]:
        """The frontier of a window under way (this rank's partial sums)."""
        return [{"start": n.start, "size": n.size, "tensors": [t.clone() for t in n.tensors]}
                for n in self.frontier.nodes]

    def load_state_dict(self, state: Optional[list[dict[str, Any]]]) -> None:
        device = self.params[0].device if self.params else None
        self.frontier.nodes = [Node(n["start"], n["size"], [t.to(device).clone() for t in n["tensors"]])
                               for n in state or []]


def is_dtensor(t: object) -> bool:
    """``t`` is a ``DTensor`` (a sharded parameter or gradient): asked only once
    ``torch.distributed.tensor`` was imported (a heavy import: no DTensor exists before it ran)."""
    tensors = sys.modules.get("torch.distributed.tensor")
    return tensors is not None and isinstance(t, tensors.DTensor)


def set_grad(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``p.grad = grad``; for a parameter sharded over one rank (FSDP2 in a group of one) as the
    DTensor of that one shard."""
    if is_dtensor(p):
        sharded: Any = p  # a DTensor
        dtensor = sys.modules["torch.distributed.tensor"].DTensor
        p.grad = dtensor.from_local(grad, sharded.device_mesh, sharded.placements, run_check=False,
                                    shape=p.size(), stride=p.stride())
    else:
        p.grad = grad


def local_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """The gradient a backward left in ``p.grad`` (a sharded one's local shard), zeros where
    the parameter took no part (every rank's slots hold the same shapes)."""
    grad: Any = p.grad
    if grad is None:
        param: Any = p
        return torch.zeros_like(param.to_local() if is_dtensor(p) else p, memory_format=torch.contiguous_format)
    return grad.to_local() if is_dtensor(grad) else grad


def slot_reduction(net: torch.nn.Module, params: list[torch.nn.Parameter], accumulation_steps: int,
                   weight: Callable[[], Any]) -> Union[SlotReduction, FsdpSlotReduction]:
    """The canonical sum of each step's slots for ``net`` (the module the step trains: DDP's
    wrapper, a sharded net, a plain one) in this process group: FSDP2's hook for a net sharded
    over several ranks, else the fold and exchange of :class:`SlotReduction`. ``weight()`` is
    the weight of the micro-batch under way (the hook weighs during the backward)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and any(is_dtensor(p) for p in params):
        return FsdpSlotReduction(net, params, world, accumulation_steps, weight)
    return SlotReduction(params, world, dist.get_rank() if world > 1 else 0, accumulation_steps)
