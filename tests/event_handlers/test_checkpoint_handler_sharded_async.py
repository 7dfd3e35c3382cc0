"""CheckpointHandler(async_save=True) with a net sharded across ranks (FSDP2): each rank copies its
shards into staging buffers and its writer thread writes them, the ranks agreeing over a group
of their own; the directory holds the boundary's state whatever the steps during the write do, a
failed write is an error on every rank at the next save, and a SIGTERM during a write leaves
both checkpoints durable and resumes bit-identically."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from estimatorch import checkpoint, distributed
from tests.conftest import assert_tree_equal
from tests.event_handlers.sharded_fit import fit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCHES, PER_EPOCH = 10, 6
ASYNC = {"async_save": True}


def _name(step):
    return f"model-epoch{(step - 1) // PER_EPOCH}batch{step}.dcp"


def _spawn(ckpt_dir, **options):
    return distributed.spawn(fit, 2, str(ckpt_dir), dict(batches=BATCHES, **options), backend="gloo")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two ranks, synchronous saves after every batch."""
    ckpt = tmp_path_factory.mktemp("reference")
    return ckpt, _spawn(ckpt, period=1)


def test_each_directory_holds_its_boundary_whatever_the_steps_during_the_write_change(reference, tmp_path):
    ckpt, full = reference
    runs = _spawn(tmp_path, period=2, handler=ASYNC, scribble=True)
    assert runs[0]["scribbled"] == runs[1]["scribbled"] == BATCHES // 2 - 1  # every save but the last's
    for step in range(2, BATCHES + 1, 2):
        weights = checkpoint.load_weights(tmp_path / _name(step))
        assert_tree_equal(dict(weights), runs[0]["states"][step], f"model at step {step}")
        assert_tree_equal(dict(weights), dict(checkpoint.load_weights(ckpt / _name(step))), f"reference {step}")
    for got, want in zip(runs, full):  # saving in the background changes nothing of the run
        assert got["losses"] == want["losses"]
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")


def test_a_run_resumes_bit_identically_from_a_directory_written_in_the_background(reference, tmp_path):
    _, full = reference
    _spawn(tmp_path / "async", period=1, handler=ASYNC, slow_write=0.05)
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copytree(tmp_path / "async" / _name(4), resume / _name(4))
    again = _spawn(resume, period=1, resume=True, handler=ASYNC)
    for got, want in zip(again, full):
        assert got["outcome"] == "returned" and got["losses"] == want["losses"][4:]
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")


def test_a_failed_background_write_is_an_error_on_every_rank_at_the_next_save(tmp_path):
    runs = _spawn(tmp_path, period=2, handler=ASYNC, full_disk=2)  # rank 0's file of the save of step 4
    for result in runs:
        assert result["outcome"] == "OSError" and "No space left on device" in result["message"], result
        assert "rank-0.pt" in result["message"] and result["step"] == 6, result  # the next save's boundary
    assert runs[0]["errno"] == errno.ENOSPC
    assert [n for n in sorted(os.listdir(tmp_path)) if n.startswith("model-")] == [_name(2), "model-latest"]
    assert checkpoint.read_latest(tmp_path, "model") == _name(2)


def test_sigterm_during_a_background_write_leaves_both_checkpoints_durable_and_resumes_exactly(reference, tmp_path):
    _, full = reference
    # agree_every=1: the flags are exchanged after every step (gloo's default is every 16)
    stopped = _spawn(tmp_path / "run", period=3, handler=ASYNC, slow_write=0.5, signal_at={1: 3}, agree_every=1)
    assert [(r["outcome"], r["step"]) for r in stopped] == [("SystemExit(143)", 4)] * 2
    # 3 in flight at the signal, 4 in train_end; the progress mark stays after a stop by a signal
    assert stopped[0]["files"] == sorted([checkpoint.PROGRESS_NAME, _name(3), _name(4), "model-latest"])
    for step in (3, 4):
        assert checkpoint.locate(tmp_path / "run" / _name(step)).kind == "sharded"
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copytree(tmp_path / "run" / _name(4), resume / _name(4))
    again = _spawn(resume, period=3, resume=True, handler=ASYNC)
    for got, want in zip(again, full):
        assert got["losses"] == want["losses"][4:]
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")
