"""The replica check (``Estimator(check_replicas_every=N)``) on 2 gloo ranks: a healthy run with it
ends bit-identical to one without, and costs one ``all_gather`` and one host read every N steps,
nothing on the steps between; a run where one weight of rank 1 moves by 1e-3 at the end of step 6,
saving every step, stops on both ranks naming rank 1 and the steps, with no checkpoint of the
diverged state; the resume from its last checkpoint ends bit-identical to the healthy run; under
HSDP the ranks of the replicated mesh dimension are compared. In one process: the refusal under
FSDP2 without a replicated dimension, and the argument's check."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint, distributed
from estimatorch.distributed import ReplicaDivergenceError
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochBegin

EVERY, DIVERGE_AT, EPOCHS = 3, 6, 2
STEPS = 64 // 2 // 4  # per epoch and rank


def build(check=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                    seed=3, check_replicas_every=check)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.arange(64) % 3)
    return est, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)


def params(est):
    return [p.detach().clone() for p in est.net.parameters()]


class Perturb(BatchEnd):
    """Rank 1's first weight moves by 1e-3 at the end of step ``at`` (a flipped bit, say)."""

    priority = float("inf")

    def __init__(self, at):
        self.at = at

    def batch_end(self, est, **kw):
        if est.position.step + 1 == self.at and distributed.get_rank() == 1:
            with torch.no_grad():
                est.net[0].weight[0, 0] += 1e-3


class Probe(BatchBegin, EpochBegin):
    """The collectives and host reads between consecutive batch_begins of an epoch (one step)."""

    priority = -float("inf")

    def __init__(self, counts):
        self.counts, self.steps, self.last = counts, [], None

    def epoch_begin(self, est, **kw):
        self.last = None

    def batch_begin(self, est, **kw):
        now = Counter(self.counts)
        if self.last is not None:
            self.steps.append((est.position.step, dict(now - self.last)))
        self.last = now


def _ranks(root):
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = {}
    est, loader = build()
    est.fit(loader, epochs=EPOCHS)
    out["plain"] = params(est)

    counts: Counter = Counter()
    gather, tolist = dist.all_gather, torch.Tensor.tolist

    def counted_gather(*args, **kwargs):
        counts["all_gather"] += 1
        return gather(*args, **kwargs)

    def counted_tolist(self, *args, **kwargs):
        counts["tolist"] += 1
        return tolist(self, *args, **kwargs)

    dist.all_gather, torch.Tensor.tolist = counted_gather, counted_tolist
    try:
        est, loader = build(EVERY)
        probe = Probe(counts)
        est.fit(loader, epochs=EPOCHS, event_handlers=[probe])
    finally:
        dist.all_gather, torch.Tensor.tolist = gather, tolist
    out["checked"], out["per_step"] = params(est), probe.steps

    model_dir = os.path.join(root, "model")
    saving = dict(batch_period=1, epoch_period=None, max_checkpoints=None)
    est, loader = build(5)
    try:
        est.fit(loader, epochs=EPOCHS, event_handlers=[CheckpointHandler(model_dir, **saving), Perturb(DIVERGE_AT)])
    except ReplicaDivergenceError as err:
        out["error"] = (str(err), err.ranks, err.steps)
    out["files"] = sorted(os.listdir(model_dir))
    est, loader = build(5)
    history = est.fit(loader, epochs=EPOCHS,
                      event_handlers=[CheckpointHandler(model_dir, resume_from_checkpoint=True, **saving)])
    out["resumed"], out["ledger"] = params(est), history.ledger
    out["hsdp"] = [_hsdp(perturb) for perturb in (False, True)]
    return out


def _hsdp(perturb):
    """HSDP over both ranks (a 2 x 1 mesh: two replicas of one shard), checked every 2 steps."""
    est, loader = _sharded((2, 1), every=2)
    try:
        est.fit(loader, epochs=1, event_handlers=[Perturb(3)] if perturb else [])
    except ReplicaDivergenceError as err:
        return err.ranks, err.steps
    return est.position.step


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return distributed.spawn(_ranks, 2, str(tmp_path_factory.mktemp("replicas")), backend="gloo")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_healthy_run_with_the_check_ends_bit_identical_to_one_without(ranks):
    for result in ranks:
        assert all(torch.equal(a, b) for a, b in zip(result["checked"], result["plain"]))


@pytest.mark.distributed
@pytest.mark.slow
def test_a_check_is_one_all_gather_and_one_host_read_every_n_steps_and_nothing_between(ranks):
    for result in ranks:
        per_step = result["per_step"]
        assert len(per_step) == EPOCHS * (STEPS - 1)
        # the probe of step s + 1 sees what step s did: a check where s is a multiple of EVERY
        expected = [{"all_gather": 1, "tolist": 1} if done % EVERY == 0 else {} for done, _ in per_step]
        assert [counts for _, counts in per_step] == expected


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_whose_weights_moved_stops_the_run_naming_it_with_no_checkpoint_of_that_state(ranks):
    for result in ranks:
        message, odd, steps = result["error"]  # on every rank, the same
        assert odd == [1] and steps == (5, DIVERGE_AT)
        assert message.startswith(f"the replicas diverged between step 5 and step {DIVERGE_AT}: rank 1's parameters "
                                  "and optimizer state differ from rank 0's (found by the check before the "
                                  f"checkpoint of step {DIVERGE_AT} (not written)")
    saved = [name for name in ranks[0]["files"] if name.endswith(".pt")]
    assert saved == sorted(f"model-epoch0batch{s}.pt" for s in range(1, DIVERGE_AT))  # none of the diverged state
    assert checkpoint.PROGRESS_NAME in ranks[0]["files"]  # the failed attempt, for the ledger


@pytest.mark.distributed
@pytest.mark.slow
def test_the_resume_starts_from_the_last_good_state_and_ends_bit_identical(ranks):
    for result in ranks:
        assert all(torch.equal(a, b) for a, b in zip(result["resumed"], result["plain"]))
    first, second = ranks[0]["ledger"]["attempts"]
    assert first["ended"] == "failed" and first["reason"].startswith("ReplicaDivergenceError: the replicas diverged")
    assert (first["last_step"], first["steps_lost"], second["resumed_from"]) == (DIVERGE_AT, 1, DIVERGE_AT - 1)
    assert ranks[1]["ledger"] is None  # kept by rank 0


@pytest.mark.distributed
@pytest.mark.slow
def test_under_hsdp_the_replicated_dimension_is_checked(ranks):
    for result in ranks:
        healthy, diverged = result["hsdp"]
        assert healthy == STEPS and diverged == ([1], (2, 4))  # moved at step 3's end, found at the check of 4


# -- in one process -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -3, 2.5, "5", True])
def test_check_replicas_every_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=f"check_replicas_every must be a positive int or None, got {value!r}"):
        build(value)


def test_one_process_has_no_replicas_to_compare_and_trains_as_without(monkeypatch):
    calls = []
    monkeypatch.setattr(distributed, "gather_fingerprints", lambda *a: calls.append(a))
    est, loader = build(1)
    est.fit(loader, epochs=1)
    reference, loader = build()
    reference.fit(loader, epochs=1)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(params(est), params(reference)))


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone (FSDP2 needs one), removed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(mesh_shape, every=5):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    est, loader = build(every)
    names = ("replicate", "shard")[-len(mesh_shape):]
    fully_shard(est.net, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    est.optimizer = torch.optim.SGD(est.net.parameters(), lr=0.1, momentum=0.9)
    return est, loader


def test_fsdp_without_a_replicated_dimension_is_refused_at_fit_start(one_rank_group):
    est, loader = build(5)
    est.strategy = "fsdp"
    with pytest.raises(ValueError, match=r"check_replicas_every=5 compares the ranks that hold copies of the same "
                                         r"state, but strategy='fsdp' shards every parameter over all the ranks"):
        est.fit(loader, epochs=1)
    est, loader = _sharded((1,))
    with pytest.raises(ValueError, match="net is sharded with fully_shard over every mesh dimension: each rank holds "
                                         "the only copy of its shard. Shard over a 2-D mesh"):
        est.fit(loader, epochs=1)
    est, loader = _sharded((1, 1))  # HSDP: the replicated dimension is what a check compares
    est.fit(loader, epochs=1)
    assert est.position.step == 2 * STEPS
