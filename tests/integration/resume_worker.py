"""One process of the stop-and-resume matrix (run as a script by test_resume_matrix.py).

The setup the exact-resume issue names: a tiny MLP with dropout, AdamW and a step LR scheduler; a
map-style dataset whose __getitem__ draws augmentation from torch, numpy (the library's generator)
and python's random; a shuffling DataLoader; 3 epochs of 7 batches, the last one partial.

    python resume_worker.py full   --workers W --out OUT
    python resume_worker.py kill   --workers W --dir DIR --at K      (SIGKILLs itself after step K's checkpoint)
    python resume_worker.py resume --workers W --dir DIR --out OUT
"""

from __future__ import annotations

import argparse
import os
import random
import signal

import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, rng
from estimatorch.event_handlers import BatchEnd

SAMPLES, BATCH, EPOCHS = 52, 8, 3  # 7 batches per epoch: 6 full, 1 of 4


class AugmentedDataset(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        noise = 0.1 * torch.randn(6)
        shift = float(rng.default_numpy_rng().normal(scale=0.1))
        scale = 1.0 + 0.1 * random.random()
        return (self.x[i] + noise + shift) * scale, self.y[i]


class Recorder(BatchEnd):
    priority = float("inf")

    def __init__(self):
        self.losses = []

    def batch_end(self, estimator, *, loss, **kwargs):
        self.losses.append(float(loss.detach()).hex())


class KillAfter(BatchEnd):
    """SIGKILL at the boundary after step ``at``: right after that step's checkpoint."""

    priority = float("inf")

    def __init__(self, at):
        self.at, self.seen = at, 0

    def batch_end(self, estimator, **kwargs):
        self.seen += 1
        if self.seen == self.at:
            estimator.at_boundary(lambda: os.kill(os.getpid(), signal.SIGKILL))


def build(workers):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, lr_scheduler=scheduler, seed=7)
    train = torch.utils.data.DataLoader(AugmentedDataset(), batch_size=BATCH, shuffle=True, num_workers=workers)
    val = [(torch.randn(8, 6, generator=torch.Generator().manual_seed(i)), torch.arange(8) % 3) for i in range(2)]
    return est, train, val


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["full", "kill", "resume"])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--dir")
    parser.add_argument("--at", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    est, train, val = build(args.workers)
    recorder = Recorder()
    handlers = [recorder]
    if args.mode != "full":
        handlers.append(CheckpointHandler(args.dir, batch_period=1, epoch_period=None, max_checkpoints=None,
                                          resume_from_checkpoint=args.mode == "resume"))
    if args.mode == "kill":
        handlers.append(KillAfter(args.at))
    history = est.fit(train, val_data=val, epochs=EPOCHS, event_handlers=handlers)
    if args.out:
        torch.save({"losses": recorder.losses, "model": est.net.state_dict(),
                    "optimizer": est.optimizer.state_dict(), "scheduler": est.lr_scheduler.state_dict(),
                    "history": history.to_dict()}, args.out)


if __name__ == "__main__":
    main()
