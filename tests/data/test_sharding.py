"""Sharding for evaluate and predict, with the ranks simulated in one process: every rank's
rebuilt loader, merged back in rank order, is the sequence of batches one process would see."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, TensorDataset

from estimatorch import distributed
from estimatorch.data import _sharding
from estimatorch.data._sharding import for_inference
from estimatorch.samplers import DistributedSampler as ComposableDistributedSampler
from estimatorch.samplers import ResumableDistributedSampler

N = 7  # does not divide by 2 or 3 ranks, nor by the batch size


def indexed(n=N):
    """Samples whose value is their index, so batches show which samples they hold."""
    return TensorDataset(torch.arange(n))


def as_rank(monkeypatch, rank, world, broadcast=None):
    monkeypatch.setattr(distributed, "is_distributed", lambda: world > 1)
    monkeypatch.setattr(distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(distributed, "get_world_size", lambda: world)
    monkeypatch.setattr(distributed, "broadcast_object", broadcast or (lambda obj, src=0: obj))


def batches_of(loader):
    return [b[0].tolist() if isinstance(b, list) else b.tolist() for b in loader]


def merged(monkeypatch, make_loader, world):
    """Each simulated rank's batches, merged back into the global order."""
    per_rank, shard = [], None
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        shard = for_inference(make_loader(rank, world), "val_data")
        assert shard.split and shard.rank == rank and shard.world == world
        per_rank.append(batches_of(shard.batches))
    assert [len(b) for b in per_rank] == [len(range(r, shard.total, world)) for r in range(world)]
    return shard.merge(per_rank)


def one_process(make_loader):
    """The batches of the same loader built for a world of one."""
    return batches_of(make_loader(0, 1))


LOADERS = {
    "sequential": lambda r, w, bs=2, dl=False: DataLoader(indexed(), batch_size=bs, drop_last=dl),
    "torch-distributed": lambda r, w, bs=2, dl=False: DataLoader(
        indexed(), batch_size=bs, drop_last=dl, sampler=DistributedSampler(indexed(), w, r, shuffle=False)),
    "torch-distributed-shuffled": lambda r, w, bs=2, dl=False: DataLoader(
        indexed(), batch_size=bs, drop_last=dl, sampler=DistributedSampler(indexed(), w, r, shuffle=True, seed=3)),
    "resumable-distributed": lambda r, w, bs=2, dl=False: DataLoader(
        indexed(), batch_size=bs, drop_last=dl, sampler=ResumableDistributedSampler(N, w, r, seed=3)),
    "sampler-drop-last": lambda r, w, bs=2, dl=False: DataLoader(
        indexed(), batch_size=bs, drop_last=dl, sampler=DistributedSampler(indexed(), w, r, shuffle=False,
                                                                          drop_last=True)),
}


@pytest.mark.parametrize("kind", list(LOADERS))
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bs, dl", [(2, False), (3, True), (1, False)])
def test_ranks_share_the_batches_of_one_process_without_padding(monkeypatch, kind, world, bs, dl):
    make = LOADERS[kind]

    def make_loader(r, w):
        return make(r, w, bs, dl)

    got = merged(monkeypatch, make_loader, world)
    if kind == "sampler-drop-last":  # the sampler's drop_last makes shards even; evaluation keeps all
        want = one_process(lambda r, w: LOADERS["torch-distributed"](r, w, bs, dl))
    else:
        want = one_process(make_loader)
    assert got == want
    flat = [i for b in got for i in b]
    assert len(flat) == len(set(flat)), "no sample twice"
    if not dl:
        assert sorted(flat) == list(range(N)), "every sample once"


def test_the_epoch_of_a_distributed_sampler_chooses_the_order(monkeypatch):
    def make_loader(r, w, epoch=4):
        sampler = DistributedSampler(indexed(), w, r, shuffle=True, seed=1)
        sampler.set_epoch(epoch)
        return DataLoader(indexed(), batch_size=2, sampler=sampler)

    assert merged(monkeypatch, make_loader, 2) == one_process(make_loader)
    assert merged(monkeypatch, make_loader, 2) != one_process(lambda r, w: make_loader(r, w, epoch=5))


def test_a_loader_without_batching_is_shared_sample_by_sample(monkeypatch):
    def make_loader(r, w):
        return DataLoader(indexed(), batch_size=None, sampler=DistributedSampler(indexed(), w, r, shuffle=False))

    got = merged(monkeypatch, make_loader, 2)
    assert got == one_process(make_loader) == list(range(N))


def test_a_custom_batch_sampler_is_shared_batch_by_batch_from_rank_0s_batches(monkeypatch):
    rank0_batches = [[6, 5, 4], [0], [1, 2], [3]]

    def make_loader(r, w):
        return DataLoader(indexed(), batch_sampler=[[0, 1], [2, 3], [4, 5], [6]])  # every rank alike...

    broadcasts = []

    def broadcast(obj, src=0):  # ...but rank 0's batches are the ones used
        broadcasts.append(obj)
        return rank0_batches

    got = []
    for rank in range(2):
        as_rank(monkeypatch, rank, 2, broadcast)
        got.append(batches_of(for_inference(make_loader(rank, 2), "val_data").batches))
    assert got == [rank0_batches[0::2], rank0_batches[1::2]]
    assert broadcasts == [[[0, 1], [2, 3], [4, 5], [6]]] * 2  # every rank iterated its own


def test_a_random_sampler_takes_rank_0s_order(monkeypatch):
    rank0_order = list(reversed(range(N)))
    as_rank(monkeypatch, 1, 2, lambda obj, src=0: rank0_order)
    shard = for_inference(DataLoader(indexed(), batch_size=2, sampler=RandomSampler(indexed())), "val_data")
    assert batches_of(shard.batches) == [rank0_order[2:4], rank0_order[6:]]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(N))


class OtherDistributedSampler(torch.utils.data.Sampler):
    """A sampler of another library that shards by itself (torch's attribute names)."""

    def __init__(self, num_replicas, rank):
        self.num_replicas, self.rank = num_replicas, rank

    def __iter__(self):
        return iter(range(self.rank, N, self.num_replicas))

    def __len__(self):
        return len(range(self.rank, N, self.num_replicas))


def test_data_each_rank_holds_itself_is_used_as_it_is(monkeypatch):
    as_rank(monkeypatch, 1, 2)
    for data in ([torch.zeros(2)], DataLoader(Stream(), batch_size=2),
                 DataLoader(indexed(), batch_size=2, sampler=ComposableDistributedSampler(range(N), 2, 1)),
                 DataLoader(indexed(), batch_sampler=BatchSampler(ComposableDistributedSampler(range(N), 2, 1), 2,
                                                                  False))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            shard = for_inference(data, "val_data")
        assert shard.batches is data and not shard.split
    other = DataLoader(indexed(), batch_size=2, sampler=OtherDistributedSampler(2, 1))
    with pytest.warns(UserWarning, match="OtherDistributedSampler looks like a distributed sampler"):
        assert for_inference(other, "val_data").batches is other


def test_one_process_uses_the_data_as_it_is():
    loader = LOADERS["torch-distributed"](0, 2)
    shard = for_inference(loader, "val_data")
    assert shard.batches is loader and not shard.split


def test_no_batches_at_all_is_an_error_on_every_rank_before_any_work(monkeypatch):
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        with pytest.raises(ValueError, match="val_data yields no batches: 1 samples with batch_size=2 and drop_last=True"):
            for_inference(DataLoader(indexed(1), batch_size=2, drop_last=True), "val_data")


def test_a_rank_may_get_no_batch(monkeypatch):
    as_rank(monkeypatch, 1, 2)
    shard = for_inference(DataLoader(indexed(2), batch_size=2), "val_data")
    assert shard.total == 1 and batches_of(shard.batches) == []


def test_a_loader_with_persistent_workers_is_rebuilt_once_and_follows_the_epoch(monkeypatch):
    as_rank(monkeypatch, 0, 2)
    sampler = DistributedSampler(indexed(), 2, 0, shuffle=True, seed=2)
    loader = DataLoader(indexed(), batch_size=2, sampler=sampler, num_workers=1, persistent_workers=True)
    first = for_inference(loader, "val_data").batches
    sampler.set_epoch(1)
    second = for_inference(loader, "val_data").batches
    assert second is first, "its workers persist across evaluations"
    assert list(first.batch_sampler) == list(for_inference(
        DataLoader(indexed(), batch_size=2, sampler=sampler), "val_data").batches.batch_sampler)
    assert first.num_workers == 1 and first.persistent_workers
    monkeypatch.setattr(distributed, "get_rank", lambda: 1)
    assert for_inference(loader, "val_data").batches is not first, "another rank: rebuilt"
    assert len(_sharding._REBUILT) >= 1
