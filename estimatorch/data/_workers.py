"""What a rebuilt ``DataLoader``'s worker processes run first: :class:`IgnoreStopSignals`, so
that a stop signal sent to the whole process group is the main process's to act on (see
``estimatorch.estimator._stopping.interrupts``)."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable, Optional

from ..distributed import cluster

__all__ = ["IgnoreStopSignals"]

#: seconds the exit of a process waits for its daemonic children to end after SIGTERM before SIGKILL
#: (:func:`_end_children_at_exit`)
EXIT_WAIT = 5.0
_logger = logging.getLogger(__name__)
_exit_hook_pid = 0


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
        _end_children_at_exit_once()  # in the process that builds the loader

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        requeue = cluster.requeue_signal()  # SLURM's --signal=USR1@N reaches every process of the step
        if requeue is not None:
            signal.signal(requeue, signal.SIG_IGN)
        if self.fn is not None:
            self.fn(worker_id)


def _end_children_at_exit_once() -> None:
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        atexit.register(_end_children_at_exit)  # runs before multiprocessing's (registered on its import)


def _end_children_at_exit() -> None:
    """At the exit of a process whose DataLoader workers ignore SIGTERM: end its daemonic children
    in bounded time.

    multiprocessing's own exit hook sends each daemonic child SIGTERM, then waits for it without
    a limit. A worker that ignores SIGTERM (:class:`IgnoreStopSignals`) and whose loader was never
    shut down (its iterator still referenced at exit, e.g. by the traceback of an error raised
    while it fetched) would keep the process from ending: it gets :data:`EXIT_WAIT` seconds, then
    SIGKILL, with a warning. Nothing is lost: a worker only loads data.
    """
    children = [child for child in multiprocessing.active_children() if child.daemon]
    if children and threading.current_thread() is threading.main_thread():
        # torch's SIGCHLD handler would raise "DataLoader worker ... is killed by signal" here,
        # out of this hook, and leave the other workers to multiprocessing's unbounded wait
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + EXIT_WAIT
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    stuck = [child for child in children if child.is_alive()]
    for child in stuck:
        child.kill()
        child.join(EXIT_WAIT)
    if stuck:
        _logger.warning("%d worker process(es) still ran at exit %.0f s after SIGTERM (DataLoader workers ignore it "
                        "during fit): ended with SIGKILL", len(stuck), EXIT_WAIT)
