"""``python -m estimatorch demo``: train a model, crash a second run midway, resume it in a new
estimator from its checkpoint, and check that the result is bit-identical.

The data is generated in code (no download): 8x8 images of the digits 0-9 drawn from a 5x7
pixel font, randomly shifted and noised in ``__getitem__`` (augmentation that draws from torch,
python's ``random`` and the library's numpy generator).

Results (checkpoints and TensorBoard events) go to ``runs/demo`` and stay there. Run the demo
again and it resumes from them, so a demo stopped with Ctrl-C continues where it was; ``--fresh``
deletes them first (only files the demo writes, or it refuses).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from typing import Any, Optional

import torch
from torch import nn

from . import rng
from .checkpoint import list_checkpoints
from .estimator import Estimator, default_logger
from .event_handlers import CheckpointHandler, EarlyStoppingHandler, TensorBoardHandler
from .testing import CrashAfter, SimulatedCrash

__all__ = ["DESCRIPTION", "DigitGlyphs", "build_parser", "main", "make_estimator"]

#: the demo's one-line summary (``--help`` here and in ``python -m estimatorch --help``).
DESCRIPTION = ("train an MLP on generated digit images, crash a second run midway, resume it from its "
               "checkpoint in a new estimator, and check that the result is bit-identical")
#: where results go unless ``--model-dir`` says otherwise (relative to the working directory).
DEFAULT_DIR = os.path.join("runs", "demo")
#: what the demo writes under its directory: checkpoint folders and TensorBoard runs.
_CHECKPOINT_DIRS = ("full", "crashed")
_TENSORBOARD_DIR = "tensorboard"
_PERIOD = 10  # a checkpoint every 10 batches

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
    """The demo's model: a two-layer MLP with dropout, AdamW and a cosine schedule.

    The seed is set before the net is built, so every call makes the same initial weights.
    """
    rng.seed_everything(seed)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(net.parameters(), lr=5e-3, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, lr_scheduler=scheduler, seed=seed)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line."""
    parser = argparse.ArgumentParser(prog="python -m estimatorch demo", description=DESCRIPTION[0].upper()
                                     + DESCRIPTION[1:] + ".")
    parser.add_argument("--epochs", type=int, default=4, metavar="N", help="epochs to train (default: 4)")
    parser.add_argument("--workers", type=int, default=0, metavar="N", help="DataLoader worker processes (default: 0)")
    parser.add_argument("--stop-at", type=int, default=37, metavar="N",
                        help="the batch after which the second run crashes (default: 37)")
    parser.add_argument("--model-dir", default=DEFAULT_DIR, metavar="DIR",
                        help=f"where checkpoints and TensorBoard events go and stay (default: {DEFAULT_DIR})")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the results of an earlier demo in --model-dir and start over "
                             "(default: resume from them)")
    return parser


def _demo_files(root: str) -> tuple[list[str], list[str]]:
    """The demo's own folders under ``root``, and any file in them the demo did not write."""
    patterns = ("model-epoch", "model-latest", "model-best", ".model-")
    folders, foreign = [], []
    for name in (*_CHECKPOINT_DIRS, _TENSORBOARD_DIR):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue
        folders.append(folder)
        for parent, _, files in os.walk(folder):
            for file in files:
                prefixes = ("events.out.tfevents.",) if name == _TENSORBOARD_DIR else patterns
                ours = file.startswith(prefixes)
                if not ours:
                    foreign.append(os.path.join(parent, file))
    return folders, foreign


def _has_checkpoints(folder: str) -> bool:
    return bool(list_checkpoints(folder, "model"))


def main(argv: Optional[list[str]] = None) -> int:
    """Run the demo with the command-line arguments ``argv`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 1 if the resumed run diverged, 2 for results of another demo
        configuration in ``--model-dir``, 130 after Ctrl-C. Bad arguments exit with 2.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("epochs", "stop_at"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    if args.workers < 0:
        parser.error(f"--workers must be a non-negative int, got {args.workers}")
    if not args.model_dir:
        parser.error("--model-dir must be a directory path, got ''")
    log = default_logger()  # before the first line: headings print from the start
    try:
        return _run(args, log)
    except KeyboardInterrupt:
        log.warning("Interrupted. Run the demo again to resume from the newest checkpoints in %s "
                    "(--fresh starts over).", args.model_dir)
        return 130
    except (ValueError, OSError) as err:  # e.g. results of a demo run with other arguments
        log.error("The demo cannot go on with the results in %s: %s\nPass --fresh to start over, or choose "
                  "another --model-dir.", args.model_dir, err)
        return 2


def _run(args: argparse.Namespace, log: Any) -> int:
    root = args.model_dir
    full_dir, crashed_dir = (os.path.join(root, name) for name in _CHECKPOINT_DIRS)
    tensorboard_dir = os.path.join(root, _TENSORBOARD_DIR)
    if args.fresh:
        folders, foreign = _demo_files(root)
        if foreign:
            log.error("--fresh: %s holds files the demo did not write (%s); nothing was deleted. "
                      "Move them, or choose another --model-dir.", root, ", ".join(foreign[:3]))
            return 2
        for folder in folders:
            shutil.rmtree(folder)
            log.info("Deleted %s (--fresh)", folder)
    if _has_checkpoints(full_dir) or _has_checkpoints(crashed_dir):
        log.info("%s holds the results of an earlier demo: resuming from them. A finished run has nothing "
                 "left to train (a larger --epochs extends it); --fresh starts over.", root)
    period = min(_PERIOD, args.stop_at)  # at least one checkpoint before the crash
    torch.set_num_threads(1)  # tiny tensors: more threads only add synchronisation

    def loaders() -> tuple[Any, Any]:
        train = torch.utils.data.DataLoader(DigitGlyphs(3000), batch_size=64, shuffle=True, num_workers=args.workers)
        val = torch.utils.data.DataLoader(DigitGlyphs(1000, augment=False, seed=1), batch_size=250)
        return train, val

    def handlers(est: Estimator, folder: str, run_name: str, resume: bool) -> list[Any]:
        return [CheckpointHandler(folder, batch_period=period, resume_from_checkpoint=resume),
                EarlyStoppingHandler(est.val_metrics[0], patience=2),
                TensorBoardHandler(tensorboard_dir, run_name=run_name)]

    log.info("== 1. Training with the default handlers (metrics, logging, progress, stopping, gradient "
             "update, validation, LR schedule), early stopping, checkpoints and TensorBoard ==")
    est = make_estimator()
    train, val = loaders()
    history = est.fit(train, val_data=val, epochs=args.epochs,
                      event_handlers=handlers(est, full_dir, "full", resume=_has_checkpoints(full_dir)))
    log.info("History: %s", {k: [round(v, 4) for v in vals] for k, vals in history.to_dict().items()})

    if _has_checkpoints(crashed_dir):
        log.info("== 2. (%s already holds the second run's checkpoints: no new crash) ==", crashed_dir)
    else:
        log.info("== 2. The same run, crashing after batch %d (as a pre-emption or a power cut would) ==",
                 args.stop_at)
        stopped = make_estimator()
        train, val = loaders()
        try:
            stopped.fit(train, val_data=val, epochs=args.epochs,
                        event_handlers=[*handlers(stopped, crashed_dir, "crashed", resume=False),
                                        CrashAfter(args.stop_at)])
        except SimulatedCrash:
            log.info("Crashed after batch %d", args.stop_at)
    epoch, batch, last = list_checkpoints(crashed_dir, "model")[-1]
    log.info("Newest checkpoint: %s (epoch %d, batch %d)", last, epoch, batch)

    log.info("== 3. A brand-new estimator resumes from that checkpoint ==")
    resumed = make_estimator()
    train, val = loaders()
    resumed.fit(train, val_data=val, epochs=args.epochs,
                event_handlers=handlers(resumed, crashed_dir, "crashed", resume=True))
    same_params = all(torch.equal(a, b) for a, b in zip(est.net.state_dict().values(),
                                                          resumed.net.state_dict().values()))
    scores = resumed.evaluate(val)
    log.info("== Result ==")
    log.info("Validation of the resumed model: %s", ", ".join(f"{k}: {v:.4f}" for k, v in scores.items()))
    log.info("Parameters of the resumed run are bit-identical to the uninterrupted run: %s", same_params)
    log.info("Results kept in %s: checkpoints in %s and %s.", root, full_dir, crashed_dir)
    log.info("Training curves: tensorboard --logdir %s", tensorboard_dir)
    log.info("Run the demo again to resume from these files; --fresh starts over.")
    if not same_params:
        log.error("The resumed run diverged: please report this as a bug.")
        return 1
    return 0
