"""A character-level causal Transformer trained on the source of Python's own standard library.

No download: the text is the ``.py`` files next to the ``os`` module. What it shows, written the
way estimatorch intends (see examples/README.md):

- the schedule sized from the plan: ``Estimator(lr_scheduler=lambda optimizer, total_steps: ...,
  lr_scheduler_interval="batch")`` builds a linear warmup + cosine decay at ``fit`` start for the
  optimizer steps this process will take (``est.planned_steps`` says how many, before ``fit``,
  under ``torchrun`` too: each process trains its share of the data);
- per-epoch limits (``fit(batches_per_epoch=..., val_batches=...)``), monitors by name
  (``EarlyStoppingHandler("val_loss")``), gradient clipping, bf16 on a GPU, dict batches;
- checkpoints every N steps and at every epoch end (one file per step), resumed by running the
  same command again (also after Ctrl-C or SIGTERM), with the best weights kept;
- CSV and (when installed) TensorBoard logs with throughput in tokens/s;
- ``predict`` for greedy sampling.

Run it::

    python examples/char_lm.py                            # one process (CPU or one GPU)
    torchrun --nproc-per-node=2 examples/char_lm.py       # two processes, each half the data
    python examples/char_lm.py --epochs 8                 # a finished run extended: it warns
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

from estimatorch import (
    CheckpointHandler,
    CSVLoggerHandler,
    EarlyStoppingHandler,
    Estimator,
    GradientUpdateHandler,
    MeterHandler,
    TensorBoardHandler,
    distributed,
)
from estimatorch.metrics import Loss
from estimatorch.statistics import Throughput

#: the characters the model reads and writes; anything else in the source reads as "?".
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = VOCAB.index("?")


def stdlib_text(max_chars: int) -> str:
    """The first ``max_chars`` characters of the standard library's top-level modules, in name order."""
    parts, size = [], 0
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        size += len(parts[-1])
        if size >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(VOCAB)}
    return torch.tensor([index.get(c, UNKNOWN) for c in text], dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return "".join(VOCAB[i] for i in ids.tolist())


class Chunks(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len + 1`` characters: a dict batch of the inputs and the
    next character at each place (the label)."""

    def __init__(self, ids: torch.Tensor, seq_len: int):
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return {"tokens": window[:-1], "label": window[1:]}


class CharTransformer(nn.Module):
    """A decoder-only Transformer: embeddings, causal self-attention blocks, logits per place."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, layers: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        places = torch.arange(length, device=tokens.device)
        x = self.embed(tokens) + self.position(places)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


def next_char_loss(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), label.flatten())


class Perplexity(Loss):
    """exp of the mean loss: how many characters the model hesitates between."""

    default_name = "perplexity"
    higher_is_better = False

    def _value(self, states: dict) -> torch.Tensor:
        return torch.exp(super()._value(states))


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> SequentialLR:
    """Linear warmup over the first 5% of the steps, then cosine decay to 1% of the peak: sized by
    ``fit`` from the plan (``total_steps``), whatever the number of processes."""
    warmup = max(1, total_steps // 20)
    peak = optimizer.param_groups[0]["lr"]
    return SequentialLR(optimizer, [LinearLR(optimizer, start_factor=0.01, total_iters=warmup),
                                    CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup),
                                                      eta_min=peak / 100)], milestones=[warmup])


def sample(est: Estimator, prompt: str, n: int) -> str:
    """Greedy continuation of ``prompt``, one ``predict`` per character."""
    ids = encode(prompt)
    for _ in range(n):
        window = ids[-est.net.seq_len:].unsqueeze(0)
        logits = est.predict([window])  # a batch without a label: (1, length, vocab), float32
        ids = torch.cat([ids, logits[0, -1].argmax().reshape(1)])
    return decode(ids)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batches-per-epoch", type=int, default=200, help="training batches per epoch")
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches per evaluation")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="the peak learning rate")
    parser.add_argument("--max-chars", type=int, default=2_000_000, help="characters of source text")
    parser.add_argument("--model-dir", default="runs/char_lm", help="checkpoints and logs")
    parser.add_argument("--precision", default="bf16" if torch.cuda.is_available() else "32")
    parser.add_argument("--sample", type=int, default=200, help="characters to generate after training")
    args = parser.parse_args(argv)

    torch.manual_seed(0)  # the same initial weights in every process (DDP also broadcasts them)
    ids = encode(stdlib_text(args.max_chars))
    split = int(len(ids) * 0.9)
    train = torch.utils.data.DataLoader(Chunks(ids[:split], args.seq_len), batch_size=args.batch_size,
                                        shuffle=True, drop_last=True)
    val = torch.utils.data.DataLoader(Chunks(ids[split:], args.seq_len), batch_size=args.batch_size)

    net = CharTransformer(len(VOCAB), args.seq_len, args.d_model, args.layers, args.heads)
    decay = [p for n, p in net.named_parameters() if p.dim() > 1 and "embed" not in n and "position" not in n]
    rest = [p for n, p in net.named_parameters() if not any(p is q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    est = Estimator(net, next_char_loss, train_metrics=[Loss(), Perplexity()], optimizer=optimizer,
                    lr_scheduler=warmup_cosine, lr_scheduler_interval="batch", precision=args.precision)

    writer = TensorBoardHandler(os.path.join(args.model_dir, "tb")) \
        if importlib.util.find_spec("tensorboard") is not None else None
    handlers = [
        GradientUpdateHandler(clip_grad_norm=1.0),
        EarlyStoppingHandler("val_loss", patience=3, restore_best_weights=True),
        CheckpointHandler(args.model_dir, monitor="val_loss", save_best=True, batch_period=100, max_checkpoints=3,
                          resume_from_checkpoint=True),
        CSVLoggerHandler(os.path.join(args.model_dir, "history.csv")),
    ]
    if writer is not None:  # tensorboard is an optional extra
        handlers += [writer, MeterHandler([Throughput()], writer=writer)]

    # Known before fit (the process group does not exist yet): this process's rank and steps.
    steps = est.planned_steps(train, epochs=args.epochs, batches_per_epoch=args.batches_per_epoch,
                              event_handlers=handlers)
    if distributed.is_main_process():
        params = sum(p.numel() for p in net.parameters())
        print(f"{params / 1e6:.2f}M parameters, {len(ids):,} characters, {distributed.get_world_size()} "
              f"process(es): {steps} optimizer steps each", flush=True)

    est.fit(train, val_data=val, epochs=args.epochs, event_handlers=handlers,
            batches_per_epoch=args.batches_per_epoch, val_batches=args.val_batches)

    scores = est.evaluate(val)  # every process takes part (a collective under torchrun)
    text = sample(est, "def ", args.sample) if args.sample else ""
    if distributed.is_main_process():
        print(f"val_loss {scores['val_loss']:.4f}, val_perplexity {scores['val_perplexity']:.3f} "
              f"(of {len(VOCAB)} characters; {math.log(len(VOCAB)):.2f} nats for a uniform guess)")
        if text:
            print("Greedy sample:\n" + text, flush=True)
    if torch.distributed.is_initialized():  # fit started it under torchrun: end it before exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
