"""ValidationHandler: evaluation on an epoch and/or batch schedule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.estimator import Position
from estimatorch.event_handlers import BatchEnd, EpochBegin, EpochEnd, ValidationHandler
from estimatorch.events import subscribes
from tests.conftest import Count, make_batches, make_estimator

N_BATCHES = 4
ONE = [(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long))]  # val data where its content does not matter


class FakeEval:
    """An eval_fn that records where in the run it was called, and with what."""

    def __init__(self, count: Count) -> None:
        self.count = count
        self.calls: list[tuple[int, int]] = []
        self.kwargs: list[dict] = []
        self.data: list = []

    def __call__(self, val_data, **kwargs):
        self.calls.append((self.count.epochs, self.count.batches))
        self.kwargs.append(kwargs)
        self.data.append(val_data)
        return {}


def run(epochs=4, **handler_kwargs):
    count = Count()
    fake = FakeEval(count)
    val = make_batches(2, seed=1)
    h = ValidationHandler(val, fake, **handler_kwargs)
    make_estimator().fit(make_batches(N_BATCHES), epochs=epochs, event_handlers=[count, h])
    return fake, h, val


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arg", ["epoch_period", "batch_period"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_periods(arg, bad):
    with pytest.raises(ValueError) as info:
        ValidationHandler(ONE, lambda *a, **k: None, **{arg: bad})
    assert arg in str(info.value) and repr(bad) in str(info.value)


def test_bad_val_data_and_eval_fn():
    with pytest.raises(TypeError, match="val_data"):
        ValidationHandler(5, lambda *a, **k: None)
    with pytest.raises(TypeError, match="eval_fn"):
        ValidationHandler(ONE, "evaluate")
    with pytest.raises(TypeError, match="iterator"):
        ValidationHandler(iter(ONE), lambda *a, **k: None)


def test_empty_val_data_is_refused_before_any_training():
    """Accepted, it trained an epoch (and wrote checkpoints) before evaluate found no batch."""
    count = Count()
    with pytest.raises(ValueError, match="val_data is empty: a list of length 0"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=2,
                             event_handlers=[count, ValidationHandler([], lambda *a, **k: None)])
    assert count.batches == 0
    with pytest.raises(TypeError, match="event_handlers"):
        ValidationHandler(ONE, lambda *a, **k: None, event_handlers=[object()])


# -- schedule -----------------------------------------------------------------------------------
def test_every_epoch_by_default():
    fake, _, _ = run(epochs=3)
    assert fake.calls == [(e, e * N_BATCHES) for e in range(1, 4)]


def test_epoch_period():
    fake, _, _ = run(epochs=5, epoch_period=2)
    # after epochs 2 and 4, once their batches are done
    assert fake.calls == [(2, 2 * N_BATCHES), (4, 4 * N_BATCHES)]


def test_batch_period_counts_over_the_whole_run():
    fake, _, _ = run(epochs=3, epoch_period=None, batch_period=3)
    total = 3 * N_BATCHES
    # counted over the run: batches 3, 6, 9, 12 (a per-epoch count would give 3, 7, 11)
    expected_batches = [b for b in range(1, total + 1) if b % 3 == 0]
    assert [b for _, b in fake.calls] == expected_batches
    # each during its batch_end: the epoch it belongs to has not ended yet
    assert [e for e, _ in fake.calls] == [(b - 1) // N_BATCHES for b in expected_batches]


def test_epoch_and_batch_period_together():
    fake, _, _ = run(epochs=2, epoch_period=1, batch_period=N_BATCHES)
    # after batch 4 (batch_end), after epoch 1, after batch 8, after epoch 2
    assert fake.calls == [(0, 4), (1, 4), (1, 8), (2, 8)]


def test_both_periods_none_is_refused():
    with pytest.raises(ValueError, match="epoch_period and batch_period are both None"):
        ValidationHandler(ONE, lambda *a, **k: None, epoch_period=None)


def test_subscribes_only_to_the_periods_set():

    def handler(**periods):
        return ValidationHandler(ONE, lambda *a, **k: None, **periods)

    assert subscribes(handler(), "epoch_end") and not subscribes(handler(), "batch_end")
    only_batches = handler(epoch_period=None, batch_period=3)
    assert subscribes(only_batches, "batch_end") and not subscribes(only_batches, "epoch_end")


def test_passes_val_data_event_handlers_and_batch_axis():
    class Listener(EpochBegin):
        def epoch_begin(self, estimator, **kwargs):
            pass

    listener = Listener()
    count = Count()
    fake = FakeEval(count)
    val = make_batches(2, seed=1)
    h = ValidationHandler(val, fake, event_handlers=[listener])
    # batch_axis only travels to eval_fn (the default step ignores it)
    make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[count, h], batch_axis=1)
    assert fake.data == [val] and fake.data[0] is val
    assert fake.kwargs == [{"batch_axis": 1, "event_handlers": [listener]}]


def test_with_est_evaluate_val_metrics_match_a_hand_evaluation():
    est = make_estimator()
    val = make_batches(3, batch_size=5, seed=1)

    class Events(EpochBegin, BatchEnd, EpochEnd):
        def __init__(self):
            self.calls = []

        def epoch_begin(self, estimator, **kwargs):
            self.calls.append("epoch_begin")

        def batch_end(self, estimator, **kwargs):
            self.calls.append("batch_end")

        def epoch_end(self, estimator, **kwargs):
            self.calls.append("epoch_end")

    events = Events()
    history = est.fit(make_batches(N_BATCHES), epochs=2,
                      event_handlers=[ValidationHandler(val, est.evaluate, event_handlers=[events])])
    # the handlers passed on saw both evaluations, batch by batch
    assert events.calls == 2 * ["epoch_begin", "batch_end", "batch_end", "batch_end", "epoch_end"]
    est.net.eval()
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(est.net(x), y, reduction="sum") for x, y in val]
        correct = [(est.net(x).argmax(1) == y).sum() for x, y in val]
    n = sum(len(y) for _, y in val)
    assert history["val_loss"][-1] == pytest.approx(float(sum(losses)) / n, rel=1e-6)
    assert history["val_accuracy"][-1] == pytest.approx(int(sum(correct)) / n, rel=1e-12)


def test_user_handler_replaces_the_default():
    est = make_estimator()
    count = Count()
    fake = FakeEval(count)
    val = make_batches(2, seed=1)
    history = est.fit(make_batches(N_BATCHES), val_data=val, epochs=2,
                      event_handlers=[count, ValidationHandler(val, fake, epoch_period=2)])
    assert fake.calls == [(2, 2 * N_BATCHES)]
    assert "val_loss" not in history  # est.evaluate never ran: nothing to record


# -- state and reuse ----------------------------------------------------------------------------
def test_state_round_trip():
    _, h, val = run(epochs=2, batch_period=3)
    state = h.state_dict()
    assert state == {"current_epoch": 2, "current_batch": 2 * N_BATCHES}
    fresh = ValidationHandler(val, lambda *a, **k: None, batch_period=3)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


@pytest.mark.parametrize("periods, counted", [
    ({"epoch_period": 2}, {"current_epoch": 3, "current_batch": None}),
    ({"epoch_period": None, "batch_period": 5}, {"current_epoch": None, "current_batch": 3 * N_BATCHES}),
])
def test_the_state_holds_only_the_counts_kept(periods, counted):
    """A count of events the handler does not listen to would stay 0 and lie: it is None."""
    _, h, _ = run(epochs=3, **periods)
    assert h.state_dict() == counted
    assert not hasattr(h, "current_batch") and not hasattr(h, "current_epoch")  # no public counter that lies


def test_loaded_counters_continue_the_schedule():
    calls = []
    h = ValidationHandler([1], lambda data, **kw: calls.append(1), epoch_period=3, batch_period=5)

    class Est:
        batch_axis = 0

        def record_validation(self, values=None):
            return False

    h.train_begin(Est())
    h.load_state_dict({"current_epoch": 2, "current_batch": 4})
    h.batch_end(Est())  # batch 5
    h.epoch_end(Est())  # epoch 3
    assert len(calls) == 2


def test_a_count_the_saved_run_did_not_keep_comes_from_the_position():
    """Resumed with a batch_period the saved run did not have: batches count from the position."""
    calls = []
    h = ValidationHandler([1], lambda data, **kw: calls.append(1), epoch_period=None, batch_period=5)

    class Est:
        batch_axis = 0
        position = Position(epoch=1, batch=0, step=8)

        def record_validation(self, values=None):
            return False

    h.train_begin(Est())
    h.load_state_dict({"current_epoch": 1, "current_batch": None})
    h.batch_end(Est())  # batch 9
    h.batch_end(Est())  # batch 10
    assert len(calls) == 1 and h.state_dict() == {"current_epoch": None, "current_batch": 10}


@pytest.mark.parametrize("key", ["current_epoch", "current_batch"])
def test_load_missing_key(key):
    h = ValidationHandler(ONE, lambda *a, **k: None)
    state = h.state_dict()
    del state[key]
    with pytest.raises(ValueError, match=key):
        h.load_state_dict(state)


def test_load_a_bad_count():
    h = ValidationHandler(ONE, lambda *a, **k: None)
    with pytest.raises(ValueError, match="current_epoch"):
        h.load_state_dict({"current_epoch": -1, "current_batch": None})


def test_one_instance_serves_two_fits():
    count = Count()
    fake = FakeEval(count)
    h = ValidationHandler(make_batches(2, seed=1), fake, epoch_period=2, batch_period=3)
    make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[count, h])
    first = list(fake.calls)
    count.batches = count.epochs = 0
    fake.calls.clear()
    make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[count, h])
    assert fake.calls == first
    assert [b for _, b in first] == [3, 6, 8, 9, 12]
