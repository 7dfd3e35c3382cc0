"""Index-level tests of the Determined family: exact lists, resume by skip, state, ordering rules.

Expected values are derived from first principles: an epoch's permutation is the documented
``randperm`` from a generator seeded with ``rng.derive_seed(seed, epoch)``; the global stream of
the documented chain is the concatenation of those permutations; rank ``r`` takes items
``r, r + W, ...``; batches are consecutive chunks.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler

from estimatorch import rng
from estimatorch.samplers import ResumableRandomSampler, composable, resumable
from estimatorch.samplers.composable import (
    DistributedBatchSampler,
    DistributedSampler,
    RepeatBatchSampler,
    RepeatSampler,
    ReproducibleShuffleSampler,
    SkipBatchSampler,
    SkipSampler,
)

SEED = 11


@functools.lru_cache(maxsize=None)
def spec_permutation(n, seed, epoch):
    """An epoch's order as documented: randperm from a generator seeded with (seed, epoch)."""
    generator = torch.Generator()
    generator.manual_seed(rng.derive_seed(seed, epoch))
    return tuple(torch.randperm(n, generator=generator).tolist())


def global_item(g, n, seed=SEED):
    """Item ``g`` of shuffle -> repeat over range(n): pass g // n, position g % n."""
    return spec_permutation(n, seed, g // n)[g % n]


def expected_batch(t, n, w, r, bs, seed=SEED):
    """Batch ``t`` of rank ``r`` in the documented chain: its items are global items (t*bs+j)*w + r."""
    return [global_item((t * bs + j) * w + r, n, seed) for j in range(bs)]


def chunks(items, size, drop_last=False):
    out = [list(items[i:i + size]) for i in range(0, len(items), size)]
    return out[:-1] if out and drop_last and len(out[-1]) < size else out


def make_batch_sampler(sampler_or_dataset, mode, shuffle_seed, num_workers, rank, batch_size, skip):
    """Determined's documented example, verbatim but for the imports."""
    if isinstance(sampler_or_dataset, Sampler):
        sampler = sampler_or_dataset
    else:
        sampler = SequentialSampler(sampler_or_dataset)
    if mode == "training":
        sampler = ReproducibleShuffleSampler(sampler, shuffle_seed)
        sampler = RepeatSampler(sampler)
    sampler = DistributedSampler(sampler, num_workers=num_workers, rank=rank)
    batch_sampler = BatchSampler(sampler, batch_size, drop_last=False)
    if mode == "training":
        batch_sampler = SkipBatchSampler(batch_sampler, skip)
    return batch_sampler


def training(n, w, r, bs, skip, seed=SEED):
    return make_batch_sampler(range(n), "training", seed, w, r, bs, skip)


def take(iterable, count):
    return list(itertools.islice(iterable, count))


def is_plain(value):
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return type(value) in (int, bool)


class EpochRecorder(Sampler[int]):
    """A sampler that records the epochs it is given (and is not known to be positional)."""

    def __init__(self, n):
        self.n, self.epochs = n, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


# -- each sampler, exactly -------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 10])
def test_shuffle_is_the_documented_permutation_of_the_inner_indices(n):
    inner = [100 + 3 * i for i in range(n)]
    sampler = ReproducibleShuffleSampler(inner, seed=SEED)
    assert len(sampler) == n
    for epoch in (0, 1, 5):
        sampler.set_epoch(epoch)
        expected = [inner[i] for i in spec_permutation(n, SEED, epoch)]
        assert list(sampler) == list(sampler) == expected
        again = ReproducibleShuffleSampler(inner, seed=SEED)
        again.set_epoch(epoch)
        assert list(again) == expected


def test_shuffle_gives_distinct_epochs_and_seeds():
    sampler = ReproducibleShuffleSampler(range(10), seed=SEED)
    orders = set()
    for epoch in range(10):
        sampler.set_epoch(epoch)
        orders.add(tuple(sampler))
    assert len(orders) == 10
    assert list(ReproducibleShuffleSampler(range(10), seed=SEED + 1)) != list(ReproducibleShuffleSampler(range(10), seed=SEED))


def test_repeat_concatenates_passes_and_sets_each_epoch():
    recorder = EpochRecorder(3)
    assert take(RepeatSampler(recorder), 10) == [0, 1, 2] * 3 + [0]
    assert recorder.epochs == [0, 1, 2, 3]
    shuffled = RepeatSampler(ReproducibleShuffleSampler(range(5), seed=SEED))
    assert take(shuffled, 20) == [i for p in range(4) for i in spec_permutation(5, SEED, p)]
    with pytest.raises(TypeError):
        len(RepeatSampler(range(3)))  # an infinite stream has no length


def test_repeat_batch_sampler_repeats_batches():
    batches = BatchSampler(ReproducibleShuffleSampler(range(7), seed=SEED), 3, drop_last=True)
    expected = [b for p in range(3) for b in chunks(spec_permutation(7, SEED, p), 3, drop_last=True)]
    assert take(RepeatBatchSampler(batches), 6) == expected


@pytest.mark.parametrize("w", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 7, 10])
def test_distributed_sampler_deals_items_round_robin_without_padding(w, n):
    items = [50 + i for i in range(n)]
    shards = [list(DistributedSampler(items, num_workers=w, rank=r)) for r in range(w)]
    for r, shard in enumerate(shards):
        assert shard == [items[i] for i in range(n) if i % w == r]
        assert len(DistributedSampler(items, num_workers=w, rank=r)) == len(shard)
    assert sorted(itertools.chain(*shards)) == items


def test_distributed_batch_sampler_deals_batches_round_robin():
    batches = list(BatchSampler(range(11), 2, drop_last=False))
    for r in range(3):
        sampler = DistributedBatchSampler(BatchSampler(range(11), 2, drop_last=False), num_workers=3, rank=r)
        assert list(sampler) == batches[r::3]
        assert len(sampler) == len(batches[r::3])


def test_set_epoch_reaches_the_shuffle_through_shard_and_skip():
    sampler = SkipSampler(DistributedSampler(ReproducibleShuffleSampler(range(10), seed=SEED), 2, 1), skip=1)
    sampler.set_epoch(3)
    assert list(sampler) == list(spec_permutation(10, SEED, 3)[1::2])[1:]


@pytest.mark.parametrize("skip", [0, 1, 4, 7, 9])
def test_skip_sampler_skips_once(skip):
    items = [7 * i for i in range(7)]
    sampler = SkipSampler(items, skip=skip)
    assert len(sampler) == max(7 - skip, 0)
    assert list(sampler) == items[skip:]
    assert sampler.skip == 0 and len(sampler) == 7
    assert list(sampler) == items, "the skip is used in the first iteration only"


def test_assigning_skip_positions_like_the_argument_and_is_checked():
    sampler = SkipBatchSampler(BatchSampler(range(9), 2, drop_last=False))
    sampler.skip = 3
    assert len(sampler) == 2 and list(sampler) == [[6, 7], [8]]
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="skip must be a non-negative int"):
            sampler.skip = bad
    assert sampler.skip == 0


def test_skip_batch_sampler_skips_batches_once():
    batches = list(BatchSampler(range(9), 2, drop_last=False))
    for skip in range(len(batches) + 2):
        sampler = SkipBatchSampler(BatchSampler(range(9), 2, drop_last=False), skip)
        assert list(sampler) == batches[skip:]
        assert list(sampler) == batches


def test_an_iterator_dropped_unused_does_not_spend_the_skip():
    """A DataLoader with workers calls iter() on its batch sampler twice and uses the second."""
    batches = list(BatchSampler(range(9), 2, drop_last=False))
    sampler = SkipBatchSampler(BatchSampler(range(9), 2, drop_last=False), 2)
    unused = iter(sampler)  # noqa: F841
    assert list(sampler) == batches[2:]
    sampler = SkipSampler(range(5), 3)
    unused = iter(sampler)  # noqa: F841
    assert list(sampler) == [3, 4]


# -- the documented chain --------------------------------------------------------------------

@pytest.mark.parametrize("n", [7, 10])
@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("w", [1, 2, 3])
def test_documented_chain_is_the_sharded_repeated_shuffle(n, bs, w):
    count = 3 * n  # several passes of the dataset
    for r in range(w):
        expected = [expected_batch(t, n, w, r, bs) for t in range(count)]
        assert take(training(n, w, r, bs, skip=0), count) == expected
    # the ranks together consume the global stream in order, each item once per pass
    merged = [b for t in range(count) for r in range(w) for b in take(training(n, w, r, bs, t), 1)[0]]
    by_position = [global_item((t * bs + j) * w + r, n) for t in range(count) for r in range(w) for j in range(bs)]
    assert merged == by_position


@pytest.mark.parametrize("n, bs, w", [(7, 1, 1), (7, 3, 2), (10, 3, 3), (10, 2, 2)])
def test_documented_chain_resumes_at_every_skip(n, bs, w):
    horizon = 4 * n  # well past several epoch boundaries of every rank
    for r in range(w):
        uninterrupted = take(training(n, w, r, bs, skip=0), horizon + 6)
        for k in range(horizon):
            assert take(training(n, w, r, bs, skip=k), 6) == uninterrupted[k:k + 6], (r, k)


def test_a_large_skip_generates_only_the_passes_it_needs(monkeypatch):
    passes = []
    original = resumable._permutation  # the shuffle's randperm order (see resumable._shuffled)

    def spy(n, seed, epoch):
        passes.append(epoch)
        return original(n, seed, epoch)

    monkeypatch.setattr(resumable, "_permutation", spy)
    n, w, r, bs = 10, 2, 1, 3
    for skip in (10, 10**9):
        passes.clear()
        first = take(training(n, w, r, bs, skip), 1)[0]
        assert first == expected_batch(skip, n, w, r, bs)
        first_item, last_item = skip * bs * w + r, (skip * bs + bs - 1) * w + r
        assert passes == list(range(first_item // n, last_item // n + 1)), "no earlier pass is generated"


def test_a_stateful_inner_sampler_is_replayed_exactly():
    def chain(skip):
        generator = torch.Generator().manual_seed(3)
        return SkipSampler(DistributedSampler(RepeatSampler(RandomSampler(range(5), generator=generator)), 2, 1), skip)

    uninterrupted = take(chain(0), 30)
    for k in range(20):
        assert take(chain(k), 10) == uninterrupted[k:k + 10]


def test_a_resumable_sampler_can_be_repeated_and_skipped():
    def chain(skip):
        return SkipSampler(RepeatSampler(ResumableRandomSampler(7, seed=SEED)), skip)

    expected = [i for p in range(6) for i in spec_permutation(7, SEED, p)]
    assert take(chain(0), 35) == expected[:35]
    for k in range(30):
        assert take(chain(k), 5) == expected[k:k + 5]


def test_shard_before_repeat_is_allowed_with_unequal_epoch_boundaries():
    streams = [take(RepeatSampler(DistributedSampler(ReproducibleShuffleSampler(range(10), seed=SEED), 3, r)), 12)
               for r in range(3)]
    for r, stream in enumerate(streams):
        shard_passes = [list(spec_permutation(10, SEED, p)[r::3]) for p in range(4)]
        assert stream == [i for shard in shard_passes for i in shard][:12]
    assert [len(range(10)[r::3]) for r in range(3)] == [4, 3, 3]
    resumed = SkipSampler(RepeatSampler(DistributedSampler(ReproducibleShuffleSampler(range(10), seed=SEED), 3, 1)), 5)
    assert take(resumed, 7) == streams[1][5:12]


# -- state -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 5, 23])
def test_state_dict_round_trip_positions_identically(k):
    saved = training(10, 2, 1, 3, skip=k)
    state = saved.state_dict()
    assert is_plain(state)
    assert state["skip"] == k
    restored = training(10, 2, 1, 3, skip=0)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert take(restored, 8) == take(saved, 8) == take(training(10, 2, 1, 3, skip=0), k + 8)[k:]
    assert saved.state_dict()["skip"] == 0, "once iterated, the skip is spent"


def test_shuffle_state_round_trip():
    sampler = ReproducibleShuffleSampler(range(10), seed=SEED)
    sampler.set_epoch(4)
    state = sampler.state_dict()
    assert state == {"seed": SEED, "epoch": 4, "sampler": {}}
    restored = ReproducibleShuffleSampler(range(10), seed=SEED)
    restored.load_state_dict(state)
    assert list(restored) == list(sampler) == list(spec_permutation(10, SEED, 4))


@pytest.mark.parametrize("path, key", [
    ((), "skip"),
    (("batch_sampler",), "batch_size"),
    (("batch_sampler", "sampler"), "num_workers"),
    (("batch_sampler", "sampler", "sampler", "sampler"), "epoch"),
])
def test_load_state_dict_names_a_missing_key(path, key):
    state = training(10, 2, 1, 3, skip=2).state_dict()
    node = state
    for step in path:
        node = node[step]
    del node[key]
    with pytest.raises(ValueError, match=f"missing the key '{key}'"):
        training(10, 2, 1, 3, skip=0).load_state_dict(state)


@pytest.mark.parametrize("other, key", [
    (lambda: training(10, 2, 1, 3, 0, seed=SEED + 1), "seed"),
    (lambda: training(10, 3, 1, 3, 0), "num_workers"),
    (lambda: training(10, 2, 1, 4, 0), "batch_size"),
])
def test_load_state_dict_refuses_a_different_stream(other, key):
    state = training(10, 2, 1, 3, skip=2).state_dict()
    with pytest.raises(ValueError, match=f"{key}=.*would shift"):
        other().load_state_dict(state)


# -- ordering rules and arguments ------------------------------------------------------------

@pytest.mark.parametrize("infinite", [
    lambda: RepeatSampler(range(4)),
    lambda: DistributedSampler(RepeatSampler(range(4)), 2, 0),
    lambda: BatchSampler(RepeatSampler(range(4)), 2, drop_last=False),
])
def test_shuffling_an_infinite_stream_is_refused(infinite):
    with pytest.raises(ValueError, match="infinite"):
        ReproducibleShuffleSampler(infinite(), seed=SEED)


def test_repeating_an_infinite_stream_is_refused():
    with pytest.raises(ValueError, match="already infinite"):
        RepeatSampler(DistributedSampler(RepeatSampler(range(4)), 2, 0))
    with pytest.raises(ValueError, match="already infinite"):
        RepeatBatchSampler(BatchSampler(RepeatSampler(range(4)), 2, False))


@pytest.mark.parametrize("wrap", [
    ReproducibleShuffleSampler,
    RepeatSampler,
    lambda s: DistributedSampler(s, 2, 0),
    SkipSampler,
    lambda s: RepeatBatchSampler(BatchSampler(s, 2, False)),
    lambda s: DistributedBatchSampler(BatchSampler(s, 2, False), 2, 0),
    lambda s: SkipBatchSampler(BatchSampler(s, 2, False), 1),
], ids=["shuffle", "repeat", "shard", "skip", "repeat-batch", "shard-batch", "skip-batch"])
def test_wrapping_a_skip_is_refused(wrap):
    with pytest.raises(ValueError, match="skip must be the last step"):
        wrap(SkipSampler(range(6), 1))
    with pytest.raises(ValueError, match="skip must be the last step"):
        wrap(SkipBatchSampler(BatchSampler(range(6), 2, False), 1))


def test_a_torch_batch_sampler_may_batch_a_skipped_stream():
    assert list(BatchSampler(SkipSampler(range(7), 2), 2, drop_last=False)) == [[2, 3], [4, 5], [6]]


@pytest.mark.parametrize("call, error, match", [
    (lambda: SkipSampler(range(3), -1), ValueError, "skip must be a non-negative int, got -1"),
    (lambda: SkipBatchSampler(BatchSampler(range(3), 1, False), True), ValueError,
     "skip must be a non-negative int, got True"),
    (lambda: DistributedSampler(range(3), 0, 0), ValueError, "num_workers must be a positive int, got 0"),
    (lambda: DistributedSampler(range(3), 2, 2), ValueError, r"rank must be an int in \[0, 2\), got 2"),
    (lambda: DistributedBatchSampler(BatchSampler(range(3), 1, False), 2, -1), ValueError,
     r"rank must be an int in \[0, 2\), got -1"),
    (lambda: ReproducibleShuffleSampler(range(3), seed=-1), ValueError, "seed must be a non-negative int, got -1"),
    (lambda: ReproducibleShuffleSampler(range(3)).set_epoch(-1), ValueError, "epoch must be a non-negative int, got -1"),
    (lambda: RepeatSampler(range(0)), ValueError, "sampler must not be empty"),
    (lambda: RepeatBatchSampler(BatchSampler(range(1), 2, True)), ValueError, "batch_sampler must not be empty"),
    (lambda: RepeatSampler(5), TypeError, "sampler must be a re-iterable sampler, got int"),
    (lambda: SkipBatchSampler(iter([[0]]), 1), TypeError, "batch_sampler must be a re-iterable sampler"),
])
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_pass_that_yields_nothing_raises_instead_of_hanging():
    class Empty:
        def __iter__(self):
            return iter(())

    with pytest.raises(RuntimeError, match="yielded nothing in pass 0"):
        take(RepeatSampler(Empty()), 1)


def test_a_random_sampler_without_generator_is_warned_about():
    with pytest.warns(UserWarning, match="without a generator"):
        RepeatSampler(RandomSampler(range(4)))


# -- through a DataLoader --------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_dataloader_yields_the_chain_batches(num_workers):
    n, w, bs = 10, 2, 3
    data = [1000 + i for i in range(n)]
    for r, skip in [(0, 0), (1, 0), (1, 7), (0, 40)]:
        loader = DataLoader(data, batch_sampler=training(n, w, r, bs, skip), num_workers=num_workers)
        got = [b.tolist() for b in take(loader, 5)]
        assert got == [[1000 + i for i in expected_batch(t, n, w, r, bs)] for t in range(skip, skip + 5)]


def test_dataloader_with_a_skipped_shuffle_sampler():
    data = [1000 + i for i in range(11)]
    order = spec_permutation(11, SEED, 2)
    for skip in range(13):
        sampler = ReproducibleShuffleSampler(range(11), seed=SEED)
        sampler.set_epoch(2)
        loader = DataLoader(data, batch_size=4, sampler=SkipSampler(sampler, skip))
        assert [b.tolist() for b in loader] == [[1000 + i for i in c] for c in chunks(order[skip:], 4)]
