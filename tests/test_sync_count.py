"""Watching training costs no host-device sync except where something is shown or decided.

Every way a tensor's value reaches the host (``item``, ``bool``, ``float``, ``tolist``, ``cpu``,
``numpy``) is counted during a fit with the progress bar, logging every N batches, TensorBoard
every N batches and the NaN check every N batches. Twice the steps with the same number of
firings must cost exactly the same syncs, and a step where nothing fires must cost none.
"""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch

from estimatorch.event_handlers import (
    LambdaHandler,
    LoggingHandler,
    ProgressBarHandler,
    TensorBoardHandler,
    TerminateOnNaNHandler,
)
from tests.conftest import make_batches, make_estimator

SYNCS = ("item", "__bool__", "__float__", "tolist", "cpu", "numpy")
EPOCHS = 4


@pytest.fixture
def syncs(monkeypatch):
    """A Counter of the host transfers made while the fixture is active."""
    counts: Counter = Counter()
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def watched_fit(tmp_path, syncs, batches_per_epoch, interval):
    """Fit with the four watching handlers firing every ``interval`` batches. Returns the
    syncs of the whole fit and, per step, the syncs between its batch_begin and the end of its
    batch_end (probes at both ends)."""
    est = make_estimator()
    data = make_batches(batches_per_epoch, batch_size=4)
    per_step: list[int] = []
    mark = []
    first = LambdaHandler(batch_begin=lambda e, **kw: mark.append(sum(syncs.values())), priority=-float("inf"))
    last = LambdaHandler(batch_end=lambda e, **kw: per_step.append(sum(syncs.values()) - mark[-1]),
                         priority=float("inf"))
    handlers = [
        first,
        ProgressBarHandler(refresh_interval=1e9, file=io.StringIO()),  # redraws only when a bar opens or closes
        LoggingHandler(log_interval=interval),
        TensorBoardHandler(tmp_path / f"tb{batches_per_epoch}", log_interval=interval),
        TerminateOnNaNHandler(check_every=interval),
        last,  # after LoggingHandler and ProgressBarHandler (+inf too): the order given breaks ties
    ]
    syncs.clear()
    est.fit(data, epochs=EPOCHS, event_handlers=handlers)
    total = Counter(syncs)
    assert len(per_step) == EPOCHS * batches_per_epoch
    return total, per_step


def test_syncs_grow_with_firings_not_with_steps(tmp_path, syncs):
    short, short_steps = watched_fit(tmp_path, syncs, batches_per_epoch=50, interval=50)   # 200 steps
    long, long_steps = watched_fit(tmp_path, syncs, batches_per_epoch=100, interval=100)   # 400 steps
    assert sum(short.values()) > 0  # the counting works: firings do read values
    assert long == short  # twice the steps, the same firings: exactly the same syncs
    for steps, interval in ((short_steps, 50), (long_steps, 100)):
        quiet = [n for i, n in enumerate(steps, start=1) if i % interval]
        assert quiet == [0] * len(quiet)  # a step where nothing fires reads nothing
        assert all(n > 0 for i, n in enumerate(steps, start=1) if i % interval == 0)


def test_the_same_cadence_over_more_steps_adds_only_the_extra_firings(tmp_path, syncs):
    """LoggingHandler(log_interval=50) & co over 200 and 400 steps: the extra syncs are those of
    the extra firings (as many again), none from the extra steps."""
    short, short_steps = watched_fit(tmp_path, syncs, batches_per_epoch=50, interval=50)
    long, long_steps = watched_fit(tmp_path, syncs, batches_per_epoch=100, interval=50)
    per_firing = short_steps[49]  # what one firing step of every handler costs
    firings = {50: EPOCHS, 100: 2 * EPOCHS}
    assert [n for n in long_steps if n] == [per_firing] * firings[100]
    assert sum(long.values()) - sum(short.values()) == (firings[100] - firings[50]) * per_firing


@pytest.mark.parametrize("invariant", [False, True], ids=["items", "world_size_invariant"])
def test_the_items_rule_and_the_slot_tree_read_nothing_on_the_host_per_step(syncs, invariant):
    """A token loss with padding (labels -100), 2 accumulation steps, clipping: the window's count
    of labels stays a device tensor, and under world_size_invariant the tree's folds and the clip
    by rows read nothing either. Only the default handlers, which fire at the epoch's end; SGD (AdamW
    reads its step count with .item() on the CPU)."""
    from torch import nn

    from estimatorch import Estimator
    from estimatorch.event_handlers import GradientUpdateHandler

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), _ClassesFirst())
    est = Estimator(net, nn.CrossEntropyLoss(ignore_index=-100), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    world_size_invariant=invariant)
    labels = (torch.arange(16 * 5) % 3).view(16, 5).masked_fill(torch.arange(16 * 5).view(16, 5) % 7 == 0, -100)
    data = torch.utils.data.TensorDataset(torch.randn(16, 5, 4), labels)
    per_step: list[int] = []
    mark = []
    first = LambdaHandler(batch_begin=lambda e, **kw: mark.append(sum(syncs.values())), priority=-float("inf"))
    last = LambdaHandler(batch_end=lambda e, **kw: per_step.append(sum(syncs.values()) - mark[-1]),
                         priority=float("inf"))
    update = GradientUpdateHandler(accumulation_steps=2, clip_grad_norm=0.5)
    syncs.clear()
    est.fit(torch.utils.data.DataLoader(data, batch_size=2), epochs=2, event_handlers=[first, update, last])
    assert est.step_items is None and len(per_step) == 16  # weighed during the fit (2 steps per window)
    assert per_step == [0] * 16
    assert sum(syncs.values()) > 0  # the counting works: the epochs' ends read the metrics


# -- collectives under torch.distributed ------------------------------------------------------------
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "gather_object", "broadcast_object_list",
               "barrier", "reduce", "gather", "scatter", "reduce_scatter", "all_to_all")


class _CountedWork:
    def __init__(self, work, counts):
        self._work, self._counts = work, counts

    def wait(self, *args, **kwargs):
        self._counts["waits"] += 1
        if not self._work.is_completed():
            self._counts["waits on incomplete work"] += 1
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        return self._work.is_completed()


def _count_collectives_per_step(every, tokens=False):
    """Count every torch.distributed collective a 2-rank fit makes (a blocking call, an async
    start, a wait on its work) and return the counts between consecutive batch_begins of one
    epoch: what one step costs, its epoch's end excluded. ``tokens``: a per-token loss whose
    labels are partly -100 (each rank's items differ: the items rule sums them)."""
    import torch.distributed as dist
    from torch import nn

    from estimatorch import Estimator
    from estimatorch.event_handlers import BatchBegin, EpochBegin

    counts: Counter = Counter()

    def counting(name, original):
        def counted(*args, **kwargs):
            if kwargs.get("async_op"):
                counts[f"{name} started"] += 1
                return _CountedWork(original(*args, **kwargs), counts)
            counts[f"{name} blocking"] += 1
            return original(*args, **kwargs)
        return counted

    for name in COLLECTIVES:
        setattr(dist, name, counting(name, getattr(dist, name)))

    class Probe(BatchBegin, EpochBegin):
        priority = -float("inf")

        def __init__(self):
            self.steps, self.last = [], None

        def epoch_begin(self, est, **kw):
            self.last = None

        def batch_begin(self, est, **kw):
            now = Counter(counts)
            if self.last is not None:
                self.steps.append(dict(now - self.last))
            self.last = now

    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    if tokens:  # (N, T, 4) -> per-token logits (N, 3, T), labels (N, T) with padding
        net = nn.Sequential(net, _ClassesFirst())
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    est.agree_every = every
    data = torch.utils.data.TensorDataset(torch.randn(80, 4), torch.arange(80) % 3)
    if tokens:
        labels = (torch.arange(80 * 5) % 3).view(80, 5).masked_fill(torch.arange(80 * 5).view(80, 5) % 7 == 0, -100)
        data = torch.utils.data.TensorDataset(torch.randn(80, 5, 4), labels)
    probe = Probe()
    est.fit(torch.utils.data.DataLoader(data, batch_size=4, shuffle=True), epochs=3, event_handlers=[probe])
    return {"steps": probe.steps, "total": dict(counts)}


class _ClassesFirst(torch.nn.Module):
    def forward(self, x):
        return x.movedim(-1, 1)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_token_loss_sums_its_items_in_one_collective_per_step_started_before_the_backward():
    """The items rule's cost under DDP: one all-reduce of one integer per optimizer step, started
    asynchronously (before the step's backward, on a gloo group of its own) and waited for at the
    step; no blocking collective per step, and no host-device sync is needed for it."""
    from estimatorch import distributed

    for result in distributed.spawn(_count_collectives_per_step, 2, None, True, backend="gloo"):
        steps = result["steps"]
        assert [step.get("all_reduce started", 0) for step in steps] == \
            [1 + int((epoch * 10 + i) % 16 == 0) for epoch in range(3) for i in range(1, 10)]
        assert all(not k.endswith("blocking") for step in steps for k in step)
        assert [step.get("waits", 0) for step in steps] == \
            [1 + int(i > 1 and (epoch * 10 + i - 1) % 16 == 0) for epoch in range(3) for i in range(1, 10)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("every, period", [(None, 16), (1, 1), (3, 3)])
def test_the_per_step_path_makes_no_blocking_collective(every, period):
    """Default handlers on 2 gloo ranks: a step makes no blocking collective (the epoch's ends
    do); a step whose number (counted over the run) is a multiple of ``agree_every`` starts one
    flag exchange, read at the next step (gloo's default: every 16 steps). Whether a read finds
    the exchange complete depends on timing, so it is printed, not asserted."""
    from estimatorch import distributed

    for rank, result in enumerate(distributed.spawn(_count_collectives_per_step, 2, every, backend="gloo")):
        steps = result["steps"]
        assert len(steps) == 3 * (10 - 1)  # 10 batches per epoch on each rank
        blocking = [{k: v for k, v in step.items() if k.endswith("blocking")} for step in steps]
        assert blocking == [{}] * len(steps), f"rank {rank}"
        numbers = [(epoch * 10 + i, i) for epoch in range(3) for i in range(1, 10)]  # (step, in epoch)
        assert [step.get("all_reduce started", 0) for step in steps] == [int(n % period == 0) for n, _ in numbers]
        # an epoch's first step has no earlier exchange to read (the epoch's end agreed on it)
        assert [step.get("waits", 0) for step in steps] == [int(i > 1 and (n - 1) % period == 0) for n, i in numbers]
        print(f"rank {rank}: {sum(step.get('waits on incomplete work', 0) for step in steps)} of "
              f"{sum(step.get('waits', 0) for step in steps)} reads waited for an exchange still in flight")
        assert sum(v for k, v in result["total"].items() if k.endswith("blocking")) > 0  # counting works
