"""Fault injection: SIGKILL a process that writes a checkpoint after every batch, at seeded random
moments (a timer from the start of fit) and at seeded points inside the write sequence (inside
``torch.save``, before a rename, before the pointer, before a prune, before an fsync). After each
kill a fresh process resumes: it must pick the newest complete file, end bit-identical to an
uninterrupted run (parameters, optimizer state, every later step's loss), and leave no temporary
file behind. The pointer must never name a missing file.

Each process resumes the previous trial's directory, then runs the next trial and is killed:
one process per trial, forked from a server that imported torch once (``tests/forked.py``), so
that a trial costs its fit, not an interpreter's start-up. The whole chain runs with synchronous saves, with
``async_save="thread"`` (the kills inside the write sequence then land in the writer thread, while
the steps go on) and with ``async_save=True`` (the writer process: the kills inside its own
writes, by byte count and before the checkpoint's rename, cannot be placed from the training
process and are left out; the timed kills land in its writes too, the writer process dying with
the training process; tests/checkpoint/test_writer_process.py kills the writer alone).
"""

from __future__ import annotations

import collections
import os
import random
import signal

import pytest
import torch

from estimatorch import checkpoint
from estimatorch.checkpoint import LOCK_NAME
from tests import forked
from tests.conftest import assert_tree_equal
from tests.integration.checkpoint_worker import MAX_CHECKPOINTS, STEPS

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
SEED = 20240917
TIMER_TRIALS = 20
#: (how, how many trials): kills at seeded points of the write sequence.
STAGED = [("bytes", 3), ("replace-checkpoint", 2), ("replace-pointer", 2), ("remove", 2), ("fsync", 1)]


def _run(*args, expect_kill):
    proc = forked.run(WORKER, args, timeout=300)  # a fresh process, without a fresh interpreter's imports
    want = -signal.SIGKILL if expect_kill else 0
    assert proc.returncode == want, f"exit {proc.returncode}, wanted {want}\n{proc.stderr[-3000:]}"
    return proc


def _trials(reference_seconds, checkpoint_bytes, staged=STAGED, timed=TIMER_TRIALS):
    rng = random.Random(SEED)
    trials = [("timer", f"{rng.uniform(0.0, 1.1 * reference_seconds):.4f}") for _ in range(timed)]
    ranges = {"bytes": (1, STEPS * checkpoint_bytes), "replace-checkpoint": (1, STEPS), "replace-pointer": (1, STEPS),
              "remove": (1, STEPS - MAX_CHECKPOINTS), "fsync": (1, 3 * STEPS)}
    for how, count in staged:
        trials += [(how, str(rng.randint(*ranges[how]))) for _ in range(count)]
    rng.shuffle(trials)
    return trials


def _newest_complete(directory):
    """(step, name) of the newest periodic checkpoint that loads, or (0, None)."""
    for _, _, path in reversed(checkpoint.list_checkpoints(directory, "model")):
        try:
            return checkpoint.load(path)["ranks"][0]["position"]["step"], os.path.basename(path)
        except checkpoint.CheckpointError:
            continue
    return 0, None


def _classify(directory, how):
    """Where the kill landed, read from what it left (asserting the pointer names a file)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    periodic = [os.path.basename(p) for _, _, p in checkpoint.list_checkpoints(directory, "model")]
    pointer = checkpoint.read_latest(directory, "model")
    assert pointer is None or pointer in names, f"the pointer names {pointer}, which is gone: {sorted(names)}"
    step, newest = _newest_complete(directory)
    if any(n.endswith(".tmp") for n in names):
        return "mid-write (a temporary left)"
    if not periodic:
        return "before the first checkpoint"
    if pointer != newest:
        return "after a checkpoint, before its pointer"
    if len(periodic) > MAX_CHECKPOINTS:
        return "after the pointer, before pruning"
    if step == STEPS:
        return "after the last save"
    return "between writes"


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, "thread", True], ids=["sync", "thread", "process"])
def test_sigkill_at_random_moments_then_resume_picks_the_newest_complete_file_bit_identically(tmp_path, async_save):
    mode = {False: [], "thread": ["--async", "thread"], True: ["--async"]}[async_save]
    out = tmp_path / "reference.pt"
    _run("reference", "--out", out, *mode, expect_kill=False)
    reference = torch.load(out, weights_only=True)
    assert len(reference["losses"]) == STEPS
    sizes = [os.path.getsize(p) for _, _, p in checkpoint.list_checkpoints(str(out) + ".dir", "model")]
    in_the_writer_process = ("bytes", "replace-checkpoint")
    staged = [(how, n) for how, n in STAGED if async_save is not True or how not in in_the_writer_process]
    timed = TIMER_TRIALS // 2 if async_save is True else TIMER_TRIALS  # (two interpreters start per trial)
    trials = _trials(reference["seconds"], max(sizes), staged, timed)
    assert len(trials) >= 15

    outcomes: collections.Counter = collections.Counter()
    picked: collections.Counter = collections.Counter()
    previous = None
    for i, (how, at) in enumerate(trials + [(None, None)]):
        args = []
        if previous is not None:
            directory, expected_step = previous
            args += ["--resume", directory, "--out", tmp_path / f"resumed{i - 1}.pt"]
        if how is not None:
            args += ["--kill", tmp_path / f"trial{i}", "--how", how, "--at", at]
        _run("chain", *args, *mode, expect_kill=how is not None)
        if previous is not None:
            resumed = torch.load(tmp_path / f"resumed{i - 1}.pt", weights_only=True)
            where = f"trial {i - 1} ({trials[i - 1]})"
            if expected_step == STEPS:  # nothing left to train: the fit only checks and cleans up
                assert resumed["losses"] == [], where
            else:
                assert resumed["start"] == expected_step, where
                assert resumed["losses"] == reference["losses"][expected_step:], where
            for key in ("model", "optimizer"):
                assert_tree_equal(resumed[key], reference[key], f"{where} {key}")
            left = os.listdir(directory)
            assert not [n for n in left if n.endswith(".tmp")] and LOCK_NAME not in left, (where, left)
            assert len(checkpoint.list_checkpoints(directory, "model")) == MAX_CHECKPOINTS, (where, left)
            assert checkpoint.read_latest(directory, "model") in left, where
        if how is not None:
            directory = str(tmp_path / f"trial{i}")
            outcome = _classify(directory, how)
            if how in ("bytes", "replace-checkpoint"):
                assert outcome == "mid-write (a temporary left)", (how, at, outcome)
            outcomes[outcome] += 1
            step, newest = _newest_complete(directory)
            picked["none: a new run" if newest is None else "the newest file"] += 1
            previous = (directory, step)
    saves = f"async_save={async_save!r}" if async_save else "synchronous saves"
    print(f"\n{saves}: {len(trials)} SIGKILLs ({timed} timed, {len(trials) - timed} at write stages), "
          f"seed {SEED}; where they landed:")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {count:3d}  {outcome}")
    print(f"resume picked: {dict(picked)}; every resume bit-identical, no temporary left")
    assert sum(outcomes.values()) == len(trials)
