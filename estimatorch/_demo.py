"""``python -m estimatorch demo``: train a real model, then stop a run midway, resume it in a new
estimator from its checkpoint, and show that the result is bit-identical.

The data is generated in code (no download): 8x8 images of the digits 0-9 drawn from a 5x7
pixel font, randomly shifted and noised in ``__getitem__`` (augmentation that draws from torch,
python's ``random`` and the library's numpy generator).
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
from typing import Any, Optional

import torch
from torch import nn

from . import rng
from .checkpoint import list_checkpoints
from .estimator import Estimator
from .event_handlers import CheckpointHandler, EarlyStoppingHandler
from .testing import _CrashAfter, _SimulatedCrash

__all__ = ["DigitGlyphs", "main", "make_estimator"]

# A 5x7 pixel font: each digit is 7 rows of 5 bits.
_FONT = {
    0: ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    1: ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    2: ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    3: ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],
    4: ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    5: ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    6: ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    7: ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    8: ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    9: ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}
_GLYPHS = torch.tensor([[[int(c) for c in row] for row in _FONT[d]] for d in range(10)], dtype=torch.float32)


class DigitGlyphs(torch.utils.data.Dataset):
    """Noisy 8x8 digit images (flattened to 64 values) with random placement.

    Sample ``i`` is digit ``i % 10``. With ``augment``, every fetch places the glyph at a random
    offset, adds gaussian noise (torch), flips a few pixels (numpy) and scales the contrast
    (python ``random``); estimatorch seeds those draws from the sample's position, so a resumed
    run sees exactly the same images.

    Args:
        size: number of samples.
        augment: draw a new random variant on every fetch. Defaults to True.
        seed: seeds the fixed variants when ``augment`` is False. Defaults to 0.
    """

    def __init__(self, size: int, augment: bool = True, seed: int = 0):
        self.size = size
        self.augment = augment
        self.fixed: Optional[torch.Tensor] = None
        if not augment:  # draw one variant per sample, once, without touching the caller's RNG
            with rng.keep_random_state():
                rng.seed_everything(seed)
                self.fixed = torch.stack([self._draw(i) for i in range(size)])

    def __len__(self) -> int:
        return self.size

    def _draw(self, index: int) -> torch.Tensor:
        digit = index % 10
        image = torch.zeros(8, 8)
        dy, dx = random.randint(0, 1), random.randint(0, 3)
        image[dy:dy + 7, dx:dx + 5] = _GLYPHS[digit]
        flips = torch.from_numpy(rng.default_numpy_rng().random((8, 8)) < 0.02)
        image = torch.where(flips, 1.0 - image, image)
        image = image * random.uniform(0.7, 1.3) + 0.2 * torch.randn(8, 8)
        return image.flatten()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self._draw(index) if self.fixed is None else self.fixed[index]
        return image, index % 10


def make_estimator(seed: int = 0) -> Estimator:
    """The demo's model: a two-layer MLP with dropout, AdamW and a cosine schedule."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(net.parameters(), lr=5e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, lr_scheduler=scheduler, seed=seed)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m estimatorch demo", description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (default 0)")
    parser.add_argument("--stop-at", type=int, default=37, help="batch at which the second run is stopped")
    parser.add_argument("--model-dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = parser.parse_args(argv)
    for name in ("epochs", "stop_at"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if args.workers < 0:
        parser.error(f"--workers must be a non-negative int, got {args.workers}")
    period = min(10, args.stop_at)  # a checkpoint every 10 batches, at least one before the stop
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation
    log = logging.getLogger("estimatorch")

    def loaders() -> tuple[Any, Any]:
        train = torch.utils.data.DataLoader(DigitGlyphs(3000), batch_size=64, shuffle=True, num_workers=args.workers)
        val = torch.utils.data.DataLoader(DigitGlyphs(1000, augment=False, seed=1), batch_size=250)
        return train, val

    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir or tmp
        log.info("== 1. Training with the default handlers (metrics, logging, progress, stopping, "
                 "gradient update, validation, LR schedule), early stopping and checkpoints ==")
        est = make_estimator()
        train, val = loaders()
        handlers = [CheckpointHandler(f"{root}/full", batch_period=period, epoch_period=None),
                    EarlyStoppingHandler(est.val_metrics[0], patience=2)]
        history = est.fit(train, val_data=val, epochs=args.epochs, event_handlers=handlers)
        log.info("History: %s", {k: [round(v, 4) for v in vals] for k, vals in history.to_dict().items()})

        log.info("== 2. The same run, crashing after batch %d (as a pre-emption or a power cut would) ==",
                 args.stop_at)
        stopped = make_estimator()
        train, val = loaders()
        try:
            stopped.fit(train, val_data=val, epochs=args.epochs, event_handlers=[
                CheckpointHandler(f"{root}/resumed", batch_period=period, epoch_period=None),
                EarlyStoppingHandler(stopped.val_metrics[0], patience=2), _CrashAfter(args.stop_at)])
        except _SimulatedCrash:
            log.info("Crashed after batch %d", args.stop_at)
        last = list_checkpoints(f"{root}/resumed", "model")[-1]
        log.info("Newest checkpoint: %s (epoch %d, batch %d)", last[2], last[0], last[1])

        log.info("== 3. A brand-new estimator resumes from that checkpoint ==")
        resumed = make_estimator(seed=0)
        train, val = loaders()
        resumed.fit(train, val_data=val, epochs=args.epochs, event_handlers=[
            CheckpointHandler(f"{root}/resumed", batch_period=period, epoch_period=None, resume_from_checkpoint=True),
            EarlyStoppingHandler(resumed.val_metrics[0], patience=2)])

        same_params = all(torch.equal(a, b) for a, b in zip(est.net.state_dict().values(),
                                                              resumed.net.state_dict().values()))
        scores = resumed.evaluate(val)
        log.info("== Result ==")
        log.info("Validation of the resumed model: %s",
                 ", ".join(f"{k}: {v:.4f}" for k, v in scores.items()))
        log.info("Parameters of the resumed run are bit-identical to the uninterrupted run: %s", same_params)
        if not same_params:
            log.error("The resumed run diverged: please report this as a bug.")
            return 1
    return 0
