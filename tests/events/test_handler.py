"""StatefulHandler (events/handler.py) and the shared argument checks; the event mixins."""

from __future__ import annotations

import inspect

import pytest
import torch

from estimatorch._checks import check_positive_int, check_state_keys
from estimatorch.event_handlers import EVENTS, StatefulHandler, mixins


class Counter(StatefulHandler):
    state_attributes = ("count", "tensor", "history")

    def __init__(self):
        self.count = 0
        self.tensor = torch.zeros(3)
        self.history = [[1, 2], {"a": 1}]


# -- name and priority --------------------------------------------------------------------------
def test_default_name_and_priority():
    h = Counter()
    assert h.name == "Counter"
    assert h.priority == 0


def test_name_can_be_set():
    h = Counter()
    h.name = "my_counter"
    assert h.name == "my_counter"
    assert Counter().name == "Counter"  # per instance


@pytest.mark.parametrize("bad", ["", 3, None])
def test_bad_name(bad):
    with pytest.raises(ValueError) as info:
        Counter().name = bad
    assert "name" in str(info.value) and repr(bad) in str(info.value)


# -- state --------------------------------------------------------------------------------------
def test_state_dict_holds_copies():
    h = Counter()
    state = h.state_dict()
    assert set(state) == {"count", "tensor", "history"}
    h.count += 1
    h.tensor.add_(1)
    h.history[0].append(3)
    h.history[1]["a"] = 2
    assert state["count"] == 0
    assert torch.equal(state["tensor"], torch.zeros(3))
    assert state["history"] == [[1, 2], {"a": 1}]


def test_load_state_dict_round_trip_and_copies():
    h = Counter()
    h.count, h.tensor, h.history = 5, torch.arange(3.0), [[7], {"b": 2}]
    state = h.state_dict()
    fresh = Counter()
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert again["count"] == 5 and again["history"] == [[7], {"b": 2}]
    assert torch.equal(again["tensor"], torch.arange(3.0))
    state["tensor"].add_(10)  # the loaded handler does not share the caller's objects
    state["history"][0].append(8)
    assert torch.equal(fresh.tensor, torch.arange(3.0)) and fresh.history[0] == [7]


@pytest.mark.parametrize("key", ["count", "tensor", "history"])
def test_load_missing_key_names_it(key):
    h = Counter()
    state = h.state_dict()
    del state[key]
    with pytest.raises(ValueError) as info:
        h.load_state_dict(state)
    assert repr(key) in str(info.value) and "Counter" in str(info.value)


def test_load_refuses_a_non_dict():
    with pytest.raises(TypeError, match="list"):
        Counter().load_state_dict([])


def test_a_handler_without_state():
    class Plain(StatefulHandler):
        pass

    assert Plain().state_dict() == {}
    Plain().load_state_dict({})


# -- argument checks ----------------------------------------------------------------------------
def test_check_state_keys():
    check_state_keys({"a": 1, "b": 2}, ("a", "b"), "owner")
    with pytest.raises(ValueError, match="owner is missing the key 'b'"):
        check_state_keys({"a": 1}, ("a", "b", "c"), "owner")


def test_check_positive_int_accepts():
    assert check_positive_int(1, "n") == 1
    assert check_positive_int(None, "n", allow_none=True) is None
    assert check_positive_int(0, "n", minimum=0) == 0


@pytest.mark.parametrize("value, kwargs", [
    (0, {}), (-1, {}), (1.0, {}), (True, {}), ("2", {}), (None, {}), (-1, {"minimum": 0}),
    (2, {"minimum": 3}),
])
def test_check_positive_int_refuses(value, kwargs):
    with pytest.raises(ValueError) as info:
        check_positive_int(value, "steps", **kwargs)
    assert "steps" in str(info.value) and repr(value) in str(info.value)


def test_check_positive_int_message_says_what_is_expected():
    with pytest.raises(ValueError, match="positive int or None, got 0"):
        check_positive_int(0, "every", allow_none=True)
    with pytest.raises(ValueError, match="a non-negative int, got -1"):
        check_positive_int(-1, "patience", minimum=0)


# -- the event mixins ---------------------------------------------------------------------------
def test_each_mixin_holds_its_one_event_method():
    for event, mixin in EVENTS.items():
        own = [name for name, _ in inspect.getmembers(mixin, inspect.isfunction) if not name.startswith("_")]
        assert own == [event], mixin.__name__
        assert mixin.__name__ == "".join(part.title() for part in event.split("_"))


def test_every_mixin_is_exported_and_stateless():
    assert set(mixins.__all__) == {"EVENTS", *(m.__name__ for m in EVENTS.values())}
    for mixin in EVENTS.values():
        assert not hasattr(mixin(), "__dict__") or vars(mixin()) == {}


def test_default_methods_return_none():
    assert mixins.EpochEnd().epoch_end(None) is None
    assert mixins.BatchEnd().batch_end(None, batch=None, pred=None, label=None, loss=None) is None
