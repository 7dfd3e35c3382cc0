"""Where a rank is, in words, and the watchdog's one line over every rank: what
:mod:`estimatorch.distributed._rank_watch` tells when a rank hangs or another rank's failure ends it.

Part of :mod:`estimatorch.distributed`; imports nothing of estimatorch's.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Sequence
from types import FrameType
from typing import Any, Optional

__all__ = ["summarize", "where_is"]


def _rel(path: str) -> str:
    return os.path.basename(path)


def where_is(frame: Optional[FrameType]) -> str:
    """Where a thread whose innermost frame is ``frame`` is, in words: ``"in the dataset's
    __getitem__ (data.py:41)"``, ``"in the DataLoader's collate"``, ``"waiting for a DataLoader
    worker"``, ``"waiting in a collective (all_reduce)"``, ``"in backward (...)"``, else the
    innermost function (``"in train_step (train.py:12)"``); ``"in validation, ..."`` when it is
    in ``evaluate``."""
    if frame is None:
        return "gone (its training thread ended)"
    stack = traceback.extract_stack(frame)
    files = [f.filename.replace("\\", "/") for f in stack]
    prefix = "in validation, " if any(f.name == "evaluate_batches" for f in stack) else ""
    fetch = [i for i, name in enumerate(files) if name.endswith("torch/utils/data/_utils/fetch.py")]
    if fetch and fetch[-1] + 1 < len(stack):
        callee, inner = stack[fetch[-1] + 1], _innermost_own(stack[fetch[-1] + 1:])
        place = f"({_rel(inner.filename)}:{inner.lineno})"
        if "collate_fn" in (stack[fetch[-1]].line or ""):
            return prefix + "in the DataLoader's collate" + ("" if "/torch/" in inner.filename else " " + place)
        return prefix + f"in the dataset's {callee.name} {place}"
    inner = stack[-1]
    if any(f.endswith("torch/utils/data/dataloader.py") for f in files):  # and not fetching itself
        return prefix + "waiting for a DataLoader worker"
    for i in range(len(files) - 1, -1, -1):
        if "torch/distributed/" in files[i] and "torch/distributed/checkpoint" not in files[i]:
            return prefix + f"waiting in a collective ({stack[i].name})"
    if any("torch/autograd/" in f for f in files):
        return prefix + "in backward (under DDP it waits there for the gradients' all-reduce)"
    inner = _innermost_own(stack)
    return prefix + f"in {inner.name} ({_rel(inner.filename)}:{inner.lineno})"


_STDLIB = os.path.dirname(os.__file__)


def _innermost_own(stack: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary:
    """The innermost frame of the program's own code (not Python's library nor torch's), else
    the innermost frame."""
    for frame in reversed(stack):
        name = frame.filename.replace("\\", "/")
        if not name.startswith(_STDLIB) and "/torch/" not in name:
            return frame
    return stack[-1]


def _waiting(where: str) -> bool:
    return "waiting in a collective" in where or "in backward" in where


def summarize(statuses: dict[int, dict[str, Any]], world: int, timeout: float) -> str:
    """The watchdog's one line: the ranks behind (the fewest completed steps; among those, the
    ones not waiting for the others), then the others, and where the stacks are."""
    if not statuses:
        return f"watchdog: no step completed for {timeout:g} s; no rank answered"
    least = min(s["step"] for s in statuses.values())
    behind = [r for r, s in sorted(statuses.items()) if s["step"] == least]
    working = [r for r in behind if not _waiting(statuses[r]["where"])]
    behind = working or behind
    def line(r: int) -> str:
        return f"rank {r}: step {statuses[r]['step']}, {statuses[r]['where']}"
    text = f"watchdog: no step completed for {timeout:g} s; behind: " + "; ".join(line(r) for r in behind)
    others = [r for r in sorted(statuses) if r not in behind]
    if others:
        text += " | others: " + "; ".join(line(r) for r in others)
    silent = [r for r in range(world) if r not in statuses]
    if silent:
        text += " | no answer from rank " + ", ".join(map(str, silent))
    paths = [s["path"] for s in statuses.values() if s.get("path")]
    if paths:
        text += f" | stacks: {os.path.dirname(paths[0]) or '.'}/hang_stacks_rank*"
    return text
