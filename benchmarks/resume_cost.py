"""Time to the first batch after resuming at batch 10 versus batch 1,000,000.

DESIGN.md promises that skipping to the resume position costs O(1) in the position: no data is
loaded for skipped batches. This measures it on a large index space (``--samples``, default
4 * 10^7: a dataset that computes each tiny sample from its index and stores nothing), with batches
of 32, so that batch 1,000,000 lies inside the first epoch. Three levels, each timed from the
start of the positioning to the first batch delivered:

- ``sampler``: ``ResumableRandomSampler.set_start_iter(k)``, then the first 32 indices;
- ``stream``: the training stream ``fit`` builds around a ``DataLoader(shuffle=True)``
  (``estimatorch.data._streams.make_train_stream``, a private helper), ``epoch_iter(0, k)``,
  then the first batch;
- ``fit``: ``fit(..., event_handlers=[CheckpointHandler(resume_from_checkpoint=True), ...])``
  from a checkpoint saved at batch ``k``, until the first ``batch_begin`` (checkpoint discovery
  and load, restore, sampler positioning, first fetch). The checkpoint at batch 10 is written by
  a real fit; the one at 1,000,000 is the same file with the position and the handlers' batch
  counters moved (training 10^6 batches to write it would take hours and measure nothing more).

Every level regenerates the epoch's permutation of all ``--samples`` indices, which costs the
same at every position; the ratio (position 1,000,000 over position 10) should be about 1. For
contrast, ``replay`` skips by iterating a plain ``DataLoader`` and discarding batches (what a
library without positioning does); it is measured at 10 and 10,000 batches only, and its
1,000,000 figure is extrapolated.

Usage::

    python benchmarks/resume_cost.py                 # table
    python benchmarks/resume_cost.py --samples 100000000 --repeats 3 --json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import _common as common

from estimatorch import Estimator, checkpoint  # noqa: E402
from estimatorch import event_handlers as eh  # noqa: E402
from estimatorch.data._streams import make_train_stream  # noqa: E402
from estimatorch.samplers import ResumableRandomSampler  # noqa: E402

NEAR, FAR = 10, 1_000_000


class IndexDataset(Dataset):
    """``n`` samples computed from their index (nothing stored): a 32-float input and a label."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((common.IN_FEATURES,), float(index % 97) / 97.0), index % common.CLASSES


class FirstBatch(eh.BatchBegin):
    """Records when the first batch reaches ``batch_begin``."""

    def __init__(self) -> None:
        self.at: Optional[float] = None

    def batch_begin(self, estimator: Any, **kwargs: Any) -> None:
        if self.at is None:
            self.at = time.perf_counter()


def loader_for(dataset: Dataset) -> DataLoader:
    return DataLoader(dataset, batch_size=common.BATCH_SIZE, shuffle=True)


# -- the three levels -----------------------------------------------------------------------
def sampler_first_batch(n: int, position: int) -> float:
    sampler = ResumableRandomSampler(n, seed=common.SEED, batch_size=common.BATCH_SIZE)
    sampler.set_epoch(0)
    start = time.perf_counter()
    sampler.set_start_iter(position)
    first = list(itertools.islice(iter(sampler), common.BATCH_SIZE))
    elapsed = time.perf_counter() - start
    assert len(first) == common.BATCH_SIZE
    return elapsed


def stream_first_batch(dataset: Dataset, position: int) -> float:
    stream = make_train_stream(loader_for(dataset), common.SEED)
    start = time.perf_counter()
    batch = next(iter(stream.epoch_iter(0, position)))
    elapsed = time.perf_counter() - start
    assert batch[0].shape[0] == common.BATCH_SIZE
    return elapsed


def _checkpoint_handler(model_dir: str, resume: bool, batch_period: int) -> eh.CheckpointHandler:
    return eh.CheckpointHandler(model_dir, epoch_period=None, batch_period=batch_period,
                                resume_from_checkpoint=resume)


def _estimator() -> Estimator:
    net = common.make_net()
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=common.make_optimizer(net), device="cpu",
                     seed=common.SEED)


def write_checkpoints(dataset: Dataset, root: str) -> dict[int, str]:
    """A real checkpoint at batch NEAR, and the same state moved to batch FAR."""
    near_dir, far_dir = os.path.join(root, "near"), os.path.join(root, "far")
    with contextlib.redirect_stdout(io.StringIO()):
        _estimator().fit(loader_for(dataset), batches=NEAR,
                         event_handlers=[_checkpoint_handler(near_dir, False, NEAR)])
    path = os.path.join(near_dir, checkpoint.checkpoint_name("model", 0, NEAR))
    payload = checkpoint.load(path)
    snapshot = payload["ranks"][0]
    snapshot["position"].update(batch=FAR, step=FAR)
    for state in snapshot["handlers"].values():
        for key in ("current_batch", "batch_in_epoch", "total_batches"):
            if state.get(key) == NEAR:
                state[key] = FAR
        if state.get("samples_in_epoch") == NEAR * common.BATCH_SIZE:
            state["samples_in_epoch"] = FAR * common.BATCH_SIZE
    os.makedirs(far_dir)
    far_path = os.path.join(far_dir, checkpoint.checkpoint_name("model", 0, FAR))
    checkpoint.atomic_save(payload, far_path)
    checkpoint.write_latest(far_dir, "model", far_path)
    return {NEAR: near_dir, FAR: far_dir}


def fit_first_batch(dataset: Dataset, model_dir: str, position: int) -> float:
    estimator, first = _estimator(), FirstBatch()
    handlers = [_checkpoint_handler(model_dir, True, 10**9), first]
    with contextlib.redirect_stdout(io.StringIO()):
        start = time.perf_counter()
        estimator.fit(loader_for(dataset), batches=position + 1, event_handlers=handlers)
    assert first.at is not None and estimator.position.step == position + 1, estimator.position
    return first.at - start


def replay_first_batch(dataset: Dataset, position: int) -> float:
    loader = loader_for(dataset)
    start = time.perf_counter()
    batch = next(itertools.islice(iter(loader), position, None))
    elapsed = time.perf_counter() - start
    assert batch[0].shape[0] == common.BATCH_SIZE
    return elapsed


# -- driver ---------------------------------------------------------------------------------
def repeat(fn: Callable[[], float], repeats: int) -> list[float]:
    values = []
    for _ in range(repeats):
        gc.collect()
        values.append(fn())
    return values


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4 * 10**7, help="index space (default 4*10^7)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--no-replay", action="store_true", help="skip the replay contrast")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.samples < (FAR + 1) * common.BATCH_SIZE:
        parser.error(f"--samples must be at least {(FAR + 1) * common.BATCH_SIZE} so that batch {FAR} "
                     "lies in the first epoch")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # e.g. the default-optimizer notice; not what is measured
    dataset = IndexDataset(args.samples)

    results: dict[str, dict[int, list[float]]] = {}
    root = tempfile.mkdtemp(prefix="estimatorch-resume-")
    try:
        dirs = write_checkpoints(dataset, root)
        levels: dict[str, Callable[[int], float]] = {
            "sampler": lambda k: sampler_first_batch(args.samples, k),
            "stream": lambda k: stream_first_batch(dataset, k),
            "fit": lambda k: fit_first_batch(dataset, dirs[k], k),
        }
        for level, fn in levels.items():
            fn(NEAR)  # warm-up
            results[level] = {}
            for k in (NEAR, FAR):
                results[level][k] = repeat(lambda: fn(k), args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    replay: dict[int, list[float]] = {}
    if not args.no_replay:
        replay = {k: repeat(lambda: replay_first_batch(dataset, k), max(1, min(args.repeats, 3)))
                  for k in (NEAR, 10_000)}

    rows, out = [], {}
    for level, by_pos in results.items():
        near, far = statistics.median(by_pos[NEAR]), statistics.median(by_pos[FAR])
        out[level] = {"seconds_at_10": by_pos[NEAR], "seconds_at_1000000": by_pos[FAR],
                      "median_ratio": far / near}
        rows.append([level, f"{near * 1e3:.1f}", f"{far * 1e3:.1f}", f"{far / near:.3f}"])
    if replay:
        near, mid = statistics.median(replay[NEAR]), statistics.median(replay[10_000])
        per_batch = (mid - near) / (10_000 - NEAR)
        far = near + per_batch * (FAR - NEAR)
        out["replay"] = {"seconds_at_10": replay[NEAR], "seconds_at_10000": replay[10_000],
                         "seconds_at_1000000_extrapolated": far, "median_ratio": far / near}
        rows.append(["replay (plain DataLoader, skip by iterating)", f"{near * 1e3:.1f}",
                     f"{far * 1e3:.0f} (extrapolated from 10,000: {mid * 1e3:.0f} ms)",
                     f"{far / near:.0f}"])
    info = common.machine_info()
    settings = {"samples": args.samples, "batch_size": common.BATCH_SIZE, "repeats": args.repeats,
                "positions": [NEAR, FAR], "threads": args.threads}
    if args.json:
        print(json.dumps({"machine": info, "settings": settings, "results": out}, indent=2))
        return 0
    common.print_machine(info)
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(common.format_table(["level", "first batch at 10 (ms, median)", "at 1,000,000 (ms, median)",
                               "ratio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
