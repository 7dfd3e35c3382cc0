"""TerminateOnNaNHandler: a device-side tally read every ``check_every`` batches."""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from torch import nn

from estimatorch import Estimator, NonFiniteError, checkpoint
from estimatorch.event_handlers import CheckpointHandler, LambdaHandler, TerminateOnNaNHandler, ValidationHandler
from estimatorch.metrics import Loss
from tests.conftest import make_batches

N_BATCHES = 4  # per epoch


class NanLossAt:
    """Cross-entropy, made nan on the given calls (1-based)."""

    def __init__(self, *bad):
        self.bad, self.calls = set(bad), 0
        self.loss = nn.CrossEntropyLoss()

    def __call__(self, pred, label):
        self.calls += 1
        loss = self.loss(pred, label)
        return loss * float("nan") if self.calls in self.bad else loss


def make(loss, **kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    return Estimator(net, loss, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)


def errors(records):
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR]


def test_check_every_1_stops_at_the_first_nan_loss(estimatorch_log):
    est = make(NanLossAt(6))
    h = TerminateOnNaNHandler(check_every=1)
    est.fit(make_batches(N_BATCHES), epochs=5, event_handlers=[h])
    assert est.position.step == 6 and (h.reason, h.stopped_batch) == ("loss", 6)
    assert errors(estimatorch_log) == ["Terminating: the loss is not finite (nan or inf) at batch 6 (batch 2 of the epoch)"]


def test_a_later_check_finds_the_first_bad_batch(estimatorch_log):
    est = make(NanLossAt(6, 7))
    h = TerminateOnNaNHandler(check_every=3)
    est.fit(make_batches(N_BATCHES * 4), epochs=2, event_handlers=[h])
    assert est.position.step == 6  # checks at 3 and 6
    est = make(NanLossAt(7))
    h = TerminateOnNaNHandler(check_every=3)
    est.fit(make_batches(N_BATCHES * 4), epochs=2, event_handlers=[h])
    assert est.position.step == 9 and h.stopped_batch == 7
    assert errors(estimatorch_log)[-1] == ("Terminating: the loss is not finite (nan or inf) at batch 7 "
                                    "(batch 7 of the epoch), found at the check after batch 9")


def test_the_epoch_end_checks_what_the_last_interval_left(estimatorch_log):
    est = make(NanLossAt(N_BATCHES))
    h = TerminateOnNaNHandler(check_every=1000)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[h])
    assert (est.position.epoch, est.position.step) == (1, N_BATCHES) and h.stopped_batch == N_BATCHES


def test_between_checks_the_host_never_reads_the_tally(monkeypatch):
    h = TerminateOnNaNHandler(check_every=5)

    class Est:
        logger, val_metrics, boundary_actions_pending = logging.getLogger("test"), [], False

    h.train_begin(Est())
    reads = []
    for name in ("item", "__int__", "__bool__", "__float__", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(20):
        h.batch_end(Est(), batch=None, pred=None, label=None, loss=torch.tensor(1.0))
    assert len(reads) == 20 // 5


class InfAfter(Loss):
    """A loss-like metric whose value becomes infinite after ``n`` updates."""

    def __init__(self, n, name="weird"):
        super().__init__(name)
        self.n = n
        self.updates = 0

    def update(self, preds, target=None):
        self.updates += 1
        super().update(preds * math.inf if self.updates > self.n else preds, target)


def test_a_monitored_metric_that_is_not_finite_stops_and_is_named(estimatorch_log):
    est = make(nn.CrossEntropyLoss(), train_metrics=[Loss(), InfAfter(5)])
    h = TerminateOnNaNHandler(check_every=2, monitor=est.train_metrics[1])
    est.fit(make_batches(N_BATCHES), epochs=5, event_handlers=[h])
    assert est.position.step == 6 and h.reason == "train_weird"
    assert errors(estimatorch_log) == ["Terminating: train_weird is inf at batch 6 (batch 2 of the epoch)"]


def test_a_val_metric_is_checked_only_after_validation():
    """Before its first validation a val loss holds no value (nan): not a reason to stop."""
    est = make(nn.CrossEntropyLoss())
    h = TerminateOnNaNHandler(check_every=1, monitor=est.val_metrics[0])
    val = ValidationHandler(make_batches(2, seed=1), est.evaluate, epoch_period=2)
    history = est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[h, val])
    assert len(history) == 3 and h.reason is None


def test_a_non_finite_val_metric_stops_at_the_epoch_end():
    est = make(nn.CrossEntropyLoss(), val_metrics=[Loss(), InfAfter(0)])
    h = TerminateOnNaNHandler(check_every=1, monitor=est.val_metrics[1])
    est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=[h])
    assert (est.position.epoch, h.reason, h.stopped_batch) == (1, "val_weird", N_BATCHES)


def test_the_tally_is_state_and_a_resume_reports_a_bad_batch_from_before_the_save():
    class Est:
        logger, val_metrics, boundary_actions_pending = logging.getLogger("test"), [], False

    h = TerminateOnNaNHandler(check_every=5)
    h.train_begin(Est())
    for v in (1.0, math.nan, 1.0):
        assert not h.batch_end(Est(), batch=None, pred=None, label=None, loss=torch.tensor(v))
    state = h.state_dict()
    resumed = TerminateOnNaNHandler(check_every=5)
    resumed.train_begin(Est())
    resumed.load_state_dict(state)
    stops = [resumed.batch_end(Est(), batch=None, pred=None, label=None, loss=torch.tensor(1.0)) for _ in range(2)]
    assert stops == [False, True] and resumed.stopped_batch == 2
    del state["good"]
    with pytest.raises(ValueError, match="good"):
        resumed.load_state_dict(state)


def test_train_begin_resets_so_the_next_fit_runs():
    h = TerminateOnNaNHandler(check_every=1)
    est = make(NanLossAt(2))
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    assert est.position.step == 2
    est = make(nn.CrossEntropyLoss())  # the same handler serves a new run
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    assert est.position.step == 2 * N_BATCHES and h.reason is None


@pytest.mark.parametrize("kwargs, error, match", [
    ({"check_every": 0}, ValueError, "check_every"),
    ({"check_every": 1.5}, ValueError, "check_every"),
    ({"monitor": "val_loss"}, TypeError, "monitor"),
    ({"monitor": [Loss(), 3]}, TypeError, "monitor"),
])
def test_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        TerminateOnNaNHandler(**kwargs)


def test_a_monitor_the_estimator_does_not_own_is_refused_at_fit_start():
    est = make(nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="does not own"):
        est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[TerminateOnNaNHandler(monitor=Loss())])


# -- raise_error ----------------------------------------------------------------------------------
def test_raise_error_raises_a_named_error_after_the_train_end_handlers(estimatorch_log):
    ended = []
    est = make(NanLossAt(6))
    h = TerminateOnNaNHandler(check_every=1, raise_error=True)
    with pytest.raises(NonFiniteError, match=r"the loss is not finite \(nan or inf\) at batch 6") as info:
        est.fit(make_batches(N_BATCHES), epochs=5,
                event_handlers=[h, LambdaHandler(train_end=lambda e, **k: ended.append(e.position.step))])
    assert isinstance(info.value, RuntimeError) and (info.value.reason, info.value.batch) == ("loss", 6)
    assert ended == [5]  # train_end ran; the poisoned step 6 never reached its boundary
    assert errors(estimatorch_log)[0] == "Terminating: the loss is not finite (nan or inf) at batch 6 " \
                                          "(batch 2 of the epoch)"


def test_raise_error_for_a_monitored_metric_at_an_epoch_end():
    est = make(nn.CrossEntropyLoss(), val_metrics=[Loss(), InfAfter(0)])
    h = TerminateOnNaNHandler(check_every=100, monitor=est.val_metrics[1], raise_error=True)
    with pytest.raises(NonFiniteError, match="val_weird is inf") as info:
        est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=[h])
    assert info.value.reason == "val_weird" and est.position.epoch == 0  # epoch 1's end never passed


def saved_steps(directory):
    return sorted(step for _, step, _ in checkpoint.list_checkpoints(directory, "model"))


@pytest.mark.parametrize("first", ["terminate", "checkpoint"])
@pytest.mark.parametrize("check_every", [1, 100])
def test_no_checkpoint_of_a_non_finite_state_is_written(tmp_path, first, check_every):
    """A CheckpointHandler saving every batch between two checks would save the poisoned state
    (the tally is read only every check_every batches): a pending save forces a check first."""
    bad = 6
    est = make(NanLossAt(bad))
    h = TerminateOnNaNHandler(check_every=check_every, raise_error=True)
    ckpt = CheckpointHandler(tmp_path, batch_period=1, max_checkpoints=None)
    with pytest.raises(NonFiniteError):
        est.fit(make_batches(N_BATCHES), epochs=5, event_handlers=[h, ckpt] if first == "terminate" else [ckpt, h])
    assert saved_steps(tmp_path) == sorted({*range(1, bad), N_BATCHES})  # each good step (epoch 1's end: one file)
    latest = checkpoint.find_latest(tmp_path, "model")[0]
    assert os.path.basename(latest) == checkpoint.checkpoint_name("model", 1, bad - 1)
    params = checkpoint.load(latest)["model"]
    assert all(torch.isfinite(v).all() for v in params.values())


def test_a_pending_save_at_an_epoch_end_is_checked_first(tmp_path):
    """The last batch of epoch 2 is bad and the tally is not due: the epoch end's save waits for
    the check, which raises."""
    est = make(NanLossAt(2 * N_BATCHES))
    ckpt = CheckpointHandler(tmp_path, epoch_period=1)
    with pytest.raises(NonFiniteError):
        est.fit(make_batches(N_BATCHES), epochs=5,
                event_handlers=[TerminateOnNaNHandler(check_every=100, raise_error=True), ckpt])
    assert saved_steps(tmp_path) == [N_BATCHES]


def test_stopping_writes_at_most_the_stop_boundarys_checkpoint(tmp_path):
    """Without raise_error the stop's own boundary is saved (it is where the run stops); the
    forced check keeps it to that one, rather than every save until the next due check."""
    bad = 6
    est = make(NanLossAt(bad))
    ckpt = CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, max_checkpoints=None)
    est.fit(make_batches(N_BATCHES), epochs=5, event_handlers=[TerminateOnNaNHandler(check_every=100), ckpt])
    assert est.position.step == bad and saved_steps(tmp_path) == list(range(1, bad + 1))


def test_checks_follow_pending_saves_only(monkeypatch):
    """Between due checks the tally is read only where a save waits: the cost of a check comes
    with the cost of a save."""
    est = make(nn.CrossEntropyLoss())
    h = TerminateOnNaNHandler(check_every=100)
    checks = []
    original = h._check
    monkeypatch.setattr(h, "_check", lambda e, at_epoch_end: checks.append(e.position.step) or original(e, at_epoch_end))
    save_every_3 = LambdaHandler(batch_end=lambda e, **k: e.at_boundary(lambda: None), every=3)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[save_every_3, h])
    # during batch_end the position still names the previous step: steps 3 and 6 are at 2 and 5;
    # the epoch ends (4, 8) check anyway
    assert checks == [2, N_BATCHES, 5, 2 * N_BATCHES]


def test_raise_error_must_be_a_bool():
    with pytest.raises(TypeError, match="raise_error must be a bool, got 1"):
        TerminateOnNaNHandler(raise_error=1)
