"""GradientUpdateHandler: optimizer steps, gradient accumulation, clipping, and its state."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from estimatorch.event_handlers import BatchEnd, GradientUpdateHandler
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
    assert state == {"pending": 0, "grads": None}
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
