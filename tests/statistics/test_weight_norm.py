"""WeightNorm: each parameter's 2-norm."""

from __future__ import annotations

import torch
from torch import nn

from estimatorch.statistics import WeightNorm


class Est:
    def __init__(self, net):
        self.net = net


def test_norm_of_each_named_parameter():
    net = nn.Linear(3, 2)
    stat = WeightNorm(["weight"], period=1)
    stat.setup(Est(net))
    stat.batch_end(None)
    values = stat.scalars()
    assert list(values) == ["weight"] and torch.equal(values["weight"], net.weight.detach().norm())


def test_every_trainable_parameter_by_default():
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    stat = WeightNorm(period=1)
    stat.setup(Est(net))
    stat.batch_end(None)
    assert sorted(stat.scalars()) == sorted(n for n, _ in net.named_parameters())
    stat.reset()
    assert stat.scalars() == {}
