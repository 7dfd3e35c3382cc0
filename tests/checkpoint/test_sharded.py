"""Sharded checkpoint directories (DCP): written by every rank, complete only once marked, checked
before anything is read, loaded on another number of ranks, never running code when read."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from estimatorch import checkpoint, distributed
from estimatorch.checkpoint import CheckpointError, load_weights, main, write_latest
from estimatorch.checkpoint import _sharded as sharded

WIDTH, OUT = 7, 3  # odd sizes: the shards of two ranks are uneven


def make_net(width: int = WIDTH) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, OUT))


def train(net: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    """``steps`` Adam steps on batches drawn from ``seed`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 5, generator=gen), torch.randint(0, OUT, (8,), generator=gen)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def full_state(net: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full, whether sharded (DTensor) or not."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}


def plain(width: int = WIDTH) -> tuple[nn.Module, torch.optim.Optimizer]:
    net = make_net(width)
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def save_plain(path, steps=2):
    net, opt = plain()
    torch.manual_seed(1)
    train(net, opt, steps, seed=1)
    model, optim = get_state_dict(net, opt)
    sharded.save_sharded({"model": model, "optimizer": optim}, {"rng": torch.get_rng_state(), "step": steps}, path)
    return net, opt


def load_plain(path, width: int = WIDTH):
    net, opt = plain(width)
    model, optim = get_state_dict(net, opt)
    state, rank_state = sharded.load_sharded(path, {"model": model, "optimizer": optim})
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return net, opt, rank_state


# -- one process --------------------------------------------------------------------------------
def test_a_directory_round_trips_and_training_continues_bit_identically(tmp_path):
    path = tmp_path / "model-epoch0batch2.dcp"
    net, opt = save_plain(path)
    assert sharded.is_sharded(path)
    assert sorted(os.listdir(path)) == sorted([".metadata", "__0_0.distcp", "common.pt", "rank-0.pt", sharded.MARKER])
    assert sharded.sharded_marker(path)["world_size"] == 1
    net2, opt2, rank_state = load_plain(path)
    assert rank_state["step"] == 2
    assert all(torch.equal(a, b) for a, b in zip(full_state(net).values(), full_state(net2).values()))
    torch.manual_seed(2)
    expected = train(net, opt, 3, seed=2)
    torch.manual_seed(2)
    assert train(net2, opt2, 3, seed=2) == expected
    assert all(torch.equal(a, b) for a, b in zip(full_state(net).values(), full_state(net2).values()))


def test_weights_come_back_as_a_plain_cpu_state_dict(tmp_path):
    path = tmp_path / "model-epoch0batch2.dcp"
    net, _ = save_plain(path)
    weights = sharded.read_sharded_weights(path)
    assert weights.keys() == net.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())


def test_an_existing_checkpoint_is_never_overwritten(tmp_path):
    path = tmp_path / "model-epoch0batch2.dcp"
    save_plain(path)
    before = sorted(os.listdir(path))
    with pytest.raises(FileExistsError, match="never overwritten"):
        save_plain(path)
    assert sorted(os.listdir(path)) == before and os.listdir(tmp_path) == [path.name]


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    path = tmp_path / "model-epoch0batch2.dcp"

    def full_disk(obj, file, **kwargs):
        raise OSError(28, f"cannot write {file!r}: No space left on device")

    monkeypatch.setattr(sharded, "atomic_save", full_disk)
    with pytest.raises(OSError) as caught:
        save_plain(path)
    assert caught.value.errno == 28 and "rank-0.pt" in str(caught.value)
    assert os.listdir(tmp_path) == []  # neither the checkpoint nor its temporary directory


def test_a_directory_without_its_marker_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "model-epoch0batch2.dcp"
    save_plain(path)
    os.unlink(path / sharded.MARKER)  # what a writer killed before its last file leaves
    assert not sharded.is_sharded(path)
    with pytest.raises(CheckpointError, match="no estimatorch.json .a writer that was killed"):
        load_plain(path)


@pytest.mark.parametrize("damage, words", [
    (lambda p: os.truncate(p / "__0_0.distcp", 100), r"__0_0.distcp.* is truncated: 100 bytes"),
    (lambda p: os.unlink(p / "__0_0.distcp"), "missing its shard '__0_0.distcp'"),
    (lambda p: os.unlink(p / "rank-0.pt"), "missing 'rank-0.pt'"),
    (lambda p: os.unlink(p / ".metadata"), "has no .metadata file"),
    (lambda p: (p / "rank-0.pt").write_bytes(b"garbage"), "rank-0.pt': it is not a file torch.save wrote"),
])
def test_a_damaged_directory_is_named_with_the_reason(tmp_path, damage, words):
    path = tmp_path / "model-epoch0batch2.dcp"
    save_plain(path)
    damage(path)
    with pytest.raises(CheckpointError, match=words):
        load_plain(path)


def test_a_checkpoint_of_another_model_says_what_differs(tmp_path):
    path = tmp_path / "model-epoch0batch2.dcp"
    save_plain(path)
    with pytest.raises(CheckpointError, match=r"model.0.weight has shape \(7, 5\), this model's has \(9, 5\)"):
        load_plain(path, width=9)
    longer = nn.Sequential(*make_net(), nn.Linear(OUT, 2))
    with pytest.raises(CheckpointError, match=r"does not hold model.4.bias, model.4.weight \(saved from another"):
        sharded.check_sharded(path, {"model": longer.state_dict()})
    with pytest.raises(CheckpointError, match=r"holds model.3.bias, model.3.weight, which this model"):
        sharded.check_sharded(path, {"model": nn.Sequential(*list(make_net())[:3]).state_dict()})


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_reading_metadata_runs_no_code(tmp_path, monkeypatch):
    path = tmp_path / "model-epoch0batch2.dcp"
    save_plain(path)
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="posix.system is not part of a checkpoint's metadata"):
        load_plain(path)
    with pytest.raises(CheckpointError):
        sharded.read_sharded_weights(path)
    assert not (tmp_path / "pwned").exists()


# -- FSDP2 on two gloo processes ------------------------------------------------------------------
def _sharded_net(width: int = WIDTH):
    net = make_net(width)
    for module in net:
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module)
    fully_shard(net)
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)


def _fsdp(directory: str, action: str) -> dict:
    """On every rank: ``save`` trains 3 steps, saves, trains 3 more; ``load`` loads and trains
    the same 3. Returns the full parameters and the losses of the last 3 steps (rank 0)."""
    net, opt = _sharded_net()
    rank = distributed.get_rank()
    path = os.path.join(directory, "model-epoch0batch3.dcp")
    if action == "save":
        torch.manual_seed(10 + rank)
        train(net, opt, 3, seed=1)
        model, optim = get_state_dict(net, opt)
        sharded.save_sharded({"model": model, "optimizer": optim},
                             {"rng": torch.get_rng_state(), "rank": rank}, path)
        saved = full_state(net)
    else:
        model, optim = get_state_dict(net, opt)
        state, rank_state = sharded.load_sharded(path, {"model": model, "optimizer": optim})
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        assert rank_state["rank"] == rank
        torch.set_rng_state(rank_state["rng"])
        saved = full_state(net)
    losses = train(net, opt, 3, seed=2)
    return {"saved": saved, "after": full_state(net), "losses": losses,
            "local_shape": tuple(next(iter(net.parameters())).to_local().shape)}


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_two_ranks_save_and_resume_bit_identically_and_reshard_to_one(tmp_path):
    first = distributed.spawn(_fsdp, 2, str(tmp_path), "save", backend="gloo")
    assert first[0]["local_shape"] == (4, 5) and first[1]["local_shape"] == (3, 5)  # 7 rows, uneven
    path = tmp_path / "model-epoch0batch3.dcp"
    assert sharded.sharded_marker(path)["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", "rank-0.pt", "rank-1.pt"} <= set(os.listdir(path))

    again = distributed.spawn(_fsdp, 2, str(tmp_path), "load", backend="gloo")
    for rank in (0, 1):
        assert all(torch.equal(again[rank]["saved"][k], v) for k, v in first[0]["saved"].items())
        assert again[rank]["losses"] == first[rank]["losses"]
        assert all(torch.equal(again[rank]["after"][k], v) for k, v in first[0]["after"].items())

    (one,) = distributed.spawn(_fsdp, 1, str(tmp_path), "load", backend="gloo")  # 2 -> 1: resharded
    assert all(torch.equal(one["saved"][k], v) for k, v in first[0]["saved"].items())
    # (its steps differ from the two ranks': their dropout masks came from two generators)
    weights = sharded.read_sharded_weights(path)  # no process group here
    assert all(torch.equal(weights[k], v) for k, v in first[0]["saved"].items())


# -- what finds and reads a checkpoint ------------------------------------------------------------
def test_load_weights_and_inspect_understand_a_sharded_directory(tmp_path, capsys):
    path = tmp_path / "model-epoch0batch2.dcp"
    net, _ = save_plain(path)
    os.mkdir(tmp_path / ".model-epoch0batch3.dcp.0123456789ab.tmp")  # a killed writer's: never chosen
    os.mkdir(tmp_path / "model-epoch0batch4.dcp")  # no marker: incomplete, never chosen
    for where in (path, tmp_path):
        weights = load_weights(where)
        assert all(torch.equal(weights[k], v) for k, v in net.state_dict().items())
    write_latest(tmp_path, "model", path)
    assert load_weights(tmp_path / "model-latest").keys() == net.state_dict().keys()
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sharded checkpoint (a directory)" in out and "world size 1" in out
    assert f"model 4 tensors, {sum(v.numel() for v in net.state_dict().values())} values (float32)" in out


def test_inspect_names_a_sharded_directory_whose_run_state_is_damaged(tmp_path, capsys):
    """A directory written by a fit holds every rank's snapshot: one that fails the checks a
    resume runs is an error, not a directory of the storage layer alone."""
    path = tmp_path / "model-epoch0batch2.dcp"
    save_plain(path)
    torch.save({"format_version": checkpoint.FORMAT_VERSION, "snapshot": {"position": {}}}, path / "rank-0.pt")
    assert main(["inspect", str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
