"""What ``fit`` tells a user it stopped: the signal guard with a message that fits where the run
is (checkpointing or not, a notebook, several ranks), and the one line of a clean Ctrl-C stop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ... import _console, distributed
from ...distributed import cluster
from ...events import declared
from .._fit_estimator import FitEstimator
from .._stopping.interrupts import SignalGuard, install_excepthook, is_clean_stop, stop_message

__all__ = ['describe_stop', 'signal_guard']


def signal_guard(handlers: Sequence[object], logger: logging.Logger) -> SignalGuard:
    """Defers SIGINT and SIGTERM (and SLURM's requeue signal under SLURM) to a step boundary, with
    a message that fits where we are, logged on every rank. Warns (rank 0) where a launcher would lose
    the signal or a restart would fail: see ``cluster.agent_drops``, ``cluster.shared_store_restarts``."""
    # only a handler writing resumable checkpoints saves the boundary (exporters do not)
    savers = [h for h in handlers if declared(h, "checkpoint_location") is not None]

    def describe(name: str) -> str:
        rank = f"[rank {distributed.get_rank()}] " if distributed.is_distributed() else ""
        return rank + stop_message(name, notebook=_console.in_notebook(), checkpointing=bool(savers),
                                   resumes=any(declared(h, "resumes_run") for h in savers),
                                   multi=distributed.is_distributed())

    if not _console.in_notebook():  # a script ends a clean Ctrl-C stop with one line, not a traceback
        install_excepthook()
    requeue = cluster.requeue_signal()
    dropped = cluster.agent_drops(requeue)  # srun torchrun: the agent must pass the signal on
    if dropped is not None:
        logger.warning(dropped)
    shared = cluster.shared_store_restarts()  # several torchrun agents: a restart would meet the dead store
    if shared is not None:
        logger.warning(shared)
    return SignalGuard(describe, lambda message: logger.warning(message, extra={"all_ranks": True}),
                       requeue=requeue, resumes=any(declared(h, "resumes_run") for h in savers))


def describe_stop(error: BaseException, estimator: FitEstimator, handlers: Sequence[object]) -> BaseException:
    """Give the ``KeyboardInterrupt`` of a clean Ctrl-C stop (once ``train_end`` has saved) its
    one line: where it stopped, what was saved, how to resume; returns ``error``."""
    if not is_clean_stop(error):
        return error
    pos = estimator.position
    savers = [h for h in handlers if declared(h, "checkpoint_location") is not None]
    where = f"stopped by Ctrl-C after step {pos.step} (epoch {pos.epoch + (pos.phase != 'epoch_end')})"
    if _console.in_notebook():
        how = "fit(..., resume=True) continues from there"
    elif any(declared(h, "resumes_run") for h in savers):
        how = f"checkpoint in {declared(savers[0], 'checkpoint_location')}: run the script again to resume"
    elif savers:
        how = (f"checkpoint in {declared(savers[0], 'checkpoint_location')}: to resume, run again with "
               "CheckpointHandler(..., resume_from_checkpoint=True)")
    else:
        how = "nothing saved: add CheckpointHandler(model_dir, resume_from_checkpoint=True) to resume after a stop"
    error.args = (f"{where}; {how}",)
    return error
