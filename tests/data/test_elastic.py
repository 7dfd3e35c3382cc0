"""The elastic layout: any world size x accumulation with the same micro-batches per step gives
every slot the same samples; the fit's data must be one it can lay out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, rng
from estimatorch.event_handlers import BatchBegin
from estimatorch.data._elastic import ElasticLayout, slot_positions


@pytest.mark.parametrize("n, drop_last", [(48, False), (45, False), (45, True), (5, False)])
def test_slots_of_one_epoch_cover_each_sample_once_and_differ_by_at_most_one_in_the_last_step(n, drop_last):
    batch_size, slots = 4, 8
    steps = n // (batch_size * slots) + (1 if n % (batch_size * slots) and not drop_last else 0)
    seen = []
    for step in range(steps):
        sizes = [len(slot_positions(n, batch_size, slots, step, m)) for m in range(slots)]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
        seen += [p for m in range(slots) for p in slot_positions(n, batch_size, slots, step, m)]
    kept = n if not drop_last else n // (batch_size * slots) * batch_size * slots
    assert sorted(set(seen)) == list(range(kept))
    assert len(seen) == max(kept, steps * slots)  # repeats only to give every slot a sample


def _slots(world_size, accumulation, n=45, epoch=1):
    """Every slot's samples, step by step, gathered from the layouts of every rank."""
    def order(e):
        return torch.randperm(n, generator=torch.Generator().manual_seed(e))

    layouts = [ElasticLayout(order, ["shuffled", 0], n, 4, world_size, rank, accumulation, False, 0)
               for rank in range(world_size)]
    per_rank = [list(layout.index_batches(epoch, 0)) for layout in layouts]
    assert len({layout.batches_per_epoch for layout in layouts}) == 1
    micro = [layouts[r].micro_batch(b) for r in range(world_size) for b in range(len(per_rank[r]))]
    assert sorted(micro) == list(range(len(micro)))  # every global micro-batch once
    return {layouts[r].micro_batch(b): batch for r in range(world_size) for b, batch in enumerate(per_rank[r])}


def test_every_topology_of_a_global_batch_trains_the_same_samples_per_slot():
    reference = _slots(4, 1)
    assert _slots(2, 2) == reference
    assert _slots(1, 4) == reference
    assert _slots(2, 1) != reference  # another global batch: other steps


def test_a_resume_in_the_middle_of_an_epoch_continues_with_the_same_batches():
    order = lambda e: torch.arange(40)  # noqa: E731
    layout = ElasticLayout(order, ["sequential", None], 40, 4, 2, 1, 2, False, 0)
    assert list(layout.index_batches(0, 3)) == list(layout.index_batches(0, 0))[3:]


def test_reseeding_makes_each_micro_batchs_draws_a_function_of_its_place():
    order = lambda e: torch.arange(16)  # noqa: E731
    one = ElasticLayout(order, ["sequential", None], 16, 2, 1, 0, 2, False, 7)
    two = ElasticLayout(order, ["sequential", None], 16, 2, 2, 1, 1, False, 7)
    draws_one = [torch.rand(1).item() for _ in one.reseeding(iter(range(4)), 0, 0)]
    draws_two = [torch.rand(1).item() for _ in two.reseeding(iter(range(2)), 0, 0)]
    assert draws_two == draws_one[1::2]  # rank 1 of 2 trains slot 1 of each step


def test_seeded_state_is_what_seed_everything_leaves_and_changes_nothing():
    before = torch.get_rng_state()
    state = rng.seeded_state(5, cuda=False)
    assert torch.equal(torch.get_rng_state(), before)
    rng.seed_everything(5)
    assert torch.equal(state["torch"], torch.get_rng_state())


def test_elastic_needs_a_dataloader_it_can_lay_out(tmp_path):
    net = nn.Linear(2, 1)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    data = [(torch.randn(2, 2), torch.randn(2, 1))] * 2
    with pytest.raises(ValueError, match="elastic=True lays the samples.*map-style DataLoader.*"
                                         "got train_data that is a list or tuple of batches"):
        est.fit(data, epochs=1, event_handlers=[CheckpointHandler(str(tmp_path), elastic=True)])


def draws_follow_the_micro_batch(device, tmp_path):
    """In an elastic fit on ``device``, what a micro-batch draws (dropout's generator: the CPU's,
    or the CUDA device's) is the draw of ``seed_position(seed, epoch, micro-batch)``. Returns the
    (got, wanted) pairs."""
    drawn = []

    class Draw(BatchBegin):
        def batch_begin(self, est, **kw):
            drawn.append((est.position.epoch, est.position.batch, torch.rand(3, device=device).cpu()))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=3,
                    device=device)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.arange(24) % 2)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    est.fit(loader, epochs=2, event_handlers=[Draw(), GradientUpdateHandler(accumulation_steps=2),
                                              CheckpointHandler(str(tmp_path), elastic=True)])
    pairs = []
    for epoch, batch, got in drawn:
        rng.seed_position(3, epoch, batch, device=torch.device(device))  # one process: micro-batch = batch
        pairs.append((got, torch.rand(3, device=device).cpu()))
    assert len(pairs) == 12
    return pairs


def test_each_micro_batch_of_an_elastic_fit_draws_from_its_place(tmp_path):
    for got, wanted in draws_follow_the_micro_batch("cpu", tmp_path):
        assert torch.equal(got, wanted)


@pytest.mark.parametrize("n, drop_last", [(48, False), (45, False), (5, False), (45, True)])
def test_step_samples_is_what_the_slots_of_each_step_hold(n, drop_last):
    """The items of a step of samples, known without asking the other ranks."""
    layout = ElasticLayout(None, [], n, 4, 2, 0, 4, drop_last, 0)
    for step in range(layout.steps):
        assert layout.step_samples(step) == sum(len(slot_positions(n, 4, 8, step, m)) for m in range(8))


def test_a_split_no_accumulation_keeps_is_named(monkeypatch):
    """4 micro-batches per step saved, resumed on 3 processes: no accumulation_steps keeps them."""
    from estimatorch import distributed
    from estimatorch.data._fingerprint import compare_fingerprints

    saved = ElasticLayout(None, [], 48, 4, 2, 0, 2, False, 0).fingerprint()
    now = ElasticLayout(None, [], 48, 4, 3, 0, 1, False, 0).fingerprint()
    monkeypatch.setattr(distributed, "get_world_size", lambda: 3)
    with pytest.raises(ValueError, match=r"saved 4 samples x 4 micro-batches per optimizer step, now 4 samples x 3 "
                                         r"micro-batches.*no accumulation_steps keeps 4 micro-batches on 3 processes: "
                                         r"resume on a number of processes that divides 4"):
        compare_fingerprints(saved, now, "ckpt")
