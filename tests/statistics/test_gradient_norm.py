"""GradientNorm: each gradient's 2-norm and their total."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.statistics import GradientNorm


class Est:
    def __init__(self, net):
        self.net = net


def test_per_parameter_and_total_norms_skip_missing_gradients():
    net = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    net(torch.randn(4, 3)).sum().backward()
    net[1].bias.grad = None
    stat = GradientNorm(period=1)
    stat.setup(Est(net))
    stat.backward_end(None)
    values = {k: float(v) for k, v in stat.scalars().items()}
    grads = {n: p.grad.norm().item() for n, p in net.named_parameters() if p.grad is not None}
    assert set(values) == set(grads) | {"total"}
    assert values["total"] == pytest.approx(sum(g ** 2 for g in grads.values()) ** 0.5, rel=1e-6)


def test_no_gradient_no_values():
    stat = GradientNorm(period=1)
    stat.setup(Est(nn.Linear(2, 1)))
    stat.backward_end(None)
    assert stat.scalars() == {} and stat.events == frozenset({"backward_end"})
