"""LambdaHandler: functions on the events given (and no others), filters, stop, state."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from estimatorch.event_handlers import EVENTS, LambdaHandler
from estimatorch.events import subscribes
from tests.conftest import Count, make_batches, make_estimator

N_BATCHES = 4


def noop(estimator, **kwargs):
    return None


def fired_batches(epochs=3, **filters):
    """The (1-based, run-wide) batch numbers at which a batch_end function fired."""
    count = Count()
    fired = []
    h = LambdaHandler(batch_end=lambda est, **kw: fired.append(count.batches), **filters)
    make_estimator().fit(make_batches(N_BATCHES), epochs=epochs, event_handlers=[count, h])
    return fired


# -- arguments ----------------------------------------------------------------------------------
def test_needs_a_function():
    with pytest.raises(ValueError, match="at least one event"):
        LambdaHandler()
    with pytest.raises(ValueError, match="at least one event"):
        LambdaHandler(every=2)


def test_function_must_be_callable():
    with pytest.raises(TypeError) as info:
        LambdaHandler(batch_end=5)
    assert "batch_end" in str(info.value) and "5" in str(info.value)


def test_unknown_event():
    with pytest.raises(TypeError, match="'on_batch_end'"):
        LambdaHandler(batch_end=noop, on_batch_end=noop)


@pytest.mark.parametrize("kwargs, arg", [({"every": 0}, "every"), ({"once": 0}, "once"),
                                         ({"before": 0}, "before"), ({"after": -1}, "after")])
def test_bad_filters(kwargs, arg):
    with pytest.raises(ValueError) as info:
        LambdaHandler(batch_end=noop, **kwargs)
    assert arg in str(info.value) and repr(next(iter(kwargs.values()))) in str(info.value)


def test_filters_that_can_never_fire_are_refused():
    """LambdaHandler(before=3, after=5) was accepted and never called its function."""
    with pytest.raises(ValueError, match="before=3, after=5 can never fire"):
        LambdaHandler(batch_end=noop, before=3, after=5)
    with pytest.raises(ValueError, match="can never fire"):
        LambdaHandler(epoch_end=noop, once=[1, 3], every=2)


@pytest.mark.parametrize("bad", ["high", None, math.nan, True])
def test_bad_priority(bad):
    with pytest.raises(ValueError) as info:
        LambdaHandler(batch_end=noop, priority=bad)
    assert "priority" in str(info.value) and repr(bad) in str(info.value)


def test_bad_predicate():
    with pytest.raises(TypeError, match="predicate"):
        LambdaHandler(batch_end=noop, predicate=3)


# -- subscriptions ------------------------------------------------------------------------------
@pytest.mark.parametrize("event", list(EVENTS))
def test_subscribes_only_to_the_events_given(event):
    """Plus train_begin, once per fit, to reset the counts: nothing else is ever called."""
    h = LambdaHandler(**{event: noop})
    assert type(h) is LambdaHandler  # one class whatever the options: no class made at run time
    assert subscribes(h, event)
    for other in EVENTS:
        if other not in (event, "train_begin"):
            assert not subscribes(h, other), other  # fit calls a handler only for what it listens to


def test_two_events():
    h = LambdaHandler(epoch_begin=noop, backward_end=noop)
    subscribed = {e for e in EVENTS if subscribes(h, e)}
    assert subscribed == {"train_begin", "epoch_begin", "backward_end"}


def test_fit_calls_exactly_the_functions_given():
    calls = {e: 0 for e in EVENTS}

    def recorder(event):
        def fn(estimator, **kwargs):
            calls[event] += 1
        return fn

    epochs = 2
    expected = {"train_begin": 1, "train_end": 1, "epoch_begin": epochs, "epoch_end": epochs,
                **{e: epochs * N_BATCHES for e in ("batch_begin", "forward_begin", "forward_end",
                                                    "backward_begin", "backward_end", "batch_end")}}
    for event in EVENTS:
        calls.update(dict.fromkeys(EVENTS, 0))
        make_estimator().fit(make_batches(N_BATCHES), epochs=epochs,
                             event_handlers=[LambdaHandler(**{event: recorder(event)})])
        assert calls == {e: (expected[e] if e == event else 0) for e in EVENTS}, event


def test_functions_receive_the_event_keywords():
    seen = []

    def fn(estimator, *, batch, pred, label, loss, **kwargs):
        seen.append((estimator, batch, pred.shape, label.shape, loss.dim()))

    est = make_estimator()
    batches = make_batches(2)
    est.fit(batches, epochs=1, event_handlers=[LambdaHandler(batch_end=fn)])
    assert [s[0] for s in seen] == [est, est]
    assert all(torch.equal(s[1][0], b[0]) and torch.equal(s[1][1], b[1]) for s, b in zip(seen, batches))
    assert seen[0][2:] == ((8, 3), (8,), 0)


def test_priority():
    grads = []

    def fn(estimator, **kwargs):
        grads.append(next(estimator.net.parameters()).grad)

    est = make_estimator()
    # before the optimizer step (-2000) the gradients are there; after it they are cleared
    est.fit(make_batches(1), epochs=1, event_handlers=[LambdaHandler(batch_end=fn, priority=-3000)])
    est.fit(make_batches(1), epochs=1, event_handlers=[LambdaHandler(batch_end=fn)])
    assert grads[0] is not None and grads[1] is None
    assert LambdaHandler(batch_end=noop, priority=-3000).priority == -3000


# -- filters ------------------------------------------------------------------------------------
TOTAL = 3 * N_BATCHES


@pytest.mark.parametrize("filters, wanted", [
    ({}, lambda n: True),
    ({"every": 3}, lambda n: n % 3 == 0),
    ({"once": 5}, lambda n: n == 5),
    ({"once": [2, 7]}, lambda n: n in (2, 7)),
    ({"before": 3}, lambda n: n < 3),
    ({"after": 10}, lambda n: n > 10),
    ({"predicate": lambda n: n % 5 == 1}, lambda n: n % 5 == 1),
    ({"every": 2, "after": 5, "before": 11}, lambda n: n % 2 == 0 and 5 < n < 11),
])
def test_batch_filters_count_batches_over_the_run(filters, wanted):
    assert fired_batches(epochs=3, **filters) == [n for n in range(1, TOTAL + 1) if wanted(n)]


def test_epoch_events_count_epochs():
    count = Count()
    fired = []
    h = LambdaHandler(epoch_end=lambda est, **kw: fired.append(count.epochs), every=2)
    make_estimator().fit(make_batches(N_BATCHES), epochs=5, event_handlers=[count, h])
    assert fired == [2, 4]


def test_each_event_has_its_own_count():
    fired = []
    h = LambdaHandler(batch_end=lambda est, **kw: fired.append("batch"),
                      epoch_end=lambda est, **kw: fired.append("epoch"), once=2)
    make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[h])
    assert fired == ["batch", "epoch"]
    assert h.counts == {"batch_end": 3 * N_BATCHES, "epoch_end": 3}


# -- stopping -----------------------------------------------------------------------------------
def test_true_from_batch_end_stops():
    count = Count()
    stop = LambdaHandler(batch_end=lambda est, **kw: True, once=6)
    history = make_estimator().fit(make_batches(N_BATCHES), epochs=5, event_handlers=[count, stop])
    assert count.batches == 6
    assert count.epochs == len(history) == 2  # the cut-short epoch still ends


def test_true_from_epoch_end_stops():
    count = Count()
    stop = LambdaHandler(epoch_end=lambda est, **kw: True, once=2)
    make_estimator().fit(make_batches(N_BATCHES), epochs=5, event_handlers=[count, stop])
    assert (count.epochs, count.batches) == (2, 2 * N_BATCHES)


def test_filtered_out_calls_return_none():
    h = LambdaHandler(batch_end=lambda est, **kw: True, every=2)
    out = [h.batch_end(None, batch=None, pred=None, label=None, loss=None) for _ in range(4)]
    assert out == [None, True, None, True]


# -- state and reuse ----------------------------------------------------------------------------
def test_one_instance_serves_two_fits():
    count = Count()
    fired = []
    h = LambdaHandler(batch_end=lambda est, **kw: fired.append(count.batches), once=[2, 6])
    for _ in range(2):
        count.batches = 0
        make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[count, h])
    assert fired == [2, 6, 2, 6]


def test_state_round_trip():
    h = LambdaHandler(batch_end=noop, epoch_end=noop)
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    state = h.state_dict()
    assert state == {"counts": {"batch_end": 2 * N_BATCHES, "epoch_end": 2}}
    fresh = LambdaHandler(batch_end=noop, epoch_end=noop)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    state["counts"]["batch_end"] = 0  # a copy, not a view
    assert fresh.counts["batch_end"] == 2 * N_BATCHES


def test_a_resumed_fit_continues_the_counts():
    def every_third():
        calls = []
        h = LambdaHandler(batch_end=lambda est, **kw: calls.append(h.counts["batch_end"]), every=3)
        return h, calls

    whole, whole_calls = every_third()
    make_estimator().fit(make_batches(N_BATCHES), epochs=4, event_handlers=[whole])
    assert whole_calls == [3, 6, 9, 12, 15]
    # stop after 2 epochs, resume with a new instance (as a new process would): the restored
    # counts carry on, so the resumed part fires where the uninterrupted run did
    est = make_estimator()
    first, first_calls = every_third()
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[first])
    second, second_calls = every_third()
    est.fit(make_batches(N_BATCHES), epochs=4, event_handlers=[second], resume=True)
    assert first_calls + second_calls == whole_calls


def test_counts_loaded_between_events_are_kept_for_the_next_ones():
    fired = []
    h = LambdaHandler(batch_end=lambda est, **kw: fired.append(1), every=3)
    h.load_state_dict({"counts": {"batch_end": 5}})
    for _ in range(4):  # counts 6..9
        h.batch_end(None, batch=None, pred=None, label=None, loss=None)
    assert len(fired) == 2 and h.counts == {"batch_end": 9}


def test_load_missing_keys():
    h = LambdaHandler(batch_end=noop, epoch_end=noop)
    with pytest.raises(ValueError, match="'counts'"):
        h.load_state_dict({})
    with pytest.raises(ValueError, match="'epoch_end'"):
        h.load_state_dict({"counts": {"batch_end": 1}})


def test_deepcopy_keeps_its_own_counts():
    h = LambdaHandler(batch_end=noop)
    h.batch_end(None, batch=None, pred=None, label=None, loss=None)
    twin = copy.deepcopy(h)
    assert type(twin) is type(h) and twin.counts == {"batch_end": 1}
    twin.batch_end(None, batch=None, pred=None, label=None, loss=None)
    assert (h.counts["batch_end"], twin.counts["batch_end"]) == (1, 2)


def test_refuses_pickling():
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(LambdaHandler(batch_end=noop))
