"""What a rebuilt ``DataLoader``'s worker processes run first: :class:`IgnoreStopSignals`, so
that a stop signal sent to the whole process group is the main process's to act on (see
``estimatorch.estimator._interrupts``)."""

from __future__ import annotations

import signal
from typing import Any, Callable, Optional

from .. import cluster

__all__ = ["IgnoreStopSignals"]


class IgnoreStopSignals:
    """A DataLoader ``worker_init_fn``: the worker ignores SIGINT, SIGTERM and, under SLURM, the
    requeue signal (SIGUSR1 unless configured), then runs ``fn``.

    A worker that took Ctrl-C as a ``KeyboardInterrupt`` would exit, and the main process, which
    trains on to the step boundary to checkpoint it, would fail with "DataLoader worker exited
    unexpectedly". Picklable when ``fn`` is (a spawned worker receives it pickled).

    Args:
        fn: the loader's own ``worker_init_fn``, called with the worker's id. Defaults to None.
    """

    def __init__(self, fn: Optional[Callable[[int], Any]] = None):
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        requeue = cluster.requeue_signal()  # SLURM's --signal=USR1@N reaches every process of the step
        if requeue is not None:
            signal.signal(requeue, signal.SIG_IGN)
        if self.fn is not None:
            self.fn(worker_id)
