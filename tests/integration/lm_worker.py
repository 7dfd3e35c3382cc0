"""One process of the causal-LM kill tests (run as a script by test_transformers_kills.py): a tiny
GPT-2 trained without a loss on a streamed, shuffled ``datasets`` pipeline (a tokenizer trained
offline, a batched tokenizing ``.map``, ``DataCollatorForLanguageModeling``), checkpointing every
step; with ``--lora``, the same model wrapped in a PEFT LoRA adapter.

    python lm_worker.py DIR full|sigterm|sigkill|resume AT [--lora]

writes DIR/<mode>.losses (one float.hex per step) and DIR/<mode>.pt (the final weights).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from estimatorch import CheckpointHandler, Estimator  # noqa: E402
from estimatorch.event_handlers import BatchEnd  # noqa: E402
from tests.hf_models import lm_stream, load_tokenizer, tiny_gpt2  # noqa: E402


class Record(BatchEnd):
    """Append each step's loss to a file as it happens (a killed process keeps what it wrote)."""

    priority = float("inf")

    def __init__(self, path):
        self.file = open(path, "a")

    def batch_end(self, estimator, *, loss, **kwargs):
        self.file.write(float(loss.detach()).hex() + "\n")
        self.file.flush()


class Kill(BatchEnd):
    """SIGTERM during step ``at`` (fit checkpoints that step and exits 143), or SIGKILL at the
    boundary after it, right after that step's checkpoint."""

    priority = float("inf")

    def __init__(self, at, sig):
        self.at, self.sig = at, sig

    def batch_end(self, estimator, **kwargs):
        if estimator.position.step + 1 != self.at:
            return
        if self.sig == signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            estimator.at_boundary(lambda: os.kill(os.getpid(), signal.SIGKILL))


def build(lora):
    model = tiny_gpt2(len(load_tokenizer(TOKENIZER)))
    if lora:
        from peft import LoraConfig, get_peft_model  # optional: the LoRA variant only

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1,
                                                 fan_in_fan_out=True))
    params = [p for p in model.parameters() if p.requires_grad]
    return model, Estimator(model, optimizer=torch.optim.AdamW(params, lr=1e-3), seed=3)


def main():
    global TOKENIZER
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("mode", choices=["full", "sigterm", "sigkill", "resume"])
    parser.add_argument("at", type=int)
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    TOKENIZER = os.path.join(args.dir, "tokenizer.json")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.startswith("part"))
    model, est = build(args.lora)
    handlers = [Record(os.path.join(args.dir, ("resume" if args.mode == "resume" else args.mode) + ".losses"))]
    if args.mode != "full":
        handlers.append(CheckpointHandler(os.path.join(args.dir, "ckpt"), batch_period=1, max_checkpoints=2,
                                          resume_from_checkpoint=True))
    if args.mode in ("sigterm", "sigkill"):
        handlers.append(Kill(args.at, signal.SIGTERM if args.mode == "sigterm" else signal.SIGKILL))
    est.fit(lm_stream(files, load_tokenizer(TOKENIZER)), epochs=2, event_handlers=handlers)
    torch.save({k: v for k, v in model.state_dict().items()}, os.path.join(args.dir, args.mode + ".pt"))


TOKENIZER = ""

if __name__ == "__main__":
    main()
