"""evaluate and predict on two gloo processes equal one process on the same data: 7 samples in
batches of 2 (neither divides), with a plain loader, torch's DistributedSampler, ours, and a
shuffled loader; data each rank holds itself (a list) keeps its documented meaning."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from estimatorch import Estimator, distributed
from estimatorch.metrics import Accuracy, Loss, Metric
from estimatorch.samplers import ResumableDistributedSampler

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

N, BATCH = 7, 2
KINDS = ["plain", "torch", "torch-shuffled", "resumable", "shuffled"]


class SampleCount(Metric):
    """The number of samples evaluated: 7, or 8 when a padded sample counts twice."""

    default_name = "samples"

    def __init__(self):
        super().__init__()
        self.add_state("count", 0)

    def update(self, preds, target):
        self.count += target.shape[0]

    def _value(self, states):
        return torch.as_tensor(states["count"])


def _estimator():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), val_metrics=[Loss(), Accuracy(), SampleCount()],
                     optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=2)


def _dataset(n=N):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _loader(kind, num_replicas=None, rank=None):
    """The val loader of each kind; ``num_replicas=1, rank=0`` builds it for one process."""
    data = _dataset()
    if kind == "plain":
        return DataLoader(data, batch_size=BATCH)
    if kind in ("torch", "torch-shuffled"):
        sampler = DistributedSampler(data, num_replicas, rank, shuffle=kind == "torch-shuffled", seed=4)
        sampler.set_epoch(1)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)
    if kind == "resumable":
        sampler = ResumableDistributedSampler(data, num_replicas, rank, seed=4)
        sampler.set_epoch(1)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)
    return DataLoader(data, batch_size=BATCH, shuffle=True)


def _evaluate_and_predict_everywhere():
    out = {}
    for kind in KINDS:
        est = _estimator()
        torch.manual_seed(100 + distributed.get_rank())  # ranks' global generators differ (as after fit)
        loader = _loader(kind)
        out[kind] = {"scores": est.evaluate(loader), "preds": est.predict(loader),
                     "training": est.net.training, "batches_per_rank": len(loader)}
    return out


def _one_process(kind):
    est = _estimator()
    loader = _loader(kind, num_replicas=1, rank=0)
    net = est.net
    net.eval()
    with torch.no_grad():
        plain = torch.cat([net(x) for x, _ in loader])
    net.train()
    return est.evaluate(loader), est.predict(loader), plain


def test_two_ranks_evaluate_and_predict_as_one_process_on_7_samples():
    results = distributed.spawn(_evaluate_and_predict_everywhere, 2, backend="gloo")
    for kind in KINDS:
        scores, preds, plain = _one_process(kind)
        if kind != "shuffled":  # each iteration of a shuffled loader has its own order
            assert torch.equal(preds, plain), kind
        assert scores["val_samples"] == N
        for rank, result in enumerate(results):
            got = result[kind]
            where = f"{kind} on rank {rank}"
            assert got["scores"]["val_samples"] == N, where  # no padded sample counted twice
            assert got["scores"]["val_accuracy"] == scores["val_accuracy"], where
            # the same batches as one process, but for the shuffled loader (float32 batch means)
            tolerance = 1e-6 if kind == "shuffled" else 1e-12
            assert got["scores"]["val_loss"] == pytest.approx(scores["val_loss"], rel=tolerance), where
            assert got["preds"].shape == (N, 3) and got["training"] is True, where
            if kind == "shuffled":  # the order is rank 0's random draw: the same samples, each once
                assert sorted(map(tuple, got["preds"].tolist())) == sorted(map(tuple, plain.tolist())), where
                assert torch.equal(got["preds"], results[0][kind]["preds"]), where
            else:  # one process's order, without the sampler's padding
                assert torch.equal(got["preds"], plain), where
    # the padded samplers really pad: 4 batches per rank (8 samples) where one process has 7
    assert results[1]["torch"]["batches_per_rank"] == results[1]["resumable"]["batches_per_rank"] == 2


def _counting_collectives():
    import torch.distributed as dist

    calls = []
    patched = {}
    for name in ("all_reduce", "all_gather_object", "broadcast_object_list", "all_gather", "broadcast"):
        real = getattr(dist, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        patched[name] = real
        setattr(dist, name, counting)
    return calls, lambda: [setattr(dist, n, f) for n, f in patched.items()]


def _per_rank_lists():
    rank = distributed.get_rank()
    est = _estimator()
    data = _dataset()
    own = [(data.tensors[0][i:i + BATCH], data.tensors[1][i:i + BATCH]) for i in range(rank * 4, min(N, rank * 4 + 4), BATCH)]
    calls, restore = _counting_collectives()
    try:
        preds = est.predict(own)  # this rank's own data: no collective, may run on one rank alone
        predict_calls = list(calls)
        scores = est.evaluate(own)
    finally:
        restore()
    with torch.no_grad():
        est.net.eval()
        plain = torch.cat([est.net(x) for x, _ in own])
    return {"preds": preds, "plain": plain, "predict_calls": predict_calls, "scores": scores}


def test_lists_of_batches_are_each_ranks_own_data():
    """Documented: a list is the rank's own data, as in fit; metrics reduce over every rank's batches."""
    results = distributed.spawn(_per_rank_lists, 2, backend="gloo")
    whole = [(x, y) for x, y in DataLoader(_dataset(), batch_size=BATCH)]
    reference = _estimator().evaluate(whole)  # rank 0 holds samples 0-3, rank 1 samples 4-6
    for result in results:
        assert result["predict_calls"] == []
        assert torch.equal(result["preds"], result["plain"])
        assert result["scores"]["val_samples"] == N
        assert result["scores"]["val_accuracy"] == reference["val_accuracy"]
        assert result["scores"]["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-12)
    assert results[0]["preds"].shape == (4, 3) and results[1]["preds"].shape == (3, 3)


def _fit_with_validation():
    est = _estimator()
    train = DataLoader(_dataset(12), batch_size=3, shuffle=True)
    val = _loader("torch-shuffled")
    history = est.fit(train, val_data=val, epochs=2, event_handlers=[])
    return {"history": history.to_dict(), "model": est.net.state_dict()}


def test_validation_during_a_two_rank_fit_counts_every_sample_once():
    r0, r1 = distributed.spawn(_fit_with_validation, 2, backend="gloo")
    assert r0["history"] == r1["history"]
    assert r0["history"]["val_samples"] == [N, N]
    est = _estimator()
    est.net.load_state_dict(r0["model"])
    final = est.evaluate(_loader("torch-shuffled", num_replicas=1, rank=0))
    assert r0["history"]["val_accuracy"][-1] == final["val_accuracy"]
    assert r0["history"]["val_loss"][-1] == pytest.approx(final["val_loss"], rel=1e-12)


def _predict_in_a_group():
    import torch.distributed as dist

    est = _estimator()
    loader = _loader("torch-shuffled")
    return {"world": dist.get_world_size(), "preds": est.predict(loader), "scores": est.evaluate(loader)}


def test_predict_in_a_one_process_group_equals_a_plain_loop():
    (result,) = distributed.spawn(_predict_in_a_group, 1, backend="gloo")
    scores, preds, plain = _one_process("torch-shuffled")
    assert result["world"] == 1
    assert torch.equal(result["preds"], plain) and torch.equal(preds, plain)
    assert result["scores"] == scores
