"""The plan before fit (``planned_steps``), schedules checked against it or sized from it
(``lr_scheduler`` as a callable, ``lr_scheduler_interval``), and ``fit``'s per-epoch limits."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, OneCycleLR, SequentialLR, StepLR
from torch.utils.data import DataLoader, TensorDataset

from estimatorch import Estimator, GradientUpdateHandler, StoppingHandler
from estimatorch.estimator._plan.counts import count_steps
from estimatorch.estimator._plan.schedules import scheduler_horizon
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochBegin
from estimatorch.testing import assert_resumable


def make_estimator(**kwargs):
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if "lr_scheduler" in kwargs and isinstance(kwargs["lr_scheduler"], type):
        kwargs["lr_scheduler"] = kwargs["lr_scheduler"](opt, T_max=kwargs.pop("T_max"))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, **kwargs)


def batches(n, size=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def loader(samples=40, batch_size=4):
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(samples, 4, generator=g), torch.randint(0, 3, (samples,), generator=g))
    return DataLoader(data, batch_size=batch_size, shuffle=True)


def optimizer_steps(est):
    """Count est.optimizer.step() calls from now on."""
    count = [0]
    est.optimizer.register_step_post_hook(lambda *a: count.__setitem__(0, count[0] + 1))
    return count


# -- the count itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("per_epoch, k, epochs, batches", [
    (10, 1, 3, None), (10, 3, 3, None), (10, 4, None, 25), (7, 2, None, 30), (5, 5, 2, None), (1, 1, None, 9)])
def test_count_steps_matches_a_step_by_step_count(per_epoch, k, epochs, batches):
    """The closed count against a simulation of the loop: a step every k batches, plus one for
    an epoch's leftover; a batches= plan re-iterates epochs until the total is reached."""
    steps, done, epoch = 0, 0, 0
    while (epochs is None or epoch < epochs) and (batches is None or done < batches):
        pending = 0
        for _ in range(per_epoch):
            if batches is not None and done >= batches:
                break
            done += 1
            pending += 1
            if pending == k:
                steps, pending = steps + 1, 0
        steps += pending > 0
        epoch += 1
    assert count_steps(per_epoch, k, epochs, batches) == steps


def test_count_steps_from_a_position_counts_what_is_left():
    total = count_steps(10, 1, 3, None)
    assert count_steps(10, 1, 3, None, epoch=1, batch=4, done=14) == total - 14
    assert count_steps(10, 1, None, 25, epoch=2, batch=0, done=20) == 5


def test_horizon_of_each_kind_of_schedule():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert scheduler_horizon(CosineAnnealingLR(opt, T_max=7)) == 7
    assert scheduler_horizon(OneCycleLR(opt, max_lr=1.0, total_steps=9)) == 9
    assert scheduler_horizon(LinearLR(opt, total_iters=4)) == 4
    warm, cos = LinearLR(opt, 0.1, total_iters=3), CosineAnnealingLR(opt, T_max=12)
    assert scheduler_horizon(SequentialLR(opt, [warm, cos], milestones=[3])) == 15
    assert scheduler_horizon(StepLR(opt, step_size=2)) is None


# -- planned_steps ---------------------------------------------------------------------------------
def test_planned_steps_is_the_number_of_optimizer_steps_fit_takes():
    cases = [
        (dict(epochs=3), []),
        (dict(batches=23), []),
        (dict(epochs=3), [GradientUpdateHandler(accumulation_steps=3)]),
        (dict(epochs=4), [StoppingHandler(max_epoch=2)]),
        (dict(epochs=3, batches_per_epoch=4), []),
        (dict(epochs=2, batches_per_epoch=5), [GradientUpdateHandler(accumulation_steps=2)]),
    ]
    for plan, handlers in cases:
        est = make_estimator()
        count = optimizer_steps(est)
        planned = est.planned_steps(loader(), event_handlers=handlers, **plan)
        est.fit(loader(), event_handlers=handlers, **plan)
        assert planned == count[0], (plan, handlers)


def test_planned_steps_under_torchrun_before_the_process_group_exists(monkeypatch):
    """torchrun's variables are all there is before fit: a DataLoader is counted as this
    process's share (40 samples, batch 4, 2 processes: 5 batches an epoch)."""
    est = make_estimator()
    one = est.planned_steps(loader(), epochs=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not torch.distributed.is_initialized()
    assert est.planned_steps(loader(), epochs=2) == one // 2 == 10


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of epochs and batches"),
    (dict(epochs=2, batches=3), "exactly one of epochs and batches"),
    (dict(epochs=0), "epochs"),
    (dict(epochs=2, batches_per_epoch=0), "batches_per_epoch must be a positive int or None, got 0"),
])
def test_planned_steps_refuses_a_bad_plan_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_estimator().planned_steps(batches(3), **kwargs)


def test_planned_steps_of_data_without_length_needs_batches_per_epoch():
    est = make_estimator()
    data = iter(batches(5))
    with pytest.raises(ValueError, match="batches_per_epoch"):
        est.planned_steps((b for b in batches(5)), epochs=2)
    assert est.planned_steps(data, batches=5) == 5
    assert est.planned_steps((b for b in batches(5)), epochs=1, batches_per_epoch=3) == 3


# -- schedules against the plan --------------------------------------------------------------------
def test_a_per_batch_schedule_of_another_length_warns_with_both_numbers_at_the_fit_line():
    est = make_estimator(lr_scheduler=CosineAnnealingLR, T_max=100, lr_scheduler_interval="batch")
    with pytest.warns(UserWarning, match=r"ends after 100 optimizer steps, but this fit's plan takes 30") as record:
        est.fit(batches(10), epochs=3)
    assert record[0].filename == __file__  # the user's line, not the library's


def test_a_schedule_that_fits_the_plan_does_not_warn():
    data = batches(10)
    est = make_estimator(lr_scheduler=CosineAnnealingLR, T_max=15, lr_scheduler_interval="batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.fit(data, epochs=3, batches_per_epoch=5)
    assert est.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # reached eta_min
    per_epoch = make_estimator(lr_scheduler=CosineAnnealingLR, T_max=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        per_epoch.fit(data, epochs=3)


def test_a_callable_lr_scheduler_is_built_at_fit_start_with_the_planned_steps():
    seen = []

    def schedule(optimizer, total_steps):
        seen.append(total_steps)
        return CosineAnnealingLR(optimizer, T_max=total_steps)

    est = make_estimator(lr_scheduler=schedule, lr_scheduler_interval="batch")
    assert est.lr_scheduler is None and est.lr_scheduler_factory is schedule
    handlers = [GradientUpdateHandler(accumulation_steps=3)]
    planned = est.planned_steps(batches(10), epochs=2, event_handlers=handlers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.fit(batches(10), epochs=2, event_handlers=handlers)
    assert seen == [planned] == [8]  # 10 batches by 3: 3 steps and a leftover, twice
    assert est.lr_scheduler.last_epoch == planned  # stepped with every optimizer step, the leftovers too
    assert est.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    per_epoch = make_estimator(lr_scheduler=schedule, lr_scheduler_interval="epoch")
    per_epoch.fit(batches(10), epochs=4)
    assert seen[-1] == 4 and per_epoch.lr_scheduler.last_epoch == 4


def test_a_callable_lr_scheduler_counts_optimizer_steps_by_default():
    """``lr_scheduler=lambda opt, total: ...`` without an interval: sized and stepped in optimizer
    steps, the unit of ``total_steps``; a scheduler object keeps PyTorch's per-epoch convention."""
    seen = []

    def schedule(optimizer, total_steps):
        seen.append(total_steps)
        return CosineAnnealingLR(optimizer, T_max=total_steps)

    est = make_estimator(lr_scheduler=schedule)
    assert est.lr_scheduler_interval == "batch"
    est.fit(batches(5), epochs=2)
    assert seen == [10] and est.lr_scheduler.last_epoch == 10
    assert make_estimator(lr_scheduler=CosineAnnealingLR, T_max=3).lr_scheduler_interval == "epoch"
    assert make_estimator().lr_scheduler_interval == "epoch"


def test_a_callable_lr_scheduler_that_returns_no_scheduler_is_an_error():
    est = make_estimator(lr_scheduler=lambda optimizer, total_steps: None)
    with pytest.raises(TypeError, match="must return a torch LR scheduler"):
        est.fit(batches(2), epochs=1)
    assert est.lr_scheduler is None


def test_lr_scheduler_interval_batch_steps_every_batch_with_no_handler_of_yours():
    rates = []

    class Rates(BatchBegin):
        def batch_begin(self, est, **kw):
            rates.append(est.optimizer.param_groups[0]["lr"])

    est = make_estimator(lr_scheduler=CosineAnnealingLR, T_max=6, lr_scheduler_interval="batch")
    est.fit(batches(3), epochs=2, event_handlers=[Rates()])
    assert len(set(rates)) == 6  # a new rate every batch
    with pytest.raises(ValueError, match=r"lr_scheduler_interval must be 'epoch' or 'batch' \(or None.*got 'step'"):
        make_estimator(lr_scheduler_interval="step")
    with pytest.raises(TypeError, match="lr_scheduler must be a torch LR scheduler or a callable"):
        make_estimator(lr_scheduler=3)


# -- batches_per_epoch / val_batches -----------------------------------------------------------------
def test_batches_per_epoch_caps_each_epoch_and_each_starts_at_its_data_start():
    seen = []

    class Record(EpochBegin, BatchBegin):
        def epoch_begin(self, est, **kw):
            seen.append([])

        def batch_begin(self, est, batch, **kw):
            seen[-1].append(batch[0][0, 0].item())

    data = batches(10)
    est = make_estimator()
    history = est.fit(data, epochs=3, batches_per_epoch=4, event_handlers=[Record()])
    firsts = [b[0][0, 0].item() for b in data[:4]]
    assert seen == [firsts] * 3
    assert est.batches_per_epoch == 4 and est.position.step == 12 and len(history["train_loss"]) == 3


def test_val_batches_caps_each_evaluation_during_fit_only():
    counted = []

    class Count(BatchBegin):
        def batch_begin(self, est, **kw):
            counted.append(1)

    from estimatorch import ValidationHandler

    est = make_estimator()
    val = batches(6)
    est.fit(batches(2), val_data=None, epochs=2, val_batches=2,
            event_handlers=[ValidationHandler(val, est.evaluate, event_handlers=[Count()])])
    assert len(counted) == 4  # 2 batches in each of 2 evaluations
    counted.clear()
    est.evaluate(val, event_handlers=[Count()])
    assert len(counted) == 6  # outside fit: all of them


@pytest.mark.parametrize("arg", ["batches_per_epoch", "val_batches"])
def test_a_bad_limit_is_refused_before_any_work(arg):
    est = make_estimator()
    before = [p.clone() for p in est.net.parameters()]
    with pytest.raises(ValueError, match=f"{arg} must be a positive int or None, got 0"):
        est.fit(batches(2), epochs=1, **{arg: 0})
    assert all(torch.equal(a, b) for a, b in zip(before, est.net.parameters()))


@pytest.mark.parametrize("value, shown", [(0, "0"), (2.0, "2.0"), (True, "True")])
def test_a_bad_agree_every_is_refused_before_any_work(value, shown):
    est = make_estimator()
    est.agree_every = value
    before = [p.clone() for p in est.net.parameters()]
    with pytest.raises((TypeError, ValueError), match=f"agree_every must be a positive int or None, got {shown}"):
        est.fit(batches(2), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, est.net.parameters()))


def test_agree_every_changes_nothing_in_one_process():
    """One process exchanges nothing: a stop takes effect at its step whatever agree_every."""
    class AskAt(BatchEnd):
        def batch_end(self, est, **kw):
            return est.position.step + 1 == 2

    est = make_estimator()
    est.agree_every = 5
    est.fit(batches(4), epochs=1, event_handlers=[AskAt()])
    assert est.position.step == 2


@pytest.mark.slow
def test_a_run_with_batches_per_epoch_resumes_bit_identically(tmp_path):
    def make():
        return make_estimator(lr_scheduler=lambda o, n: CosineAnnealingLR(o, n), lr_scheduler_interval="batch")

    assert_resumable(make, loader(), epochs=3, batches_per_epoch=4, stop_at=[2, 4, 5, 9], quiet=True,
                     workdir=str(tmp_path))


def test_a_resumed_fit_in_process_continues_with_the_same_limit():
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C must reach fit (see test_distributed)

    class CtrlC(BatchEnd):
        def __init__(self):
            self.seen = 0

        def batch_end(self, est, **kw):
            self.seen += 1
            if self.seen == 4:
                signal.raise_signal(signal.SIGINT)

    full = make_estimator()
    full.fit(batches(10), epochs=2, batches_per_epoch=3)
    split = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        split.fit(batches(10), epochs=2, batches_per_epoch=3, event_handlers=[CtrlC()])
    assert split.position.step == 4
    split.fit(batches(10), epochs=2, batches_per_epoch=3, resume=True)
    assert split.position.step == full.position.step == 6
    for a, b in zip(full.net.parameters(), split.net.parameters()):
        assert torch.equal(a, b)


# -- extending a finished run ----------------------------------------------------------------------
def test_extending_a_finished_run_past_its_schedule_warns_saying_what_to_do(tmp_path):
    from estimatorch import CheckpointHandler

    def make():
        return make_estimator(lr_scheduler=lambda o, n: CosineAnnealingLR(o, n), lr_scheduler_interval="batch")

    first = make()
    first.fit(batches(4), epochs=2, event_handlers=[CheckpointHandler(tmp_path)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same plan again: nothing to warn about
        make().fit(batches(4), epochs=2, event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    with pytest.warns(UserWarning, match=r"ends after 8 optimizer steps, but the new plan runs to 12.*raises the "
                                         r"learning rate again.*new run") as record:
        make().fit(batches(4), epochs=3, event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    assert record[0].filename == __file__
    with pytest.warns(UserWarning, match="the new plan runs to 12"):
        first.fit(batches(4), epochs=3, resume=True)


def test_a_callable_lr_scheduler_over_data_without_length_is_refused_before_any_work():
    est = make_estimator(lr_scheduler=lambda o, n: CosineAnnealingLR(o, n), lr_scheduler_interval="batch")
    before = [p.clone() for p in est.net.parameters()]
    with pytest.raises(ValueError, match="lr_scheduler is a callable sized from the plan, but train_data has no "
                                         "length.*batches_per_epoch="):
        est.fit(_Endless(), epochs=2, event_handlers=[GradientUpdateHandler(accumulation_steps=2)])
    assert all(torch.equal(a, b) for a, b in zip(before, est.net.parameters()))
    est.fit(_Endless(), epochs=2, batches_per_epoch=3)  # a limit makes it countable
    assert est.lr_scheduler.T_max == 6


class _Endless(torch.utils.data.IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(3)
        while True:
            yield torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
