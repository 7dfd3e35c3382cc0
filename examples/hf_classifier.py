"""Fine-tuning a small BERT sequence classifier, built from its config, with transformers'
``DataCollatorWithPadding``: which standard-library package (``json``, ``email``, ``http``,
``asyncio``) a line of Python comes from.

Nothing is downloaded: the lines are read from the standard library's source, the tokenizer
(word pieces) is trained here by ``tokenizers`` at the run's first start and saved with the run
(``<model-dir>/tokenizer``: ``tokenizers`` does not train the same vocabulary in every process,
so a rerun loads it, and resumes on the same token ids). What it shows (docs/transformers.md):

- ``Estimator(model, optimizer=...)`` without a loss: the collator's ``labels`` go to the model
  with the rest of the batch, ``val_loss`` is the model's loss, ``Accuracy()`` reads the logits;
- a map-style ``datasets.Dataset`` tokenized with a batched ``.map`` and given to ``fit`` with
  ``batch_size=``, padded per batch by the collator, shuffled by fit's resumable sampler; a linear
  schedule with warmup (a callable: sized and stepped in optimizer steps); early stopping;
- checkpoints every epoch, resumed by running the same command again (also after SIGTERM, from
  the step it stopped at); ``predict`` for the logits.

Run it::

    python examples/hf_classifier.py
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    get_linear_schedule_with_warmup,
)

from estimatorch import CheckpointHandler, EarlyStoppingHandler, Estimator  # noqa: E402
from estimatorch.metrics import Accuracy  # noqa: E402

PACKAGES = ("json", "email", "http", "asyncio")


def package_lines(per_package: int) -> tuple[list[str], list[int]]:
    """Up to ``per_package`` non-blank lines of each package's source, and the package's index."""
    texts, labels = [], []
    for label, package in enumerate(PACKAGES):
        lines = []
        for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), package, "*.py"))):
            with open(path, encoding="utf-8", errors="replace") as f:
                lines += [line.strip() for line in f if len(line.strip()) > 8]
        step = max(1, len(lines) // per_package)  # spread over the package's files
        texts += lines[::step][:per_package]
        labels += [label] * len(lines[::step][:per_package])
    return texts, labels


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size,
                                                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def run_tokenizer(model_dir: str, texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """The run's tokenizer: the one saved in ``model_dir`` by its first start, else trained and saved."""
    path = os.path.join(model_dir, "tokenizer")
    if os.path.isdir(path):
        return PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.save_pretrained(path + ".tmp")
    os.replace(path + ".tmp", path)  # whole or not at all
    return tokenizer


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lines", type=int, default=1500, help="lines per package (a tenth validate)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--model-dir", default="runs/hf_classifier")
    args = parser.parse_args(argv)

    texts, labels = package_lines(args.lines)
    tokenizer = run_tokenizer(args.model_dir, texts, args.vocab)
    rows = Dataset.from_dict({"text": texts, "label": labels}).shuffle(seed=0)  # a fixed split
    rows = rows.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=48), batched=True,
                    remove_columns=["text"])
    split = rows.train_test_split(test_size=0.1, seed=0)
    collate = DataCollatorWithPadding(tokenizer)  # pads each batch, "label" -> "labels"

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=4, intermediate_size=4 * args.hidden, max_position_embeddings=64,
                        num_labels=len(PACKAGES), pad_token_id=tokenizer.pad_token_id)
    model = BertForSequenceClassification(config)
    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr), train_metrics=[Accuracy()],
                    lr_scheduler=lambda opt, steps: get_linear_schedule_with_warmup(opt, steps // 10, steps))
    est.fit(split["train"], val_data=split["test"], epochs=args.epochs, batch_size=args.batch_size,
            collate_fn=collate, event_handlers=[
                EarlyStoppingHandler("val_accuracy", patience=2),
                CheckpointHandler(args.model_dir, max_checkpoints=2, resume_from_checkpoint=True)])
    print("Validation:", {k: round(v, 4) for k, v in est.evaluate(split["test"], batch_size=64,
                                                                  collate_fn=collate).items()})

    examples = ["import json", "msg['Subject'] = subject", "conn.request('GET', url)", "await asyncio.sleep(1)"]
    batch = collate([tokenizer(text) for text in examples])
    logits = est.predict([dict(batch)])  # (4, classes): the model's logits
    for text, guess in zip(examples, logits.argmax(-1).tolist()):
        print(f"{text!r:30} -> {PACKAGES[guess]}")


if __name__ == "__main__":
    main(sys.argv[1:])
