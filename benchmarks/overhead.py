"""Per-step overhead of ``Estimator.fit`` against a hand-written PyTorch loop.

Every configuration trains the same MLP 32-64-10 (CrossEntropyLoss, SGD lr 0.01, batch 32, seed
0) for ``--steps`` optimizer steps on the same in-memory data, in one process with one torch
thread. Only the ``fit`` call (or the raw loop) is timed, with ``time.perf_counter``, after one
untimed warm-up run of every configuration. Configurations run round-robin for ``--repeats``
rounds (the starting configuration rotates each round) so that drift on a shared machine affects
all of them alike.

Configurations:

- ``raw``: ``for x, y in loader: pred = net(x); loss = loss_fn(pred, y); loss.backward();
  opt.step(); opt.zero_grad()``, re-iterating the loader until ``--steps`` steps.
- ``bare``: the least ``fit`` can run with. ``fit`` adds a default ``MetricHandler`` and
  ``LoggingHandler`` unless one of each type is passed, so bare passes ``StoppingHandler()``,
  ``GradientUpdateHandler()``, ``MetricHandler([])`` (updates nothing) and
  ``LoggingHandler(metrics=[])`` (shows no metric). Neither of the last two subscribes to
  ``batch_end`` (nothing to update, a line per epoch only): a step calls the optimizer step
  and the stopping check, nothing else.
- ``default``: what ``fit`` adds by itself (``StoppingHandler``, ``GradientUpdateHandler``,
  ``MetricHandler`` over the default train metrics ``Loss`` and ``Accuracy``, ``LoggingHandler``
  with its default interval) plus ``ProgressBarHandler(file=<null stream>)``, passed explicitly
  because ``fit`` adds the bar only when stderr is a terminal.
- ``default+tb+ckpt``: default + ``TensorBoardHandler`` (epoch-level scalars) +
  ``CheckpointHandler(epoch_period=1)``, both in a fresh temporary directory per run.
- ``default+50noop``: default + 50 handlers whose ``batch_end`` does nothing.
- ``default-nobar`` (only with ``--configs``): the default set as ``fit`` adds it without a
  terminal, i.e. no progress bar.
- ``default+speed`` (only with ``--configs``): default + ``SpeedMonitor()`` (the step-time
  split, FLOPs counted in the first batch).
- ``nobar-elastic`` and ``nobar-invariant`` (only with ``--configs``): ``default-nobar`` with
  the data laid out in global steps (as ``CheckpointHandler(elastic=True)`` lays it out, without
  its files), and ``Estimator(world_size_invariant=True)`` (in one process: the elastic layout,
  each micro-batch's gradient folded into the tree and finished, the step's items divided).
- ``default+ema`` and ``default-nobar+ema`` (only with ``--configs``): default (without the bar)
  + ``EMAHandler()`` (one ``_foreach_lerp_`` of the parameters into their average after every
  step).
- ``default+mlflow`` and ``default+wandb`` (only with ``--configs``; they need the ``mlflow``
  and ``wandb`` extras): default + ``MLflowHandler`` (a sqlite store in a temporary directory,
  created before the clock starts, as a store is once) or ``WandbHandler`` (offline, silent),
  both with ``log_interval=50``. Their time includes opening the run at the first step's end
  (a new MLflow run and its parameters; ``wandb.init``), spread over ``--steps`` steps.

Log lines go to a null stream during the timed call (they are still formatted). The ratio column
is the median time per step divided by the raw loop's median; ``paired`` is the median over
rounds of (this configuration's time / the raw loop's time in the same round); ``min ratio`` is
this configuration's fastest run over the raw loop's fastest. Two tables are
printed: wall-clock (``time.perf_counter``, the reference) and process CPU time
(``time.process_time``, all threads; it leaves out time the process spent descheduled, so it is
steadier on a machine shared with other jobs).

Usage::

    python benchmarks/overhead.py                    # table
    python benchmarks/overhead.py --repeats 15 --json
    python benchmarks/overhead.py --device cuda      # on a machine with a GPU
    python benchmarks/overhead.py --profile default  # cProfile of one fit, by tottime
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Optional

import torch
from torch import nn

import _common as common

from estimatorch import Estimator  # noqa: E402  (after _common puts the checkout on the path)
from estimatorch import event_handlers as eh  # noqa: E402
from estimatorch.events import Handler  # noqa: E402

REQUIRED = ["raw", "bare", "default", "default+tb+ckpt", "default+50noop"]
EXTRA = ["default-nobar", "default+mlflow", "default+wandb", "default+speed", "default+ema", "default-nobar+ema",
         "nobar-elastic", "nobar-invariant"]


class NullStream(io.TextIOBase):
    """A text stream that drops everything (progress bars and log lines still get formatted)."""

    def write(self, text: str) -> int:
        return len(text)

    def writable(self) -> bool:
        return True


class NoOpHandler(eh.BatchEnd):
    """A user handler that listens to ``batch_end`` and does nothing."""

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        return None


class ElasticLayout(Handler, eh.TrainBegin):
    """Asks for the elastic layout only (``CheckpointHandler(elastic=True)``'s, without its files)."""

    @property
    def elastic_checkpoints(self) -> bool:
        return True


class Setup:
    """One configuration's run: everything built before the clock starts, then ``run()``."""

    def __init__(self, config: str, steps: int, dataset: Any, device: torch.device):
        self.config = config
        self.steps = steps
        self.device = device
        self.tmpdirs: list[str] = []
        pin = device.type == "cuda"
        self.loader = common.make_loader(dataset, pin_memory=pin)
        self.net = common.make_net()
        self.optimizer = common.make_optimizer(self.net.to(device))
        self.loss = nn.CrossEntropyLoss()
        if config == "raw":
            return
        invariant = {"world_size_invariant": True} if config == "nobar-invariant" else {}
        self.estimator = Estimator(self.net, self.loss, optimizer=self.optimizer, device=device,
                                   seed=common.SEED, **invariant)
        self.handlers = self._handlers(config)

    def _tmpdir(self) -> str:
        path = tempfile.mkdtemp(prefix="estimatorch-bench-")
        self.tmpdirs.append(path)
        return path

    def _handlers(self, config: str) -> list[Any]:
        if config == "bare":
            return [eh.StoppingHandler(), eh.GradientUpdateHandler(), eh.MetricHandler([]),
                    eh.LoggingHandler(metrics=[])]
        if config in ("default-nobar", "nobar-invariant"):
            return []
        if config == "nobar-elastic":
            return [ElasticLayout()]
        if config == "default-nobar+ema":  # (a bar's redraws follow wall time, which valgrind stretches)
            return [eh.EMAHandler()]
        handlers: list[Any] = [eh.ProgressBarHandler(file=NullStream())]
        if config == "default":
            return handlers
        if config == "default+tb+ckpt":
            return handlers + [eh.TensorBoardHandler(self._tmpdir()),
                               eh.CheckpointHandler(self._tmpdir(), epoch_period=1)]
        if config == "default+50noop":
            return handlers + [NoOpHandler() for _ in range(50)]
        if config == "default+speed":
            return handlers + [eh.SpeedMonitor()]
        if config == "default+ema":
            return handlers + [eh.EMAHandler()]
        if config == "default+mlflow":
            uri = f"sqlite:///{os.path.join(self._tmpdir(), 'runs.db')}"
            handler = eh.MLflowHandler(uri, experiment_name="bench", log_interval=50, artifact_location=self._tmpdir())
            handler._mlflow.MlflowClient(uri).search_experiments(max_results=1)  # the store, created once
            return handlers + [handler]
        if config == "default+wandb":
            for key, value in {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_CODE": "true",
                               "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true"}.items():
                os.environ.setdefault(key, value)
            return handlers + [eh.WandbHandler(project="bench", log_interval=50, mode="offline", dir=self._tmpdir())]
        raise ValueError(f"unknown configuration {config!r}")

    def run(self, synchronize: bool = True) -> tuple[float, float]:
        """Train; return the wall-clock and the process CPU seconds of the fit call (or of the
        raw loop). On a GPU the clock starts and stops after ``torch.cuda.synchronize()``
        (unless ``synchronize=False``)."""
        cuda = self.device.type == "cuda" and synchronize
        with contextlib.redirect_stdout(NullStream()):
            if cuda:
                torch.cuda.synchronize(self.device)
            cpu_start, start = time.process_time(), time.perf_counter()
            if self.config == "raw":
                common.raw_loop(self.net, self.loader, self.optimizer, self.loss, self.steps, self.device)
            else:
                self.estimator.fit(self.loader, batches=self.steps, event_handlers=self.handlers)
            if cuda:
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - start, time.process_time() - cpu_start

    def close(self) -> None:
        for path in self.tmpdirs:
            shutil.rmtree(path, ignore_errors=True)


def timed_run(config: str, steps: int, dataset: Any, device: torch.device) -> tuple[float, float]:
    setup = Setup(config, steps, dataset, device)
    try:
        gc.collect()
        return setup.run()
    finally:
        setup.close()


def count_syncs(config: str, steps: int, dataset: Any, device: torch.device) -> int:
    """Host-device synchronisations torch reports during one run (``set_sync_debug_mode``)."""
    setup = Setup(config, steps, dataset, device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                setup.run(synchronize=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    finally:
        setup.close()


def measure(configs: list[str], steps: int, repeats: int, dataset: Any,
            device: torch.device) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``(wall seconds, CPU seconds)`` per configuration, one value per round."""
    warmup = min(steps, 200)
    for config in configs:  # imports, allocator, tqdm/tensorboard first-use costs
        timed_run(config, warmup, dataset, device)
    wall: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            w, c = timed_run(config, steps, dataset, device)
            wall[config].append(w)
            cpu[config].append(c)
    return wall, cpu


def results(times: dict[str, list[float]], steps: int) -> dict[str, dict[str, Any]]:
    raw = times["raw"]
    raw_median = common.summary(raw)["median"]
    out: dict[str, dict[str, Any]] = {}
    for config, values in times.items():
        us = [v / steps * 1e6 for v in values]
        paired = [v / r for v, r in zip(values, raw)]
        out[config] = {
            "us_per_step": common.summary(us),
            "ratio": common.summary(values)["median"] / raw_median,
            "min_ratio": min(values) / min(raw),
            "paired_ratio": common.summary(paired),
            "runs_us_per_step": [round(u, 2) for u in us],
        }
    return out


def table(res: dict[str, dict[str, Any]]) -> str:
    raw_us = res["raw"]["us_per_step"]["median"]
    rows = []
    for config, r in res.items():
        s = r["us_per_step"]
        rows.append([config, f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}",
                     f"{s['median'] - raw_us:+.1f}", f"{r['ratio']:.3f}",
                     f"{r['paired_ratio']['median']:.3f}", f"{r['min_ratio']:.3f}"])
    return common.format_table(
        ["config", "median µs/step", "min", "max", "overhead µs/step", "ratio", "paired ratio", "min ratio"],
        rows)


def profile(config: str, steps: int, dataset: Any, device: torch.device, top: int) -> None:
    setup = Setup(config, steps, dataset, device)
    try:
        profiler = cProfile.Profile()
        profiler.enable()
        setup.run()
        profiler.disable()
    finally:
        setup.close()
    stats = pstats.Stats(profiler, stream=sys.stdout).stats  # type: ignore[attr-defined]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def rows(items: list[Any]) -> list[list[Any]]:
        out = []
        for (filename, line, func), (cc, nc, tt, ct, _) in items:
            where = filename.split("site-packages/")[-1]
            if where.startswith(root + os.sep):
                where = os.path.relpath(where, root)
            out.append([f"{where}:{line}({func})", nc, f"{tt / steps * 1e6:.2f}", f"{ct / steps * 1e6:.2f}"])
        return out

    header = ["function", "calls", "tottime µs/step", "cumtime µs/step"]
    print(f"cProfile of {config!r}, {steps} steps (µs/step = tottime / steps; cProfile inflates "
          "python-level calls):")
    print(common.format_table(header, rows(sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top])))
    own = [kv for kv in stats.items() if f"{os.sep}estimatorch{os.sep}" in kv[0][0]
           and kv[0][2] not in ("fit", "_fit", "_loop", "_train")]
    print("\nestimatorch's own functions by cumulative time (the loop and fit itself left out):")
    print(common.format_table(header, rows(sorted(own, key=lambda kv: kv[1][3], reverse=True)[:top])))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per run (default 2000)")
    parser.add_argument("--repeats", type=int, default=7, help="round-robin rounds (default 7)")
    parser.add_argument("--samples", type=int, default=6400,
                        help="dataset size; 6400 = 200 batches per epoch (default)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--configs", default=",".join(REQUIRED),
                        help=f"comma-separated, from {REQUIRED + EXTRA}; raw is always included")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--profile", metavar="CONFIG", help="cProfile one run of CONFIG instead")
    parser.add_argument("--top", type=int, default=30, help="rows of --profile output (default 30)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available on this machine; nothing to measure.")
        return 0
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dataset = common.make_dataset(args.samples)

    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in REQUIRED + EXTRA:
            parser.error(f"unknown configuration {c!r}; choose from {REQUIRED + EXTRA}")
    if "raw" not in configs:
        configs.insert(0, "raw")
    notes = []
    if not hasattr(eh, "TensorBoardHandler") and "default+tb+ckpt" in configs:
        configs.remove("default+tb+ckpt")
        notes.append("default+tb+ckpt skipped: estimatorch.event_handlers has no TensorBoardHandler")

    info = common.machine_info(device)
    if args.profile:
        common.print_machine(info)
        timed_run(args.profile, min(args.steps, 200), dataset, device)  # warm-up
        profile(args.profile, args.steps, dataset, device, args.top)
        return 0

    wall, cpu = measure(configs, args.steps, args.repeats, dataset, device)
    res, res_cpu = results(wall, args.steps), results(cpu, args.steps)
    syncs = {c: count_syncs(c, args.steps, dataset, device) for c in configs} if device.type == "cuda" else None
    settings = {"steps": args.steps, "repeats": args.repeats, "samples": args.samples,
                "batches_per_epoch": -(-args.samples // common.BATCH_SIZE), "batch_size": common.BATCH_SIZE,
                "device": str(device), "threads": args.threads, "lr": common.LR, "seed": common.SEED}
    if args.json:
        print(json.dumps({"machine": info, "settings": settings, "results": res, "results_cpu_time": res_cpu,
                          "sync_warnings": syncs,
                          "notes": notes}, indent=2))
        return 0
    common.print_machine(info)
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print("wall-clock (time.perf_counter), the reference figure:")
    print(table(res))
    print("process CPU time (time.process_time): less sensitive to other jobs on a shared machine:")
    print(table(res_cpu))
    if syncs is not None:
        epochs = -(-args.steps // settings["batches_per_epoch"])
        print(f"host-device synchronisations torch reported in one run of {args.steps} steps ({epochs} epochs; "
              "per-epoch metric reads and progress-bar redraws are expected, per-step ones are not):")
        print(common.format_table(["config", "syncs per run", "per step"],
                                  [[c, n, f"{n / args.steps:.3f}"] for c, n in syncs.items()]))
    for note in notes:
        print("note: " + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
