"""LRSchedulerHandler: per-epoch and per-batch steps, ReduceLROnPlateau with a monitor, state."""

from __future__ import annotations

import signal

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, ExponentialLR, ReduceLROnPlateau, StepLR

from estimatorch import Estimator
from estimatorch.event_handlers import BatchBegin, BatchEnd, LambdaHandler, LRSchedulerHandler
from estimatorch.events import subscribes
from estimatorch.metrics import Loss, Metric
from tests.conftest import make_batches, make_estimator

LR = 0.1
GAMMA = 0.5
N_BATCHES = 4


class LRs(BatchBegin):
    """The learning rate each batch trained with."""

    def __init__(self):
        self.lrs = []

    def batch_begin(self, estimator, **kwargs):
        self.lrs.append(estimator.optimizer.param_groups[0]["lr"])


class Scripted(Metric):
    """Value ``values[e - 1]`` in epoch ``e`` (MetricHandler resets it at each epoch_begin)."""

    default_name = "scripted"
    higher_is_better = False

    def __init__(self, values):
        super().__init__()
        self.values, self.epoch = list(values), 0

    def update(self, preds, target):
        pass

    def reset(self):
        self.epoch += 1

    def _value(self, states):
        return torch.tensor(self.values[self.epoch - 1], dtype=torch.float64)


def estimator_with_scheduler(make_scheduler):
    """An estimator that owns the scheduler ``make_scheduler(optimizer)`` builds."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    return Estimator(net, torch.nn.CrossEntropyLoss(), optimizer=opt, lr_scheduler=make_scheduler(opt))


def counting(scheduler):
    calls = []
    step = scheduler.step

    def counted(*args, **kwargs):
        calls.append(args)
        return step(*args, **kwargs)

    scheduler.step = counted
    return calls


# -- arguments ----------------------------------------------------------------------------------
def test_bad_step_on():
    with pytest.raises(ValueError) as info:
        LRSchedulerHandler(step_on="step")
    assert "step_on" in str(info.value) and "'step'" in str(info.value)


def test_bad_scheduler_and_monitor():
    with pytest.raises(TypeError, match="scheduler"):
        LRSchedulerHandler(object())
    with pytest.raises(TypeError, match="monitor"):
        LRSchedulerHandler(monitor=3)
    with pytest.raises(ValueError, match="monitor"):
        LRSchedulerHandler(monitor="")


def test_plateau_needs_a_monitor():
    est = make_estimator()
    with pytest.raises(ValueError, match="monitor"):
        LRSchedulerHandler(ReduceLROnPlateau(est.optimizer))


def test_other_schedulers_refuse_a_monitor():
    est = make_estimator()
    with pytest.raises(ValueError, match="StepLR"):
        LRSchedulerHandler(StepLR(est.optimizer, 1), monitor=Loss())


def test_fit_refuses_a_handler_without_any_scheduler():
    est = make_estimator()
    with pytest.raises(ValueError, match="no scheduler"):
        est.fit(make_batches(), epochs=1, event_handlers=[LRSchedulerHandler()])


def test_fit_checks_the_monitor_against_the_estimators_scheduler():
    est = make_estimator()
    est.lr_scheduler = StepLR(est.optimizer, 1)
    with pytest.raises(ValueError, match="monitor"):
        est.fit(make_batches(), epochs=1, event_handlers=[LRSchedulerHandler(monitor=est.train_metrics[0])])
    plateau_est = estimator_with_scheduler(ReduceLROnPlateau)
    with pytest.raises(ValueError, match="monitor"):  # the default handler has none
        plateau_est.fit(make_batches(), epochs=1)


# -- stepping -----------------------------------------------------------------------------------
def test_steps_every_epoch():
    est, rec = make_estimator(lr=LR), LRs()
    sched = StepLR(est.optimizer, step_size=1, gamma=GAMMA)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[rec, LRSchedulerHandler(sched)])
    assert rec.lrs == pytest.approx([LR * GAMMA ** (i // N_BATCHES) for i in range(3 * N_BATCHES)])
    assert est.optimizer.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** 3)


def test_steps_every_batch():
    est, rec = make_estimator(lr=LR), LRs()
    sched = ExponentialLR(est.optimizer, gamma=GAMMA)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[rec, LRSchedulerHandler(sched, step_on="batch")])
    assert rec.lrs == pytest.approx([LR * GAMMA ** i for i in range(2 * N_BATCHES)])


def test_default_handler_for_the_estimators_scheduler():
    est = estimator_with_scheduler(lambda opt: StepLR(opt, 1, gamma=GAMMA))
    calls = counting(est.lr_scheduler)
    rec = LRs()
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[rec])
    assert len(calls) == 3
    assert rec.lrs[::N_BATCHES] == pytest.approx([LR, LR * GAMMA, LR * GAMMA ** 2])


def test_a_user_handler_replaces_the_default():
    est = estimator_with_scheduler(lambda opt: StepLR(opt, 1, gamma=GAMMA))
    calls = counting(est.lr_scheduler)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[LRSchedulerHandler(step_on="batch")])
    assert len(calls) == 2 * N_BATCHES  # stepped by the user's handler only


def test_plateau_with_a_constant_monitor_reduces_every_epoch():
    est = make_estimator(lr=LR, train_metrics=[Loss(), Scripted([3.0, 3.0, 3.0])])
    sched = ReduceLROnPlateau(est.optimizer, mode="min", factor=0.1, patience=0)
    calls = counting(sched)
    rec = LRs()
    est.fit(make_batches(N_BATCHES), epochs=3,
            event_handlers=[rec, LRSchedulerHandler(sched, monitor=est.train_metrics[1])])
    assert calls == [(3.0,)] * 3
    # epoch 1 sets the best; epochs 2 and 3 do not improve with patience 0: a cut each time
    assert est.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.1 ** 2)
    assert rec.lrs[::N_BATCHES] == pytest.approx([LR, LR, LR * 0.1])


def test_plateau_with_an_improving_monitor_keeps_the_rate():
    est = make_estimator(lr=LR, train_metrics=[Loss(), Scripted([3.0, 2.0, 1.0])])
    sched = ReduceLROnPlateau(est.optimizer, mode="min", factor=0.1, patience=0)
    calls = counting(sched)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[LRSchedulerHandler(sched, monitor=est.train_metrics[1])])
    assert calls == [(3.0,), (2.0,), (1.0,)]
    assert est.optimizer.param_groups[0]["lr"] == LR


def test_plateau_sees_this_epochs_validation():
    est = make_estimator(lr=LR)
    sched = ReduceLROnPlateau(est.optimizer)
    calls = counting(sched)
    history = est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3,
                      event_handlers=[LRSchedulerHandler(sched, monitor=est.val_metrics[0])])
    assert [c[0] for c in calls] == history["val_loss"]


# -- state and reuse ----------------------------------------------------------------------------
def test_state_round_trip_with_its_own_scheduler():
    est = make_estimator(lr=LR)
    h = LRSchedulerHandler(StepLR(est.optimizer, step_size=2, gamma=GAMMA))
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[h])
    state = h.state_dict()
    assert state["scheduler"]["last_epoch"] == 3
    other = make_estimator(lr=LR)
    fresh = LRSchedulerHandler(StepLR(other.optimizer, step_size=2, gamma=GAMMA))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_state_of_the_estimators_scheduler_is_the_estimators():
    h = LRSchedulerHandler()
    assert h.state_dict() == {"scheduler": None, "trained_rates": None}
    h.load_state_dict({"scheduler": None})


def test_load_missing_key():
    with pytest.raises(ValueError, match="'scheduler'"):
        LRSchedulerHandler().load_state_dict({})


def test_one_instance_serves_two_fits():
    est = make_estimator(lr=LR)
    sched = StepLR(est.optimizer, step_size=1, gamma=GAMMA)
    calls = counting(sched)
    h = LRSchedulerHandler(sched)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    assert len(calls) == 4  # the schedule itself is the scheduler's state: it goes on
    assert est.optimizer.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** 4)


def test_a_per_batch_schedule_follows_optimizer_steps_under_accumulation():
    """OneCycleLR sized in optimizer steps: with accumulation 2, 16 batches make 8 optimizer
    steps, and the schedule steps 8 times (stepping per batch would overrun it and raise)."""
    from estimatorch import GradientUpdateHandler

    est = make_estimator()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(est.optimizer, max_lr=0.5, total_steps=8)
    est.fit(make_batches(n_batches=8), epochs=2, event_handlers=[
        GradientUpdateHandler(accumulation_steps=2), LRSchedulerHandler(scheduler, step_on="batch")])
    assert scheduler.last_epoch == 8


def test_subscribes_only_to_the_event_it_steps_on():

    assert subscribes(LRSchedulerHandler(), "epoch_end") and not subscribes(LRSchedulerHandler(), "batch_end")
    per_batch = LRSchedulerHandler(step_on="batch")  # epoch_end: an epoch's leftover accumulation step
    assert subscribes(per_batch, "batch_end") and subscribes(per_batch, "epoch_end")


# -- state across fits: a new fit watches afresh, a resume continues -----------------------------
def plateau_fit(est, handler, epochs, **kwargs):
    rec = LRs()
    est.fit(make_batches(N_BATCHES), epochs=epochs, event_handlers=[rec, handler], **kwargs)
    return rec.lrs[::N_BATCHES]


@pytest.mark.parametrize("own", [True, False], ids=["its-own-scheduler", "the-estimators"])
def test_a_new_fit_starts_the_plateau_watch_afresh(own):
    """Reused for a second fit, ReduceLROnPlateau kept the first fit's best value, patience
    count and cooldown (Keras fixed the same bug, keras-team/keras#20256)."""
    values = [3.0, 2.0, 2.5]  # patience 1: epoch 3 is one bad epoch, no cut yet
    est = make_estimator(lr=LR, train_metrics=[Loss(), Scripted(values * 2)])
    sched = ReduceLROnPlateau(est.optimizer, mode="min", factor=0.1, patience=1, cooldown=2)
    if not own:
        est.lr_scheduler = sched
    h = LRSchedulerHandler(sched if own else None, monitor=est.train_metrics[1])
    first = plateau_fit(est, h, epochs=3)
    assert (sched.best, sched.num_bad_epochs) == (2.0, 1)
    # the same values again: with the old watch, 3.0 is a second bad epoch and cuts the rate
    second = plateau_fit(est, h, epochs=3)
    assert first == second == [LR] * 3
    assert (sched.best, sched.num_bad_epochs, sched.last_epoch) == (2.0, 1, 3)


def test_a_resumed_fit_continues_the_plateau_watch():
    values = [3.0, 2.0, 2.5, 2.6, 2.7]  # patience 1: the cut comes after epoch 4
    est = make_estimator(lr=LR, train_metrics=[Loss(), Scripted(values)])
    est.lr_scheduler = ReduceLROnPlateau(est.optimizer, mode="min", factor=0.1, patience=1)
    ctrl_c = LambdaHandler(epoch_end=lambda e, **k: signal.raise_signal(signal.SIGINT), once=3)
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=5,
                event_handlers=[LRSchedulerHandler(monitor=est.train_metrics[1]), ctrl_c])
    assert est.lr_scheduler.num_bad_epochs == 1
    lrs = plateau_fit(est, LRSchedulerHandler(monitor=est.train_metrics[1]), epochs=5, resume=True)
    assert lrs == pytest.approx([LR, LR * 0.1])  # epoch 4 was the second bad one: cut before epoch 5


# -- the learning rate in the history and the log ------------------------------------------------
def test_the_history_records_the_rate_each_epoch_trained_with():
    est, rec = make_estimator(lr=LR), LRs()
    sched = StepLR(est.optimizer, step_size=1, gamma=GAMMA)
    history = est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[rec, LRSchedulerHandler(sched)])
    assert history["lr"] == rec.lrs[::N_BATCHES] == pytest.approx([LR, LR * GAMMA, LR * GAMMA ** 2])
    assert history.learning_rates == ["lr"] and "lr" not in history.metrics


def test_a_per_batch_schedule_records_the_rate_of_the_epochs_last_step():
    est, rec = make_estimator(lr=LR), LRs()
    history = est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[
        rec, LRSchedulerHandler(ExponentialLR(est.optimizer, gamma=GAMMA), step_on="batch")])
    assert history["lr"] == rec.lrs[N_BATCHES - 1::N_BATCHES]  # what the last batch of each epoch trained with
    assert history["lr"] == pytest.approx([LR * GAMMA ** (N_BATCHES - 1), LR * GAMMA ** (2 * N_BATCHES - 1)])


def test_a_cosine_decayed_to_zero_shows_the_last_rate_a_batch_trained_with(estimatorch_log):
    """The issue's run: a per-batch cosine ending at 0 showed `lr: 0` for an epoch that never
    trained at 0."""
    est, rec = make_estimator(lr=LR), LRs()
    sched = CosineAnnealingLR(est.optimizer, T_max=2 * N_BATCHES)
    history = est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[rec, LRSchedulerHandler(sched, step_on="batch")])
    assert est.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # after the final step
    assert history["lr"][-1] == rec.lrs[-1] > 0
    epoch_lines = [r.getMessage() for r in estimatorch_log if "[Epoch 2/2] Finished" in r.getMessage()]
    assert epoch_lines and epoch_lines[0].endswith(f"lr: {rec.lrs[-1]:.4g}")


def test_a_plateau_cut_is_logged_with_its_reason(estimatorch_log):
    est = make_estimator(lr=LR, train_metrics=[Loss(), Scripted([3.0, 3.0])])
    sched = ReduceLROnPlateau(est.optimizer, mode="min", factor=0.1, patience=0)
    history = est.fit(make_batches(N_BATCHES), epochs=2,
                      event_handlers=[LRSchedulerHandler(sched, monitor=est.train_metrics[1])])
    messages = [r.getMessage() for r in estimatorch_log]
    assert [m for m in messages if "Learning rate" in m] == [
        f"[Epoch 2] Learning rate {LR:.6g} -> {LR * 0.1:.6g} (ReduceLROnPlateau, train_scripted 3)"]
    assert history["lr"] == [LR, LR]  # both epochs trained at LR; the cut applies from epoch 3


def test_an_unchanged_rate_is_not_logged(estimatorch_log):
    est = make_estimator(lr=LR)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[LRSchedulerHandler(StepLR(est.optimizer, 5))])
    assert not any("Learning rate" in r.getMessage() for r in estimatorch_log)


def test_a_resume_at_an_epochs_last_batch_records_the_same_per_batch_rate():
    import signal

    class CtrlCAt(BatchEnd):
        def __init__(self, at):
            self.at, self.n = at, 0

        def batch_end(self, est, **kw):
            self.n += 1
            if self.n == self.at:
                signal.raise_signal(signal.SIGINT)

    def run(*extra, resume=False, est=None):
        est = est or make_estimator(lr=LR)
        if not resume:
            est._sched = CosineAnnealingLR(est.optimizer, T_max=2 * N_BATCHES)
        handler = LRSchedulerHandler(est._sched, step_on="batch")
        return est, est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler, *extra], resume=resume)

    _, whole = run()
    est = make_estimator(lr=LR)
    with pytest.raises(KeyboardInterrupt):
        run(CtrlCAt(N_BATCHES), est=est)  # stops after the first epoch's last step, before its epoch_end
    _, resumed = run(resume=True, est=est)
    assert resumed["lr"] == whole["lr"]
