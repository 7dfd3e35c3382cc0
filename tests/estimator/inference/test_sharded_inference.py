"""evaluate and predict on a sharded net (FSDP2) with batch counts that do not divide by the
number of ranks: every rank runs as many forwards (FSDP gathers parameters from every rank in
each), a rank with a batch fewer runs a padding forward whose result is discarded, and scores and
predictions (in order) equal those of one process with the whole net. Two gloo processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from estimatorch import Estimator, distributed
from estimatorch.checkpoint import is_sharded_module
from estimatorch.event_handlers import BatchEnd

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: (samples, batch size): 5 batches (3 and 2 per rank, the last of 4 samples), 3 (2 and 1), 1
#: (rank 1 holds none), 4 (2 and 2: no padding)
CASES = [(36, 8), (20, 8), (8, 8), (32, 8)]


def _estimator():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Dropout(0.3), nn.Linear(7, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=2,
                     device="cpu")


def _loader(n, batch):
    g = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)),
                      batch_size=batch)


class CountBatches(BatchEnd):
    def __init__(self):
        self.count = 0

    def batch_end(self, est, **kw):
        self.count += 1


def _sharded(cases):
    est = _estimator()
    for child in est.net.children():
        if any(True for _ in child.parameters()):
            fully_shard(child)
    fully_shard(est.net)
    forwards = [0]
    est.net.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    out = {"sharded": is_sharded_module(est.net)}
    for n, batch in cases:
        counter = CountBatches()
        forwards[0] = 0
        scores = est.evaluate(_loader(n, batch), event_handlers=[counter])
        preds = est.predict(_loader(n, batch))
        limited = est.evaluate(_loader(n, batch), event_handlers=[counter])  # a second evaluation works too
        out[(n, batch)] = {"scores": scores, "preds": preds, "batch_end": counter.count, "forwards": forwards[0],
                           "again": limited}
    return out


@pytest.mark.timeout(180)  # before the padding forward, this hung in FSDP's all-gather
def test_a_sharded_net_evaluates_and_predicts_any_number_of_batches_as_one_process():
    results = distributed.spawn(_sharded, 2, CASES, backend="gloo")
    for n, batch in CASES:
        est = _estimator()
        scores, preds = est.evaluate(_loader(n, batch)), est.predict(_loader(n, batch))
        total = -(-n // batch)
        for rank, result in enumerate(results):
            got, where = result[(n, batch)], f"{n} samples in batches of {batch}, rank {rank}"
            assert result["sharded"], where
            assert torch.equal(got["preds"], preds), where  # every sample once, in order
            assert got["scores"] == pytest.approx(scores, rel=1e-6) and got["again"] == got["scores"], where
            own = len(range(rank, total, 2))
            assert got["batch_end"] == 2 * own, where  # handlers see this rank's batches only
            # evaluate, predict and evaluate again: as many forwards on every rank
            assert got["forwards"] == 3 * -(-total // 2), where


# -- data each rank holds itself: its lengths are unknown in advance, the ranks agree batch by batch

#: per rank, the sizes of its own batches: unequal counts, rank 0 with none (it pads with a batch
#: rank 1 sends), equal counts, uneven last batches
OWN = [((8, 8, 3), (5,)), ((), (8, 2)), ((4, 4), (4, 4)), ((8,), (8, 8, 8, 1))]


def _own_batches(sizes, rank, case):
    g = torch.Generator().manual_seed(100 * case + rank)
    return [(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


class _Samples(torch.utils.data.IterableDataset):
    """A stream of this rank's own samples (no length: its batch count is found by iterating)."""

    def __init__(self, batches):
        self.samples = [(x[i], y[i]) for x, y in batches for i in range(len(y))]

    def __iter__(self):
        return iter(self.samples)


def _predict(est, data):
    try:
        return est.predict(data)
    except ValueError as err:  # a rank holding nothing has nothing to predict (as under DDP)
        return str(err)


def _own_sharded(strategy):
    rank = distributed.get_rank()
    est = _estimator()
    if strategy == "fsdp":  # sharded when fit starts
        est.strategy = "fsdp"
    else:  # sharded before fit: fit's sanity pass runs on the sharded net
        for child in est.net.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(est.net)
        est = Estimator(est.net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(est.net.parameters(), lr=0.1),
                        seed=2, device="cpu")  # an optimizer over the sharded parameters
    # its validation runs on own data too, and the sanity pass: 2 batches on rank 0, 1 on rank 1 (it pads)
    est.fit(_own_batches((4, 4, 4), rank, 9), val_data=_own_batches(OWN[0][rank], rank, 0), epochs=1,
            num_sanity_val_steps=2)
    forwards = [0]
    est.net.register_forward_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    out = {"sharded": is_sharded_module(est.net),
           "state": {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in est.net.state_dict().items()}}
    for case, sizes in enumerate(OWN):
        mine = _own_batches(sizes[rank], rank, case)
        counter = CountBatches()
        forwards[0] = 0
        stream = DataLoader(_Samples(mine), batch_size=4)
        got = {"scores": est.evaluate(mine, event_handlers=[counter]), "preds": _predict(est, mine),
               "stream_scores": est.evaluate(stream), "stream_preds": _predict(est, stream)}
        got["batch_end"], got["forwards"] = counter.count, forwards[0]
        out[case] = got
    return out


@pytest.mark.timeout(240)  # before the ranks agreed batch by batch, this hung in FSDP's all-gather
@pytest.mark.parametrize("strategy", ["fully_shard", "fsdp"])
def test_a_sharded_net_evaluates_and_predicts_data_each_rank_holds_itself(strategy):
    results = distributed.spawn(_own_sharded, 2, strategy, backend="gloo")
    assert all(r["sharded"] for r in results)
    for key in results[0]["state"]:  # the shards of one net: the same full parameters on every rank
        assert torch.equal(results[0]["state"][key], results[1]["state"][key]), key
    plain = _estimator()
    plain.net.load_state_dict(results[0]["state"])
    for case, sizes in enumerate(OWN):
        per_rank = [_own_batches(sizes[rank], rank, case) for rank in range(2)]
        union = per_rank[0] + per_rank[1]
        scores = plain.evaluate(union)  # one process, every rank's batches, the whole net
        for rank, result in enumerate(results):
            got, where = result[case], f"{strategy}, batches of {sizes}, rank {rank}"
            assert got["scores"] == pytest.approx(scores, rel=1e-6), where
            assert got["stream_scores"] == pytest.approx(scores, rel=1e-6), where
            assert got["batch_end"] == len(sizes[rank]), where  # handlers see this rank's batches only
            if sizes[rank]:
                assert torch.equal(got["preds"], plain.predict(per_rank[rank])), where  # this rank's outputs
                # the stream batches this rank's samples by 4, not as its list: a matmul of
                # another height may round differently (it does on AVX-512), so close, in order
                torch.testing.assert_close(got["stream_preds"], got["preds"], rtol=1e-6, atol=1e-7, msg=where)
            else:  # after taking part in the other ranks' forwards
                assert got["preds"] == got["stream_preds"] == "data yielded no batches", where
            # evaluate and predict, of the list and of the stream: as many forwards on every rank
            assert got["forwards"] == 2 * max(map(len, sizes)) + 2 * max(-(-sum(s) // 4) for s in sizes), where
