"""What the benchmarks share: the model, the data, the raw loop, machine facts and statistics.

Every benchmark trains the same thing so that its figures compare: an MLP 32-64-10 (Linear,
ReLU, Linear), ``CrossEntropyLoss``, ``SGD(lr=0.01)``, batches of 32 drawn by a shuffling
``DataLoader`` from a ``TensorDataset`` of random inputs and labels, all seeded from :data:`SEED`.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Let ``python benchmarks/<name>.py`` import the checkout's estimatorch without installing it.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

SEED = 0
IN_FEATURES, HIDDEN, CLASSES = 32, 64, 10
BATCH_SIZE = 32
LR = 0.01


def make_net(seed: int = SEED) -> nn.Module:
    """The benchmark model, with the same initial weights for every configuration."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def make_optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=LR)


def make_dataset(samples: int, seed: int = SEED) -> TensorDataset:
    """Random inputs and labels, held in memory (so data loading costs the same everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, IN_FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    return TensorDataset(inputs, labels)


def make_loader(dataset: Any, seed: int = SEED, pin_memory: bool = False) -> DataLoader:
    """``DataLoader(batch_size=32, shuffle=True)`` with its own seeded generator."""
    return DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, pin_memory=pin_memory,
                      generator=torch.Generator().manual_seed(seed))


def raw_loop(net: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
             loss_fn: nn.Module, steps: int, device: torch.device) -> None:
    """The hand-written loop every configuration is compared with; re-iterates the loader as
    needed until ``steps`` optimizer steps are done."""
    cuda = device.type == "cuda"
    done = 0
    while done < steps:
        for x, y in loader:
            if cuda:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = net(x)
            loss = loss_fn(pred, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done >= steps:
                return


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: Optional[torch.device] = None) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        info["load_average_1min"] = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        pass
    try:
        import estimatorch

        info["estimatorch"] = estimatorch.__version__
    except (ImportError, AttributeError):
        pass
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def print_machine(info: dict[str, Any]) -> None:
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))


def summary(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (also readable as plain text)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for row in cells:
        lines.append("| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                       for i, (c, w) in enumerate(zip(row, widths))) + " |")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
