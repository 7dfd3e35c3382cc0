"""One process of the EMAHandler kill tests (run as a script by test_ema_kills.py): the resume
matrix's run (tests/integration/resume_worker.py: dropout, random augmentation, AdamW, a step
schedule, 3 epochs of 7 batches) with an EMAHandler (warm-up, a period, a start step) that the
validation runs on, and a checkpoint after every batch.

    python ema_worker.py full   --out OUT
    python ema_worker.py kill   --dir DIR --at K     (SIGKILLs itself after step K's checkpoint)
    python ema_worker.py term   --dir DIR --at K     (SIGTERM during step K: train_end saves its boundary)
    python ema_worker.py resume --dir DIR --out OUT [--dir DIR --out OUT ...]   (one resume after another)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from estimatorch import CheckpointHandler, EMAHandler  # noqa: E402
from estimatorch.event_handlers import BatchEnd  # noqa: E402
from tests.integration.resume_worker import EPOCHS, KillAfter, Recorder, build  # noqa: E402


class TermDuring(BatchEnd):
    """SIGTERM during step ``at``: fit stops at its boundary and the CheckpointHandler saves it."""

    def __init__(self, at):
        self.at, self.seen = at, 0

    def batch_end(self, estimator, **kwargs):
        self.seen += 1
        if self.seen == self.at:
            signal.raise_signal(signal.SIGTERM)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["full", "kill", "term", "resume"])
    parser.add_argument("--dir", action="append", default=[])
    parser.add_argument("--at", type=int)
    parser.add_argument("--out", action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for directory, out in zip(args.dir or [None], args.out or [None]):
        run(args.mode, directory, args.at, out)


def run(mode, directory, at, out):
    """One fit of ``mode`` (its checkpoints in ``directory``), its outcome saved to ``out``."""
    est, train, val = build(0)
    recorder, ema = Recorder(), EMAHandler(0.9, update_every=2, start_step=3, warmup=True)
    handlers = [recorder, ema]
    if mode != "full":
        # under SIGTERM, a step between two periodic checkpoints: train_end saves it
        handlers.append(CheckpointHandler(directory, batch_period=1 if mode != "term" else 4,
                                          epoch_period=None, max_checkpoints=None,
                                          resume_from_checkpoint=mode == "resume"))
    if mode == "kill":
        handlers.append(KillAfter(at))
    if mode == "term":
        handlers.append(TermDuring(at))
    history = est.fit(train, val_data=val, epochs=EPOCHS, event_handlers=handlers)
    outcome = {"losses": recorder.losses, "model": est.net.state_dict(), "raw": ema.raw_state_dict(),
               "updates": ema.updates, "history": history.to_dict()}
    if out is not None:
        torch.save(outcome, out)
    return outcome


if __name__ == "__main__":
    main()
