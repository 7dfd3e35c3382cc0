"""EMAHandler across process deaths: a run SIGKILLed right after a checkpoint (mid-epoch, at an
epoch's last batch, in a later epoch) or stopped by SIGTERM between checkpoints resumes in a new
process with the uninterrupted run's bits: every step's loss, the validation on the average, the
average the net holds at the end and the trained weights."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import assert_tree_equal
from tests.event_handlers import ema_worker
from tests.integration.resume_worker import BATCH, SAMPLES

pytestmark = pytest.mark.slow

WORKER = os.path.join(os.path.dirname(__file__), "ema_worker.py")
PER_EPOCH = -(-SAMPLES // BATCH)
KILLS = {"mid-epoch": 4, "epoch-last": PER_EPOCH, "later-epoch": PER_EPOCH + 4}
TERM_AT = 6  # between the checkpoints of steps 4 and 8


def _run(*args, status=0):
    proc = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run SIGKILLed after the checkpoint of its latest kill point, then a new process resuming
    from each kill point's checkpoint it left, one after another; one stopped by SIGTERM, resumed
    in a new process; the uninterrupted run in this one."""
    root = tmp_path_factory.mktemp("ema-kills")
    killed, termed = root / "killed", root / "termed"

    def resume(source, cases):
        args = []
        for name, step in cases.items():
            directory = root / f"from-{name}"
            directory.mkdir()
            kept = next(f for f in os.listdir(source) if f.endswith(f"batch{step}.pt"))
            shutil.copy(source / kept, directory / kept)
            args += ["--dir", directory, "--out", root / f"{name}.pt"]
        _run("resume", *args)

    with ThreadPoolExecutor(max_workers=2) as pool:
        kill = pool.submit(_run, "kill", "--dir", killed, "--at", max(KILLS.values()), status=-signal.SIGKILL)
        term = pool.submit(_run, "term", "--dir", termed, "--at", TERM_AT, status=143)
        kill.result()
        resumed = [pool.submit(resume, killed, KILLS)]
        term.result()
        resumed.append(pool.submit(resume, termed, {"sigterm": TERM_AT}))
        full = ema_worker.run("full", None, None, None)
        for job in resumed:
            job.result()
    return {"full": full, **{name: torch.load(root / f"{name}.pt", weights_only=True) for name in [*KILLS, "sigterm"]}}


@pytest.mark.parametrize("name", [*KILLS, "sigterm"])
def test_a_resume_after_a_kill_or_sigterm_has_the_uninterrupted_runs_bits(runs, name):
    full, got = runs["full"], runs[name]
    step = KILLS.get(name, TERM_AT)
    assert got["losses"] == full["losses"][step:]
    assert got["history"] == full["history"]  # the val metrics are the average's
    assert got["updates"] == full["updates"] > 0
    assert_tree_equal(got["model"], full["model"], "the average, in the net")
    assert_tree_equal(got["raw"], full["raw"], "the trained weights")
