"""MeanSquaredError and MeanAbsoluteError, with (N, 1) vs (N,) alignment."""

from __future__ import annotations

import math

import pytest
import torch

from estimatorch.metrics import MeanAbsoluteError, MeanSquaredError

PREDS = torch.tensor([1.0, 2.0, 4.0, -1.0])
TARGET = torch.tensor([1.5, 2.0, 1.0, 1.0])
# differences: -0.5, 0, 3, -2
MSE = (0.25 + 0 + 9 + 4) / 4
MAE = (0.5 + 0 + 3 + 2) / 4


def value(cls, preds, target):
    m = cls()
    m.update(preds, target)
    return m.compute()


@pytest.mark.parametrize("cls, expected", [(MeanSquaredError, MSE), (MeanAbsoluteError, MAE)])
def test_values(cls, expected):
    assert value(cls, PREDS, TARGET) == pytest.approx(expected)


@pytest.mark.parametrize("cls, expected", [(MeanSquaredError, MSE), (MeanAbsoluteError, MAE)])
def test_column_predictions_align_with_a_flat_target(cls, expected):
    # (N, 1) - (N,) would broadcast to (N, N) without the alignment
    assert value(cls, PREDS[:, None], TARGET) == pytest.approx(expected)
    assert value(cls, PREDS, TARGET[:, None]) == pytest.approx(expected)


@pytest.mark.parametrize("cls", [MeanSquaredError, MeanAbsoluteError])
def test_accumulates_over_elements_of_all_updates(cls):
    m = cls()
    m.update(PREDS[:1], TARGET[:1])
    m.update(PREDS[1:].reshape(3, 1), TARGET[1:])
    assert m.compute() == pytest.approx(value(cls, PREDS, TARGET))


def test_multi_output_averages_every_element():
    preds = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    target = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert value(MeanSquaredError, preds, target) == pytest.approx((1 + 0 + 4 + 9) / 4)


@pytest.mark.parametrize("cls", [MeanSquaredError, MeanAbsoluteError])
@pytest.mark.parametrize("preds_shape, target_shape", [((4,), (5,)), ((2, 3), (3, 2)), ((4, 2), (4,))])
def test_shape_mismatch(cls, preds_shape, target_shape):
    with pytest.raises(ValueError) as info:
        value(cls, torch.zeros(preds_shape), torch.zeros(target_shape))
    assert str(tuple(preds_shape)) in str(info.value) and str(tuple(target_shape)) in str(info.value)


@pytest.mark.parametrize("cls", [MeanSquaredError, MeanAbsoluteError])
def test_reset_nan_and_state(cls):
    m = cls()
    assert math.isnan(m.compute())
    m.update(PREDS, TARGET)
    fresh = cls()
    fresh.load_state_dict(m.state_dict())
    assert fresh.compute() == m.compute()
    m.reset()
    assert math.isnan(m.compute())
    with pytest.raises(ValueError, match="'total'"):
        fresh.load_state_dict({"count": 1})


def test_integer_targets():
    assert value(MeanAbsoluteError, torch.tensor([0.5, 2.0]), torch.tensor([1, 2])) == pytest.approx(0.25)


def test_names_and_direction():
    assert (MeanSquaredError().name, MeanAbsoluteError().name) == ("mse", "mae")
    assert not MeanSquaredError().higher_is_better and not MeanAbsoluteError().higher_is_better
