"""The step-time split the loop measures for a handler that declares ``times_steps``: its parts
add up to the steps' time, a slow part shows where it is, and a fit without such a handler is
not clocked at all."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from estimatorch import Estimator
from estimatorch.estimator import _loop
from estimatorch.events import PARTS, BatchBegin, BatchEnd, EpochBegin, EpochEnd, Handler
from tests.conftest import make_batches, make_estimator

SLEEP = 0.03  # seconds a slow part takes per step: far above what the rest of a step costs here


class Watch(Handler, EpochBegin, EpochEnd):
    """Reads the split at each epoch's end, and the wall time between epoch_begin and epoch_end."""

    times_steps = True
    priority = -5000  # before validation: the epoch's time is its batches'

    def __init__(self):
        self.splits, self.walls, self._begun = [], [], 0.0
        self._last = None

    def epoch_begin(self, estimator, **kwargs):
        self._last = estimator.step_times.split()
        self._begun = time.perf_counter()

    def epoch_end(self, estimator, **kwargs):
        self.walls.append(time.perf_counter() - self._begun)
        now = estimator.step_times.split()
        self.splits.append(now - self._last)


class Sleeps(Handler, BatchBegin, BatchEnd):
    def __init__(self, event):
        self.event = event

    def listens_to(self, event):
        return event == self.event

    def batch_begin(self, estimator, **kwargs):
        time.sleep(SLEEP)

    def batch_end(self, estimator, **kwargs):
        time.sleep(SLEEP)


class SlowData(Dataset):
    def __init__(self, n):
        self.batches = make_batches(n_batches=n, batch_size=1)

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        time.sleep(SLEEP)
        x, y = self.batches[i]
        return x[0], y[0]


class SlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x):
        time.sleep(SLEEP)
        return self.body(x)


def _estimator(net):
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def test_the_parts_add_up_to_the_epochs_time():
    est = _estimator(SlowNet())
    watch = Watch()
    est.fit(make_batches(n_batches=6), epochs=2, event_handlers=[watch])
    for split, wall in zip(watch.splits, watch.walls):
        assert split.steps == 6
        assert abs(split.wall - wall) <= 0.1 * wall  # the parts cover the epoch's batches, nothing else
        assert split.step >= 6 * SLEEP  # the slow forward is in the step


def test_a_slow_dataloader_shows_as_data_wait():
    est = make_estimator()
    watch = Watch()
    est.fit(DataLoader(SlowData(5), batch_size=1), epochs=1, event_handlers=[watch])
    (split,) = watch.splits
    assert split.steps == 5
    assert split.data >= 5 * SLEEP
    assert split.data > 0.5 * split.wall


@pytest.mark.parametrize("event", ["batch_begin", "batch_end"])
def test_a_slow_handler_shows_as_handlers(event):
    est = make_estimator()
    watch = Watch()
    est.fit(make_batches(n_batches=5), epochs=1, event_handlers=[watch, Sleeps(event)])
    (split,) = watch.splits
    assert split.handlers >= 5 * SLEEP
    assert split.handlers > 0.5 * split.wall


def test_the_optimizer_step_counts_in_the_step():
    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            time.sleep(SLEEP)
            return super().step(closure)

    est = _estimator(nn.Linear(4, 3))
    est.optimizer = SlowSGD(est.net.parameters(), lr=0.1)
    watch = Watch()
    est.fit(make_batches(n_batches=4), epochs=1, event_handlers=[watch])
    (split,) = watch.splits
    assert split.step >= 4 * SLEEP and split.handlers < 4 * SLEEP


def test_a_stop_in_the_middle_of_an_epoch_closes_its_last_step():
    est = make_estimator()
    watch = Watch()
    est.fit(make_batches(n_batches=8), batches=3, event_handlers=[watch, Sleeps("batch_end")])
    (split,) = watch.splits
    assert split.steps == 3
    assert split.handlers >= 3 * SLEEP  # the last step's sleep too, though no next batch was asked for


def test_validation_at_the_epochs_end_is_not_in_the_split():
    class SlowVal(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 3)

        def forward(self, x):
            if not self.training:
                time.sleep(SLEEP)
            return self.body(x)

    est = _estimator(SlowVal())
    times = []

    class Late(Handler, EpochEnd):
        times_steps = True

        def epoch_end(self, estimator, **kwargs):
            times.append(estimator.step_times.split())

    est.fit(make_batches(n_batches=3), val_data=make_batches(n_batches=4), epochs=1,
            event_handlers=[Late()], num_sanity_val_steps=0)
    assert times[0].steps == 3 and times[0].wall < 4 * SLEEP


class Boom(Handler, BatchEnd):
    def batch_end(self, estimator, **kwargs):
        if estimator.position.step == 2:
            raise RuntimeError("boom")


def test_a_failed_clocked_fit_leaves_no_loader_workers_behind():
    """The clocked batches are held by no name of the loop: the error unwinds them, and the
    DataLoader's workers stop before fit's end releases the data (a hang otherwise)."""
    est = make_estimator()
    loader = DataLoader(SlowData(8), batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError, match="boom") as raised:
        est.fit(loader, epochs=1, event_handlers=[Watch(), Boom()])
    assert raised.value is not None and multiprocessing.active_children() == []


def test_without_a_handler_that_asks_nothing_is_clocked(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the loop built a StepClock with no handler asking for the split")

    monkeypatch.setattr(_loop, "StepClock", refuse)
    est = make_estimator()
    est.fit(make_batches(n_batches=3), epochs=2)
    assert est.step_times is None


def test_step_times_are_per_fit_and_count_every_step():
    est = make_estimator()
    watch = Watch()
    est.fit(make_batches(n_batches=4), epochs=2, event_handlers=[watch])
    first = est.step_times
    assert first.split().steps == 8 and set(PARTS) <= set(first.split().per_step())
    est.fit(make_batches(n_batches=4), epochs=1, event_handlers=[watch])
    assert est.step_times is not first and est.step_times.split().steps == 4
