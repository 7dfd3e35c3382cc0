"""The run's ledger under torchrun, 2 gloo ranks: rank 1 is SIGKILLed after step 13 (the checkpoint
of step 10 the newest; rank 0's collective then fails: the job lost a rank without a word) and
torchrun's agent restarts both workers; the restarted workers get SIGTERM during step 27 (as a
cluster signals every process of a job) and both stop at the next agreed boundary, step 28, and
checkpoint it; the agent restarts them again, and they train to the end. The ledger rank 0 keeps: killed, signal,
finished; 3, 0, 0 steps lost; the resumes from 10 and 28; the goodput between 0 and 1."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys

import pytest

from estimatorch import checkpoint
from tests.distributed.test_cluster_launchers import _base_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KILL_AFTER, CHECKPOINT, TERM_AT, STEPS = 13, 10, 27, 40
STOPPED = TERM_AT + 1  # a signal during step k stops every rank at step k + 1 (agree_every=1)

SCRIPT = '''
import json, os, signal, sys, torch
from torch import nn
from estimatorch import CheckpointHandler, Estimator, distributed
from estimatorch.event_handlers import BatchBegin, BatchEnd

torch.set_num_threads(1)
out, model_dir = sys.argv[1], sys.argv[2]
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = distributed.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), seed=3)
est.agree_every = 1  # a signal on every rank during step 27 stops both at step 27
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(160, 4, generator=g), torch.arange(160) % 3)
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)  # 20 steps per epoch and rank


class Interrupt(BatchBegin, BatchEnd):
    priority = float("inf")

    def batch_begin(self, est, **kw):
        if restart == 0 and rank == 1 and est.position.step == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)

    def batch_end(self, est, **kw):
        if restart == 1 and est.position.step + 1 == TERM_AT:  # the cluster signals every worker
            os.kill(os.getpid(), signal.SIGTERM)


KILL_AFTER, TERM_AT = int(sys.argv[3]), int(sys.argv[4])
try:
    history = est.fit(loader, epochs=2, event_handlers=[
        CheckpointHandler(model_dir, batch_period=5, max_checkpoints=None, resume_from_checkpoint=True), Interrupt()])
    status = 0
except SystemExit as stop:
    history, status = None, stop.code
if rank == 0:
    with open(f"{out}/attempt-{restart}.json", "w") as f:
        json.dump({"status": status, "ledger": history.ledger if history is not None else None}, f)
sys.stdout.flush(); sys.stderr.flush()
os._exit(status)  # torch 2.13's gloo may abort at teardown: the results are written (143: the agent restarts)
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One torchrun whose agent restarts its workers twice: after the kill, after the stop."""
    tmp = tmp_path_factory.mktemp("ledger-torchrun")
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=2", "--monitor-interval=0.5", str(script), str(tmp), str(tmp / "model"),
                           str(KILL_AFTER), str(TERM_AT)], capture_output=True, text=True, env=_base_env(), timeout=400)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (tmp / "attempt-2.json").exists(), logs[-6000:]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert checkpoint.main(["inspect", str(tmp / "model"), "--json"]) == 0
    return {"last": json.loads((tmp / "attempt-2.json").read_text()), "logs": logs,
            "inspect": json.loads(text.getvalue()),
            "dir": tmp / "model", "stopped": json.loads((tmp / "attempt-1.json").read_text())}


def test_the_attempts_under_torchrun_end_killed_stopped_and_finished(run):
    assert run["last"]["status"] == 0, run["logs"][-6000:]
    for ledger in (run["last"]["ledger"], run["inspect"]["ledger"]):
        attempts = ledger["attempts"]
        assert [a["ended"] for a in attempts] == ["killed", "signal", "finished"], run["logs"][-6000:]
        assert [a["resumed_from"] for a in attempts] == [None, CHECKPOINT, STOPPED]
        assert [a["last_step"] for a in attempts] == [KILL_AFTER, STOPPED, STEPS]
        assert attempts[0]["reason"].startswith("another rank ended without a word (RuntimeError: ")
        assert [a["steps_lost"] for a in attempts] == [KILL_AFTER - CHECKPOINT, 0, 0]
        assert [a["world_size"] for a in attempts] == [2, 2, 2]
        assert ledger["steps_lost"] == KILL_AFTER - CHECKPOINT and 0 < ledger["goodput"] < 1


def test_the_restarted_worker_says_what_the_killed_attempt_lost(run):
    lost = KILL_AFTER - CHECKPOINT
    assert (f"0 epochs and {CHECKPOINT} batches done; the last attempt was killed after step {KILL_AFTER}, "
            f"{lost} steps to train again") in run["logs"]
    assert f"the last attempt stopped for SIGTERM after step {STOPPED}, no step to train again" in run["logs"]
    assert os.path.exists(run["dir"] / f"model-epoch1batch{STOPPED}.pt")
    assert run["stopped"]["status"] == 128 + signal.SIGTERM
