"""events/dispatch.py: a handler is called for an event when it inherits the event's mixin,
overrides its hook and its ``listens_to`` agrees, decided once per fit; the class, ``isinstance``
and the signature are the same whatever the options; handlers of earlier releases keep working."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest

from estimatorch.event_handlers import (
    BatchEnd,
    CheckpointHandler,
    EpochEnd,
    GradientUpdateHandler,
    LoggingHandler,
    StatefulHandler,
    TrainBegin,
    ValidationHandler,
)
from estimatorch.event_handlers._subscribe import subscribe
from estimatorch.events import Dispatch, Handler, subscribes
from tests.conftest import make_batches, make_estimator


class Periodic(StatefulHandler, TrainBegin, BatchEnd):
    def __init__(self, every=None):
        self.every = every
        self.calls = 0
        self.asked = 0

    def listens_to(self, event):
        self.asked += 1
        return event != "batch_end" or self.every is not None

    def batch_end(self, estimator, **kwargs):
        self.calls += 1


def test_listens_to_chooses_the_events_and_the_class_stays():
    assert subscribes(Periodic(every=2), "batch_end") and not subscribes(Periodic(), "batch_end")
    assert type(Periodic()) is Periodic and isinstance(Periodic(), BatchEnd)
    assert inspect.signature(Periodic) == inspect.signature(Periodic.__init__).replace(
        parameters=list(inspect.signature(Periodic.__init__).parameters.values())[1:])


def test_fit_calls_the_listening_handler_and_asks_once_per_fit():
    on, off = Periodic(every=2), Periodic()
    make_estimator().fit(make_batches(4), epochs=2, event_handlers=[on, off])
    assert (on.calls, off.calls) == (8, 0)
    assert on.asked == off.asked == 1  # batch_end, when the dispatch was built: never per step


def test_a_mixin_hook_left_as_the_no_op_default_is_not_called():
    """Inheriting a mixin without overriding its hook subscribes nothing: no call per step."""
    class OnlyEpochs(TrainBegin, BatchEnd, EpochEnd):
        def epoch_end(self, estimator, **kwargs):
            return False

    dispatch = Dispatch([OnlyEpochs()])
    assert len(dispatch.epoch_end) == 1
    assert dispatch.batch_end == () and dispatch.train_begin == ()


@pytest.mark.parametrize("make", [
    lambda tmp: Periodic(every=2),
    lambda tmp: CheckpointHandler(str(tmp), batch_period=3),
    lambda tmp: LoggingHandler(log_interval=5),
    lambda tmp: GradientUpdateHandler(accumulation_steps=2),
], ids=["own", "checkpoint", "logging", "gradient"])
def test_a_handler_pickles_and_copies_as_itself(make, tmp_path):
    handler = make(tmp_path)
    assert subscribes(handler, "batch_end")
    for clone in (pickle.loads(pickle.dumps(handler)), copy.deepcopy(handler)):
        assert type(clone) is type(handler)
        assert vars(clone).keys() == vars(handler).keys()
        assert subscribes(clone, "batch_end")


@pytest.mark.parametrize("cls", [CheckpointHandler, ValidationHandler])
def test_a_subclass_that_sets_its_periods_itself_is_subscribed_to_exactly_those(tmp_path, cls):
    class Mine(cls):
        def __init__(self, first):
            if cls is CheckpointHandler:
                super().__init__(first, batch_period=2, epoch_period=None)
            else:
                super().__init__(first, lambda *a, **k: None, batch_period=2, epoch_period=None)

    handler = Mine(str(tmp_path) if cls is CheckpointHandler else make_batches(1))
    assert subscribes(handler, "batch_end") and not subscribes(handler, "epoch_end")


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
    from estimatorch.event_handlers import (
        LambdaHandler,
        LRSchedulerHandler,
        MeterHandler,
        MetricHandler,
        TensorBoardHandler,
    )
    from estimatorch.metrics import Loss

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
    return [
        (lambda tmp: WarmLR(sched, warmup=3), "batch_end", None),  # per batch: epoch_end too (a leftover step)
        (lambda tmp: Tracked([Loss()], tag="x"), "batch_end", None),
        (lambda tmp: Chatty(every=2), "batch_end", None),
        (lambda tmp: Histograms(tmp), "backward_end", None),
        (lambda tmp: Every(lambda est, **kw: None, n=2), "batch_end", "epoch_end"),
        (lambda tmp: Norms(writer=lambda *a, **k: None), "backward_end", "batch_begin"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_a_subclass_with_arguments_of_its_own_is_subscribed_by_what_it_passed(case, tmp_path):
    build, subscribed, unsubscribed = _subclass_cases()[case]
    handler = build(str(tmp_path))
    assert subscribes(handler, subscribed)
    if unsubscribed is not None:
        assert not subscribes(handler, unsubscribed)


# -- handlers of earlier releases ------------------------------------------------------------------
def test_the_deprecated_subscribe_still_subscribes_with_a_warning():
    class Old(TrainBegin):
        def __init__(self):
            self.calls = 0
            subscribe(self, ["batch_end"])

        def batch_end(self, estimator, **kwargs):
            self.calls += 1

    with pytest.warns(DeprecationWarning, match="subscribe"):
        old = Old()
    make_estimator().fit(make_batches(3), epochs=1, event_handlers=[old])
    assert old.calls == 3


def test_unknown_events_are_refused():
    with pytest.raises(ValueError, match="unknown event 'batch_ends'"):
        subscribe(Periodic(), ["batch_ends"])


def test_private_declarations_of_earlier_releases_still_work_with_a_warning():
    with pytest.warns(DeprecationWarning, match="_state_attrs is deprecated"):
        class Counted(StatefulHandler, BatchEnd):
            _state_attrs = ("n",)

            def __init__(self):
                self.n = 0

            def batch_end(self, estimator, **kwargs):
                self.n += 1

    assert Counted.state_attributes == ("n",) and Counted().state_dict() == {"n": 0}
    checked = []

    class Plain(TrainBegin):  # mixins only, no Handler: the private hook is found and warned about
        def _check_fit(self, estimator, resume):
            checked.append(resume)

        def train_begin(self, estimator, **kwargs):
            pass

    with pytest.warns(DeprecationWarning, match="_check_fit is deprecated"):
        make_estimator().fit(make_batches(2), epochs=1, event_handlers=[Plain()])
    assert checked == [False]

    with pytest.warns(DeprecationWarning, match="_check_fit is deprecated"):
        class Checked(Handler, TrainBegin):
            def _check_fit(self, estimator, resume):
                checked.append("handler")

            def train_begin(self, estimator, **kwargs):
                pass

    make_estimator().fit(make_batches(2), epochs=1, event_handlers=[Checked()])
    assert checked[-1] == "handler"


# -- notices ---------------------------------------------------------------------------------------
def test_a_checkpoint_handler_announces_what_it_wrote_and_removed_before_after_train_end(tmp_path):
    from estimatorch.events import AfterTrainEnd, CheckpointSaved

    class Listener(CheckpointSaved, AfterTrainEnd):
        priority = -1000  # before the CheckpointHandler in every event: the notices still come

        def __init__(self):
            self.seen, self.held_at_end = [], None
            self.held = set()

        def checkpoint_saved(self, estimator, *, written, removed, **kwargs):
            self.seen.append(([p.rsplit("/", 1)[1] for p in written], [p.rsplit("/", 1)[1] for p in removed]))
            self.held = (self.held - set(removed)) | set(written)

        def after_train_end(self, estimator, **kwargs):
            self.held_at_end = sorted(self.held)

    listener = Listener()
    make_estimator().fit(make_batches(2), epochs=3, event_handlers=[
        listener, CheckpointHandler(tmp_path, max_checkpoints=1, batch_period=3)])
    assert listener.seen == [(["model-epoch1batch2.pt"], []),
                             (["model-epoch1batch3.pt"], ["model-epoch1batch2.pt"]),
                             (["model-epoch2batch4.pt"], ["model-epoch1batch3.pt"]),
                             (["model-epoch2batch6.pt"], ["model-epoch2batch4.pt"]),
                             (["model-epoch3batch6.pt"], ["model-epoch2batch6.pt"])]  # the epoch end's replaces it
    assert listener.held_at_end == [str(p) for p in sorted(tmp_path.glob("model-epoch*"))]
