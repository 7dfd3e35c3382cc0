"""estimatorch against transformers' ``Trainer`` on the same job: a tiny GPT-2 from its config,
the standard library's source streamed with ``datasets`` (a batched tokenizing ``.map``, with or
without a shuffle buffer), ``DataCollatorForLanguageModeling``, AdamW at a constant rate, clipping
at 1.0, batches of 8, one torch thread, the CPU. Every run is a subprocess of this script.

    python benchmarks/vs_trainer.py                       # 60 steps, a checkpoint every 20, stop at 30
    python benchmarks/vs_trainer.py --steps 8 --save-every 3 --stop-at 4 --buffers 0 --frameworks estimatorch --json

For each of estimatorch, ``Trainer`` and ``Trainer(enable_jit_checkpoint=True)``, with and without
a shuffle buffer:

- step time and data time per step (median over an uninterrupted run; a step: from its batch in
  hand to the optimizer's step done, ``batch_begin`` to ``batch_end`` here, ``on_step_begin`` to
  ``on_step_end`` in ``Trainer``; data time: from the end of a step to the start of the next, the
  batch's wait), against a hand-written loop over the same loader (``out = model(**batch);
  out.loss.backward(); clip; step``). The uninterrupted runs are interleaved: ``--rounds`` rounds,
  each running the loop and every framework once, in an order that rotates from round to round,
  and a framework's ratio to the loop is taken within each round (its median over the rounds is
  shown, with the smallest and largest), so that a shared machine's load, which changes over
  minutes, weighs on both sides of a ratio alike;
- SIGTERM during step ``--stop-at``, and SIGKILL during the step after it: the exit status, the
  steps the rerun does again (those after the newest checkpoint it resumes from), the rerun's
  time from ``fit`` / ``trainer.train`` to its first batch (the resume's cost: a checkpoint in the
  middle of the data), and whether its per-step losses and final weights equal the uninterrupted
  run's bit for bit.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FRAMEWORKS = ("estimatorch", "trainer", "trainer-jit")
BATCH, LENGTH, LR = 8, 64, 1e-3


# -- the job, the same for everyone -----------------------------------------------------------------
def job(directory: str, buffer: int) -> tuple[Any, Any, Any]:
    """``(model, dataset, collator)``: the tokenizer trained once by the parent, in ``directory``."""
    import datasets
    import torch
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(directory, "tokenizer.json"),
                                                     pad_token="<pad>", eos_token="<eos>")
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:30]
    ds = datasets.load_dataset("text", data_files=files, split="train", streaming=True)
    ds = ds.filter(lambda row: bool(row["text"].strip()))
    ds = ds.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=LENGTH), batched=True,
                remove_columns=["text"])
    if buffer:
        ds = ds.shuffle(seed=0, buffer_size=buffer)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=LENGTH, n_embd=64, n_layer=2, n_head=2,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                     bos_token_id=tokenizer.eos_token_id)
    model = transformers.GPT2LMHeadModel(config)
    return model, ds, transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)


class Clock:
    """Per-step timestamps, losses, and the kill: what each framework's hooks call."""

    def __init__(self, out: str, stop_at: int, how: str):
        self.out, self.stop_at, self.how = out, stop_at, how
        self.start = time.perf_counter()
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.losses: list[str] = []

    def begin(self) -> None:
        self.begins.append(time.perf_counter())

    def end(self, loss: Any, step: int) -> None:
        self.ends.append(time.perf_counter())
        self.losses.append(float(loss).hex())
        self.dump()
        if step == self.stop_at and self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if step == self.stop_at + 1 and self.how == "sigkill":  # after step stop_at's checkpoint
            os.kill(os.getpid(), signal.SIGKILL)

    def dump(self, **extra: Any) -> None:
        with open(self.out, "w") as f:
            json.dump({"start": self.start, "begins": self.begins, "ends": self.ends, "losses": self.losses,
                       **extra}, f)


def run_estimatorch(args: argparse.Namespace, clock: Clock) -> Any:
    import torch
    from torch.utils.data import DataLoader

    from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler
    from estimatorch.event_handlers import BatchBegin, BatchEnd

    model, ds, collate = job(args.dir, args.buffer)

    class Hooks(BatchBegin, BatchEnd):
        priority = float("inf")

        def batch_begin(self, estimator: Any, **kwargs: Any) -> None:
            clock.begin()

        def batch_end(self, estimator: Any, *, loss: Any, **kwargs: Any) -> None:
            clock.end(loss.detach(), estimator.position.step + 1)

    est = Estimator(model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01), seed=0)
    handlers = [GradientUpdateHandler(clip_grad_norm=1.0), Hooks()]
    if args.mode != "full":
        handlers.append(CheckpointHandler(os.path.join(args.dir, "ckpt-estimatorch"), batch_period=args.save_every,
                                          resume_from_checkpoint=True))
    clock.start = time.perf_counter()  # the resume's cost counts from here
    est.fit(DataLoader(ds, batch_size=BATCH, collate_fn=collate), batches=args.steps, event_handlers=handlers)
    return model


def run_trainer(args: argparse.Namespace, clock: Clock, jit: bool) -> Any:
    import transformers

    model, ds, collate = job(args.dir, args.buffer)

    losses: list[Any] = []

    class Hooks(transformers.TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_step_end(self, a: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.end(losses.pop(), state.global_step)  # after clipping and the optimizer's step

    class Recording(transformers.Trainer):
        def training_step(self, *a: Any, **k: Any) -> Any:
            loss = super().training_step(*a, **k)
            losses.append(loss.detach())
            return loss

    saving = args.mode != "full"
    training = transformers.TrainingArguments(
        output_dir=os.path.join(args.dir, "ckpt-trainer-jit" if jit else "ckpt-trainer"), max_steps=args.steps,
        per_device_train_batch_size=BATCH, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.01, max_grad_norm=1.0, save_strategy="steps" if saving else "no", save_steps=args.save_every,
        logging_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, enable_jit_checkpoint=jit)
    trainer = Recording(model=model, args=training, train_dataset=ds, data_collator=collate, callbacks=[Hooks()])
    clock.start = time.perf_counter()  # the resume's cost counts from here
    trainer.train(resume_from_checkpoint=args.mode == "resume" or None)
    return model


def run_loop(args: argparse.Namespace, clock: Clock) -> Any:
    import torch
    from torch.utils.data import DataLoader

    from estimatorch import rng

    model, ds, collate = job(args.dir, args.buffer)
    rng.seed_everything(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model.train()
    for step, batch in enumerate(DataLoader(ds, batch_size=BATCH, collate_fn=collate), 1):
        clock.begin()
        out = model(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.end(out.loss.detach(), step)
        if step == args.steps:
            break
    return model


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    out = os.path.join(args.dir, f"{args.framework}-{args.mode}-{args.buffer}.json")
    clock = Clock(out, args.stop_at, args.mode)
    if args.framework == "estimatorch":
        model = run_estimatorch(args, clock)
    elif args.framework == "loop":
        model = run_loop(args, clock)
    else:
        model = run_trainer(args, clock, jit=args.framework == "trainer-jit")
    torch.save(model.state_dict(), out.replace(".json", ".pt"))


# -- the parent: every run, then the table -------------------------------------------------------------
def spawn(args: argparse.Namespace, directory: str, framework: str, mode: str, buffer: int) -> tuple[int, dict]:
    command = [sys.executable, os.path.abspath(__file__), "--worker", framework, mode, "--dir", directory,
               "--buffer", str(buffer), "--steps", str(args.steps), "--save-every", str(args.save_every),
               "--stop-at", str(args.stop_at)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    path = os.path.join(directory, f"{framework}-{mode}-{buffer}.json")
    record = json.load(open(path)) if os.path.exists(path) else {"losses": [], "begins": [], "ends": []}
    if done.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM, 143):
        raise RuntimeError(f"{framework} {mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.returncode, record


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def timings(record: dict) -> tuple[float, float]:
    """Median step time and data time (ms), the first two steps left out (warm-up)."""
    begins, ends = record["begins"], record["ends"]
    steps = [e - b for b, e in zip(begins, ends)][2:]
    waits = [b - e for e, b in zip(ends, begins[1:])][2:]
    return 1e3 * median(steps), 1e3 * median(waits)


def same_weights(a: str, b: str) -> bool:
    import torch

    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as directory:
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:30]
        tokenizer.train(files, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<pad>", "<eos>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
        for buffer in args.buffers:
            rounds = interleaved(args, directory, buffer)
            loop_steps = [timings(r["loop"])[0] for r in rounds]
            for framework in args.frameworks:
                full = rounds[0][framework]  # (every round trains the same bits)
                steps = [timings(r[framework])[0] for r in rounds]
                ratios = sorted(step / loop for step, loop in zip(steps, loop_steps))
                row: dict[str, Any] = {"step_ms": median(steps), "data_ms": median([timings(r[framework])[1]
                                                                                     for r in rounds]),
                                       "loop_step_ms": median(loop_steps),
                                       "loop_data_ms": median([timings(r["loop"])[1] for r in rounds]),
                                       "step_ratio_to_loop": median(ratios), "ratio_range": [ratios[0], ratios[-1]],
                                       "rounds": len(rounds)}
                for kill in ("sigterm", "sigkill"):
                    for leftover in glob.glob(os.path.join(directory, "ckpt-*")):
                        shutil.rmtree(leftover)
                    code, killed = spawn(args, directory, framework, kill, buffer)
                    _, resumed = spawn(args, directory, framework, "resume", buffer)
                    first = resumed["begins"][0] - resumed["start"] if resumed["begins"] else float("nan")
                    done = args.steps - len(resumed["losses"])  # steps the checkpoint it resumed from held
                    bitwise = (resumed["losses"] == full["losses"][done:] and same_weights(
                        os.path.join(directory, f"{framework}-resume-{buffer}.pt"),
                        os.path.join(directory, f"{framework}-full-{buffer}.pt")))
                    row[kill] = {"exit": code, "steps_trained_before": len(killed["losses"]),
                                 "resumed_after_step": done, "steps_redone": len(killed["losses"]) - done,
                                 "first_batch_s": first, "bitwise": bitwise}
                results[f"{framework}, buffer {buffer}"] = row
    return results


def interleaved(args: argparse.Namespace, directory: str, buffer: int) -> list[dict[str, dict]]:
    """``--rounds`` rounds of uninterrupted runs (the loop's and each framework's), the order
    rotating by one each round; each round's records by name."""
    names = ["loop", *args.frameworks]
    rounds = []
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        rounds.append({name: spawn(args, directory, name, "full", buffer)[1] for name in order})
    return rounds


def table(results: dict[str, Any]) -> str:
    from _common import format_table

    rows = []
    for name, r in results.items():
        kills = [f"exit {r[k]['exit']}, {r[k]['steps_redone']} redone, first batch {r[k]['first_batch_s']:.2f} s, "
                 f"{'bitwise' if r[k]['bitwise'] else 'NOT bitwise'}" for k in ("sigterm", "sigkill")]
        low, high = r["ratio_range"]
        rows.append([name, f"{r['step_ms']:.1f}", f"{r['step_ratio_to_loop']:.2f} ({low:.2f}-{high:.2f})",
                     f"{r['data_ms']:.1f}", *kills])
    return format_table(["run", "step ms", "vs loop (rounds)", "data ms/step", "SIGTERM, then rerun",
                         "SIGKILL, then rerun"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--stop-at", type=int, default=30)
    parser.add_argument("--buffers", default="0,1000", help="shuffle buffer sizes to run (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the uninterrupted runs")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="of " + ", ".join(FRAMEWORKS))
    parser.add_argument("--buffer", type=int, default=0, help=argparse.SUPPRESS)  # a worker's
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", nargs=2, metavar=("FRAMEWORK", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.framework, args.mode = args.worker
        worker(args)
        return
    from _common import machine_info, print_machine

    import torch

    torch.set_num_threads(1)
    args.buffers = [int(b) for b in args.buffers.split(",")]
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    unknown = sorted(set(args.frameworks) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"--frameworks: unknown {unknown}; choose among {list(FRAMEWORKS)}")
    results = measure(args)
    if args.json:
        print(json.dumps({"machine": machine_info(), "settings": vars(args), "results": results}))
        return
    print_machine(machine_info())
    print(f"{args.steps} steps of {BATCH} rows, a checkpoint every {args.save_every}, stopped at step {args.stop_at}; "
          f"{args.rounds} interleaved rounds of the uninterrupted runs (ratios to the loop within each round)")
    print(table(results))


if __name__ == "__main__":
    main()
