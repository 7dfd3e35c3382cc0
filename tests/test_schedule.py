"""EventFilter: the one helper for every / once / before / after / predicate."""

from __future__ import annotations

import pytest

from estimatorch.event_handlers import EventFilter

COUNTS = range(1, 31)


def fired(f):
    return [n for n in COUNTS if f(n)]


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, arg", [
    ({"every": 0}, "every"), ({"every": -3}, "every"), ({"every": 1.5}, "every"), ({"every": True}, "every"),
    ({"once": 0}, "once"), ({"once": [1, 0]}, "once"), ({"once": True}, "once"), ({"once": ["2"]}, "once"),
    ({"before": 0}, "before"), ({"before": 2.0}, "before"),
    ({"after": -1}, "after"), ({"after": 1.5}, "after"),
])
def test_bad_values_name_argument_and_value(kwargs, arg):
    value = next(iter(kwargs.values()))
    shown = value[-1] if isinstance(value, list) else value
    with pytest.raises(ValueError) as info:
        EventFilter(**kwargs)
    assert arg in str(info.value) and repr(shown) in str(info.value)


def test_once_needs_a_count():
    with pytest.raises(ValueError, match="once"):
        EventFilter(once=[])


def test_once_of_a_wrong_type():
    with pytest.raises(TypeError) as info:
        EventFilter(once=2.5)
    assert "once" in str(info.value) and "2.5" in str(info.value)


def test_predicate_must_be_callable():
    with pytest.raises(TypeError, match="predicate"):
        EventFilter(predicate=True)


def test_after_zero_is_allowed():
    assert fired(EventFilter(after=0)) == list(COUNTS)


# -- decisions ----------------------------------------------------------------------------------
def test_no_condition_always_fires():
    assert fired(EventFilter()) == list(COUNTS)


def test_every():
    assert fired(EventFilter(every=7)) == [7, 14, 21, 28]
    assert fired(EventFilter(every=1)) == list(COUNTS)


def test_once():
    assert fired(EventFilter(once=5)) == [5]
    assert fired(EventFilter(once=(3, 9, 9, 40))) == [3, 9]
    assert fired(EventFilter(once=range(10, 13))) == [10, 11, 12]


def test_before_and_after_are_strict():
    assert fired(EventFilter(before=4)) == [1, 2, 3]
    assert fired(EventFilter(after=27)) == [28, 29, 30]
    assert fired(EventFilter(after=3, before=6)) == [4, 5]
    assert fired(EventFilter(after=3, before=5)) == [4]


@pytest.mark.parametrize("kwargs", [
    {"before": 1}, {"before": 3, "after": 5}, {"before": 5, "after": 4}, {"once": 3, "every": 2},
    {"once": [2, 9], "after": 2, "before": 9}, {"every": 4, "after": 4, "before": 8},
])
def test_conditions_that_can_never_fire_are_refused(kwargs):
    """Such a filter would be accepted and silently never fire: refused, naming what was given."""
    with pytest.raises(ValueError, match="can never fire") as info:
        EventFilter(**kwargs)
    assert all(f"{k}={v!r}" in str(info.value) for k, v in kwargs.items())


@pytest.mark.parametrize("kwargs", [
    {"before": 2}, {"before": 6, "after": 4}, {"every": 4, "after": 4, "before": 9}, {"once": [3, 4], "every": 2},
])
def test_the_narrowest_conditions_that_can_fire_are_accepted(kwargs):
    f = EventFilter(**kwargs)
    assert len(fired(f)) == 1


def test_predicate():
    assert fired(EventFilter(predicate=lambda n: n * n % 10 == 1)) == [n for n in COUNTS if n * n % 10 == 1]


def test_predicate_result_is_a_python_bool():
    f = EventFilter(predicate=lambda n: [n] if n > 1 else [])
    assert f(1) is False and f(2) is True


def test_all_conditions_must_hold():
    f = EventFilter(every=3, after=5, before=25, predicate=lambda n: n % 2 == 0, once=range(1, 19))
    assert fired(f) == [n for n in COUNTS if n % 3 == 0 and 5 < n < 25 and n % 2 == 0 and n < 19]
    assert fired(f) == [6, 12, 18]


def test_repr_shows_the_conditions_given():
    assert repr(EventFilter(every=2, after=3)) == "EventFilter(every=2, after=3)"
    assert repr(EventFilter()) == "EventFilter()"
