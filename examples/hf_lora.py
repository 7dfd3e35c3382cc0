"""LoRA fine-tuning with PEFT: a GPT-2 (the one examples/hf_pretrain_lm.py saved, or a fresh one
from its config) adapted to the standard library's test files, with only the adapter trained.

Nothing is downloaded. What it shows (docs/transformers.md):

- a PEFT model trained without a loss: ``Estimator(model, optimizer=AdamW(trainable params))``,
  every weight but the adapter's left as it was;
- checkpoints every N steps and at each epoch's end, resumed by running the same command again;
- the adapter exported alone with ``save_pretrained`` from the trained model, and loaded back
  with ``PeftModel.from_pretrained`` over the base model: the same logits.

Run it::

    python examples/hf_pretrain_lm.py                  # the base model, in runs/hf_lm/final
    python examples/hf_lora.py --base runs/hf_lm/final
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
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, PreTrainedTokenizerFast  # noqa: E402

from estimatorch import CheckpointHandler, Estimator  # noqa: E402
from estimatorch.metrics import Perplexity  # noqa: E402


def test_file_lines(count: int) -> list[str]:
    """``count`` non-blank lines of the standard library's own tests (its ``test/`` package)."""
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "test", "test_*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines += [line.rstrip() for line in f if line.strip()]
        if len(lines) >= count:
            break
    return lines[:count]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="runs/hf_lm/final", help="a model and tokenizer saved by save_pretrained")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lines", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--model-dir", default="runs/hf_lora")
    args = parser.parse_args(argv)

    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.base)
    rows = Dataset.from_dict({"text": test_file_lines(args.lines)})
    rows = rows.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=64), batched=True,
                    remove_columns=["text"]).train_test_split(test_size=0.1, seed=0)
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    train = DataLoader(rows["train"], batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    val = DataLoader(rows["test"], batch_size=64, collate_fn=collate)

    torch.manual_seed(0)  # the adapter's initial weights
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args.base),
                           LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["c_attn", "c_proj"],
                                      lora_dropout=0.05, fan_in_fan_out=True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable: {sum(p.numel() for p in trainable):,} of {sum(p.numel() for p in model.parameters()):,} "
          "parameters (the adapter)", flush=True)
    est = Estimator(model, optimizer=torch.optim.AdamW(trainable, lr=args.lr), train_metrics=[Perplexity()])
    print("Before:", {k: round(v, 3) for k, v in est.evaluate(val).items()})
    est.fit(train, val_data=val, epochs=args.epochs, event_handlers=[
        CheckpointHandler(args.model_dir, batch_period=100, max_checkpoints=2, resume_from_checkpoint=True)])

    adapter = os.path.join(args.model_dir, "adapter")
    model.save_pretrained(adapter)  # the adapter alone
    size = sum(os.path.getsize(os.path.join(adapter, f)) for f in os.listdir(adapter))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.base), adapter).eval()
    batch = next(iter(val))
    model.eval()
    with torch.no_grad():
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        same = torch.equal(loaded(**inputs).logits, model(**inputs).logits)
    print(f"Adapter exported to {adapter} ({size / 1024:.0f} KiB); reloaded over the base model, same logits: {same}")


if __name__ == "__main__":
    main(sys.argv[1:])
