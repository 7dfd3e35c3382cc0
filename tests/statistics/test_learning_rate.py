"""LearningRate: each param group's rate."""

from __future__ import annotations

import torch

from estimatorch.statistics import LearningRate


class Est:
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_one_value_per_param_group_read_at_batch_end():
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.3}])
    stat = LearningRate(period=1)
    stat.setup(Est(opt))
    assert stat.scalars() == {}
    stat.batch_end(None)
    opt.param_groups[0]["lr"] = 0.05  # a later change is not seen until the next firing step
    assert stat.scalars() == {"group0": 0.1, "group1": 0.3}
    stat.reset()
    assert stat.scalars() == {}


def test_a_tensor_learning_rate_stays_a_tensor_until_written():
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    stat = LearningRate(period=1)
    stat.setup(Est(opt))
    stat.batch_end(None)
    value = stat.scalars()["group0"]
    assert isinstance(value, torch.Tensor) and torch.equal(value, torch.tensor(0.01))
