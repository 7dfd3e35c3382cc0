"""Accuracy and TopKAccuracy on logits, segmentation maps, binary probabilities and indices."""

from __future__ import annotations

import math

import pytest
import torch

from estimatorch.metrics import Accuracy, TopKAccuracy


def acc(preds, target, **kwargs):
    m = Accuracy(**kwargs)
    m.update(preds, target)
    return m.compute()


# -- Accuracy -----------------------------------------------------------------------------------
def test_logits():
    preds = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 1.0, 5.0], [4.0, 0.0, 0.0]])
    # argmax: 0, 1, 2, 0
    assert acc(preds, torch.tensor([0, 1, 1, 1])) == 2 / 4


def test_segmentation_maps():
    g = torch.Generator().manual_seed(0)
    preds = torch.randn(2, 4, 3, 5, generator=g)  # (N, C, H, W)
    target = torch.randint(0, 4, (2, 3, 5), generator=g)
    by_hand = sum(int(preds[n, :, h, w].argmax() == target[n, h, w])
                  for n in range(2) for h in range(3) for w in range(5)) / (2 * 3 * 5)
    assert acc(preds, target) == pytest.approx(by_hand)


def test_binary_probabilities():
    probs = torch.tensor([0.9, 0.2, 0.6, 0.4, 0.5])
    target = torch.tensor([1, 0, 0, 1, 1])
    # thresholded at 0.5 (inclusive): 1, 0, 1, 0, 1 -> right, right, wrong, wrong, right
    assert acc(probs, target) == 3 / 5
    assert acc(probs, target.float()) == 3 / 5
    # threshold 0.55: 1, 0, 1, 0, 0
    assert acc(probs, target, threshold=0.55) == 2 / 5


def test_single_column_probabilities_are_binary():
    probs = torch.tensor([[0.9], [0.2], [0.7], [0.1]])
    target = torch.tensor([1, 0, 0, 0])
    # an argmax over one column would always say class 0 (3/4 here)
    assert acc(probs, target) == 3 / 4
    assert acc(probs, torch.tensor([1, 0, 1, 0])) == 1.0


def test_class_indices():
    assert acc(torch.tensor([0, 2, 1, 1]), torch.tensor([0, 1, 1, 0])) == 2 / 4


def test_accumulates_over_updates():
    m = Accuracy()
    m.update(torch.tensor([[1.0, 0.0]] * 3), torch.tensor([0, 0, 1]))  # 2 of 3
    m.update(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))  # 1 of 1
    assert m.compute() == 3 / 4


def test_shape_mismatch():
    with pytest.raises(ValueError) as info:
        acc(torch.randn(4, 3), torch.zeros(5, 2, dtype=torch.long))
    assert "(4, 3)" in str(info.value) and "(5, 2)" in str(info.value)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, "0.5", True])
def test_bad_threshold(bad):
    with pytest.raises(ValueError) as info:
        Accuracy(threshold=bad)
    assert "threshold" in str(info.value) and repr(bad) in str(info.value)


def test_nan_before_update():
    assert math.isnan(Accuracy().compute())


def test_state_round_trip():
    m = Accuracy()
    m.update(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    fresh = Accuracy()
    fresh.load_state_dict(m.state_dict())
    assert fresh.compute() == 0.5
    with pytest.raises(ValueError, match="'correct'"):
        fresh.load_state_dict({"count": 2})


# -- TopKAccuracy -------------------------------------------------------------------------------
def topk(k, preds, target):
    m = TopKAccuracy(top_k=k)
    m.update(preds, target)
    return m.compute()


def test_top_k():
    preds = torch.tensor([[0.1, 0.5, 0.3, 0.05, 0.02],
                          [0.6, 0.1, 0.15, 0.08, 0.07],
                          [0.2, 0.25, 0.1, 0.4, 0.05]])
    target = torch.tensor([2, 1, 4])
    # the targets rank 2nd, 3rd and 5th in their rows
    ranks = [2, 3, 5]
    for k in range(1, 6):
        assert topk(k, preds, target) == pytest.approx(sum(r <= k for r in ranks) / 3), k


def test_top_1_equals_accuracy():
    g = torch.Generator().manual_seed(2)
    preds, target = torch.randn(20, 6, generator=g), torch.randint(0, 6, (20,), generator=g)
    assert topk(1, preds, target) == acc(preds, target)


def test_k_larger_than_the_classes_counts_everything():
    assert topk(10, torch.randn(4, 3), torch.tensor([0, 1, 2, 0])) == 1.0


def test_top_k_segmentation():
    g = torch.Generator().manual_seed(3)
    preds = torch.randn(2, 5, 3, 3, generator=g)
    target = torch.randint(0, 5, (2, 3, 3), generator=g)
    by_hand = sum(int(target[n, h, w] in preds[n, :, h, w].topk(2).indices)
                  for n in range(2) for h in range(3) for w in range(3)) / 18
    assert topk(2, preds, target) == pytest.approx(by_hand)


def test_top_k_needs_a_class_dimension():
    with pytest.raises(ValueError, match="top3_accuracy"):
        topk(3, torch.randn(4), torch.zeros(4, dtype=torch.long))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_top_k(bad):
    with pytest.raises(ValueError) as info:
        TopKAccuracy(top_k=bad)
    assert "top_k" in str(info.value) and repr(bad) in str(info.value)


def test_top_k_names():
    assert TopKAccuracy().name == "top5_accuracy"
    assert TopKAccuracy(3, "best3").name == "best3"


def test_a_pending_view_counts_the_storage_it_keeps_alive():
    """Last-token logits are a view of every token's: keeping it pending keeps them all, so the
    pending cap counts the storage (here it folds at once instead of holding 32 of them)."""
    m = Accuracy()
    for _ in range(3):
        logits = torch.randn(8, 512, 1000)
        m.update(logits[:, -1], torch.randint(0, 1000, (8,)))
        assert m._pending == []


@pytest.mark.parametrize("cls", [Accuracy, TopKAccuracy])
def test_a_state_saved_before_the_newer_accumulators_passes_the_checkpoint_check_and_loads(cls):
    """A checkpoint's Accuracy state from before ``ignored`` (ignore_index) and ``unnormalised``
    existed: the resume's check fills them from :meth:`upgrade_state` instead of refusing the file."""
    from estimatorch.estimator._state.run import _check_metrics

    metric = cls()
    metric.update(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]]), torch.tensor([0, 1, 1]))
    old = {k: v for k, v in metric.state_dict().items() if k not in ("ignored", "unnormalised")}
    _check_metrics({metric.name: old}, [metric])  # raised "lacks 'ignored'" before
    fresh = cls()
    fresh.load_state_dict(old)
    assert fresh.compute() == metric.compute()
