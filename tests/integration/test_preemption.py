"""Preemption as a cluster does it, in subprocesses: SIGTERM (to the whole process group, so the
DataLoader workers get it too) or Ctrl-C during a step; the job checkpoints that step, exits with
the conventional status, and the rerun resumes from the exact step, ending bit-identical to an
uninterrupted run. With ``async_save=True`` (the writer process) and ``"thread"`` the signal comes
while the previous checkpoint is being written in the background: both files are durable before
the process exits. (Two ranks:
tests/estimator/stopping/test_stop_agreement.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from estimatorch import checkpoint
from tests.conftest import assert_tree_equal

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP = 9  # checkpoints every 4 batches: steps 5 to 8 would be lost without the preemption save

SCRIPT = r'''
import os, signal, sys, threading
import torch
from torch import nn
from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.event_handlers import BatchEnd

model_dir, step, signame, workers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
async_save = {"sync": False, "process": True, "thread": "thread"}[sys.argv[6]]
signalled = threading.Event()


def hold(path):
    if path.endswith(f"batch{step - 1}.pt"):
        assert signalled.wait(60), "no signal"
        print("the signal came during the write of", os.path.basename(path), flush=True)


if async_save == "thread" and step:  # the background write of the checkpoint before the signal waits for it
    real_save = checkpoint.atomic_save

    def held(obj, path, **kwargs):
        hold(path)
        real_save(obj, path, **kwargs)

    checkpoint.atomic_save = held
if async_save is True and step:  # the same, before the writer thread hands it to the writer process
    real_handover = checkpoint.ProcessWriter._write

    def held_handover(writer, staged, paths):
        hold(paths[0])
        real_handover(writer, staged, paths)

    checkpoint.ProcessWriter._write = held_handover
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background start inherits SIGINT ignored
torch.set_num_threads(1)


class Noisy(torch.utils.data.Dataset):
    """Random augmentation in the workers: seeded per sample by fit."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


class Preempt(BatchEnd):
    def batch_end(self, est, **kw):
        if est.position.step + 1 == step:  # mid-step: the whole process group, as SLURM does
            os.killpg(os.getpgid(0), getattr(signal, signame))
            signalled.set()


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=7)
loader = torch.utils.data.DataLoader(Noisy(), batch_size=6, shuffle=True, num_workers=workers)
ckpt = CheckpointHandler(model_dir, batch_period=4, epoch_period=None, max_checkpoints=None,
                         resume_from_checkpoint=True, async_save=async_save)
try:
    est.fit(loader, epochs=3, event_handlers=[Preempt(), ckpt])
finally:
    torch.save({"model": est.net.state_dict(), "optimizer": est.optimizer.state_dict(),
                "step": est.position.step, "interruption": est.interruption}, out)
    print("finally ran", flush=True)
'''


def run_script(tmp_path, model_dir, step=0, signame="SIGTERM", workers=0, tag="run", async_save=False):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{tag}.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(model_dir), str(step), signame, str(workers), str(out),
                           {False: "sync", True: "process", "thread": "thread"}[async_save]],
                          capture_output=True, text=True, env=env, timeout=300, start_new_session=True)
    result = torch.load(out, weights_only=True) if out.exists() else None
    return proc, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reference")
    proc, result = run_script(tmp_path, tmp_path / "ckpt", tag="reference")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result


@pytest.mark.parametrize("signame, workers, status, async_save", [
    ("SIGTERM", 2, 128 + signal.SIGTERM, False),  # loader workers receive it too
    ("SIGTERM", 0, 128 + signal.SIGTERM, False),
    ("SIGINT", 0, -signal.SIGINT, False),  # an unhandled KeyboardInterrupt: python ends itself by SIGINT
    ("SIGTERM", 0, 128 + signal.SIGTERM, True),  # during the background write of step 8's checkpoint
    ("SIGINT", 0, -signal.SIGINT, True),
    ("SIGTERM", 0, 128 + signal.SIGTERM, "thread"),
])
def test_a_preempted_job_loses_no_step_and_its_rerun_ends_bit_identical(signame, workers, status, async_save,
                                                                        tmp_path, reference):
    model_dir = tmp_path / "ckpt"
    proc, stopped = run_script(tmp_path, model_dir, step=STEP, signame=signame, workers=workers, tag="stopped",
                               async_save=async_save)
    assert proc.returncode == status, proc.stderr[-3000:]
    if async_save:
        assert f"the signal came during the write of model-epoch1batch{STEP - 1}.pt" in proc.stdout
    assert "finally ran" in proc.stdout  # the user's finally blocks ran
    assert stopped["step"] == STEP and stopped["interruption"] == signame
    # and the progress mark: the attempt's entry with the time of its train_end (the stop's save), for the ledger
    assert sorted(os.listdir(model_dir)) == sorted(["model-epoch0batch4.pt", "model-epoch1batch8.pt",
                                                    f"model-epoch1batch{STEP}.pt", "model-latest",
                                                    checkpoint.PROGRESS_NAME])
    assert f"Saved checkpoint of step {STEP} to {model_dir / f'model-epoch1batch{STEP}.pt'} ({signame})" in proc.stdout

    proc, resumed = run_script(tmp_path, model_dir, workers=workers, tag="resumed", async_save=async_save)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"Resuming from {model_dir / f'model-epoch1batch{STEP}.pt'}: 1 epochs and {STEP} batches done; the last "
            f"attempt stopped for {signame} after step {STEP}, no step to train again") in proc.stdout
    assert resumed["step"] == reference["step"] == 21 and resumed["interruption"] is None
    assert_tree_equal(resumed["model"], reference["model"], "model")
    assert_tree_equal(resumed["optimizer"], reference["optimizer"], "optimizer")


def test_ctrl_c_in_a_script_ends_with_one_line_saying_what_was_saved_and_how_to_resume(tmp_path):
    """Not a 10-line traceback through the loop: one line, and the status of a process ended by
    Ctrl-C (130 in a shell: python ends itself by SIGINT)."""
    model_dir = tmp_path / "ckpt"
    proc, stopped = run_script(tmp_path, model_dir, step=STEP, signame="SIGINT", tag="stopped")
    assert proc.returncode == -signal.SIGINT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"KeyboardInterrupt: stopped by Ctrl-C after step {STEP} (epoch 2); checkpoint in {model_dir}: "
                    "run the script again to resume")
    assert stopped["step"] == STEP
