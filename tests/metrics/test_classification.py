"""F1Score, Precision, Recall: equal to scikit-learn's over the same samples, fed in uneven
batches (binary, multiclass micro/macro/weighted, multi-label, one-hot targets, token tasks with
-100), resumed from a state taken mid-way, and summed over 2 gloo ranks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from estimatorch import Estimator
from estimatorch.metrics import F1Score, Precision, Recall
from tests.conftest import assert_tree_equal, ctrl_c_at

sklearn_metrics = pytest.importorskip("sklearn.metrics")

SKLEARN = {F1Score: "f1_score", Precision: "precision_score", Recall: "recall_score"}
SPLITS = (5, 1, 13, 7, 30, 4)  # 60 samples in uneven batches


def cases():
    """``(name, metric kwargs, preds, target, sklearn y_true, y_pred, sklearn kwargs)``."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(60, 4, generator=g)
    scores[:, 3] -= 2.0  # class 3 rarely predicted: zero divisions in some batches
    indices = torch.randint(0, 4, (60,), generator=g)
    out = []
    for average in ("micro", "macro", "weighted"):
        out.append((f"multiclass-{average}", {"average": average}, scores, indices, indices.numpy(),
                    scores.argmax(1).numpy(), {"average": average}))
    one_hot = torch.nn.functional.one_hot(indices, 4).float()
    out.append(("one-hot-macro", {"average": "macro"}, scores, one_hot, indices.numpy(), scores.argmax(1).numpy(),
                {"average": "macro"}))
    probs = torch.rand(60, generator=g)
    labels = torch.randint(0, 2, (60,), generator=g)
    out.append(("binary-probabilities", {}, probs, labels, labels.numpy(), (probs >= 0.5).long().numpy(), {}))
    two = torch.randn(60, 2, generator=g)
    out.append(("binary-two-scores", {"pos_label": 0}, two, labels, labels.numpy(), two.argmax(1).numpy(),
                {"pos_label": 0}))
    multi_p, multi_t = torch.rand(60, 5, generator=g), torch.randint(0, 2, (60, 5), generator=g)
    multi_t[:, 4] = 0  # a label that never occurs: zero division
    for average in ("micro", "macro", "weighted"):
        out.append((f"multilabel-{average}", {"average": average, "multilabel": True}, multi_p, multi_t,
                    multi_t.numpy(), (multi_p >= 0.5).long().numpy(), {"average": average}))
    return out


def token_case():
    """A token task: scores (N, C, T), targets (N, T) with -100 where padding is."""
    g = torch.Generator().manual_seed(1)
    scores, target = torch.randn(60, 3, 6, generator=g), torch.randint(0, 3, (60, 6), generator=g)
    target[:, 4:] = -100
    target[::3, 2:] = -100
    keep = (target != -100).numpy().reshape(-1)
    return scores, target, target.numpy().reshape(-1)[keep], scores.argmax(1).numpy().reshape(-1)[keep]


def batches(preds, target):
    start = 0
    for size in SPLITS:
        yield preds[start:start + size], target[start:start + size]
        start += size


@pytest.mark.parametrize("cls", [F1Score, Precision, Recall])
@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_equal_to_scikit_learn_across_batches(cls, case):
    _, kwargs, preds, target, y_true, y_pred, sk_kwargs = case
    metric = cls(**kwargs)
    for p, t in batches(preds, target):
        metric.update(p, t)
    expected = getattr(sklearn_metrics, SKLEARN[cls])(y_true, y_pred, zero_division=0, **sk_kwargs)
    assert metric.compute() == float(expected)


@pytest.mark.parametrize("cls", [F1Score, Precision, Recall])
@pytest.mark.parametrize("average", ["micro", "macro", "weighted"])
def test_a_token_task_skips_minus_100(cls, average):
    scores, target, y_true, y_pred = token_case()
    metric = cls(average=average)
    for p, t in batches(scores, target):
        metric.update(p, t)
    expected = getattr(sklearn_metrics, SKLEARN[cls])(y_true, y_pred, average=average, zero_division=0)
    assert metric.compute() == float(expected)


@pytest.mark.parametrize("cls", [F1Score, Precision, Recall])
def test_a_state_taken_mid_way_resumes_exactly(cls):
    """Pending updates and counts in the state: a copy loaded from it continues bit for bit."""
    _, kwargs, preds, target, *_ = cases()[1]
    whole, first = cls(**kwargs), cls(**kwargs)
    parts = list(batches(preds, target))
    for p, t in parts:
        whole.update(p, t)
    for p, t in parts[:3]:
        first.update(p, t)
    state = first.state_dict()
    resumed = cls(**kwargs)
    resumed.load_state_dict(copy.deepcopy(state))
    for p, t in parts[3:]:
        resumed.update(p, t)
    assert resumed.compute() == whole.compute()
    assert_tree_equal(resumed.state_dict(), whole.state_dict())


def test_a_fit_resumed_mid_epoch_gives_the_same_scores():
    """F1 / precision / recall as train and val metrics of a fit stopped by Ctrl-C mid-epoch
    and resumed: the history of the uninterrupted fit."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)]

    def estimator():
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        return Estimator(net, torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
                         train_metrics=[F1Score(average="macro"), Precision(average="weighted"),
                                        Recall(average="micro")])

    whole = estimator().fit(data, val_data=data[:2], epochs=2)
    est = estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(data, val_data=data[:2], epochs=2, event_handlers=[ctrl_c_at(9)])
    resumed = est.fit(data, val_data=data[:2], epochs=2, resume=True)
    assert resumed.to_dict() == whole.to_dict()
    assert "train_f1" in whole and "val_precision" in whole and not np.isnan(whole["val_recall"][-1])


def test_arguments_are_checked_naming_them():
    with pytest.raises(ValueError, match=r"average must be one of \['binary', 'micro', 'macro', 'weighted'\], "
                                         r"got 'samples'"):
        F1Score(average="samples")
    with pytest.raises(ValueError, match="average='binary' scores one class of single-label targets"):
        Precision(multilabel=True)
    with pytest.raises(ValueError, match="num_classes must be a positive int or None, got 0"):
        Recall(num_classes=0)
    metric = F1Score()
    with pytest.raises(ValueError, match=r"average='binary' scores class 1 of two, but the predictions hold 3 "
                                         r"classes; pass average='micro', 'macro' or 'weighted'"):
        metric.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="multilabel=True"):
        m = F1Score(average="macro")
        m.update(torch.rand(4, 3), torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]]))
        m.compute()  # multi-hot rows of the scores' shape, read as classes: refused, naming the fix


def test_nan_before_any_update_and_after_reset():
    metric = F1Score(average="macro")
    assert np.isnan(metric.compute())
    metric.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    metric.reset()
    assert np.isnan(metric.compute()) and metric.size == 3  # the classes are kept


def _on_two_ranks():
    from estimatorch import distributed

    rank = distributed.get_rank()
    out = {}
    for cls in (F1Score, Precision, Recall):
        for name, kwargs, preds, target, *_ in cases():
            metric = cls(**kwargs)
            half = slice(0, 25) if rank == 0 else slice(25, 60)  # uneven shares
            for p, t in batches(preds[half], target[half]):
                metric.update(p, t)
            out[f"{cls.__name__}-{name}"] = metric.compute()
        empty = cls(average="macro")  # a rank that saw nothing: the classes come from the other
        if rank == 1:
            empty.update(torch.randn(3, 4), torch.tensor([0, 3, 1]))
        out[f"{cls.__name__}-empty"] = empty.compute()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_two_gloo_ranks_give_the_value_over_every_sample():
    from estimatorch import distributed

    results = distributed.spawn(_on_two_ranks, 2, backend="gloo")
    for cls in (F1Score, Precision, Recall):
        for name, kwargs, preds, target, y_true, y_pred, sk_kwargs in cases():
            expected = float(getattr(sklearn_metrics, SKLEARN[cls])(y_true, y_pred, zero_division=0, **sk_kwargs))
            assert [r[f"{cls.__name__}-{name}"] for r in results] == [expected, expected]
        alone = cls(average="macro")
        alone.update(torch.randn(3, 4), torch.tensor([0, 3, 1]))
        assert results[0][f"{cls.__name__}-empty"] == results[1][f"{cls.__name__}-empty"]
