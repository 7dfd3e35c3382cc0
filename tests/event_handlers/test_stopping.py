"""StoppingHandler: epoch and batch limits, read against the fit's plan."""

from __future__ import annotations

import pytest

from estimatorch.event_handlers import StoppingHandler
from tests.conftest import Count, make_batches, make_estimator

N_BATCHES = 4  # batches per epoch of make_batches()


def run(handlers=(), **plan):
    count = Count()
    history = make_estimator().fit(make_batches(N_BATCHES), event_handlers=[count, *handlers], **plan)
    return count, history


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arg", ["max_epoch", "max_batch"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_limits_name_argument_and_value(arg, bad):
    with pytest.raises(ValueError) as info:
        StoppingHandler(**{arg: bad})
    assert arg in str(info.value) and repr(bad) in str(info.value)


def test_defaults_are_none():
    h = StoppingHandler()
    assert (h.max_epoch, h.max_batch) == (None, None)


# -- the plan -----------------------------------------------------------------------------------
def test_default_handler_follows_epochs_plan():
    count, history = run(epochs=3)
    assert (count.epochs, count.batches) == (3, 3 * N_BATCHES)
    assert len(history) == 3


def test_default_handler_follows_batches_plan_across_epochs():
    # 6 batches of 4-batch epochs: one full epoch, then an epoch cut short after 2 batches,
    # whose epoch_end still runs.
    count, history = run(batches=6)
    assert (count.batches, count.epochs) == (6, 2)
    assert len(history) == 2


def test_batches_plan_exact_multiple_of_epoch_length():
    count, _ = run(batches=2 * N_BATCHES)
    assert (count.batches, count.epochs) == (2 * N_BATCHES, 2)


# -- its own limits vs the plan -----------------------------------------------------------------
def test_own_max_epoch_stops_before_the_plan():
    count, history = run([StoppingHandler(max_epoch=1)], epochs=3)
    assert (count.epochs, count.batches) == (1, N_BATCHES)
    assert len(history) == 1


def test_own_max_batch_with_an_epochs_plan():
    count, _ = run([StoppingHandler(max_batch=5)], epochs=3)
    assert (count.batches, count.epochs) == (5, 2)


def test_own_max_epoch_with_a_batches_plan():
    count, _ = run([StoppingHandler(max_epoch=1)], batches=10)
    assert (count.batches, count.epochs) == (N_BATCHES, 1)


def test_own_limit_never_extends_the_plan():
    # fit(epochs=2) is the contract resume and the history are checked against.
    count, history = run([StoppingHandler(max_epoch=5)], epochs=2)
    assert (count.epochs, count.batches) == (2, 2 * N_BATCHES)
    assert len(history) == 2


def test_own_max_batch_never_extends_a_batches_plan():
    count, _ = run([StoppingHandler(max_batch=50)], batches=3)
    assert count.batches == 3


def test_both_limits_first_one_reached_wins():
    count, _ = run([StoppingHandler(max_epoch=2, max_batch=100)], epochs=5)
    assert count.epochs == 2
    count, _ = run([StoppingHandler(max_epoch=5, max_batch=3)], epochs=5)
    assert (count.batches, count.epochs) == (3, 1)


# -- the handler on its own ---------------------------------------------------------------------
class Plan:
    def __init__(self, max_epoch=None, max_batch=None):
        self.max_epoch, self.max_batch = max_epoch, max_batch


def _batch_end(h, est):
    return h.batch_end(est, batch=None, pred=None, label=None, loss=None)


def test_returns_python_bools():
    h = StoppingHandler()
    est = Plan(max_epoch=2, max_batch=2)
    h.train_begin(est)
    results = [_batch_end(h, est), _batch_end(h, est), h.epoch_end(est), h.epoch_end(est)]
    assert results == [False, True, False, True]
    assert all(type(r) is bool for r in results)


def test_no_limit_never_stops():
    h = StoppingHandler()
    est = Plan()
    h.train_begin(est)
    assert not any(_batch_end(h, est) for _ in range(100))
    assert not any(h.epoch_end(est) for _ in range(100))


def test_loaded_counters_continue():
    h = StoppingHandler(max_batch=5)
    h.train_begin(Plan())
    h.load_state_dict({"current_epoch": 0, "current_batch": 3})
    assert [_batch_end(h, Plan()) for _ in range(2)] == [False, True]


# -- state and reuse ----------------------------------------------------------------------------
def test_state_round_trip():
    h = StoppingHandler()
    run([h], batches=6)
    state = h.state_dict()
    assert state == {"current_epoch": 2, "current_batch": 6}
    fresh = StoppingHandler()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


@pytest.mark.parametrize("key", ["current_epoch", "current_batch"])
def test_load_missing_key(key):
    state = StoppingHandler().state_dict()
    del state[key]
    with pytest.raises(ValueError, match=key):
        StoppingHandler().load_state_dict(state)


def test_one_instance_serves_two_fits():
    h = StoppingHandler(max_batch=5)
    first, _ = run([h], epochs=3)
    second, _ = run([h], epochs=3)
    assert (first.batches, first.epochs) == (second.batches, second.epochs) == (5, 2)
