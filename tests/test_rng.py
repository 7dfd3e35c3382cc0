"""rng: seeding, capture and restore of python random, torch and the library's numpy Generator."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from estimatorch import rng


def draws():
    """One draw from each stream estimatorch manages."""
    return (random.random(), torch.rand(3).tolist(), rng.default_numpy_rng().random(2).tolist())


def legacy_numpy_state():
    state = np.random.get_state()
    return (state[0], state[1].tobytes(), state[2:])


@pytest.fixture(autouse=True)
def _keep_global_state():
    """These tests reseed the process-wide generators: put them back afterwards."""
    saved = rng.get_state()
    legacy = np.random.get_state()
    yield
    rng.set_state(saved)
    np.random.set_state(legacy)


# -- seed_everything ----------------------------------------------------------------------------
def test_seed_everything_seeds_all_three_streams():
    assert rng.seed_everything(123) == 123
    first = draws()
    rng.seed_everything(123)
    assert draws() == first
    rng.seed_everything(124)
    assert all(a != b for a, b in zip(draws(), first))


def test_seed_everything_matches_each_library_seeded_directly():
    rng.seed_everything(7)
    ours = draws()
    random.seed(7)
    torch.manual_seed(7)
    theirs = (random.random(), torch.rand(3).tolist(), np.random.Generator(np.random.PCG64(7)).random(2).tolist())
    assert ours == theirs


def test_default_seed():
    assert rng.seed_everything() == rng.DEFAULT_SEED == 0
    first = draws()
    rng.seed_everything(rng.DEFAULT_SEED)
    assert draws() == first


def test_default_numpy_rng_is_one_object_reseeded_in_place():
    g = rng.default_numpy_rng()
    rng.seed_everything(5)
    assert rng.default_numpy_rng() is g
    assert g.random() == np.random.Generator(np.random.PCG64(5)).random()


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_bad_seed(bad):
    with pytest.raises(ValueError) as info:
        rng.seed_everything(bad)
    assert "seed" in str(info.value) and repr(bad) in str(info.value)


def test_numpy_integer_seed():
    assert rng.seed_everything(np.int64(3)) == 3


def test_never_touches_numpys_legacy_global_rng():
    before = legacy_numpy_state()
    rng.seed_everything(11)
    draws()
    with rng.sample_seeding(1, 2, restore=True) as seed_sample:
        seed_sample(3)
        draws()
        np.random.random()
    with rng.keep_random_state():
        rng.seed_everything(12)
    rng.set_state(rng.get_state())
    rng.seed_worker(0)
    assert legacy_numpy_state() == before


# -- get_state / set_state ----------------------------------------------------------------------
def test_get_set_state_restores_every_stream():
    rng.seed_everything(3)
    draws()
    state = rng.get_state()
    expected = draws()
    draws()
    rng.set_state(state)
    assert draws() == expected


def test_state_keys():
    state = rng.get_state()
    assert {"python", "torch", "numpy"} <= set(state)
    assert ("cuda" in state) == torch.cuda.is_available()


def test_state_survives_torch_save_with_weights_only(tmp_path):
    rng.seed_everything(9)
    state = rng.get_state()
    expected = draws()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    rng.seed_everything(10)
    rng.set_state(torch.load(path, weights_only=True))
    assert draws() == expected


def test_python_state_as_lists_is_accepted():
    # serialisers other than torch.save turn tuples into lists
    rng.seed_everything(4)
    state = rng.get_state()
    expected = draws()
    version, internal, gauss = state["python"]
    state["python"] = [version, list(internal), gauss]
    rng.set_state(state)
    assert draws() == expected


@pytest.mark.parametrize("key", ["python", "torch", "numpy"])
def test_set_state_refuses_a_missing_key_and_restores_nothing(key):
    state = rng.get_state()
    del state[key]
    rng.seed_everything(21)
    expected = draws()
    rng.seed_everything(21)
    with pytest.raises(ValueError) as info:
        rng.set_state(state)
    assert repr(key) in str(info.value)
    assert draws() == expected


def test_set_state_refuses_an_unknown_key():
    state = dict(rng.get_state(), numpy_legacy=np.random.get_state())
    with pytest.raises(ValueError, match="'numpy_legacy'"):
        rng.set_state(state)


def test_set_state_refuses_another_bit_generator():
    state = dict(rng.get_state(), numpy=np.random.Generator(np.random.MT19937(0)).bit_generator.state)
    with pytest.raises(ValueError, match="MT19937"):
        rng.set_state(state)


def test_set_state_refuses_cuda_states_for_another_device_count():
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    state = dict(rng.get_state(), cuda=[torch.zeros(8, dtype=torch.uint8)] * (have + 1))
    with pytest.raises(ValueError, match=f"{have + 1} CUDA"):
        rng.set_state(state)


def test_set_state_refuses_a_non_dict():
    with pytest.raises(TypeError, match="list"):
        rng.set_state([])


# -- keep_random_state --------------------------------------------------------------------------
def test_keep_random_state_as_a_context_manager():
    rng.seed_everything(1)
    state = rng.get_state()
    expected = draws()
    rng.set_state(state)
    with rng.keep_random_state():
        draws()
        rng.seed_everything(99)
        draws()
    assert draws() == expected


def test_keep_random_state_as_a_decorator():
    @rng.keep_random_state()
    def noisy():
        draws()
        return "done"

    rng.seed_everything(1)
    expected = draws()
    rng.seed_everything(1)
    assert noisy() == "done"
    assert draws() == expected


def test_keep_random_state_restores_on_exception():
    rng.seed_everything(1)
    expected = draws()
    rng.seed_everything(1)
    with pytest.raises(RuntimeError, match="boom"):
        with rng.keep_random_state():
            draws()
            raise RuntimeError("boom")
    assert draws() == expected


def test_keep_random_state_decorator_restores_on_exception():
    @rng.keep_random_state()
    def fails():
        draws()
        raise KeyError("x")

    rng.seed_everything(2)
    expected = draws()
    rng.seed_everything(2)
    with pytest.raises(KeyError):
        fails()
    assert draws() == expected


def test_keep_random_state_recursion_and_reuse():
    shield = rng.keep_random_state()

    @shield
    def recurse(n):
        draws()
        if n:
            recurse(n - 1)

    rng.seed_everything(3)
    expected = draws()
    rng.seed_everything(3)
    recurse(3)  # every level enters the same object before the outer one exits
    assert draws() == expected
    rng.seed_everything(3)
    with shield:
        draws()
        with shield:
            draws()
        draws()
    assert draws() == expected


# -- seed_worker --------------------------------------------------------------------------------
@pytest.mark.parametrize("torch_seed", [5, 2**40 + 17])
def test_seed_worker_seeds_from_the_workers_torch_seed(torch_seed):
    torch.manual_seed(torch_seed)  # what a DataLoader does in each worker
    rng.seed_worker(3)
    got = (random.random(), rng.default_numpy_rng().random())
    worker_seed = torch_seed % 2**32
    random.seed(worker_seed)
    assert got == (random.random(), np.random.Generator(np.random.PCG64(worker_seed)).random())


def test_seed_worker_in_a_dataloader():
    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor([random.random(), rng.default_numpy_rng().random()])

    def run():
        loader = torch.utils.data.DataLoader(Draws(), batch_size=2, num_workers=2, worker_init_fn=rng.seed_worker,
                                             generator=torch.Generator().manual_seed(0))
        return torch.cat(list(loader))

    first, second = run(), run()
    assert torch.equal(first, second)
    assert len(set(first[:, 1].tolist())) == 4  # the two workers draw different numbers


# -- derive_seed --------------------------------------------------------------------------------
@pytest.mark.slow  # starts a python process that imports torch
def test_derive_seed_is_a_pure_function():
    code = "from estimatorch import rng; print(rng.derive_seed(1, 2, 3))"
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other_process.stdout) == rng.derive_seed(1, 2, 3)


def test_derive_seed_separates_parts():
    seeds = {rng.derive_seed(seed, epoch, index) for seed in range(4) for epoch in range(20) for index in range(50)}
    assert len(seeds) == 4 * 20 * 50
    assert rng.derive_seed(1, 2) != rng.derive_seed(2, 1)
    assert rng.derive_seed(0) != rng.derive_seed(0, 0) != rng.derive_seed()


def test_derive_seed_range():
    values = [rng.derive_seed(i, -i, 2**70 + i) for i in range(100)]
    assert all(isinstance(v, int) and 0 <= v < 2**63 for v in values)
    rng.seed_everything(max(values))  # usable as a seed


@pytest.mark.parametrize("part", [1.5, 1.0, True, "1", None, torch.tensor(1.5)])
def test_derive_seed_refuses_what_is_not_an_integer(part):
    """1.5 used to hash like 1: two different positions, one seed."""
    with pytest.raises(TypeError, match="derive_seed takes integers"):
        rng.derive_seed(0, part)


def test_derive_seed_takes_integers_of_any_kind():
    assert rng.derive_seed(0, 1) == rng.derive_seed(0, np.int64(1)) == rng.derive_seed(0, torch.tensor(1))


# -- seed range ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 2**32, 2**63, 2**64 - 1])
def test_every_seed_in_range_seeds_every_generator(seed):
    assert rng.seed_everything(seed) == seed
    a = draws()
    rng.seed_everything(seed)
    assert draws() == a


@pytest.mark.parametrize("seed", [2**64, 2**100, -1])
def test_a_seed_some_generator_refuses_is_a_clear_error_before_any_is_seeded(seed):
    """2**64 used to reseed python's random, then fail in torch ("Overflow when unpacking long
    long"): a half-applied seed."""
    rng.seed_everything(5)
    with pytest.raises(ValueError, match=rf"seed must be .*got {seed}"):
        rng.seed_everything(seed)
    after = draws()
    rng.seed_everything(5)
    assert after == draws()  # every stream is where seed 5 left it


# -- sample_seeding -----------------------------------------------------------------------------
def sample_draws(seed, epoch, order, restore=True):
    out = {}
    with rng.sample_seeding(seed, epoch, restore=restore) as seed_sample:
        for index in order:
            seed_sample(index)
            out[index] = draws()
    return out


def test_sample_seeding_restore_leaves_the_callers_streams_untouched():
    rng.seed_everything(8)
    expected = draws()
    rng.seed_everything(8)
    sample_draws(0, 1, range(5))
    assert draws() == expected


def test_sample_seeding_without_restore_leaves_the_last_samples_streams():
    rng.seed_everything(8)
    before = rng.get_state()
    sample_draws(0, 1, [3], restore=False)
    after = draws()
    rng.set_state(before)
    assert after != draws()


def test_per_sample_draws_do_not_depend_on_the_order():
    forward = sample_draws(5, 2, range(6))
    backward = sample_draws(5, 2, reversed(range(6)))
    shuffled = sample_draws(5, 2, [4, 0, 5, 1, 3, 2])
    assert forward == backward == shuffled


def test_per_sample_draws_depend_on_seed_epoch_and_index():
    base = sample_draws(5, 2, range(3))
    assert len({str(v) for v in base.values()}) == 3
    assert sample_draws(5, 3, range(3)) != base
    assert sample_draws(6, 2, range(3)) != base


def test_salt_separates_draws_of_one_sample():
    with rng.sample_seeding(0, 0, restore=True) as seed_sample:
        seed_sample(1)
        plain = draws()
        seed_sample(1, salt=1)
        salted = draws()
        seed_sample(1)
        again = draws()
    assert plain == again and plain != salted


def test_sample_seeding_restores_on_exception():
    rng.seed_everything(8)
    expected = draws()
    rng.seed_everything(8)
    with pytest.raises(IndexError):
        with rng.sample_seeding(0, 0, restore=True) as seed_sample:
            seed_sample(0)
            draws()
            raise IndexError
    assert draws() == expected


def test_per_sample_seeding_covers_numpys_legacy_global_rng():
    """Augmentation libraries draw from np.random: a sample's draws are a function of its
    position there too, whatever came before (the worker that served it, the resume point)."""
    def draw(index, noise):
        with rng.sample_seeding(5, 1, restore=True) as seed_sample:
            np.random.random(noise)  # draws made before this sample, e.g. by other samples
            seed_sample(index)
            return np.random.normal(size=3).tolist()

    assert draw(7, 1) == draw(7, 13)
    assert draw(7, 1) != draw(8, 1)


def test_numpy_global_is_captured_and_restored_only_when_asked():
    rng.seed_everything(3, numpy_global=True)
    seeded = np.random.get_state()[1].copy()
    assert "numpy_global" not in rng.get_state()
    state = rng.get_state(numpy_global=True)
    expected = np.random.rand(3).tolist()
    rng.seed_everything(4)  # leaves np.random alone
    assert np.random.rand(3).tolist() != expected
    rng.set_state(state)
    assert np.random.rand(3).tolist() == expected
    rng.seed_everything(3, numpy_global=True)
    assert (np.random.get_state()[1] == seeded).all()
    rng.seed_everything(3 + (1 << 40), numpy_global=True)  # the whole 64-bit seed counts
    assert not (np.random.get_state()[1] == seeded).all()


def test_set_state_refuses_a_numpy_global_that_is_not_mt19937():
    state = dict(rng.get_state(), numpy_global={"kind": "PCG64"})
    with pytest.raises(ValueError, match="'numpy_global'"):
        rng.set_state(state)
