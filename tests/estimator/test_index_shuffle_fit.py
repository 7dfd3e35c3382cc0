"""``fit`` over the keyed-bijection order: a billion virtual samples trained, interrupted and
resumed bit for bit without building their permutation; the order recorded in the data
fingerprint only when it is not today's, and a resume with the other one refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from estimatorch import CheckpointHandler, Estimator
from estimatorch.data._streams import make_train_stream
from estimatorch.data._elastic import ElasticLayout
from estimatorch.samplers import AUTO_THRESHOLD, ResumableRandomSampler
from estimatorch.testing import assert_resumable
from tests.conftest import CrashAt, losses_recorder

BILLION = 10**9


class VirtualSamples(Dataset):
    """``n`` samples computed from their index, with a random augmentation (seeded per sample)."""

    def __init__(self, n: int = BILLION):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        phase = torch.arange(1, 5, dtype=torch.float32) * (index % 9973) / 9973
        return torch.sin(phase) + 0.1 * torch.randn(4), index % 3


def make_estimator() -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=3)


@pytest.fixture
def no_large_randperm(monkeypatch):
    """Fail the test if anything builds a permutation of more than the threshold's samples."""
    randperm = torch.randperm

    def guarded(n, *args, **kwargs):
        assert n <= AUTO_THRESHOLD, f"a randperm of {n} samples was built"
        return randperm(n, *args, **kwargs)

    monkeypatch.setattr(torch, "randperm", guarded)


def test_a_fit_over_a_billion_virtual_samples_resumes_bit_identically(no_large_randperm):
    def loader():
        return DataLoader(VirtualSamples(), batch_size=8, shuffle=True)

    assert make_train_stream(loader(), seed=3).fingerprint()["permutation"] == "feistel"
    assert_resumable(make_estimator, loader, batches=40, stop_at=[1, 23, 40], quiet=True)


def test_an_elastic_fit_over_a_billion_virtual_samples_resumes_bit_identically(tmp_path, no_large_randperm):
    def run(directory, crash_at=None, resume=False):
        losses, recorder = losses_recorder()
        handlers = [recorder, CheckpointHandler(directory, batch_period=5, epoch_period=None, elastic=True,
                                                resume_from_checkpoint=resume)]
        try:
            make_estimator().fit(DataLoader(VirtualSamples(), batch_size=8, shuffle=True), batches=30,
                                 event_handlers=handlers + ([CrashAt(crash_at)] if crash_at else []))
        except RuntimeError as err:
            assert f"crash at batch {crash_at}" in str(err)
        return losses

    uninterrupted = run(tmp_path / "whole")
    before = run(tmp_path / "cut", crash_at=18)
    after = run(tmp_path / "cut", resume=True)
    assert len(uninterrupted) == 30 and before == uninterrupted[:17]
    assert after == uninterrupted[15:]  # from the checkpoint of step 15


def test_a_feistel_fit_resumes_across_epoch_boundaries():
    data = TensorDataset(torch.randn(50, 4), torch.arange(50) % 3)

    def loader():
        return DataLoader(data, batch_size=8, drop_last=True,
                          sampler=ResumableRandomSampler(data, seed=3, permutation="feistel"))

    assert_resumable(make_estimator, loader, epochs=3, quiet=True)


def test_the_fingerprint_names_the_order_only_when_it_is_not_randperm():
    data = TensorDataset(torch.zeros(10, 2), torch.zeros(10))
    shuffled = make_train_stream(DataLoader(data, batch_size=4, shuffle=True), seed=0).fingerprint()
    assert shuffled == {"world_size": 1, "seed": 0, "dataset_len": 10, "batch_size": 4, "drop_last": False,
                        "sampler": "ResumableRandomSampler"}  # what checkpoints always held
    feistel = DataLoader(data, batch_size=4, sampler=ResumableRandomSampler(data, permutation="feistel"))
    assert make_train_stream(feistel, seed=0).fingerprint() == {**shuffled, "permutation": "feistel"}


@pytest.mark.parametrize("saved, now", [("feistel", "randperm"), ("randperm", "feistel")])
def test_a_resume_with_the_other_order_is_refused_before_training(tmp_path, saved, now):
    data = TensorDataset(torch.randn(24, 4), torch.arange(24) % 3)

    def loader(permutation):
        return DataLoader(data, batch_size=8, sampler=ResumableRandomSampler(data, seed=3, permutation=permutation))

    make_estimator().fit(loader(saved), epochs=1, event_handlers=[CheckpointHandler(tmp_path, epoch_period=1)])
    losses, recorder = losses_recorder()
    with pytest.raises(ValueError, match=f"written with permutation='{saved}' and this one uses "
                                         f"permutation='{now}'.*Pass permutation='{saved}' to the sampler"):
        make_estimator().fit(loader(now), epochs=2, event_handlers=[
            recorder, CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    assert losses == []


def test_elastic_slots_hold_the_same_samples_on_any_topology_of_a_global_batch():
    n = 45
    sampler = ResumableRandomSampler(n, seed=3, permutation="feistel")

    def slots(world_size, accumulation):
        layouts = [ElasticLayout(sampler.epoch_view, ["shuffled", 3], n, 4, world_size, rank, accumulation, False, 3,
                                 permutation=sampler.permutation) for rank in range(world_size)]
        return {layout.micro_batch(b): batch for layout in layouts
                for b, batch in enumerate(layout.index_batches(1, 0))}

    reference = slots(4, 1)
    assert slots(2, 2) == reference and slots(1, 4) == reference
    assert sorted(i for batch in reference.values() for i in batch) == list(range(n))
    order = sampler.epoch_indices(1).tolist()
    assert [i for m in sorted(reference) for i in reference[m]] == order
    assert ElasticLayout(sampler.epoch_view, ["shuffled", 3], n, 4, 1, 0, 1, False, 3,
                         permutation="feistel").fingerprint()["permutation"] == "feistel"
