"""CheckpointHandler with a net sharded across ranks (FSDP2): each checkpoint is a directory every
rank writes; a killed job, one rank's SIGTERM, a kill at any stage of a write and a damaged shard
all resume bit-identically; elastic resume reshards (2 -> 1 with accumulation 2, 1 -> 2)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint, distributed
from estimatorch.distributed import RankFailedError
from tests.conftest import assert_tree_equal
from tests.event_handlers.sharded_fit import fit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCHES, PER_EPOCH = 10, 6  # 48 samples in batches of 4 on 2 ranks


def _name(step):
    return f"model-epoch{(step - 1) // PER_EPOCH}batch{step}.dcp"


def _spawn(nprocs, ckpt_dir, **options):
    return distributed.spawn(fit, nprocs, str(ckpt_dir) if ckpt_dir else "", options, backend="gloo")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two ranks, uninterrupted, checkpointing after every batch (kept: resume points)."""
    ckpt = tmp_path_factory.mktemp("reference")
    return ckpt, _spawn(2, ckpt, batches=BATCHES, period=1)


def _same_run(got, want, since):
    """``got`` (resumed after ``since`` steps) ends as ``want`` did, bit for bit."""
    for g, w in zip(got, want):
        assert g["outcome"] == "returned" and g["step"] == w["step"]
        assert g["losses"] == w["losses"][since:]
        assert_tree_equal(g["model"], w["model"], "model")
        assert_tree_equal(g["optimizer"], w["optimizer"], "optimizer")


def _copy(src, tmp_path, *names):
    target = tmp_path / "resume"
    target.mkdir()
    for name in names:
        shutil.copytree(src / name, target / name)
    return target


def test_checkpoints_are_directories_every_rank_wrote_and_hold_the_run(reference):
    ckpt, runs = reference
    names = sorted(os.listdir(ckpt))
    assert names == sorted([_name(b) for b in range(1, BATCHES + 1)] + ["model-latest"])
    newest = ckpt / _name(BATCHES)
    assert checkpoint.read_latest(ckpt, "model") == newest.name
    assert {"rank-0.pt", "rank-1.pt", "__0_0.distcp", "__1_0.distcp", "common.pt", "estimatorch.json"} \
        <= set(os.listdir(newest))
    weights = checkpoint.load_weights(ckpt)  # no process group: gathered in full
    assert_tree_equal(dict(weights), runs[0]["model"], "weights")


def test_the_whole_job_killed_after_a_checkpoint_relaunches_bit_identically(reference, tmp_path):
    _, full = reference
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankFailedError):
        _spawn(2, ckpt, batches=BATCHES, period=2, max_checkpoints=2, kill_at=5)
    # the lock and the progress mark: killed
    assert sorted(os.listdir(ckpt)) == sorted([checkpoint.LOCK_NAME, checkpoint.PROGRESS_NAME, _name(2), _name(4),
                                               "model-latest"])
    again = _spawn(2, ckpt, batches=BATCHES, period=2, max_checkpoints=2, resume=True)
    _same_run(again, full, since=4)
    assert again[0]["files"] == [_name(10), _name(8), "model-latest"]  # retention


def test_sigterm_on_one_rank_saves_the_agreed_step_and_the_rerun_is_bit_identical(reference, tmp_path):
    _, full = reference
    ckpt = tmp_path / "ckpt"
    # agree_every=1: the flags are exchanged after every step (gloo's default is every 16)
    stopped = _spawn(2, ckpt, batches=BATCHES, period=3, signal_at={1: 3}, agree_every=1)
    assert [(r["outcome"], r["step"]) for r in stopped] == [("SystemExit(143)", 4)] * 2
    assert stopped[0]["files"] == [checkpoint.PROGRESS_NAME, "model-epoch0batch3.dcp", "model-epoch0batch4.dcp",
                                   "model-latest"]  # the mark: the stop's entry with its train_end
    again = _spawn(2, _copy(ckpt, tmp_path, "model-epoch0batch4.dcp"), batches=BATCHES, period=3, resume=True)
    _same_run(again, full, since=4)


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint_with_a_warning(reference, tmp_path):
    ckpt, full = reference
    resume = _copy(ckpt, tmp_path, _name(5), _name(6))
    shard = resume / _name(6) / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    again = _spawn(2, resume, batches=BATCHES, period=1, resume=True)
    _same_run(again, full, since=5)
    skipped = [line for line in again[0]["log"] if line.startswith("Skipping a checkpoint")]
    assert len(skipped) == 1 and str(shard) in skipped[0] and "truncated" in skipped[0], again[0]["log"]
    resumed = [line for line in again[0]["log"] if line.startswith("Resuming from")]
    # the position, then (after ";") what the ledger says of the last attempt
    assert resumed and resumed[0].split(";")[0].endswith(f"{_name(5)}: 0 epochs and 5 batches done"), again[0]["log"]


def _in_process(ckpt_dir, **options):
    """The fit in this process (no process group: a plain net), the thread count restored."""
    threads = torch.get_num_threads()
    try:
        return fit(str(ckpt_dir), {"strategy": "ddp", **options})
    finally:
        torch.set_num_threads(threads)


def test_two_ranks_resume_on_one_with_accumulation_two_bit_identically(tmp_path):
    full = _spawn(2, tmp_path / "full", batches=BATCHES, elastic=True)
    resume = _copy(tmp_path / "full", tmp_path, "model-epoch0batch3.dcp")
    plain = tmp_path / "plain"
    shutil.copytree(resume, plain)
    (one,) = _spawn(1, resume, batches=2 * BATCHES, accumulation=2, elastic=True, resume=True)
    # and into a plain net, in a process without a process group (the directory read whole)
    alone = _in_process(plain, batches=2 * BATCHES, accumulation=2, elastic=True, resume=True)
    for run in (one, alone):
        assert run["step"] == 2 * BATCHES
        assert_tree_equal(run["model"], full[0]["model"], "model")
        assert_tree_equal(run["optimizer"], full[0]["optimizer"], "optimizer")


def test_one_rank_resumes_on_two_bit_identically(tmp_path):
    (full,) = _spawn(1, tmp_path / "full", batches=2 * BATCHES, accumulation=2, elastic=True)
    resume = _copy(tmp_path / "full", tmp_path, "model-epoch0batch6.dcp")  # an epoch of 12 micro-batches
    two = _spawn(2, resume, batches=BATCHES, elastic=True, resume=True)
    for rank in two:
        assert rank["step"] == BATCHES
        assert_tree_equal(rank["model"], full["model"], "model")
        assert_tree_equal(rank["optimizer"], full["optimizer"], "optimizer")


def test_another_world_size_is_refused_without_elastic_naming_both(reference, tmp_path):
    ckpt, _ = reference
    with pytest.raises(RankFailedError) as info:
        _spawn(1, _copy(ckpt, tmp_path, "model-epoch0batch4.dcp"), batches=BATCHES, resume=True)
    assert "written by 2 processes; this run has 1" in str(info.value)


def test_a_weights_export_of_a_sharded_run_is_one_plain_file(reference, tmp_path):
    _, full = reference
    runs = _spawn(2, tmp_path, batches=BATCHES, period=5, handler={"save_weights_only": True})
    assert runs[0]["files"] == ["model-epoch0batch5.weights.pt", "model-epoch1batch10.weights.pt"]
    weights = torch.load(tmp_path / "model-epoch1batch10.weights.pt", weights_only=True)
    assert_tree_equal(dict(weights), full[0]["model"], "weights")


@pytest.mark.parametrize("option", ["save_best", "save_best_only"])
def test_a_best_checkpoint_of_a_sharded_net_is_refused_before_any_step(tmp_path, option):
    with pytest.raises(RankFailedError) as info:
        _spawn(1, tmp_path, batches=2, handler={option: True, "monitor": "train_loss"})
    assert f"CheckpointHandler({option}=True) is not available for a net sharded" in str(info.value)
    assert not any(name.endswith(".dcp") for name in os.listdir(tmp_path))


def test_a_plain_net_writes_directories_with_sharded_true_and_resumes_from_them_exactly(tmp_path):
    full = _in_process(tmp_path / "full", batches=8, period=1, handler={"sharded": True})
    assert full["files"] == [f"model-epoch0batch{b}.dcp" for b in range(1, 9)] + ["model-latest"]
    again = _in_process(_copy(tmp_path / "full", tmp_path, "model-epoch0batch3.dcp"), batches=8, period=1,
                        resume=True, handler={"sharded": True})
    assert again["losses"] == full["losses"][3:]
    assert_tree_equal(again["model"], full["model"], "model")
    assert_tree_equal(again["optimizer"], full["optimizer"], "optimizer")


def test_a_file_is_skipped_by_a_fit_of_a_sharded_net_saying_why(tmp_path):
    _in_process(tmp_path, batches=4, period=2)
    assert "model-epoch0batch4.pt" in os.listdir(tmp_path)
    with pytest.raises(RankFailedError) as info:
        _spawn(1, tmp_path, batches=BATCHES, resume=True)
    assert "written by a fit of a net that was not sharded and this net is sharded (FSDP2)" in str(info.value)


def test_sharded_false_is_refused_for_a_sharded_net_and_sharded_must_be_a_bool(tmp_path):
    with pytest.raises(RankFailedError, match=r"CheckpointHandler\(sharded=False\) but the net is sharded"):
        _spawn(1, tmp_path, batches=2, handler={"sharded": False})
    with pytest.raises(TypeError, match="sharded"):
        CheckpointHandler(tmp_path, sharded="yes")
