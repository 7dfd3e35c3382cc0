"""Tiny ``transformers`` models from configs (random init) and a tokenizer trained here on text
the tests write: nothing is downloaded."""

from __future__ import annotations

import os
import random
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

transformers.logging.set_verbosity_error()  # the tiny configs' token ids and loss_type notes
datasets.disable_progress_bars()

WORDS = ("the a cat dog sat ran on under mat log fast slow red blue big small and then it was "
         "saw near far tree house bird sang loud soft").split()
SPECIAL = ["[PAD]", "[UNK]", "[MASK]", "[CLS]", "[SEP]", "[EOS]"]


def write_corpus(directory: str, lines: int = 200, seed: int = 0) -> str:
    """A text file of ``lines`` random sentences over :data:`WORDS`; returns its path."""
    draw = random.Random(seed)
    path = os.path.join(directory, "corpus.txt")
    with open(path, "w") as f:
        for _ in range(lines):
            f.write(" ".join(draw.choice(WORDS) for _ in range(draw.randint(4, 14))) + ".\n")
    return path


def train_tokenizer(corpus: str, kind: str = "bpe", vocab_size: int = 80) -> transformers.PreTrainedTokenizerFast:
    """A BPE (or word-level) tokenizer trained on ``corpus``, as transformers' collators take it."""
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL)
    else:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([corpus], trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]",
                                                eos_token="[EOS]")


def tiny_gpt2(vocab_size: int, seed: int = 0, positions: int = 32, width: int = 16) -> transformers.GPT2LMHeadModel:
    """A 2-layer GPT-2 of width 16 (dropout on: a step draws from the global generator)."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=positions, n_embd=width, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def tiny_bert(vocab_size: int, seed: int = 0, num_labels: int = 3, head: str = "classifier") -> torch.nn.Module:
    """A 2-layer BERT of width 16: a sequence classifier, or a masked LM (``head="mlm"``)."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                                     num_labels=num_labels, pad_token_id=0)
    if head == "mlm":
        return transformers.BertForMaskedLM(config)
    return transformers.BertForSequenceClassification(config)


def tiny_t5(vocab_size: int, seed: int = 0) -> transformers.T5ForConditionalGeneration:
    """A 1-layer T5 encoder-decoder of width 16."""
    torch.manual_seed(seed)
    config = transformers.T5Config(vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, pad_token_id=0, eos_token_id=5,
                                   decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def lm_batches(vocab_size: int, n: int = 4, size: int = 3, length: int = 12, seed: int = 0) -> list[dict]:
    """``n`` causal-LM batches: input_ids, an attention mask with padding, labels -100 there."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        ids = torch.randint(6, vocab_size, (size, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # one padded row
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def classification_batches(vocab_size: int, n: int = 4, size: int = 4, length: int = 10, seed: int = 0,
                           num_labels: int = 3) -> list[dict]:
    """``n`` sequence-classification batches, as DataCollatorWithPadding gives them."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(6, vocab_size, (size, length), generator=g),
             "attention_mask": torch.ones(size, length, dtype=torch.long),
             "labels": torch.randint(0, num_labels, (size,), generator=g)} for _ in range(n)]


def write_shards(corpus: str, directory: str, shards: int = 4) -> list[str]:
    """``corpus``'s lines dealt into ``shards`` text files (several input shards: datasets reads
    them through its prefetch threads, as it reads a real corpus); returns their paths."""
    with open(corpus) as f:
        lines = f.read().splitlines()
    paths = []
    for s in range(shards):
        path = os.path.join(directory, f"part{s}.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines[s::shards]) + "\n")
        paths.append(path)
    return paths


def lm_stream(files: list[str], tokenizer: Any, batch_size: int = 8, buffer_size: int = 16, max_length: int = 16,
              workers: int = 0) -> Any:
    """The standard pre-training pipeline: text files streamed with ``datasets``, a batched
    tokenizing ``.map``, a shuffle buffer, ``DataCollatorForLanguageModeling(mlm=False)``."""
    from datasets import load_dataset  # heavy: only the tests that stream import it
    from torch.utils.data import DataLoader

    ds = load_dataset("text", data_files=files, split="train", streaming=True)
    ds = ds.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=max_length), batched=True,
                remove_columns=["text"])
    ds = ds.shuffle(seed=1, buffer_size=buffer_size)
    collate = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return DataLoader(ds, batch_size=batch_size, collate_fn=collate, num_workers=workers)


def save_tokenizer(tokenizer: transformers.PreTrainedTokenizerFast, path: str) -> str:
    """Write ``tokenizer`` as one ``tokenizer.json`` (what :func:`load_tokenizer` reads)."""
    tokenizer.backend_tokenizer.save(path)
    return path


def load_tokenizer(path: str) -> transformers.PreTrainedTokenizerFast:
    """A tokenizer :func:`save_tokenizer` wrote, with the special tokens the collators need."""
    return transformers.PreTrainedTokenizerFast(tokenizer_file=path, pad_token="[PAD]", unk_token="[UNK]",
                                                mask_token="[MASK]", cls_token="[CLS]", sep_token="[SEP]",
                                                eos_token="[EOS]")
