"""The first half of ``fit``: its arguments and handlers checked and its run prepared, before any
work (no data read, no file written, the net and the generators untouched)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from .. import distributed, rng
from .._checks import warn_user
from ..events import Dispatch, check_fit, check_handlers, check_metric_references, declared, order_handlers
from ..events.monitor import resolve_monitors
from ..events.timing import StepTimes
from ._fit_estimator import FitEstimator
from ._plan.counts import plan_counts
from ._plan.schedules import schedule_length
from ._setup.arguments import check_fit_arguments, check_limits, check_optimizer, check_unique_handlers
from ._setup.handlers import default_handlers
from ._setup.optimizer import warn_default_optimizer
from ._setup.train_stream import open_train_stream
from ._state.run import Run, resume_plan
from ._step.capture import check_capture
from ._step.weighing import step_items
from ._stopping.agreement import agreement_period
from ._stopping.replicas import check_replica_setting
from ._stopping.stop_messages import signal_guard

__all__ = ["start_run"]


def start_run(estimator: FitEstimator, train_data: Iterable[Any], val_data: Optional[Iterable[Any]],
              epochs: Optional[int], event_handlers: Any, batches: Optional[int], batch_axis: int, resume: bool,
              limits: tuple[Optional[int], Optional[int]], *, last: Optional[dict[str, Any]] = None,
              default_optimizer: Optional[torch.optim.Optimizer] = None,
              monitor_aliases: Optional[dict[Any, Any]] = None) -> Run:
    """Check ``fit``'s arguments and handlers and prepare its run, before any work (every
    rank; ``fit`` then agrees on the outcome, so a check failing on one rank stops all).
    ``last`` is the snapshot ``resume=True`` continues from (the estimator's last fit's), and
    ``default_optimizer`` the one the estimator built for want of one, not yet warned about;
    ``monitor_aliases`` what a monitor of the estimator's own val metrics follows when
    ``val_data`` holds several eval sets (:mod:`._setup.eval_sets`)."""
    check_fit_arguments(train_data, val_data, epochs, batches, batch_axis, resume)
    check_limits(*limits)
    if estimator.optimizer is None:
        raise ValueError("this estimator has no optimizer: net has no trainable parameters; pass optimizer=")
    check_optimizer(estimator.optimizer, estimator.net)
    warn_default_optimizer(estimator, default_optimizer)
    rng.check_seed(estimator.seed)  # also one assigned after construction
    user = check_handlers(event_handlers)
    check_unique_handlers(user)
    if resume and last is None:
        raise ValueError("resume=True but this estimator has no earlier fit to continue")
    handlers = order_handlers(user, default_handlers(estimator, user, val_data))
    resolve_monitors(handlers, estimator.train_metrics + estimator.val_metrics,  # monitors given by name
                     monitor_aliases, estimator.logger)
    check_metric_references(handlers, estimator.train_metrics + estimator.val_metrics)
    check_fit(handlers, estimator, resume)
    check_capture(estimator, handlers, distributed.get_world_size())  # cuda_graphs=True
    check_replica_setting(estimator)  # check_replicas_every under FSDP2
    stream = open_train_stream(estimator, train_data, handlers)  # laid out for CheckpointHandler(..., elastic=True)
    resumes = resume or any(declared(h, "resumes_run") or declared(h, "checkpoint_location") is not None
                            for h in handlers)
    if not stream.exact and resumes:
        warn_user(f"train_data ({type(train_data).__name__}) cannot be positioned: a resume will replay (load "
                  "and discard) the batches before the saved position, exact only if it yields the same batches "
                  "each time. Use a map-style DataLoader, or give the IterableDataset state_dict()/"
                  "load_state_dict().")
    run = Run(Dispatch(handlers), stream, {"epochs": epochs, "batches": batches}, batch_axis,
              signal_guard(handlers, estimator.logger), limits)
    run.agreement.period = agreement_period(estimator.agree_every)
    run.items = step_items(estimator, handlers, stream)
    if any(declared(h, "times_steps") for h in handlers):
        run.step_times = StepTimes(events=estimator.device.type == "cuda")
    run.counts = plan_counts(stream.batches_per_epoch, handlers, epochs, batches, limits[0])
    schedule_length(estimator, run.counts)  # a callable lr_scheduler can be sized: checked before any work
    if resume and last is not None:  # checked above: a resume has a fit to continue
        run.pending = resume_plan(run, last, source="the previous fit")
    return run
