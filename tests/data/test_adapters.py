"""The adapter registry: the built-ins registered through the public call, a third party's adapter
tried before them, one passing the data on, and bad registrations refused naming the value."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from estimatorch.data import DataSource, TrainStream, open_stream, register_adapter, registered_adapters, \
    unregister_adapter
from tests.conftest import make_batches


class _Doubled(TrainStream):
    kind = "a list of batches, each twice"

    def __init__(self, batches: list[Any], seed: int):
        super().__init__(seed)
        self.batches = batches
        self.batches_per_epoch = 2 * len(batches)

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        return itertools.islice((b for b in self.batches for _ in range(2)), start, None)


class Doubler:
    """Takes lists of batches over from the built-in ``sequence`` adapter."""

    name = "test-doubler"

    def recognises(self, source: DataSource) -> bool:
        return isinstance(source.data, list)

    def open(self, source: DataSource) -> TrainStream:
        return _Doubled(source.data, source.seed)


class Watcher:
    """Sees every loader, opens none itself: passes it on."""

    name = "test-watcher"

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def recognises(self, source: DataSource) -> bool:
        return source.loader is not None

    def open(self, source: DataSource) -> TrainStream:
        self.seen.append(source.loader)
        return source.pass_on(self)


@pytest.fixture
def registered():
    """Adapters registered in a test, unregistered after it."""
    names: list[str] = []

    def register(adapter: Any, **kwargs: Any) -> Any:
        register_adapter(adapter, **kwargs)
        names.append(adapter.name)
        return adapter

    yield register
    for name in names:
        unregister_adapter(name)


def test_the_built_in_adapters_are_registered_in_their_order():
    assert registered_adapters() == [("torchdata", 100), ("hf-iterable", 200), ("mosaic", 210),
                                     ("stateful-iterable", 300), ("map-loader", 400), ("sequence", 500),
                                     ("replay", 1000)]


def test_a_third_party_adapter_comes_before_the_built_ins_and_fit_trains_on_its_stream(registered):
    batches = make_batches(3)
    assert open_stream(batches, 0).batches_per_epoch == 3  # the built-in sequence
    registered(Doubler())
    stream = open_stream(batches, 0)
    assert type(stream) is _Doubled and stream.batches_per_epoch == 6
    assert [b[0] for b in stream.epoch_iter(0, 5)] == [batches[2][0]]


def test_an_adapter_that_passes_the_data_on_leaves_it_to_the_next(registered):
    watcher = registered(Watcher())
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    stream = open_stream(loader, 0)
    assert watcher.seen == [loader] and stream.batches_per_epoch == 4 and stream.exact


def test_equal_priorities_keep_the_order_of_registration(registered):
    first, second = Doubler(), Doubler()
    second.name = "test-doubler-2"
    registered(first, priority=5)
    registered(second, priority=5)
    names = [name for name, _ in registered_adapters()]
    assert names.index("test-doubler") < names.index("test-doubler-2") < names.index("torchdata")


@pytest.mark.parametrize("adapter, kwargs, error, words", [
    (object(), {}, TypeError, "adapter must have a non-empty str name"),
    (Doubler(), {"priority": "high"}, ValueError, "priority must be a number, got 'high'"),
    (type("Nameless", (Doubler,), {"name": ""})(), {}, TypeError, "non-empty str name"),
], ids=["not-an-adapter", "bad-priority", "empty-name"])
def test_a_bad_registration_is_refused_naming_the_value(adapter, kwargs, error, words):
    with pytest.raises(error, match=words):
        register_adapter(adapter, **kwargs)
    assert "test-doubler" not in [name for name, _ in registered_adapters()]


def test_a_second_adapter_of_a_name_is_refused_and_unknown_names_are_named(registered):
    registered(Doubler())
    with pytest.raises(ValueError, match="an adapter named 'test-doubler' is registered already"):
        register_adapter(Doubler())
    with pytest.raises(KeyError, match="no adapter named 'nothing'"):
        unregister_adapter("nothing")


def test_an_adapter_that_opens_something_else_than_a_stream_is_named(registered):
    class Wrong(Doubler):
        name = "test-wrong"

        def open(self, source: DataSource) -> Any:
            return iter(source.data)

    registered(Wrong())
    with pytest.raises(TypeError, match="data adapter 'test-wrong' opened list_iterator, not an estimatorch.data"):
        open_stream(make_batches(2), 0)


def test_elastic_steps_are_checked_and_a_kind_that_cannot_be_laid_out_says_what_it_is():
    with pytest.raises(ValueError, match="elastic_steps must be a positive int or None, got 0"):
        open_stream(make_batches(2), 0, elastic_steps=0)
    with pytest.raises(ValueError, match="got train_data that is a list or tuple of batches"):
        open_stream(make_batches(2), 0, elastic_steps=1)
