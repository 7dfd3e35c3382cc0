"""``fit``'s watch over the ranks (:mod:`estimatorch.distributed._rank_watch`): started with the loop,
stopped when ``fit`` ends. A step that raised on this rank is published to the others (they end
within seconds instead of waiting in their next collective); an error this rank meets because
another rank failed first is raised as a :class:`~estimatorch.distributed.RankFailedError`
naming that rank and its exception; ``Estimator(watchdog=...)`` reports a hang.

Nothing runs per step: the thread reads the position the loop keeps anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from ...distributed import RankWatch
from ...events import PositionView
from .._fit_estimator import FitEstimator
from .interrupts import SignalGuard
from .oom import diagnostics_dir

__all__ = ["publish_failure", "watching"]


@contextlib.contextmanager
def watching(estimator: FitEstimator, pos: PositionView, handlers: Sequence[object]) -> Iterator[RankWatch]:
    """Watch the ranks for the duration of the block (the loop and ``train_end``): ``pos`` is the
    run's position (the loop moves it; the watch reads its step), ``handlers`` the fit's (where a
    hang's diagnostics go)."""
    watch = RankWatch(lambda: pos.step, estimator.logger, estimator.watchdog,
                      lambda: diagnostics_dir(handlers)).start()
    try:
        yield watch
    except BaseException as err:
        replacement = watch.peer_error(err)
        if replacement is None:
            raise
        raise replacement from err
    finally:
        watch.stop()


def publish_failure(watch: RankWatch, signals: SignalGuard, pos: PositionView, error: BaseException) -> None:
    """Tell the other ranks that this rank's fit failed at ``pos`` (not for a stop every rank
    agreed on: ``signals`` stopped the fit)."""
    if signals.stopped is None:
        watch.failed(error, pos.step)
