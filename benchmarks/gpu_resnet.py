"""One GPU: ``Estimator.fit`` against a hand-written loop on a real model, as a ratio.

A ResNet-18 (the CIFAR variant: 3x3 stem, no max-pool; written out here so that the benchmark
needs nothing beyond torch) trains on synthetic 3x32x32 images, 10 classes, batch 256, SGD with
momentum, in ``bf16-mixed`` precision (``torch.autocast(dtype=torch.bfloat16)``; no grad scaler)
or ``32``. Both loops see the same batches in the same order:

- ``--data list`` (default): a list of batches already on the GPU, so that the figure is the
  library's per-step cost and nothing else; ``fit`` indexes a list directly.
- ``--data loader``: a ``DataLoader`` over a CPU ``TensorDataset`` (``--workers`` workers,
  pinned memory, persistent workers); the batches are copied to the GPU non-blocking by both.

Configurations, timed round-robin for ``--repeats`` rounds after one untimed warm-up each (the
first configuration rotates every round); each run is ``--steps`` optimizer steps, timed with
``time.perf_counter`` between two ``torch.cuda.synchronize()`` calls:

- ``raw``: ``with autocast: loss = loss_fn(net(x), y)``; ``loss.backward(); opt.step();
  opt.zero_grad(set_to_none=True)``.
- ``fit-default``: ``fit`` with the default handler set it adds without a terminal (stopping,
  gradient update, metrics ``train_loss``/``train_accuracy`` on the device, logging per epoch).
- ``fit-default+bar``: the same plus ``ProgressBarHandler`` writing to a null stream.
- ``fit-graphs`` (with ``--cuda-graphs``, which needs ``--optimizer adamw``): ``fit-default`` with
  ``Estimator(..., cuda_graphs=True)``, the step captured in one CUDA graph after a 3-step
  warm-up and replayed.

``--model mlp`` trains an MLP 256-1024-1024-10 on 256 features instead of the ResNet: a step of
little GPU work, bound by the host's kernel launches, where a captured step pays off (target:
``fit-graphs`` at least 3x faster than ``raw``). ``--optimizer adamw`` uses ``AdamW(lr=1e-3)``
(its default foreach implementation in ``raw`` and ``fit-default``) instead of SGD with momentum.
With ``--data loader`` every configuration copies each batch from pinned memory, ``fit`` on a
side stream that the step waits for on the device (the copy of batch k+1 overlaps step k).

It also counts the synchronising CUDA calls of one ``fit-default`` run after its first batch,
with ``torch.cuda.set_sync_debug_mode("warn")`` (the figure should be 0 between epoch ends: the
step path never waits for the GPU).

Usage (on a machine with a CUDA device)::

    python benchmarks/gpu_resnet.py                       # bf16-mixed, list data
    python benchmarks/gpu_resnet.py --precision 32 --data loader --json
    python benchmarks/gpu_resnet.py --model mlp --optimizer adamw --precision 32 --cuda-graphs
    python benchmarks/gpu_resnet.py --device cpu --steps 2 --repeats 1 --batch-size 4 --batches 2  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
import warnings
from typing import Any, Optional

import torch
from torch import nn

import _common as common

from estimatorch import Estimator  # noqa: E402  (after _common puts the checkout on the path)
from estimatorch import event_handlers as eh  # noqa: E402

CONFIGS = ["raw", "fit-default", "fit-default+bar"]
SEED = 0


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes)]
    return nn.Sequential(*layers)


class NullStream(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)

    def writable(self) -> bool:
        return True


def mlp(classes: int = 10) -> nn.Module:
    """MLP 256-1024-1024-10: little GPU work per step, many kernel launches."""
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, classes))


def make_data(args: argparse.Namespace, device: torch.device) -> Any:
    g = torch.Generator().manual_seed(SEED)
    n = args.batch_size * args.batches
    x = torch.randn(n, 256, generator=g) if args.model == "mlp" else torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    if args.data == "list":
        return [(xb.to(device), yb.to(device)) for xb, yb in zip(x.split(args.batch_size), y.split(args.batch_size))]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                       shuffle=False, num_workers=args.workers, pin_memory=True,
                                       persistent_workers=args.workers > 0)


def make_model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    net = mlp().to(device) if args.model == "mlp" else resnet18().to(device, memory_format=torch.channels_last)
    if args.optimizer == "adamw":
        return net, torch.optim.AdamW(net.parameters(), lr=1e-3)
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def raw_loop(data: Any, steps: int, args: argparse.Namespace, device: torch.device) -> None:
    precision = args.precision
    net, opt = make_model(args, device)
    loss_fn = nn.CrossEntropyLoss()
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
    net.train()
    done = 0
    while done < steps:
        for x, y in data:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with amp:
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done += 1
            if done == steps:
                return


def fit_run(data: Any, steps: int, args: argparse.Namespace, device: torch.device, bar: bool,
            extra: Optional[list[Any]] = None, cuda_graphs: bool = False) -> Estimator:
    net, opt = make_model(args, device)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, device=device, precision=args.precision, seed=SEED,
                    cuda_graphs=cuda_graphs)
    handlers: list[Any] = list(extra or [])
    if bar:
        handlers.append(eh.ProgressBarHandler(file=NullStream()))
    with contextlib.redirect_stdout(NullStream()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est.fit(data, batches=steps, event_handlers=handlers)
    return est


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(config: str, data: Any, args: argparse.Namespace, device: torch.device) -> float:
    _synchronize(device)
    start = time.perf_counter()
    if config == "raw":
        raw_loop(data, args.steps, args, device)
    else:
        fit_run(data, args.steps, args, device, bar=config.endswith("+bar"), cuda_graphs=config == "fit-graphs")
    _synchronize(device)
    return time.perf_counter() - start


class _CountSyncs(eh.BatchBegin, eh.BatchEnd, eh.EpochEnd, eh.TrainEnd):
    """Counts the synchronising calls torch warns about between the first batch_begin and the
    last batch_end of each epoch (epoch ends legitimately read values: logs, History)."""

    priority = -float("inf")

    def __init__(self) -> None:
        self.catcher = warnings.catch_warnings(record=True)
        self.records: Optional[list[Any]] = None

    def batch_begin(self, est: Any, **kw: Any) -> None:
        if self.records is None:
            self.records = self.catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def batch_end(self, est: Any, **kw: Any) -> None:
        pass

    def epoch_end(self, est: Any, **kw: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def train_end(self, est: Any, **kw: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")
        if self.records is not None:
            self.catcher.__exit__(None, None, None)


def count_syncs(data: Any, args: argparse.Namespace, device: torch.device) -> int:
    """Synchronising calls during one epoch of ``fit-default`` (``args.batches`` steps)."""
    counter = _CountSyncs()
    fit_run(data, args.batches, args, device, bar=False, extra=[counter])
    records = counter.records or []
    # torch also warns that the debug mode itself is a prototype: count only the calls it caught
    return sum("called a synchronizing cuda operation" in str(r.message).lower() for r in records)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per timed run (default 300)")
    parser.add_argument("--repeats", type=int, default=5, help="round-robin rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=256, help="default 256")
    parser.add_argument("--batches", type=int, default=50, help="distinct batches of data (default 50)")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32"])
    parser.add_argument("--data", default="list", choices=["list", "loader"])
    parser.add_argument("--workers", type=int, default=4, help="loader workers for --data loader (default 4)")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to check that the script runs")
    parser.add_argument("--model", default="resnet18", choices=["resnet18", "mlp"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="add fit-graphs: fit with cuda_graphs=True (needs --optimizer adamw and a CUDA device)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.cuda_graphs and args.optimizer != "adamw":
        parser.error("--cuda-graphs needs --optimizer adamw (SGD has no capturable mode), "
                     f"got --optimizer {args.optimizer}")
    if args.cuda_graphs and args.device != "cuda":
        parser.error(f"--cuda-graphs needs --device cuda, got --device {args.device}")
    configs = CONFIGS + ["fit-graphs"] * args.cuda_graphs
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_resnet.py: no CUDA device here (--device cpu only checks that the script runs)", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    data = make_data(args, device)
    for config in configs:  # warm-up: kernels chosen, allocator primed, workers started
        timed(config, data, args, device)
    times: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            times[config].append(timed(config, data, args, device) / args.steps)
    raw = statistics.median(times["raw"])
    paired = {c: statistics.median(t / b for t, b in zip(times[c], times["raw"])) for c in configs}
    result = {
        "machine": common.machine_info(device),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "ms_per_step": {c: 1000 * statistics.median(v) for c, v in times.items()},
        "ratio_median": {c: statistics.median(times[c]) / raw for c in configs},
        "ratio_paired": paired,
        "syncs_in_one_epoch_of_fit_default": count_syncs(data, args, device) if device.type == "cuda" else None,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    common.print_machine(result["machine"])
    model = "MLP 256-1024-1024-10" if args.model == "mlp" else "ResNet-18, 3x32x32"
    print(f"{model}, {args.optimizer}, batch {args.batch_size}, {args.precision}, data {args.data}, {device.type}, "
          f"{args.steps} steps x {args.repeats} rounds")
    rows = [[c, f"{result['ms_per_step'][c]:.3f}", f"{result['ratio_median'][c]:.3f}", f"{paired[c]:.3f}"]
            for c in configs]
    print(common.format_table(["config", "ms/step (median)", "ratio", "paired ratio"], rows))
    print(f"synchronising CUDA calls in one epoch of fit-default ({args.batches} steps, after its "
          f"first batch_begin): {result['syncs_in_one_epoch_of_fit_default']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
