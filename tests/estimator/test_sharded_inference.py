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
