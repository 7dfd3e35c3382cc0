"""``fit``'s watch over the ranks (:mod:`estimatorch.distributed._rank_watch`): started with the loop,
stopped when ``fit`` ends. A step that raised on this rank is published to the others (they end
within seconds instead of waiting in their next collective); an error this rank meets because
another rank failed first is raised as a :class:`~estimatorch.distributed.RankFailedError`
naming that rank and its exception; ``Estimator(watchdog=...)`` reports a hang.

Nothing runs per step: the thread reads the position the loop keeps anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ...distributed import RankWatch
from .._fit_estimator import FitEstimator
from .._state.run import Run
from .oom import diagnostics_dir

__all__ = ["publish_failure", "watching"]


@contextlib.contextmanager
def watching(estimator: FitEstimator, run: Run) -> Iterator[RankWatch]:
    """Watch the ranks for the duration of the block (the loop and ``train_end``)."""
    pos = run.pos
    watch = RankWatch(lambda: pos.step, estimator.logger, estimator.watchdog,
                      lambda: diagnostics_dir(run.dispatch.handlers)).start()
    try:
        yield watch
    except BaseException as err:
        replacement = watch.peer_error(err)
        if replacement is None:
            raise
        raise replacement from err
    finally:
        watch.stop()


def publish_failure(watch: RankWatch, run: Run, error: BaseException) -> None:
    """Tell the other ranks that this rank's fit failed (not for a stop every rank agreed on)."""
    if run.signals.stopped is None:
        watch.failed(error, run.pos.step)
