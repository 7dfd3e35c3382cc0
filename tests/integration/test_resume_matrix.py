"""Stop a run with SIGKILL right after the checkpoint of step k, resume it in a fresh process, and
get the uninterrupted run's bits: every parameter and optimizer tensor, and each step's loss.

The matrix: k in {first batch, mid-epoch, an epoch's last batch, first batch of an epoch, the
final batch} x num_workers {0 -> 0, 2 -> 2, 0 -> 2 across the resume}.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests import forked
from tests.integration.resume_worker import BATCH, EPOCHS, SAMPLES

WORKER = os.path.join(os.path.dirname(__file__), "resume_worker.py")
PER_EPOCH = -(-SAMPLES // BATCH)
STOPS = {"first": 1, "mid-epoch": 4, "epoch-last": PER_EPOCH, "epoch-first": PER_EPOCH + 1,
         "final": PER_EPOCH * EPOCHS}
WORKERS = [(0, 0), (2, 2), (0, 2)]


def _run(*args, expect_kill=False):
    proc = forked.run(WORKER, args, timeout=300)  # a fresh process, without a fresh interpreter's imports
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def _selected(session):
    """The matrix's cases this session runs, in the matrix's order: a run of one node id (the
    load harness's) starts only that case's processes, not all thirty."""
    chosen = {(item.callspec.params["before"], item.callspec.params["after"], item.callspec.params["name"])
              for item in session.items
              if getattr(item, "originalname", "") == "test_sigkill_after_a_checkpoint_then_resume_is_bit_identical"}
    return [(before, after, name, k) for before, after in WORKERS for name, k in STOPS.items()
            if (before, after, name) in chosen]


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    """Run the processes of the matrix's selected cases and both uninterrupted runs, two at a
    time; return the loaded results."""
    root = tmp_path_factory.mktemp("matrix")
    full_out = {w: root / f"full-w{w}.pt" for w in {0, 2}}
    cases = _selected(request.session)

    def full(w):
        _run("full", "--workers", w, "--out", full_out[w])

    def stop_and_resume(case):
        before, after, name, k = case
        directory = root / f"ckpt-{before}-{after}-{name}"
        _run("kill", "--workers", before, "--dir", directory, "--at", k, expect_kill=True)
        saved = sorted(os.listdir(directory))
        out = root / f"resumed-{before}-{after}-{name}.pt"
        _run("resume", "--workers", after, "--dir", directory, "--out", out)
        return case, saved, out

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(full, full_out))
        resumed = list(pool.map(stop_and_resume, cases))
    load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
    return {w: load(p) for w, p in full_out.items()}, {case: (saved, load(out)) for case, saved, out in resumed}


@pytest.mark.slow
def test_uninterrupted_runs_agree_across_worker_counts(matrix):
    full, _ = matrix
    assert len(full[0]["losses"]) == PER_EPOCH * EPOCHS
    _equal(full[0], full[2], "num_workers 0 vs 2")


@pytest.mark.slow
@pytest.mark.parametrize("before, after", WORKERS)
@pytest.mark.parametrize("name", list(STOPS))
def test_sigkill_after_a_checkpoint_then_resume_is_bit_identical(matrix, before, after, name):
    full, resumed = matrix
    k = STOPS[name]
    saved, result = resumed[(before, after, name, k)]
    latest = [f for f in saved if f.endswith(".pt")][-1] if saved else None
    assert any(f.endswith(f"batch{k}.pt") for f in saved), (latest, saved)
    assert not any(f.endswith(".tmp") for f in saved)
    reference = full[after]
    assert result["losses"] == reference["losses"][k:]
    _equal(reference["model"], result["model"], "model")
    _equal(reference["optimizer"], result["optimizer"], "optimizer")
    _equal(reference["scheduler"], result["scheduler"], "scheduler")
    _equal(reference["history"], result["history"], "history")
