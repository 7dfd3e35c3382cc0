"""EpochGradientNorm: mean and max of the total gradient norm, accumulated on the device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from estimatorch.statistics import EpochGradientNorm


class Est:
    def __init__(self, net):
        self.net = net


def step(stat, net, grad):
    net.weight.grad = torch.tensor([grad])
    stat.backward_end(None)


def test_mean_and_max_over_the_epoch():
    net = nn.Linear(2, 1, bias=False)
    stat = EpochGradientNorm()
    stat.setup(Est(net))
    assert all(math.isnan(v) for v in stat.scalars().values())
    for g in ([3.0, 4.0], [0.0, 1.0], [6.0, 8.0]):
        step(stat, net, g)
    assert {k: float(v) for k, v in stat.scalars().items()} == {"mean": pytest.approx(16 / 3), "max": 10.0}
    stat.epoch_begin(None)
    assert stat.count == 0


def test_the_accumulators_are_the_state():
    net = nn.Linear(2, 1, bias=False)
    stat = EpochGradientNorm()
    stat.setup(Est(net))
    step(stat, net, [3.0, 4.0])
    state = stat.state_dict()
    step(stat, net, [30.0, 40.0])  # the saved state is a copy
    resumed = EpochGradientNorm()
    resumed.setup(Est(net))
    resumed.load_state_dict(state)
    step(resumed, net, [6.0, 8.0])
    assert {k: float(v) for k, v in resumed.scalars().items()} == {"mean": 7.5, "max": 10.0}
    with pytest.raises(ValueError, match="count"):
        resumed.load_state_dict({"total": None, "max": None})
