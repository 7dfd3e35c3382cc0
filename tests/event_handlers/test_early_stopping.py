"""EarlyStoppingHandler: mode, min_delta, patience, baseline, nan, best weights, state."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from estimatorch.estimator import Position
from estimatorch.event_handlers import EarlyStoppingHandler, EpochEnd, LambdaHandler
from estimatorch.metrics import Accuracy, Loss, MeanAbsoluteError, MeanSquaredError, Metric, TopKAccuracy
from tests.conftest import make_batches, make_estimator


class Scripted(Metric):
    """A metric whose value in epoch ``e`` (counted by its resets, which MetricHandler does at
    every epoch_begin) is ``values[e - 1]``. Outside a fit, :meth:`next` advances it."""

    default_name = "scripted"

    def __init__(self, values, higher_is_better=False, name=None):
        super().__init__(name)
        self.values = list(values)
        self.higher_is_better = higher_is_better
        self.epoch = 0

    def update(self, preds, target):
        pass

    def reset(self):
        self.epoch += 1

    def next(self):
        self.epoch += 1
        return self

    def _value(self, states):
        return torch.tensor(self.values[self.epoch - 1], dtype=torch.float64)


class Est:
    """What epoch_end needs from an estimator."""

    def __init__(self):
        self.logger = logging.getLogger("test")
        self.net = torch.nn.Linear(1, 1)
        self.val_metrics = []  # the monitor is not a val metric: read once per epoch
        self.position = Position()


def decisions(values, **kwargs):
    """Feed ``values`` one epoch at a time, as fit would, until epoch_end asks to stop; return
    what it returned each epoch."""
    metric = Scripted(values, higher_is_better=kwargs.pop("higher_is_better", False))
    h = EarlyStoppingHandler(metric, **kwargs)
    est = Est()
    h.train_begin(est)
    out = []
    for _ in values:
        metric.next()
        out.append(h.epoch_end(est))
        if out[-1]:
            break
    return out, h


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, arg, shown", [
    ({"patience": -1}, "patience", "-1"),
    ({"patience": 1.5}, "patience", "1.5"),
    ({"patience": True}, "patience", "True"),
    ({"min_delta": -0.1}, "min_delta", "-0.1"),
    ({"min_delta": math.nan}, "min_delta", "nan"),
    ({"min_delta": "0"}, "min_delta", "'0'"),
    ({"mode": "maximum"}, "mode", "'maximum'"),
    ({"baseline": "1"}, "baseline", "'1'"),
    ({"baseline": math.nan}, "baseline", "nan"),
    ({"baseline": math.inf}, "baseline", "inf"),
    ({"start_from_epoch": -1}, "start_from_epoch", "-1"),
    ({"start_from_epoch": 1.0}, "start_from_epoch", "1.0"),
])
def test_bad_arguments_name_argument_and_value(kwargs, arg, shown):
    with pytest.raises(ValueError) as info:
        EarlyStoppingHandler(Loss(), **kwargs)
    assert arg in str(info.value) and shown in str(info.value)


def test_bad_types():
    with pytest.raises(TypeError, match="restore_best_weights"):
        EarlyStoppingHandler(Loss(), restore_best_weights=1)
    with pytest.raises(TypeError, match="monitor"):
        EarlyStoppingHandler(3)
    with pytest.raises(TypeError, match="monitor"):
        EarlyStoppingHandler(None)


def test_auto_mode_needs_higher_is_better():
    class Duck:
        def update(self, p, t): pass
        def compute(self): return 0.0
        def reset(self): pass

    with pytest.raises(ValueError, match="higher_is_better"):
        EarlyStoppingHandler(Duck())
    assert EarlyStoppingHandler(Duck(), mode="max").mode == "max"


# -- mode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric, mode", [
    (Loss(), "min"), (MeanSquaredError(), "min"), (MeanAbsoluteError(), "min"),
    (Accuracy(), "max"), (TopKAccuracy(2), "max"),
])
def test_auto_mode_follows_higher_is_better(metric, mode):
    assert EarlyStoppingHandler(metric).mode == mode


def test_explicit_mode_wins():
    assert EarlyStoppingHandler(Loss(), mode="max").mode == "max"
    assert EarlyStoppingHandler(Accuracy(), mode="min").mode == "min"


def test_a_falling_loss_never_stops():
    # Gluon's auto mode compared with "greater" for every metric and stopped here at epoch 2
    out, h = decisions([3.0, 2.0, 1.0, 0.5], patience=0)
    assert out == [False] * 4
    assert (h.best, h.best_epoch) == (0.5, 4)


def test_a_rising_accuracy_never_stops():
    out, h = decisions([0.5, 0.6, 0.7], patience=0, higher_is_better=True)
    assert out == [False] * 3 and h.mode == "max"


def test_a_rising_loss_stops():
    out, h = decisions([1.0, 2.0, 3.0], patience=0)
    assert out == [False, True]  # epoch 2 is worse than epoch 1
    assert h.stopped_epoch == 2


# -- patience, min_delta, baseline ---------------------------------------------------------------
@pytest.mark.parametrize("patience, stop_epoch", [(0, 2), (1, 2), (2, 3), (3, 4)])
def test_patience(patience, stop_epoch):
    # best at epoch 1, then no improvement: stop after max(patience, 1) epochs without one
    values = [1.0] + [1.0] * 5
    out, h = decisions(values, patience=patience)
    assert out.index(True) + 1 == stop_epoch == 1 + max(patience, 1)
    assert h.wait == max(patience, 1)


def test_an_improvement_resets_the_wait():
    # improvements at 1, 3, 5; patience 2 never runs out until 6 and 7 fail
    out, h = decisions([5.0, 5.0, 4.0, 4.0, 3.0, 3.0, 3.0], patience=2)
    assert out == [False] * 6 + [True]
    assert (h.best, h.best_epoch) == (3.0, 5)


def test_min_delta_min_mode():
    # an improvement must beat best - 0.5: 4.6 does not (best stays 5), 4.4 does, 4.0 does not
    out, h = decisions([5.0, 4.6, 4.4, 4.0, 3.0], min_delta=0.5, patience=2)
    assert out == [False, False, False, False, False]
    assert [h.best, h.best_epoch] == [3.0, 5]
    out, h = decisions([5.0, 4.6, 4.4, 4.0, 3.95], min_delta=0.5, patience=2)
    assert out == [False, False, False, False, True]
    assert [h.best, h.best_epoch] == [4.4, 3]


def test_min_delta_max_mode():
    out, h = decisions([0.5, 0.55, 0.62, 0.65], min_delta=0.1, patience=1, higher_is_better=True)
    # 0.55 is not > 0.5 + 0.1: stop at epoch 2
    assert out == [False, True]
    assert h.best == 0.5


def test_baseline_must_be_beaten():
    out, h = decisions([2.0, 1.5, 0.9], baseline=1.0, patience=2)
    assert out == [False, True]  # 2.0 and 1.5 do not beat 1.0
    assert h.best == 1.5 and h.best_epoch == 2  # the best seen all the same
    out, h = decisions([0.9, 0.8], baseline=1.0, patience=0)
    assert out == [False, False]
    assert h.best == 0.8


def test_an_improvement_that_does_not_beat_the_baseline_does_not_reset_the_wait():
    out, h = decisions([3.0, 2.0, 1.5, 0.5, 0.7], baseline=1.0, patience=3)
    assert out == [False, False, True]  # improving on 3.0 and 2.0, but never under 1.0 in 3 epochs
    out, h = decisions([3.0, 2.0, 0.5, 0.7, 0.8, 0.9], baseline=1.0, patience=3)
    assert out == [False, False, False, False, False, True] and (h.best, h.best_epoch) == (0.5, 3)


def test_baseline_in_max_mode_with_min_delta():
    out, _ = decisions([0.75, 0.79, 0.81], baseline=0.7, min_delta=0.1, patience=1, higher_is_better=True)
    # improvements must exceed 0.8: 0.75 fails (stop)
    assert out == [True]


# -- nan ----------------------------------------------------------------------------------------
def test_nan_counts_as_no_improvement_with_a_warning():
    metric = Scripted([1.0, math.nan, math.nan, 0.5])
    h = EarlyStoppingHandler(metric, patience=2)
    est = Est()
    h.train_begin(est)
    metric.next()
    assert h.epoch_end(est) is False
    with pytest.warns(UserWarning, match="nan"):
        metric.next()
        assert h.epoch_end(est) is False
    with pytest.warns(UserWarning, match="nan"):
        metric.next()
        assert h.epoch_end(est) is True
    assert (h.best, h.best_epoch, h.wait) == (1.0, 1, 2)


def test_nan_first_then_a_value():
    with pytest.warns(UserWarning, match="nan"):
        out, h = decisions([math.nan, 2.0, 1.0], patience=3)
    assert out == [False, False, False]
    assert (h.best, h.best_epoch, h.wait) == (1.0, 3, 0)


# -- through fit --------------------------------------------------------------------------------
class Weights(EpochEnd):
    """The weights at every epoch's end (after the epoch's steps, before early stopping)."""

    priority = -500

    def __init__(self):
        self.epochs = []

    def epoch_end(self, estimator, **kwargs):
        self.epochs.append({k: v.clone() for k, v in estimator.net.state_dict().items()})


def fit_scripted(values, epochs, **kwargs):
    est = make_estimator(train_metrics=[Loss(), Scripted(values, higher_is_better=kwargs.pop("higher", False))])
    monitor = est.train_metrics[1]
    weights = Weights()
    h = EarlyStoppingHandler(monitor, **kwargs)
    history = est.fit(make_batches(), epochs=epochs, event_handlers=[weights, h])
    return est, history, weights, h


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_stops_at_the_right_epoch_in_fit():
    _, history, _, h = fit_scripted([3.0, 1.0, 2.0, 4.0, 0.5, 0.1], epochs=6, patience=2)
    assert len(history) == 4  # best at 2, then 3 and 4 without improvement
    assert h.stopped_epoch == 4 and h.best_epoch == 2


def test_stops_on_a_constant_val_loss():
    # lr=0: the weights never change, so the val loss is the same every epoch
    est = make_estimator(lr=0.0)
    h = EarlyStoppingHandler(est.val_metrics[0], patience=2)
    history = est.fit(make_batches(), val_data=make_batches(2, seed=1), epochs=10, event_handlers=[h])
    assert len(history) == 1 + 2
    assert history["val_loss"][0] == history["val_loss"][-1]


def test_monitor_must_be_owned_by_the_estimator():
    est = make_estimator()
    with pytest.raises(ValueError, match="does not own"):
        est.fit(make_batches(), epochs=1, event_handlers=[EarlyStoppingHandler(Loss("other"))])


def test_restore_best_weights_after_an_early_stop():
    est, history, weights, h = fit_scripted([3.0, 1.0, 2.0, 4.0, 0.5], epochs=5, patience=2,
                                            restore_best_weights=True)
    assert len(weights.epochs) == 4
    final = est.net.state_dict()
    assert same_weights(final, weights.epochs[1])  # epoch 2 was the best
    assert not same_weights(final, weights.epochs[3])


def test_restore_best_weights_without_an_early_stop():
    est, _, weights, _ = fit_scripted([3.0, 1.0, 2.0], epochs=3, patience=5, restore_best_weights=True)
    assert same_weights(est.net.state_dict(), weights.epochs[1])


def test_no_restore_when_the_fit_is_cut_short_by_an_exception():
    # the weights must stay those that fit(..., resume=True) continues from
    est = make_estimator(train_metrics=[Loss(), Scripted([3.0, 1.0, 2.0, 4.0])])
    weights = Weights()

    def crash(estimator, **kwargs):
        raise RuntimeError("crash in epoch 3")

    h = EarlyStoppingHandler(est.train_metrics[1], patience=5, restore_best_weights=True)
    with pytest.raises(RuntimeError, match="epoch 3"):
        est.fit(make_batches(), epochs=4, event_handlers=[weights, h, LambdaHandler(epoch_end=crash, once=3)])
    assert len(weights.epochs) == 3
    assert same_weights(est.net.state_dict(), weights.epochs[2])
    assert h.best_epoch == 2 and same_weights(h.best_weights, weights.epochs[1])


def test_no_restore_by_default():
    est, _, weights, h = fit_scripted([3.0, 1.0, 2.0, 4.0], epochs=4, patience=2)
    assert same_weights(est.net.state_dict(), weights.epochs[-1])
    assert h.best_weights is None


def test_restore_best_weights_in_max_mode():
    est, _, weights, _ = fit_scripted([0.5, 0.9, 0.7, 0.6], epochs=4, patience=5, higher=True,
                                      restore_best_weights=True)
    assert same_weights(est.net.state_dict(), weights.epochs[1])


def test_restore_best_weights_when_the_baseline_is_never_beaten(estimatorch_log):
    """The docstring promises the best epoch's weights: it was never stored before."""
    est, history, weights, h = fit_scripted([3.0, 1.5, 2.0, 2.5], epochs=4, patience=3, baseline=1.0,
                                            restore_best_weights=True)
    assert len(history) == 3 and h.stopped_epoch == 3  # 3 epochs without beating 1.0
    assert (h.best, h.best_epoch) == (1.5, 2)
    assert same_weights(est.net.state_dict(), weights.epochs[1])
    messages = [r.getMessage() for r in estimatorch_log]
    assert "[Epoch 3] Early stopping: train_scripted has not beaten the baseline 1 in 3 epoch(s) " \
           "(best 1.5 at epoch 2)" in messages
    assert "Restored the weights of epoch 2 (best train_scripted: 1.5)" in messages


# -- start_from_epoch ----------------------------------------------------------------------------
def test_start_from_epoch_ignores_the_warm_up_epochs():
    # without it, 1.0 at epoch 1 is the best and patience 2 stops at epoch 3
    values = [1.0, 4.0, 3.0, 2.0, 2.5, 2.6]
    assert decisions(values, patience=2)[0] == [False, False, True]
    out, h = decisions(values, patience=2, start_from_epoch=2)
    assert out == [False, False, False, False, False, True]
    assert (h.best, h.best_epoch, h.stopped_epoch) == (2.0, 4, 6)


def test_start_from_epoch_does_not_read_the_monitor_while_warming_up():
    """A val metric before the first validation is nan: not read, so no nan warning either."""
    metric = Scripted([math.nan, 1.0])
    h = EarlyStoppingHandler(metric, start_from_epoch=1)
    h.train_begin(Est())
    reads = []
    compute = metric.compute
    metric.compute = lambda *a, **k: reads.append(1) or compute(*a, **k)
    metric.next()
    assert h.epoch_end(Est()) is False and reads == []
    metric.next()
    assert h.epoch_end(Est()) is False and len(reads) == 1 and h.best == 1.0


def test_warm_up_epochs_never_give_the_restored_weights():
    est, _, weights, h = fit_scripted([0.1, 3.0, 2.0, 2.5], epochs=4, patience=5, start_from_epoch=1,
                                      restore_best_weights=True)
    assert h.best_epoch == 3 and same_weights(est.net.state_dict(), weights.epochs[2])


def test_start_from_epoch_holds_after_a_resume():
    """The epoch count is state: a run resumed in its warm-up still ignores the rest of it."""
    metric = Scripted([1.0, 9.0, 8.0, 9.5])
    h = EarlyStoppingHandler(metric, patience=1, start_from_epoch=2)
    h.train_begin(Est())
    metric.next()
    h.epoch_end(Est())
    resumed = EarlyStoppingHandler(metric, patience=1, start_from_epoch=2)
    resumed.train_begin(Est())
    resumed.load_state_dict(h.state_dict())
    out = []
    for _ in range(3):
        metric.next()
        out.append(resumed.epoch_end(Est()))
    # epoch 2 ignored, 8.0 the best at epoch 3, 9.5 no better: a count restarted at the resume
    # would have ignored epoch 3 and taken 9.5 as the first value
    assert out == [False, False, True] and (resumed.best, resumed.best_epoch) == (8.0, 3)


# -- state and reuse ----------------------------------------------------------------------------
def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert a[key].keys() == b[key].keys()
            assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])
        else:
            assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), key


def test_state_round_trip():
    est, _, _, h = fit_scripted([3.0, 1.0, 2.0, 4.0], epochs=4, patience=5, restore_best_weights=True)
    state = h.state_dict()
    assert (state["current_epoch"], state["best"], state["best_epoch"], state["wait"]) == (4, 1.0, 2, 2)
    fresh = EarlyStoppingHandler(est.train_metrics[1], restore_best_weights=True)
    fresh.load_state_dict(state)
    assert_state_equal(fresh.state_dict(), state)
    # a copy: changing the loaded handler's weights does not change the saved state
    next(iter(fresh.best_weights.values())).add_(1.0)
    assert_state_equal(h.state_dict(), state)


def test_loaded_state_continues_the_count():
    metric = Scripted([5.0, 5.0])
    h = EarlyStoppingHandler(metric, patience=3)
    h.train_begin(Est())
    h.load_state_dict({"current_epoch": 4, "best": 1.0, "best_epoch": 2, "wait": 2, "stopped_epoch": 0,
                       "best_weights": None})
    metric.next()
    assert h.epoch_end(Est()) is True  # wait 3 reaches patience
    assert h.stopped_epoch == 5


@pytest.mark.parametrize("key", ["current_epoch", "best", "best_epoch", "wait", "stopped_epoch", "best_weights"])
def test_load_missing_key(key):
    h = EarlyStoppingHandler(Loss())
    state = h.state_dict()
    del state[key]
    with pytest.raises(ValueError, match=key):
        h.load_state_dict(state)


def test_one_instance_serves_two_fits():
    est = make_estimator(train_metrics=[Loss(), Scripted([3.0, 1.0, 2.0, 4.0, 0.5] * 2)])
    weights = Weights()
    h = EarlyStoppingHandler(est.train_metrics[1], patience=2, restore_best_weights=True)
    first = est.fit(make_batches(), epochs=5, event_handlers=[weights, h])
    best_first = weights.epochs[1]
    state_first = h.state_dict()
    weights.epochs.clear()
    # the scripted values repeat; without a reset the second fit would start from best=1.0
    est.train_metrics[1].epoch = 5
    second = est.fit(make_batches(), epochs=5, event_handlers=[weights, h])
    assert len(first) == len(second) == 4
    assert (h.best, h.best_epoch, h.stopped_epoch) == (state_first["best"], state_first["best_epoch"], 4)
    assert same_weights(est.net.state_dict(), weights.epochs[1])
    assert not same_weights(weights.epochs[1], best_first)


def test_best_weights_use_plain_keys_and_restore_into_a_compiled_or_plain_net():
    """The best weights are saved in checkpoints: with torch.compile's ``_orig_mod.`` keys they
    could not be restored after a compiled run resumed into a plain net (or the reverse)."""
    import torch
    from torch import nn

    from estimatorch import Estimator
    from estimatorch.event_handlers.early_stopping import _load_plain_weights
    from tests.conftest import make_batches

    def build(compiled):
        torch.manual_seed(1)
        plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        net = torch.compile(plain, backend="eager") if compiled else plain
        return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.5)), plain

    est, _ = build(compiled=True)
    stopper = EarlyStoppingHandler(est.train_metrics[0], patience=100, restore_best_weights=True)
    est.fit(make_batches(4), epochs=3, event_handlers=[stopper])
    best = stopper.state_dict()["best_weights"]
    assert best and not any("_orig_mod" in k for k in best)
    for compiled in (False, True):  # a resumed run of either kind restores them
        other, plain = build(compiled)
        _load_plain_weights(other.net, best)
        assert all(torch.equal(value, best[key]) for key, value in plain.state_dict().items())
