"""Index-level tests of the Helios family: every stop point resumes to the uninterrupted stream.

Expected values come from first principles: the uninterrupted stream of the same sampler, the
documented derivation of an epoch's order (a generator seeded with ``rng.derive_seed(seed,
epoch)``), and torch's own ``DistributedSampler`` for the unshuffled partition.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from estimatorch import rng
from estimatorch.samplers import resumable
from estimatorch.samplers.resumable import (
    ResumableDistributedSampler,
    ResumableRandomSampler,
    ResumableSequentialSampler,
)

EPOCHS = 3
SEED = 5


def spec_permutation(n, seed, epoch):
    """An epoch's order as documented: randperm from a generator seeded with (seed, epoch)."""
    generator = torch.Generator()
    generator.manual_seed(rng.derive_seed(seed, epoch))
    return torch.randperm(n, generator=generator).tolist()


def chunks(items, size, drop_last):
    out = [items[i:i + size] for i in range(0, len(items), size)]
    return out[:-1] if out and drop_last and len(out[-1]) < size else out


# (factory(batch_size), loader drop_last) for every sampler and shape under test.
CONFIGS = []
for n, bs, dl in itertools.product((7, 10), (1, 3), (False, True)):
    CONFIGS.append(pytest.param(lambda b, n=n: ResumableSequentialSampler(n, batch_size=b), bs, dl,
                                id=f"sequential-n{n}-bs{bs}-dl{dl}"))
    CONFIGS.append(pytest.param(lambda b, n=n: ResumableRandomSampler(n, seed=SEED, batch_size=b), bs, dl,
                                id=f"random-n{n}-bs{bs}-dl{dl}"))
for w, n, bs, sdl, dl in itertools.product((1, 2, 3), (7, 10), (1, 3), (False, True), (False, True)):
    for r in range(w):
        CONFIGS.append(pytest.param(
            lambda b, w=w, r=r, n=n, sdl=sdl: ResumableDistributedSampler(
                n, num_replicas=w, rank=r, seed=SEED, drop_last=sdl, batch_size=b),
            bs, dl, id=f"distributed-w{w}-r{r}-n{n}-bs{bs}-sdl{sdl}-dl{dl}"))


def epoch_batches(sampler, epoch, bs, dl):
    sampler.set_epoch(epoch)
    return list(BatchSampler(sampler, bs, dl))


@pytest.mark.parametrize("make, bs, dl", CONFIGS)
def test_every_stop_point_resumes_to_the_uninterrupted_stream(make, bs, dl):
    reference = make(bs)
    per_epoch = [epoch_batches(reference, e, bs, dl) for e in range(EPOCHS)]
    uninterrupted = [b for batches in per_epoch for b in batches]
    for epoch in range(EPOCHS):
        before = sum(len(b) for b in per_epoch[:epoch])
        for k in range(len(per_epoch[epoch]) + 2):  # every batch, the end, and beyond
            sampler = make(bs)
            sampler.set_epoch(epoch)
            sampler.set_start_iter(k)
            resumed = list(BatchSampler(sampler, bs, dl))
            for later in range(epoch + 1, EPOCHS):  # later epochs are complete (Helios trap b)
                resumed += epoch_batches(sampler, later, bs, dl)
            start = before + min(k, len(per_epoch[epoch]))
            assert resumed == uninterrupted[start:], (epoch, k)


@pytest.mark.parametrize("make, bs, dl", CONFIGS)
def test_state_dict_round_trip_positions_identically(make, bs, dl):
    for epoch, k in itertools.product(range(EPOCHS), range(5)):
        sampler = make(bs)
        sampler.set_epoch(epoch)
        sampler.set_start_iter(k)
        state = sampler.state_dict()
        assert all(type(v) is int for v in state.values())
        restored = make(bs)
        restored.load_state_dict(state)
        assert len(restored) == len(sampler)
        assert list(restored) == list(sampler)
        assert restored.state_dict() == sampler.state_dict() == {"epoch": epoch, "start_index": 0}


@pytest.mark.parametrize("n", [1, 7, 10])
def test_epoch_order_is_the_documented_function_of_seed_and_epoch(n):
    sampler = ResumableRandomSampler(n, seed=SEED)
    assert list(sampler) == spec_permutation(n, SEED, 0)  # a fresh sampler is at epoch 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        assert list(sampler) == spec_permutation(n, SEED, epoch)
        assert list(sampler) == list(sampler), "iterating twice without set_epoch repeats the epoch"
        other = ResumableRandomSampler(n, seed=SEED)
        other.set_epoch(epoch)
        assert list(other) == list(sampler)
    assert list(ResumableSequentialSampler(n)) == list(range(n))


def test_distinct_epochs_and_seeds_give_distinct_permutations():
    sampler = ResumableRandomSampler(10, seed=SEED)
    orders = []
    for epoch in range(10):
        sampler.set_epoch(epoch)
        orders.append(tuple(sampler))
    assert len(set(orders)) == len(orders)
    assert all(sorted(order) == list(range(10)) for order in orders)
    assert list(ResumableRandomSampler(10, seed=SEED + 1)) != list(ResumableRandomSampler(10, seed=SEED))


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 7, 10, 11])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_partition_the_padded_epoch(w, n, drop_last, shuffle):
    epoch = 2
    order = spec_permutation(n, SEED, epoch) if shuffle else list(range(n))
    per_rank = n // w if drop_last else -(-n // w)
    total = per_rank * w
    padded = (order * -(-total // n))[:total]
    shards = []
    for r in range(w):
        sampler = ResumableDistributedSampler(n, w, r, shuffle=shuffle, seed=SEED, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert shards[-1] == padded[r::w]
        assert len(sampler) == sampler.num_samples == per_rank
        if not shuffle:  # torch's own sampler is the reference for the unshuffled partition
            assert shards[-1] == list(DistributedSampler(range(n), w, r, shuffle=False, drop_last=drop_last))
    assert Counter(itertools.chain(*shards)) == Counter(padded)
    if drop_last:
        assert len(set(itertools.chain(*shards))) == total
    else:
        assert set(itertools.chain(*shards)) == set(range(n))


# -- regressions for the Helios failures -----------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: ResumableRandomSampler(10, seed=SEED, batch_size=2),
    lambda: ResumableDistributedSampler(10, 2, 1, seed=SEED, batch_size=2),
], ids=["random", "distributed"])
def test_a_resume_uses_the_seed_of_the_epoch_being_resumed(make):
    """Helios saved the epoch counter already advanced and resumed with set_epoch(epoch + 1)."""
    run = make()
    run.set_epoch(0)
    list(run)
    run.set_epoch(1)
    epoch1 = list(run)
    run.set_start_iter(2)  # stop after batch 2 of epoch 1 and checkpoint
    state = run.state_dict()
    assert state["epoch"] == 1
    resumed = make()
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert tail == epoch1[4:]
    nxt = make()
    nxt.set_epoch(2)
    assert tail != list(nxt)[4:], "the next epoch's order must not be used"
    fresh = make()
    fresh.set_epoch(0)
    assert list(make()) == list(fresh), "set_epoch(e) selects epoch e, not e + 1"


@pytest.mark.parametrize("k", [1, 3, 4])
def test_b_a_start_is_used_for_one_iteration_only(k):
    """Helios never reset start_iter, so every later epoch dropped its first k batches."""
    sampler = ResumableRandomSampler(10, seed=SEED, batch_size=2)
    reference = ResumableRandomSampler(10, seed=SEED, batch_size=2)
    sampler.set_epoch(3)
    sampler.set_start_iter(k)
    assert len(sampler) == 10 - 2 * k
    assert len(list(sampler)) == 10 - 2 * k
    assert len(sampler) == 10 and sampler.start_iter == 0
    for epoch in (3, 4, 5):
        sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert list(sampler) == list(reference)
        assert len(list(sampler)) == 10


@pytest.mark.parametrize("make", [
    lambda: ResumableSequentialSampler(10, batch_size=3),
    lambda: ResumableRandomSampler(10, seed=SEED, batch_size=3),
    lambda: ResumableDistributedSampler(20, 2, 0, seed=SEED, batch_size=3),
], ids=["sequential", "random", "distributed"])
def test_c_a_start_at_the_last_batch_or_beyond_ends_the_epoch_once(make):
    """Helios looped forever over empty epochs when resumed after an epoch's last batch."""
    sampler = make()
    batches = -(-sampler.num_samples // 3)  # 4 batches of 3, 3, 3, 1
    sampler.set_epoch(1)
    full = list(sampler)
    sampler.set_start_iter(batches - 1)
    assert list(sampler) == full[3 * (batches - 1):] == full[-1:]
    for start in (batches, batches + 5):
        sampler.set_epoch(1)
        sampler.set_start_iter(start)
        assert len(sampler) == 0
        assert list(sampler) == []
    # a loop that runs until a number of steps is reached: bounded, and the next epoch is full
    total_steps, steps, empty_epochs = 2 * batches, 0, 0
    sampler.set_start_iter(batches)
    for epoch in range(1, 1 + 10):
        sampler.set_epoch(epoch)
        got = list(BatchSampler(sampler, 3, False))
        empty_epochs += not got
        steps += len(got)
        if steps >= total_steps:
            break
    assert (epoch, steps, empty_epochs) == (3, total_steps, 1)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("rank", [0, 1])
def test_d_distributed_start_counts_this_ranks_batches(k, rank):
    """Helios gave no batch_size to its distributed sampler, so a start skipped k samples."""
    n, w, bs = 37, 2, 4
    total = -(-n // w) * w
    shard = (spec_permutation(n, SEED, 0) * 2)[:total][rank::w]
    sampler = ResumableDistributedSampler(n, w, rank, seed=SEED, batch_size=bs)
    sampler.set_start_iter(k)
    assert list(sampler) == shard[bs * k:]
    if k:
        sampler.set_start_iter(k)
        assert list(sampler) != shard[k:]
    sampler.set_start_index(k)  # a start counted in samples
    assert list(sampler) == shard[k:]
    data = [1000 + i for i in range(n)]
    sampler.set_start_iter(k)
    loader = DataLoader(data, batch_size=bs, sampler=sampler)
    got = [b.tolist() for b in loader]
    assert got == [[1000 + i for i in b] for b in chunks(shard[bs * k:], bs, False)]


@pytest.mark.parametrize("make", [
    lambda: ResumableSequentialSampler(10, batch_size=3),
    lambda: ResumableRandomSampler(10, seed=SEED, batch_size=3),
    lambda: ResumableDistributedSampler(20, 2, 1, seed=SEED, batch_size=3),
], ids=["sequential", "random", "distributed"])
def test_an_iterator_dropped_unused_does_not_spend_the_start(make):
    """A DataLoader with workers calls iter() on its sampler twice and uses the second iterator."""
    sampler = make()
    sampler.set_epoch(1)
    full = list(sampler)
    sampler.set_start_iter(2)
    unused = iter(sampler)  # noqa: F841
    assert list(sampler) == full[6:]
    assert list(sampler) == full


@pytest.mark.slow
def test_dataloader_with_workers_and_no_batching_keeps_the_start():
    data = [torch.tensor(100 + i) for i in range(10)]
    sampler = ResumableRandomSampler(10, seed=SEED)
    full = list(sampler)
    sampler.set_start_iter(6)
    loader = DataLoader(data, batch_size=None, sampler=sampler, num_workers=2)
    assert [int(x) - 100 for x in loader] == full[6:]


# -- positioning cost ------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: ResumableSequentialSampler(10_000_000, batch_size=4),
    lambda: ResumableRandomSampler(10_000_000, seed=SEED, batch_size=4),
    lambda: ResumableDistributedSampler(10_000_000, 2, 1, shuffle=False, batch_size=4),
], ids=["sequential", "random", "distributed"])
def test_positioning_work_does_not_depend_on_the_start(make, monkeypatch):
    work = {}
    iterated: list = []
    original = resumable._iterate

    def spy_iterate(order, start):
        iterated.append(len(order) - start)
        return original(order, start)

    monkeypatch.setattr(resumable, "_iterate", spy_iterate)
    for k in (10, 1_000_000):
        sampler = make()
        iterated.clear()
        calls: list = []
        real_epoch_view = sampler.epoch_view

        def spy_epoch_view(epoch, calls=calls, real=real_epoch_view):
            calls.append(real(epoch))
            return calls[-1]

        sampler.epoch_view = spy_epoch_view
        sampler.set_epoch(1)
        sampler.set_start_iter(k)
        head = list(itertools.islice(iter(sampler), 5))
        assert len(calls) == 1, "the epoch's order is computed once"
        assert head == calls[0][4 * k:4 * k + 5].tolist(), "the first index yielded is the start"
        assert iterated[-1] == sampler.num_samples - 4 * k, "only indices from the start are iterated"
        work[k] = (len(calls), len(iterated))
    assert work[10] == work[1_000_000] == (1, 1)


# -- arguments and state ---------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: ResumableSequentialSampler(-1), "data_source must be a non-negative length, got -1"),
    (lambda: ResumableRandomSampler(5, seed=-1), "seed must be a non-negative int, got -1"),
    (lambda: ResumableRandomSampler(5, batch_size=0), "batch_size must be a positive int, got 0"),
    (lambda: ResumableDistributedSampler(5, 0, 0), "num_replicas must be a positive int, got 0"),
    (lambda: ResumableDistributedSampler(5, 2, 2), r"rank must be an int in \[0, 2\), got 2"),
    (lambda: ResumableSequentialSampler(5).set_epoch(-1), "epoch must be a non-negative int, got -1"),
    (lambda: ResumableSequentialSampler(5).set_start_iter(-2), "start_iter must be a non-negative int, got -2"),
    (lambda: ResumableSequentialSampler(5).load_state_dict({"epoch": 0}), "missing the key 'start_index'"),
    (lambda: ResumableSequentialSampler(5).load_state_dict({"start_index": 0}), "missing the key 'epoch'"),
])
def test_bad_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_type_errors_name_the_argument():
    with pytest.raises(TypeError, match="data_source must be a sized dataset or an int, got True"):
        ResumableRandomSampler(True)


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_dataloader_yields_the_resumed_batches(num_workers):
    n, bs = 23, 4
    data = [100 + i for i in range(n)]
    reference = ResumableRandomSampler(n, seed=SEED, batch_size=bs)
    reference.set_epoch(2)
    expected = [[100 + i for i in b] for b in chunks(list(reference), bs, True)]
    for k in range(len(expected) + 1):
        sampler = ResumableRandomSampler(n, seed=SEED, batch_size=bs)
        sampler.set_epoch(2)
        sampler.set_start_iter(k)
        loader = DataLoader(data, batch_size=bs, sampler=sampler, drop_last=True, num_workers=num_workers)
        assert len(loader) == len(expected) - k
        assert [b.tolist() for b in loader] == expected[k:]
        if num_workers:
            break


# -- start_iter as an attribute (issue 10) -------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: ResumableSequentialSampler(10, batch_size=3),
    lambda: ResumableRandomSampler(10, seed=SEED, batch_size=3),
    lambda: ResumableDistributedSampler(20, 2, 1, seed=SEED, batch_size=3),
], ids=["sequential", "random", "distributed"])
@pytest.mark.parametrize("k", [1, 2])
def test_assigning_start_iter_positions_like_set_start_iter(make, k):
    """Helios users resume with ``sampler.start_iter = k``: it used to be silently ignored."""
    by_method, by_attribute, full = make(), make(), make()
    for sampler in (by_method, by_attribute, full):
        sampler.set_epoch(1)
    by_method.set_start_iter(k)
    by_attribute.start_iter = k
    assert by_attribute.start_iter == k and len(by_attribute) == len(by_method) == full.num_samples - 3 * k
    expected = list(full)[3 * k:]
    assert list(by_attribute) == list(by_method) == expected
    assert by_attribute.start_iter == 0, "spent by the iteration"
    assert list(by_attribute) == list(full), "used for one iteration only"


def test_start_iter_reads_a_start_set_in_samples_and_a_loaded_state():
    sampler = ResumableSequentialSampler(10, batch_size=4)
    sampler.set_start_index(9)
    assert sampler.start_iter == 2  # whole batches: 9 samples are 2 batches and a part
    other = ResumableSequentialSampler(10, batch_size=4)
    other.load_state_dict({"epoch": 0, "start_index": 8})
    assert other.start_iter == 2 and list(other) == [8, 9]


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_assigning_a_bad_start_iter_is_refused(bad):
    sampler = ResumableRandomSampler(10, seed=SEED, batch_size=2)
    with pytest.raises((ValueError, TypeError), match="start_iter must be a non-negative int"):
        sampler.start_iter = bad
    assert sampler.start_iter == 0 and len(list(sampler)) == 10


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("w, n", [(2, 7), (3, 10), (2, 8)])
def test_epoch_order_is_the_unpadded_order_the_ranks_share(w, n, shuffle):
    """What evaluate and predict split over the ranks: every index once, the padded epoch's head."""
    samplers = [ResumableDistributedSampler(n, w, r, shuffle=shuffle, seed=SEED) for r in range(w)]
    order = samplers[0].epoch_order(2).tolist()
    assert sorted(order) == list(range(n))
    assert order == (spec_permutation(n, SEED, 2) if shuffle else list(range(n)))
    for r, sampler in enumerate(samplers):
        sampler.set_epoch(2)
        assert list(sampler)[:len(order[r::w])] == order[r::w]
