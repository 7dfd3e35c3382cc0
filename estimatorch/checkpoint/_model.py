"""The model's state under the plain module's keys, whatever wraps the module.

``torch.compile`` wraps a module in an ``OptimizedModule`` whose state keys start with
``_orig_mod.`` (also inside a parent, for a compiled submodule: ``encoder._orig_mod.weight``);
DDP and ``DataParallel`` add ``module.``. A checkpoint holds the keys of the module underneath, so
compiled and plain nets resume from each other's files.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any

from torch import nn

__all__ = ["is_sharded_module", "load_model_state", "model_state", "plain_key", "plain_module"]

_COMPILED = "_orig_mod"


def plain_module(net: nn.Module) -> nn.Module:
    """``net`` without the wrappers around it (DDP, ``DataParallel``, ``torch.compile``)."""
    while True:
        if isinstance(net, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            net = net.module
        elif type(net).__name__ == "OptimizedModule" and isinstance(getattr(net, _COMPILED, None), nn.Module):
            net = getattr(net, _COMPILED)
        else:
            return net


def is_sharded_module(net: nn.Module) -> bool:
    """``net`` holds parameters sharded across ranks (``DTensor``s, e.g. after FSDP2's
    ``fully_shard``).

    Example:
        >>> is_sharded_module(nn.Linear(2, 1))
        False
    """
    tensors = sys.modules.get("torch.distributed.tensor")  # (a heavy import: a DTensor exists only once it ran)
    return tensors is not None and any(isinstance(p, tensors.DTensor) for p in net.parameters())


def plain_key(key: str) -> str:
    """A state key (or module prefix) without the ``_orig_mod`` parts ``torch.compile`` adds.

    Example:
        >>> plain_key("encoder._orig_mod.0.weight")
        'encoder.0.weight'
    """
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def _depth(prefix: str) -> int:
    return prefix.split(".").count(_COMPILED)


def _compiled_inside(state: Any) -> bool:
    return any(_COMPILED in key.split(".") for key in state)


def model_state(net: nn.Module) -> Any:
    """``net``'s ``state_dict()`` under the plain module's keys (tensors are not copied)."""
    state = plain_module(net).state_dict()
    if not _compiled_inside(state):
        return state
    plain: Any = OrderedDict((plain_key(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:  # module versions; the compiled module's own entry wins over its wrapper's
        plain._metadata = OrderedDict()
        for prefix in sorted(metadata, key=_depth):
            plain._metadata[plain_key(prefix)] = metadata[prefix]
    return plain


def load_model_state(net: nn.Module, state: Any) -> None:
    """Load a state with plain keys into ``net``, whatever wraps it or its submodules (strict)."""
    target = plain_module(net)
    current = target.state_dict()
    if not _compiled_inside(current):
        target.load_state_dict(state)
        return
    actual = {plain_key(k): k for k in current}
    remapped: Any = OrderedDict((actual.get(k, k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        prefixes = {plain_key(p): p for p in sorted(getattr(current, "_metadata", {}), key=_depth)}
        remapped._metadata = OrderedDict((prefixes.get(p, p), v) for p, v in metadata.items())
    target.load_state_dict(remapped)
