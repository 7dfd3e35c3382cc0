"""event_handlers/_subscribe.py: a handler subscribes to an event only when an option needs it,
also when a subclass's own ``__init__`` sets the option."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

from estimatorch.event_handlers import BatchEnd, CheckpointHandler, EpochEnd, StatefulHandler, TrainBegin
from estimatorch.event_handlers import GradientUpdateHandler, LoggingHandler, ValidationHandler
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


@pytest.mark.parametrize("make", [
    lambda tmp: Periodic(every=2),
    lambda tmp: CheckpointHandler(str(tmp), batch_period=3),
    lambda tmp: LoggingHandler(log_interval=5),
    lambda tmp: GradientUpdateHandler(accumulation_steps=2),
], ids=["own", "checkpoint", "logging", "gradient"])
def test_a_subscribed_handler_pickles_and_copies_as_itself(make, tmp_path):
    handler = make(tmp_path)
    assert isinstance(handler, BatchEnd)
    for clone in (pickle.loads(pickle.dumps(handler)), copy.deepcopy(handler)):
        assert type(clone) is type(handler)
        assert vars(clone).keys() == vars(handler).keys()


def test_subscribing_a_subscribed_handler_again_keeps_one_subclass_of_the_original():
    handler = Periodic(every=2)
    subscribe(handler, ["epoch_end"])
    assert type(handler).__bases__[0] is Periodic and isinstance(handler, (BatchEnd, EpochEnd))
    assert type(pickle.loads(pickle.dumps(handler))) is type(handler)


def test_subscribe_sees_what_a_subclass_passed_on():
    class Every3(Periodic):
        def __init__(self):
            super().__init__(every=3)

    assert isinstance(Every3(), BatchEnd)


def test_unknown_events_are_refused():
    with pytest.raises(ValueError, match="unknown event 'batch_ends'"):
        with_events(Periodic, ["batch_ends"])


@pytest.mark.parametrize("cls", [CheckpointHandler, ValidationHandler])
def test_a_subclass_that_sets_its_periods_itself_is_subscribed(tmp_path, cls):
    class Mine(cls):
        def __init__(self, first):
            if cls is CheckpointHandler:
                super().__init__(first, batch_period=2, epoch_period=None)
            else:
                super().__init__(first, lambda *a, **k: None, batch_period=2, epoch_period=None)

    first = str(tmp_path) if cls is CheckpointHandler else make_batches(1)
    handler = Mine(first)
    assert isinstance(handler, BatchEnd)
    if cls is CheckpointHandler:  # decided in __new__: both, as the arguments cannot tell
        assert isinstance(handler, EpochEnd)
        assert periodic_events(Mine, (first,), {}) == ["batch_end", "epoch_end"]
    else:  # decided at the end of __init__: exactly the period it set
        assert not isinstance(handler, EpochEnd)


def test_a_checkpoint_subclass_with_its_own_init_saves_per_batch(tmp_path):
    class EveryTwo(CheckpointHandler):
        def __init__(self, model_dir):
            super().__init__(model_dir, batch_period=2, epoch_period=None, max_checkpoints=None)

    make_estimator().fit(make_batches(4), epochs=1, event_handlers=[EveryTwo(tmp_path)])
    assert sorted(p.name for p in tmp_path.glob("model-epoch*.pt")) == ["model-epoch0batch2.pt",
                                                                          "model-epoch0batch4.pt"]


# -- user subclasses of the built-ins that choose their events from their options ------------------
def _subclass_cases():
    import torch

    from estimatorch import statistics
    from estimatorch.event_handlers import (BackwardEnd, LambdaHandler, LoggingHandler, LRSchedulerHandler,
                                            MeterHandler, MetricHandler, TensorBoardHandler)

    class WarmLR(LRSchedulerHandler):  # an extra argument of its own, the base's option set by it
        def __init__(self, scheduler, warmup=5):
            super().__init__(scheduler, step_on="batch")
            self.warmup = warmup

    class Tracked(MetricHandler):
        def __init__(self, metrics, tag="mine"):
            super().__init__(metrics)
            self.tag = tag

    class Chatty(LoggingHandler):
        def __init__(self, every=2):
            super().__init__(log_interval=every)

    class Histograms(TensorBoardHandler):
        def __init__(self, log_dir):
            super().__init__(log_dir, histogram_period=3)

    class Every(LambdaHandler):
        def __init__(self, fn, n=2):
            super().__init__(batch_end=fn, every=n)

    class Norms(MeterHandler):
        def __init__(self, writer, period=2):
            super().__init__([statistics.GradientNorm(period=period)], writer=writer)

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    from estimatorch.metrics import Loss

    return [
        (lambda tmp: WarmLR(sched, warmup=3), BatchEnd, None),  # per batch: epoch_end too (a leftover step)
        (lambda tmp: Tracked([Loss()], tag="x"), BatchEnd, None),
        (lambda tmp: Chatty(every=2), BatchEnd, None),
        (lambda tmp: Histograms(tmp), BackwardEnd, None),
        (lambda tmp: Every(lambda est, **kw: None, n=2), BatchEnd, EpochEnd),
        (lambda tmp: Norms(writer=lambda *a, **k: None), BatchEnd, None),
    ]


@pytest.mark.parametrize("case", range(6))
def test_a_subclass_with_arguments_of_its_own_is_built_and_subscribed_by_what_it_passed(case, tmp_path):
    """Deciding events in ``__new__`` from the caller's arguments broke such subclasses: an extra
    argument was a TypeError, and options set by the subclass's own __init__ were not seen."""
    build, subscribed, unsubscribed = _subclass_cases()[case]
    handler = build(str(tmp_path))
    assert isinstance(handler, subscribed)
    if unsubscribed is not None:
        assert not isinstance(handler, unsubscribed)
