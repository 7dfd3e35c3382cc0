"""The per-batch cost of a ``.shuffle(buffer_size=--buffer)`` datasets pipeline behind 2
DataLoader workers, with each worker's state (the buffer's content) sent with every batch
(``snapshot_every=1``, before) and with one batch in ``buffer_size // batch_size`` (now), against
a hand-written loop over the same DataLoader (no state); and the time to the first batch after
resuming at batch ``--at`` (from the data state, ``torch.load`` included) for both.

``--samples`` examples ``{"i": int}`` in 16 json-lines shards, a no-op ``.map``. Run from the
repository root::

    python benchmarks/worker_snapshots.py [--samples 200000] [--batch-size 100] [--buffer 10000] [--at 500]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
import warnings
from typing import Any

import torch

from estimatorch.data import open_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--buffer", type=int, default=10_000)
    parser.add_argument("--at", type=int, default=500, help="the batch a resume starts at")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from datasets import load_dataset

    root = tempfile.mkdtemp()
    try:
        files = []
        for s in range(16):
            path = os.path.join(root, f"part{s}.jsonl")
            with open(path, "w") as out:
                out.writelines(f'{{"i": {i}}}\n' for i in range(s, args.samples, 16))
            files.append(path)

        def make() -> Any:
            ds = load_dataset("json", data_files=files, split="train", streaming=True)
            ds = ds.shuffle(seed=1, buffer_size=args.buffer).map(lambda e: {"x": e["i"] % 7}, remove_columns=["i"])
            return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=args.batch_size, num_workers=2)

        def stream(every: int) -> Any:
            s = open_stream(make(), 0)
            if every:
                s.inner._capture.snapshot_every = every
            return s

        def per_batch(batches: Any) -> tuple[float, Any]:
            """Seconds per batch over batches 100..at (after the buffers' first fill)."""
            it = iter(batches)
            for _ in range(100):
                next(it)
            t0 = time.perf_counter()
            for _ in range(args.at - 100):
                next(it)
            return (time.perf_counter() - t0) / (args.at - 100), it

        every = max(1, args.buffer // args.batch_size)
        plain, _ = per_batch(make())
        print(f"{args.samples} examples, buffer_size={args.buffer}, batches of {args.batch_size}, 2 workers; "
              f"snapshot_every now {every}")
        print(f"{'case':34s} {'ms/batch':>9s} {'vs loop':>8s} {'resume at ' + str(args.at):>15s} {'state bytes':>12s}")
        print(f"{'hand-written loop (no state)':34s} {plain * 1e3:9.2f} {1.0:8.2f}", flush=True)
        for name, n in (("state with every batch (before)", 1), (f"state every {every} batches (now)", every)):
            s = stream(n)
            took, _ = per_batch(s.epoch_iter(0, 0))
            out = io.BytesIO()
            torch.save(s.state_dict(), out)
            s.close()
            fresh = stream(n)
            t0 = time.perf_counter()
            fresh.load_state_dict(torch.load(io.BytesIO(out.getvalue()), weights_only=True))
            next(iter(fresh.epoch_iter(0, args.at)))
            resume = time.perf_counter() - t0
            fresh.close()
            print(f"{name:34s} {took * 1e3:9.2f} {took / plain:8.2f} {resume:15.3f} {len(out.getvalue()):12d}",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
