"""Accuracy and TopKAccuracy follow the label format (indices, one-hot, soft, binary, multi-label),
checked against a numpy reference on random data, and refuse what they cannot interpret."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from estimatorch.metrics import Accuracy, TopKAccuracy

N, C = 64, 7


def random_case(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, C, generator=g), torch.randint(0, C, (N,), generator=g), g


def value(metric, preds, target, batches=4):
    """The metric over ``batches`` updates (pending updates fold together)."""
    for p, t in zip(preds.chunk(batches), target.chunk(batches)):
        metric.update(p, t)
    return metric.compute()


def ref_accuracy(scores, classes):
    return float(np.mean(np.argmax(scores, axis=1) == classes))


def ref_top_k(scores, classes, k):
    ranked = np.argsort(-scores, axis=1)[:, :k]
    return float(np.mean([c in row for c, row in zip(classes, ranked)]))


def soft(y, g):
    """Random class probabilities whose argmax is ``y`` (a mixed or smoothed label)."""
    weights = torch.rand(len(y), C, generator=g)
    weights[torch.arange(len(y)), y] = 2.0
    return weights / weights.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("fmt", ["indices", "int32 indices", "one-hot", "float one-hot", "smoothed", "soft"])
def test_accuracy_follows_the_target_format(seed, fmt):
    preds, y, g = random_case(seed)
    target = {
        "indices": y,
        "int32 indices": y.int(),
        "one-hot": F.one_hot(y, C),  # int64, as the user passed it
        "float one-hot": F.one_hot(y, C).float(),
        "smoothed": F.one_hot(y, C).float() * 0.9 + 0.1 / C,  # label smoothing 0.1
        "soft": soft(y, g),
    }[fmt]
    expected = ref_accuracy(preds.numpy(), y.numpy())
    assert value(Accuracy(), preds, target) == pytest.approx(expected)
    for k in (1, 3):
        assert value(TopKAccuracy(k), preds, target) == pytest.approx(ref_top_k(preds.numpy(), y.numpy(), k))


def test_the_users_one_hot_case_is_no_longer_inflated():
    """The issue's repro: random predictions, one-hot labels, true accuracy about 1/C (was 0.66)."""
    preds, y, _ = random_case(10)
    got = value(Accuracy(), preds, F.one_hot(y, C), batches=1)
    assert got == pytest.approx(ref_accuracy(preds.numpy(), y.numpy()))
    assert got < 0.5


def test_segmentation_one_hot_maps():
    g = torch.Generator().manual_seed(4)
    preds, y = torch.randn(3, C, 4, 5, generator=g), torch.randint(0, C, (3, 4, 5), generator=g)
    one_hot = F.one_hot(y, C).permute(0, 3, 1, 2)  # (N, C, H, W)
    expected = float(np.mean(np.argmax(preds.numpy(), axis=1) == y.numpy()))
    assert value(Accuracy(), preds, one_hot, batches=1) == pytest.approx(expected)
    assert value(Accuracy(), preds, y, batches=1) == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(3))
def test_binary_probabilities_with_hard_and_soft_labels(seed):
    g = torch.Generator().manual_seed(seed)
    probs, y = torch.rand(N, generator=g), torch.randint(0, 2, (N,), generator=g)
    expected = float(np.mean((probs.numpy() >= 0.5) == y.numpy().astype(bool)))
    assert value(Accuracy(), probs, y) == pytest.approx(expected)
    assert value(Accuracy(), probs.unsqueeze(1), y) == pytest.approx(expected)  # (N, 1)
    smoothed = y.float() * 0.8 + 0.1  # soft binary labels: thresholded at 0.5
    assert value(Accuracy(), probs, smoothed) == pytest.approx(expected)


@pytest.mark.parametrize("seed", range(3))
def test_multilabel(seed):
    g = torch.Generator().manual_seed(seed)
    probs, labels = torch.rand(N, C, generator=g), torch.randint(0, 2, (N, C), generator=g)
    expected = float(np.mean((probs.numpy() >= 0.5) == labels.numpy().astype(bool)))
    assert value(Accuracy(multilabel=True), probs, labels) == pytest.approx(expected)
    assert value(Accuracy(multilabel=True), probs, labels.float()) == pytest.approx(expected)


def test_multi_hot_targets_without_multilabel_are_read_as_binary_labels_with_a_warning():
    g = torch.Generator().manual_seed(5)
    probs, labels = torch.rand(N, C, generator=g), torch.randint(0, 2, (N, C), generator=g)
    labels[0] = 1  # at least one row that is not one-hot
    expected = float(np.mean((probs.numpy() >= 0.5) == labels.numpy().astype(bool)))
    m = Accuracy()
    m.update(probs, labels)  # no sync here: the check is counted on the device
    with pytest.warns(UserWarning) as caught:
        assert m.compute() == pytest.approx(expected)
    message = str(caught[0].message)
    assert "accuracy" in message and "sum to 1" in message and "multilabel=True" in message
    top = TopKAccuracy(3)
    top.update(probs, labels)
    with pytest.raises(ValueError, match="top3_accuracy.*multi-label"):
        top.compute()


@pytest.mark.parametrize("seed", range(3))
def test_a_binary_mask_of_the_predictions_shape_is_compared_element_by_element(seed):
    """Binary segmentation: probabilities (N, H, W) against a 0/1 mask of that shape (axis 1 is
    not a class axis: its rows do not sum to 1)."""
    g = torch.Generator().manual_seed(seed)
    probs, mask = torch.rand(8, 5, 6, generator=g), torch.randint(0, 2, (8, 5, 6), generator=g).float()
    expected = float(np.mean((probs.numpy() >= 0.5) == (mask.numpy() >= 0.5)))
    with pytest.warns(UserWarning, match="binary labels"):
        assert value(Accuracy(), probs, mask, batches=2) == pytest.approx(expected)


@pytest.mark.parametrize("metric", [Accuracy(), TopKAccuracy(3)], ids=["accuracy", "top3"])
def test_float_class_indices_are_refused_with_long(metric):
    with pytest.raises(ValueError) as info:
        metric.update(torch.randn(4, C), torch.tensor([0.0, 1.0, 2.0, 3.0]))
    message = str(info.value)
    assert metric.name in message and "(4, 7)" in message and "(4,)" in message and ".long()" in message


@pytest.mark.parametrize("preds,target", [
    (torch.randn(4, C), torch.zeros(5, dtype=torch.long)),        # batch sizes differ
    (torch.randn(4, C), torch.zeros(4, C + 1)),                   # one-hot over another class count
    (torch.randn(4, C, 3), torch.zeros(4, 2, dtype=torch.long)),  # trailing sizes differ
    (torch.randn(4, C), torch.zeros(4, C, 2)),                    # target has more dimensions
])
def test_uninterpretable_shapes_name_metric_shapes_and_formats(preds, target):
    for metric in (Accuracy(), TopKAccuracy(2)):
        with pytest.raises(ValueError) as info:
            metric.update(preds, target)
        message = str(info.value)
        assert metric.name in message and str(tuple(preds.shape)) in message and str(tuple(target.shape)) in message
        assert "class indices" in message


def test_multilabel_refuses_index_targets():
    with pytest.raises(ValueError, match=r"accuracy: multilabel=True .*\(4, 7\).*\(4,\)"):
        Accuracy(multilabel=True).update(torch.rand(4, C), torch.zeros(4, dtype=torch.long))


def test_bad_multilabel_argument():
    with pytest.raises(ValueError, match="multilabel must be a bool, got 1"):
        Accuracy(multilabel=1)


def test_a_state_saved_before_the_normalisation_count_loads():
    m = Accuracy()
    m.update(torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([0, 1]))
    old = {k: v for k, v in m.state_dict().items() if k != "unnormalised"}
    fresh = Accuracy()
    fresh.load_state_dict(old)
    assert fresh.compute() == 0.5


def test_updates_make_no_host_transfer(monkeypatch):
    """Format checks read shapes and dtypes only: an update (and a fold) never syncs."""
    def refuse(*args, **kwargs):
        raise AssertionError("host transfer during update")

    preds, y, g = random_case(0)
    metrics = [Accuracy(), TopKAccuracy(3), Accuracy(multilabel=True)]
    targets = [soft(y, g), F.one_hot(y, C), torch.randint(0, 2, (N, C), generator=g)]
    for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    for metric, target in zip(metrics, targets):
        for _ in range(40):  # past max_pending: folds happen too
            metric.update(preds, target)
    monkeypatch.undo()
    assert all(0.0 <= m.compute() <= 1.0 for m in metrics)
