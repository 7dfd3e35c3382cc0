"""What ``Estimator(check_replicas_every=N)`` costs on 2 processes (gloo, CPU): the time of one check
as a ratio to a step, and the per-step time of a fit with the check every 50 steps and every step
against the same fit without it, in the same run.

Both ranks train the benchmark MLP (``_common.py``: 32-``--hidden``-10, CrossEntropyLoss, SGD with
momentum, so that the optimizer holds a state the fingerprint covers, batches of 32 per rank, one
torch thread per process) with the handlers ``fit`` adds by itself, no progress bar, for
``--steps`` steps:

- ``off``: ``check_replicas_every=None`` (the default);
- ``every-50`` and ``every-1``: the check every 50 steps, and every step.

Each timed run builds its net and optimizer afresh; the configurations alternate, the first of
each round rotating, after one untimed warm-up round; a run's time is the slower rank's. A check's
own time is read around each call of the check (``ReplicaCheck.check``) and its collectives are
counted (``torch.distributed.all_gather`` calls per check). Reported: the median per-step time of
each configuration, the median time of one check, the check's time over a step of ``off``, and
the per-step overhead of ``every-50`` and ``every-1`` over ``off`` (median of the paired ratios).

Usage::

    python benchmarks/replica_check.py                   # 1000 steps, 5 rounds
    python benchmarks/replica_check.py --hidden 1024 --json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from typing import Any, Optional

import torch
from torch import nn

import _common as common  # noqa: I001 - puts the checkout on sys.path first

from estimatorch import distributed  # noqa: E402

CONFIGS = {"off": None, "every-50": 50, "every-1": 1}


def _fit(steps: int, dataset: Any, hidden: int, every: Optional[int]) -> None:
    from estimatorch import Estimator

    torch.manual_seed(common.SEED)
    net = nn.Sequential(nn.Linear(common.IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, common.CLASSES))
    est = Estimator(net, nn.CrossEntropyLoss(), device="cpu", seed=common.SEED, check_replicas_every=every,
                    optimizer=torch.optim.SGD(net.parameters(), lr=common.LR, momentum=0.9))
    with contextlib.redirect_stdout(io.StringIO()):
        est.fit(common.make_loader(dataset), batches=steps)


def _worker(settings: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from estimatorch.estimator._setup import handlers as fit_setup
    from estimatorch.estimator._stopping.replicas import ReplicaCheck

    torch.set_num_threads(1)
    fit_setup.interactive = lambda: False  # the default set without a progress bar
    dataset = common.make_dataset(settings["samples"])
    checks: list[float] = []
    gathers = [0]
    check, gather = ReplicaCheck.check, dist.all_gather

    def timed_check(self: Any, *args: Any, **kwargs: Any) -> int:
        began = time.perf_counter()
        try:
            return check(self, *args, **kwargs)
        finally:
            checks.append(time.perf_counter() - began)

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        gathers[0] += 1
        return gather(*args, **kwargs)

    ReplicaCheck.check, dist.all_gather = timed_check, counted_gather  # type: ignore[method-assign]
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for round_ in range(settings["repeats"] + 1):  # round 0: warm-up
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            dist.barrier()
            began = time.perf_counter()
            _fit(settings["steps"], dataset, settings["hidden"], CONFIGS[name])
            elapsed = torch.tensor(time.perf_counter() - began, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slower rank's
            if round_:
                times[name].append(float(elapsed) / settings["steps"])
    return {"times": times, "check_s": checks, "checks": len(checks), "all_gathers": gathers[0]}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = {"steps": args.steps, "repeats": args.repeats, "hidden": args.hidden, "samples": args.samples}
    result = distributed.spawn(_worker, 2, settings, backend="gloo")[0]
    times = result["times"]
    step = statistics.median(times["off"])
    check = statistics.median(result["check_s"])
    rounds = range(args.repeats)
    out = {
        "settings": settings,
        "us_per_step": {name: statistics.median(values) * 1e6 for name, values in times.items()},
        "us_per_check": check * 1e6,
        "check_over_step": check / step,
        "all_gathers_per_check": result["all_gathers"] / result["checks"] if result["checks"] else None,
        "overhead": {name: statistics.median(times[name][r] / times["off"][r] for r in rounds) - 1
                     for name in ("every-50", "every-1")},
        "machine": common.machine_info(),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        common.print_machine(out["machine"])
        rows = [[name, f"{us:.1f}"] for name, us in out["us_per_step"].items()]
        print(common.format_table(["config", "us/step"], rows))
        print(f"one check: {out['us_per_check']:.1f} us = {out['check_over_step']:.2f} steps of 'off'; "
              f"{out['all_gathers_per_check']:.0f} all_gather per check")
        print("per-step overhead over 'off': " + ", ".join(f"{name} {value:+.1%}"
                                                          for name, value in out["overhead"].items()))
    return out


if __name__ == "__main__":
    main()
