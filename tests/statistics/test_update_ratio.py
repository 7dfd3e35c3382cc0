"""UpdateToWeightRatio: ||dW|| / ||W|| around the optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.statistics import UpdateToWeightRatio


class Est:
    def __init__(self, net):
        self.net = net


def test_ratio_of_the_update_to_the_weights_before_it():
    net = nn.Linear(2, 1)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    stat = UpdateToWeightRatio(period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    with torch.no_grad():
        net.weight.mul_(1.5)
    stat.batch_end(None)
    values = stat.scalars()
    assert float(values["weight"]) == pytest.approx(0.5, rel=1e-6)
    assert float(values["bias"]) == 0.0
    assert torch.equal(before["bias"], net.bias.detach())


def test_without_a_snapshot_nothing_is_measured():
    stat = UpdateToWeightRatio(period=1)
    stat.setup(Est(nn.Linear(2, 1)))
    stat.batch_end(None)
    assert stat.scalars() == {} and "batch_begin" in stat.events
