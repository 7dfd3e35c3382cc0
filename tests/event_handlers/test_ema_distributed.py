"""EMAHandler over two gloo ranks. Under FSDP2 each rank averages its own shards (no rank holds
the whole average), which equals the average of the whole weights bit for bit, training is
unchanged although every validation swaps the shards in and out, the sharded checkpoint (written
in the background) holds the average through DCP, and a resume on two ranks or (elastic) on one
continues it bit for bit. Under DDP every rank holds the same average, stored once, and a resume
continues it."""

from __future__ import annotations

import shutil

import pytest
import torch

from estimatorch import EMAHandler, checkpoint, distributed
from tests.conftest import assert_tree_equal
from tests.event_handlers.sharded_fit import fit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCHES, PER_EPOCH = 10, 6  # 48 samples in batches of 4 on 2 ranks
EMA = {"decay": 0.8, "warmup": True}
OPTIONS = {"ema": EMA, "val": True, "scaled": True, "elastic": True, "period": 3}


def _spawn(nprocs, ckpt_dir, **options):
    return distributed.spawn(fit, nprocs, str(ckpt_dir), {**OPTIONS, **options}, backend="gloo")


def _name(step, sharded=True):
    return f"model-epoch{(step - 1) // PER_EPOCH}batch{step}" + (".dcp" if sharded else ".pt")


def _average(trajectory, steps=None):
    """EMAHandler(**EMA)'s average of the whole weights after ``steps`` steps (all: None)."""
    handler = EMAHandler(**EMA)
    average = {k: v.clone() for k, v in trajectory[0].items()}
    for k, weights in enumerate(trajectory[1:steps + 1 if steps is not None else None], start=1):
        names = list(average)
        torch._foreach_lerp_([average[n] for n in names], [weights[n] for n in names], 1.0 - handler.decay_at(k))
    return average


def _copy(src, tmp_path, name):
    target = tmp_path / "resume"
    target.mkdir()
    (shutil.copytree if name.endswith(".dcp") else shutil.copy)(src / name, target / name)
    return target


def _same_end(got, want, since):
    assert got["outcome"] == "returned" and got["losses"] == want["losses"][since:]
    assert_tree_equal(got["model"], want["model"], "the average, in the net")
    assert_tree_equal(got["raw"], want["raw"], "the trained weights")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """Two ranks under FSDP2 (a parameter on the root module too), a checkpoint every 3 batches
    (kept), written in the background (the shards staged), the weights after every step; the
    same fit without the average first."""
    ckpt = tmp_path_factory.mktemp("fsdp")
    return ckpt, _spawn(2, ckpt, batches=BATCHES, trajectory=True, plain_first=True, max_checkpoints=None,
                        handler={"async_save": True})


def test_under_fsdp2_each_rank_averages_its_shards_into_the_average_of_the_whole(fsdp):
    _, runs = fsdp
    whole = _average(runs[0]["trajectory"])
    total = sum(t.numel() for t in whole.values())
    for rank in runs:
        assert rank["updates"] == BATCHES
        assert_tree_equal(rank["model"], whole, "the average")
        assert rank["local_numel"] < total  # its shards only
        assert rank["losses"] == rank["plain_losses"]  # the validations on the average changed nothing
    assert sum(rank["local_numel"] for rank in runs) == total


def test_the_sharded_checkpoint_holds_the_average_through_dcp(fsdp):
    ckpt, runs = fsdp
    directory = ckpt / _name(PER_EPOCH)
    held = torch.load(directory / "rank-1.pt", weights_only=True)["snapshot"]["handlers"]["EMAHandler"]["weights"]
    assert held["0.weight"] == {"__in_dcp__": "EMAHandler.weights.0.weight"}
    at_six = _average(runs[0]["trajectory"], PER_EPOCH)
    weights = checkpoint.load_weights(directory, handler="EMAHandler")  # gathered in this process
    assert_tree_equal({k: weights[k] for k in at_six}, at_six, "the average at step 6")


def test_a_resume_on_two_ranks_continues_the_average_bit_for_bit(fsdp, tmp_path):
    ckpt, runs = fsdp
    again = _spawn(2, _copy(ckpt, tmp_path, _name(3)), batches=BATCHES, resume=True)
    for got, want in zip(again, runs):
        _same_end(got, want, since=3)
        assert got["history"] == want["history"]


def test_an_elastic_resume_on_one_rank_continues_the_average_bit_for_bit(fsdp, tmp_path):
    ckpt, runs = fsdp
    (one,) = _spawn(1, _copy(ckpt, tmp_path, _name(PER_EPOCH)), batches=2 * BATCHES, accumulation=2, resume=True)
    assert one["step"] == 2 * BATCHES and one["updates"] == BATCHES
    assert_tree_equal(one["model"], runs[0]["model"], "the average, in the net")
    assert_tree_equal(one["raw"], runs[0]["raw"], "the trained weights")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """Two ranks under DDP, checkpoint files written in the background (a writer process)."""
    ckpt = tmp_path_factory.mktemp("ddp")
    return ckpt, _spawn(2, ckpt, strategy="ddp", batches=BATCHES, trajectory=True, max_checkpoints=None,
                        handler={"async_save": True})


def test_under_ddp_every_rank_holds_the_same_average_stored_once(ddp):
    ckpt, runs = ddp
    whole = _average(runs[0]["trajectory"])
    for rank in runs:
        assert_tree_equal(rank["model"], whole, "the average")
        assert_tree_equal(rank["raw"], runs[0]["raw"], "the trained weights")
    payload = checkpoint.load(ckpt / _name(PER_EPOCH, sharded=False))
    assert "EMAHandler" in payload["ranks"][0]["handlers"] and "EMAHandler" not in payload["ranks"][1]["handlers"]


def test_under_ddp_a_resume_in_a_later_epoch_continues_the_average_bit_for_bit(ddp, tmp_path):
    ckpt, runs = ddp
    again = _spawn(2, _copy(ckpt, tmp_path, _name(9, sharded=False)), strategy="ddp", batches=BATCHES, resume=True)
    for got, want in zip(again, runs):
        _same_end(got, want, since=9)
        assert got["history"] == want["history"]
