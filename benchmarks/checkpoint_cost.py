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

With ``--stall`` it measures instead, in one run, what a checkpoint costs the training loop with
``CheckpointHandler(async_save=False)`` (``sync``), ``async_save="thread"`` (the writer thread,
which pickles and writes holding the GIL the steps need) and ``async_save=True`` (``process``:
the writer process, the training process only copies into shared memory; ``--modes`` picks
some), for the 50.4M-parameter model
of 12 ``Linear(2048, 2048)`` with Adam (576 MiB of state; ``--small``: 2 ``Linear(256, 256)``, for
the tests): each mode is a ``fit`` of ``--steps`` steps (batches of 8) in a fresh process,
checkpointing every ``--batch-period`` batches, and reports

- the memcpy floor: one copy of the model's and the optimizer's tensors into preallocated CPU
  buffers (median of 5), the least an asynchronous save can hold a step for;
- the stall per save: how long the save holds the training thread at the boundary (the
  handler's save call), and the step time of steps with a save minus that of clean steps (steps
  with no save and no write in flight; the first step, a warm-up, is left out);
- the total cost per save: that stall plus the extra time of the steps that ran while its write
  was in flight (each such step's time minus the clean steps' median; a background write shares
  the cores, the memory bandwidth and the GIL with them), for every save whose write was durable
  before the last timed step began; synchronously the total is the stall;
- the time until durable: from the save's start until the file, the pointer and retention are
  done (written, fsynced, renamed);
- the saves that found the previous write still running (and waited for it), and the whole
  fit's time from its first step until the last file is durable (a write in the background
  shares the cores and the memory bandwidth with the steps that run meanwhile);
- peak memory: the process's peak resident set, and its rise above the resident set at the first
  save (the staging copy of ``async_save`` shows there), with the staging buffers' size.

With an object-store URL for ``--dir`` (``s3://bucket/prefix``, reached with
``--storage-options`` JSON, fsspec's filesystem arguments) it times instead, for the 50.4M-parameter
state of ``--stall`` (one Adam step): estimatorch's save (``build_payload`` + ``atomic_save`` to
the URL, and ``atomic_save`` of a built payload) and ``checkpoint.load`` of the URL, against a
plain s3fs put of ``torch.save``'s bytes of the same state and a plain get + ``torch.load``.

Usage::

    python benchmarks/checkpoint_cost.py
    python benchmarks/checkpoint_cost.py --dir s3://bucket/bench --storage-options '{"key": ..., ...}'
    python benchmarks/checkpoint_cost.py --repeats 9 --json
    python benchmarks/checkpoint_cost.py --stall [--small] [--steps 24 --batch-period 6] [--json]
    python benchmarks/checkpoint_cost.py --stall --modes thread,process   # the two writers only
    python benchmarks/checkpoint_cost.py --stall --device cuda     # the model and Adam on the GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

import _common as common

from estimatorch import CheckpointHandler, Estimator, checkpoint  # noqa: E402
from estimatorch import event_handlers as eh  # noqa: E402

WIDTH = 1024
LOADS = ("estimatorch checkpoint.load", "raw torch.load(weights_only=True)")
MODELS = {"small (1.05M params)": 1, "medium (25.2M params)": 24}  # Linear(1024, 1024) layers


def make_model(layers: int, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(common.SEED)
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def fit_one_step(layers: int, at_train_end: Callable[[Estimator], Any], width: int = WIDTH) -> Any:
    """One Adam step of fit (so model, optimizer and handlers hold state), then
    ``at_train_end(est)`` while the fit is still active: a payload is built through the
    estimator's seam, which only a fit in progress has. Returns what it returned."""
    net = make_model(layers, width)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
                    device="cpu", seed=common.SEED)
    data = [(torch.randn(8, width), torch.randn(8, width))]
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


# -- --dir s3://...: an object store, against plain s3fs put/get of the same bytes -------------
OBJECT_LOADS = ("estimatorch checkpoint.load", "raw s3fs get + torch.load")


def measure_object_store(url: str, options: dict[str, Any], repeats: int) -> dict[str, Any]:
    import fsspec  # optional: only this mode needs it

    checkpoint.configure_store(url, options)
    fs, root = fsspec.core.url_to_fs(url, **options)
    layers, width = STALL_MODELS["50.4M params (12 x Linear(2048, 2048))"]

    def run(est: Estimator) -> dict[str, Any]:
        def raw_bytes() -> bytes:
            buffer = io.BytesIO()
            torch.save({"model": est.net.state_dict(), "optimizer": est.optimizer.state_dict()}, buffer)
            return buffer.getvalue()

        payload = checkpoint.build_payload(est)
        times = time_round_robin({
            "estimatorch build_payload + atomic_save":
                lambda: checkpoint.atomic_save(checkpoint.build_payload(est), f"{url}/estimatorch.pt"),
            "estimatorch atomic_save": lambda: checkpoint.atomic_save(payload, f"{url}/estimatorch-prebuilt.pt"),
            "raw torch.save + s3fs put": lambda: fs.pipe_file(f"{root}/raw.pt", raw_bytes()),
            "estimatorch checkpoint.load": lambda: checkpoint.load(f"{url}/estimatorch.pt"),
            "raw s3fs get + torch.load": lambda: torch.load(io.BytesIO(fs.cat_file(f"{root}/raw.pt")),
                                                            map_location="cpu", weights_only=True),
        }, repeats)
        return {"parameters": sum(p.numel() for p in est.net.parameters()), "seconds": times,
                "bytes": {"estimatorch": fs.size(f"{root}/estimatorch.pt"), "raw": fs.size(f"{root}/raw.pt")}}

    try:
        return fit_one_step(layers, run, width)
    finally:
        fs.rm(root, recursive=True)


def print_object_store(res: dict[str, Any], url: str) -> None:
    secs = res["seconds"]
    raw_save, raw_load = (statistics.median(secs[k]) for k in ("raw torch.save + s3fs put",
                                                                "raw s3fs get + torch.load"))
    rows = [[what, f"{statistics.median(v) * 1e3:.0f}", f"{min(v) * 1e3:.0f}", f"{max(v) * 1e3:.0f}",
             f"{statistics.median(v) / (raw_load if what in OBJECT_LOADS else raw_save):.2f}"]
            for what, v in secs.items()]
    size = res["bytes"]
    print(f"\n{res['parameters'] / 1e6:.1f}M parameters with Adam to {url}: estimatorch object "
          f"{common.human_bytes(size['estimatorch'])}, raw object {common.human_bytes(size['raw'])}")
    print(common.format_table(["operation", "median ms", "min", "max", "x raw put/get"], rows))


# -- --stall: the step stall of a save, synchronous and async_save=True -------------------------
#: --stall's modes: CheckpointHandler's async_save for each.
ASYNC_SAVE: dict[str, Any] = {"sync": False, "thread": "thread", "process": True}
STALL_MODELS = {"50.4M params (12 x Linear(2048, 2048))": (12, 2048), "small (2 x Linear(256, 256))": (2, 256)}


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="utf-8") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memcpy_floor(net: nn.Module, optimizer: torch.optim.Optimizer, repeats: int = 5) -> list[float]:
    """Seconds to copy the model's and the optimizer's tensors into preallocated CPU buffers
    (pinned, and waited for, from CUDA)."""
    tensors = [t for t in net.state_dict().values()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    cuda = any(t.is_cuda for t in tensors)
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in tensors]
    times = []
    for _ in range(repeats + 1):  # the first touches the buffers' pages
        start = time.perf_counter()
        for buf, t in zip(buffers, tensors):
            buf.copy_(t, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def stall_child(mode: str, layers: int, width: int, steps: int, period: int, directory: str,
                device: str = "cpu") -> dict[str, Any]:
    """One fit with checkpoints every ``period`` batches, ``async_save`` by ``mode`` (``sync``,
    ``thread`` or ``process``); its figures.
    On CUDA the batches are on the device already and each step's clock waits for the device
    (``torch.cuda.synchronize`` at ``batch_begin``), so that a step's time is the device's."""
    torch.manual_seed(common.SEED)
    net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.Adam(net.parameters(), lr=1e-4), device=device,
                    seed=common.SEED)
    data = [(torch.randn(8, width).to(est.device), torch.randn(8, width).to(est.device)) for _ in range(steps)]
    sync = torch.cuda.synchronize if est.device.type == "cuda" else (lambda: None)
    handler = CheckpointHandler(directory, batch_period=period, epoch_period=None, max_checkpoints=2,
                                async_save=ASYNC_SAVE[mode])
    begins: list[float] = []
    saves: list[list[float]] = []  # [start, returned]
    durable: list[float] = []
    rss_at_first_save: list[int] = []
    writes = handler._writes  # the object that writes a save's files (on rank 0)
    real_save, real_write = handler._save, writes._write

    def timed_save(estimator: Any, *args: Any, **kwargs: Any) -> None:
        if not rss_at_first_save:
            rss_at_first_save.append(_rss_bytes())
        start = time.perf_counter()
        real_save(estimator, *args, **kwargs)
        saves.append([start, time.perf_counter()])

    def timed_write(*args: Any, **kwargs: Any) -> None:
        real_write(*args, **kwargs)
        durable.append(time.perf_counter())

    handler._save, writes._write = timed_save, timed_write  # type: ignore[method-assign]
    clock = eh.LambdaHandler(batch_begin=lambda e, **_: (sync(), begins.append(time.perf_counter())),
                             priority=-float("inf"))
    with contextlib.redirect_stdout(io.StringIO()):
        est.fit(data, batches=steps, event_handlers=[eh.StoppingHandler(), handler, clock])
    fit_s = time.perf_counter() - begins[0]  # the last write durable included (train_end waits for it)
    floor = memcpy_floor(est.net, est.optimizer)
    # a step's time: from its batch_begin to the next one's; a save runs at the end of steps period, 2 period...
    step_times = [b - a for a, b in zip(begins, begins[1:])]
    with_save = [t for i, t in enumerate(step_times, start=1) if i % period == 0]
    without = [t for i, t in enumerate(step_times, start=1) if i % period]
    kinds, costs = save_costs(begins, saves, durable, period)
    writer = handler._writer
    state_bytes = sum(t.numel() * t.element_size() for t in est.net.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in est.optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in net.parameters()),
        "state_bytes": state_bytes,
        "saves": len(saves),
        "fit_s": fit_s,
        "memcpy_floor_s": floor,
        "save_call_s": [end - start for start, end in saves],
        "step_with_save_s": with_save,
        "step_without_save_s": without,
        "step_first_s": step_times[0],
        "step_in_flight_s": [t for t, kind in zip(step_times, kinds) if kind == "in_flight"],
        "step_clean_s": [t for t, kind in zip(step_times, kinds) if kind == "clean"],
        "save_costs": costs,
        "until_durable_s": [end - start for (start, _), end in zip(saves, durable)],
        "waits": writer.waits if writer is not None else 0,
        "waited_s": writer.waited_seconds if writer is not None else 0.0,
        "staging_bytes": writer.staging.nbytes if writer is not None else 0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_at_first_save_bytes": rss_at_first_save[0] if rss_at_first_save else 0,
    }


def save_costs(begins: list[float], saves: list[list[float]], durable: list[float],
               period: int) -> tuple[list[str], list[dict[str, Any]]]:
    """What each save cost the steps: the kind of every timed step, and one entry per save whose
    costs were all timed.

    Step ``s`` (1-based) runs from ``begins[s - 1]`` to ``begins[s]``; a save runs at the end of
    steps ``period``, ``2 period``..., its write in flight from the save call's return until
    durable (never, synchronously: the call returns after it). A step is ``"first"`` (step 1, a
    warm-up), ``"save"``, ``"in_flight"`` (it overlaps a write in flight) or ``"clean"``. A save's
    entry: ``stall_s`` (its step minus the clean steps' median), ``following_s`` (the same
    difference summed over the in-flight steps of its write), their count, and ``total_s``. Saves
    whose write was still running when the last timed step began, and every save when no step
    was clean, have no entry.
    """
    steps = len(begins) - 1
    windows = [(returned, done) for (_, returned), done in zip(saves, durable)]
    kinds: list[str] = []
    owner: list[int] = []  # the save whose write a step overlaps, -1 for none
    for s in range(1, steps + 1):
        start, end = begins[s - 1], begins[s]
        overlaps = [k for k, (returned, done) in enumerate(windows) if start < done and end > returned]
        owner.append(overlaps[0] if overlaps else -1)
        kinds.append("first" if s == 1 else "save" if s % period == 0 else "in_flight" if overlaps else "clean")
    clean = [b - a for a, b, kind in zip(begins, begins[1:], kinds) if kind == "clean"]
    if not clean:
        return kinds, []
    base = statistics.median(clean)
    costs = []
    for k, (_, done) in enumerate(windows):
        s = (k + 1) * period
        if s > steps or done > begins[-1]:  # the save's step or the end of its write not timed
            continue
        following = [begins[j] - begins[j - 1] - base for j in range(1, steps + 1)
                     if kinds[j - 1] == "in_flight" and owner[j - 1] == k]
        stall = begins[s] - begins[s - 1] - base
        costs.append({"step": s, "stall_s": stall, "following_steps": len(following),
                      "following_s": sum(following), "total_s": stall + sum(following)})
    return kinds, costs


def measure_stall(args: argparse.Namespace) -> dict[str, Any]:
    """Each mode in a fresh process (so that its peak memory is its own), synchronous first."""
    name = list(STALL_MODELS)[1 if args.small else 0]
    layers, width = STALL_MODELS[name]
    results = {}
    for mode in args.modes:
        directory = tempfile.mkdtemp(prefix="estimatorch-stall-", dir=args.dir)
        try:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--stall-child", mode, "--dir", directory,
                                   "--layers", str(layers), "--width", str(width), "--steps", str(args.steps),
                                   "--batch-period", str(args.batch_period), "--threads", str(args.threads),
                                   "--device", args.device],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"the {mode} run failed:\n{done.stderr[-3000:]}")
            results[mode] = json.loads(done.stdout)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return {"model": name, "results": results}


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}" if values else "-"


def print_stall(out: dict[str, Any], args: argparse.Namespace) -> None:
    results = out["results"]
    floor = statistics.median([t for res in results.values() for t in res["memcpy_floor_s"]])
    first = next(iter(results.values()))
    print(f"\n{out['model']}: {first['parameters'] / 1e6:.1f}M parameters, state (model + Adam) "
          f"{common.human_bytes(first['state_bytes'])}; {args.steps} steps, a checkpoint every {args.batch_period}; "
          f"memcpy floor {floor * 1e3:.1f} ms (median)")
    rows = []
    for mode, res in results.items():
        costs = res["save_costs"]
        cost = {key: [c[key] for c in costs] for key in ("stall_s", "following_steps", "following_s", "total_s")}
        total = f"{statistics.median(cost['total_s']) / floor:.1f}x" if costs else "-"
        rows.append([f"{mode} (async_save={ASYNC_SAVE[mode]!r})", _ms(res["save_call_s"]),
                     f"{statistics.median(res['save_call_s']) / floor:.1f}x", _ms(cost["stall_s"]),
                     f"{statistics.median(cost['following_steps']):g}" if costs else "-", _ms(cost["following_s"]),
                     _ms(cost["total_s"]), total, f"{len(costs)}/{res['saves']}", _ms(res["step_clean_s"]),
                     _ms(res["until_durable_s"]), f"{res['waits']}/{res['saves']}", f"{res['fit_s']:.2f}",
                     common.human_bytes(res["peak_rss_bytes"]),
                     common.human_bytes(res["peak_rss_bytes"] - res["rss_at_first_save_bytes"]),
                     common.human_bytes(res["staging_bytes"])])
    print(common.format_table(["mode", "save holds the step (ms)", "x memcpy floor", "save step - clean step (ms)",
                               "steps during the write", "their extra (ms)", "total per save (ms)",
                               "total x memcpy floor", "saves totalled", "clean step (ms)", "until durable (ms)",
                               "saves that waited", "fit (s)", "peak RSS", "peak rise after 1st save", "staging"],
                              rows))
    print("medians over saves; a save's total is its step's extra time plus that of the steps run while its "
          "write was in flight, each against the median clean step (no save, no write in flight)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--dir", default=None, help="where files are written (default: a temp dir); an "
                        "object-store URL (s3://bucket/prefix) times saves and loads there against plain s3fs")
    parser.add_argument("--storage-options", default="{}", help="with a URL --dir: fsspec's filesystem "
                        "arguments as JSON (endpoint, credentials)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--stall", action="store_true",
                        help="measure the step stall per save, synchronous and async_save=True, instead")
    parser.add_argument("--small", action="store_true", help="--stall with a small model (for the tests)")
    parser.add_argument("--steps", type=int, default=None, help="--stall: steps per fit (default 24, --small 12)")
    parser.add_argument("--batch-period", type=int, default=None,
                        help="--stall: a checkpoint every this many steps (default 6, --small 4)")
    parser.add_argument("--device", default="cpu", help="--stall: where the model trains (default cpu; e.g. cuda)")
    parser.add_argument("--modes", default="sync,thread,process",
                        help="--stall: the comma-separated modes to run, of sync, thread, process (default all)")
    parser.add_argument("--stall-child", choices=list(ASYNC_SAVE), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    for name in ("steps", "batch_period"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive int, got {getattr(args, name)}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device must name a torch device, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: CUDA is not available on this machine")
    modes = [mode.strip() for mode in args.modes.split(",")]
    if not modes or any(mode not in ASYNC_SAVE for mode in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes must name distinct modes of {', '.join(ASYNC_SAVE)}, got {args.modes!r}")
    args.modes = modes
    args.steps = args.steps or (12 if args.small else 24)
    args.batch_period = args.batch_period or (4 if args.small else 6)
    if args.stall_child:
        print(json.dumps(stall_child(args.stall_child, args.layers, args.width, args.steps, args.batch_period,
                                     args.dir, args.device)))
        return 0
    if args.stall:
        stall = measure_stall(args)
        info = common.machine_info(device)
        if args.json:
            print(json.dumps({"machine": info, "settings": {"steps": args.steps, "batch_period": args.batch_period,
                                                            "threads": args.threads, "device": args.device,
                                                            "modes": args.modes},
                              **stall}, indent=2))
        else:
            common.print_machine(info)
            print_stall(stall, args)
        return 0

    if args.dir is not None and checkpoint.is_url(args.dir):
        result = measure_object_store(args.dir.rstrip("/"), json.loads(args.storage_options), args.repeats)
        info = common.machine_info()
        if args.json:
            print(json.dumps({"machine": info, "settings": {"repeats": args.repeats, "dir": args.dir},
                              "results": result}, indent=2))
        else:
            common.print_machine(info)
            print_object_store(result, args.dir)
        return 0
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
