"""What validating an exponential moving average of the weights changes, on real text.

A small character-level model (an MLP over the last 16 characters) learns to predict the next
character of the Python standard library's source (the ``.py`` files next to ``os``: nothing is
downloaded) with AdamW at a constant, rather high learning rate, whose noise the average smooths
out. The same run is made twice: without an average, and with ``EMAHandler``. The average never
changes training (the script checks that both runs' train losses are the same bits), so the two
runs' validations compare the trained weights with their average, epoch by epoch.

Run it::

    python examples/weight_averaging.py                 # two fits of 600 steps: a minute or two on a CPU
    python examples/weight_averaging.py --decay 0.999 --epochs 8
"""

from __future__ import annotations

import argparse
import glob
import os

import torch
from torch import nn

from estimatorch import EMAHandler, Estimator

#: the characters the model reads and writes; anything else reads as "?".
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
CONTEXT = 16


def stdlib_ids(max_chars: int) -> torch.Tensor:
    """The first ``max_chars`` characters of the standard library's top-level modules, as ids."""
    parts, size = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        size += len(parts[-1])
        if size >= max_chars:
            break
    unknown = VOCAB.index("?")
    return torch.tensor([VOCAB.find(c) if c in VOCAB else unknown for c in "".join(parts)[:max_chars]])


class Windows(torch.utils.data.Dataset):
    """``CONTEXT`` characters and the one after them, at ``n`` fixed random places of ``ids``."""

    def __init__(self, ids: torch.Tensor, n: int, seed: int):
        self.ids = ids
        self.starts = torch.randint(0, len(ids) - CONTEXT - 1, (n,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        return self.ids[start:start + CONTEXT], self.ids[start + CONTEXT]


def run(args: argparse.Namespace, train, val, ema: EMAHandler | None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(len(VOCAB), 24), nn.Flatten(), nn.Linear(24 * CONTEXT, args.hidden), nn.GELU(),
                        nn.Linear(args.hidden, len(VOCAB)))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=args.lr), seed=0)
    history = est.fit(train, val, epochs=args.epochs, batches_per_epoch=args.batches_per_epoch,
                      event_handlers=[ema] if ema is not None else None)
    return est, history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches-per-epoch", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--decay", type=float, default=0.995)
    parser.add_argument("--no-warmup", action="store_true", help="the decay from the first update (no warm-up)")
    parser.add_argument("--max-chars", type=int, default=400_000)
    parser.add_argument("--val-windows", type=int, default=4000)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a small model: one thread is the fastest, and the numbers repeat

    ids = stdlib_ids(args.max_chars)
    cut = int(len(ids) * 0.9)  # the last tenth of the text: files the model never trains on
    train = torch.utils.data.DataLoader(Windows(ids[:cut], 60_000, 0),
                                        batch_size=args.batch_size, shuffle=True)
    val = torch.utils.data.DataLoader(Windows(ids[cut:], args.val_windows, 1), batch_size=500)

    _, trained = run(args, train, val, None)
    ema = EMAHandler(args.decay, warmup=not args.no_warmup)
    est, averaged = run(args, train, val, ema)
    assert averaged["train_loss"] == trained["train_loss"], "the average changed training"

    print(f"\nValidation on {len(val.dataset)} windows of held-out text, EMAHandler({args.decay}, "
          f"warmup={not args.no_warmup}):")
    print("epoch  val_loss trained  val_loss average  val_accuracy trained  val_accuracy average")
    for e, (a, b, c, d) in enumerate(zip(trained["val_loss"], averaged["val_loss"], trained["val_accuracy"],
                                         averaged["val_accuracy"]), start=1):
        print(f"{e:5d}  {a:16.4f}  {b:16.4f}  {c:20.4f}  {d:20.4f}")
    # after fit the net holds the average; the trained weights are a state dict away
    average = est.evaluate(val)
    est.net.load_state_dict(ema.raw_state_dict())
    raw = est.evaluate(val)
    print(f"at the end: val_loss {raw['val_loss']:.4f} (trained weights) -> {average['val_loss']:.4f} (average)")


if __name__ == "__main__":
    main()
