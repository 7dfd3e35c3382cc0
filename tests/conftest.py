"""Shared fixtures: tiny models and data that train in milliseconds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch import Estimator


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_batches(n_batches: int = 4, batch_size: int = 8, features: int = 4, classes: int = 3, seed: int = 0):
    """A list of (data, label) batches with a learnable rule."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch_size, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    y = y.clamp(max=classes - 1)
    return list(zip(x.split(batch_size), y.split(batch_size)))


def make_estimator(features: int = 4, classes: int = 3, lr: float = 0.1, **kwargs) -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, classes))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=lr), **kwargs)


@pytest.fixture
def batches():
    return make_batches()


@pytest.fixture
def estimator():
    return make_estimator()
