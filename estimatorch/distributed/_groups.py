"""The gloo groups of every rank the package creates beside the default group (side work,
host-side flags, the items of a step), one per purpose, cached per default group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["gloo_group"]

#: the one cache of the groups this module creates: (id of the default group, purpose) -> (that
#: default group, a gloo group of every rank). A new process group gets new ones.
_GROUPS: dict[tuple[int, str], tuple[Any, Any]] = {}


def gloo_group(purpose: str) -> Any:
    """The gloo group of every rank for ``purpose`` under the current default group: created at
    the first call (a collective: every rank calls it at the same point), then reused."""
    world = dist.group.WORLD
    cached = _GROUPS.get((id(world), purpose))
    if cached is None or cached[0] is not world:  # (an id a destroyed group had is no match)
        cached = _GROUPS[(id(world), purpose)] = (world, dist.new_group(backend="gloo"))
    return cached[1]
