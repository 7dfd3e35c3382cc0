"""The run's state: where the loop stands, and everything of one rank a resume needs beside the
model and optimizer (the *snapshot*), declared once and taken, checked and restored from here.

A snapshot is a dict of tensors and plain python values (what :data:`SNAPSHOT` lists), one per
rank. A checkpoint store moves a list of them, with the model and optimizer states, to and from
disk through the estimator's seam (``Estimator.state_payload`` / ``check_payload`` /
``load_payload``); an elastic resume maps them onto another world size
(:mod:`estimatorch.estimator._state.elastic_resume`). The store declares their keys and checks their
structure (``checkpoint/_run_state.py``: what ``checkpoint.load`` and ``inspect`` check of any
file); their meaning is read nowhere outside ``estimator/``, except ``handlers`` and ``shared``: a
store may keep a state the handler declares the same on every rank (``shared_state``) once, and
gives it back with ``checkpoint.rank_snapshot``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from ... import distributed, rng
from ..._checks import warn_user
from ..._saved import CheckpointError, check_dict, check_like, show
from ...checkpoint import (
    PHASES,
    PLAN_KEYS,
    POSITION_KEYS,
    SNAPSHOT,
    check_positions,
    check_snapshot_structure,
)
from ...data import TrainStream
from ...events import Dispatch, declared, state_attributes
from ...events.readings import epoch_learning_rates, epoch_readings
from ...events.timing import StepTimes
from ...metrics.base import Metric, metric_name
from .._fit_estimator import FitEstimator
from .._stopping.agreement import StopAgreement
from .._stopping.interrupts import SignalGuard
from ..history import History
from .fingerprint import check_restored
from .ledger import RunLedger

__all__ = ["PHASES", "PLAN_KEYS", "POSITION_KEYS", "SNAPSHOT", "Position", "Run", "Stage", "check_snapshot",
           "check_positions", "describe_plan", "record_history", "restore_snapshot", "resume_plan", "take_snapshot"]


@dataclasses.dataclass
class Position:
    """Where the loop stands, at a boundary between events.

    ``phase`` is ``"start"`` before the first batch, ``"batch_end"`` after a batch and all its
    ``batch_end`` handlers, ``"epoch_end"`` after an epoch and all its ``epoch_end`` handlers
    (then ``epoch`` is already the next epoch). ``stop`` records a stop requested there.
    """

    epoch: int = 0
    batch: int = 0
    step: int = 0
    phase: str = "start"
    stop: bool = False


#: the fields of a saved position, which the store checks by name (``checkpoint/_run_state.py``).
assert POSITION_KEYS == tuple(field.name for field in dataclasses.fields(Position))


class Stage(enum.Enum):
    """Where one ``fit`` call stands, as the loop and ``fit`` ask it. (Not ``Position.phase``,
    the kind of the last boundary, which a snapshot saves; a stage is never saved.)

    ``NOT_STARTED`` until ``train_begin`` is fired; ``SETTING_UP`` from then (``train_begin``,
    the horizons, a mid-epoch resume's ``epoch_begin``) until the loop holds this fit's state
    (a resume applied, or none asked for); then ``STEPPING`` inside an event or a step and
    ``AT_BOUNDARY`` between events, in turn; ``ENDED`` once ``train_end`` ran for a run that
    held its state (a run that fails before is discarded by ``fit`` and keeps its stage).
    """

    NOT_STARTED = "not started"
    SETTING_UP = "setting up"
    STEPPING = "stepping"
    AT_BOUNDARY = "at a boundary"
    ENDED = "ended"

    @property
    def began(self) -> bool:
        """``train_begin`` was fired: ``train_end`` will be."""
        return self is not Stage.NOT_STARTED

    @property
    def holds_state(self) -> bool:
        """The loop holds this fit's own state (a resume applied): worth recording, and worth
        keeping as the estimator's last run."""
        return self in (Stage.STEPPING, Stage.AT_BOUNDARY, Stage.ENDED)


class Run:
    """The state of one ``fit`` call that is not a handler's: the loop's own bookkeeping."""

    def __init__(self, dispatch: Dispatch, stream: TrainStream, plan: dict[str, Optional[int]],
                 batch_axis: int, signals: SignalGuard,
                 limits: tuple[Optional[int], Optional[int]] = (None, None)):
        self.dispatch = dispatch
        #: ``fit``'s ``(batches_per_epoch, val_batches)``
        self.limits = limits
        #: what the plan amounts to (a ``_plan.PlanCounts``), set once the handlers are known
        self.counts: Any = None
        self.stream = stream
        self.plan = plan
        self.batch_axis = batch_axis
        self.signals = signals
        self.agreement = StopAgreement(distributed.is_distributed())
        self.pos = Position()
        self.history = History()
        self.pending: Optional[dict[str, Any]] = None
        self.boundary_actions: list[Callable[[], None]] = []
        self.stage = Stage.NOT_STARTED
        self.evaluated = False
        #: the name of the weights this epoch's validation ran on (a handler's average), else None
        self.evaluated_on: Optional[str] = None
        #: True while ``epoch_begin`` or ``epoch_end`` is fired (a validation then is at the
        #: position's step; inside a step's events, at the step being trained)
        self.in_epoch_event = False
        self.stateless_metrics: set[str] = set()
        #: the step the loop runs in place of the batch processor (``cuda_graphs=True``), else None
        self.step: Any = None
        #: where the steps' time goes, when a handler declares ``times_steps`` (else None)
        self.step_times: Optional[StepTimes] = None
        #: the snapshot ``fit(..., resume=True)`` continues from, taken as the fit ends
        self.final_snapshot: Optional[dict[str, Any]] = None
        #: the items of each optimizer step, when a step spans several micro-batches (else None)
        self.items: Optional[distributed.StepItems] = None
        #: the run's ledger, kept by this attempt (rank 0): see ``_state/ledger.py``
        self.ledger = RunLedger()
        #: the replica check (``Estimator(check_replicas_every=...)``), None when off or in one process
        self.replicas: Any = None


def describe_plan(plan: Mapping[str, Optional[int]]) -> str:
    return f"epochs={plan['epochs']}" if plan["epochs"] is not None else f"batches={plan['batches']}"


def record_history(estimator: FitEstimator, run: Run, epoch: int) -> None:
    """Record the epoch's values in the run's History: every train metric, the val metrics when
    the epoch validated, the learning rates the epoch trained with and what handlers measured of it
    (a SpeedMonitor's values), as the handlers declare them (:mod:`estimatorch.events.readings`)."""
    values = {metric_name(m): m.compute() for m in estimator.train_metrics}
    if run.evaluated:
        values.update((metric_name(m), m.compute()) for m in estimator.val_metrics)
        run.evaluated, run.evaluated_on = False, None
    values.update(epoch_learning_rates(estimator))
    values.update(epoch_readings(estimator))
    run.history.record(epoch + 1, values)


# -- taking ---------------------------------------------------------------------------------------
def take_snapshot(estimator: FitEstimator, run: Run, partial: bool = False) -> dict[str, Any]:
    """This rank's state at the current boundary: everything but model and optimizer."""
    handlers = {name: h.state_dict() for name, h in run.dispatch.by_name.items()
                if callable(getattr(h, "state_dict", None))}
    metrics: dict[str, Any] = {}
    for metric in estimator.train_metrics + estimator.val_metrics:
        state = metric.state_dict() if callable(getattr(metric, "state_dict", None)) else None
        if state is not None:
            metrics[metric_name(metric)] = state
        if not state and not isinstance(metric, Metric) and run.pos.phase == "batch_end" \
                and metric_name(metric) not in run.stateless_metrics:
            run.stateless_metrics.add(metric_name(metric))  # warned once per fit
            warn_user(f"metric {metric_name(metric)!r} keeps no state (no or an empty state_dict(), e.g. a "
                      "torchmetrics metric whose states are not persistent): resuming from here restarts its "
                      "running value for this epoch. For a torchmetrics metric, call metric.persistent(True) "
                      "before fit so that checkpoints keep it")
    snapshot = {
        "position": dataclasses.asdict(run.pos),
        "plan": dict(run.plan),
        "partial": partial,
        "handlers": handlers,
        "metrics": metrics,
        "history": run.history.state_dict(),
        "evaluated": run.evaluated,
        "data": run.stream.state_dict(),
        "fingerprint": run.stream.fingerprint(),
        "rng": rng.get_state(cuda=estimator.device.type == "cuda", numpy_global=True),
        "pending_stop": run.agreement.pending_stop,
        "shared": [name for name, h in run.dispatch.by_name.items() if declared(h, "shared_state")],
        "ledger": run.ledger.state(run),
        "state_fingerprint": None,  # taken by a store's save (``payload.payload_of``)
    }
    assert tuple(snapshot) == tuple(SNAPSHOT), "SNAPSHOT declares what a snapshot holds"
    return snapshot


# -- checking -------------------------------------------------------------------------------------
def check_snapshot(estimator: FitEstimator, run: Run, snapshot: dict[str, Any]) -> None:
    """Check everything of one rank's snapshot that a resume of ``run`` reads (but the data
    fingerprint and the plan, which :func:`resume_plan` judges), without changing anything: its
    structure (what the store checks of any file, ``checkpoint.check_snapshot_structure``), then
    its states against this fit's data stream, handlers, metrics and devices.

    Raises:
        CheckpointError: saying what is wrong, in words.
    """
    check_snapshot_structure(snapshot)
    data, want = snapshot["data"], run.stream.state_dict()
    for key, value in want.items():
        if key not in data:
            raise CheckpointError(f"the data state lacks {key!r}")
        check_like(data[key], value, f"the data state[{key!r}]")
    _check_handlers(snapshot["handlers"], run.dispatch.by_name)
    _check_metrics(snapshot["metrics"], estimator.train_metrics + estimator.val_metrics)
    cuda = snapshot["rng"].get("cuda")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda is not None and len(cuda) != have:
        raise CheckpointError(f"rng['cuda'] holds {len(cuda)} CUDA generator states but this process sees "
                              f"{have} CUDA devices")


def _check_handlers(saved: dict[str, Any], handlers: Mapping[str, Any]) -> None:
    for name, handler in handlers.items():
        if name not in saved or not callable(getattr(handler, "load_state_dict", None)):
            continue  # a handler without saved state starts fresh (the estimator warns)
        try:
            declared(handler, "check_state_dict")(saved[name])
        except ValueError as err:
            raise CheckpointError(f"the state of handler {name!r} does not fit this fit: {err}") from None
        attrs = state_attributes(handler)
        if not attrs:
            continue  # a handler of yours: its load_state_dict is the judge
        state = check_dict(saved[name], f"the state of handler {name!r}")
        for attr in attrs:
            if attr not in state:
                raise CheckpointError(f"the state of handler {name!r} lacks {attr!r}")
            check_like(state[attr], getattr(handler, attr, None), f"the state of handler {name!r}[{attr!r}]")


def _check_metrics(saved: Any, metrics: list[Any]) -> None:
    saved = check_dict(saved, "metrics")
    for metric in metrics:
        name = metric_name(metric)
        if name not in saved or not callable(getattr(metric, "load_state_dict", None)):
            continue
        state = check_dict(saved[name], f"the state of metric {name!r}")
        if not isinstance(metric, Metric):
            continue
        state = metric.upgrade_state(state)  # accumulators added since it was saved take their defaults
        for attr, default in metric.state_defaults().items():
            if attr not in state:
                raise CheckpointError(f"the state of metric {name!r} lacks {attr!r}")
            check_like(state[attr], default, f"the state of metric {name!r}[{attr!r}]")
        if not isinstance(state.get("pending", []), (list, tuple)):
            raise CheckpointError(f"the state of metric {name!r}['pending'] must be a list, "
                                  f"got {show(state['pending'])}")


# -- resuming -------------------------------------------------------------------------------------
def resume_plan(run: Run, snapshot: dict[str, Any], source: str) -> dict[str, Any]:
    """Check a snapshot against this fit (data fingerprint, plan) before any work starts, and
    decide whether its recorded stop still holds under the new plan."""
    run.stream.check_fingerprint(snapshot["fingerprint"], source)
    if not isinstance(snapshot.get("pending_stop", False), bool):  # read by the stop agreement
        raise ValueError(f"cannot resume from {source}: its pending_stop must be a bool, "
                         f"got {snapshot['pending_stop']!r}")
    pos = snapshot["position"]
    epochs, batches = run.plan["epochs"], run.plan["batches"]
    same_plan = snapshot["plan"] == run.plan
    if batches is not None and pos["step"] > batches or epochs is not None and pos["epoch"] > epochs:
        raise ValueError(f"cannot resume from {source}: it already trained {pos['step']} batches "
                         f"in {pos['epoch']} epochs, beyond the plan {describe_plan(run.plan)}")
    reached = (batches is not None and pos["step"] >= batches) or \
              (epochs is not None and pos["phase"] == "epoch_end" and pos["epoch"] >= epochs)
    snapshot = dict(snapshot, position=dict(pos, stop=reached or (pos["stop"] and same_plan)), source=source)
    if snapshot["partial"]:
        warn_user(f"{source} was interrupted in the middle of a step or epoch end: resuming restarts it, so "
                  "results may differ from an uninterrupted run. (Ctrl-C stops at a step boundary and resumes "
                  "exactly.)")
    return snapshot


def restore_snapshot(estimator: FitEstimator, run: Run, snapshot: dict[str, Any]) -> None:
    """Put a snapshot's state into this fit's handlers, metrics, data and generators."""
    pos = snapshot["position"]
    check_restored(estimator, snapshot.get("state_fingerprint"), snapshot["source"])  # before anything changes
    note = run.ledger.previous_note
    estimator.logger.info("Resuming from %s: %d epochs and %d batches done%s", snapshot["source"], pos["epoch"],
                          pos["step"], f"; {note}" if note else "")
    saved = snapshot["handlers"]
    for name, handler in run.dispatch.by_name.items():
        if not callable(getattr(handler, "load_state_dict", None)):
            continue
        if name in saved:
            handler.load_state_dict(saved[name])
        elif handler.state_dict():
            warn_user(f"handler {name!r} has no saved state to resume from (the fit that saved it had no handler "
                      "of that name); it starts fresh. Resume with the handlers of the saved run to continue theirs")
    for metric in estimator.train_metrics + estimator.val_metrics:
        name = metric_name(metric)
        if name in snapshot["metrics"] and callable(getattr(metric, "load_state_dict", None)):
            metric.load_state_dict(snapshot["metrics"][name])
            if snapshot["metrics"][name] and getattr(metric, "_update_count", None) == 0:
                # torchmetrics counts updates outside its state_dict: restored accumulators are
                # updates, so its compute() must not warn "called before the update method"
                metric._update_count = 1
    run.history.load_state_dict(snapshot["history"])
    run.evaluated = snapshot["evaluated"]
    run.stream.load_state_dict(snapshot["data"])
    for key, value in snapshot["position"].items():  # in place: the loop holds run.pos
        setattr(run.pos, key, value)
    if snapshot["partial"] and estimator.optimizer is not None:
        estimator.optimizer.zero_grad(set_to_none=True)
    run.agreement.restore(snapshot.get("pending_stop", False), pos["step"], pos["phase"] == "batch_end")
    run.stage = Stage.STEPPING
    rng.set_state(snapshot["rng"])  # last: nothing may draw between here and the next step
