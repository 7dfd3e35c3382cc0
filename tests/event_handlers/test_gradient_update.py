"""GradientUpdateHandler: optimizer steps, gradient accumulation, clipping, and its state."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from estimatorch.event_handlers import BatchEnd, GradientUpdateHandler
from estimatorch.events import subscribes
from tests.conftest import make_batches, make_estimator

LR = 0.1


def counting_steps(est):
    """Wrap the estimator's optimizer.step to count the calls."""
    calls = []
    step = est.optimizer.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    est.optimizer.step = counted
    return calls


def hand_train(net, groups, clip=None):
    """The reference: for each group of batches, one SGD step on the mean of their gradients
    (each batch's gradient of its mean loss), clipped with torch's own clip_grad_norm_."""
    net = copy.deepcopy(net)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    for group in groups:
        grads = [torch.autograd.grad(nn.functional.cross_entropy(net(x), y), params) for x, y in group]
        for p, *gs in zip(params, *grads):
            p.grad = torch.stack(gs).sum(0) / len(group)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return net


def assert_same_params(a, b, exact=False):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(pa, pb), name
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)


def assert_params_differ(a, b):
    assert any(not torch.allclose(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


# -- arguments ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_bad_accumulation_steps(bad):
    with pytest.raises(ValueError) as info:
        GradientUpdateHandler(accumulation_steps=bad)
    assert "accumulation_steps" in str(info.value) and repr(bad) in str(info.value)


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "1", True])
def test_bad_clip_grad_norm(bad):
    with pytest.raises(ValueError) as info:
        GradientUpdateHandler(clip_grad_norm=bad)
    assert "clip_grad_norm" in str(info.value) and repr(bad) in str(info.value)


def test_defaults_and_priority():
    h = GradientUpdateHandler(clip_grad_norm=2)
    assert (h.accumulation_steps, h.clip_grad_norm) == (1, 2.0)
    assert isinstance(h.clip_grad_norm, float)
    assert h.priority == -2000


# -- stepping -----------------------------------------------------------------------------------
def test_one_step_per_batch_matches_a_hand_loop():
    est, batches = make_estimator(lr=LR), make_batches(4)
    net0 = copy.deepcopy(est.net)
    steps = counting_steps(est)
    est.fit(batches, epochs=2)
    assert len(steps) == 2 * len(batches)
    assert_same_params(est.net, hand_train(net0, [[b] for b in batches] * 2), exact=True)


def test_gradients_are_zeroed_after_each_step():
    seen = []

    class After(BatchEnd):  # priority 0: after the step (-2000)
        def batch_end(self, estimator, **kwargs):
            seen.append([p.grad for p in estimator.net.parameters()])

    make_estimator().fit(make_batches(3), epochs=1, event_handlers=[After()])
    assert all(g is None for grads in seen for g in grads)


@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_equals_one_step_on_the_averaged_gradient(k):
    est, batches = make_estimator(lr=LR), make_batches(4)
    net0 = copy.deepcopy(est.net)
    steps = counting_steps(est)
    est.fit(batches, epochs=2, event_handlers=[GradientUpdateHandler(accumulation_steps=k)])
    assert len(steps) == 2 * len(batches) // k
    groups = [batches[i:i + k] for i in range(0, len(batches), k)] * 2
    assert_same_params(est.net, hand_train(net0, groups))
    # and it is not the same as stepping every batch
    assert_params_differ(est.net, hand_train(net0, [[b] for b in batches] * 2))


def test_leftover_batches_are_stepped_at_epoch_end():
    est, batches = make_estimator(lr=LR), make_batches(5)
    net0 = copy.deepcopy(est.net)
    steps = counting_steps(est)
    est.fit(batches, epochs=2, event_handlers=[GradientUpdateHandler(accumulation_steps=2)])
    # per epoch: [b1, b2], [b3, b4], then the leftover [b5] alone (its mean is itself)
    assert len(steps) == 2 * 3
    groups = [batches[0:2], batches[2:4], batches[4:5]] * 2
    assert_same_params(est.net, hand_train(net0, groups))


def test_epoch_cut_short_by_a_batches_plan_steps_its_leftover():
    est, batches = make_estimator(lr=LR), make_batches(4)
    net0 = copy.deepcopy(est.net)
    steps = counting_steps(est)
    est.fit(batches, batches=3, event_handlers=[GradientUpdateHandler(accumulation_steps=2)])
    assert len(steps) == 2
    assert_same_params(est.net, hand_train(net0, [batches[0:2], batches[2:3]]))


def test_clip_grad_norm_matches_torch_applied_by_hand():
    clip = 0.05
    est, batches = make_estimator(lr=LR), make_batches(4)
    net0 = copy.deepcopy(est.net)
    # the clip must bite for the test to mean anything
    x, y = batches[0]
    grads = torch.autograd.grad(nn.functional.cross_entropy(net0(x), y), list(net0.parameters()))
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) > clip
    est.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler(accumulation_steps=2, clip_grad_norm=clip)])
    groups = [batches[0:2], batches[2:4]]
    assert_same_params(est.net, hand_train(net0, groups, clip=clip))
    assert_params_differ(est.net, hand_train(net0, groups))


def test_stale_gradients_do_not_leak_into_the_first_step():
    est, batches = make_estimator(lr=LR), make_batches(1)
    net0 = copy.deepcopy(est.net)
    for p in est.net.parameters():  # e.g. left by a manual backward or a failed fit
        p.grad = torch.full_like(p, 100.0)
    est.fit(batches, epochs=1)
    assert_same_params(est.net, hand_train(net0, [batches]), exact=True)


# -- state --------------------------------------------------------------------------------------
def _step_by_hand(est, h, batch):
    x, y = batch
    est.loss(est.net(x), y).backward()
    h.batch_end(est, batch=batch, pred=None, label=y, loss=None)


def test_state_carries_accumulated_gradients_and_a_load_reproduces_them():
    batches = make_batches(3)
    # uninterrupted: three batches, one step
    ref_est, ref = make_estimator(lr=LR), GradientUpdateHandler(accumulation_steps=3)
    ref.train_begin(ref_est)
    for b in batches:
        _step_by_hand(ref_est, ref, b)
    # interrupted after one batch: its gradients travel in the state
    est, h = make_estimator(lr=LR), GradientUpdateHandler(accumulation_steps=3)
    h.train_begin(est)
    _step_by_hand(est, h, batches[0])
    state = h.state_dict()
    assert state["pending"] == 1
    for p, g in zip(est.net.parameters(), state["grads"]):
        assert torch.equal(p.grad, g) and g is not p.grad
    # a fresh estimator and handler continue from the state
    new_est, new = make_estimator(lr=LR), GradientUpdateHandler(accumulation_steps=3)
    new.train_begin(new_est)
    new.load_state_dict(state)
    for p, g in zip(new_est.net.parameters(), state["grads"]):
        assert torch.equal(p.grad, g)
    assert_state_equal(new.state_dict(), state)
    for b in batches[1:]:
        _step_by_hand(new_est, new, b)
    assert new.pending == 0
    assert_same_params(new_est.net, ref_est.net, exact=True)


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    assert a["pending"] == b["pending"]
    if b["grads"] is None:
        assert a["grads"] is None
    else:
        assert len(a["grads"]) == len(b["grads"])
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


def test_state_between_steps_round_trips():
    est, h = make_estimator(), GradientUpdateHandler()
    est.fit(make_batches(2), epochs=1, event_handlers=[h])
    state = h.state_dict()
    assert state == {"pending": 0, "grads": None, "items": None}
    fresh = GradientUpdateHandler()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


@pytest.mark.parametrize("key", ["pending", "grads"])
def test_load_missing_key(key):
    state = {"pending": 0, "grads": None}
    del state[key]
    with pytest.raises(ValueError, match=key):
        GradientUpdateHandler().load_state_dict(state)


def test_load_refuses_gradients_for_other_parameters():
    est, h = make_estimator(), GradientUpdateHandler(accumulation_steps=2)
    h.train_begin(est)
    with pytest.raises(ValueError, match="1 gradients"):
        h.load_state_dict({"pending": 1, "grads": [torch.zeros(3)]})


def test_one_instance_serves_two_fits():
    h = GradientUpdateHandler(accumulation_steps=3)
    nets = []
    for _ in range(2):
        est = make_estimator(lr=LR)
        steps = counting_steps(est)
        est.fit(make_batches(4), epochs=2, event_handlers=[h])
        nets.append((est.net, len(steps)))
    assert nets[0][1] == nets[1][1] == 2 * 2  # per epoch: [b1..b3], leftover [b4]
    assert_same_params(nets[0][0], nets[1][0], exact=True)


def test_batch_begin_is_subscribed_only_with_accumulation_also_when_a_subclass_sets_it():
    """It chooses whether DDP synchronises a batch: needed with accumulation only."""
    import pickle


    class Accumulating(GradientUpdateHandler):
        def __init__(self, clip=1.0):
            super().__init__(accumulation_steps=4, clip_grad_norm=clip)

    assert not subscribes(GradientUpdateHandler(), "batch_begin")
    assert subscribes(GradientUpdateHandler(2), "batch_begin") and subscribes(Accumulating(), "batch_begin")
    for handler in (GradientUpdateHandler(2), GradientUpdateHandler()):  # spawn pickles its arguments
        copy_ = pickle.loads(pickle.dumps(handler))
        assert type(copy_) is type(handler) and copy_.accumulation_steps == handler.accumulation_steps


# -- under DDP: no_sync on the micro-batches that do not step ------------------------------------
def _ddp_accumulation(k, ckpt_dir=None, resume=False):
    """2 epochs of 5 batches per rank with accumulation ``k``: counts DDP's gradient
    synchronisations (a comm hook) and what DDP's sync flag was in each forward."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from estimatorch import CheckpointHandler, Estimator
    from estimatorch.event_handlers import ForwardBegin, TrainBegin

    class Watch(TrainBegin, ForwardBegin):
        def __init__(self):
            self.syncs, self.flags = 0, []

        def train_begin(self, est, **kw):
            def hook(state, bucket):
                self.syncs += 1
                return allreduce_hook(state, bucket)

            est.train_net.register_comm_hook(None, hook)

        def forward_begin(self, est, **kw):
            self.flags.append(est.train_net.require_backward_grad_sync)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=3)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(50, 4, generator=g), torch.randint(0, 3, (50,), generator=g))
    watch = Watch()
    handlers = [watch, GradientUpdateHandler(accumulation_steps=k)]
    if ckpt_dir is not None:
        handlers.append(CheckpointHandler(ckpt_dir, batch_period=1, epoch_period=None, max_checkpoints=None,
                                          resume_from_checkpoint=resume))
    est.fit(torch.utils.data.DataLoader(data, batch_size=5, shuffle=True), epochs=2, event_handlers=handlers)
    return {"syncs": watch.syncs, "flags": watch.flags, "model": est.net.state_dict(),
            "optimizer": est.optimizer.state_dict(), "flag_after": est.train_net.require_backward_grad_sync}


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_synchronises_only_the_batch_that_completes_a_window():
    from estimatorch import distributed

    every = distributed.spawn(_ddp_accumulation, 2, 1, backend="gloo")
    windows = distributed.spawn(_ddp_accumulation, 2, 3, backend="gloo")
    buckets = every[0]["syncs"] // 10  # 10 synchronised backwards without accumulation
    assert buckets >= 1 and every[0]["flags"] == [True] * 10
    for r in windows:
        # per epoch of 5: batches 1-3 step on batch 3; 4-5 are the epoch's leftover, averaged
        # across ranks in one all-reduce at its end
        assert r["flags"] == [False, False, True, False, False] * 2
        assert r["syncs"] == 2 * buckets and r["flag_after"] is True
    assert_tree_equal_params(windows[0]["model"], windows[1]["model"])  # ranks still in step


def assert_tree_equal_params(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("step, pending", [(1, 1), (4, 1), (7, 2)])  # a window, the leftover, the next epoch
def test_ddp_resume_mid_window_is_bit_identical(step, pending, tmp_path):
    """The accumulated gradients differ per rank under no_sync: each rank's are saved, and a
    resume mid-window ends bit-identical to the uninterrupted run."""
    import shutil

    from estimatorch import distributed

    full = tmp_path / "full"
    reference = distributed.spawn(_ddp_accumulation, 2, 3, str(full), backend="gloo")
    name = f"model-epoch{(step - 1) // 5}batch{step}.pt"
    payload = torch.load(full / name, weights_only=True)
    grads = [rank["handlers"]["GradientUpdateHandler"]["grads"] for rank in payload["ranks"]]
    assert [rank["handlers"]["GradientUpdateHandler"]["pending"] for rank in payload["ranks"]] == [pending] * 2
    assert any(not torch.equal(a, b) for a, b in zip(*grads))  # unsynchronised: per rank
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copy(full / name, resume)
    resumed = distributed.spawn(_ddp_accumulation, 2, 3, str(resume), True, backend="gloo")
    for want, got in zip(reference, resumed):
        assert_tree_equal_params(got["model"], want["model"])
        assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
        for key, state in want["optimizer"]["state"].items():
            assert all(torch.equal(state[s], got["optimizer"]["state"][key][s]) for s in state)


def test_a_step_of_every_batch_is_capturable_and_a_replay_counts_as_a_step():
    plain, clipped = GradientUpdateHandler(), GradientUpdateHandler(clip_grad_norm=1.0)
    assert plain.capturable_batch_end and clipped.capturable_batch_end
    assert not GradientUpdateHandler(accumulation_steps=2).capturable_batch_end  # two kinds of batch

    class OwnStep(GradientUpdateHandler):
        def batch_end(self, estimator, **kwargs):
            super().batch_end(estimator, **kwargs)

    class SameStep(GradientUpdateHandler):
        pass

    assert not OwnStep().capturable_batch_end and SameStep().capturable_batch_end
    replayed = plain.record_batch_end(None)
    plain.stepped = False
    replayed()
    assert plain.stepped is True


# -- world_size_invariant in one process -------------------------------------------------------------
def _invariant_fit(invariant, k, clip=None, net=None):
    from estimatorch import Estimator

    torch.manual_seed(0)
    net = net or nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=LR),
                    world_size_invariant=invariant)
    data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*make_batches(8, batch_size=4))))
    handler = GradientUpdateHandler(accumulation_steps=k, clip_grad_norm=clip)
    est.fit(torch.utils.data.DataLoader(data, batch_size=4), epochs=1, event_handlers=[handler])
    return est.net, handler


def test_world_size_invariant_sums_the_slots_in_the_tree_the_default_sums_them_in_order():
    """Two slots: one addition either way, the same bits; four: ((g0 + g1) + (g2 + g3)) against
    ((g0 + g1) + g2) + g3, the same to rounding; the clip's norm is added by rows."""
    plain, _ = _invariant_fit(False, 2)
    tree, handler = _invariant_fit(True, 2)
    assert_same_params(tree, plain, exact=True)
    assert handler.reduction is not None and handler.reduction.bytes_sent == 0  # one process: nothing sent
    assert_same_params(_invariant_fit(True, 4)[0], _invariant_fit(False, 4)[0])
    assert_same_params(_invariant_fit(True, 2, clip=0.05)[0], _invariant_fit(False, 2, clip=0.05)[0])
    assert_params_differ(_invariant_fit(True, 2, clip=0.05)[0], plain)  # the clip bites


def test_world_size_invariant_is_a_bool_without_cuda_graphs_and_running_statistics_are_named_at_fit_start():
    from estimatorch import Estimator

    net = nn.Linear(4, 3)
    with pytest.raises(TypeError, match="world_size_invariant must be a bool, got 'yes'"):
        Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  world_size_invariant="yes")
    with pytest.raises(ValueError, match="world_size_invariant=True and cuda_graphs=True cannot be combined"):
        Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                  world_size_invariant=True, cuda_graphs=True)
    with pytest.warns(UserWarning, match=r"running statistics of 1 are not"):
        _invariant_fit(True, 2, net=nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))


def test_world_size_invariant_leaves_a_frozen_parameter_of_the_optimizer_alone():
    from estimatorch import Estimator

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net[0].weight.requires_grad_(False)
    frozen = net[0].weight.detach().clone()
    est = Estimator(net, nn.CrossEntropyLoss(), world_size_invariant=True,
                    optimizer=torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.5))
    data = torch.utils.data.TensorDataset(*map(torch.cat, zip(*make_batches(4, batch_size=4))))
    est.fit(torch.utils.data.DataLoader(data, batch_size=4), epochs=1,
            event_handlers=[GradientUpdateHandler(accumulation_steps=2)])
    assert torch.equal(net[0].weight, frozen) and net[0].weight.grad is None
