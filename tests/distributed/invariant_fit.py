"""One rank of a ``world_size_invariant`` fit for the tests of the same bits on any split: S = 4
micro-batches of 4 samples per optimizer step (``accumulation_steps = 4 / world size``), dropout
and a random augmentation, AdamW, clipping, a checkpoint after every optimizer step; a fit may
SIGKILL its process right after a checkpoint (``kill_at``, in optimizer steps)."""

from __future__ import annotations

import os
import shutil
import signal
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, distributed
from estimatorch.event_handlers import BatchEnd, TrainBegin

N, BATCH, SLOTS, WIDTH, STEPS = 48, 4, 4, 17, 6  # 3 steps per epoch; 17 rows: uneven shards on 2 and 4 ranks


class Augmented(torch.utils.data.Dataset):
    """Fixed points with noise drawn at every access (a random augmentation)."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.arange(N) % 3

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


class Record(TrainBegin, BatchEnd):
    """Every micro-batch's loss (as hex: exact); SIGKILL after the boundary of step ``kill_at``."""

    priority = float("inf")  # after the CheckpointHandler: its save of the boundary comes first

    def __init__(self, kill_at=None, k=1):
        self.losses, self.kill_at, self.k, self.items = [], kill_at, k, None

    def train_begin(self, est, **kw):
        self.items = est.step_items

    def batch_end(self, est, *, loss, **kw):
        self.losses.append(float(loss.detach()).hex())
        if self.kill_at is not None and est.position.step + 1 == self.kill_at * self.k:
            est.at_boundary(lambda: os.kill(os.getpid(), signal.SIGKILL))


def full_state(est) -> dict[str, Any]:
    """Parameters and optimizer state in full, keyed by parameter name (gathered: a collective)."""
    model, optim = get_state_dict(est.net, est.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.detach().clone() for k, v in model.items()},
            "optimizer": {name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                          for name, state in optim["state"].items()}}


def fit(ckpt_dir: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    """One rank's fit; ``options``: resume, kill_at, steps (optimizer steps in all), clip, period
    (batches between checkpoints: ``k``, one per optimizer step, by default), accumulation and
    batch in place of the split's (another S, another b), and shards (DDP's exchange by shards,
    all_to_all and all_gather, also for this small gradient that travels whole by default)."""
    distributed.SlotReduction.gather_below = 0 if options.get("shards") else 1 << 16
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same bits on every rank need the same thread count
    net = nn.Sequential(nn.Linear(4, WIDTH), nn.ReLU(), nn.Dropout(0.3), nn.Linear(WIDTH, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=11,
                    strategy=strategy, device="cpu", world_size_invariant=True)
    k = options.get("accumulation", SLOTS // distributed.get_world_size())
    record = Record(options.get("kill_at"), k)
    update = GradientUpdateHandler(accumulation_steps=k, clip_grad_norm=options.get("clip", 0.3))
    handlers = [record, update, CheckpointHandler(ckpt_dir, batch_period=options.get("period", k), epoch_period=None,
                                                  max_checkpoints=None, resume_from_checkpoint=options.get("resume", False))]
    loader = torch.utils.data.DataLoader(Augmented(), batch_size=options.get("batch", BATCH), shuffle=True)
    history = est.fit(loader, batches=options.get("steps", STEPS) * k, event_handlers=handlers)
    reduction = update.reduction
    return {"losses": record.losses, "step": est.position.step // k, **full_state(est), "history": history.to_dict(),
            "bytes": reduction.bytes_sent if reduction is not None else 0,
            "collectives": reduction.collectives if reduction is not None else 0,
            "items_sums": record.items.collectives}


def checkpoint_name(strategy: str, step: int, k: int) -> str:
    """The file (or directory) of the checkpoint after optimizer step ``step`` of a fit of ``k``
    micro-batches per rank and step (3 steps per epoch)."""
    batch = step * k
    return f"model-epoch{(step - 1) // 3}batch{batch}" + (".dcp" if strategy == "fsdp" else ".pt")


def several(ckpt_root: str, jobs: list[tuple[str, str, dict[str, Any]]], results_dir: str) -> list[dict[str, Any]]:
    """Run ``jobs`` (``(subdirectory, strategy, options)``) one after the other on this rank; each
    job's results are saved to ``results_dir`` on rank 0 as soon as it ends (a later job may
    SIGKILL the processes)."""
    out = []
    for name, strategy, options in jobs:
        if "copy_from" in options:  # (run, checkpoint): resume from that one, written by an earlier job
            if distributed.get_rank() == 0:
                run, checkpoint = options["copy_from"]
                os.makedirs(os.path.join(ckpt_root, name))
                source = os.path.join(ckpt_root, run, checkpoint)
                (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, os.path.join(ckpt_root, name, checkpoint))
            distributed.barrier()
        result = fit(os.path.join(ckpt_root, name), strategy, options)
        if distributed.get_rank() == 0:
            torch.save(result, os.path.join(results_dir, f"{name}.pt"))
        out.append(result)
    return out
