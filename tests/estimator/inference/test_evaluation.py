"""The loop evaluate and predict share: arguments checked at the door, emptiness agreed across
ranks for data each rank holds, companions shown this rank's batches (ranks simulated)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from estimatorch import CheckpointHandler, distributed
from estimatorch.estimator._inference.evaluation import run_batches
from estimatorch.event_handlers import BatchEnd, EpochBegin, EpochEnd
from tests.conftest import CrashAt, make_batches, make_estimator


class Events(EpochBegin, BatchEnd, EpochEnd):
    def __init__(self):
        self.events = []

    def epoch_begin(self, est, **kw):
        self.events.append("epoch_begin")

    def batch_end(self, est, **kw):
        self.events.append("batch_end")

    def epoch_end(self, est, **kw):
        self.events.append("epoch_end")


@pytest.mark.parametrize("val_data, error, match", [
    (torch.zeros(4, 4), TypeError, r"val_data must be an iterable of batches .*got Tensor; for one tensor x pass \[x\]"),
    ([], ValueError, "val_data is empty: a list of length 0"),
    (DataLoader(TensorDataset(torch.zeros(1, 4)), batch_size=2, drop_last=True), ValueError,
     "val_data is empty: a DataLoader of length 0"),
])
def test_evaluate_refuses_bad_data_before_any_event(val_data, error, match):
    est, events = make_estimator(), Events()
    with pytest.raises(error, match=match):
        est.evaluate(val_data, event_handlers=[events])
    assert events.events == []


def test_evaluate_of_an_iterable_that_yields_nothing_fires_no_epoch_end():
    est, events = make_estimator(), Events()
    with pytest.raises(ValueError, match="val_data yielded no batches"):
        est.evaluate(iter([]), event_handlers=[events])
    assert events.events == ["epoch_begin"]


class Stub:
    """What the loop reads of an estimator."""

    def __init__(self, handlers=()):
        self.val_net = nn.Identity()
        self.device = torch.device("cpu")
        self.seed = 0
        self.handlers = tuple(handlers)


def simulate_rank(monkeypatch, rank, world, seen_by_rank=None):
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(distributed, "get_world_size", lambda: world)
    monkeypatch.setattr(distributed, "gather_objects", lambda obj: seen_by_rank)


def step(batch):
    return batch, None, None


def test_a_rank_without_batches_of_its_own_is_fine_when_another_rank_has_some(monkeypatch):
    simulate_rank(monkeypatch, 1, 2, seen_by_rank=[3, 0])
    events = Events()
    run_batches(Stub(), [], "val_data", [events], step, agree_on_empty=True)
    assert events.events == ["epoch_begin", "epoch_end"]


def test_no_batches_on_any_rank_is_an_error_on_every_rank(monkeypatch):
    for rank in range(2):
        simulate_rank(monkeypatch, rank, 2, seen_by_rank=[0, 0])
        with pytest.raises(ValueError, match="val_data yielded no batches"):
            run_batches(Stub(), [], "val_data", [], step, agree_on_empty=True)


def test_without_agreement_an_empty_rank_raises_alone(monkeypatch):
    simulate_rank(monkeypatch, 1, 2, seen_by_rank=None)  # gather_objects must not be called
    with pytest.raises(ValueError, match="data yielded no batches"):
        run_batches(Stub(), [], "data", [], step, agree_on_empty=False)


def test_companions_see_this_ranks_share_of_a_split_loader(monkeypatch):
    simulate_rank(monkeypatch, 1, 3)
    seen = []

    class Owner(EpochEnd):
        def evaluation_handlers(self, batches):
            seen.append(len(batches))
            return [companion]

        def epoch_end(self, est, **kw):
            pass

    companion = Events()
    data = TensorDataset(torch.arange(7.0).unsqueeze(1))
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 3, 1, shuffle=False))
    shard = run_batches(Stub([Owner()]), loader, "val_data", [], step, agree_on_empty=True)
    assert len(loader) == 2 and shard.total == 4
    assert shard.split and seen == [1]  # batch 1 of the 4 one process sees
    assert companion.events == ["epoch_begin", "batch_end", "epoch_end"]


def test_evaluate_values_are_unchanged_in_one_process():
    """The refactor into the shared loop keeps evaluate's values and events."""
    est, events = make_estimator(), Events()
    data = make_batches(n_batches=3)
    scores = est.evaluate(data, event_handlers=[events])
    with torch.no_grad():
        x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        logits = est.net(x)
    assert scores["val_loss"] == pytest.approx(float(nn.CrossEntropyLoss()(logits, y)), rel=1e-6)
    assert scores["val_accuracy"] == float((logits.argmax(1) == y).double().mean())
    assert events.events == ["epoch_begin"] + ["batch_end"] * 3 + ["epoch_end"]


class NoisyValidation(torch.utils.data.Dataset):
    """Validation samples with noise drawn from numpy's legacy global generator."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((4,), float(i % 5)) + torch.from_numpy(np.random.rand(4)).float(), i % 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_validation_drawing_from_np_random_gives_the_same_val_loss_after_a_resume(tmp_path, num_workers):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    train = DataLoader(TensorDataset(x, torch.arange(16) % 3), batch_size=4, shuffle=True)
    val = DataLoader(NoisyValidation(), batch_size=8, num_workers=num_workers)
    np.random.seed(1)
    full = make_estimator().fit(train, val_data=val, epochs=3)
    with pytest.raises(RuntimeError, match="crash at batch 7"):
        make_estimator().fit(train, val_data=val, epochs=3, event_handlers=[
            CheckpointHandler(tmp_path, batch_period=1, epoch_period=None), CrashAt(7)])
    np.random.seed(2)  # another process: numpy's global state is whatever it is
    resumed = make_estimator().fit(train, val_data=val, epochs=3, event_handlers=[
        CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, resume_from_checkpoint=True)])
    assert resumed["val_loss"] == full["val_loss"]
    assert resumed["train_loss"] == full["train_loss"]
    scores = [make_estimator().evaluate(val)["val_loss"] for _ in range(2)]
    assert scores[0] == scores[1]  # evaluating is a function of the samples, not of when it runs
