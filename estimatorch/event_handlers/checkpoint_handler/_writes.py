"""How a :class:`~estimatorch.CheckpointHandler` hands a save to its background writer, and
ends its background writes at ``train_end``: which ranks wait for the write in flight and where
its failure is raised."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from ... import checkpoint, distributed
from ...events import EstimatorView

__all__ = ["finish_background_write", "submit_background_write"]


def submit_background_write(writer: checkpoint.BackgroundWriter, state: Any, paths: list[str],
                            write: Callable[[Any, bool], None]) -> None:
    """Hand a save of ``state`` to ``paths`` to the background writer: the files to its process,
    then ``write(None, True)`` on its thread (the pointer, retention); or everything to its
    thread (``async_save="thread"``): ``write(staged, False)``."""
    if isinstance(writer, checkpoint.ProcessWriter):
        writer.submit_files(state, paths, lambda: write(None, True))
    else:
        writer.submit(state, lambda staged: write(staged, False))


def finish_background_write(writer: Optional[checkpoint.BackgroundWriter], sharded: bool,
                            estimator: EstimatorView) -> None:
    """Wait for the background write in flight and raise its failure: on every rank where
    every rank ends the fit at the same boundary (a signal, or the plan's end or a stop with
    no error on its way), else (an error, maybe on this rank only: no collective) where it
    was met. (For a ``sharded`` net every rank has a writer of its own part.)"""
    if writer is None:
        return
    together = estimator.interruption is not None or (estimator.position.stop and sys.exc_info()[1] is None)
    what = "CheckpointHandler writing a checkpoint in the background"
    if sharded:
        error: Optional[BaseException] = None
        try:
            writer.wait()
        except Exception as err:  # noqa: BLE001 - every rank raises it, or this one where ranks part
            error = err
        if together:
            distributed.raise_on_every_rank(error, what)
        elif error is not None:
            raise error
    elif together:
        distributed.run_on_main(writer.wait, what)
    elif distributed.is_main_process():
        writer.wait()
