"""Perplexity: exp of the mean cross-entropy per token, every token weighing the same, labels of
ignore_index skipped; and Accuracy's ignore_index."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional

from estimatorch.metrics import Accuracy, Perplexity


def test_perplexity_weighs_every_token_the_same_across_batches():
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 5, 7, generator=g), torch.randn(3, 5, 2, generator=g)]  # (N, C, T)
    labels = [torch.randint(0, 5, (2, 7), generator=g), torch.randint(0, 5, (3, 2), generator=g)]
    labels[0][0, :3] = -100
    metric = Perplexity()
    for s, y in zip(scores, labels):
        metric.update(s, y)
    total = sum(functional.cross_entropy(s, y, reduction="sum") for s, y in zip(scores, labels))
    tokens = sum(int((y != -100).sum()) for y in labels)
    assert metric.compute() == pytest.approx(math.exp(float(total) / tokens), rel=1e-6)
    mean_of_batches = sum(math.exp(float(functional.cross_entropy(s, y))) for s, y in zip(scores, labels)) / 2
    assert metric.compute() != pytest.approx(mean_of_batches, rel=1e-3)


def test_perplexity_state_round_trips():
    metric = Perplexity()
    metric.update(torch.randn(2, 4, 3), torch.randint(0, 4, (2, 3)))
    other = Perplexity()
    other.load_state_dict(metric.state_dict())
    assert other.compute() == metric.compute()


@pytest.mark.parametrize("preds, target, match", [
    (torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long), "class indices of shape"),
    (torch.zeros(2, 3, 5), torch.zeros(2, 5), "class indices must be integers"),
])
def test_perplexity_names_what_it_cannot_read(preds, target, match):
    with pytest.raises(ValueError, match=match):
        Perplexity().update(preds, target)


def test_accuracy_skips_ignore_index_targets():
    preds = torch.tensor([[[2.0, 0.0], [0.0, 2.0]], [[2.0, 2.0], [0.0, 0.0]]]).transpose(1, 2)  # (N=2, C=2, T=2)
    target = torch.tensor([[0, -100], [-100, -100]])
    metric = Accuracy()
    metric.update(preds, target)
    assert metric.compute() == 1.0
    unmasked = Accuracy(ignore_index=None)
    unmasked.update(preds, target.clamp(min=0))
    assert unmasked.compute() == 0.75


def test_an_accuracy_state_saved_before_ignore_index_loads():
    metric = Accuracy()
    metric.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    state = metric.state_dict()
    state.pop("ignored", None)
    other = Accuracy()
    other.load_state_dict(state)
    assert other.compute() == 1.0
