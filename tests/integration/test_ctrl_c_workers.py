"""A terminal's Ctrl-C during a fit with DataLoader workers, as the user meets it: SIGINT to the
whole process group (the workers get it too), at a random moment near a step, an epoch's start
(workers starting) or an epoch's end (workers shutting down); then a rerun resumes, is stopped the
same way once more, and a last rerun finishes. Each stop ends the process (status of Ctrl-C) with
the step it stopped at checkpointed, in bounded time; the finished run is bit-identical to an
uninterrupted one. Loop it under load with ``python -m tests.load_harness -n 50 --load <this test>``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import assert_tree_equal

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 48  # 4 epochs of 12 batches

SCRIPT = r'''
import faulthandler, os, signal, sys, threading, time
faulthandler.dump_traceback_later(float(os.environ.get("CTRL_C_STACKS_AFTER", "90")), exit=False)  # a hang shows where
import torch
from torch import nn
from estimatorch import CheckpointHandler, Estimator
from estimatorch.event_handlers import BatchEnd, EpochBegin, EpochEnd

model_dir, out, event, count, delay = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background start inherits SIGINT ignored
torch.set_num_threads(1)


class Noisy(torch.utils.data.Dataset):
    """Random augmentation in the workers, and a little time per sample."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.002)
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


class CtrlC(BatchEnd, EpochBegin, EpochEnd):
    """The count-th ``event`` of this process presses Ctrl-C ``delay`` seconds later (a timer thread)."""

    seen = 0

    def press(self, name):
        if name == event:
            self.seen += 1
            if self.seen == count:
                threading.Timer(delay, os.killpg, (os.getpgid(0), signal.SIGINT)).start()

    def batch_end(self, est, **kw):
        self.press("batch_end")

    def epoch_begin(self, est, **kw):
        self.press("epoch_begin")

    def epoch_end(self, est, **kw):
        self.press("epoch_end")


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=7)
loader = torch.utils.data.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2)
ckpt = CheckpointHandler(model_dir, batch_period=5, epoch_period=None, max_checkpoints=None,
                         resume_from_checkpoint=True)
handlers = [ckpt] if event == "none" else [CtrlC(), ckpt]
try:
    est.fit(loader, epochs=4, event_handlers=handlers)
finally:
    torch.save({"model": est.net.state_dict(), "optimizer": est.optimizer.state_dict(),
                "step": est.position.step, "interruption": est.interruption}, out)
    print("finally ran", flush=True)
'''


def run_script(tmp_path, tag, event="none", count=0, delay=0.0):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"{tag}.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt"), str(out), event, str(count),
                           str(delay)], capture_output=True, text=True, env=env, timeout=150,
                          start_new_session=True)
    return proc, (torch.load(out, weights_only=True) if out.exists() else None)


def test_ctrl_c_to_the_group_with_workers_twice_then_resume_ends_bit_identical(tmp_path):
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    proc, reference = run_script(reference_dir, "reference")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert reference["step"] == STEPS
    rng = random.Random()
    last = 0
    for attempt in range(2):  # two Ctrl-Cs, each followed by a rerun that resumes
        event = rng.choice(["batch_end", "epoch_begin", "epoch_end"])
        count, delay = rng.randint(1, 3 if event == "batch_end" else 1), rng.uniform(0.0, 0.05)
        plan = f"Ctrl-C {delay:.3f} s after {event} #{count}"
        proc, stopped = run_script(tmp_path, f"stopped{attempt}", event, count, delay)
        if proc.returncode == 0:  # the fit ended before the press landed: nothing to stop
            assert stopped["step"] == STEPS, plan
            break
        assert proc.returncode == -signal.SIGINT, f"{plan}: {proc.stderr[-3000:]}"
        assert "finally ran" in proc.stdout, plan
        # a press before the resumed run's first step stops at the boundary it resumed from
        assert stopped["interruption"] == "SIGINT" and last <= stopped["step"] <= STEPS, (plan, stopped["step"])
        saved = [name for name in os.listdir(tmp_path / "ckpt") if name.endswith(f"batch{stopped['step']}.pt")]
        assert len(saved) == 1, f"{plan}: {proc.stdout[-2000:]}"  # the stop's step (or a periodic save of it)
        last = stopped["step"]
    proc, resumed = run_script(tmp_path, "resumed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["step"] == STEPS and resumed["interruption"] is None
    assert_tree_equal(resumed["model"], reference["model"], "model")
    assert_tree_equal(resumed["optimizer"], reference["optimizer"], "optimizer")
