"""ActivationStatistics: module outputs through forward hooks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.statistics import ActivationStatistics


class Est:
    def __init__(self, net):
        self.net = net


def test_norm_mean_std_and_histogram_of_the_output():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    x = torch.randn(5, 3)
    stat = ActivationStatistics(["1"], histograms=True, period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    net(x)
    stat.forward_end(None)
    out = torch.tanh(net[0](x)).detach()
    values = stat.scalars()
    assert float(values["1/norm"]) == pytest.approx(out.norm().item(), rel=1e-6)
    assert float(values["1/mean"]) == pytest.approx(out.mean().item(), rel=1e-6, abs=1e-7)
    assert float(values["1/std"]) == pytest.approx(out.std().item(), rel=1e-6)
    assert torch.allclose(stat.histograms()["1"], out)
    assert not stat.attached


def test_non_tensor_outputs_are_skipped_and_tuples_use_their_first_tensor():
    class Pair(nn.Module):
        def forward(self, x):
            return ("label", x * 2)

    class Ints(nn.Module):
        def forward(self, x):
            return x.long()

    net = nn.Sequential(Pair(), Ints())
    stat = ActivationStatistics(["0", "1"], period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    net[0](torch.ones(2))
    net[1](torch.ones(2))
    assert {k: float(v) for k, v in stat.scalars().items() if k.endswith("norm")} == {"0/norm": pytest.approx(8 ** 0.5)}


def test_histograms_is_a_bool():
    with pytest.raises(TypeError, match="histograms"):
        ActivationStatistics(histograms="yes")
