"""The Metric base: device accumulators, no host sync in update, compute, state, duck typing."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from estimatorch.metrics import (Accuracy, Loss, MeanAbsoluteError, MeanSquaredError, Metric, TopKAccuracy,
                                 is_metric, metric_name)
from estimatorch.metrics import base as metric_base
from estimatorch.metrics.base import split_loss_metrics, update_metrics
from tests.conftest import make_batches, make_estimator


class Sum(Metric):
    """A minimal subclass: a tensor and a python accumulator."""

    default_name = "sum"

    def __init__(self, name=None, device=None):
        super().__init__(name, device=device)
        self.add_state("total", torch.zeros((), dtype=torch.float64))
        self.add_state("count", 0)

    def update(self, preds, target):
        self.total.add_(preds.sum())
        self.count += preds.numel()

    def _value(self, states):
        return metric_base._ratio(states["total"], states["count"])


def inputs(metric_cls, device="cpu"):
    """A (preds, target) pair each built-in metric accepts."""
    g = torch.Generator().manual_seed(0)
    if metric_cls is Loss:
        return torch.rand((), generator=g).to(device), torch.zeros(4, device=device)
    if metric_cls in (Accuracy, TopKAccuracy):
        return torch.randn(4, 3, generator=g).to(device), torch.tensor([0, 1, 2, 1], device=device)
    return torch.randn(4, 1, generator=g).to(device), torch.randn(4, generator=g).to(device)


BUILT_INS = [Loss, Accuracy, TopKAccuracy, MeanSquaredError, MeanAbsoluteError]


def make(cls, **kwargs):
    return cls(2, **kwargs) if cls is TopKAccuracy else cls(**kwargs)


# -- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["", 3])
def test_bad_name(bad):
    with pytest.raises(ValueError) as info:
        Sum(bad)
    assert "name" in str(info.value) and repr(bad) in str(info.value)


def test_names_and_directions():
    assert [make(c).name for c in BUILT_INS] == ["loss", "accuracy", "top2_accuracy", "mse", "mae"]
    assert [make(c).higher_is_better for c in BUILT_INS] == [False, True, True, False, False]
    assert Sum("custom").name == "custom" and Sum().name == "sum"
    assert repr(Sum()) == "Sum(name='sum')"


def test_default_device_is_the_cpu():
    assert Sum().device == torch.device("cpu")
    assert Sum().total.device == torch.device("cpu")


# -- protocol -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", BUILT_INS + [Sum])
def test_compute_before_update_is_nan(cls):
    assert math.isnan(make(cls).compute())


@pytest.mark.parametrize("cls", BUILT_INS)
def test_reset_clears_and_returns_to_nan(cls):
    m = make(cls)
    m.update(*inputs(cls))
    assert not math.isnan(m.compute())
    m.reset()
    assert math.isnan(m.compute())
    m.update(*inputs(cls))
    fresh = make(cls)
    fresh.update(*inputs(cls))
    assert m.compute() == fresh.compute()


@pytest.mark.parametrize("cls", BUILT_INS)
def test_compute_returns_a_python_float(cls):
    m = make(cls)
    m.update(*inputs(cls))
    assert type(m.compute()) is float


def test_reset_clears_the_accumulators_in_place():
    """In place: a captured train step (cuda_graphs=True) keeps adding to the same memory."""
    m = Sum()
    before = m.total
    m.update(torch.ones(2), None)
    m.reset()
    assert m.total is before and float(m.total) == 0.0 and m.count == 0


# -- state --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", BUILT_INS)
def test_state_round_trip(cls):
    m = make(cls)
    m.update(*inputs(cls))
    state = m.state_dict()
    fresh = make(cls)
    fresh.load_state_dict(state)
    assert fresh.compute() == m.compute()
    for key, value in state.items():
        loaded = fresh.state_dict()[key]
        assert torch.equal(loaded, value) if isinstance(value, torch.Tensor) else loaded == value


def test_state_dict_is_a_copy():
    m = Sum()
    m.update(torch.ones(2), None)
    state = m.state_dict()
    m.update(torch.ones(2), None)
    assert float(state["total"]) == 2.0 and state["count"] == 2
    fresh = Sum()
    fresh.load_state_dict(state)
    state["total"].add_(100)
    assert fresh.compute() == 1.0


@pytest.mark.parametrize("key", ["total", "count"])
def test_load_missing_key_names_it(key):
    state = Sum().state_dict()
    del state[key]
    with pytest.raises(ValueError) as info:
        Sum().load_state_dict(state)
    assert repr(key) in str(info.value) and "'sum'" in str(info.value)


def test_load_casts_to_the_accumulators_dtype_and_device():
    m = Sum(device="meta")
    m.load_state_dict({"total": torch.tensor(3.0, dtype=torch.float32), "count": 2})
    assert m.total.dtype == torch.float64 and m.total.device.type == "meta"
    cpu = Sum()
    cpu.load_state_dict({"total": 3, "count": 2})
    assert cpu.total.dtype == torch.float64 and cpu.compute() == 1.5


# -- devices and host syncs ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", BUILT_INS)
def test_accumulators_stay_on_the_metrics_device(cls):
    # meta tensors have no data: any read of a value on the host would raise
    m = make(cls, device="meta")
    m.update(*inputs(cls, device="meta"))
    m.update(*inputs(cls, device="meta"))
    tensors = [v for v in m.state_dict().values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)


def test_to_moves_accumulators():
    m = Sum()
    assert m.to("meta") is m
    assert m.device.type == "meta" and m.total.device.type == "meta"
    m.reset()
    assert m.total.device.type == "meta"  # fresh accumulators on the new device


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def count_host_reads(monkeypatch):
    calls = []
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)
    try:
        yield calls
    finally:
        monkeypatch.undo()


def test_the_host_read_counter_works(monkeypatch):
    with count_host_reads(monkeypatch) as calls:
        torch.ones(1).item()
        bool(torch.ones(1))
    assert calls == ["item", "__bool__"]


@pytest.mark.parametrize("cls", BUILT_INS)
def test_update_reads_nothing_on_the_host(cls, monkeypatch):
    m = make(cls)
    preds, target = inputs(cls)
    with count_host_reads(monkeypatch) as calls:
        for _ in range(3):
            m.update(preds, target)
    assert calls == []


def test_loss_per_sample_and_accuracy_variants_read_nothing_on_the_host(monkeypatch):
    cases = [
        (Loss(), torch.rand(4), torch.zeros(4)),
        (Accuracy(), torch.rand(4), torch.tensor([0, 1, 1, 0])),  # binary probabilities
        (Accuracy(), torch.rand(4, 1), torch.tensor([0, 1, 1, 0])),
        (Accuracy(), torch.tensor([0, 2, 1, 1]), torch.tensor([0, 1, 1, 0])),  # class indices
        (Accuracy(), torch.randn(2, 3, 4, 4), torch.randint(0, 3, (2, 4, 4))),
    ]
    with count_host_reads(monkeypatch) as calls:
        for m, preds, target in cases:
            m.update(preds, target)
    assert calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", BUILT_INS)
def test_cuda_accumulators_and_no_host_reads(cls, monkeypatch):
    m = make(cls, device="cuda")
    preds, target = inputs(cls, device="cuda")
    with count_host_reads(monkeypatch) as calls:
        m.update(preds, target)
    assert calls == []
    assert all(v.device.type == "cuda" for v in m.state_dict().values() if isinstance(v, torch.Tensor))
    cpu = make(cls)
    cpu.update(*inputs(cls))
    assert m.compute() == pytest.approx(cpu.compute(), rel=1e-6)
    # update_now (a captured step's) reads nothing on the host either, and reset keeps the
    # tensors a graph adds to, also for a metric made on "cuda" without an index
    before = {a: v for a, v in vars(m).items() if a in m.state_defaults() and isinstance(v, torch.Tensor)}
    with count_host_reads(monkeypatch) as calls:
        m.update_now(preds, target)
    assert calls == []
    m.reset()  # reads its CPU defaults, never the device
    assert all(getattr(m, a) is v for a, v in before.items())


# -- compute(sync) ------------------------------------------------------------------------------
def test_compute_sync_reduces_over_ranks_and_sync_false_does_not(monkeypatch):
    other_rank = {"total": 10.0, "count": 2}
    calls = []

    def fake_all_reduce_states(values, reductions, device=None):
        calls.append(sorted(values))
        assert reductions == {"total": "sum", "count": "sum"}
        return {k: torch.as_tensor(values[k], dtype=torch.float64) + other_rank[k] for k in values}

    monkeypatch.setattr(metric_base.distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(metric_base.distributed, "all_reduce_states", fake_all_reduce_states)
    m = Loss()
    m.update(torch.tensor(1.0), torch.zeros(2))  # this rank: total 2 over 2 samples
    assert m.compute(sync=False) == 1.0
    assert calls == []
    assert m.compute() == (2.0 + 10.0) / (2 + 2)
    assert calls == [["count", "total"]]
    assert m.compute(sync=False) == 1.0  # the reduction did not change the local accumulators


def test_compute_sync_with_no_samples_anywhere_is_nan(monkeypatch):
    monkeypatch.setattr(metric_base.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(metric_base.distributed, "all_reduce_states",
                        lambda values, reductions, device=None: {k: torch.as_tensor(v, dtype=torch.float64)
                                                                 for k, v in values.items()})
    assert math.isnan(Accuracy().compute())


# -- duck typing --------------------------------------------------------------------------------
class Duck:
    """Not a Metric, but it quacks like one (as a torchmetrics metric does)."""

    higher_is_better = True

    def __init__(self):
        self.updates = []

    def update(self, preds, target):
        self.updates.append((preds.shape, target.shape))

    def compute(self):
        return float(len(self.updates))

    def reset(self):
        self.updates = []


def test_is_metric():
    assert is_metric(Loss()) and is_metric(Duck())
    assert not is_metric(Duck)  # a class, not an instance
    assert not is_metric(object())

    class NoReset:
        def update(self, p, t): pass
        def compute(self): return 0.0

    assert not is_metric(NoReset())


def test_metric_name():
    assert metric_name(Loss()) == "loss"
    assert metric_name(Duck()) == "duck"
    d = Duck()
    d.name = "quack"
    assert metric_name(d) == "quack"


def test_a_duck_metric_is_accepted_by_the_estimator():
    duck = Duck()
    est = make_estimator(train_metrics=[duck])
    assert est.train_metrics[-1] is duck and duck.name == "train_duck"
    history = est.fit(make_batches(4), epochs=2)
    assert history["train_duck"] == [4.0, 4.0]  # reset each epoch, updated once per batch
    assert duck.updates[0] == (torch.Size([8, 3]), torch.Size([8]))


def test_split_and_update():
    class LossLike(Duck):
        is_loss_metric = True

    loss, acc, duck, loss_like = Loss(), Accuracy(), Duck(), LossLike()
    losses, others = split_loss_metrics([loss, acc, duck, loss_like])
    assert losses == [loss, loss_like] and others == [acc, duck]
    pred, label = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0])
    update_metrics(losses, others, pred, label, torch.tensor(0.5))
    assert loss.compute() == 0.5 and acc.compute() == 0.5
    assert loss_like.updates == [(torch.Size([]), torch.Size([2]))]
    assert duck.updates == [(torch.Size([2, 2]), torch.Size([2]))]


# -- batched (deferred) updates ---------------------------------------------------------------------
def _losses_and_batches(n=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = 8 if i % 9 else 5  # a few partial batches: two weights in one fold
        out.append((torch.rand((), generator=g) * 3, torch.randn(size, 4, generator=g),
                    torch.randint(0, 4, (size,), generator=g)))
    return out


def test_batched_updates_give_the_immediate_values():
    from estimatorch.metrics import Accuracy, Loss

    batched_loss, batched_acc = Loss(), Accuracy()
    single_loss, single_acc = Loss(), Accuracy()
    single_loss.max_pending = single_acc.max_pending = 1
    for loss, pred, target in _losses_and_batches():
        for m_loss, m_acc in ((batched_loss, batched_acc), (single_loss, single_acc)):
            m_loss.update(loss, target)
            m_acc.update(pred, target)
    assert batched_acc.compute() == single_acc.compute()  # integer counts: exact
    assert batched_loss.compute() == pytest.approx(single_loss.compute(), rel=1e-12)


def test_reading_a_value_does_not_change_later_bits():
    """compute() folds pending updates into a copy: when values are read (a progress bar's
    time-based refresh) cannot change the bits of later results."""
    from estimatorch.metrics import Loss

    quiet, watched = Loss(), Loss()
    for i, (loss, _, target) in enumerate(_losses_and_batches()):
        quiet.update(loss, target)
        watched.update(loss, target)
        if i % 7 == 3:
            watched.compute()
    assert quiet.compute().hex() == watched.compute().hex()
    assert torch.equal(quiet.total, watched.total)


def test_pending_updates_survive_a_state_round_trip_bit_for_bit():
    from estimatorch.metrics import Accuracy, Loss

    data = _losses_and_batches()
    whole_loss, whole_acc = Loss(), Accuracy()
    for loss, pred, target in data:
        whole_loss.update(loss, target)
        whole_acc.update(pred, target)
    first_loss, first_acc = Loss(), Accuracy()
    for loss, pred, target in data[:45]:  # 45 = 32 folded + 13 pending
        first_loss.update(loss, target)
        first_acc.update(pred, target)
    loss_state, acc_state = first_loss.state_dict(), first_acc.state_dict()
    assert len(loss_state["pending"]) == 13 and acc_state["pending"] == []  # integer sums fold first
    resumed_loss, resumed_acc = Loss(), Accuracy()
    resumed_loss.load_state_dict(loss_state)
    resumed_acc.load_state_dict(acc_state)
    for loss, pred, target in data[45:]:
        resumed_loss.update(loss, target)
        resumed_acc.update(pred, target)
    assert resumed_loss.compute().hex() == whole_loss.compute().hex()
    assert resumed_acc.compute() == whole_acc.compute()


def test_pending_updates_are_capped_by_bytes():
    from estimatorch.metrics import Accuracy

    m = Accuracy()
    m.max_pending_bytes = 3 * 8 * 4 * 4  # three (8, 4) float32 predictions
    for _, pred, target in _losses_and_batches(n=8):
        m.update(pred, target)
        assert m._pending_bytes < m.max_pending_bytes
    assert len(m._pending) < 8 and int(m.correct) > 0  # folded long before max_pending (32)


def test_predictions_of_different_shapes_fold_one_by_one():
    from estimatorch.metrics import Accuracy

    batched, single = Accuracy(), Accuracy()
    single.max_pending = 1
    g = torch.Generator().manual_seed(1)
    for length in (3, 5, 3, 7):  # (N, C, T) with a varying T
        pred, target = torch.randn(2, 4, length, generator=g), torch.randint(0, 4, (2, length), generator=g)
        batched.update(pred, target)
        single.update(pred, target)
    assert batched.compute() == single.compute()


def test_reset_drops_pending_updates():
    from estimatorch.metrics import Loss

    m = Loss()
    m.update(torch.tensor(5.0), torch.zeros(2))
    m.reset()
    m.update(torch.tensor(1.0), torch.zeros(2))
    assert m.compute() == 1.0


# -- per-state reduction (issue 10) ----------------------------------------------------------------
class Extremes(Metric):
    """One state per reduction; updates are deferred, so folds go through every reduction too.
    ``_value`` keeps the (reduced) states it was given for the tests to read."""

    default_name = "extremes"
    max_pending = 3

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64))
        self.add_state("count", 0)
        self.add_state("largest", torch.tensor(float("-inf")), reduce="max")
        self.add_state("smallest", torch.tensor(float("inf")), reduce="min")
        self.add_state("level", torch.zeros((), dtype=torch.float64), reduce="mean")
        self.add_state("seen", [], reduce="cat")
        self.states = None

    def update(self, preds, target=None):
        self._defer((preds.detach(),), 8)
        self.count += preds.numel()

    def _fold(self, items):
        values = torch.cat([p for p, in items])
        return {"total": values.double().sum(), "largest": values.max(), "smallest": values.min(), "seen": values}

    def _value(self, states):
        self.states = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in states.items()}
        return states["largest"]


UPDATES = [torch.tensor([1.0, 3.0]), torch.tensor([-2.0]), torch.tensor([7.0, 0.5]), torch.tensor([4.0])]


def _expected(updates):
    flat = torch.cat(updates).tolist()
    return {"total": sum(flat), "count": len(flat), "largest": max(flat), "smallest": min(flat), "seen": flat}


def test_each_state_folds_and_reads_by_its_reduction():
    m = Extremes()
    for values in UPDATES:  # 3 folded into the states, 1 pending
        m.update(values)
    assert len(m._pending) == 1 and isinstance(m.seen, list) and len(m.seen) == 1
    assert m.compute() == max(torch.cat(UPDATES).tolist())
    assert {k: m.states[k] for k in _expected(UPDATES)} == _expected(UPDATES)
    assert len(m._pending) == 1, "compute folds pending updates into copies"


def test_list_states_and_pending_updates_round_trip():
    whole, first = Extremes(), Extremes()
    for values in UPDATES:
        whole.update(values)
    for values in UPDATES[:2]:
        first.update(values)
    state = first.state_dict()
    assert state["seen"] == [] and len(state["pending"]) == 2
    first.update(UPDATES[2])  # the saved state is a copy
    assert state["seen"] == [] and len(state["pending"]) == 2
    resumed = Extremes()
    resumed.load_state_dict(state)
    for values in UPDATES[2:]:
        resumed.update(values)
    assert resumed.compute() == whole.compute() and resumed.states == whole.states
    with pytest.raises(ValueError, match="'seen' must be a list of tensors"):
        Extremes().load_state_dict(dict(state, seen=3))


def test_reset_gives_a_fresh_list_and_cat_of_nothing_is_empty():
    m = Extremes()
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.update(torch.tensor([1.0, 2.0, 3.0]))
    m.reset()
    assert m.seen == [] and m.seen is not m._defaults["seen"]
    m.compute()
    assert m.states["seen"] == [] and m.states["largest"] == float("-inf")


@pytest.mark.parametrize("args, error, match", [
    (("x", torch.zeros(()), "median"), ValueError, r"reduce must be one of \['sum', 'mean', 'min', 'max', 'cat'\], got 'median'"),
    (("x", [], "sum"), ValueError, "a list state \\('x'\\) must use reduce='cat', got reduce='sum'"),
    (("x", [1, 2], "cat"), TypeError, "the default of 'x' must be a list of tensors"),
    (("x", 0, "cat"), TypeError, "a 'cat' state \\('x'\\) needs a list or a tensor default, got 0"),
    (("x", "0", "sum"), TypeError, "the default of 'x' must be a tensor, an int or a float, got '0'"),
    (("pending", 0, "sum"), ValueError, "attr must be an identifier other than 'pending', got 'pending'"),
])
def test_add_state_checks_its_arguments(args, error, match):
    with pytest.raises(error, match=match):
        Metric().add_state(*args)


def test_all_reduce_states_in_one_process_and_its_checks():
    from estimatorch import distributed

    out = distributed.all_reduce_states(
        {"n": 3, "mean": 2, "low": torch.tensor([1, -4]), "items": torch.zeros(0, 2), "none": []},
        {"n": "sum", "mean": "mean", "low": "min", "items": "cat", "none": "cat"}, torch.device("cpu"))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 3
    assert out["mean"].dtype == torch.float64 and float(out["mean"]) == 2.0
    assert out["low"].tolist() == [1, -4] and out["low"].dtype == torch.int64
    assert out["items"].shape == (0, 2) and out["none"].shape == (0,)
    with pytest.raises(ValueError, match="the reduction of 'n' must be one of .*got 'median'"):
        distributed.all_reduce_states({"n": 1}, {"n": "median"})


def _reduce_on_two_ranks():
    import torch.distributed as dist

    from estimatorch import distributed

    rank = distributed.get_rank()
    calls = {"all_reduce": 0, "gather": 0}
    real_all_reduce, real_gather = dist.all_reduce, distributed.gather_objects

    def counting_all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    def counting_gather(obj):
        calls["gather"] += 1
        return real_gather(obj)

    dist.all_reduce, distributed.gather_objects = counting_all_reduce, counting_gather
    try:
        m = Extremes()
        for values in (UPDATES[:2] if rank == 0 else UPDATES[2:]):
            m.update(values)
        m.level = torch.tensor(2.0 * rank, dtype=torch.float64)
        local_value = m.compute(sync=False)
        local_calls = dict(calls)
        value = m.compute()
        extremes_calls = {k: calls[k] - local_calls[k] for k in calls}
        loss = Loss()
        loss.update(torch.tensor(float(rank + 1)), torch.zeros(rank + 1))
        before = dict(calls)
        loss_value = loss.compute()
        loss_calls = {k: calls[k] - before[k] for k in calls}
    finally:
        dist.all_reduce, distributed.gather_objects = real_all_reduce, real_gather
    return {"value": value, "local": local_value, "states": m.states, "local_calls": local_calls,
            "extremes_calls": extremes_calls, "loss": loss_value, "loss_calls": loss_calls}


@pytest.mark.distributed
@pytest.mark.slow
def test_each_state_reduces_over_two_ranks_by_its_reduction():
    """A max state over ranks holding 3 and 7 is 7 (summed, it was 10): each state chooses."""
    from estimatorch import distributed

    results = distributed.spawn(_reduce_on_two_ranks, 2, backend="gloo")
    rank_updates = [UPDATES[:2], UPDATES[2:]]
    want = _expected(UPDATES)  # rank 0's updates, then rank 1's: the cat order
    for rank, got in enumerate(results):
        assert got["local"] == max(torch.cat(rank_updates[rank]).tolist())
        assert got["value"] == want["largest"] != sum(max(torch.cat(u).tolist()) for u in rank_updates)
        assert {k: got["states"][k] for k in want} == want
        assert got["states"]["level"] == (0.0 + 2.0) / 2
        assert got["local_calls"] == {"all_reduce": 0, "gather": 0}
        # one all_reduce for sums and means, one for maxima and minima, one gather for cat
        assert got["extremes_calls"] == {"all_reduce": 2, "gather": 1}
        assert got["loss_calls"] == {"all_reduce": 1, "gather": 0}  # built-ins: sums only
        assert got["loss"] == (1.0 * 1 + 2.0 * 2) / (1 + 2)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", 3.5])
def test_an_unknown_device_is_a_value_error_naming_device(device):
    with pytest.raises(ValueError, match=r"device must be a torch device such as 'cpu' or 'cuda:0', got "):
        Loss(device=device)
    with pytest.raises(ValueError, match="device must be a torch device"):
        Loss().to(device)


def test_compute_does_not_reduce_under_torchrun_variables_before_the_process_group_exists(monkeypatch):
    """torchrun's WORLD_SIZE makes get_world_size() 2 before fit starts the group: a metric
    computed then (a script's own evaluation before fit) is this process's, with no collective."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")

    def no_collective(*args, **kwargs):
        raise AssertionError("no process group: nothing to reduce over")

    monkeypatch.setattr(metric_base.distributed, "all_reduce_states", no_collective)
    assert metric_base.distributed.get_world_size() == 2
    m = Loss()
    m.update(torch.tensor(1.0), torch.zeros(2))
    assert m.compute() == 1.0


def test_update_now_folds_in_place_and_returns_the_counts_a_replay_adds():
    """What a captured step records: the tensors added to in place (the graph keeps their
    memory), nothing left pending, and the number accumulators' growth handed back."""
    for metric, preds, target in ((Loss(), torch.tensor(0.5), torch.zeros(4, dtype=torch.long)),
                                  (Accuracy(), torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))):
        tensors = {attr: getattr(metric, attr) for attr in metric.state_defaults()
                   if isinstance(getattr(metric, attr), torch.Tensor)}
        deferred = type(metric)()
        deferred.update(preds, target)
        grown = metric.update_now(preds, target)
        assert metric._pending == []
        assert all(getattr(metric, attr) is tensor for attr, tensor in tensors.items())
        assert grown == {attr: getattr(deferred, attr) for attr in grown} and grown  # e.g. {"count": 4}
        assert metric.compute() == deferred.compute()
        metric.add_counts(grown)  # a replay: the graph adds the totals, the host the counts
        for attr in tensors:
            getattr(metric, attr).mul_(2)
        deferred.update(preds, target)
        assert metric.compute() == deferred.compute()


def test_reset_clears_tensors_in_place_and_replaces_one_of_another_shape():
    m = Loss()
    total = m.total
    m.update_now(torch.tensor(3.0), torch.zeros(2))
    m.reset()
    assert m.total is total and float(total) == 0.0 and m.count == 0
    m.total = torch.zeros(3, dtype=torch.float64)  # not the declared shape: a fresh default
    m.reset()
    assert m.total.shape == () and m.total is not total


def test_the_built_in_metrics_say_their_update_is_capturable_and_the_base_does_not():
    assert all(cls.capturable for cls in (Loss, Accuracy, TopKAccuracy, MeanSquaredError, MeanAbsoluteError))
    assert Metric.capturable is False


def test_reset_replaces_an_inference_tensor_it_may_not_change_in_place():
    m = Loss()
    with torch.inference_mode():
        m.total = m.total + 1  # e.g. a state combined in a loop run under inference_mode
    m.reset()
    assert float(m.total) == 0.0 and not m.total.is_inference()
