"""A CUDA out-of-memory error in ``fit``, told where it happened: the step, the phase (forward,
backward, optimizer, validation, ...) and, where CUDA exists, a memory snapshot's path.

Nothing runs per step: the phase is read from the error's traceback once it is raised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from types import TracebackType
from typing import Optional

import torch

from ... import distributed
from ...events import PositionView, declared

__all__ = ["describe_out_of_memory", "diagnostics_dir", "failing_phase"]

_logger = logging.getLogger(__name__)

#: functions whose frame on the traceback names the phase, outermost phase first
_PHASES = (("evaluate_batches", "validation"), ("backward", "backward"), ("<optimizer>", "optimizer"),
           ("fit_batch", "forward"), ("to_device", "moving the batch to the device"))


def failing_phase(traceback: Optional[TracebackType]) -> str:
    """The phase of the step the traceback ran in: ``"validation"``, ``"backward"``,
    ``"optimizer"`` (a method of an optimizer or gradient scaler), ``"forward"``, ``"moving the
    batch to the device"``, else ``"a handler"`` (an event hook outside those)."""
    names = set()
    while traceback is not None:
        frame = traceback.tb_frame
        names.add(frame.f_code.co_name)
        if isinstance(frame.f_locals.get("self"), (torch.optim.Optimizer, torch.amp.GradScaler)):
            names.add("<optimizer>")
        traceback = traceback.tb_next
    for function, phase in _PHASES:
        if function in names:
            return phase
    return "a handler"


def diagnostics_dir(handlers: Sequence[object]) -> str:
    """The first handler's ``diagnostics_location`` (a ``ProfilerHandler``'s ``log_dir``), else the
    local checkpoint directory, else the working directory."""
    for handler in handlers:
        location = declared(handler, "diagnostics_location")
        if location is not None:
            return str(location)
    for handler in handlers:
        location = declared(handler, "checkpoint_location")
        if location is not None and "://" not in str(location):
            return str(location)
    return os.getcwd()


def _dump_snapshot(handlers: Sequence[object], step: int) -> Optional[str]:
    """Write the CUDA allocator's snapshot (with its history when ``_record_memory_history`` was
    on); its path, or None without CUDA or when it cannot be written (logged)."""
    if not torch.cuda.is_available():
        return None
    path = os.path.join(diagnostics_dir(handlers), f"oom_snapshot_rank{distributed.get_rank()}_step{step}.pickle")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.cuda.memory._dump_snapshot(path)
    except (OSError, RuntimeError):
        _logger.exception("Could not write the memory snapshot %s", path)
        return None
    return path


def describe_out_of_memory(error: torch.cuda.OutOfMemoryError, pos: PositionView,
                           handlers: Sequence[object]) -> torch.cuda.OutOfMemoryError:
    """``error`` told where it happened (the fit's position ``pos``; the snapshot written where
    ``handlers`` say, :func:`diagnostics_dir`): raise the result ``from error``."""
    phase = failing_phase(error.__traceback__)
    step = pos.step if phase == "validation" else pos.step + 1  # validation follows the epoch's last step
    where = f"validation after step {step}" if phase == "validation" else f"step {step} ({phase})"
    snapshot = _dump_snapshot(handlers, step)
    saved = f"; memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)" if snapshot else ""
    return torch.cuda.OutOfMemoryError(f"out of memory in {where}, epoch {pos.epoch + 1}{saved}. {error}")
