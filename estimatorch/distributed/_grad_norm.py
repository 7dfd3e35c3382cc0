"""Gradient clipping by a 2-norm that is the same floats however the gradients are sharded
(``world_size_invariant``; FSDP2 shards each parameter along dim 0).

The norm is added up by rows: each parameter's gradient is seen as rows along dim 0 (a scalar
as one row, a vector's elements as rows of one), each row's sum of squares is taken where the
row is (a row is never split between ranks), the rows of every rank are gathered in order into
the parameter's full column of row sums (one ``all_gather`` of a few floats per row for all
parameters at once, only for a sharded net), and those are added the same way on any sharding:
the parameter's sum over its rows, then the sum over parameters, then the square root. The clip
then multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``, as torch's
``clip_grad_norm_`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._slot_reduction import is_dtensor

__all__ = ["clip_by_rows_"]


def _rows(grad: torch.Tensor) -> torch.Tensor:
    """The sums of squares of ``grad``'s rows along dim 0 (float32 at least)."""
    flat = grad.reshape(grad.shape[0], grad[0].numel() if grad.shape[0] else 0) if grad.dim() else grad.reshape(1, 1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return flat.square().sum(dim=1)


def clip_by_rows_(params: list[torch.nn.Parameter], max_norm: float, group: Any = None) -> torch.Tensor:
    """Clip the gradients of ``params`` (sharded ones: their local shards) in place to a total
    2-norm of ``max_norm``; returns the norm (a device tensor). ``group``: the ranks a sharded
    net's gradients are spread over. Defaults to None (the default group, when sharded).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> w.grad = torch.full((2, 2), 2.0)
        >>> float(clip_by_rows_([w], 1.0)), round(float(w.grad.norm()), 4)
        (4.0, 1.0)
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    grads: list[torch.Tensor] = []
    for p in with_grad:
        grad: Any = p.grad
        assert grad is not None, "kept: a gradient"
        grads.append(grad.to_local() if is_dtensor(grad) else grad)
    rows = [_rows(g) for g in grads]
    if any(is_dtensor(p.grad) for p in with_grad) and dist.is_initialized() \
            and dist.get_world_size(group) > 1:
        rows = _gathered(with_grad, rows, group)
    norm = torch.stack([r.sum() for r in rows]).sum().sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm


def _gathered(params: list[torch.nn.Parameter], rows: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Every parameter's full column of row sums: each rank's rows, in rank order (dim-0 shards
    of ``ceil(R / W)`` rows, the last ones shorter or empty, as FSDP2 chunks them)."""
    world, ref = dist.get_world_size(group), rows[0]
    chunks = [-(-(p.shape[0] if p.dim() else 1) // world) for p in params]
    pack = torch.zeros(sum(chunks), dtype=ref.dtype, device=ref.device)
    offset = 0
    for r, chunk in zip(rows, chunks):
        pack[offset:offset + r.numel()] = r
        offset += chunk
    every = torch.empty(world * pack.numel(), dtype=ref.dtype, device=ref.device)
    dist.all_gather_single(every, pack, group=group)
    every = every.view(world, pack.numel())
    out, offset = [], 0
    for p, chunk in zip(params, chunks):
        total = p.shape[0] if p.dim() else 1
        parts = [every[rank, offset:offset + max(0, min(chunk, total - rank * chunk))] for rank in range(world)]
        out.append(torch.cat(parts))
        offset += chunk
    return out
