"""Fault injection for sharded checkpoints: two ranks of an FSDP2 fit checkpoint after every batch
and rank 0 is SIGKILLed at each stage of a sharded write in turn (DCP's shards written but not
its metadata; before a rank's own file; before the marker; before the rename; before the
pointer; inside retention). Each launch resumes the previous one's directory. After every kill
the pointer names a directory that is there, every ``.dcp`` directory is complete; the last
launch ends bit-identical to an uninterrupted run, leaving no temporary behind. The chain runs
with synchronous saves and with ``async_save=True`` (the kills then land in the writer thread,
while the steps go on)."""

from __future__ import annotations

import os
import re

import pytest

from estimatorch import checkpoint, distributed
from estimatorch.checkpoint import _sharded
from estimatorch.distributed import RankFailedError
from tests.conftest import assert_tree_equal
from tests.event_handlers.sharded_fit import fit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCHES = 24
#: (stage, at its n-th occurrence in that launch, where it leaves the directory)
KILLS = [("shards", 2, "shards without metadata"), ("rank-file", 2, "before the rank files"),
         ("marker", 1, "before the marker"), ("rename", 2, "before the rename"), ("pointer", 2, "before the pointer"),
         ("prune", 1, "inside retention")]


def _spawn(ckpt_dir, **options):
    options = dict(batches=BATCHES, period=1, max_checkpoints=2, **options)
    return distributed.spawn(fit, 2, str(ckpt_dir), options, backend="gloo")


def _where(directory):
    """Where the kill landed, read from what it left."""
    temporaries = [directory / n for n in os.listdir(directory) if n.endswith(".tmp") and ".dcp." in n]
    if len(temporaries) > 1:
        return f"several temporaries: {temporaries}"
    if not temporaries:
        newest = checkpoint.list_checkpoints(directory, "model")[-1][2]
        return "before the pointer" if checkpoint.read_latest(directory, "model") != os.path.basename(newest) \
            else "after the write"
    inside = set(os.listdir(temporaries[0]))
    if _sharded.MARKER in inside:  # the new one (after every listed step), or an old one being deleted
        step = int(re.search(r"batch(\d+)\.dcp", temporaries[0].name).group(1))
        listed = [s for _, s, _ in checkpoint.list_checkpoints(directory, "model")]
        return "before the rename" if step > max(listed, default=0) else "inside retention"
    if "common.pt" in inside:
        return "before the marker"
    if ".metadata" in inside:
        return "before the rank files"
    if any(n.endswith(".distcp") for n in inside):
        return "shards without metadata"
    return f"an empty temporary ({sorted(inside)})"


def _check_left(directory):
    """What a kill left: the pointer names an existing directory; every .dcp one is complete."""
    names = os.listdir(directory)
    pointer = checkpoint.read_latest(directory, "model")
    assert pointer is None or pointer in names, f"the pointer names {pointer}, which is gone: {sorted(names)}"
    for _, _, path in checkpoint.list_checkpoints(directory, "model"):
        assert _sharded.is_sharded(path), f"{path} is listed without its marker"
    return max((step for _, step, _ in checkpoint.list_checkpoints(directory, "model")), default=0)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kills_at_every_stage_of_a_sharded_write_resume_from_the_newest_complete_one(tmp_path, async_save):
    reference = _spawn(tmp_path / "reference")
    ckpt = tmp_path / "ckpt"
    handler = {"async_save": async_save}
    newest = 0
    for stage, n, left in KILLS:
        with pytest.raises(RankFailedError, match="SIGKILL"):  # the kill, not a launch that failed otherwise
            _spawn(ckpt, resume=True, kill_in=(stage, n), handler=handler)
        assert _where(ckpt) == left, stage
        step = _check_left(ckpt)
        assert step >= newest, f"after a kill {stage}: the newest checkpoint went back from {newest} to {step}"
        newest = step
    assert newest < BATCHES
    final = _spawn(ckpt, resume=True, handler=handler)
    for got, want in zip(final, reference):
        assert got["outcome"] == "returned" and got["step"] == BATCHES
        assert got["losses"] == want["losses"][BATCHES - len(got["losses"]):]
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")
    resumed = [line for line in final[0]["log"] if line.startswith("Resuming from")]
    assert resumed and f"batch{newest}.dcp" in resumed[0]
    assert not [name for name in os.listdir(ckpt) if name.endswith(".tmp")]
