"""Memory per rank and checkpoint save/load time of an FSDP2 (sharded) fit against a DDP fit, on 2
gloo processes, in the same run.

The model is 12 ``Linear(2048, 2048)`` (50.4M parameters; ``--small``: 2 ``Linear(256, 256)``,
for the tests) with Adam, trained ``--steps`` batches of 8 per rank by ``Estimator.fit`` with
``strategy="ddp"`` and then ``strategy="fsdp"``, each in fresh processes. At ``train_end`` each
rank reports:

- the bytes of parameters and optimizer moments it holds (its local shards under FSDP2, whole
  tensors under DDP), and the process's peak resident set;
- the save time of a checkpoint as ``CheckpointHandler`` writes it: under DDP
  ``checkpoint.build_payload`` (gathered on rank 0) and ``atomic_save`` on rank 0 (one file);
  under FSDP2 ``checkpoint.save_fit_checkpoint`` (every rank writes its part of a directory:
  DCP's shards, its own file, fsynced, marked, renamed); median of ``--repeats``, the slower
  rank's, each save after an (untimed) ``os.sync()``;
- the load time of what a resume reads and restores: every rank reads the file (DDP) or the
  directory's run part (FSDP2) and restores the model and optimizer
  (``checkpoint.restore_training_state``; DCP reads each rank's slices); loads read from the page cache;
- the checkpoint's size on disk;
- under FSDP2, the same save with ``async_save`` (``save_fit_checkpoint(..., writer=...)``): how
  long it holds the training thread (every rank copies its shards into staging buffers) and the
  time until the directory is durable (the writer threads done).

Usage::

    python benchmarks/sharded_checkpoint.py [--small] [--steps 2] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from estimatorch import Estimator, LambdaHandler, checkpoint, distributed  # noqa: E402


def _net(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def _held_bytes(est) -> tuple[int, int]:
    """This rank's bytes of parameters and of optimizer moments (Adam's scalar step counters, 4
    bytes per parameter tensor, left out)."""
    params = _local_bytes(est.net.parameters())
    state = _local_bytes(v for entry in est.optimizer.state.values() for v in entry.values() if v.dim() > 0)
    return params, state


def _timed(fn) -> float:
    os.sync()
    distributed.barrier()
    start = time.perf_counter()
    fn()
    distributed.barrier()
    return time.perf_counter() - start


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def _save(est, path: str) -> None:
    """A checkpoint as CheckpointHandler writes it."""
    if est.strategy == "fsdp":
        checkpoint.save_fit_checkpoint(est, path)  # every rank writes its part
        return
    payload = checkpoint.build_payload(est)  # gathered on rank 0, which writes the file
    if distributed.get_rank() == 0:
        checkpoint.atomic_save(payload, path)


def _load(est, path: str) -> None:
    """What a resume reads and restores on every rank."""
    checkpoint.restore_training_state(est, checkpoint.read_checkpoint(path))


def _measure(est, directory: str, repeats: int) -> dict:
    params, state = _held_bytes(est)
    saves, loads, size = [], [], 0
    for i in range(repeats):
        path = os.path.join(directory, f"model-epoch0batch{i}.{'dcp' if est.strategy == 'fsdp' else 'pt'}")
        saves.append(_timed(functools.partial(_save, est, path)))
        loads.append(_timed(functools.partial(_load, est, path)))
        size = _size(path)
    out = {"param_bytes": params, "optimizer_bytes": state, "save_s": statistics.median(saves),
           "load_s": statistics.median(loads), "size_bytes": size}
    if est.strategy == "fsdp":  # async_save: how long the save holds the step, and until durable
        writer, stalls, durable = checkpoint.BackgroundWriter(), [], []
        for i in range(repeats):
            path = os.path.join(directory, f"model-epoch1batch{i}.dcp")
            os.sync()
            distributed.barrier()
            start = time.perf_counter()
            checkpoint.save_fit_checkpoint(est, path, writer=writer)
            stalls.append(time.perf_counter() - start)
            writer.wait()
            distributed.barrier()
            durable.append(time.perf_counter() - start)
        out.update(async_stall_s=statistics.median(stalls), async_durable_s=statistics.median(durable))
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _rank(strategy: str, width: int, depth: int, steps: int, repeats: int, directory: str) -> dict:
    torch.set_num_threads(1)
    net = _net(width, depth)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(net.parameters(), lr=1e-4), strategy=strategy)
    est.logger.disabled = True  # stdout holds the results only
    x = torch.randn(8 * 2 * steps, width)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=8)
    out = {}
    measure = LambdaHandler(train_end=lambda est, **kw: out.update(_measure(est, directory, repeats)))
    est.fit(loader, batches=steps, event_handlers=[measure])
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    width, depth = (256, 2) if args.small else (2048, 12)
    results = {"parameters": depth * (width * width + width), "ranks": 2}
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for strategy in ("ddp", "fsdp"):
            directory = os.path.join(root, strategy)
            os.makedirs(directory)
            ranks = distributed.spawn(_rank, 2, strategy, width, depth, args.steps, args.repeats, directory,
                                      backend="gloo")
            results[strategy] = {
                "held_bytes_per_rank": [r["param_bytes"] + r["optimizer_bytes"] for r in ranks],
                "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
                "save_s": max(r["save_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
                "size_bytes": ranks[0]["size_bytes"]}
            if strategy == "fsdp":
                for key in ("async_stall_s", "async_durable_s"):
                    results[strategy][key] = max(r[key] for r in ranks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["held_ratio_fsdp_to_ddp"] = max(results["fsdp"]["held_bytes_per_rank"]) / max(
        results["ddp"]["held_bytes_per_rank"])
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        mib = 2 ** 20
        print(f"{results['parameters'] / 1e6:.1f}M parameters, Adam, 2 gloo processes")
        print(f"{'':6} {'held/rank MiB':>14} {'peak RSS MiB':>13} {'save s':>8} {'load s':>8} {'size MiB':>9}")
        for strategy in ("ddp", "fsdp"):
            r = results[strategy]
            print(f"{strategy:6} {max(r['held_bytes_per_rank']) / mib:14.1f} "
                  f"{max(r['peak_rss_bytes_per_rank']) / mib:13.1f} {r['save_s']:8.3f} {r['load_s']:8.3f} "
                  f"{r['size_bytes'] / mib:9.1f}")
        print(f"held per rank, fsdp / ddp: {results['held_ratio_fsdp_to_ddp']:.3f}")
        fsdp = results["fsdp"]
        print(f"fsdp async_save: the save holds the step {fsdp['async_stall_s']:.3f} s, durable after "
              f"{fsdp['async_durable_s']:.3f} s (synchronous: {fsdp['save_s']:.3f} s)")
    return results


if __name__ == "__main__":
    main()
