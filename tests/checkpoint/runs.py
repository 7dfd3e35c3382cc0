"""The small run the checkpoint tests resume: an MLP with dropout, AdamW and a step LR scheduler on
a shuffling DataLoader, two epochs of four batches, a checkpoint after every batch."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from estimatorch import CheckpointHandler, Estimator, checkpoint
from tests.conftest import Count, LossRecorder

FEATURES, CLASSES, SAMPLES, BATCH_SIZE, EPOCHS = 4, 3, 16, 4, 2
BATCHES = SAMPLES // BATCH_SIZE
STEPS = EPOCHS * BATCHES


def build(net: Optional[nn.Module] = None, compile_net: bool = False) -> tuple[Estimator, DataLoader]:
    torch.manual_seed(0)
    net = net if net is not None else nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Dropout(0.2),
                                                    nn.Linear(8, CLASSES))
    if compile_net:
        net = torch.compile(net, backend="eager")
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, lr_scheduler=scheduler, seed=4)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))
    return estimator, DataLoader(data, batch_size=BATCH_SIZE, shuffle=True)


def fit_run(directory: Any, *, estimator: Optional[Estimator] = None, loader: Any = None,
            extra: Optional[list] = None, **handler_kwargs: Any) -> SimpleNamespace:
    """Fit the run with a CheckpointHandler saving after every batch into ``directory``."""
    if estimator is None:
        estimator, loader = build()
    kwargs: dict[str, Any] = dict(batch_period=1, epoch_period=None, max_checkpoints=None)
    kwargs.update(handler_kwargs)
    recorder, count = LossRecorder(), Count()
    handler = CheckpointHandler(directory, **kwargs)
    history = estimator.fit(loader, epochs=EPOCHS, event_handlers=[handler, recorder, count, *(extra or [])])
    return SimpleNamespace(estimator=estimator, losses=recorder.losses, history=history, dir=directory,
                           handler=handler, count=count)


def name(step: int) -> str:
    """The batch-period file written after ``step`` batches."""
    return checkpoint.checkpoint_name("model", (step - 1) // BATCHES, step)


def copy_files(reference: SimpleNamespace, directory: Any, steps: Any) -> None:
    os.makedirs(directory, exist_ok=True)
    for step in steps:
        shutil.copy(os.path.join(reference.dir, name(step)), directory)


def rewrite(path: Any, change: Any) -> None:
    """Load a checkpoint file raw, let ``change(payload)`` edit it, save it back."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    change(payload)
    torch.save(payload, path)


def dir_state(directory: Any) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}
