"""Time to the first batch after resuming at the middle of an epoch of 10^6 examples, for each
data library ``fit`` resumes exactly (docs/data.md), against the first batch at the epoch's start.

Each case builds the training stream ``fit`` builds (``make_train_stream``, a private helper),
positions it the way a resume does, and times from the positioning to the first batch:

- ``torchdata map``: a ``StatefulDataLoader(shuffle=True)`` over a map-style dataset of
  ``--samples`` examples; for contrast, torchdata's own resume (``load_state_dict`` of its
  ``state_dict`` at the middle, then ``next``), which replays the sampler's indices;
- ``hf map``: a ``datasets.Dataset`` (in-memory arrow) with a ``with_transform``, in a DataLoader;
- ``hf iterable``: ``load_dataset("json", streaming=True)`` over 8 json-lines shards, ``.map``,
  no shuffle buffer: resumed from its own state (the dataset re-reads the start of the shard it
  stopped in); the state at the middle is captured by running the stream there once;
- ``hf iterable + buffer``: the same with ``.shuffle(seed, buffer_size=1000)``: replayed from
  the epoch's start (read and discarded);
- ``streaming``: a ``StreamingDataset(shuffle=True)`` over MDS shards written here, positioned
  by its resume state (the epoch's order is computed, nothing skipped is read).

(json rather than parquet: datasets sleeps 5 s whenever it shuts down the threads that read
parquet shards behind a shuffle, ``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN``, which would
land in whichever timing collects an abandoned iterator.)

Batches of ``--batch-size`` (default 1000: the middle is batch 500); each figure is the best
of ``--repeats`` (default 3; 1 for datasets' iterables, which take minutes). Data is written to a
temporary directory first (about a minute for 10^6 examples). Prints seconds and the ratio
middle / start; run from the repository root::

    python benchmarks/data_positioning.py [--samples 1000000] [--batch-size 1000] [--only streaming]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import _common  # noqa: F401  (puts the checkout on sys.path)
import numpy as np
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from estimatorch.data._streams import make_train_stream  # noqa: E402


class Indexed(torch.utils.data.Dataset):
    """Sample i: a 32-feature tensor computed from i (nothing stored)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return torch.full((32,), float(i)), i % 10


def first_batch(make: Callable[[], Any], start: int) -> float:
    """Seconds from positioning a fresh stream at ``start`` to its first batch."""
    stream = make_train_stream(make(), 0)
    t0 = time.perf_counter()
    next(iter(stream.epoch_iter(0, start)))
    return time.perf_counter() - t0


def from_state(make: Callable[[], Any], start: int) -> float:
    """A stateful stream run to ``start`` once; a fresh one restored from that state, timed."""
    stream = make_train_stream(make(), 0)
    it = iter(stream.epoch_iter(0, 0))
    for _ in range(start):
        next(it)
    state = stream.state_dict()
    fresh = make_train_stream(make(), 0)
    t0 = time.perf_counter()
    fresh.load_state_dict(state)
    next(iter(fresh.epoch_iter(0, start)))
    return time.perf_counter() - t0


def torchdata_cases(n: int, b: int) -> dict[str, Callable[[int], float]]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> Any:
        return StatefulDataLoader(Indexed(n), batch_size=b, shuffle=True)

    def own(start: int) -> float:
        loader = make()
        it = iter(loader)
        for _ in range(start):
            next(it)
        state = loader.state_dict()
        fresh = make()
        t0 = time.perf_counter()
        fresh.load_state_dict(state)
        next(iter(fresh))
        return time.perf_counter() - t0

    return {"torchdata map (fit)": lambda s: first_batch(make, s),
            "torchdata map (its own load_state_dict)": own}


def hf_cases(n: int, b: int, root: str) -> dict[str, Callable[[int], float]]:
    from datasets import Dataset, load_dataset

    def augment_batch(batch: dict) -> dict:
        i = torch.tensor(batch["i"])
        return {"input": i[:, None].float() + torch.rand(len(i), 32), "label": i % 10}

    table = Dataset.from_dict({"i": np.arange(n)})

    def map_style() -> Any:
        return torch.utils.data.DataLoader(table.with_transform(augment_batch), batch_size=b, shuffle=True)

    files = []
    for s in range(8):
        path = os.path.join(root, f"part{s}.jsonl")
        with open(path, "w") as out:
            out.writelines(f'{{"i": {i}}}\n' for i in range(s, n, 8))
        files.append(path)

    def augment(example: dict) -> dict:
        return {"input": (torch.full((32,), float(example["i"])) + torch.rand(32)).tolist(),
                "label": example["i"] % 10}

    def iterable(buffer: bool) -> Callable[[], Any]:
        def make() -> Any:
            ds = load_dataset("json", data_files=files, split="train", streaming=True)
            if buffer:
                ds = ds.shuffle(seed=1, buffer_size=1000)
            return torch.utils.data.DataLoader(ds.map(augment, remove_columns=["i"]).with_format("torch"),
                                               batch_size=b)
        return make

    return {"hf map": lambda s: first_batch(map_style, s),
            "hf iterable (its state)": lambda s: from_state(iterable(False), s) if s else first_batch(
                iterable(False), 0),
            "hf iterable + buffer (replay)": lambda s: first_batch(iterable(True), s)}


def streaming_cases(n: int, b: int, root: str) -> dict[str, Callable[[int], float]]:
    if "streaming" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        # streaming/__init__ imports its torchvision datasets; the dev venv has no torchvision
        sys.modules["streaming"] = importlib.util.module_from_spec(importlib.util.find_spec("streaming"))
    from streaming.base import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    remote = os.path.join(root, "mds")
    with MDSWriter(out=remote, columns={"i": "int"}, size_limit=1 << 22) as out:
        for i in range(n):
            out.write({"i": i})
    counter = iter(range(10**9))

    class Augmented(StreamingDataset):
        def __getitem__(self, idx: int) -> Any:
            i = int(super().__getitem__(idx)["i"])
            return torch.full((32,), float(i)) + torch.rand(32), i % 10

    def make() -> Any:
        local = os.path.join(root, f"local{next(counter)}")
        return torch.utils.data.DataLoader(
            Augmented(remote=remote, local=local, shuffle=True, shuffle_seed=7, batch_size=b), batch_size=b)

    return {"streaming": lambda s: first_batch(make, s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10**6)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--only", choices=["torchdata", "hf", "streaming"])
    parser.add_argument("--repeats", type=int, default=3, help="the best of this many (1 for datasets' iterables)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    n, b = args.samples, args.batch_size
    middle = n // b // 2
    root = tempfile.mkdtemp()
    try:
        cases: dict[str, Callable[[int], float]] = {}
        if args.only in (None, "torchdata"):
            cases.update(torchdata_cases(n, b))
        if args.only in (None, "hf"):
            cases.update(hf_cases(n, b, root))
        if args.only in (None, "streaming"):
            cases.update(streaming_cases(n, b, root))
        print(f"{n} examples, batches of {b}: first batch at batch 0 and at batch {middle} (s)")
        print(f"{'case':42s} {'start':>9s} {'middle':>9s} {'ratio':>7s}")
        for name, case in cases.items():
            times = 1 if "iterable" in name else args.repeats  # the datasets iterables: minutes each
            start = min(case(0) for _ in range(times))
            mid = min(case(middle) for _ in range(times))
            print(f"{name:42s} {start:9.3f} {mid:9.3f} {mid / start:7.1f}", flush=True)
    finally:  # streaming's download threads may still be copying shards: no error at removal
        time.sleep(1)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
