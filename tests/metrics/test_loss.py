"""Loss: the running mean of a loss over samples."""

from __future__ import annotations

import math

import pytest
import torch

from estimatorch.metrics import Loss


def test_scalar_losses_are_weighted_by_batch_size():
    m = Loss()
    m.update(torch.tensor(1.0), torch.zeros(6))
    m.update(torch.tensor(4.0), torch.zeros(2))
    # 6 samples at 1.0 and 2 at 4.0; the mean over batches would be 2.5
    assert m.compute() == pytest.approx((6 * 1.0 + 2 * 4.0) / 8)


def test_batch_size_is_the_targets_first_dimension():
    m = Loss()
    m.update(torch.tensor(2.0), torch.zeros(3, 5))  # e.g. 3 sequences of 5 tokens
    m.update(torch.tensor(6.0), torch.zeros(1, 5))
    assert m.compute() == pytest.approx((3 * 2.0 + 1 * 6.0) / 4)


def test_scalar_loss_without_a_batch_counts_once():
    m = Loss()
    m.update(torch.tensor(3.0))
    m.update(torch.tensor(5.0), torch.tensor(1))  # a 0-dim target: one sample
    assert m.compute() == 4.0
    assert m.count == 2


def test_per_sample_losses_are_averaged_over_all_samples():
    m = Loss()
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0])
    m.update(a, torch.zeros(3))
    m.update(b, torch.zeros(1))
    assert m.compute() == pytest.approx((1 + 2 + 3 + 10) / 4)


def test_mixed_scalar_and_per_sample():
    m = Loss()
    m.update(torch.tensor(2.0), torch.zeros(4))
    m.update(torch.tensor([5.0, 7.0]), torch.zeros(2))
    assert m.compute() == pytest.approx((4 * 2.0 + 5 + 7) / 6)


def test_matches_cross_entropy_over_the_whole_set():
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(10, 4, generator=g), torch.randint(0, 4, (10,), generator=g)
    m = Loss()
    for lo, la in zip(logits.split(3), labels.split(3)):  # batches 3, 3, 3, 1
        m.update(torch.nn.functional.cross_entropy(lo, la), la)
    assert m.compute() == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)), rel=1e-6)


def test_accumulates_in_float64_without_keeping_the_graph():
    m = Loss()
    w = torch.tensor(1.0, requires_grad=True)
    m.update(w * 3, torch.zeros(2))
    assert m.total.dtype == torch.float64 and not m.total.requires_grad
    m.update(torch.tensor(1.0, dtype=torch.float16), torch.zeros(2))
    assert m.compute() == 2.0


def test_reset_and_nan():
    m = Loss()
    assert math.isnan(m.compute())
    m.update(torch.tensor(1.0), torch.zeros(2))
    m.reset()
    assert math.isnan(m.compute()) and m.count == 0


def test_state_round_trip():
    m = Loss("train_loss")
    m.update(torch.tensor(1.5), torch.zeros(4))
    state = m.state_dict()
    assert set(state) == {"total", "count", "pending"} and state["count"] == 4 and len(state["pending"]) == 1
    fresh = Loss()
    fresh.load_state_dict(state)
    assert fresh.compute() == 1.5
    del state["count"]
    with pytest.raises(ValueError, match="'count'"):
        fresh.load_state_dict(state)


def test_direction_and_name():
    assert Loss().higher_is_better is False
    assert Loss().name == "loss" and Loss("val_loss").name == "val_loss"
