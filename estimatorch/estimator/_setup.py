"""What ``Estimator`` and ``fit`` set up around the loop: the metric lists, the default handler
set, the process-wide torch flags of a fit, and the signal guard with its messages."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import _console, cluster, distributed
from .._checks import warn_user
from ..event_handlers import (
    GradientUpdateHandler,
    LoggingHandler,
    LRSchedulerHandler,
    MetricHandler,
    ProgressBarHandler,
    StoppingHandler,
    ValidationHandler,
)
from ..events import declared
from ..metrics import Accuracy, Loss
from ..metrics.base import as_metric_list, metric_name
from ._interrupts import SignalGuard, install_excepthook, is_clean_stop, stop_message

__all__ = ["default_handlers", "default_optimizer", "describe_stop", "interactive", "signal_guard", "torch_flags",
           "metric_lists", "train_metric_list", "val_metric_list", "warn_default_optimizer"]

#: the optimizer an ``Estimator`` built without one uses, as its warning shows it.
DEFAULT_OPTIMIZER = "torch.optim.SGD(net.parameters(), lr=0.01)"


def default_optimizer(net: nn.Module) -> Any:
    """``Estimator(optimizer=None)``'s optimizer: SGD with lr 0.01 over ``net``'s trainable
    parameters (None without any). Built silently: an estimator only used to evaluate or
    predict never trains with it; ``fit`` warns (:func:`warn_default_optimizer`)."""
    params = [p for p in net.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.01) if params else None


def warn_default_optimizer(estimator: Any) -> None:
    """Warn at the user's ``fit`` line, once per estimator, when it trains with the default
    optimizer (still the one it was built with)."""
    default, estimator._default_optimizer = getattr(estimator, "_default_optimizer", None), None
    if default is not None and estimator.optimizer is default:
        warn_user(f"no optimizer given to Estimator: fit trains with {DEFAULT_OPTIMIZER}. Pass "
                  "Estimator(..., optimizer=...) to choose one")


def _rename(metric: Any, prefix: str) -> Any:
    name = metric_name(metric)
    if not name.startswith(prefix):
        base = name.split("_", 1)[1] if name.startswith(("train_", "val_")) else name
        metric.name = prefix + base
    return metric


def metric_lists(train_metrics: Any, val_metrics: Any, loss: Any, device: torch.device
                 ) -> tuple[list[Any], list[Any]]:
    """``Estimator``'s train and val metrics (:func:`train_metric_list`,
    :func:`val_metric_list`), their names unique, moved to ``device`` where they can be."""
    train = train_metric_list(train_metrics, loss)
    val = val_metric_list(val_metrics, train)
    names = [metric_name(m) for m in train + val]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"metric names must be unique, got {duplicated[0]!r} more than once")
    for metric in train + val:
        if callable(getattr(metric, "to", None)):
            metric.to(device)
    return train, val


def train_metric_list(train_metrics: Any, loss: Any) -> list[Any]:
    """The train metrics: those given (a ``Loss`` added first when none is), or ``Loss`` plus
    ``Accuracy`` for a classification loss; each named ``train_<name>``."""
    metrics = as_metric_list(train_metrics, "train_metrics")
    if train_metrics is None and isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
        metrics.append(Accuracy())
    if not any(isinstance(m, Loss) for m in metrics):
        metrics.insert(0, Loss())
    return [_rename(m, "train_") for m in metrics]


def val_metric_list(val_metrics: Any, train_metrics: list[Any]) -> list[Any]:
    """The val metrics: those given (a ``Loss`` added first when none is), else deep copies of
    the train metrics; each named ``val_<name>``."""
    if val_metrics is None:
        return [_rename(copy.deepcopy(m), "val_") for m in train_metrics]
    metrics = as_metric_list(val_metrics, "val_metrics")
    if not any(isinstance(m, Loss) for m in metrics):
        metrics.insert(0, Loss())
    return [_rename(m, "val_") for m in metrics]


def interactive() -> bool:
    """True in a terminal or a Jupyter kernel: where a progress bar is shown by default."""
    if _console.in_notebook():
        return True
    stream = sys.stderr
    return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


def default_handlers(estimator: Any, user: list[Any], val_data: Any) -> list[Any]:
    """The handlers ``fit`` adds: each default whose type none of ``user`` has."""
    def missing(cls: type) -> bool:
        return not any(isinstance(h, cls) for h in user)

    defaults: list[Any] = []
    if missing(StoppingHandler):
        defaults.append(StoppingHandler())
    if missing(GradientUpdateHandler):
        defaults.append(GradientUpdateHandler())
    if missing(MetricHandler):
        defaults.append(MetricHandler(estimator.train_metrics))
    if val_data is not None and missing(ValidationHandler):
        defaults.append(ValidationHandler(val_data, estimator.evaluate))
    scheduled = estimator.lr_scheduler is not None or estimator.lr_scheduler_factory is not None
    if scheduled and not any(
            isinstance(h, LRSchedulerHandler) and h.scheduler in (None, estimator.lr_scheduler) for h in user):
        # unless one of yours already steps it
        defaults.append(LRSchedulerHandler(step_on=estimator.lr_scheduler_interval))
    if missing(LoggingHandler):
        defaults.append(LoggingHandler())
    if missing(ProgressBarHandler) and interactive():
        defaults.append(ProgressBarHandler())
    return defaults


@contextlib.contextmanager
def torch_flags(deterministic: bool, cudnn_benchmark: bool, cpu: bool = False) -> Iterator[None]:
    """torch's process-wide algorithm flags for the duration of a fit, restored afterwards.

    ``deterministic``: deterministic algorithms and cuDNN, and, when the net trains on the CPU
    (``cpu``), one intra-op thread: a CPU kernel splits its work (a matrix product's sums, a
    reduction) by the thread count, which torch takes at start-up from the CPUs the process may
    run on, so the same script gives other bits where it starts with other CPUs.
    """
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    threads = torch.get_num_threads()
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        if cpu and threads != 1:
            torch.set_num_threads(1)
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def signal_guard(handlers: list[Any], logger: logging.Logger) -> SignalGuard:
    """Defers SIGINT and SIGTERM (and SLURM's requeue signal under SLURM) to a step boundary, with
    a message that fits where we are, logged on every rank. Warns (rank 0) where a launcher would lose
    the signal or a restart would fail: see ``cluster.agent_drops``, ``cluster.shared_store_restarts``."""
    # only a handler writing resumable checkpoints saves the boundary (exporters do not)
    savers = [h for h in handlers if declared(h, "checkpoint_location") is not None]

    def describe(name: str) -> str:
        rank = f"[rank {distributed.get_rank()}] " if distributed.is_distributed() else ""
        return rank + stop_message(name, notebook=_console.in_notebook(), checkpointing=bool(savers),
                                   resumes=any(declared(h, "resumes_run") for h in savers),
                                   multi=distributed.is_distributed())

    if not _console.in_notebook():  # a script ends a clean Ctrl-C stop with one line, not a traceback
        install_excepthook()
    requeue = cluster.requeue_signal()
    dropped = cluster.agent_drops(requeue)  # srun torchrun: the agent must pass the signal on
    if dropped is not None:
        logger.warning(dropped)
    shared = cluster.shared_store_restarts()  # several torchrun agents: a restart would meet the dead store
    if shared is not None:
        logger.warning(shared)
    return SignalGuard(describe, lambda message: logger.warning(message, extra={"all_ranks": True}),
                       requeue=requeue, resumes=any(declared(h, "resumes_run") for h in savers))


def describe_stop(error: BaseException, estimator: Any, handlers: list[Any]) -> BaseException:
    """Give the ``KeyboardInterrupt`` of a clean Ctrl-C stop (once ``train_end`` has saved) its
    one line: where it stopped, what was saved, how to resume; returns ``error``."""
    if not is_clean_stop(error):
        return error
    pos = estimator.position
    savers = [h for h in handlers if declared(h, "checkpoint_location") is not None]
    where = f"stopped by Ctrl-C after step {pos.step} (epoch {pos.epoch + (pos.phase != 'epoch_end')})"
    if _console.in_notebook():
        how = "fit(..., resume=True) continues from there"
    elif any(declared(h, "resumes_run") for h in savers):
        how = f"checkpoint in {declared(savers[0], 'checkpoint_location')}: run the script again to resume"
    elif savers:
        how = (f"checkpoint in {declared(savers[0], 'checkpoint_location')}: to resume, run again with "
               "CheckpointHandler(..., resume_from_checkpoint=True)")
    else:
        how = "nothing saved: add CheckpointHandler(model_dir, resume_from_checkpoint=True) to resume after a stop"
    error.args = (f"{where}; {how}",)
    return error
