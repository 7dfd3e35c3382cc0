"""TensorBoard event files: keep a resumed run's curves from forking.

A run that resumes from step ``k`` after having written events past ``k`` (it crashed after its
last checkpoint) would show two values for those steps. :func:`carry_over_events` moves the
events that are still valid into a new writer and deletes the old files, so the directory holds
each step once, whatever program reads it (TensorBoard's ``purge_step`` only hides events from
readers that honour it, and cannot serve tags whose steps count epochs and tags whose steps
count batches at once).

Needs the ``tensorboard`` package; imported lazily.
"""

from __future__ import annotations

import os
from typing import Any, Callable

__all__ = ["carry_over_events", "event_files"]

_PREFIX = "events.out.tfevents."


def event_files(run_dir: str) -> list[str]:
    """The event files directly in ``run_dir``, in the order TensorBoard reads them."""
    if not os.path.isdir(run_dir):
        return []
    return sorted(os.path.join(run_dir, f) for f in os.listdir(run_dir) if f.startswith(_PREFIX))


def carry_over_events(files: list[str], keep: Callable[[str, int], bool], file_writer: Any) -> int:
    """Copy the summary values of ``files`` for which ``keep(tag, step)`` holds, in order and with
    their wall times, to ``file_writer`` (a ``torch.utils.tensorboard`` ``FileWriter``); flush it,
    then delete ``files``. Returns the number of values copied.

    Version headers and session logs (``purge_step`` markers) are dropped; other events (graphs,
    metadata) are kept.

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> d = tempfile.mkdtemp()
        >>> old = SummaryWriter(d)
        >>> for step in (1, 2, 3):
        ...     old.add_scalar("batch/loss", 1.0 / step, step)
        >>> old.close()
        >>> files = event_files(d)
        >>> new = SummaryWriter(d)
        >>> carry_over_events(files, lambda tag, step: step <= 2, new.file_writer)
        2
        >>> new.close()
        >>> len(event_files(d))
        1
    """
    # heavy (tensorboard imports protobuf and more): only when event files are copied
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    copied = 0
    for path in files:
        for event in LegacyEventFileLoader(path).Load():  # as written: no migration
            if event.HasField("file_version") or event.HasField("session_log"):
                continue
            if event.HasField("summary"):
                values = [v for v in event.summary.value if keep(v.tag, event.step)]
                if not values:
                    continue
                if len(values) != len(event.summary.value):
                    del event.summary.value[:]
                    event.summary.value.extend(values)
                copied += len(values)
            file_writer.add_event(event, step=event.step, walltime=event.wall_time)
    file_writer.flush()
    for path in files:
        os.remove(path)
    return copied
