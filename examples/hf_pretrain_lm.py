"""Pre-training a small GPT-2 from its config on the standard library's source, streamed with
Hugging Face ``datasets``, with a byte-level BPE tokenizer trained here by ``tokenizers``.

Nothing is downloaded: the text is the ``.py`` files next to the ``os`` module. What it shows
(docs/transformers.md):

- ``Estimator(model, optimizer=...)`` without a loss: the model computes its own loss from the
  batch's ``labels``; ``Perplexity()`` per token, shifted as the model's loss is;
- a streamed pipeline: ``load_dataset("text", ..., streaming=True)``, a batched tokenizing
  ``.map``, a shuffle buffer, ``split_dataset_by_node`` under ``torchrun``, the rows collated from
  Arrow by ``ArrowCollate`` (the batches of ``DataCollatorForLanguageModeling(mlm=False)``, at a
  fraction of the cost);
- transformers' cosine schedule with warmup sized by ``fit`` from the plan, clipping, bf16 on a GPU;
- checkpoints every N steps, resumed by running the same command again (also after Ctrl-C or
  SIGTERM, bit for bit), and the final model saved with ``save_pretrained``.

Run it::

    python examples/hf_pretrain_lm.py                          # one process (CPU or one GPU)
    torchrun --nproc-per-node=2 examples/hf_pretrain_lm.py     # two processes, each half the files
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, get_cosine_schedule_with_warmup  # noqa: E402

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, distributed  # noqa: E402
from estimatorch.collate import ArrowCollate  # noqa: E402
from estimatorch.metrics import Perplexity  # noqa: E402


def source_files(count: int, skip: int = 0) -> list[str]:
    """``count`` of the standard library's top-level modules, in name order, after ``skip``."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[skip:skip + count]


def train_tokenizer(files: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``files`` (deterministic: every process trains the same)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|endoftext|>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|endoftext|>")


def stream(files: list[str], tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace, shuffle: bool) -> DataLoader:
    """Lines of ``files``, tokenized in batches, shuffled in a buffer, this process's share, in Arrow."""
    ds = load_dataset("text", data_files=files, split="train", streaming=True)
    ds = ds.filter(lambda row: row["text"].strip() != "")
    ds = ds.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=args.seq_len), batched=True,
                remove_columns=["text"])
    if shuffle:
        ds = ds.shuffle(seed=0, buffer_size=args.buffer)
    ds = split_dataset_by_node(ds, rank=distributed.get_rank(), world_size=distributed.get_world_size())
    collate = ArrowCollate(tokenizer.pad_token_id, causal_lm_labels=True)
    return DataLoader(ds.with_format("arrow"), batch_size=args.batch_size, collate_fn=collate)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches-per-epoch", type=int, default=300)
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--files", type=int, default=40, help="source files to train on (4 more validate)")
    parser.add_argument("--buffer", type=int, default=2000, help="shuffle buffer size")
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--model-dir", default="runs/hf_lm", help="checkpoints, then the final model")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--precision", default="bf16" if torch.cuda.is_available() else "32")
    args = parser.parse_args(argv)

    tokenizer = train_tokenizer(source_files(args.files), args.vocab)
    train = stream(source_files(args.files), tokenizer, args, shuffle=True)
    val = stream(source_files(4, skip=args.files), tokenizer, args, shuffle=False)

    torch.manual_seed(0)  # the same initial weights in every process
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=args.d_model,
                        n_layer=args.layers, n_head=args.heads, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config)
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1),
                    train_metrics=[Perplexity()], precision=args.precision, lr_scheduler_interval="batch",
                    lr_scheduler=lambda opt, steps: get_cosine_schedule_with_warmup(opt, max(1, steps // 20), steps))
    handlers = [GradientUpdateHandler(clip_grad_norm=1.0),
                CheckpointHandler(args.model_dir, batch_period=args.checkpoint_every, max_checkpoints=2,
                                  resume_from_checkpoint=True)]
    if distributed.is_main_process():
        print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, a vocabulary of "
              f"{len(tokenizer)}, {distributed.get_world_size()} process(es)", flush=True)
    est.fit(train, val_data=val, epochs=args.epochs, event_handlers=handlers,
            batches_per_epoch=args.batches_per_epoch, val_batches=args.val_batches)
    if distributed.is_main_process():
        model.save_pretrained(os.path.join(args.model_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.model_dir, "final"))
        prompt = tokenizer("def ", return_tensors="pt")
        model.eval()
        with torch.no_grad():
            ids = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        print("Greedy sample:", repr(tokenizer.decode(ids[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
