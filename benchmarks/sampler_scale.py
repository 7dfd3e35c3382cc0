"""What an epoch's order costs at internet scale: ``permutation="randperm"`` against
``permutation="feistel"`` for 10^6, 10^8 and 10^9 samples.

For each length and order, in a fresh process (so that memory figures are its own):

- ``first batch``: from a fresh ``ResumableRandomSampler`` to the first batch of 1024 indices
  after ``set_epoch(1)`` and ``set_start_iter`` at the middle of the epoch (what a resume, and
  every epoch start, pays);
- ``memory``: the peak resident memory over that, minus the resident memory before (the kernel's
  peak counter is reset first: ``/proc/self/clear_refs``);
- ``batch of 1024``: reading 1024 consecutive indices at a random position of the epoch's order
  (``sampler.epoch_view(epoch)[p:p + 1024]``), once the order is there; per batch and per index.

``randperm`` is measured up to ``--randperm-max`` samples (default 10^8: at 10^9 it holds 8 GB).
``--quality`` prints the uniformity figures the tests bound (``tests/samplers/test_index_shuffle.py``).

Usage::

    python benchmarks/sampler_scale.py                      # table, 5 runs per figure
    python benchmarks/sampler_scale.py --sizes 1000000 --repeats 3 --json
    python benchmarks/sampler_scale.py --quality
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

import torch

import _common as common

from estimatorch.samplers import IndexShuffle, ResumableRandomSampler  # noqa: E402

BATCH = 1024
SEED = common.SEED


def _rss_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # reset the peak resident set size (VmHWM)
        return True
    except OSError:
        return False


def measure_one(n: int, permutation: str, repeats: int) -> dict[str, Any]:
    """The figures of one (length, order), measured in this process."""
    torch.set_num_threads(1)
    warm = ResumableRandomSampler(1000, seed=SEED, batch_size=BATCH, permutation=permutation)
    list(itertools.islice(iter(warm), BATCH))  # first-call costs of the code path, not of n
    firsts = []
    peak_kib = 0
    exact_peak = True
    for _ in range(repeats):
        before = _rss_kib("VmRSS")
        exact_peak = _reset_peak() and exact_peak
        start = time.perf_counter()
        sampler = ResumableRandomSampler(n, seed=SEED, batch_size=BATCH, permutation=permutation)
        sampler.set_epoch(1)
        sampler.set_start_iter(n // BATCH // 2)
        first = list(itertools.islice(iter(sampler), BATCH))
        firsts.append(time.perf_counter() - start)
        peak_kib = max(peak_kib, _rss_kib("VmHWM") - before)
        assert len(first) == BATCH
        del sampler, first
    sampler = ResumableRandomSampler(n, seed=SEED, batch_size=BATCH, permutation=permutation)
    order = sampler.epoch_view(1)
    draw = random.Random(SEED)
    batches = []
    for _ in range(max(200, repeats)):
        low = draw.randrange(0, n - BATCH)
        start = time.perf_counter()
        order[low:low + BATCH]
        batches.append(time.perf_counter() - start)
    return {"n": n, "permutation": permutation, "first_batch_s": common.summary(firsts),
            "memory_bytes": peak_kib * 1024, "memory_exact": exact_peak, "batch_1024_s": common.summary(batches)}


def measure(n: int, permutation: str, repeats: int) -> dict[str, Any]:
    """``measure_one`` in a fresh process."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(n), permutation,
                           "--repeats", str(repeats)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def quality(epochs: int = 3000) -> list[tuple[str, str]]:
    """The statistics ``tests/samplers/test_index_shuffle.py`` bounds, with their bounds."""
    rows = []
    for n in (7, 10):
        counts = torch.zeros(n, n, dtype=torch.float64)
        for epoch in range(epochs):
            counts[IndexShuffle(n, SEED, epoch)(torch.arange(n)), torch.arange(n)] += 1
        expected = epochs / n
        statistic = float(((counts - expected) ** 2 / expected).sum()) * (n - 1) / n
        dof = (n - 1) ** 2
        bound = dof * (1 - 2 / (9 * dof) + 5 * math.sqrt(2 / (9 * dof))) ** 3
        rows.append((f"n={n}: position chi-square over {epochs} epochs (dof {dof})",
                     f"{statistic:.1f} (bound {bound:.1f}, mean {dof})"))
    n = 10**6
    order = IndexShuffle(n, SEED, 0)(torch.arange(n)).double()
    following = IndexShuffle(n, SEED, 1)(torch.arange(n)).double()

    def r(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    bound = 5 / math.sqrt(n - 1)
    for name, value in (("consecutive indices", r(order[:-1], order[1:])),
                        ("index and position", r(order, torch.arange(n).double())),
                        ("epochs 0 and 1", r(order, following))):
        rows.append((f"n=10^6: correlation of {name}", f"{value:+.1e} (bound +-{bound:.1e})"))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,100000000,1000000000", help="lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (default 5)")
    parser.add_argument("--randperm-max", type=int, default=10**8, help="longest randperm measured (default 10^8)")
    parser.add_argument("--quality", action="store_true", help="print the uniformity figures instead")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--one", nargs=2, metavar=("N", "PERMUTATION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(int(args.one[0]), args.one[1], args.repeats)))
        return 0
    if args.quality:
        for name, value in quality():
            print(f"{name}: {value}")
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)  # as in each measuring process
    info = common.machine_info()
    results = [measure(n, p, args.repeats) for n in sizes for p in ("randperm", "feistel")
               if p == "feistel" or n <= args.randperm_max]
    settings = {"sizes": sizes, "repeats": args.repeats, "batch": BATCH, "randperm_max": args.randperm_max}
    if args.json:
        print(json.dumps({"machine": info, "settings": settings, "results": results}, indent=2))
        return 0
    common.print_machine(info)
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    rows = []
    for res in results:
        first, batch = res["first_batch_s"], res["batch_1024_s"]
        rows.append([f"{res['n']:.0e}".replace("+0", "") + f" {res['permutation']}",
                     f"{first['median'] * 1e3:.2f} ({first['min'] * 1e3:.2f}-{first['max'] * 1e3:.2f})",
                     common.human_bytes(res["memory_bytes"]) + ("" if res["memory_exact"] else " (upper bound)"),
                     f"{batch['median'] * 1e6:.0f}", f"{batch['median'] * 1e9 / BATCH:.0f}"])
    print(common.format_table(["samples, order", "first batch at the middle (ms, median (min-max))",
                               "sampler memory (peak RSS)", "batch of 1024 (us)", "per index (ns)"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
