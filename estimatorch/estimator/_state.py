"""The run's state: where the loop stands, and everything of one rank a resume needs beside the
model and optimizer (the *snapshot*), declared once and taken, checked and restored from here.

A snapshot is a dict of tensors and plain python values (what :data:`SNAPSHOT` lists), one per
rank. A checkpoint store moves a list of them, with the model and optimizer states, to and from
disk through the estimator's seam (``Estimator.state_payload`` / ``check_payload`` /
``load_payload``); an elastic resume maps them onto another world size
(:mod:`estimatorch.estimator._elastic_resume`). Nothing outside ``estimator/`` reads their keys,
except ``handlers`` and ``shared``: a store may keep a state the handler declares the same on every
rank (``shared_state``) once, and gives it back with ``checkpoint.rank_snapshot``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from .. import distributed, rng
from .._checks import is_int, warn_user
from .._saved import MISSING, CheckpointError, check_count, check_dict, check_keys, check_like, kind, show
from ..event_handlers.lr_scheduler import epoch_learning_rates
from ..events import Dispatch, state_attributes
from ..metrics.base import Metric, metric_name
from ._elastic import check_fingerprint
from ._interrupts import SignalGuard
from ._stop_agreement import StopAgreement
from ._streams import TrainStream
from .history import History

__all__ = ["PHASES", "PLAN_KEYS", "POSITION_KEYS", "SNAPSHOT", "Position", "Run", "check_snapshot",
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


#: the boundaries a position can be at (see :class:`Position`).
PHASES = ("start", "batch_end", "epoch_end")
#: the fields of a saved position.
POSITION_KEYS = tuple(field.name for field in dataclasses.fields(Position))
#: the fields of a saved plan (exactly one is set).
PLAN_KEYS = ("epochs", "batches")
#: the snapshot of one rank: key -> what it holds. Keys marked optional are absent from files of
#: earlier versions; every other key is required.
SNAPSHOT = {
    "position": "where the loop stands (Position's fields)",
    "plan": "the fit's plan: epochs or batches",
    "partial": "True when taken in the middle of a step or an epoch end (resuming redoes it)",
    "handlers": "every stateful handler's state_dict(), by handler name",
    "metrics": "every metric's state_dict() (accumulators), by metric name",
    "history": "History.state_dict(): the per-epoch values so far",
    "evaluated": "whether the current epoch already ran validation",
    "data": "the training stream's state_dict()",
    "fingerprint": "what shapes the data stream (dataset length, batch size, drop_last, world size, seed...)",
    "rng": "rng.get_state(): every generator of this rank",
    "pending_stop": "optional: this rank asked to stop, not agreed yet (waiting for the next exchange or in flight)",
    "shared": "optional: the handlers whose state is the same on every rank (stored once)",
}
_OPTIONAL = ("pending_stop", "shared")


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
        self.at_boundary = True
        self.began = False  # train_begin was fired: train_end will be
        self.started = False  # the loop holds this fit's state (a resume applied): worth recording
        self.evaluated = False
        self.stateless_metrics: set[str] = set()


def describe_plan(plan: Mapping[str, Optional[int]]) -> str:
    return f"epochs={plan['epochs']}" if plan["epochs"] is not None else f"batches={plan['batches']}"


def record_history(estimator: Any, run: Run, epoch: int) -> None:
    """Record the epoch's values in the run's History: every train metric, the val metrics when
    the epoch validated, and the learning rates the epoch trained with."""
    values = {metric_name(m): m.compute() for m in estimator.train_metrics}
    if run.evaluated:
        values.update((metric_name(m), m.compute()) for m in estimator.val_metrics)
        run.evaluated = False
    values.update(epoch_learning_rates(estimator))
    run.history.record(epoch + 1, values)


# -- taking ---------------------------------------------------------------------------------------
def take_snapshot(estimator: Any, run: Run, partial: bool = False) -> dict[str, Any]:
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
        "rng": rng.get_state(cuda=estimator.device.type == "cuda"),
        "pending_stop": run.agreement.pending_stop,
        "shared": [name for name, h in run.dispatch.by_name.items() if getattr(h, "shared_state", False)],
    }
    assert tuple(snapshot) == tuple(SNAPSHOT), "SNAPSHOT declares what a snapshot holds"
    return snapshot


# -- checking -------------------------------------------------------------------------------------
def check_positions(ranks: list[Any]) -> None:
    """Every rank's entry is a snapshot with every required key and a valid position."""
    for rank, snapshot in enumerate(ranks):
        if not isinstance(snapshot, dict):
            raise CheckpointError(f"the snapshot of rank {rank} is a {type(snapshot).__name__}, not a dict")
        for key in SNAPSHOT:
            if key not in snapshot and key not in _OPTIONAL:
                raise CheckpointError(f"the snapshot of rank {rank} is missing {key!r}")
        _check_position(snapshot["position"], f"the position of rank {rank}")


def _check_position(position: Any, where: str) -> None:
    position = check_dict(position, where)
    missing = [key for key in POSITION_KEYS if key not in position]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    unknown = [key for key in position if key not in POSITION_KEYS]
    if unknown:
        raise CheckpointError(f"{where} has unknown {unknown}")
    for key in ("epoch", "batch", "step"):
        check_count(position[key], f"{where}[{key!r}]")
    if position["phase"] not in PHASES:
        raise CheckpointError(f"{where}['phase'] must be one of {list(PHASES)}, got {show(position['phase'])}")
    if not isinstance(position["stop"], bool):
        raise CheckpointError(f"{where}['stop'] must be a bool, got {show(position['stop'])}")


def _check_plan(plan: Any) -> None:
    plan = check_dict(plan, "plan")
    missing = [key for key in PLAN_KEYS if key not in plan]
    if missing:
        raise CheckpointError(f"plan lacks {missing}")
    for key, value in plan.items():
        if value is not None and (not is_int(value) or value < 1):
            raise CheckpointError(f"plan[{key!r}] must be a positive int or None, got {show(value)}")


def _check_history(history: Any) -> None:
    history = check_dict(history, "history")
    epochs, values = history.get("epochs", MISSING), history.get("values", MISSING)
    if not isinstance(epochs, (list, tuple)) or not all(is_int(e) for e in epochs):
        raise CheckpointError(f"history['epochs'] must be a list of ints, got "
                              f"{'nothing' if epochs is MISSING else show(epochs)}")
    for name, series in check_dict(values, "history['values']").items():
        if not isinstance(series, (list, tuple)) or any(kind(v) != "number" for v in series):
            raise CheckpointError(f"history['values'][{name!r}] must be a list of numbers, got {show(series)}")


def _check_rng(state: Any) -> None:
    state = check_dict(state, "rng")
    reference = rng.get_state(cuda=False)
    check_keys({k: v for k, v in state.items() if k != "cuda"}, reference, "rng")
    python, want = state["python"], reference["python"]
    if not (isinstance(python, (list, tuple)) and len(python) == 3 and isinstance(python[0], int)
            and isinstance(python[1], (list, tuple)) and len(python[1]) == len(want[1])
            and all(isinstance(x, int) for x in python[1]) and (python[2] is None or isinstance(python[2], float))):
        raise CheckpointError(f"rng['python'] is not a state of python's random module: {show(python)}")
    torch_state, want_torch = state["torch"], reference["torch"]
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8 \
            or torch_state.shape != want_torch.shape:
        raise CheckpointError(f"rng['torch'] must be {show(want_torch)}, got {show(torch_state)}")
    numpy_state, want_numpy = check_dict(state["numpy"], "rng['numpy']"), reference["numpy"]
    if numpy_state.get("bit_generator") != want_numpy["bit_generator"]:
        raise CheckpointError(f"rng['numpy'] is a state of {numpy_state.get('bit_generator')!r}, "
                              f"expected {want_numpy['bit_generator']!r}")
    check_keys(numpy_state, want_numpy, "rng['numpy']")
    inner = check_dict(numpy_state["state"], "rng['numpy']['state']")
    check_keys(inner, want_numpy["state"], "rng['numpy']['state']")
    extra = [("has_uint32", numpy_state["has_uint32"]), ("uinteger", numpy_state["uinteger"])]
    for key, value in [*inner.items(), *extra]:
        if not is_int(value):
            raise CheckpointError(f"rng['numpy'] entry {key!r} must be an int, got {show(value)}")
    cuda = state.get("cuda")
    if cuda is not None:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not isinstance(cuda, (list, tuple)) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
            raise CheckpointError(f"rng['cuda'] must be a list of uint8 tensors, got {show(cuda)}")
        if len(cuda) != have:
            raise CheckpointError(f"rng['cuda'] holds {len(cuda)} CUDA generator states but this process sees "
                                  f"{have} CUDA devices")


def _check_handlers(saved: dict[str, Any], handlers: Mapping[str, Any]) -> None:
    for name, handler in handlers.items():
        if name not in saved or not callable(getattr(handler, "load_state_dict", None)):
            continue  # a handler without saved state starts fresh (the estimator warns)
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
        for attr, default in metric.state_defaults().items():
            if attr not in state:
                raise CheckpointError(f"the state of metric {name!r} lacks {attr!r}")
            check_like(state[attr], default, f"the state of metric {name!r}[{attr!r}]")
        if not isinstance(state.get("pending", []), (list, tuple)):
            raise CheckpointError(f"the state of metric {name!r}['pending'] must be a list, "
                                  f"got {show(state['pending'])}")


def check_snapshot(estimator: Any, run: Run, snapshot: dict[str, Any]) -> None:
    """Check everything of one rank's snapshot that a resume of ``run`` reads (but the data
    fingerprint and the plan, which :func:`resume_plan` judges), without changing anything.

    Raises:
        CheckpointError: saying what is wrong, in words.
    """
    _check_plan(snapshot["plan"])
    for key in ("partial", "evaluated"):
        if not isinstance(snapshot[key], bool):
            raise CheckpointError(f"{key!r} must be a bool, got {show(snapshot[key])}")
    if not isinstance(snapshot.get("pending_stop", False), bool):  # absent in files of earlier versions
        raise CheckpointError(f"'pending_stop' must be a bool, got {show(snapshot['pending_stop'])}")
    fingerprint = check_dict(snapshot["fingerprint"], "fingerprint")
    if not all(isinstance(key, str) for key in fingerprint):
        raise CheckpointError(f"fingerprint keys must be strings, got {list(fingerprint)}")
    _check_history(snapshot["history"])
    data, want = check_dict(snapshot["data"], "data"), run.stream.state_dict()
    for key, value in want.items():
        if key not in data:
            raise CheckpointError(f"the data state lacks {key!r}")
        check_like(data[key], value, f"the data state[{key!r}]")
    _check_handlers(snapshot["handlers"], run.dispatch.by_name)
    _check_metrics(snapshot["metrics"], estimator.train_metrics + estimator.val_metrics)
    _check_rng(snapshot["rng"])


# -- resuming -------------------------------------------------------------------------------------
def resume_plan(run: Run, snapshot: dict[str, Any], source: str) -> dict[str, Any]:
    """Check a snapshot against this fit (data fingerprint, plan) before any work starts, and
    decide whether its recorded stop still holds under the new plan."""
    check_fingerprint(snapshot["fingerprint"], run.stream.fingerprint(), source)
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


def restore_snapshot(estimator: Any, run: Run, snapshot: dict[str, Any]) -> None:
    """Put a snapshot's state into this fit's handlers, metrics, data and generators."""
    pos = snapshot["position"]
    estimator.logger.info("Resuming from %s: %d epochs and %d batches done", snapshot["source"], pos["epoch"],
                          pos["step"])
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
    run.started = True
    rng.set_state(snapshot["rng"])  # last: nothing may draw between here and the next step
