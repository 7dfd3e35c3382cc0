"""Two processes start a fit into one model_dir at the same instant: one trains, the other fails at
start with the lock message, and nothing of the first is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from estimatorch import checkpoint
from tests.conftest import assert_tree_equal

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
ROUNDS = 3


def _start(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
def test_two_fits_into_one_model_dir_at_the_same_instant(tmp_path):
    solo = tmp_path / "solo.pt"
    proc = _start("reference", "--out", solo)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    reference = torch.load(solo, weights_only=True)
    failures = []
    for round_ in range(ROUNDS):
        directory = tmp_path / f"shared{round_}"
        procs = [_start("race", "--dir", directory, "--out", tmp_path / f"r{round_}-{i}.pt") for i in range(2)]
        for p in procs:  # both built their fit (torch imported, model and data made)
            assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
        start = time.time() + 0.5
        for p in procs:
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
        results = [torch.load(tmp_path / f"r{round_}-{i}.pt", weights_only=True) for i in range(2)]
        trained = [r for r in results if r["outcome"] == "trained"]
        refused = [r for r in results if r["outcome"] != "trained"]
        assert len(trained) == 1 and len(refused) == 1, [r["outcome"] for r in results]
        failures.append(refused[0]["outcome"])
        holder_pid = procs[[r["outcome"] for r in results].index("trained")].pid
        assert refused[0]["outcome"] == "DirectoryLockedError", refused[0]
        assert f"pid {holder_pid}" in refused[0]["message"] and "in use by another fit" in refused[0]["message"]
        winner = trained[0]
        assert winner["losses"] == reference["losses"]  # the winner's run was not disturbed
        assert_tree_equal(winner["model"], reference["model"], "model")
        names = sorted(os.listdir(directory))
        assert not [n for n in names if n.endswith(".tmp") or n == checkpoint.LOCK_NAME], names
        for _, _, path in checkpoint.list_checkpoints(directory, "model"):
            checkpoint.load(path)
        assert checkpoint.read_latest(directory, "model") in names
    print(f"\n{ROUNDS} rounds of two simultaneous fits: the second got {failures}")
