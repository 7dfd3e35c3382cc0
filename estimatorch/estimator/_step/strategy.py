"""How ``fit`` spreads a net over the ranks: DDP (a full copy per rank, gradients all-reduced) or
FSDP2 (parameters, gradients and optimizer state sharded across ranks with ``fully_shard``).

A net whose parameters are already ``DTensor``s (the user called ``fully_shard``) is trained as
it is. ``strategy="fsdp"`` shards a plain net when ``fit`` starts: each top-level child that has
parameters, then the root, as the FSDP2 examples do, and the optimizer built over the plain
parameters is pointed at the sharded ones (same names, same groups and hyper-parameters; it must
not have stepped yet). Without a process group both strategies train the net as it is; in a
process group of one process (``torchrun --nproc_per_node 1``) ``"fsdp"`` shards over that one
rank, so that its checkpoints are sharded directories that resume on more ranks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ... import distributed
from ...checkpoint import is_sharded_module
from .._fit_estimator import FitEstimator
from .._setup.arguments import PRECISIONS

__all__ = ["STRATEGIES", "check_strategy", "train_wrapper", "wraps"]

#: what ``Estimator(strategy=...)`` accepts (None: "fsdp" for a sharded net, else "ddp").
STRATEGIES = ("ddp", "fsdp")


def check_strategy(strategy: object, net: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Optional[str]:
    """``strategy`` checked against the net and the optimizer it will train."""
    if strategy is None:
        return None
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)} or None, got {strategy!r}")
    if strategy == "ddp" and is_sharded_module(net):
        raise ValueError("strategy='ddp' but net's parameters are already sharded (DTensors, after fully_shard): "
                         "pass strategy='fsdp' or None")
    if strategy == "fsdp" and optimizer is not None and optimizer.state:
        raise ValueError("strategy='fsdp' shards the net when fit starts and points the optimizer at the sharded "
                         "parameters, but this optimizer has already stepped (it holds state of the plain ones): "
                         "build the optimizer afresh, or shard the net yourself with fully_shard first")
    return str(strategy)  # one of STRATEGIES


def wraps(est: FitEstimator) -> bool:
    """Whether ``fit`` calls :func:`train_wrapper`: under a process group of several processes,
    or of any size for ``strategy="fsdp"``."""
    return distributed.is_distributed() or (
        est.strategy == "fsdp" and torch.distributed.is_available() and torch.distributed.is_initialized())


def train_wrapper(est: FitEstimator) -> Optional[nn.Module]:
    """What ``fit`` trains under a process group: a DDP wrapper of ``est.net``, or None when the
    net is sharded (it trains itself; ``strategy="fsdp"`` shards it here first)."""
    if is_sharded_module(est.net):
        return None
    if est.strategy == "fsdp":
        shard(est.net, est.optimizer, est.device, PRECISIONS[est.precision])
        return None
    ids = [est.device.index] if est.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(est.net, device_ids=ids)


def shard(net: nn.Module, optimizer: Optional[torch.optim.Optimizer], device: torch.device,
          amp_dtype: Optional[torch.dtype]) -> None:
    """``fully_shard`` each top-level child with parameters, then ``net``; point ``optimizer`` at
    the sharded parameters. Under bf16 the parameters are gathered in bf16 and gradients reduced
    in float32 (FSDP2's ``MixedPrecisionPolicy``)."""
    from torch.distributed.device_mesh import init_device_mesh  # heavy (FSDP2 and DTensor): strategy="fsdp" only
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # heavy: strategy="fsdp" only

    names = {id(p): name for name, p in net.named_parameters()}
    mesh = init_device_mesh(device.type, (distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32) \
        if amp_dtype is torch.bfloat16 else MixedPrecisionPolicy()
    for child in net.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    if optimizer is not None:
        sharded = dict(net.named_parameters())
        for group in optimizer.param_groups:
            group["params"] = [sharded[names[id(p)]] if id(p) in names else p for p in group["params"]]
