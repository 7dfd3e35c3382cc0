"""The batch conventions: the (data, label) split, inputs given to the net, device moves and
sample counts."""

from __future__ import annotations

import collections

import pytest
import torch

from estimatorch._batches import batch_size_of, call_net, split_batch, split_inputs, to_device


def test_split_batch_conventions():
    x, y, z = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    assert split_batch((x, y)) == (x, y)
    assert split_batch([x, y]) == (x, y)
    data, label = split_batch((x, y, z))
    assert data == (x, y) and label is z
    data, label = split_batch({"a": x, "label": y})
    assert data == {"a": x} and label is y
    data, label = split_batch({"a": x, "labels": y})
    assert label is y
    with pytest.raises(ValueError, match="'label'"):
        split_batch({"a": x})
    with pytest.raises(TypeError, match="BatchProcessor"):
        split_batch(x)
    with pytest.raises(TypeError, match="length 1"):
        split_batch((x,))


def test_split_inputs_conventions():
    x, y, z = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    assert split_inputs(x) is x
    assert split_inputs((x,)) is x and split_inputs([x]) is x
    assert split_inputs((x, y)) is x  # a pair is (data, label), as in fit and evaluate
    assert split_inputs((x, y, z)) == (x, y)
    assert split_inputs(((x, y),)) == (x, y)  # two inputs without a label
    assert split_inputs({"a": x, "labels": y}) == {"a": x}
    assert split_inputs({"a": x, "b": y}) == {"a": x, "b": y}
    assert split_inputs("text") == "text"


def test_call_net_unpacks_tuples_and_dicts():
    assert call_net(lambda a, b: a + b, (1, 2)) == 3
    assert call_net(lambda a, b: a - b, {"a": 5, "b": 2}) == 3
    assert call_net(lambda a: a * 2, 4) == 8


def test_to_device_keeps_structure_and_namedtuples():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"p": Pair(torch.zeros(1), [torch.ones(1), "s"]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].y[1] == "s" and moved["n"] == 3
    assert moved["p"].x is batch["p"].x  # already there: not copied


def test_batch_size_of_reads_shapes():
    assert batch_size_of(torch.zeros(7, 3)) == 7
    assert batch_size_of(torch.zeros(3, 7), batch_axis=1) == 7
    assert batch_size_of((torch.zeros(5), torch.zeros(5))) == 5
    assert batch_size_of({"a": torch.zeros(4, 2)}) == 4
