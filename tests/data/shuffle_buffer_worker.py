"""One process of the shuffle-buffer stop-and-resume tests (run as a script by test_shuffle_buffer.py).

``load_dataset("json", streaming=True)`` over 4 shards of 12 examples, ``.shuffle(seed=1,
buffer_size=10)`` (a flush yields 5 examples: checkpoints fall inside flushes and between them),
a random ``.map`` after it, ``with_format("torch")``, in a ``DataLoader(batch_size=4)``; on 2 gloo
ranks with ``split_dataset_by_node``. A checkpoint after every step.

    python shuffle_buffer_worker.py full   --dir DIR --workers W [--ranks 2] --out OUT
    python shuffle_buffer_worker.py kill   --dir DIR --workers W [--ranks 2] --at K  (SIGKILL after step K)
    python shuffle_buffer_worker.py resume --dir DIR --workers W [--ranks 2] --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import warnings

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402

from estimatorch import CheckpointHandler, distributed  # noqa: E402
from estimatorch.event_handlers import BatchEnd  # noqa: E402
from tests.data.test_iterable_streams import dropout_estimator  # noqa: E402

N, SHARDS, BATCH, BUFFER, EPOCHS = 48, 4, 4, 10, 2


def write_shards(directory):
    """N examples in SHARDS json-lines files (example i in file i % SHARDS)."""
    paths = []
    for s in range(SHARDS):
        path = os.path.join(directory, f"part{s}.jsonl")
        with open(path, "w") as out:
            out.writelines(json.dumps({"i": i}) + "\n" for i in range(s, N, SHARDS))
        paths.append(path)
    return paths


def augment(example):
    """A random .map after the shuffle: example i is i in every feature plus noise."""
    i = example["i"]
    return {"input": (torch.full((4,), float(i)) + torch.rand(4)).tolist(), "label": i % 3}


def train_data(files, workers, rank=None):
    ds = load_dataset("json", data_files=files, split="train", streaming=True)
    ds = ds.shuffle(seed=1, buffer_size=BUFFER).map(augment, remove_columns=["i"])
    if rank is not None:
        ds = split_dataset_by_node(ds, rank=rank, world_size=2)
    return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=BATCH, num_workers=workers)


class Recorder(BatchEnd):
    priority = float("inf")

    def __init__(self):
        self.batches, self.losses = [], []

    def batch_end(self, estimator, *, batch, loss, **kwargs):
        self.batches.append({k: v.clone() for k, v in batch.items()})
        self.losses.append(float(loss.detach()).hex())


class KillAfter(BatchEnd):
    """SIGKILL at the boundary after step ``at``: right after that step's checkpoint (on every
    rank, once rank 0 has written it)."""

    priority = float("inf")

    def __init__(self, at):
        self.at, self.seen = at, 0

    def batch_end(self, estimator, **kwargs):
        self.seen += 1
        if self.seen == self.at:
            estimator.at_boundary(self.kill)

    def kill(self):
        if distributed.get_world_size() > 1:
            torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)


def fit(directory, workers, mode, at):
    torch.set_num_threads(1)
    rank = distributed.get_rank() if distributed.get_world_size() > 1 else None
    files = write_shards(directory) if rank is None else sorted(
        os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(".jsonl"))
    recorder = Recorder()
    handlers = [recorder]
    if mode != "full":
        handlers.append(CheckpointHandler(os.path.join(directory, "ckpt"), batch_period=1, epoch_period=None,
                                          max_checkpoints=2, resume_from_checkpoint=mode == "resume"))
    if mode == "kill":
        handlers.append(KillAfter(at))
    est = dropout_estimator()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(train_data(files, workers, rank), epochs=EPOCHS, event_handlers=handlers)
    return {"batches": recorder.batches, "losses": recorder.losses,
            "params": [p.detach().clone() for p in est.net.parameters()]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["full", "kill", "resume"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--at", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.ranks == 1:
        result = [fit(args.dir, args.workers, args.mode, args.at)]
    else:
        write_shards(args.dir)
        # the ranks are forks of this process, which has trained nothing (as tests/forked.py's
        # children are of their server): not fresh interpreters, each importing torch and datasets
        distributed._spawn._START_METHOD = "fork"
        result = distributed.spawn(fit, args.ranks, args.dir, args.workers, args.mode, args.at, backend="gloo")
    if args.out:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
