"""Whether every replica still trains the same model: a bitwise fingerprint of a rank's training
state (parameters and optimizer state), and the ranks' fingerprints compared in one collective.

The fingerprint is exact: each tensor's bits are read as integers of its element size, each
value is mixed with its index (``(bits * A + index * B)``, then ``x ^ (x >> 29)``, in wrapping
64-bit integer arithmetic) and the results summed into a 64-bit integer (integer sums do not round,
and wrap the same way in any order and on any device); the tensors' sums are combined with odd
weights by their place in the state. Any change of one value's bits changes it (-0.0 and 0.0, two
NaNs of other payloads included), where a float sum could hide a change below its rounding; the
mixing makes changes of several values that cancel in a plain sum of the bits (1.0 and 2.0 for 1.5
and 1.5), and values swapped between places, count too: two different states share a fingerprint
only by a 64-bit coincidence. It covers the parameters and the optimizer's state tensors (momentum,
Adam's moments and step), not the buffers: DDP broadcasts rank 0's buffers before each forward,
then each rank's forward updates its own (BatchNorm's running statistics differ between ranks at a
step's end by design).

Computing it reads every parameter and state tensor once, in chunks of :data:`CHUNK` values (a few
elementwise kernels and one reduction per chunk, temporaries of a chunk's size, on the tensor's
device); nothing reaches the host until the ranks compare (one ``all_gather`` of one int64 per
rank, then one read of the gathered values).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ReplicaDivergenceError", "differing_ranks", "gather_fingerprints", "state_fingerprint", "state_tensors"]

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK, _SIGN = (1 << 64) - 1, 1 << 63
#: values mixed at a time (the temporaries of a chunk: a few int64 tensors of this length)
CHUNK = 1 << 22
_A, _B = 0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64)  # odd 64-bit constants, as int64


class ReplicaDivergenceError(RuntimeError):
    """The ranks' training states differ (``Estimator(check_replicas_every=...)``): a replica
    drifted apart (a faulty device, a flipped bit, a rank that stepped differently).

    Attributes:
        ranks: the global ranks whose state differs from the others'.
        steps: ``(good, bad)``: the last step the ranks were checked the same, and the step where
            they were found to differ (steps: batches trained by each process).
        fingerprints: every rank's fingerprint, in rank order.
    """

    def __init__(self, message: str, ranks: Sequence[int], steps: tuple[int, int], fingerprints: Sequence[int]):
        super().__init__(message)
        self.ranks, self.steps, self.fingerprints = list(ranks), steps, list(fingerprints)

    def __reduce__(self) -> Any:  # sent between processes whole (the spawn launcher, share_outcome)
        return type(self), (str(self), self.ranks, self.steps, self.fingerprints)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor: this rank's shard
    return to_local() if callable(to_local) else tensor


def state_tensors(net: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """What the fingerprint covers, in a fixed order: ``net``'s parameters (this rank's shards of
    sharded ones), then for each parameter of ``optimizer``'s groups, in order, its state's
    tensors by key."""
    tensors = [_local(p.detach()) for p in net.parameters()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                tensors += [_local(state[key].detach()) for key in sorted(state, key=str)
                            if isinstance(state[key], torch.Tensor)]
    return tensors


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    return tensor.view(_INTS[tensor.element_size()]) if tensor.is_floating_point() else tensor  # ints: their bits


def _mixed_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor``'s values' bits mixed with their indices (module notes), 0-dim int64."""
    bits = _bits(tensor).reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, bits.numel(), CHUNK):
        x = bits[start:start + CHUNK].to(torch.int64, copy=True)  # never the tensor itself (int64 already)
        index = torch.arange(start, start + x.numel(), dtype=torch.int64, device=tensor.device)
        x.mul_(_A).add_(index.mul_(_B))
        x.bitwise_xor_(x >> 29)
        total += x.sum()
    return total


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value & _SIGN else value


def state_fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The exact fingerprint of ``tensors`` (see the module's notes): a 0-dim int64 tensor on the
    device of the first tensor not on the CPU (else the CPU), with no host-device synchronisation
    (the CPU tensors' part, an optimizer's step counts, is added as a number).

    Example:
        >>> a = torch.tensor([1.0, -0.0])
        >>> int(state_fingerprint([a])) == int(state_fingerprint([a.clone()]))
        True
        >>> int(state_fingerprint([a])) == int(state_fingerprint([torch.tensor([1.0, 0.0])]))
        False
    """
    kept = [(2 * j + 1, t) for j, t in enumerate(tensors)
            if t.layout == torch.strided and not t.is_meta and t.numel() > 0]
    device = next((t.device for _, t in kept if t.device.type != "cpu"), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.int64, device=device)
    host = 0
    for weight, tensor in kept:  # numbers as kernel arguments: nothing is copied from the host
        part = _mixed_sum(tensor) * weight
        if tensor.device == device:
            total += part
        else:  # the CPU's part (an optimizer's step counts), read without waiting for the device
            host += int(part)
    return total + _signed(host) if host else total


def gather_fingerprints(fingerprint: torch.Tensor, group: Any = None) -> list[int]:
    """Every rank's ``fingerprint`` in ``group`` (the default group when None), in the group's
    rank order, on every rank: one ``all_gather`` of one int64, then one read on the host."""
    if not dist.is_available() or not dist.is_initialized():
        return [int(fingerprint)]
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = fingerprint.reshape(1).to(device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return torch.cat(rows).tolist()


def differing_ranks(values: Sequence[int]) -> tuple[int, list[int]]:
    """The fingerprint most ranks hold (on a tie, the one of the lowest rank among the most
    held) and the indices of the ranks that differ from it.

    Example:
        >>> differing_ranks([7, 7, 9, 7]), differing_ranks([7, 9])
        ((7, [2]), (7, [1]))
    """
    counts = Counter(values)
    most = max(counts.values())
    reference = next(v for v in values if counts[v] == most)
    return reference, [rank for rank, v in enumerate(values) if v != reference]
