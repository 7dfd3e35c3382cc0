"""The structure of a run's state in a checkpoint, checked without a fit: every rank's snapshot
has every required key, a valid position and plan, and entries of the right kinds (data, handler
and metric states are dicts, the history a list of epochs and numbers, the generators' states
those this torch and numpy take back).

This is the estimator-independent part of what a resume checks, run by
:func:`~estimatorch.checkpoint.load` and ``inspect`` as well: a file they call fine is one whose
run state a resume reads. What depends on the fit (each handler's and metric's attributes, the
data stream's keys, the fingerprint against this fit's data) is the estimator's to check
(``estimator/_state/run.py``), which declares what a snapshot holds with the names below.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import rng
from .._checks import is_int
from .._saved import MISSING, CheckpointError, check_count, check_dict, check_keys, kind, show
from ._ledger import check_ledger

__all__ = ["PHASES", "PLAN_KEYS", "POSITION_KEYS", "SNAPSHOT", "check_positions", "check_run_state",
           "check_snapshot_structure"]

#: the boundaries a position can be at (``estimator/_state/run.py``'s ``Position``).
PHASES = ("start", "batch_end", "epoch_end")
#: the fields of a saved position.
POSITION_KEYS = ("epoch", "batch", "step", "phase", "stop")
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
    "rng": "rng.get_state(numpy_global=True): every generator of this rank, numpy's legacy global one included",
    "pending_stop": "optional: this rank asked to stop, not agreed yet (waiting for the next exchange or in flight)",
    "shared": "optional: the handlers whose state is the same on every rank (stored once)",
    "ledger": "optional: the run's ledger (its attempts, see checkpoint/_ledger.py) on rank 0, None on the others",
    "state_fingerprint": "optional: the fingerprint of this rank's parameters and optimizer state at the save "
                         "(an int, or an int64 tensor: see distributed.state_fingerprint), None where not taken",
}
_OPTIONAL = ("pending_stop", "shared", "ledger", "state_fingerprint")


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
    validations = history.get("validations")  # kept since step-level validations are recorded
    if validations is None:
        return
    validations = check_dict(validations, "history['validations']")
    for key in ("steps", "epochs"):
        column = validations.get(key, MISSING)
        if not isinstance(column, (list, tuple)) or not all(is_int(v) for v in column):
            raise CheckpointError(f"history['validations'][{key!r}] must be a list of ints, got "
                                  f"{'nothing' if column is MISSING else show(column)}")
    for name, series in check_dict(validations.get("values", MISSING), "history['validations']['values']").items():
        if not isinstance(series, (list, tuple)) or any(kind(v) != "number" for v in series):
            raise CheckpointError(f"history['validations']['values'][{name!r}] must be a list of numbers, "
                                  f"got {show(series)}")


def _check_rng(state: Any) -> None:
    state = check_dict(state, "rng")
    reference = rng.get_state(cuda=False, numpy_global=True)
    if "numpy_global" not in state:  # written before fit saved numpy's legacy generator
        del reference["numpy_global"]
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
    legacy = state.get("numpy_global")
    if legacy is not None:
        check_keys(check_dict(legacy, "rng['numpy_global']"), reference["numpy_global"], "rng['numpy_global']")
        key = legacy["key"]
        if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or key.shape != (624,) \
                or legacy["kind"] != "MT19937":
            raise CheckpointError(f"rng['numpy_global'] is not numpy's legacy MT19937 state: {show(legacy)}")
    cuda = state.get("cuda")
    if cuda is not None and (not isinstance(cuda, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
        raise CheckpointError(f"rng['cuda'] must be a list of uint8 tensors, got {show(cuda)}")


def check_snapshot_structure(snapshot: dict[str, Any]) -> None:
    """Check the kinds of one rank's snapshot (which :func:`check_positions` found complete):
    what any fit would read, whatever its handlers, metrics and data."""
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
    check_ledger(snapshot.get("ledger"))  # absent in files of earlier versions
    state = snapshot.get("state_fingerprint")
    if state is not None and not is_int(state) and not (
            isinstance(state, torch.Tensor) and state.dtype == torch.int64 and state.numel() == 1):
        raise CheckpointError(f"'state_fingerprint' must be an int, an int64 tensor of one value or None, "
                              f"got {show(state)}")
    check_dict(snapshot["data"], "data")
    check_dict(snapshot["handlers"], "handlers")
    check_dict(snapshot["metrics"], "metrics")
    _check_rng(snapshot["rng"])


def check_run_state(payload: dict[str, Any], source: str) -> None:
    """Check the run's state of every rank in ``payload`` (a current-format one whose envelope
    ``validate`` passed), as a resume would before it reads it.

    Raises:
        CheckpointError: naming ``source``, the rank and what is wrong, in words.
    """
    try:
        check_positions(payload["ranks"])
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None
    for rank, snapshot in enumerate(payload["ranks"]):
        try:
            check_snapshot_structure(snapshot)
        except CheckpointError as err:
            raise CheckpointError(f"{source}: the snapshot of rank {rank}: {err}") from None
