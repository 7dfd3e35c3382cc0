"""event_handlers/_subscribe.py: a handler subscribes to an event only when an option needs it,
also when a subclass's own ``__init__`` sets the option."""

from __future__ import annotations

import inspect

import pytest

from estimatorch.event_handlers import BatchEnd, CheckpointHandler, EpochEnd, StatefulHandler, TrainBegin
from estimatorch.event_handlers import ValidationHandler
from estimatorch.event_handlers._subscribe import periodic_events, subscribe, with_events
from tests.conftest import make_batches, make_estimator


class Periodic(StatefulHandler, TrainBegin):
    def __init__(self, every=None):
        self.every = every
        self.calls = 0
        subscribe(self, ["batch_end"] if every else [])

    def batch_end(self, estimator, **kwargs):
        self.calls += 1


def test_subscribe_adds_the_mixin_only_when_asked():
    assert isinstance(Periodic(every=2), BatchEnd)
    assert type(Periodic()) is Periodic and not isinstance(Periodic(), BatchEnd)
    assert type(Periodic(every=2)) is type(Periodic(every=3))  # one subclass per event set
    assert inspect.signature(type(Periodic(every=2))) == inspect.signature(Periodic)


def test_a_subscribed_handler_is_called_by_fit():
    on, off = Periodic(every=2), Periodic()
    make_estimator().fit(make_batches(4), epochs=1, event_handlers=[on, off])
    assert (on.calls, off.calls) == (4, 0)


def test_subscribe_sees_what_a_subclass_passed_on():
    class Every3(Periodic):
        def __init__(self):
            super().__init__(every=3)

    assert isinstance(Every3(), BatchEnd)


def test_unknown_events_are_refused():
    with pytest.raises(ValueError, match="unknown event 'batch_ends'"):
        with_events(Periodic, ["batch_ends"])


@pytest.mark.parametrize("cls", [CheckpointHandler, ValidationHandler])
def test_a_subclass_that_sets_its_periods_itself_is_subscribed_to_both(tmp_path, cls):
    class Mine(cls):
        def __init__(self, first):
            if cls is CheckpointHandler:
                super().__init__(first, batch_period=2, epoch_period=None)
            else:
                super().__init__(first, lambda *a, **k: None, batch_period=2, epoch_period=None)

    first = str(tmp_path) if cls is CheckpointHandler else make_batches(1)
    handler = Mine(first)
    assert isinstance(handler, BatchEnd) and isinstance(handler, EpochEnd)
    assert periodic_events(Mine, (first,), {}) == ["batch_end", "epoch_end"]


def test_a_checkpoint_subclass_with_its_own_init_saves_per_batch(tmp_path):
    class EveryTwo(CheckpointHandler):
        def __init__(self, model_dir):
            super().__init__(model_dir, batch_period=2, epoch_period=None, max_checkpoints=None)

    make_estimator().fit(make_batches(4), epochs=1, event_handlers=[EveryTwo(tmp_path)])
    assert sorted(p.name for p in tmp_path.glob("model-epoch*.pt")) == ["model-epoch0batch2.pt",
                                                                          "model-epoch0batch4.pt"]
