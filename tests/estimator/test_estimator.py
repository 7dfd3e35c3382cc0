"""Estimator: constructor and fit checks, the loop's events and order, stop semantics, defaults,
metrics by reference, evaluate, and in-process resume."""

from __future__ import annotations

import copy
import signal

import pytest
import torch
from torch import nn

from estimatorch import (
    BatchProcessor,
    Estimator,
    GradientUpdateHandler,
    LoggingHandler,
    LRSchedulerHandler,
    MetricHandler,
    ProgressBarHandler,
    StoppingHandler,
    ValidationHandler,
)
from estimatorch.estimator._setup import handlers as fit_setup
from estimatorch.event_handlers import EVENTS, BatchEnd, EpochBegin, EpochEnd, TrainBegin, TrainEnd
from estimatorch.metrics import Accuracy, Loss, MeanSquaredError
from tests.conftest import losses_recorder, make_batches, make_estimator


class Recorder(*EVENTS.values()):
    """Subscribes to every event and records the order they arrive in."""

    def __init__(self, log=None, name="rec", priority=0):
        self.log = log if log is not None else []
        self.tag = name
        self.priority = priority

    def _record(self, event):
        self.log.append((self.tag, event))

    def train_begin(self, est, **kw):
        self._record("train_begin")

    def epoch_begin(self, est, **kw):
        self._record("epoch_begin")

    def batch_begin(self, est, **kw):
        self._record("batch_begin")

    def forward_begin(self, est, **kw):
        self._record("forward_begin")

    def forward_end(self, est, **kw):
        self._record("forward_end")

    def backward_begin(self, est, **kw):
        self._record("backward_begin")

    def backward_end(self, est, **kw):
        self._record("backward_end")

    def batch_end(self, est, **kw):
        self._record("batch_end")

    def epoch_end(self, est, **kw):
        self._record("epoch_end")

    def train_end(self, est, **kw):
        self._record("train_end")


class StopAtBatch(BatchEnd):
    def __init__(self, at):
        self.at, self.seen = at, 0

    def batch_end(self, est, **kw):
        self.seen += 1
        return self.seen == self.at


class Count(BatchEnd, EpochEnd):
    def __init__(self):
        self.batches = self.epochs = 0

    def batch_end(self, est, **kw):
        self.batches += 1

    def epoch_end(self, est, **kw):
        self.epochs += 1


def events_of(log, tag="rec"):
    return [e for t, e in log if t == tag]


# -- constructor ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(net="not a module"), TypeError, ["net", "str"]),
    (dict(loss=3), TypeError, ["loss", "3"]),
    (dict(optimizer="sgd"), TypeError, ["optimizer", "str"]),
    (dict(device="nonsense"), ValueError, ["device", "nonsense"]),
    (dict(precision="8"), ValueError, ["precision", "'8'"]),
    (dict(seed=-1), ValueError, ["seed", "-1"]),
    (dict(seed=2**64), ValueError, ["seed", "2**64", str(2**64)]),
    (dict(seed=1.5), ValueError, ["seed", "1.5"]),
    (dict(device="meta"), ValueError, ["device='meta'", "real device"]),
    (dict(device="xpu"), ValueError, ["device='xpu'", "not available"]),
    (dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), ValueError,
     ["optimizer", "none of them net's", "another module"]),
    (dict(train_metrics=[object()]), TypeError, ["train_metrics"]),
    (dict(val_metrics=[3]), TypeError, ["val_metrics", "3"]),
    (dict(batch_processor=object()), TypeError, ["batch_processor"]),
    (dict(deterministic="yes"), TypeError, ["deterministic", "yes"]),
    (dict(deterministic=True, cudnn_benchmark=True), ValueError, ["deterministic", "cudnn_benchmark"]),
    (dict(train_metrics=[Accuracy(), Accuracy()]), ValueError, ["unique", "train_accuracy"]),
])
def test_constructor_rejects_bad_arguments(kwargs, exc, words):
    if kwargs.get("device") == "xpu" and torch.xpu.is_available():
        pytest.skip("this machine has an XPU")
    net = nn.Linear(2, 2)
    args = dict(net=net, loss=nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    args.update(kwargs)
    with pytest.raises(exc) as info:
        Estimator(**args)
    for word in words:
        assert word in str(info.value)


def test_constructor_rejects_a_scheduler_of_another_optimizer():
    net = nn.Linear(2, 2)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="lr_scheduler"):
        Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        Estimator(nn.Linear(2, 2), nn.MSELoss(), device="cuda")


def test_mps_device_where_unavailable_is_a_clear_error():
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    with pytest.raises(ValueError, match="device='mps' but 'mps' is not available"):
        Estimator(nn.Linear(2, 2), nn.MSELoss(), device="mps")


def test_the_largest_seed_every_generator_accepts_trains():
    est = make_estimator(seed=2**64 - 1)
    history = est.fit(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(16, 4), torch.randint(0, 3, (16,))), batch_size=4, shuffle=True), epochs=1, event_handlers=[])
    assert est.seed == 2**64 - 1 and len(history.epochs) == 1


def test_an_optimizer_may_hold_parameters_beside_the_nets():
    """A loss with weights trained along with the net is legitimate."""
    net, loss = nn.Linear(4, 3), nn.CrossEntropyLoss()
    temperature = nn.Parameter(torch.ones(()))
    est = Estimator(net, lambda pred, y: loss(pred / temperature, y),
                    optimizer=torch.optim.SGD([*net.parameters(), temperature], lr=0.1))
    est.fit(make_batches(n_batches=2), epochs=1, event_handlers=[])
    assert temperature.grad is None and float(temperature.detach()) != 1.0  # it trained, and was zeroed


def test_an_optimizer_swapped_for_a_foreign_one_is_refused_at_fit_start():
    est = make_estimator()
    est.optimizer = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1)
    rec = Recorder()
    with pytest.raises(ValueError, match="none of them net's"):
        est.fit(make_batches(), epochs=1, event_handlers=[rec])
    assert rec.log == []


@pytest.mark.parametrize("alias, canonical", [("bf16", "bf16-mixed"), ("fp16", "16-mixed"), ("16", "16-mixed"),
                                              (16, "16-mixed"), (32, "32"), ("bf16-mixed", "bf16-mixed")])
def test_precision_aliases_hold_the_canonical_name(alias, canonical):
    est = make_estimator(precision=alias)
    assert est.precision == canonical
    assert (est.grad_scaler is not None) == (canonical == "16-mixed")
    assert est.fit(make_batches(n_batches=1), epochs=1, event_handlers=[]).epochs == [1]


# -- metrics ------------------------------------------------------------------------------------
def test_default_metrics_for_cross_entropy_and_nll():
    for loss in (nn.CrossEntropyLoss(), nn.NLLLoss()):
        net = nn.Linear(2, 2)
        est = Estimator(net, loss, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        assert [m.name for m in est.train_metrics] == ["train_loss", "train_accuracy"]
        assert [type(m) for m in est.train_metrics] == [Loss, Accuracy]
        assert [m.name for m in est.val_metrics] == ["val_loss", "val_accuracy"]


def test_default_metrics_for_other_losses_is_only_a_loss():
    net = nn.Linear(2, 1)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert [m.name for m in est.train_metrics] == ["train_loss"]


def test_val_metrics_are_renamed_deep_copies():
    net = nn.Linear(2, 1)
    mse = MeanSquaredError()
    est = Estimator(net, nn.MSELoss(), train_metrics=[mse], optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert [m.name for m in est.train_metrics] == ["train_loss", "train_mse"]  # a Loss is always added
    assert [m.name for m in est.val_metrics] == ["val_loss", "val_mse"]
    assert est.train_metrics[1] is mse
    for train, val in zip(est.train_metrics, est.val_metrics):
        assert train is not val and type(train) is type(val)


def test_given_val_metrics_are_kept_and_get_a_loss():
    net = nn.Linear(2, 2)
    acc = Accuracy()
    est = Estimator(net, nn.CrossEntropyLoss(), val_metrics=[acc], optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert est.val_metrics[1] is acc and acc.name == "val_accuracy"
    assert isinstance(est.val_metrics[0], Loss)


class DuckMetric:
    """The torchmetrics duck type without being an estimatorch Metric."""

    higher_is_better = False

    def __init__(self):
        self.reset()

    def update(self, preds, target):
        self.total += float((preds.argmax(1) != target).sum())
        self.n += len(target)

    def compute(self):
        return self.total / max(self.n, 1)

    def reset(self):
        self.total, self.n = 0.0, 0


def test_duck_typed_metrics_are_accepted_and_updated():
    duck = DuckMetric()
    est = make_estimator(train_metrics=[duck])
    history = est.fit(make_batches(), epochs=1, event_handlers=[])
    assert duck.name == "train_duckmetric"
    assert history["train_duckmetric"][0] == pytest.approx(duck.compute())
    assert duck.n == 32


def test_metrics_are_shared_by_reference_with_handlers():
    """A handler monitoring est.train_metrics[0] sees what MetricHandler accumulated."""
    est = make_estimator()
    batches = make_batches()

    class Monitor(EpochEnd):
        def __init__(self, monitor):
            self.monitor, self.values = monitor, []

        def epoch_end(self, est, **kw):
            self.values.append(self.monitor.compute())

    class Losses(BatchEnd):
        def __init__(self):
            self.values = []

        def batch_end(self, est, *, loss, label, **kw):
            self.values.append((float(loss.detach()), len(label)))

    monitor, losses = Monitor(est.train_metrics[0]), Losses()
    est.fit(batches, epochs=1, event_handlers=[monitor, losses])
    expected = sum(v * n for v, n in losses.values) / sum(n for _, n in losses.values)
    assert monitor.values == [pytest.approx(expected, rel=1e-6)]


def test_a_handler_referring_to_a_foreign_metric_fails_at_fit_start():
    est = make_estimator()
    from estimatorch import EarlyStoppingHandler

    before = copy.deepcopy(est.net.state_dict())
    with pytest.raises(ValueError, match="does not own"):
        est.fit(make_batches(), epochs=1, event_handlers=[EarlyStoppingHandler(Loss())])
    assert all(torch.equal(before[k], v) for k, v in est.net.state_dict().items())


# -- fit arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(epochs=0), ValueError, ["epochs", "0"]),
    (dict(epochs=1, batches=2), ValueError, ["exactly one", "epochs=1", "batches=2"]),
    (dict(), ValueError, ["exactly one"]),
    (dict(batches=-3), ValueError, ["batches", "-3"]),
    (dict(epochs=1.5), ValueError, ["epochs", "1.5"]),
    (dict(epochs=1, batch_axis=-1), ValueError, ["batch_axis", "-1"]),
    (dict(epochs=1, resume="yes"), TypeError, ["resume", "yes"]),
    (dict(epochs=1, val_data=3), TypeError, ["val_data", "int"]),
    (dict(epochs=1, event_handlers=[object()]), TypeError, ["event_handlers", "inherits no event mixin"]),
    (dict(epochs=1, event_handlers=[StoppingHandler]), TypeError, ["class StoppingHandler", "instance"]),
    (dict(epochs=1, resume=True), ValueError, ["resume=True", "no earlier fit"]),
    (dict(epochs=1, event_handlers="twice"), ValueError, ["same Recorder instance twice", "positions 0 and 1"]),
])
def test_fit_rejects_bad_arguments_before_any_work(kwargs, exc, words):
    est = make_estimator()
    rec = Recorder()
    handlers = kwargs.pop("event_handlers", None)
    if handlers == "twice":
        handlers = [rec, rec]
    with pytest.raises(exc) as info:
        est.fit(make_batches(), event_handlers=handlers if handlers is not None else [rec], **kwargs)
    for word in words:
        assert word in str(info.value)
    assert rec.log == []


@pytest.mark.parametrize("data, words", [
    ([], ["empty", "length 0"]),
    (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 2), torch.zeros(0))), ["empty"]),
    (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(3, 2), torch.zeros(3)),
                                 batch_size=4, drop_last=True), ["no batches", "drop_last"]),
    (torch.zeros(4, 2), ["iterable of batches", "Tensor"]),
])
def test_fit_rejects_unusable_train_data(data, words):
    est = make_estimator()
    rec = Recorder()
    with pytest.raises((ValueError, TypeError)) as info:
        est.fit(data, epochs=1, event_handlers=[rec])
    for word in words:
        assert word in str(info.value)
    assert rec.log == []


def test_an_iterator_used_for_two_epochs_is_a_clear_error_before_any_work():
    est = make_estimator()
    rec = Recorder()
    with pytest.raises(TypeError, match="iterator.*epochs=2"):
        est.fit(iter(make_batches()), epochs=2, event_handlers=[rec])
    assert rec.log == []
    with pytest.raises(ValueError, match="no batches in epoch 2"):  # found only when it runs dry
        est.fit(iter(make_batches(n_batches=4)), batches=6, event_handlers=[])


@pytest.mark.parametrize("val_data, exc, words", [
    ([], ValueError, ["val_data", "empty"]),
    (iter(make_batches(n_batches=2)), TypeError, ["val_data", "iterator", "only once"]),
])
def test_unusable_val_data_is_refused_before_any_work(val_data, exc, words):
    rec = Recorder()
    with pytest.raises(exc) as info:
        make_estimator().fit(make_batches(), val_data=val_data, epochs=1, event_handlers=[rec])
    assert all(word in str(info.value) for word in words) and rec.log == []


# -- the loop -------------------------------------------------------------------------------------
def test_every_event_fires_in_order():
    est = make_estimator()
    rec = Recorder()
    est.fit(make_batches(n_batches=2), epochs=2, event_handlers=[rec])
    step = ["batch_begin", "forward_begin", "forward_end", "backward_begin", "backward_end", "batch_end"]
    epoch = ["epoch_begin", *step, *step, "epoch_end"]
    assert events_of(rec.log) == ["train_begin", *epoch, *epoch, "train_end"]


def test_mixin_methods_equal_the_events_fit_fires():
    est = make_estimator()
    rec = Recorder()
    est.fit(make_batches(n_batches=2), epochs=1, event_handlers=[rec])
    fired = set(events_of(rec.log))
    mixin_methods = {name for mixin in EVENTS.values() for name in vars(mixin) if not name.startswith("_")}
    assert mixin_methods == fired == set(EVENTS)


def test_only_subscribers_are_called():
    class OnlyEpochEnd(EpochEnd):
        def __init__(self):
            self.calls = 0

        def epoch_end(self, est, **kw):
            self.calls += 1

        def batch_end(self, est, **kw):  # defined but not subscribed: must never be called
            raise AssertionError("batch_end called on a handler that does not inherit BatchEnd")

    handler = OnlyEpochEnd()
    make_estimator().fit(make_batches(), epochs=2, event_handlers=[handler])
    assert handler.calls == 2


def test_stop_at_batch_3_still_fires_one_epoch_end_and_every_batch_end():
    est = make_estimator()
    log = []
    stop, late = StopAtBatch(3), Recorder(log, "late", priority=5)
    count = Count()
    est.fit(make_batches(n_batches=6), epochs=4, event_handlers=[stop, count, late])
    assert count.batches == 3 and count.epochs == 1
    assert events_of(log, "late").count("batch_end") == 3  # the stopping batch reached later handlers
    assert events_of(log, "late")[-2:] == ["epoch_end", "train_end"]


def test_batches_counts_over_the_run_and_reiterates_the_data():
    est = make_estimator()
    count = Count()
    history = est.fit(make_batches(n_batches=4), batches=10, event_handlers=[count])
    assert count.batches == 10 and count.epochs == 3
    assert len(history.epochs) == 3 and est.position.step == 10


def test_epoch_end_stop_finishes_the_epoch_end_of_every_handler():
    class StopNow(EpochEnd):
        def epoch_end(self, est, **kw):
            return True

    est = make_estimator()
    log = []
    est.fit(make_batches(), epochs=5, event_handlers=[StopNow(), Recorder(log, "after", priority=1)])
    assert events_of(log, "after").count("epoch_end") == 1
    assert events_of(log, "after")[-1] == "train_end"


def test_train_end_fires_on_exception_which_propagates_unchanged():
    error = RuntimeError("boom")

    class Explode(BatchEnd):
        def batch_end(self, est, **kw):
            raise error

    log = []
    with pytest.raises(RuntimeError) as info:
        make_estimator().fit(make_batches(), epochs=1, event_handlers=[Explode(), Recorder(log)])
    assert info.value is error
    assert events_of(log)[-1] == "train_end"


def test_a_failing_train_end_does_not_mask_the_original_error():
    error = RuntimeError("original")

    class Explode(BatchEnd):
        def batch_end(self, est, **kw):
            raise error

    class BadEnd(TrainEnd):
        def train_end(self, est, **kw):
            raise ValueError("train_end failed")

    log = []
    with pytest.raises(RuntimeError) as info:
        make_estimator().fit(make_batches(), epochs=1, event_handlers=[Explode(), BadEnd(), Recorder(log, priority=1)])
    assert info.value is error
    assert events_of(log)[-1] == "train_end"  # handlers after the failing one still ended


class Raise(TrainBegin, BatchEnd, EpochEnd, TrainEnd):
    """Raises at one point of the loop: ``train_begin``, the ``step``-th ``batch_end``,
    ``epoch_end`` or ``train_end``."""

    def __init__(self, where, step=3):
        self.where, self.step, self.seen = where, step, 0

    def train_begin(self, est, **kw):
        if self.where == "train_begin":
            raise RuntimeError("failed in train_begin")

    def batch_end(self, est, **kw):
        self.seen += 1
        if self.where == "batch_end" and self.seen == self.step:
            raise RuntimeError("failed in batch_end")

    def epoch_end(self, est, **kw):
        if self.where == "epoch_end":
            raise RuntimeError("failed in epoch_end")

    def train_end(self, est, **kw):
        if self.where == "train_end":
            raise RuntimeError("failed in train_end")


def _fail(est, loader, where, tmp_path, monkeypatch):
    """Make est.fit(..., epochs=4, resume=True) fail at ``where``."""
    from estimatorch import CheckpointHandler, EarlyStoppingHandler, rng

    fit = dict(epochs=4, resume=True)
    if where == "arguments":
        est.fit(loader, epochs=4, batches=2)
    elif where == "seed set too large":
        est.seed = 2**64
        try:
            est.fit(loader, **fit)
        finally:
            est.seed = 3
    elif where == "seeding":  # the first thing inside the fit: it used to leave it 'fitting'
        def refuse(seed=None):
            raise ValueError("Overflow when unpacking long long")

        with monkeypatch.context() as m:
            m.setattr(rng, "seed_everything", refuse)
            est.fit(loader, **fit)
    elif where == "train_data":
        est.fit([], **fit)
    elif where == "other data":
        est.fit(make_batches(), **fit)
    elif where == "existing checkpoints":
        (tmp_path / "model-epoch1batch7.pt").write_bytes(b"")
        est.fit(loader, epochs=4, event_handlers=[CheckpointHandler(tmp_path)])
    elif where == "foreign metric":
        est.fit(loader, event_handlers=[EarlyStoppingHandler(Loss())], **fit)
    elif where == "bad batches":
        est.fit([(x, x, y) for x, y in make_batches()], epochs=1)
    else:
        est.fit(loader, event_handlers=[Raise(where)], **fit)


BEFORE_TRAINING = ["arguments", "seed set too large", "seeding", "train_data", "other data", "existing checkpoints", "foreign metric", "train_begin"]


@pytest.mark.parametrize("where", [*BEFORE_TRAINING, "bad batches", "batch_end", "epoch_end", "train_end"])
def test_a_failed_fit_leaves_the_estimator_reusable(where, tmp_path, monkeypatch):
    """Whatever point a fit fails at, the estimator is not left inside it (no handlers, signal
    handlers and torch flags restored) and no half-applied state remains: a failure before
    training keeps what resume=True continues from, and the next fit trains normally."""
    est, loader = dropout_setup()
    est.deterministic = True  # a flag fit sets and must restore
    est.fit(loader, epochs=2, event_handlers=[])
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises((ValueError, TypeError, RuntimeError, FileExistsError)):
        _fail(est, loader, where, tmp_path, monkeypatch)
    assert not est._fitting and est.handlers == () and not est.resume_pending
    assert {s: signal.getsignal(s) for s in signals} == signals
    assert not torch.are_deterministic_algorithms_enabled()
    assert est.max_epoch == 2 or where not in BEFORE_TRAINING  # the failed fit's plan was not applied
    if where in BEFORE_TRAINING:  # resume=True continues the last good fit exactly
        losses, rec = losses_recorder()
        est.fit(loader, epochs=4, event_handlers=[rec], resume=True)
        reference, loader = dropout_setup()
        full, rec = losses_recorder()
        reference.fit(loader, epochs=4, event_handlers=[rec])
        assert losses == full[-len(losses):] and len(losses) == 2 * 7
        assert all(torch.equal(v, reference.net.state_dict()[k]) for k, v in est.net.state_dict().items())
    else:
        count = Count()
        est.fit(loader, epochs=1, event_handlers=[count])
        assert (count.batches, count.epochs, est.position.step) == (7, 1, 7)


def test_a_failing_train_end_raises_when_nothing_else_failed():
    class BadEnd(TrainEnd):
        def train_end(self, est, **kw):
            raise ValueError("train_end failed")

    with pytest.raises(ValueError, match="train_end failed"):
        make_estimator().fit(make_batches(), epochs=1, event_handlers=[BadEnd()])


# -- handlers: defaults, order ----------------------------------------------------------------------
def default_types(est, **fit_kwargs):
    captured = {}

    class Capture(TrainBegin):
        def train_begin(self, est, **kw):
            captured["handlers"] = list(est.dispatch.handlers)

    est.fit(make_batches(), event_handlers=[Capture()], **fit_kwargs)
    return [type(h).__name__ for h in captured["handlers"] if not isinstance(h, Capture)]


def test_default_set_and_its_order(monkeypatch):
    monkeypatch.setattr(fit_setup, "interactive", lambda: True)
    net = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    types = default_types(est, epochs=1, val_data=make_batches(n_batches=1))
    assert types == [c.__name__ for c in (GradientUpdateHandler, MetricHandler, ValidationHandler, StoppingHandler,
                                          LRSchedulerHandler, LoggingHandler, ProgressBarHandler)]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # `other` never steps
def test_the_estimators_scheduler_is_stepped_even_beside_another_scheduler_handler(monkeypatch):
    monkeypatch.setattr(fit_setup, "interactive", lambda: False)
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    own = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0), 1)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, lr_scheduler=own)
    est.fit(make_batches(), epochs=2, event_handlers=[LRSchedulerHandler(other)])
    assert opt.param_groups[0]["lr"] == 0.25 and other.last_epoch == 2
    est.fit(make_batches(), epochs=1, event_handlers=[LRSchedulerHandler(own, step_on="batch")])
    assert opt.param_groups[0]["lr"] == 0.25 * 0.5 ** 4  # stepped by the user's handler only


def test_no_progress_bar_outside_a_terminal_or_notebook(monkeypatch):
    monkeypatch.setattr(fit_setup, "interactive", lambda: False)
    types = default_types(make_estimator(), epochs=1)
    assert types == [c.__name__ for c in (GradientUpdateHandler, MetricHandler, StoppingHandler, LoggingHandler)]


def test_a_default_is_not_added_when_the_user_gave_one_of_its_type(monkeypatch):
    monkeypatch.setattr(fit_setup, "interactive", lambda: False)

    class MyStopping(StoppingHandler):
        pass

    mine = MyStopping(max_epoch=1)
    est = make_estimator()
    captured = {}

    class Capture(TrainBegin):
        def train_begin(self, est, **kw):
            captured["handlers"] = list(est.dispatch.handlers)

    est.fit(make_batches(), epochs=3, event_handlers=[mine, Capture()])
    stoppers = [h for h in captured["handlers"] if isinstance(h, StoppingHandler)]
    assert stoppers == [mine]
    assert len(est.fit(make_batches(), epochs=3, event_handlers=[mine]).epochs) == 1


def test_priority_sort_is_stable_with_user_handlers_before_defaults():
    log = []
    handlers = [Recorder(log, "u0", priority=0), Recorder(log, "u-5", priority=-5),
                Recorder(log, "u0b", priority=0), Recorder(log, "u-5b", priority=-5),
                Recorder(log, "u-3000", priority=-3000), Recorder(log, "uinf", priority=float("inf"))]
    est = make_estimator()
    est.fit(make_batches(n_batches=1), epochs=1, event_handlers=handlers)
    first_train_begin = [t for t, e in log if e == "train_begin"]
    assert first_train_begin == ["u-3000", "u-5", "u-5b", "u0", "u0b", "uinf"]
    order = [type(h).__name__ if not isinstance(h, Recorder) else h.tag for h in est.dispatch.handlers] \
        if est.dispatch.handlers else None
    assert order is None  # the dispatch is cleared after fit
    names = list(est._run.dispatch.by_name)
    # ties: users first (u0, u0b), then StoppingHandler (a default at priority 0); LoggingHandler
    # (+inf, default) comes after the user's +inf handler.
    ranked = [h.tag if isinstance(h, Recorder) else type(h).__name__ for h in est._run.dispatch.handlers]
    assert ranked == ["u-3000", "GradientUpdateHandler", "MetricHandler", "u-5", "u-5b", "u0", "u0b",
                      "StoppingHandler", "uinf", "LoggingHandler"]
    assert len(names) == len(set(names))


def test_handler_names_are_unique_and_deterministic():
    est = make_estimator()
    est.fit(make_batches(n_batches=1), epochs=1, event_handlers=[Count(), Count(), Count()])
    assert [n for n in est._run.dispatch.by_name if n.startswith("Count")] == ["Count", "Count_2", "Count_3"]


def test_a_handler_instance_reused_across_fits_behaves_the_same():
    stop = StoppingHandler(max_batch=5)
    count = Count()
    est = make_estimator()
    est.fit(make_batches(n_batches=3), epochs=10, event_handlers=[stop, count])
    first = (count.batches, count.epochs, stop.state_dict())
    count.batches = count.epochs = 0
    est.fit(make_batches(n_batches=3), epochs=10, event_handlers=[stop, count])
    assert (count.batches, count.epochs, stop.state_dict()) == first == (5, 2, {"current_epoch": 2, "current_batch": 5})


# -- batches and the step -----------------------------------------------------------------------------
def test_a_custom_batch_processor_replaces_the_step():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 3), nn.Linear(2, 3)

        def forward(self, a, b):
            return self.a(a) + self.b(b)

    class Processor(BatchProcessor):
        calls = 0

        def fit_batch(self, estimator, batch, batch_axis=0):
            Processor.calls += 1
            a, b, label = batch
            estimator.fire("forward_begin", batch=batch)
            pred = estimator.train_net(a, b)
            loss = estimator.loss(pred, label)
            estimator.fire("forward_end", batch=batch, pred=pred, loss=loss)
            estimator.backward(loss * 2)
            return (a, b), label, pred, loss

    net = TwoInputs()
    rec = Recorder()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    batch_processor=Processor())
    data = [(torch.randn(4, 2), torch.randn(4, 2), torch.randint(0, 3, (4,))) for _ in range(3)]
    before = net.a.weight.detach().clone()
    est.fit(data, epochs=1, event_handlers=[rec])
    assert Processor.calls == 3
    assert events_of(rec.log).count("forward_end") == 3 and "backward_begin" not in events_of(rec.log)
    assert not torch.equal(before, net.a.weight)


def test_batch_conventions_tuple_of_three_and_dict():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, a, b):
            return self.lin(torch.cat([a, b], dim=1))

    net = TwoInputs()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    triples = [(torch.randn(4, 2), torch.randn(4, 2), torch.randint(0, 3, (4,))) for _ in range(2)]
    est.fit(triples, epochs=1, event_handlers=[])
    dicts = [{"a": a, "b": b, "label": y} for a, b, y in triples]
    history = est.fit(dicts, epochs=1, event_handlers=[])
    assert history["train_loss"][0] > 0
    with pytest.raises(ValueError, match="'label'"):
        est.fit([{"a": a, "b": b} for a, b, _ in triples], epochs=1, event_handlers=[])


def test_a_batch_with_more_parts_than_forward_takes_says_what_and_how_to_fix_it():
    """torch alone says "forward() takes 2 positional arguments but 3 were given"."""
    est = make_estimator()
    rec = Recorder()
    triples = [(x, x.clone(), y) for x, y in make_batches(n_batches=2)]
    with pytest.raises(TypeError) as info:
        est.fit(triples, epochs=1, event_handlers=[rec])
    message = str(info.value)
    for words in ("Sequential.forward(input)", "2 positional input(s)", "too many positional arguments",
                  "(x1, ..., xn, label)", "BatchProcessor"):
        assert words in message, message
    assert "takes 2 positional arguments but 3 were given" in str(info.value.__cause__)
    assert events_of(rec.log).count("batch_end") == 0 and events_of(rec.log)[-1] == "train_end"


def test_a_type_error_raised_inside_forward_is_left_as_it_is():
    class Strict(nn.Module):
        def forward(self, x):
            raise TypeError("my own check")

    net = Strict()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="^my own check$"):
        est.fit(make_batches(n_batches=1), epochs=1, event_handlers=[])


def test_the_model_trains_in_train_mode_and_evaluate_restores_the_mode():
    modes = []

    class Mode(BatchEnd, EpochEnd):
        def batch_end(self, est, **kw):
            modes.append(("train", est.net.training))

        def epoch_end(self, est, **kw):
            modes.append(("after_validation", est.net.training))

    est = make_estimator()
    est.net.eval()
    est.fit(make_batches(n_batches=2), val_data=make_batches(n_batches=1), epochs=1, event_handlers=[Mode()])
    assert modes == [("train", True), ("train", True), ("after_validation", True)]
    est.net.eval()
    est.evaluate(make_batches(n_batches=1))
    assert est.net.training is False


def test_evaluate_runs_without_gradients_fires_events_and_returns_val_metrics():
    grad_enabled, net_modes = [], []

    class Probe(EpochBegin, BatchEnd, EpochEnd):
        def __init__(self):
            self.events = []

        def epoch_begin(self, est, **kw):
            self.events.append("epoch_begin")

        def batch_end(self, est, *, loss, **kw):
            grad_enabled.append(torch.is_grad_enabled())
            net_modes.append(est.val_net.training)
            self.events.append("batch_end")

        def epoch_end(self, est, **kw):
            self.events.append("epoch_end")

    est = make_estimator()
    probe = Probe()
    data = make_batches(n_batches=2)
    scores = est.evaluate(data, event_handlers=[probe])
    assert probe.events == ["epoch_begin", "batch_end", "batch_end", "epoch_end"]
    assert grad_enabled == [False, False] and net_modes == [False, False]
    assert set(scores) == {"val_loss", "val_accuracy"}
    with torch.no_grad():
        x = torch.cat([b[0] for b in data])
        y = torch.cat([b[1] for b in data])
        expected_loss = float(nn.CrossEntropyLoss()(est.net(x), y))
        expected_acc = float((est.net(x).argmax(1) == y).double().mean())
    assert scores["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert scores["val_accuracy"] == pytest.approx(expected_acc)


def test_history_has_a_value_per_epoch_and_nan_where_validation_did_not_run():
    est = make_estimator()
    validation = ValidationHandler(make_batches(n_batches=1), est.evaluate, epoch_period=2)
    history = est.fit(make_batches(), epochs=4, event_handlers=[validation])
    assert history.epochs == [1, 2, 3, 4]
    val = history["val_loss"]
    assert [v != v for v in val] == [True, False, True, False]
    assert len(history["train_loss"]) == 4 and history["train_loss"][-1] < history["train_loss"][0]


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    def run(seed):
        torch.manual_seed(123)
        net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
        est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=seed)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 4), torch.randint(0, 3, (40,))),
                                           batch_size=8, shuffle=True)
        est.fit(data, epochs=2, event_handlers=[])
        return est.net.state_dict()

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_deterministic_is_applied_during_fit_only():
    assert not torch.are_deterministic_algorithms_enabled()
    seen = []

    class Probe(BatchEnd):
        def batch_end(self, est, **kw):
            seen.append(torch.are_deterministic_algorithms_enabled())

    make_estimator(deterministic=True).fit(make_batches(n_batches=1), epochs=1, event_handlers=[Probe()])
    assert seen == [True] and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_on_cpu(precision):
    est = make_estimator(precision=precision)
    assert (est.grad_scaler is not None) == (precision == "16-mixed")
    history = est.fit(make_batches(), epochs=2, event_handlers=[])
    assert all(v == v for v in history["train_loss"])


# -- data loading ------------------------------------------------------------------------------------
class NoisyDataset(torch.utils.data.Dataset):
    """Draws random numbers in __getitem__ but returns values that do not depend on them."""

    def __init__(self, draw):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)
        self.draw = draw
        self.estimatorch_sample_seeding = True

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.draw:
            torch.rand(3)
            import random
            random.random()
        return self.x[i], self.y[i]


def test_data_loading_in_the_main_process_does_not_shift_the_dropout_stream():
    """Training on the loader (whose dataset draws random numbers) gives the same losses as
    training on a plain list of the very batches it produced: loading consumed no RNG."""

    def run(data):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 3))
        est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        losses, batches = [], []

        class Rec(BatchEnd):
            def batch_end(self, est, *, loss, batch, **kw):
                losses.append(float(loss.detach()).hex())
                batches.append(batch)

        est.fit(data, epochs=1, event_handlers=[Rec()])
        return losses, batches

    loader = torch.utils.data.DataLoader(NoisyDataset(draw=True), batch_size=6, shuffle=True)
    from_loader, batches = run(loader)
    from_list, _ = run(batches)
    assert from_loader == from_list


def test_a_data_loader_is_rebuilt_with_its_settings_kept():
    def collate(samples):
        xs, ys = zip(*samples)
        return torch.stack(xs) * 0 + 1, torch.stack(ys)

    dataset = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randint(0, 3, (10,)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=True, shuffle=True, collate_fn=collate)
    seen = []

    class Probe(BatchEnd):
        def batch_end(self, est, *, batch, **kw):
            seen.append((batch[0].shape[0], float(batch[0].min()), float(batch[0].max())))

    make_estimator().fit(loader, epochs=1, event_handlers=[Probe()])
    assert seen == [(4, 1.0, 1.0), (4, 1.0, 1.0)]  # drop_last kept, custom collate kept


def test_a_custom_sampler_warns_that_resume_replays_its_indices():
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 8, 8))
    with pytest.warns(UserWarning, match="replays its indices"):
        make_estimator().fit(loader, epochs=1, event_handlers=[])


# -- in-process resume -----------------------------------------------------------------------------------
def dropout_setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt,
                    lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), seed=3)
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(50, 4, generator=g), torch.randint(0, 3, (50,), generator=g))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)
    return est, loader


def test_ctrl_c_stops_at_a_step_boundary_and_resume_continues_bit_identically():
    est, loader = dropout_setup()
    full, rec = losses_recorder()
    est.fit(loader, epochs=3, val_data=make_batches(n_batches=1), event_handlers=[rec])
    reference = {k: v.clone() for k, v in est.net.state_dict().items()}

    class CtrlC(BatchEnd):
        def __init__(self, at):
            self.at, self.n = at, 0

        def batch_end(self, est, **kw):
            self.n += 1
            if self.n == self.at:
                signal.raise_signal(signal.SIGINT)  # as a user pressing Ctrl-C mid-step

    est, loader = dropout_setup()
    part, rec = losses_recorder()
    with pytest.raises(KeyboardInterrupt):
        est.fit(loader, epochs=3, val_data=make_batches(n_batches=1), event_handlers=[rec, CtrlC(10)])
    assert est.position.step == 10 and len(part) == 10
    rest, rec2 = losses_recorder()
    history = est.fit(loader, epochs=3, val_data=make_batches(n_batches=1), event_handlers=[rec2], resume=True)
    assert part + rest == full
    assert all(torch.equal(reference[k], v) for k, v in est.net.state_dict().items())
    assert len(history.epochs) == 3


def test_a_second_ctrl_c_raises_at_once():
    class DoubleCtrlC(BatchEnd):
        def batch_end(self, est, **kw):
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            raise AssertionError("the second Ctrl-C should have raised")

    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(), epochs=2, event_handlers=[DoubleCtrlC()])
    assert est.position.step == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_resume_with_a_larger_plan_extends_training_bit_identically():
    est, loader = dropout_setup()
    full, rec = losses_recorder()
    est.fit(loader, epochs=3, event_handlers=[rec])
    reference = {k: v.clone() for k, v in est.net.state_dict().items()}

    est, loader = dropout_setup()
    part, rec = losses_recorder()
    est.fit(loader, epochs=2, event_handlers=[rec])
    rest, rec2 = losses_recorder()
    history = est.fit(loader, epochs=3, event_handlers=[rec2], resume=True)
    assert part + rest == full
    assert all(torch.equal(reference[k], v) for k, v in est.net.state_dict().items())
    assert history.epochs == [1, 2, 3]


def test_resume_of_a_finished_plan_trains_nothing(caplog):
    est, loader = dropout_setup()
    est.fit(loader, epochs=1, event_handlers=[])
    before = {k: v.clone() for k, v in est.net.state_dict().items()}
    losses, rec = losses_recorder()
    est.logger.addHandler(caplog.handler)
    try:
        est.fit(loader, epochs=1, event_handlers=[rec], resume=True)
    finally:
        est.logger.removeHandler(caplog.handler)
    assert losses == []
    assert "Nothing to resume" in caplog.text
    assert all(torch.equal(before[k], v) for k, v in est.net.state_dict().items())


def test_resume_after_an_exception_mid_step_warns():
    class Fail(BatchEnd):
        def __init__(self):
            self.n = 0

        def batch_end(self, est, **kw):
            self.n += 1
            if self.n == 3:
                raise RuntimeError("handler bug")

    est = make_estimator()
    with pytest.raises(RuntimeError):
        est.fit(make_batches(), epochs=2, event_handlers=[Fail()], )
    with pytest.warns(UserWarning, match="interrupted in the middle"):
        est.fit(make_batches(), epochs=2, resume=True, event_handlers=[])
    assert est.position.step == 8


def test_resume_refuses_different_data():
    est = make_estimator()
    est.fit(make_batches(n_batches=4), epochs=1, event_handlers=[])
    with pytest.raises(ValueError, match="dataset_len"):
        est.fit(make_batches(n_batches=5), epochs=2, event_handlers=[], resume=True)


def test_a_failing_state_dict_after_an_error_does_not_hide_it_nor_skip_train_end():
    error = RuntimeError("the real problem")

    class Broken(BatchEnd):
        def batch_end(self, est, **kw):
            raise error

        def state_dict(self):
            raise ValueError("state_dict is broken too")

    log = []
    est = make_estimator()
    with pytest.raises(RuntimeError) as info:
        est.fit(make_batches(), epochs=1, event_handlers=[Broken(), Recorder(log)])
    assert info.value is error
    assert events_of(log)[-1] == "train_end"
    with pytest.raises(ValueError, match="no earlier fit"):
        est.fit(make_batches(), epochs=1, event_handlers=[], resume=True)


def test_validating_with_a_data_loader_does_not_shift_the_training_stream():
    """A DataLoader draws its base seed from the global generator on every iteration: evaluate
    must not let that move the dropout stream (the torchdata trap)."""
    def losses(val_data):
        est, loader = dropout_setup()
        seen, rec = losses_recorder()
        est.fit(loader, val_data=val_data, epochs=2, event_handlers=[rec])
        return seen

    val = make_batches(n_batches=2)
    assert losses(torch.utils.data.DataLoader(val, batch_size=None)) == losses(val) == losses(None)


def test_persistent_workers_are_released_when_fit_returns():
    import multiprocessing

    dataset = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
    est = make_estimator()
    est.fit(loader, epochs=2, event_handlers=[])
    assert multiprocessing.active_children() == []
    assert est.batches_per_epoch == 4  # what the run knew is still there


def test_an_estimator_made_during_a_fit_with_bars_does_not_duplicate_log_lines():
    import io
    import logging

    class MakeAnother(EpochEnd):
        def epoch_end(self, est, **kw):
            make_estimator()

    est = make_estimator()
    est.fit(make_batches(), epochs=1, event_handlers=[ProgressBarHandler(file=io.StringIO()), MakeAnother()])
    console = [h for h in logging.getLogger("estimatorch").handlers if getattr(h, "_estimatorch_default", False)]
    assert len(console) == 1


def test_a_metric_without_state_warns_when_a_mid_epoch_snapshot_cannot_hold_it(tmp_path):
    from estimatorch import CheckpointHandler

    duck = DuckMetric()
    est = make_estimator(train_metrics=[duck])
    with pytest.warns(UserWarning) as caught:
        est.fit(make_batches(), epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=2, epoch_period=None)])
    named = {name for name in ("train_duckmetric", "val_duckmetric")
             for w in caught if f"metric '{name}' keeps no state" in str(w.message)}
    assert named == {"train_duckmetric", "val_duckmetric"}


def test_bf16_mixed_runs_the_forward_under_autocast():
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            out = self.lin(x)
            seen.append(out.dtype)
            return out

    net = Probe()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    precision="bf16-mixed")
    est.fit(make_batches(n_batches=1), epochs=1, event_handlers=[])
    assert seen == [torch.bfloat16]
    assert net.lin.weight.dtype == torch.float32  # parameters stay in float32


def test_16_mixed_clips_the_unscaled_gradients():
    """Clipping must see the true gradients: the grad scaler multiplies them by 2**16, so
    clipping before unscaling would shrink the update by that factor."""
    from estimatorch import GradientUpdateHandler

    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
                    precision="16-mixed")
    before = [p.detach().clone() for p in net.parameters()]
    est.fit(make_batches(n_batches=1), epochs=1, event_handlers=[GradientUpdateHandler(clip_grad_norm=1e-3)])
    moved = torch.linalg.vector_norm(torch.cat([(p.detach() - b).flatten() for p, b in zip(net.parameters(), before)]))
    assert float(moved) == pytest.approx(1e-3, rel=1e-2)  # lr 1 x the clipped norm
