"""Watching training costs no host-device sync except where something is shown or decided.

Every way a tensor's value reaches the host (``item``, ``bool``, ``float``, ``tolist``, ``cpu``,
``numpy``) is counted during a fit with the progress bar, logging every N batches, TensorBoard
every N batches and the NaN check every N batches. Twice the steps with the same number of
firings must cost exactly the same syncs, and a step where nothing fires must cost none.
"""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from estimatorch.event_handlers import (
    LambdaHandler,
    LoggingHandler,
    ProgressBarHandler,
    TensorBoardHandler,
    TerminateOnNaNHandler,
)
from tests.conftest import make_batches, make_estimator

SYNCS = ("item", "__bool__", "__float__", "tolist", "cpu", "numpy")
EPOCHS = 4


@pytest.fixture
def syncs(monkeypatch):
    """A Counter of the host transfers made while the fixture is active."""
    counts: Counter = Counter()
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def watched_fit(tmp_path, syncs, batches_per_epoch, interval):
    """Fit with the four watching handlers firing every ``interval`` batches. Returns the
    syncs of the whole fit and, per step, the syncs between its batch_begin and the end of its
    batch_end (probes at both ends)."""
    est = make_estimator()
    data = make_batches(batches_per_epoch, batch_size=4)
    per_step: list[int] = []
    mark = []
    first = LambdaHandler(batch_begin=lambda e, **kw: mark.append(sum(syncs.values())), priority=-float("inf"))
    last = LambdaHandler(batch_end=lambda e, **kw: per_step.append(sum(syncs.values()) - mark[-1]),
                         priority=float("inf"))
    handlers = [
        first,
        ProgressBarHandler(refresh_interval=1e9, file=io.StringIO()),  # redraws only when a bar opens or closes
        LoggingHandler(log_interval=interval),
        TensorBoardHandler(tmp_path / f"tb{batches_per_epoch}", log_interval=interval),
        TerminateOnNaNHandler(check_every=interval),
        last,  # after LoggingHandler and ProgressBarHandler (+inf too): the order given breaks ties
    ]
    syncs.clear()
    est.fit(data, epochs=EPOCHS, event_handlers=handlers)
    total = Counter(syncs)
    assert len(per_step) == EPOCHS * batches_per_epoch
    return total, per_step


def test_syncs_grow_with_firings_not_with_steps(tmp_path, syncs):
    short, short_steps = watched_fit(tmp_path, syncs, batches_per_epoch=50, interval=50)   # 200 steps
    long, long_steps = watched_fit(tmp_path, syncs, batches_per_epoch=100, interval=100)   # 400 steps
    assert sum(short.values()) > 0  # the counting works: firings do read values
    assert long == short  # twice the steps, the same firings: exactly the same syncs
    for steps, interval in ((short_steps, 50), (long_steps, 100)):
        quiet = [n for i, n in enumerate(steps, start=1) if i % interval]
        assert quiet == [0] * len(quiet)  # a step where nothing fires reads nothing
        assert all(n > 0 for i, n in enumerate(steps, start=1) if i % interval == 0)


def test_the_same_cadence_over_more_steps_adds_only_the_extra_firings(tmp_path, syncs):
    """LoggingHandler(log_interval=50) & co over 200 and 400 steps: the extra syncs are those of
    the extra firings (as many again), none from the extra steps."""
    short, short_steps = watched_fit(tmp_path, syncs, batches_per_epoch=50, interval=50)
    long, long_steps = watched_fit(tmp_path, syncs, batches_per_epoch=100, interval=50)
    per_firing = short_steps[49]  # what one firing step of every handler costs
    firings = {50: EPOCHS, 100: 2 * EPOCHS}
    assert [n for n in long_steps if n] == [per_firing] * firings[100]
    assert sum(long.values()) - sum(short.values()) == (firings[100] - firings[50]) * per_firing
