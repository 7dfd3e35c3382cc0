"""``Estimator(world_size_invariant=True)``: the same bits on any split of an optimizer step's
S = 4 micro-batches of 4 samples, 1 process x 4 accumulation steps, 2 x 2 and 4 x 1, DDP and FSDP2
(dropout, a random augmentation, AdamW, clipping): parameters, optimizer state and every
micro-batch's loss; a job SIGKILLed after a checkpoint on 4 processes resumed on 2 and on 1, and
2 -> 4, bit for bit; the bytes each rank sends per step against a ring all-reduce's; a split that
cannot keep S and the batch size refused, naming both."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from estimatorch import distributed
from estimatorch.checkpoint import CheckpointError
from estimatorch.distributed import RankFailedError
from tests.conftest import assert_tree_equal
from tests.distributed.invariant_fit import BATCH, SLOTS, STEPS, WIDTH, checkpoint_name, fit, several

KILL = 2  # the 4-process job dies right after the checkpoint of optimizer step 2 (of 6)
STRATEGIES = ("ddp", "fsdp")


def _in_process(*args):
    threads = torch.get_num_threads()
    try:
        return fit(*args)
    finally:
        torch.set_num_threads(threads)


def _resume_dir(root, source, name, target):
    """``target`` under ``root``, holding only checkpoint ``name`` of run ``source``."""
    (root / target).mkdir()
    src = root / source / name
    (shutil.copytree if src.is_dir() else shutil.copy)(src, root / target / name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the module: three jobs (4, 2 and 4 processes) and three fits in this process."""
    root = tmp_path_factory.mktemp("invariant")
    results = root / "results"
    results.mkdir()
    out = {"one": _in_process(str(root / "one"), "ddp", {})}  # 1 x 4 (a plain net: both strategies)
    with pytest.raises(RankFailedError):  # uninterrupted on 4, then a job killed after step KILL's checkpoint
        distributed.spawn(several, 4, str(root), [("four-ddp", "ddp", {"shards": True}), ("four-fsdp", "fsdp", {}),
                                                  ("four-killed", "fsdp", {"kill_at": KILL})], str(results),
                          backend="gloo")
    for strategy in STRATEGIES:
        out[f"four-{strategy}"] = torch.load(results / f"four-{strategy}.pt", weights_only=False)
    out["killed-files"] = sorted(os.listdir(root / "four-killed"))
    _resume_dir(root, "four-ddp", checkpoint_name("ddp", KILL, 1), "two-from-four-ddp")
    _resume_dir(root, "four-killed", checkpoint_name("fsdp", KILL, 1), "two-from-four-fsdp")
    middle = f"model-epoch0batch{2 * KILL + 1}"  # a window half done: each rank's partial sums are saved
    jobs = [("two-ddp", "ddp", {"period": 1}), ("two-fsdp", "fsdp", {"period": 1}),
            ("two-from-four-ddp", "ddp", {"resume": True}), ("two-from-four-fsdp", "fsdp", {"resume": True}),
            ("two-mid-window-ddp", "ddp", {"resume": True, "copy_from": ("two-ddp", f"{middle}.pt")}),
            ("two-mid-window-fsdp", "fsdp", {"resume": True, "copy_from": ("two-fsdp", f"{middle}.dcp")})]
    two = distributed.spawn(several, 2, str(root), jobs, str(results), backend="gloo")
    for i, (name, _, _) in enumerate(jobs):
        out[name] = [rank[i] for rank in two]
    for strategy in STRATEGIES:
        _resume_dir(root, f"two-{strategy}", checkpoint_name(strategy, KILL, 2), f"four-from-two-{strategy}")
    four = distributed.spawn(several, 4, str(root), [(f"four-from-two-{s}", s, {"resume": True}) for s in STRATEGIES],
                             str(results), backend="gloo")
    for i, strategy in enumerate(STRATEGIES):
        out[f"four-from-two-{strategy}"] = [rank[i] for rank in four]
    _resume_dir(root, "four-ddp", checkpoint_name("ddp", KILL, 1), "one-from-four-ddp")
    _resume_dir(root, "four-killed", checkpoint_name("fsdp", KILL, 1), "one-from-four-fsdp")
    for strategy in STRATEGIES:  # the sharded directory read whole into a plain net
        out[f"one-from-four-{strategy}"] = _in_process(str(root / f"one-from-four-{strategy}"), strategy,
                                                       {"resume": True})
    return out


def _same_bits(got, want, where):
    assert got["step"] == want["step"], where
    assert_tree_equal(got["model"], want["model"], f"{where}: model")
    assert_tree_equal(got["optimizer"], want["optimizer"], f"{where}: optimizer")


def _slots(per_rank, k):
    """Micro-batch records of the ranks in slot order: step by step, rank by rank."""
    steps = len(per_rank[0]) // k
    return [x for s in range(steps) for rank in per_rank for x in rank[s * k:(s + 1) * k]]


@pytest.mark.distributed
@pytest.mark.slow
def test_every_split_trains_the_same_bits_ddp_and_fsdp(runs):
    one = runs["one"]
    assert one["step"] == STEPS and one["collectives"] == 0 and one["bytes"] == 0  # optimizer steps
    for strategy in STRATEGIES:
        _same_bits(runs[f"four-{strategy}"], one, f"4 x 1 {strategy}")
        for rank in runs[f"two-{strategy}"]:
            _same_bits(rank, one, f"2 x 2 {strategy}")
        assert _slots([r["losses"] for r in runs[f"two-{strategy}"]], 2) == one["losses"]  # every micro-batch
        for run in [runs[f"four-{strategy}"], *runs[f"two-{strategy}"]]:  # the History: counts exact,
            assert run["history"]["train_accuracy"] == one["history"]["train_accuracy"]  # sums to rounding
            torch.testing.assert_close(torch.tensor(run["history"]["train_loss"]),
                                       torch.tensor(one["history"]["train_loss"]), rtol=1e-6, atol=0)
    assert runs["four-ddp"]["items_sums"] == runs["one"]["items_sums"] == 0  # samples: the layout knows N


@pytest.mark.distributed
@pytest.mark.slow
def test_a_job_killed_on_four_resumes_on_two_and_one_and_two_on_four_bit_identically(runs):
    one = runs["one"]
    assert checkpoint_name("fsdp", KILL, 1) in runs["killed-files"]
    assert checkpoint_name("fsdp", KILL + 1, 1) not in runs["killed-files"]  # killed right after it
    for strategy in STRATEGIES:
        for rank in runs[f"two-from-four-{strategy}"] + runs[f"four-from-two-{strategy}"]:
            _same_bits(rank, one, f"resumed {strategy}")
        _same_bits(runs[f"one-from-four-{strategy}"], one, f"4 -> 1 {strategy}")
        resumed = runs[f"two-from-four-{strategy}"]
        assert _slots([r["losses"] for r in resumed], 2) == one["losses"][KILL * SLOTS:]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_in_the_middle_of_a_window_resumes_on_its_split_bit_identically(runs):
    for strategy in STRATEGIES:
        for rank in runs[f"two-mid-window-{strategy}"]:
            _same_bits(rank, runs["one"], f"mid-window {strategy}")


def _params() -> list[tuple[int, int]]:
    """(rows, row size) of every parameter of the net of invariant_fit."""
    return [(WIDTH, 4), (WIDTH, 1), (3, WIDTH), (3, 1)]


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rank_sends_the_bytes_of_a_ring_all_reduce(runs):
    """Counted, not timed; P = 139 floats, a ring all-reduce sends 2 (W - 1)/W P of them. DDP on
    4 by shards: one all_to_all of this rank's one frontier node (S and k powers of two) and one
    all_gather of the summed shard, 2 (W - 1) shards of ceil(P / W) floats: the ring's bytes up to
    the padding. DDP on 2 (and any small gradient): the frontier whole in one all_gather, on 2
    ranks (W - 1) P, the ring's bytes exactly. FSDP2: one all_to_all per micro-batch of each
    module's padded flat gradient, as its reduce-scatter of every micro-batch sends."""
    total = sum(rows * size for rows, size in _params())
    ring = {world: 2 * (world - 1) / world * total * 4 for world in (2, 4)}
    four, two = runs["four-ddp"], runs["two-ddp"][0]
    assert four["bytes"] == STEPS * 2 * 3 * -(-total // 4) * 4 and four["collectives"] == 2 * STEPS
    assert four["bytes"] / STEPS <= ring[4] * (4 * -(-total // 4) / total)  # the ring's, but the padding
    assert two["bytes"] == STEPS * ring[2] and two["collectives"] == STEPS  # one collective per step
    assert runs["four-from-two-ddp"][0]["collectives"] == runs["four-from-two-ddp"][0]["step"] - KILL  # whole
    for world, fsdp in ((2, runs["two-fsdp"][0]), (4, runs["four-fsdp"])):
        padded = sum(-(-rows // world) * world * size for rows, size in _params())
        assert fsdp["bytes"] == STEPS * (SLOTS // world) * (world - 1) * (padded // world) * 4


def test_a_split_that_cannot_keep_s_and_b_is_refused_naming_both(tmp_path):
    """A checkpoint of 4 micro-batches of 4 samples per step, resumed as 4 x 2 (another S) and
    as 8 x 4 in one process (another b): refused before any step."""
    _in_process(str(tmp_path / "run"), "ddp", {"steps": 1})
    with pytest.raises(CheckpointError, match=r"saved 4 samples x 4 micro-batches per optimizer step, now 4 samples "
                                              r"x 2 micro-batches.*\(accumulation_steps=4 on 1 process\)"):
        _in_process(str(tmp_path / "run"), "ddp", {"resume": True, "accumulation": 2})
    with pytest.raises(CheckpointError, match=r"batch_size would change \(saved 4, now 8\).*stays 4"):
        _in_process(str(tmp_path / "run"), "ddp", {"resume": True, "batch": 2 * BATCH})
