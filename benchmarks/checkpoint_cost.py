"""Save and load time and file size of an estimatorch checkpoint versus a raw ``torch.save``.

For a small (about 1M parameters) and a medium (about 25M parameters) MLP trained one step with
Adam (so the optimizer holds two moments per parameter), it times:

- estimatorch: ``checkpoint.build_payload(est)`` (model, optimizer, every handler's state,
  metric accumulators, RNG states, data position; checked to be plain tensors and values),
  ``checkpoint.atomic_save`` (temporary file, fsync, rename, directory fsync) and
  ``checkpoint.load`` (``torch.load(weights_only=True)``, migration check, validation);
- raw: ``torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, path)``, the
  same followed by ``fsync`` (what atomic_save adds for durability), and
  ``torch.load(path, weights_only=True)``.

Files go to a temporary directory (``--dir`` to choose the disk); loads read from the page cache.
The operations run in a shuffled order each round, ``--repeats`` rounds after a warm-up round,
each after an
``os.sync()`` (untimed) so that no write of the previous one is still being flushed. The last column
divides by the raw ``torch.save`` median (for saves and ``build_payload``) or the raw
``torch.load`` median (for loads).

Usage::

    python benchmarks/checkpoint_cost.py
    python benchmarks/checkpoint_cost.py --repeats 9 --json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

import _common as common

from estimatorch import Estimator, checkpoint  # noqa: E402
from estimatorch import event_handlers as eh  # noqa: E402

WIDTH = 1024
LOADS = ("estimatorch checkpoint.load", "raw torch.load(weights_only=True)")
MODELS = {"small (1.05M params)": 1, "medium (25.2M params)": 24}  # Linear(1024, 1024) layers


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(common.SEED)
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def fit_one_step(layers: int, at_train_end: Callable[[Estimator], Any]) -> Any:
    """One Adam step of fit (so model, optimizer and handlers hold state), then
    ``at_train_end(est)`` while the fit is still active: a payload is built through the
    estimator's seam, which only a fit in progress has. Returns what it returned."""
    net = make_model(layers)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
                    device="cpu", seed=common.SEED)
    data = [(torch.randn(8, WIDTH), torch.randn(8, WIDTH))]
    result: list[Any] = []
    measure_at_end = eh.LambdaHandler(train_end=lambda estimator, **_: result.append(at_train_end(estimator)))
    with contextlib.redirect_stdout(io.StringIO()):
        est.fit(data, batches=1, event_handlers=[eh.StoppingHandler(), measure_at_end])
    return result[0]


def _fsynced_save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def time_round_robin(ops: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Each op once per round, for ``repeats`` rounds after a warm-up round, in a shuffled order,
    so that drift and the after-effects of one op on the next (page cache, disk writeback)
    affect all of them alike."""
    for fn in ops.values():
        fn()
    values: dict[str, list[float]] = {name: [] for name in ops}
    order, shuffle = list(ops), random.Random(common.SEED).shuffle
    for _ in range(repeats):
        shuffle(order)  # a fresh order every round: no op always follows the same one
        for name in order:
            fn = ops[name]
            gc.collect()
            if hasattr(os, "sync"):
                os.sync()  # no dirty pages left by the previous op for this op's fsync to wait on
            start = time.perf_counter()
            fn()
            values[name].append(time.perf_counter() - start)
    return values


def measure(layers: int, directory: str, repeats: int) -> dict[str, Any]:
    return fit_one_step(layers, lambda est: _measure(est, directory, repeats))


def _measure(est: Estimator, directory: str, repeats: int) -> dict[str, Any]:
    params = sum(p.numel() for p in est.net.parameters())
    est_path = os.path.join(directory, "estimatorch.pt")
    prebuilt_path = os.path.join(directory, "estimatorch-prebuilt.pt")
    raw_path = os.path.join(directory, "raw.pt")
    raw_sync_path = os.path.join(directory, "raw-fsync.pt")

    def raw_state() -> dict[str, Any]:
        return {"model": est.net.state_dict(), "optimizer": est.optimizer.state_dict()}

    payload = checkpoint.build_payload(est)
    times = time_round_robin({
        "estimatorch build_payload": lambda: checkpoint.build_payload(est),
        "estimatorch atomic_save": lambda: checkpoint.atomic_save(payload, prebuilt_path),
        "estimatorch build_payload + atomic_save":
            lambda: checkpoint.atomic_save(checkpoint.build_payload(est), est_path),
        "raw torch.save": lambda: torch.save(raw_state(), raw_path),
        "raw torch.save + fsync": lambda: _fsynced_save(raw_state(), raw_sync_path),
        "estimatorch checkpoint.load": lambda: checkpoint.load(est_path),
        "raw torch.load(weights_only=True)":
            lambda: torch.load(raw_path, map_location="cpu", weights_only=True),
    }, repeats)
    return {
        "parameters": params,
        "seconds": times,
        "bytes": {"estimatorch": os.path.getsize(est_path), "raw": os.path.getsize(raw_path)},
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    out: dict[str, Any] = {}
    for name, layers in MODELS.items():
        directory = tempfile.mkdtemp(prefix="estimatorch-ckpt-", dir=args.dir)
        try:
            out[name] = measure(layers, directory, args.repeats)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    info = common.machine_info()
    if args.json:
        print(json.dumps({"machine": info, "settings": {"repeats": args.repeats, "optimizer": "Adam"},
                          "results": out}, indent=2))
        return 0
    common.print_machine(info)
    print(f"settings: repeats={args.repeats}, optimizer=Adam (two moments per parameter), "
          f"directory={args.dir or tempfile.gettempdir()}")
    for name, res in out.items():
        secs = res["seconds"]
        raw_save = statistics.median(secs["raw torch.save"])
        raw_load = statistics.median(secs["raw torch.load(weights_only=True)"])
        rows = []
        for what, values in secs.items():
            med = statistics.median(values)
            ref = raw_load if what in LOADS else raw_save
            rows.append([what, f"{med * 1e3:.2f}", f"{min(values) * 1e3:.2f}", f"{max(values) * 1e3:.2f}",
                         f"{med / ref:.2f}"])
        size = res["bytes"]
        print(f"\n{name}: estimatorch file {common.human_bytes(size['estimatorch'])}, raw file "
              f"{common.human_bytes(size['raw'])} (+{size['estimatorch'] - size['raw']} bytes, "
              f"{size['estimatorch'] / size['raw']:.4f}x)")
        print(common.format_table(["operation", "median ms", "min", "max", "x raw save/load"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
