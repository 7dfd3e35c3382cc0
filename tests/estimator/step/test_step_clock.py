"""The step-time split the loop measures for a handler that declares ``times_steps``: its parts
add up to the steps' time, a slow part shows where it is, and a fit without such a handler is
not clocked at all. The clock is a fake one that only the tests' slow parts move: each figure is
then exact (a count of nanoseconds), never a wall-clock time a loaded machine could break."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from estimatorch import Estimator
from estimatorch.estimator import _loop
from estimatorch.estimator._step import clock as clock_module
from estimatorch.events import PARTS, BatchBegin, BatchEnd, EpochBegin, EpochEnd, Handler
from tests.conftest import make_batches, make_estimator

SLEEP_NS = 30_000_000  # what a slow part takes per step, on the fake clock
SLEEP = SLEEP_NS * 1e-9


class FakeClock:
    """The clock the step clock reads (``time.perf_counter_ns`` of its module): it stands still
    but where a slow part of a test moves it, so every figure is exact whatever the machine's load."""

    def __init__(self):
        self.ns = 0

    def perf_counter_ns(self):
        return self.ns

    def sleep(self, seconds):
        self.ns += round(seconds * 1e9)


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(clock_module, "time", fake)
    return fake


class Watch(Handler, EpochBegin, EpochEnd):
    """Reads the split at each epoch's end, and the time between epoch_begin and epoch_end (on
    ``clock``, a fake clock; None: no times)."""

    times_steps = True
    priority = -5000  # before validation: the epoch's time is its batches'

    def __init__(self, clock=None):
        self.clock = clock
        self.splits, self.walls, self._begun = [], [], 0
        self._last = None

    def epoch_begin(self, estimator, **kwargs):
        self._last = estimator.step_times.split()
        self._begun = self.clock.ns if self.clock is not None else 0

    def epoch_end(self, estimator, **kwargs):
        if self.clock is not None:
            self.walls.append((self.clock.ns - self._begun) * 1e-9)
        now = estimator.step_times.split()
        self.splits.append(now - self._last)


class Sleeps(Handler, BatchBegin, BatchEnd):
    def __init__(self, event, clock):
        self.event, self.clock = event, clock

    def listens_to(self, event):
        return event == self.event

    def batch_begin(self, estimator, **kwargs):
        self.clock.sleep(SLEEP)

    def batch_end(self, estimator, **kwargs):
        self.clock.sleep(SLEEP)


class SlowData(Dataset):
    """``n`` samples, each taking ``SLEEP`` to read: on ``sleep`` (the fake clock's, or
    ``time.sleep`` for a loader's worker processes)."""

    def __init__(self, n, sleep):
        self.batches = make_batches(n_batches=n, batch_size=1)
        self.sleep = sleep

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        self.sleep(SLEEP)
        x, y = self.batches[i]
        return x[0], y[0]


class SlowNet(nn.Module):
    def __init__(self, clock, when_training=True):
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.clock, self.when_training = clock, when_training

    def forward(self, x):
        if self.training == self.when_training:
            self.clock.sleep(SLEEP)
        return self.body(x)


def _estimator(net):
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def _seconds(n_sleeps):
    return pytest.approx(n_sleeps * SLEEP, rel=1e-12, abs=1e-15)


def test_the_parts_add_up_to_the_epochs_time(clock):
    est = _estimator(SlowNet(clock))
    watch = Watch(clock)
    est.fit(make_batches(n_batches=6), epochs=2, event_handlers=[watch])
    assert len(watch.splits) == 2
    for split, wall in zip(watch.splits, watch.walls):
        assert split.steps == 6
        assert split.wall == pytest.approx(wall, rel=1e-12)  # the parts cover the epoch's batches, nothing else
        assert split.step == _seconds(6)  # the slow forward is in the step
        assert (split.data, split.move, split.handlers) == (0, 0, 0)


def test_a_slow_dataloader_shows_as_data_wait(clock):
    est = make_estimator()
    watch = Watch(clock)
    est.fit(DataLoader(SlowData(5, clock.sleep), batch_size=1), epochs=1, event_handlers=[watch])
    (split,) = watch.splits
    assert split.steps == 5
    assert split.data == _seconds(5) and split.wall == split.data


@pytest.mark.parametrize("event", ["batch_begin", "batch_end"])
def test_a_slow_handler_shows_as_handlers(event, clock):
    est = make_estimator()
    watch = Watch(clock)
    est.fit(make_batches(n_batches=5), epochs=1, event_handlers=[watch, Sleeps(event, clock)])
    (split,) = watch.splits
    assert split.handlers == _seconds(5) and split.wall == split.handlers


def test_the_optimizer_step_counts_in_the_step(clock):
    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            clock.sleep(SLEEP)
            return super().step(closure)

    est = _estimator(nn.Linear(4, 3))
    est.optimizer = SlowSGD(est.net.parameters(), lr=0.1)
    watch = Watch(clock)
    est.fit(make_batches(n_batches=4), epochs=1, event_handlers=[watch])
    (split,) = watch.splits
    assert split.step == _seconds(4) and split.handlers == 0


def test_a_stop_in_the_middle_of_an_epoch_closes_its_last_step(clock):
    est = make_estimator()
    watch = Watch(clock)
    est.fit(make_batches(n_batches=8), batches=3, event_handlers=[watch, Sleeps("batch_end", clock)])
    (split,) = watch.splits
    assert split.steps == 3
    assert split.handlers == _seconds(3)  # the last step's sleep too, though no next batch was asked for


def test_validation_at_the_epochs_end_is_not_in_the_split(clock):
    est = _estimator(SlowNet(clock, when_training=False))
    times = []

    class Late(Handler, EpochEnd):
        times_steps = True

        def epoch_end(self, estimator, **kwargs):
            times.append(estimator.step_times.split())

    est.fit(make_batches(n_batches=3), val_data=make_batches(n_batches=4), epochs=1,
            event_handlers=[Late()], num_sanity_val_steps=0)
    assert clock.ns == 4 * SLEEP_NS  # the four validation batches, before Late's epoch_end
    assert times[0].steps == 3 and times[0].wall == 0


class Boom(Handler, BatchEnd):
    def batch_end(self, estimator, **kwargs):
        if estimator.position.step == 2:
            raise RuntimeError("boom")


def test_a_failed_clocked_fit_leaves_no_loader_workers_behind():
    """The clocked batches are held by no name of the loop: the error unwinds them, and the
    DataLoader's workers stop before fit's end releases the data (a hang otherwise)."""
    est = make_estimator()
    loader = DataLoader(SlowData(8, time.sleep), batch_size=2, num_workers=2)  # workers still reading at the error
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
