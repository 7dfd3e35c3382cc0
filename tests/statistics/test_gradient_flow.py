"""GradientFlow: gradients at module boundaries through full backward hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.statistics import GradientFlow


class Est:
    def __init__(self, net):
        self.net = net


def test_grad_output_and_grad_input_norms():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3, requires_grad=True)
    stat = GradientFlow(["1"], period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    hidden = net[0](x)
    hidden.retain_grad()
    out = net[2](net[1](hidden))
    out.retain_grad()
    out.pow(2).sum().backward()
    stat.forward_end(None)
    assert stat.attached  # backward hooks stay until backward_end
    stat.backward_end(None)
    assert not stat.attached
    values = stat.scalars()
    assert float(values["1/grad_input_norm"]) == pytest.approx(hidden.grad.norm().item(), rel=1e-6)
    tanh_out_grad = (out.grad @ net[2].weight)
    assert float(values["1/grad_output_norm"]) == pytest.approx(tanh_out_grad.norm().item(), rel=1e-6)
