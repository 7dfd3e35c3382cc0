"""Where the per-step overhead of ``fit`` goes, piece by piece (a diagnostic, not a benchmark).

``overhead.py`` says how much slower ``fit`` is than the raw loop; this says why. Same model,
data and settings as ``overhead.py``. One instrumented ``fit`` of the chosen configuration and
one instrumented raw loop run side by side; inside them every piece of a step is timed in place
(``time.perf_counter`` around the call), so the figures include the cache misses a real step
pays, which a tight micro-benchmark loop hides:

- data: each ``next()`` of the batch iterator (the ``DataLoader`` that ``fit`` rebuilds around a
  resumable sampler, versus the user's ``DataLoader`` in the raw loop);
- ``to_device``, ``Estimator.fire`` (the forward/backward events), ``BatchProcessor.fit_batch``
  without the model, loss and backward it calls;
- every event method of every handler (``GradientUpdateHandler.batch_end`` without the
  ``optimizer.step()`` / ``zero_grad()`` that the raw loop runs too);
- the loop's own remainder (``estimator/_loop.py``'s ``run_loop`` minus everything above).

Timing a call in place costs something itself: a ``BatchEnd`` handler that does nothing is timed
the same way, and its figure (the cost of one timed, empty handler call) is subtracted from
every timed call. The rows are therefore estimates, good to about a microsecond; their sum is
compared with the measured overhead. It patches ``estimatorch`` internals (module-level
``batch_mover``, ``call_net``, ``open_train_stream``) for the run, so it may need an update when
they move.

Usage::

    python benchmarks/step_breakdown.py                   # the default handler set
    python benchmarks/step_breakdown.py --config bare --steps 4000
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

import _common as common
import overhead

from estimatorch.estimator import _loop as loop_module  # noqa: E402
from estimatorch.estimator import _start as start_module  # noqa: E402
from estimatorch.estimator import batch_processor as bp_module  # noqa: E402
from estimatorch.estimator import estimator as est_module  # noqa: E402
from estimatorch.event_handlers import EVENTS, BatchEnd  # noqa: E402

clock = time.perf_counter


class Timings:
    """Seconds and calls per key."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        total, calls = self.total, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                total[key] += clock() - start
                calls[key] += 1

        return timed

    def iterate(self, key: str, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                self.total[key] += clock() - start
                self.calls[key] += 1
            yield item


class Calibration(BatchEnd):
    """Does nothing: its timed cost is the cost of timing a call in place."""

    priority = -10**9

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    if not hasattr(obj, name):
        yield
        return
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def instrumented_fit(config: str, steps: int, dataset: Any) -> tuple[Timings, float]:
    """One fit of ``config`` with every piece timed; returns the timings and the fit's seconds."""
    setup = overhead.Setup(config, steps, dataset, torch.device("cpu"))
    est = setup.estimator
    if config.startswith("default"):  # the defaults fit adds, passed explicitly so they can be timed
        from estimatorch.event_handlers import (GradientUpdateHandler, LoggingHandler, MetricHandler,
                                                StoppingHandler)
        setup.handlers = [StoppingHandler(), GradientUpdateHandler(), MetricHandler(est.train_metrics),
                          *setup.handlers, LoggingHandler()]
    setup.handlers.append(Calibration())
    t = Timings()
    for handler in setup.handlers:
        for event, mixin in EVENTS.items():
            if isinstance(handler, mixin):
                key = f"handler {type(handler).__name__}.{event}"
                setattr(handler, event, t.wrap(key, getattr(handler, event)))
    opt = est.optimizer
    opt.step = t.wrap("compute: optimizer.step", opt.step)  # type: ignore[method-assign]
    opt.zero_grad = t.wrap("compute: optimizer.zero_grad", opt.zero_grad)  # type: ignore[method-assign]
    est.loss = t.wrap("compute: loss", est.loss)
    est.backward = t.wrap("compute: backward", est.backward)  # type: ignore[method-assign]
    est.fire = t.wrap("glue: Estimator.fire (forward/backward events)", est.fire)  # type: ignore[method-assign]
    proc = est.batch_processor
    proc.fit_batch = t.wrap("fit_batch", proc.fit_batch)  # type: ignore[method-assign]

    def make_stream(*args: Any, **kwargs: Any) -> Any:
        stream = real_make_stream(*args, **kwargs)
        epoch_iter = stream.epoch_iter
        stream.epoch_iter = lambda epoch, start: t.iterate("data: next(batch)", iter(epoch_iter(epoch, start)))
        return stream

    real_make_stream = start_module.open_train_stream
    with patched(start_module, "open_train_stream", make_stream), \
            patched(est_module, "run_loop", t.wrap("loop", est_module.run_loop)), \
            patched(loop_module, "batch_mover",  # the loop's move to the device (to_device off CUDA)
                    lambda device, mover=loop_module.batch_mover: t.wrap("glue: to_device", mover(device))), \
            patched(bp_module, "call_net", t.wrap("compute: forward (call_net)", bp_module.call_net)):
        try:
            gc.collect()
            wall = setup.run()[0]
        finally:
            setup.close()
    return t, wall


def instrumented_raw(steps: int, dataset: Any) -> tuple[Timings, float]:
    """The raw loop with the same pieces timed the same way."""
    setup = overhead.Setup("raw", steps, dataset, torch.device("cpu"))
    t = Timings()
    net, loss_fn, opt = setup.net, setup.loss, setup.optimizer
    forward = t.wrap("compute: forward (call_net)", net)
    loss_of = t.wrap("compute: loss", loss_fn)
    backward = t.wrap("compute: backward", lambda loss: loss.backward())
    step = t.wrap("compute: optimizer.step", opt.step)
    zero = t.wrap("compute: optimizer.zero_grad", opt.zero_grad)
    calibration = t.wrap("calibration", lambda *a, **k: None)
    gc.collect()
    start = clock()
    done = 0
    while done < steps:
        for x, y in t.iterate("data: next(batch)", iter(setup.loader)):
            loss = loss_of(forward(x), y)
            backward(loss)
            step()
            zero()
            calibration(None, batch=None, pred=None, label=None, loss=None)
            done += 1
            if done >= steps:
                break
    wall = clock() - start
    setup.close()
    return t, wall


def per_step(t: Timings, key: str, unit: float, steps: int) -> float:
    """Seconds per step of ``key`` with ``unit`` (the in-place timing cost) removed per call."""
    return (t.total.get(key, 0.0) - t.calls.get(key, 0) * unit) / steps


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="default", help=f"one of {overhead.REQUIRED[1:] + overhead.EXTRA}")
    parser.add_argument("--steps", type=int, default=4000, help="steps per run (default 4000)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each, medians reported (default 5)")
    parser.add_argument("--samples", type=int, default=6400, help="dataset size (default 6400)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dataset = common.make_dataset(args.samples)
    steps = args.steps
    common.print_machine(common.machine_info())

    instrumented_fit(args.config, 200, dataset)  # warm-up
    instrumented_raw(200, dataset)
    fits, raws = [], []
    for _ in range(args.repeats):  # interleaved
        fits.append(instrumented_fit(args.config, steps, dataset))
        raws.append(instrumented_raw(steps, dataset))

    def rows_of(runs: list[tuple[Timings, float]], calibration_key: str) -> dict[str, float]:
        """Median over runs of every piece, in seconds per step, timing cost removed."""
        out: dict[str, list[float]] = defaultdict(list)
        for t, wall in runs:
            unit = t.total[calibration_key] / t.calls[calibration_key]
            out["(wall, timed run)"].append(wall / steps)
            out["(timing cost per call)"].append(unit)
            pieces = {k: per_step(t, k, unit, steps) for k in t.total if k != calibration_key}
            grad = "handler GradientUpdateHandler.batch_end"
            opt_keys = ("compute: optimizer.step", "compute: optimizer.zero_grad")
            if grad in pieces:  # its optimizer calls are shown as compute
                pieces[grad] -= sum(t.total[k] for k in opt_keys) / steps
            if "fit_batch" in pieces:
                inner = ("compute: forward (call_net)", "compute: loss", "compute: backward",
                         "glue: Estimator.fire (forward/backward events)")
                pieces["glue: fit_batch without model/loss/backward/fire"] = pieces.pop("fit_batch") - sum(
                    t.total.get(k, 0.0) for k in inner) / steps
            # What the loop does between the timed calls (the part of the timing cost that falls
            # outside the timed intervals lands here too).
            if "loop" in t.total:
                top = [k for k in t.total if k in ("data: next(batch)", "glue: to_device", "fit_batch")
                       or k.startswith("handler ") and k.endswith(("batch_end", "batch_begin", "epoch_begin", "epoch_end"))]
                pieces.pop("loop")
                pieces["glue: Estimator._loop remainder"] = (t.total["loop"] - sum(t.total[k] for k in top)) / steps
            else:
                top = [k for k in t.total]
                pieces["glue: raw loop remainder"] = (wall - sum(t.total[k] for k in top)) / steps
            for k, v in pieces.items():
                out[k].append(v)
        return {k: statistics.median(v) for k, v in out.items()}

    fit = rows_of(fits, "handler Calibration.batch_end")
    raw = rows_of(raws, "calibration")
    raw["glue: Estimator._loop remainder"] = raw.pop("glue: raw loop remainder")
    keys = [k for k in sorted(set(fit) | set(raw)) if not k.startswith("(")]
    rows = []
    for k in sorted(keys, key=lambda k: -(fit.get(k, 0) - raw.get(k, 0))):
        rows.append([k, f"{raw[k] * 1e6:.2f}" if k in raw else "", f"{fit.get(k, 0) * 1e6:.2f}",
                     f"{(fit.get(k, 0) - raw.get(k, 0)) * 1e6:+.2f}"])
    fit_sum = sum(fit[k] for k in keys if k in fit)
    raw_sum = sum(raw[k] for k in keys if k in raw)
    rows.append(["sum of the pieces", f"{raw_sum * 1e6:.2f}", f"{fit_sum * 1e6:.2f}", f"{(fit_sum - raw_sum) * 1e6:+.2f}"])
    print(f"\nconfig {args.config!r}: {steps} steps, {args.repeats} interleaved runs of each, medians, µs per step")
    print(f"timing cost per timed call (subtracted): fit {fit['(timing cost per call)'] * 1e6:.2f} µs, "
          f"raw {raw['(timing cost per call)'] * 1e6:.2f} µs")
    print(common.format_table(["piece", "raw loop", "fit", "fit - raw"], rows))
    print("(instrumented runs are slower than plain ones; overhead.py gives the true totals)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
