"""Instructions per step of ``fit`` versus the raw loop, counted by valgrind (deterministic).

Wall-clock ratios on a shared or virtual machine move by several percent from run to run, more
than the 2-5 % budgets they are checked against. Instruction counts do not: the same code counts
the same instructions whatever else the machine does, so a change of 1 % shows. They are a proxy
(a cache miss costs more than an instruction, and the ratio of instructions is not the ratio of
time), good for comparing versions of the library and for finding what a step executes.

The script re-runs itself under ``valgrind --tool=callgrind --dump-before=getppid``; the child
calls ``os.getppid()`` around each measured segment, so callgrind writes one count per segment.
Segments, each prepared (model, loader, estimator, handlers built) outside the counted part:

- every configuration of ``overhead.py`` for ``--steps`` steps and for 1 step; per-step
  instructions are ``(I(steps) - I(1)) / (steps - 1)``, the fixed cost of one ``fit`` call is
  ``I(1)`` minus one step, and the ratio to the raw loop is projected to ``--project`` steps per
  ``fit`` (2000, as in ``overhead.py``) from both;
- single pieces, each called ``--steps`` times outside any loop: ``to_device``, the four
  forward/backward ``fire`` calls, each default handler's ``batch_end``, a no-op handler, and the
  train metrics' updates.

Valgrind slows python about 50 times: the default run takes about 10 minutes. Under valgrind the
progress bar, which redraws every 0.5 s of wall time, redraws about 50 times more often per step
than in a real run, so its count is overstated (compare ``default`` and ``default-nobar``).

Every thread is counted by default, also the ones that wake on wall time (TensorBoard's event
writer, tqdm's monitor): under valgrind they wake about 50 times more often per step, and on a
loaded machine more still, so a count moves by 10-20 k instructions per step between runs of the
same code. ``--main-thread`` counts the training thread alone (callgrind's
``--separate-threads=yes``): the same code then counts the same, to compare two versions.

Usage::

    python benchmarks/instructions.py                  # needs valgrind on PATH
    python benchmarks/instructions.py --steps 300 --no-pieces --json
    python benchmarks/instructions.py --steps 100 --configs default-nobar --no-pieces --main-thread
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import types
from typing import Any, Callable, Optional

import torch

import _common as common
import overhead

from estimatorch._batches import to_device  # noqa: E402
from estimatorch.event_handlers import (GradientUpdateHandler, LoggingHandler,  # noqa: E402
                                        MetricHandler, ProgressBarHandler, StoppingHandler)

CONFIGS = overhead.REQUIRED + overhead.EXTRA


# -- the child, under valgrind ------------------------------------------------------------------
def _fit_segment(config: str, steps: int, dataset: Any) -> Callable[[], Any]:
    setup = overhead.Setup(config, steps, dataset, torch.device("cpu"))

    def go() -> None:
        setup.run()
        setup.close()

    return go


def _pieces(steps: int, dataset: Any) -> list[tuple[str, Callable[[int], Callable[[], None]]]]:
    setup = overhead.Setup("default", 1, dataset, torch.device("cpu"))
    est, device = setup.estimator, torch.device("cpu")
    batch = next(iter(common.make_loader(dataset)))
    label = batch[1]
    pred = setup.net(batch[0])
    loss = setup.loss(pred, label)
    stopping = StoppingHandler()
    stopping.train_begin(types.SimpleNamespace(max_epoch=None, max_batch=10**12))

    class NoStepOptimizer:
        param_groups: list = []

        def step(self) -> None:
            pass

        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    grad = GradientUpdateHandler()
    grad_est = types.SimpleNamespace(optimizer=NoStepOptimizer(), grad_scaler=None)
    logging_handler = LoggingHandler()
    log_est = types.SimpleNamespace(batch_axis=0)
    metrics = MetricHandler(est.train_metrics)
    bar = ProgressBarHandler(file=overhead.NullStream(), refresh_interval=3600.0)
    # A logger of its own: the bar reroutes the console handlers of the logger it is given.
    bar_est = types.SimpleNamespace(logger=logging.getLogger("estimatorch-benchmark-bar"), batches_per_epoch=200,
                                    max_epoch=None, max_batch=10**9, train_metrics=est.train_metrics)
    bar.train_begin(bar_est)
    noop = overhead.NoOpHandler()

    def loop(fn: Callable[[], Any]) -> Callable[[int], Callable[[], None]]:
        def make(n: int) -> Callable[[], None]:
            def go() -> None:
                for _ in range(n):
                    fn()
            return go
        return make

    return [
        ("to_device(batch) on the CPU", loop(lambda: to_device(batch, device))),
        ("4 x Estimator.fire (forward/backward events, no listener)", loop(lambda: (
            est.fire("forward_begin", batch=batch), est.fire("forward_end", batch=batch, pred=pred, loss=loss),
            est.fire("backward_begin", batch=batch, loss=loss), est.fire("backward_end", batch=batch)))),
        ("StoppingHandler.batch_end", loop(lambda: stopping.batch_end(est, batch=batch, pred=pred, label=label, loss=loss))),
        ("GradientUpdateHandler.batch_end (optimizer stubbed)", loop(lambda: grad.batch_end(grad_est, batch=batch, pred=pred, label=label, loss=loss))),
        ("LoggingHandler.batch_end", loop(lambda: logging_handler.batch_end(log_est, batch=batch, pred=pred, label=label, loss=loss))),
        ("ProgressBarHandler.batch_end (no redraw)", loop(lambda: bar.batch_end(est, batch=batch, pred=pred, label=label, loss=loss))),
        ("MetricHandler.batch_end (Loss + Accuracy)", loop(lambda: metrics.batch_end(est, batch=batch, pred=pred, label=label, loss=loss))),
        ("a no-op BatchEnd handler", loop(lambda: noop.batch_end(est, batch=batch, pred=pred, label=label, loss=loss))),
        ("(empty python loop, subtracted from the pieces)", loop(lambda: None)),
    ]


def child(steps: int, configs: list[str], pieces: bool) -> None:
    torch.set_num_threads(1)
    dataset = common.make_dataset(6400)
    segments: list[tuple[str, Callable[[], Callable[[], Any]]]] = []
    for config in configs:
        segments.append((f"{config}|{steps}", lambda c=config: _fit_segment(c, steps, dataset)))
        segments.append((f"{config}|1", lambda c=config: _fit_segment(c, 1, dataset)))
    if pieces:
        for name, make in _pieces(steps, dataset):
            segments.append((f"piece|{name}", lambda m=make: m(steps)))
    with contextlib.redirect_stdout(io.StringIO()):
        for name, prepare in segments:  # warm-up, not counted apart
            if name.startswith("piece|"):
                prepare()()
            else:
                config, n = name.split("|")
                _fit_segment(config, min(int(n), 50), dataset)()
    for name, prepare in segments:
        go = prepare()
        os.getppid()  # callgrind dumps here: the preparation
        go()
        os.getppid()  # and here: the segment
    print(json.dumps([name for name, _ in segments]))


# -- the parent -----------------------------------------------------------------------------------
def _totals(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith(("totals:", "summary:")):
                return int(line.split()[1])
    raise ValueError(f"no totals in {path}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="steps per counted fit (default 500)")
    parser.add_argument("--project", type=int, default=2000, help="steps per fit for the ratio (default 2000)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {CONFIGS}")
    parser.add_argument("--no-pieces", action="store_true", help="count only whole fits")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--main-thread", action="store_true",
                        help="count the training thread alone (threads that wake on wall time left out)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    if "raw" not in configs:
        configs.insert(0, "raw")
    for c in configs:
        if c not in CONFIGS:
            parser.error(f"unknown configuration {c!r}; choose from {CONFIGS}")
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.child:
        child(args.steps, configs, not args.no_pieces)
        return 0

    torch.set_num_threads(1)  # as in the child, for the machine line
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("valgrind is not installed (e.g. apt-get install valgrind); nothing to count.")
        return 0
    out_dir = tempfile.mkdtemp(prefix="estimatorch-callgrind-")
    try:
        cmd = [valgrind, "--tool=callgrind", "--dump-before=getppid",
               *(["--separate-threads=yes"] if args.main_thread else []),
               f"--callgrind-out-file={os.path.join(out_dir, 'out')}", sys.executable,
               os.path.abspath(__file__), "--child", "--steps", str(args.steps), "--configs", ",".join(configs)]
        if args.no_pieces:
            cmd.append("--no-pieces")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        names = json.loads(proc.stdout.strip().splitlines()[-1])
        # one file per dump, out.N; with --separate-threads one per dump and thread, out.N-TT (01: main)
        pattern = "out.*-01" if args.main_thread else "out.*"
        dumps = sorted(glob.glob(os.path.join(out_dir, pattern)),
                       key=lambda p: int(p.rsplit(".", 1)[1].split("-")[0]))
        if len(dumps) < 2 * len(names):
            print(f"expected {2 * len(names)} callgrind dumps, found {len(dumps)}", file=sys.stderr)
            return 1
        counts = {name: _totals(dumps[2 * i + 1]) for i, name in enumerate(names)}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)

    steps, project = args.steps, args.project
    fits: dict[str, dict[str, float]] = {}
    for config in configs:
        full, one = counts[f"{config}|{steps}"], counts[f"{config}|1"]
        per_step = (full - one) / (steps - 1)
        fits[config] = {"per_step": per_step, "fixed": one - per_step}
    raw = fits["raw"]
    raw_total = raw["per_step"] * project + raw["fixed"]
    rows = []
    for config, f in fits.items():
        total = f["per_step"] * project + f["fixed"]
        f["ratio_per_step"] = f["per_step"] / raw["per_step"]
        f["ratio_projected"] = total / raw_total
        rows.append([config, f"{f['per_step'] / 1e3:.1f}", f"{(f['per_step'] - raw['per_step']) / 1e3:+.1f}",
                     f"{(f['fixed'] - raw['fixed']) / 1e6:+.2f}", f"{f['ratio_per_step']:.4f}",
                     f"{f['ratio_projected']:.4f}"])
    pieces: dict[str, float] = {}
    empty_key = "piece|(empty python loop, subtracted from the pieces)"
    if empty_key in counts:
        empty = counts[empty_key] / steps
        pieces = {k.split("|", 1)[1]: counts[k] / steps - empty for k in counts
                  if k.startswith("piece|") and k != empty_key}
    info = common.machine_info()
    if args.json:
        print(json.dumps({"machine": info, "settings": {"steps": steps, "project": project},
                          "fits": fits, "pieces_instructions_per_call": pieces}, indent=2))
        return 0
    common.print_machine(info)
    threads = "the training thread" if args.main_thread else "every thread"
    print(f"instructions counted by callgrind ({threads}); fits of {steps} steps and of 1 step; ratio projected "
          f"to {project} steps per fit")
    print(common.format_table(["config", "k instr/step", "overhead k instr/step", "fixed overhead M instr/fit",
                               "ratio per step", f"ratio at {project} steps"], rows))
    if pieces:
        print("\npieces, each called alone (instructions per call, the empty loop's subtracted):")
        print(common.format_table(["piece", "k instr/call", "share of a raw step"],
                                  [[k, f"{v / 1e3:.2f}", f"{v / raw['per_step'] * 100:.2f} %"]
                                   for k, v in sorted(pieces.items(), key=lambda kv: -kv[1])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
