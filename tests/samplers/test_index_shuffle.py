"""The keyed-bijection order (``permutation="feistel"``): a permutation for every length, uniform
enough by statistical tests whose bounds are derived below, computed a chunk at a time, and
under the samplers with today's sharding, padding, ``drop_last``, start and state semantics.

Statistics (the bounds are false alarms with probability below 1e-6 for a random permutation):

- **Position of each index over many epochs.** ``C[i, b]`` counts the epochs in which index
  ``i`` lands in position bucket ``b`` (``B`` buckets of equal size). Pearson's
  ``X = sum (C - E)^2 / E`` then has mean ``n (B - 1)`` and ``X (n - 1) / n`` follows a
  chi-square law with ``(n - 1)(B - 1)`` degrees of freedom (every epoch fills each row and each
  bucket exactly: a contingency table). The bound is that law's upper ``z = 5`` quantile
  (Wilson-Hilferty).
- **Correlation** of consecutive indices, of an index with its position, and of two epochs'
  orders: Pearson's ``r`` of a random permutation is about normal with variance ``1 / (n - 1)``;
  the bound is ``5 / sqrt(n - 1)``.

Each statistic is also shown to reject an order that is not random (the identity), so the tests
can fail.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.utils.data import BatchSampler

from estimatorch import rng
from estimatorch.samplers import (
    AUTO_THRESHOLD,
    EpochOrder,
    IndexShuffle,
    RepeatSampler,
    ReproducibleShuffleSampler,
    ResumableDistributedSampler,
    ResumableRandomSampler,
    ResumableSequentialSampler,
    SkipBatchSampler,
    resumable,
)
from estimatorch.samplers import DistributedSampler as ShardSampler
from estimatorch.samplers._index_shuffle import MAX_LENGTH

SEED = 7
Z = 5.0  # standard deviations: a false alarm below 3e-7 per bound


def feistel_order(n, seed=SEED, epoch=0):
    return IndexShuffle(n, seed, epoch)(torch.arange(n)).tolist()


def spec_randperm(n, seed, epoch):
    """Today's order: randperm from a generator seeded with derive_seed(seed, epoch)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(rng.derive_seed(seed, epoch))).tolist()


# -- a permutation, for every length ----------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 7, 16, 17, 31, 64, 1000, 1009, 1024, 4097, 65536, 65537])
def test_every_index_exactly_once_per_epoch(n):
    for seed, epoch in [(0, 0), (SEED, 1), (2**64 - 1, 10**6)]:
        assert sorted(feistel_order(n, seed, epoch)) == list(range(n)), (seed, epoch)


def test_a_large_prime_length_is_a_permutation():
    n = 1_000_003  # prime, just above a square: cycle-walking happens
    assert torch.equal(IndexShuffle(n, SEED, 3)(torch.arange(n)).sort().values, torch.arange(n))


def test_an_index_is_a_function_of_its_position_only():
    n = 10_007
    shuffle = IndexShuffle(n, SEED, 2)
    whole = shuffle(torch.arange(n))
    in_chunks = torch.cat([shuffle(torch.arange(low, min(low + 333, n))) for low in range(0, n, 333)])
    picked = torch.tensor([n - 1, 0, 5000, 17, 5000])
    assert torch.equal(in_chunks, whole)
    assert torch.equal(shuffle(picked), whole[picked])
    assert torch.equal(IndexShuffle(n, SEED, 2)(torch.arange(n)), whole)  # a fresh instance agrees


def test_the_order_depends_on_seed_and_epoch_and_not_on_the_global_generators():
    n = 1000
    torch.manual_seed(1)
    first = feistel_order(n)
    torch.manual_seed(2)
    torch.rand(10)
    assert feistel_order(n) == first
    others = [feistel_order(n, SEED, 1), feistel_order(n, SEED + 1, 0), feistel_order(n, SEED, 10**9)]
    assert all(other != first for other in others)
    assert feistel_order(n) != spec_randperm(n, SEED, 0)


def test_positions_are_not_changed_and_lengths_are_checked():
    positions = torch.arange(50)
    IndexShuffle(50, SEED, 0)(positions)
    assert torch.equal(positions, torch.arange(50))
    for bad in (-1, MAX_LENGTH + 1, 2.0, True):
        with pytest.raises(ValueError, match=r"n must be an int in \[0, 2\*\*62\]"):
            IndexShuffle(bad, SEED, 0)


def test_the_largest_length_stays_exact_in_int64():
    n = MAX_LENGTH
    positions = torch.tensor([0, 1, n // 2, n - 2, n - 1])
    indices = IndexShuffle(n, SEED, 0)(positions)
    assert indices.dtype == torch.int64 and bool(((indices >= 0) & (indices < n)).all())
    assert len(set(indices.tolist())) == len(positions)


# -- uniformity ---------------------------------------------------------------------------------
def chi_square_bound(dof, z=Z):
    """The upper ``z``-sigma quantile of a chi-square law with ``dof`` degrees (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def position_statistic(orders, n, buckets):
    """``(X (n - 1) / n, degrees of freedom)`` of the index-by-position-bucket table (see the notes)."""
    bucket = torch.arange(n) * buckets // n
    counts = torch.zeros(n, buckets, dtype=torch.float64)
    for order in orders:
        counts.index_put_((torch.as_tensor(order), bucket), torch.ones(n, dtype=torch.float64), accumulate=True)
    expected = counts.sum(1, keepdim=True) * torch.bincount(bucket, minlength=buckets) / n
    x = float(((counts - expected) ** 2 / expected).sum())
    return x * (n - 1) / n, (n - 1) * (buckets - 1)


@pytest.mark.parametrize("n, buckets, epochs", [(3, 3, 3000), (7, 7, 3000), (8, 8, 3000), (10, 10, 3000),
                                                (1000, 10, 200)])
def test_each_index_is_equally_likely_at_each_position_over_epochs(n, buckets, epochs):
    statistic, dof = position_statistic((feistel_order(n, SEED, e) for e in range(epochs)), n, buckets)
    assert statistic < chi_square_bound(dof), (statistic, dof)
    identity, _ = position_statistic((list(range(n)) for _ in range(epochs)), n, buckets)
    assert identity > chi_square_bound(dof)  # the statistic rejects an order that is not shuffled


def correlation(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("n", [10**6, 2**20 + 1])
def test_consecutive_indices_positions_and_epochs_are_uncorrelated(n):
    bound = Z / math.sqrt(n - 1)
    order = IndexShuffle(n, SEED, 0)(torch.arange(n))
    following = IndexShuffle(n, SEED, 1)(torch.arange(n))
    assert abs(correlation(order[:-1], order[1:])) < bound
    assert abs(correlation(order, torch.arange(n))) < bound
    assert abs(correlation(order, following)) < bound
    identity = torch.arange(n)
    assert correlation(identity[:-1], identity[1:]) > bound  # the statistic rejects an unshuffled order


# -- the choice ---------------------------------------------------------------------------------
def test_auto_keeps_randperm_up_to_the_threshold_and_takes_feistel_above():
    for n, want in [(0, "randperm"), (AUTO_THRESHOLD, "randperm"), (AUTO_THRESHOLD + 1, "feistel")]:
        assert ResumableRandomSampler(n).permutation == want
        assert ResumableDistributedSampler(n, 2, 0).permutation == want
        assert ReproducibleShuffleSampler(range(n)).permutation == want
    assert ResumableDistributedSampler(AUTO_THRESHOLD + 1, 2, 0, shuffle=False).permutation is None
    assert ResumableSequentialSampler(10).permutation is None
    assert ResumableRandomSampler(10, permutation="feistel").permutation == "feistel"
    assert ResumableRandomSampler(AUTO_THRESHOLD + 1, permutation="randperm").permutation == "randperm"


@pytest.mark.parametrize("n", [1, 10, 1000])
def test_the_default_below_the_threshold_is_todays_order_bit_for_bit(n):
    sampler = ResumableRandomSampler(n, seed=SEED)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        assert list(sampler) == spec_randperm(n, SEED, epoch)
    sampler.set_start_iter(1)
    assert sampler.state_dict() == {"epoch": 2, "start_index": 1}  # today's keys only
    shard = ResumableDistributedSampler(n, 3, 2, seed=SEED)
    padded = (spec_randperm(n, SEED, 0) * 3)[:-(-n // 3) * 3]
    assert list(shard) == padded[2::3]
    assert list(ReproducibleShuffleSampler(range(n), seed=SEED)) == spec_randperm(n, SEED, 0)


@pytest.mark.parametrize("make", [
    lambda: ResumableRandomSampler(10, permutation="feistl"),
    lambda: ResumableDistributedSampler(10, 2, 0, permutation=None),
    lambda: ReproducibleShuffleSampler(range(10), permutation=1),
])
def test_a_bad_permutation_is_named(make):
    with pytest.raises(ValueError, match="permutation must be 'auto', 'randperm' or 'feistel', got"):
        make()


# -- the samplers on top of it --------------------------------------------------------------------
def test_the_random_sampler_yields_the_order_and_resumes_at_any_batch():
    n, bs = 103, 4
    sampler = ResumableRandomSampler(n, seed=SEED, batch_size=bs, permutation="feistel")
    sampler.set_epoch(2)
    full = list(sampler)
    assert full == feistel_order(n, SEED, 2) and len(sampler) == n
    assert sampler.epoch_indices(2).tolist() == full
    for k in range(0, n // bs + 2):
        sampler.set_start_iter(k)
        assert sampler.start_iter == k and len(sampler) == max(n - k * bs, 0)
        assert list(sampler) == full[k * bs:], k
        assert list(sampler) == full  # the start was used once


def test_positioning_builds_nothing_of_the_epochs_size(monkeypatch):
    n, bs = 10**9, 1024
    sizes = []
    call = IndexShuffle.__call__

    def spy(self, positions):
        sizes.append(positions.numel())
        return call(self, positions)

    def no_randperm(*args, **kwargs):
        raise AssertionError("randperm called")

    monkeypatch.setattr(IndexShuffle, "__call__", spy)
    monkeypatch.setattr(torch, "randperm", no_randperm)
    shard = ResumableDistributedSampler(n, 8, 3, seed=SEED, batch_size=bs)
    for sampler in (ResumableRandomSampler(n, seed=SEED, batch_size=bs), shard):
        sampler.set_epoch(5)
        middle = sampler.num_samples // bs // 2
        sampler.set_start_iter(middle)
        first = list(itertools.islice(iter(sampler), bs))
        view = sampler.epoch_view(5)
        assert first == view[middle * bs:(middle + 1) * bs].tolist()
    assert 0 < max(sizes) <= resumable._CHUNK
    assert shard.order_view(5)[middle * bs * 8 + 3].item() == first[0]  # rank 3 of 8: every 8th from 3


@pytest.mark.parametrize("n, w, drop_last", [(n, w, d) for n in (7, 10, 17, 64) for w in (1, 2, 3, 4)
                                             for d in (False, True)])
def test_ranks_share_the_order_padded_or_dropped_as_today(n, w, drop_last):
    order = feistel_order(n, SEED, 1)
    total = n // w * w if drop_last else -(-n // w) * w
    padded = (order * (total // n + 1))[:total]  # the head repeated, as torch's DistributedSampler
    shards = []
    for r in range(w):
        sampler = ResumableDistributedSampler(n, w, r, seed=SEED, drop_last=drop_last, permutation="feistel")
        sampler.set_epoch(1)
        shards.append(list(sampler))
        assert shards[-1] == padded[r::w] and len(sampler) == total // w
        assert sampler.epoch_order(1).tolist() == order
    seen = sorted(i for shard in shards for i in shard)
    assert seen == sorted(padded)
    assert set(seen) == (set(range(n)) if not drop_last else set(order[:total]))


def test_a_state_round_trips_and_another_permutation_is_refused():
    sampler = ResumableRandomSampler(50, seed=SEED, batch_size=5, permutation="feistel")
    sampler.set_epoch(3)
    sampler.set_start_iter(4)
    state = sampler.state_dict()
    assert state == {"epoch": 3, "start_index": 20, "permutation": "feistel"}
    restored = ResumableRandomSampler(50, seed=SEED, batch_size=5, permutation="feistel")
    restored.load_state_dict(state)
    assert list(restored) == list(sampler)
    with pytest.raises(ValueError, match="written with permutation='feistel' and this one uses "
                                         "permutation='randperm'.*Pass permutation='feistel'"):
        ResumableRandomSampler(50, seed=SEED, batch_size=5).load_state_dict(state)
    with pytest.raises(ValueError, match="written with permutation='randperm' and this one uses "
                                         "permutation='feistel'"):
        restored.load_state_dict({"epoch": 3, "start_index": 20})  # a state written before the choice


def test_the_shuffle_of_the_chain_resumes_at_every_skip():
    n, w, bs = 11, 2, 3

    def chain(rank, skip):
        shuffled = ReproducibleShuffleSampler(range(n), seed=SEED, permutation="feistel")
        batches = BatchSampler(ShardSampler(RepeatSampler(shuffled), num_workers=w, rank=rank), bs, False)
        return SkipBatchSampler(batches, skip)

    stream = [i for p in range(6) for i in feistel_order(n, SEED, p)]
    for rank in range(w):
        uninterrupted = list(itertools.islice(chain(rank, 0), 12))
        assert uninterrupted[:3] == [stream[rank::w][j * bs:(j + 1) * bs] for j in range(3)]
        for k in range(8):
            assert list(itertools.islice(chain(rank, k), 4)) == uninterrupted[k:k + 4], (rank, k)


def test_the_shuffle_of_the_chain_reads_a_range_where_the_order_points_and_checks_its_state():
    shuffled = ReproducibleShuffleSampler(range(10**9), seed=SEED)  # 'auto': never listed
    assert shuffled.permutation == "feistel"
    assert next(iter(shuffled)) == IndexShuffle(10**9, SEED, 0)(torch.tensor([0])).item()
    state = shuffled.state_dict()
    assert state["permutation"] == "feistel"
    with pytest.raises(ValueError, match="written with permutation='feistel'"):
        ReproducibleShuffleSampler(range(10**9), seed=SEED, permutation="randperm").load_state_dict(state)
    items = ["a", "b", "c", "d", "e"]
    order = feistel_order(5, SEED, 0)
    assert list(ReproducibleShuffleSampler(items, seed=SEED, permutation="feistel")) == [items[i] for i in order]


# -- the lazy view ------------------------------------------------------------------------------
def test_a_view_reads_like_the_tensor_it_stands_for():
    n = 37
    tensor = torch.tensor(feistel_order(n))
    lazy = EpochOrder(IndexShuffle(n, SEED, 0), n)
    for view in (lazy, EpochOrder(tensor)):
        assert len(view) == n
        assert view[:].tolist() == tensor.tolist()
        assert view[5:30:4].tolist() == tensor[5:30:4].tolist()
        assert view[[36, 0, -1]].tolist() == tensor[[36, 0, -1]].tolist()
        assert int(view[-2]) == int(tensor[-2]) and view[40:].numel() == 0
    with pytest.raises(IndexError, match="out of range"):
        lazy[n]
    with pytest.raises(IndexError, match=r"positions must lie in \[-37, 37\)"):
        lazy[[0, n]]
