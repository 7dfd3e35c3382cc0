"""``Estimator.fit`` on 2 processes (gloo, CPU) against hand-written DDP loops, in the same run.

Both ranks train the benchmark MLP (``_common.py``: 32-64-10, CrossEntropyLoss, SGD lr 0.01,
batches of 32 per rank, seed 0, one torch thread per process) on the CPU (``fit`` too:
``device="cpu"``, also where a GPU exists) for ``--steps`` optimizer steps:

- ``raw+metrics``: the hand-written loop doing ``fit``'s job, the one the headline ratio is
  taken against. ``DistributedDataParallel(net)`` over a ``DataLoader`` with a
  ``DistributedSampler`` (shuffled, ``set_epoch`` every epoch): forward, loss, backward,
  ``opt.step()``, ``opt.zero_grad()``, and the running loss and accuracy accumulated on the
  device (a float64 sum of batch losses times batch sizes, an int64 count of correct
  predictions); at each epoch's end (and the run's) one ``all_reduce`` of the sums over the
  ranks, read into Python and formatted into a log line (to a null stream), then reset.
- ``raw``: the same loop computing nothing else: no metric, no log, no agreement on stops
  (the "computes nothing" comparison).
- ``fit``: ``Estimator(net, ..., device="cpu").fit(DataLoader(shuffle=True), batches=steps)``
  with the handlers ``fit`` adds by itself except the progress bar (``StoppingHandler``,
  ``GradientUpdateHandler``, ``MetricHandler`` over Loss and Accuracy, ``LoggingHandler`` once
  per epoch, its lines formatted into a null stream). It shards the data with its resumable
  distributed sampler and wraps the net in DDP itself.

Each timed run builds its net (same initial weights), optimizer and DDP wrapper afresh; the
configurations alternate, the first of each round rotating, after one untimed warm-up round. A
run starts after a barrier; its time is the slower rank's. The ratios are medians over rounds of
(fit / baseline in the same round): against ``raw+metrics`` first, then against ``raw``.

With a library that agrees on stops asynchronously (``estimator/_stopping/agreement.py``) two more
configurations run, as diagnostics: ``fit-every-step`` sets ``Estimator.agree_every = 1`` (the
ranks exchange their stop flags after every step, as ``fit`` did before the exchange went to
every 16 steps on gloo), the same run's A/B of what the period saves per step; ``fit-unagreed``
skips the agreement altogether (unsafe in real use, where ranks could then stop at different
steps; nothing asks to stop here), which shows what the remaining exchanges still cost. Run the
script from an older checkout for the "before".

``--invariant`` adds ``fit-elastic`` (the data laid out in global steps, as
``CheckpointHandler(elastic=True)`` lays it out: one reseed of every generator per micro-batch)
and ``fit-invariant`` (``Estimator(world_size_invariant=True)``: each micro-batch's gradient
alone, no DDP synchronisation, the canonical tree's exchange after the backward) and reports
``fit-invariant / fit`` (against the default fit, the issue's figure) and ``fit-invariant /
fit-elastic`` (what the reduction adds to an elastic fit), the median of per-round ratios, and
the bytes each rank sent per step against a ring all-reduce's ``2 (W - 1)/W`` times the gradient.

``--calibrate US`` adds ``raw+cpu``: the raw loop with ``US`` microseconds of busy CPU work per
step on each rank (a spin on ``time.perf_counter``), to read how much wall time a microsecond of
per-step CPU costs on this machine. Where the two processes and gloo's threads have no spare core
it costs more than a microsecond; ``fit``'s own per-step work (handlers, metrics) is amplified
alike.

Usage::

    python benchmarks/ddp_overhead.py                      # 2000 steps, 7 rounds
    python benchmarks/ddp_overhead.py --hidden 1024 --json
    python benchmarks/ddp_overhead.py --calibrate 50       # + the raw loop with 50 µs of CPU per step
    python benchmarks/ddp_overhead.py --invariant --no-ab  # + world_size_invariant=True against fit
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import statistics
import sys
import time
from typing import Any, Optional

import torch
from torch import nn

import _common as common  # noqa: I001 - puts the checkout on sys.path first

from estimatorch import distributed  # noqa: E402


class _NullStream(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)

    def writable(self) -> bool:
        return True


_NULL = _NullStream()


def _net(hidden: int) -> nn.Module:
    torch.manual_seed(common.SEED)
    return nn.Sequential(nn.Linear(common.IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, common.CLASSES))


class _RunningMetrics:
    """What ``fit``'s default set computes, written by hand: the running loss (a float64 sum of
    batch losses times batch sizes) and accuracy (an int64 count of correct predictions), kept on
    the device, reduced over the ranks in one ``all_reduce`` and read at an epoch's end."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.count = 0
        self.logged = 0  # epoch-end reads, for the tests

    def update(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        self.loss_sum += loss.detach().double() * y.shape[0]
        self.correct += (out.detach().argmax(dim=1) == y).sum()
        self.count += y.shape[0]

    def end_epoch(self, epoch: int) -> None:
        import torch.distributed as dist

        totals = torch.stack([self.loss_sum, self.correct.double(),
                              torch.tensor(float(self.count), dtype=torch.float64, device=self.loss_sum.device)])
        dist.all_reduce(totals)
        loss_sum, correct, count = totals.tolist()
        print(f"epoch {epoch}: loss {loss_sum / count:.4f} accuracy {correct / count:.4f}", file=_NULL)
        self.loss_sum.zero_()
        self.correct.zero_()
        self.count = 0
        self.logged += 1


def _raw(steps: int, dataset: Any, hidden: int, cpu_s: float = 0.0, metrics: bool = False) -> int:
    """The hand-written DDP loop; with ``metrics`` it does ``fit``'s job (``_RunningMetrics``).
    Returns the number of epoch-end reads of the metrics (0 without them)."""
    from torch.utils.data import DataLoader, DistributedSampler

    ddp = nn.parallel.DistributedDataParallel(_net(hidden))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=common.LR)
    loss_fn = nn.CrossEntropyLoss()
    sampler = DistributedSampler(dataset, shuffle=True, seed=common.SEED)
    loader = DataLoader(dataset, batch_size=common.BATCH_SIZE, sampler=sampler)
    running = _RunningMetrics(torch.device("cpu")) if metrics else None
    done, epoch = 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            out = ddp(x)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if running is not None:
                running.update(loss, out, y)
            if cpu_s:  # --calibrate: busy CPU work of a known length, as a handler would add
                end = time.perf_counter() + cpu_s
                while time.perf_counter() < end:
                    pass
            done += 1
            if done >= steps:
                break
        if running is not None:
            running.end_epoch(epoch)
        epoch += 1
    return running.logged if running is not None else 0


def _fit(steps: int, dataset: Any, hidden: int, agree_every: Optional[int] = None, layout: str = "default") -> int:
    """``fit``; ``layout``: ``"elastic"`` (global steps) or ``"invariant"`` (world_size_invariant).
    Returns the bytes this rank sent in the invariant reduction (0 otherwise)."""
    from estimatorch import Estimator, GradientUpdateHandler

    net = _net(hidden)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=common.LR),
                    device="cpu", seed=common.SEED,  # as the raw loops, also where a GPU exists
                    **({"world_size_invariant": True} if layout == "invariant" else {}))
    if agree_every is not None:
        est.agree_every = agree_every
    update = GradientUpdateHandler()
    handlers = [update] + ([_elastic_layout()] if layout == "elastic" else [])
    with contextlib.redirect_stdout(_NULL):
        est.fit(common.make_loader(dataset), batches=steps, event_handlers=handlers)
    reduction = getattr(update, "reduction", None)
    return reduction.bytes_sent if reduction is not None else 0


def _elastic_layout() -> Any:
    """A handler that only asks for the elastic layout (``CheckpointHandler(elastic=True)``'s,
    without its files)."""
    from estimatorch.event_handlers import TrainBegin
    from estimatorch.events import Handler

    class ElasticLayout(Handler, TrainBegin):
        @property
        def elastic_checkpoints(self) -> bool:
            return True

    return ElasticLayout()


def _fit_unagreed(steps: int, dataset: Any, hidden: int) -> None:
    """``fit`` without any agreement on stops (a diagnostic: what the exchanges cost)."""
    _with_agreement(lambda self, step, requested, identical, code: (requested or identical, code),
                    steps, dataset, hidden)


def _with_agreement(after_batch: Any, steps: int, dataset: Any, hidden: int) -> None:
    from estimatorch.estimator._stopping.agreement import StopAgreement

    asynchronous = StopAgreement.after_batch
    StopAgreement.after_batch = after_batch  # type: ignore[method-assign]
    try:
        _fit(steps, dataset, hidden)
    finally:
        StopAgreement.after_batch = asynchronous  # type: ignore[method-assign]


#: the baselines ``fit`` is divided by, the one doing the same job first
BASELINES = ("raw+metrics", "raw")


def _worker(settings: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from estimatorch.estimator._setup import handlers as fit_setup

    torch.set_num_threads(settings["threads"])
    fit_setup.interactive = lambda: False  # the default set without a progress bar
    dataset = common.make_dataset(settings["samples"])
    steps, hidden = settings["steps"], settings["hidden"]
    configs = {"raw+metrics": lambda: _raw(steps, dataset, hidden, metrics=True),
               "raw": lambda: _raw(steps, dataset, hidden),
               "fit": lambda: _fit(steps, dataset, hidden)}
    try:
        import estimatorch.estimator._stopping.agreement  # noqa: F401 - only in versions that have it
    except ImportError:
        pass
    else:
        if settings["ab"]:
            configs["fit-every-step"] = lambda: _fit(steps, dataset, hidden, agree_every=1)
            configs["fit-unagreed"] = lambda: _fit_unagreed(steps, dataset, hidden)
    if settings["calibrate"]:
        configs["raw+cpu"] = lambda: _raw(steps, dataset, hidden, settings["calibrate"] * 1e-6)
    if settings["invariant"]:
        configs["fit-elastic"] = lambda: _fit(steps, dataset, hidden, layout="elastic")
        configs["fit-invariant"] = lambda: _fit(steps, dataset, hidden, layout="invariant")
    names = list(configs)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    metric_reads: list[int] = []
    sent: list[int] = []
    for round_ in range(settings["repeats"] + 1):  # round 0 warms up
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            done = configs[name]()
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if round_:
                times[name].append(elapsed)
                cpu[name].append(cpu_elapsed)
                if name == "raw+metrics":
                    metric_reads.append(done)
                if name == "fit-invariant":
                    sent.append(done)
    return {"rank": distributed.get_rank(), "times": times, "cpu": cpu, "metric_reads": metric_reads,
            "machine": common.machine_info(), "invariant_bytes": sent}


def _against(fit: list[float], baseline: list[float], steps: int) -> dict[str, Any]:
    """fit against one baseline, from the slower rank's time of each round."""
    paired = [f / b for f, b in zip(fit, baseline)]
    return {
        "ratio": statistics.median(paired),
        "ratio_of_medians": statistics.median(fit) / statistics.median(baseline),
        "ratio_of_fastest": min(fit) / min(baseline),
        "paired": paired,
        "added_us_per_step": statistics.median([f - b for f, b in zip(fit, baseline)]) / steps * 1e6,
    }


def _invariant(per_run: dict[str, list[float]], ranks: list[dict[str, Any]], steps: int, hidden: int) -> dict[str, Any]:
    """``fit-invariant`` against ``fit`` and ``fit-elastic``, and its bytes per rank and step
    against a ring all-reduce of the same gradient."""
    params = sum(p.numel() for p in _net(hidden).parameters())
    world = len(ranks)
    ring = 2 * (world - 1) / world * params * 4
    per_step = [max(b) / steps for b in zip(*(r["invariant_bytes"] for r in ranks))]
    cpu = {name: [max(r["cpu"][name][i] for r in ranks) for i in range(len(per_run[name]))]
           for name in ("fit", "fit-elastic", "fit-invariant")}
    return {"against_fit": _against(per_run["fit-invariant"], per_run["fit"], steps),
            "cpu_against_fit": _against(cpu["fit-invariant"], cpu["fit"], steps),
            "cpu_us_per_step": {name: statistics.median(v) / steps * 1e6 for name, v in cpu.items()},
            "against_elastic": _against(per_run["fit-invariant"], per_run["fit-elastic"], steps),
            "elastic_against_fit": _against(per_run["fit-elastic"], per_run["fit"], steps),
            "bytes_per_step": statistics.median(per_step), "ring_bytes_per_step": ring,
            "gradient_floats": params}


def measure(steps: int, repeats: int, samples: int, hidden: int, threads: int, ab: bool,
            calibrate: float = 0.0, invariant: bool = False) -> dict[str, Any]:
    """Returns the figures; ``against`` holds ``fit``'s ratios to each of :data:`BASELINES`, in
    that order, and ``ratio`` the first's (``fit`` / the same-job loop); with ``invariant``,
    ``invariant`` holds ``fit-invariant``'s ratios and bytes."""
    settings = dict(steps=steps, repeats=repeats, samples=samples, hidden=hidden, threads=threads, ab=ab,
                    calibrate=calibrate, invariant=invariant)
    ranks = distributed.spawn(_worker, 2, settings, backend="gloo")
    names = list(ranks[0]["times"])
    per_run = {name: [max(r["times"][name][i] for r in ranks) for i in range(repeats)] for name in names}
    us = {name: [t / steps * 1e6 for t in values] for name, values in per_run.items()}
    against = {base: _against(per_run["fit"], per_run[base], steps) for base in BASELINES}
    if "fit-every-step" in per_run:
        out_ab = statistics.median([b - f for b, f in zip(per_run["fit-every-step"], per_run["fit"])]) / steps * 1e6
    else:
        out_ab = None
    if calibrate:
        cal_added = _against(per_run["raw+cpu"], per_run["raw"], steps)["added_us_per_step"]
        calibration = {"cpu_us_per_step": calibrate, "added_us_per_step": cal_added,
                       "wall_per_cpu": cal_added / calibrate}
    else:
        calibration = None
    return {
        "settings": settings,
        "machine": ranks[0]["machine"],
        "us_per_step": {name: common.summary(values) for name, values in us.items()},
        "ratio": against[BASELINES[0]]["ratio"],
        "against": against,
        "metric_reads_per_run": [r["metric_reads"] for r in ranks],
        "every_step_minus_fit_us_per_step": out_ab,
        "calibration": calibration,
        "invariant": _invariant(per_run, ranks, steps, hidden) if invariant else None,
    }


def table(out: dict[str, Any]) -> str:
    rows = []
    bases = {base: out["us_per_step"][base]["median"] for base in BASELINES}
    for name, s in out["us_per_step"].items():
        rows.append([name, f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}",
                     *(f"{s['median'] / bases[base]:.3f}" for base in BASELINES)])
    lines = [common.format_table(["config", "µs/step median", "min", "max", *(f"vs {b}" for b in BASELINES)], rows),
             ""]
    for base in BASELINES:
        a = out["against"][base]
        lines.append(f"fit / {base}, median of per-round ratios: {a['ratio']:.3f}  "
                     f"(of medians {a['ratio_of_medians']:.3f}, of fastest runs {a['ratio_of_fastest']:.3f}); "
                     f"fit - {base}: {a['added_us_per_step']:.1f} µs/step")
    if out["every_step_minus_fit_us_per_step"] is not None:
        lines.append("fit-every-step - fit, median of per-round differences: "
                     f"{out['every_step_minus_fit_us_per_step']:.1f} µs/step")
    inv = out.get("invariant")
    if inv is not None:
        lines.append(f"fit-invariant / fit, median of per-round ratios: {inv['against_fit']['ratio']:.3f} "
                     f"({inv['against_fit']['added_us_per_step']:.1f} µs/step); fit-invariant / fit-elastic: "
                     f"{inv['against_elastic']['ratio']:.3f}; fit-elastic / fit: {inv['elastic_against_fit']['ratio']:.3f}")
        lines.append(f"process CPU time (every thread, the busier rank): fit-invariant / fit "
                     f"{inv['cpu_against_fit']['ratio']:.3f} ({inv['cpu_against_fit']['added_us_per_step']:.1f} µs/step; "
                     + ", ".join(f"{k} {v:.0f}" for k, v in inv["cpu_us_per_step"].items()) + " µs/step)")
        lines.append(f"fit-invariant: {inv['bytes_per_step']:.0f} bytes sent per rank and step; a ring all-reduce of the "
                     f"{inv['gradient_floats']} floats: {inv['ring_bytes_per_step']:.0f}")
    cal = out["calibration"]
    if cal is not None:
        lines.append(f"raw+cpu - raw: {cal['added_us_per_step']:.1f} µs/step of wall time for "
                     f"{cal['cpu_us_per_step']:g} µs of CPU per step ({cal['wall_per_cpu']:.2f} per µs)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per timed run (default 2000)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--samples", type=int, default=12800, help="dataset size: 200 batches per rank per epoch")
    parser.add_argument("--hidden", type=int, default=common.HIDDEN, help="hidden width (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--no-ab", action="store_true", help="skip the fit-every-step and fit-unagreed diagnostics")
    parser.add_argument("--calibrate", type=float, default=0.0, metavar="US",
                        help="add raw+cpu: the raw loop with US µs of busy CPU per step (default: off)")
    parser.add_argument("--invariant", action="store_true",
                        help="add fit-elastic and fit-invariant (world_size_invariant=True) against fit")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "samples", "hidden", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive int, got {getattr(args, name)}")
    if not (math.isfinite(args.calibrate) and args.calibrate >= 0):
        parser.error(f"--calibrate must be a non-negative number of µs, got {args.calibrate}")
    out = measure(args.steps, args.repeats, args.samples, args.hidden, args.threads, not args.no_ab, args.calibrate,
                  args.invariant)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        common.print_machine(out["machine"])
        print(f"2 processes (gloo, every loop on the CPU), {args.steps} steps per run, {args.repeats} rounds, batch "
              f"{common.BATCH_SIZE} per rank, hidden {args.hidden}, {args.threads} torch thread(s) each")
        print(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
