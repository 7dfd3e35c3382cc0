"""The stop flags ride in DDP's gradient all-reduce (estimator/_flag_carrier.py): the encoding, the
gradients left bit-identical to DDP's default all-reduce, the flags waiting for the micro-step
that synchronises under accumulation, and the GPU's one-step-late read (forced here on the CPU):
the stop it has in flight at a checkpoint resumes to the same step."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, distributed
from estimatorch.estimator._flag_carrier import SLOTS, _decode, encode
from tests.conftest import Count, assert_tree_equal
from tests.estimator.test_stop_agreement import AskStop, _estimator


@pytest.mark.parametrize("stop, code", [(False, 0), (True, 0), (False, 1), (True, 2)])
def test_an_outbox_decodes_to_its_flags(stop, code):
    assert len(encode(stop, code)) == SLOTS
    assert _decode(torch.tensor(encode(stop, code), dtype=torch.float32)) == (int(stop), code)


def test_summed_outboxes_give_any_stop_and_the_strongest_signal():
    summed = sum(torch.tensor(encode(*flags), dtype=torch.bfloat16) for flags in [(False, 1), (True, 2), (False, 0)])
    assert _decode(summed) == (1, 2)
    assert _decode(torch.zeros(SLOTS)) == (0, 0)


# -- 2 gloo ranks ----------------------------------------------------------------------------------
def _ddp_steps(hooked):
    """Three SGD steps of a DDP net, default all-reduce or with the carrier's hook (rank 1 asks
    to stop in its outbox): parameters and what the hook brought back."""
    from estimatorch.estimator._flag_carrier import attach_carrier

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5))
    ddp = nn.parallel.DistributedDataParallel(net)
    carrier = attach_carrier(ddp) if hooked else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + distributed.get_rank())
    arrived = []
    for _ in range(3):
        if carrier is not None:
            carrier.outbox = encode(distributed.get_rank() == 1, 0)
        ddp(torch.randn(16, 7, generator=g)).pow(2).mean().backward()
        if carrier is not None:
            arrived.append(carrier.collect())
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.clone() for k, v in net.state_dict().items()}, "arrived": arrived}


def _both(flag):
    return [_ddp_steps(False), _ddp_steps(True)] if flag else None


@pytest.mark.distributed
@pytest.mark.slow
def test_the_hook_leaves_the_gradients_bit_identical_to_ddps_default():
    for rank, (plain, hooked) in enumerate(distributed.spawn(_both, 2, True, backend="gloo")):
        assert_tree_equal(hooked["params"], plain["params"], f"rank {rank}")
        assert hooked["arrived"] == [(True, (1, 0))] * 3, f"rank {rank}: rank 1's stop reached every rank"


def _fit(arg, lag=0, accumulation=1, ckpt_dir=None, resume=False):
    if lag:  # the GPU's one-step-late read, on the CPU
        from estimatorch.estimator import _flag_carrier

        made = _flag_carrier.FlagCarrier.__init__

        def lagged(self, world_size, lag):
            made(self, world_size, 1)

        _flag_carrier.FlagCarrier.__init__ = lagged
    est, loader = _estimator()
    count = Count()
    handlers = [count, AskStop(arg), GradientUpdateHandler(accumulation_steps=accumulation)]
    if ckpt_dir is not None:
        handlers.append(CheckpointHandler(ckpt_dir, batch_period=1, epoch_period=None, max_checkpoints=None,
                                          resume_from_checkpoint=resume))
    est.fit(loader, epochs=2, event_handlers=handlers)
    return {"step": est.position.step, "batches": count.batches, "phase": est.position.phase,
            "model": est.net.state_dict(), "optimizer": est.optimizer.state_dict()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("asked, step", [({1: 2}, 4), ({1: 3}, 4), ({0: 1, 1: 1}, 2)])
def test_under_accumulation_the_flags_ride_on_the_micro_step_that_synchronises(asked, step):
    """2 micro-steps per window: steps 2 and 4 all-reduce, 1 and 3 run under no_sync."""
    for r in distributed.spawn(_fit, 2, asked, 0, 2, backend="gloo"):
        assert (r["step"], r["batches"], r["phase"]) == (step, step, "epoch_end")


@pytest.mark.distributed
@pytest.mark.slow
def test_read_a_step_late_a_stop_in_flight_at_a_checkpoint_resumes_to_the_same_step(tmp_path):
    """Rank 1 asks during step 2: step 3's all-reduce carries it, step 4's boundary reads it. The
    checkpoint of step 3 holds it in flight; a run resumed from it stops at step 4 as well."""
    ckpt = tmp_path / "ckpt"
    first = distributed.spawn(_fit, 2, {1: 2}, 1, 1, str(ckpt), backend="gloo")
    assert [(r["step"], r["phase"]) for r in first] == [(4, "epoch_end")] * 2
    payload = torch.load(ckpt / "model-epoch0batch3.pt", weights_only=True)
    assert [(s["pending_stop"], s["stop_in_flight"]) for s in payload["ranks"]] == [(False, True)] * 2
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    shutil.copy(ckpt / "model-epoch0batch3.pt", resume_dir)
    resumed = distributed.spawn(_fit, 2, {}, 1, 1, str(resume_dir), True, backend="gloo")
    for want, got in zip(first, resumed):
        assert (got["step"], got["batches"], got["phase"]) == (4, 1, "epoch_end")
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")


def _fits(hooks):
    """A 2-epoch fit with the flags carried and one with DDP's default all-reduce (no hook)."""
    from estimatorch.estimator import _strategy

    out = []
    for hooked in hooks:
        carried = _strategy.attach_carrier
        if not hooked:
            _strategy.attach_carrier = lambda ddp: None
        try:
            est, loader = _estimator()
            est.fit(loader, epochs=2)
        finally:
            _strategy.attach_carrier = carried
        out.append({"model": est.net.state_dict(), "optimizer": est.optimizer.state_dict()})
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_fit_trains_the_same_bits_with_and_without_the_hook():
    for rank, (hooked, plain) in enumerate(distributed.spawn(_fits, 2, (True, False), backend="gloo")):
        assert_tree_equal(hooked["model"], plain["model"], f"rank {rank} model")
        assert_tree_equal(hooked["optimizer"], plain["optimizer"], f"rank {rank} optimizer")
