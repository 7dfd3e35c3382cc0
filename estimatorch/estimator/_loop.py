"""The training loop of ``fit``, as the sequence of its phases: apply a resume or start, then per
epoch ``epoch_begin``, the batches (each: ``batch_begin``, the step, ``batch_end``, the stop
agreement, the boundary) and the epoch's end (``epoch_end``, the history, the boundary).

Each concern sits behind one call: the resume (:func:`begin`, :func:`begin_epoch`), the stop
agreement between ranks (``run.agreement``), signals (:func:`stop_for`) and the work handlers
register for a boundary (:func:`run_boundary_actions`). The batch loop keeps everything it reads
per step in locals: its cost per step is the handlers' and the step's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Optional

from .._batches import batch_mover
from ._fit_estimator import FitEstimator
from ._plan.counts import limited
from ._state.run import Run, Stage, describe_plan, record_history, restore_snapshot, take_snapshot
from ._step.clock import StepClock
from ._step.weighing import counting_step
from ._stopping.agreement import rank_identical_stops
from ._stopping.interrupts import stop_exception

__all__ = ["end_run", "run_loop"]


def run_loop(estimator: FitEstimator, run: Run) -> None:
    """Train ``run``'s plan (or what a resume leaves of it) with ``estimator``."""
    done, pending = begin(estimator, run)
    if done:
        return
    run.ledger.loop_began()
    marked = rank_identical_stops(run.dispatch.batch_end)  # stops needing no exchange under DDP
    while True:
        epoch = run.pos.epoch
        begin_epoch(estimator, run, pending)
        pending = None
        if not run.pos.stop:
            train_epoch(estimator, run, epoch, marked)
        if end_epoch(estimator, run, epoch):
            return


def begin(estimator: FitEstimator, run: Run) -> tuple[bool, Optional[dict[str, Any]]]:
    """Apply a resume at an epoch boundary now; keep one from the middle of an epoch for
    :func:`begin_epoch`. Returns whether the plan is done already, and the resume left."""
    pending, run.pending = run.pending, None
    if pending is not None and pending["position"]["phase"] != "batch_end":
        restore_snapshot(estimator, run, pending)
        pending = None
        if run.pos.stop:
            estimator.logger.warning("Nothing to resume: the saved run already finished its plan "
                                     "(%s). Pass a larger epochs= or batches= to train further.",
                                     describe_plan(run.plan))
            return True, None
    if pending is not None:  # a mid-epoch resume: that epoch begins again, then state returns
        run.pos.epoch = pending["position"]["epoch"]
    else:
        run.stage = Stage.STEPPING
    return False, pending


def begin_epoch(estimator: FitEstimator, run: Run, pending: Optional[dict[str, Any]]) -> None:
    """``epoch_begin``, then the state of a mid-epoch resume (after the handlers reset)."""
    if run.stage is Stage.AT_BOUNDARY:  # (still SETTING_UP before a mid-epoch resume)
        run.stage = Stage.STEPPING
    run.in_epoch_event = True
    try:
        run.dispatch.fire("epoch_begin", estimator)
    finally:
        run.in_epoch_event = False
    if pending is not None:
        restore_snapshot(estimator, run, pending)


def train_epoch(estimator: FitEstimator, run: Run, epoch: int, marked: frozenset[Any]) -> None:
    """The epoch's batches from the current position, until the data ends or a stop."""
    pos, signals, agreement = run.pos, run.signals, run.agreement
    processor = run.step or estimator.batch_processor  # run.step: the captured step (cuda_graphs)
    device, axis, multi = estimator.device, run.batch_axis, agreement.multi
    batch_begin, batch_end = run.dispatch.batch_begin, run.dispatch.batch_end
    batch_end = (*batch_end, *step_hooks(run))  # the replica check, the progress mark: none when off
    move = batch_mover(device)  # on CUDA, the copy of the next batch overlaps this step
    # (a processor of the user's may pass backward no count: its batch's samples, when a step weighs them)
    fit_batch, clock = counting_step(processor.fit_batch, processor, run.items), None
    if run.step_times is not None:  # the step-time split: pieces wrapped per epoch, none when off
        clock = StepClock(run.step_times)
        move, fit_batch, batch_end = clock.wrap(move, fit_batch, batch_end)
    started = pos.batch
    code = 0
    # a signal while the next batch is made stops at once only where that cannot advance the saved state
    fetch_stoppable = run.stream.stops_while_fetching
    stepping, boundary = Stage.STEPPING, Stage.AT_BOUNDARY
    for batch in epoch_batches(run, epoch, clock):  # no name holds the data's iterator past an error
        signals.stoppable = False
        run.stage = stepping
        batch = move(batch)
        for fn in batch_begin:
            fn(estimator, batch=batch)
        _, label, pred, loss = fit_batch(estimator, batch, axis)
        stop = identical = False
        for fn in batch_end:
            if fn(estimator, batch=batch, pred=pred, label=label, loss=loss):
                if fn in marked:
                    identical = True
                else:
                    stop = True
        if multi:  # every rank stops at the same step: see _stopping/agreement.py
            stop, code = agreement.after_batch(pos.step + 1, stop, identical, signals.code)
        else:
            stop = stop or identical
        pos.batch += 1
        pos.step += 1
        pos.phase, pos.stop = "batch_end", stop
        run.stage = boundary
        if run.boundary_actions:
            run_boundary_actions(run)
        if not multi:  # one process: a signal now stops here, one while waiting for data at once
            signals.stoppable = fetch_stoppable
            code = signals.code
        if code:
            stop_for(run, code)
        if stop:
            break
    if clock is not None:
        clock.close()
    signals.stoppable = False
    if started == 0 and pos.batch == 0:
        raise ValueError(f"train_data yielded no batches in epoch {epoch + 1}; "
                         "an iterator can be read only once: pass a re-iterable (list, DataLoader)")


def epoch_batches(run: Run, epoch: int, clock: Optional[StepClock]) -> Iterator[Any]:
    """The epoch's batches from the current position (clocked when the split is on)."""
    batches = limited(run.stream.epoch_iter(epoch, run.pos.batch), run.pos.batch, run.limits[0])
    return batches if clock is None else clock.batches(batches)


def end_epoch(estimator: FitEstimator, run: Run, epoch: int) -> bool:
    """``epoch_end``, the history, the stop agreement and the boundary; True when the loop ends."""
    pos, signals = run.pos, run.signals
    run.stage, run.in_epoch_event = Stage.STEPPING, True
    try:
        stop = run.dispatch.fire("epoch_end", estimator)
    finally:
        run.in_epoch_event = False
    record_history(estimator, run, epoch)
    stop, code = run.agreement.after_epoch(stop, signals.code)
    pos.epoch, pos.batch, pos.phase = epoch + 1, 0, "epoch_end"
    pos.stop = pos.stop or stop
    run.stage = Stage.AT_BOUNDARY
    if run.boundary_actions:
        run_boundary_actions(run)
    if code or (not run.agreement.multi and signals.code):
        stop_for(run, code or signals.code)
    return pos.stop


def stop_for(run: Run, code: int) -> None:
    """Leave the loop at this boundary because of a signal (agreed by every rank)."""
    run.signals.stoppable = False
    run.signals.stopped = run.signals.name_of(code)
    raise stop_exception(run.signals.stopped)


def step_hooks(run: Run) -> tuple[Any, ...]:
    """What the loop calls after every ``batch_end`` handler, when on: the replica check
    (``Estimator(check_replicas_every=...)``), then the progress mark's step counter."""
    hooks = (run.replicas.batch_end if run.replicas is not None else None, run.ledger.step_hook)
    return tuple(hook for hook in hooks if hook is not None)


def run_boundary_actions(run: Run) -> None:
    """Run the work handlers registered with ``at_boundary`` for this boundary (timed for the
    ledger: checkpoint saves, mostly)."""
    actions, run.boundary_actions = run.boundary_actions, []
    started = time.perf_counter_ns()
    try:
        for action in actions:
            action()
    finally:
        run.ledger.add("save", time.perf_counter_ns() - started)


def end_run(estimator: FitEstimator, run: Run, failed: bool, error: Optional[BaseException] = None) -> None:
    """Record the final snapshot, fire ``train_end``, release the data (also on failure), close
    the attempt's entry in the run's ledger (``error``: what ended the fit, if anything did)."""
    run.ledger.decide(run, failed, error)
    snapshot_error = _final_snapshot(estimator, run, failed)
    started = time.perf_counter_ns()
    try:
        if run.stage.began:
            run.dispatch.fire_train_end(estimator, failed or snapshot_error is not None)
    finally:
        run.ledger.add("end", time.perf_counter_ns() - started)
        run.stream.close()
        if run.stage.holds_state:
            run.stage = Stage.ENDED
        run.ledger.close(estimator, run)  # also for a fit that failed before it trained: an attempt all the same
    if snapshot_error is not None and not failed:
        raise snapshot_error


def _final_snapshot(estimator: FitEstimator, run: Run, failed: bool) -> Optional[Exception]:
    """Record what ``fit(..., resume=True)`` continues from (unless the fit failed before it
    held any state of its own); return the error if a handler's ``state_dict`` fails, so
    that it neither hides the error that ended the fit nor keeps ``train_end`` from running."""
    if not run.stage.holds_state:
        return None
    try:
        run.final_snapshot = take_snapshot(estimator, run, partial=run.stage is not Stage.AT_BOUNDARY)
        return None
    except Exception as err:  # reported after train_end, or logged if another error is on its way
        run.final_snapshot = None
        if failed:
            estimator.logger.exception("Could not record the state of the interrupted fit: resume=True is unavailable")
        return err
