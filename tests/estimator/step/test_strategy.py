"""FSDP2 under fit: a net sharded with fully_shard trains as it is (not wrapped in DDP),
strategy="fsdp" shards a plain net and points its optimizer at the shards, and both train what
DDP trains (clipping by the global norm and accumulation included), on two gloo processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, distributed
from estimatorch.checkpoint import is_sharded_module

WIDTH = 7  # rows of the first layer: uneven shards on two ranks


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, WIDTH), nn.ReLU(), nn.Dropout(0.2), nn.Linear(WIDTH, 3))


def loaders():
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 6, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    return train, DataLoader(TensorDataset(x[:16], y[:16]), batch_size=8)


def full(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}


def _fit(how: str, clip=None, accumulation=1, precision="32") -> dict:
    net = make_net()
    strategy = {"ddp": "ddp", "fsdp": "fsdp", "sharded": None}[how]
    if how == "sharded":  # the user shards, then builds the optimizer (FSDP2's recipe)
        for child in net.children():
            if any(True for _ in child.parameters()):
                fully_shard(child)
        fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, device="cpu", seed=3, strategy=strategy,
                    precision=precision)
    train, val = loaders()
    handlers = [GradientUpdateHandler(accumulation_steps=accumulation, clip_grad_norm=clip)]
    history = est.fit(train, val_data=val, epochs=2, event_handlers=handlers)
    return {"params": full(est.net), "history": dict(history), "evaluate": est.evaluate(val),
            "sharded": is_sharded_module(est.net), "wrapped": type(est.train_net).__name__,
            "optimizer_holds_net": all(any(p is q for q in est.net.parameters())
                                       for g in opt.param_groups for p in g["params"])}


def _close(a: dict, b: dict) -> None:
    for k, v in a["params"].items():
        torch.testing.assert_close(b["params"][k], v, rtol=1e-5, atol=1e-6)
    for k, v in a["history"].items():
        torch.testing.assert_close(torch.tensor(b["history"][k]), torch.tensor(v), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("clip, accumulation, precision", [(None, 1, "32"), (0.05, 2, "32"), (None, 1, "bf16")])
def test_a_sharded_net_trains_what_ddp_trains(clip, accumulation, precision):
    ddp = distributed.spawn(_fit, 2, "ddp", clip, accumulation, precision, backend="gloo")
    fsdp = distributed.spawn(_fit, 2, "fsdp", clip, accumulation, precision, backend="gloo")
    sharded = distributed.spawn(_fit, 2, "sharded", clip, accumulation, precision, backend="gloo")
    assert [r["wrapped"] for r in ddp] == ["DistributedDataParallel"] * 2 and not ddp[0]["sharded"]
    for runs in (fsdp, sharded):
        assert all(r["sharded"] and r["wrapped"].startswith("FSDP") and r["optimizer_holds_net"] for r in runs)
        assert runs[0]["evaluate"] == runs[1]["evaluate"]  # the ranks agree
        if precision == "32":
            _close(ddp[0], runs[0])
            _close(ddp[1], runs[1])
    if precision != "32":  # FSDP2 gathers bf16 parameters where DDP autocasts float32 ones
        for k, v in ddp[0]["params"].items():
            torch.testing.assert_close(fsdp[0]["params"][k], v, rtol=0.05, atol=0.02)
    assert fsdp[0]["history"]["train_loss"][-1] < fsdp[0]["history"]["train_loss"][0]


# -- one process: the argument ------------------------------------------------------------------
def test_strategy_is_checked_when_the_estimator_is_built():
    net = make_net()
    with pytest.raises(ValueError, match=r"strategy must be one of \['ddp', 'fsdp'\] or None, got 'zero3'"):
        Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), strategy="zero3")
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.randn(2, 6)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="this optimizer has already stepped"):
        Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, strategy="fsdp")


def test_in_one_process_fsdp_trains_the_net_as_it_is(tmp_path):
    net = make_net()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    device="cpu", strategy="fsdp")
    est.fit(loaders()[0], epochs=1, event_handlers=[CheckpointHandler(tmp_path)])  # not sharded: checkpoints
    assert est.strategy == "fsdp" and est.train_net is net and not is_sharded_module(net)
