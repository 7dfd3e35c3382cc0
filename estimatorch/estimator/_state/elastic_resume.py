"""An elastic fit's view of a checkpoint: the per-rank snapshots of a run saved on one world size,
mapped onto the ranks of a fit on another (``CheckpointHandler(..., elastic=True)``; the layout of
the samples is in :mod:`estimatorch.data._elastic`); ``Estimator.check_payload`` applies it.

Both runs train ``S = world_size x accumulation_steps`` micro-batches of ``batch_size`` samples
per optimizer step, the same samples in each step (anything else is refused). The mapping:

- **Where.** Only a checkpoint at an optimizer step maps (no accumulation window half done: the
  gradients a rank accumulated under ``no_sync`` belong to slots another topology splits
  differently). The position, counted in this process's batches, becomes ``optimizer steps x
  accumulation_steps`` of the new fit: ``batch`` and ``step`` are scaled by ``k_new / k_old``
  (exact: an elastic epoch is a whole number of steps), and so is a ``batches=`` plan.
- **Handlers.** Every rank takes rank 0's handler states (the ranks of an elastic run train the
  same number of batches, and at an optimizer step ``GradientUpdateHandler`` holds nothing).
  Counters of this process's batches (the state keys each handler class lists in its
  ``elastic_batch_counters`` attribute, those of its base classes included) are scaled like the
  position; any other state is carried over as saved.
- **Metrics.** The accumulators of every saved rank are combined by each state's ``reduce``
  (:meth:`estimatorch.metrics.Metric.combine_rank_states`): rank 0 takes the sum (``"sum"``) and
  the concatenation (``"cat"``, rank order) and the other ranks start from the state's default;
  every rank takes the mean (``"mean"``) and the minimum or maximum (``"min"``/``"max"``).
  ``compute()`` over the new ranks then gives the value over every
  sample trained so far, as before the change (up to float rounding: pending updates are folded
  at the mapping). A metric that is not an estimatorch ``Metric`` (its reductions are unknown)
  restarts its running value for this epoch, with a warning.
- **Randomness.** Per-rank generator states do not exist on another topology: each rank starts
  from the generators ``fit`` seeds at its start; every micro-batch reseeds from its position
  anyway (:func:`estimatorch.rng.seed_position`).
- **Stops.** A stop request in flight on any saved rank is carried to every new rank.
- **The ledger** (rank 0's) goes on, its steps scaled like the position; the state's fingerprint
  is kept for a file (the same state, restored on every rank), dropped for a sharded directory.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from ... import distributed, rng
from ..._checks import is_int, warn_user
from ..._saved import CheckpointError
from ...checkpoint import rank_snapshot, scale_steps
from ...data import ElasticLayout, is_elastic
from ...events import declared
from ...metrics.base import Metric, metric_name
from .._fit_estimator import FitEstimator
from .run import Run

__all__ = ["batch_counters", "map_payload", "world_size_error"]


def map_payload(estimator: FitEstimator, run: Run, payload: dict[str, Any], source: str) -> dict[str, Any]:
    """``payload`` as ``estimator``'s current fit (``run``) resumes it: unchanged unless the fit is elastic;
    for an elastic fit, refused unless written by an elastic fit of the same global batch, and
    mapped onto this world size when it was written on another.

    Raises:
        CheckpointError: written without ``elastic=True``, with another global batch, or (on
            another world size) in the middle of an accumulation window.
    """
    layout = getattr(run.stream, "layout", None)
    if layout is None:
        return payload
    saved = payload["ranks"][0].get("fingerprint")
    if not isinstance(saved, dict) or not is_elastic(saved):
        raise CheckpointError(f"{source} was written by a fit without CheckpointHandler(..., elastic=True) (its "
                              "samples are laid out per process, on its world size): resume it without elastic=True, "
                              f"on the {payload['world_size']} processes that wrote it")
    try:
        run.stream.check_fingerprint(saved, source)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if payload["world_size"] == layout.world_size:
        return payload
    return _remap(estimator, run, payload, layout, source)


def _remap(estimator: FitEstimator, run: Run, payload: dict[str, Any], layout: ElasticLayout,
           source: str) -> dict[str, Any]:
    old_world, new_world = payload["world_size"], layout.world_size
    old_k, rest = divmod(layout.slots, old_world)
    if rest or not old_k:
        raise CheckpointError(f"{source} was written by {old_world} processes, which do not divide its "
                              f"{layout.slots} micro-batches per optimizer step")
    new_k = layout.accumulation_steps
    snapshots = [rank_snapshot(payload, rank) for rank in range(old_world)]
    first = snapshots[0]
    position = first["position"]
    accumulators = [name for name, h in run.dispatch.by_name.items() if declared(h, "accumulation_steps") is not None]
    pending = [s["handlers"].get(name, {}).get("pending", 0) for s in snapshots for name in accumulators]
    if position["batch"] % old_k or any(pending):
        raise CheckpointError(
            f"{source} was saved in the middle of an accumulation window (batch {position['batch']} of its epoch, "
            f"{old_k} batches per optimizer step): it can resume on its {old_world} processes only. Resuming on "
            f"{new_world} needs a checkpoint at an optimizer step (batch_period a multiple of accumulation_steps)")

    def scale(count: Any) -> Any:
        return count // old_k * new_k if is_int(count) else count

    plan = dict(first["plan"])
    if plan.get("batches") is not None and plan["batches"] % old_k == 0:
        plan["batches"] = scale(plan["batches"])
    metrics = _combined_metrics(estimator, [s["metrics"] for s in snapshots], new_world)
    handlers = _scaled_handlers(run.dispatch.by_name, first["handlers"], scale)
    cuda = estimator.device.type == "cuda"
    ledger = first.get("ledger")
    if ledger is not None:  # rank 0's: its steps counted like the position
        ledger = {"run_id": ledger["run_id"], "attempts": scale_steps(ledger["attempts"], scale)}
    # a sharded checkpoint's shards are laid out anew: its ranks' fingerprints no longer apply
    fingerprint = None if payload.get("sharded") else first.get("state_fingerprint")
    ranks = []
    for rank in range(new_world):
        seed = estimator.seed if new_world == 1 else rng.derive_seed(estimator.seed, rank)
        ranks.append({
            **first,
            "position": dict(position, batch=scale(position["batch"]), step=scale(position["step"])),
            "plan": plan,
            "handlers": copy.deepcopy(handlers),
            "metrics": metrics[rank],
            "rng": rng.seeded_state(seed, cuda=cuda),  # as fit seeds this rank; each micro-batch reseeds
            "pending_stop": any(s.get("pending_stop", False) for s in snapshots),
            "shared": [],
            "ledger": ledger,
            "state_fingerprint": fingerprint,
        })
    estimator.logger.info("Elastic resume: %s was written by %d processes x %d accumulation steps; mapped onto "
                          "%d x %d", source, old_world, old_k, new_world, new_k)
    return {**payload, "world_size": new_world, "ranks": ranks}


def batch_counters(handler: Any) -> list[str]:
    """The state keys of ``handler`` that count this process's batches: its own
    ``elastic_batch_counters`` and those of every class it derives from (a key ``"a.b"`` names
    entry ``b`` of the dict under ``a``)."""
    keys = list(getattr(handler, "__dict__", {}).get("elastic_batch_counters", ()))
    for cls in type(handler).__mro__:
        keys += [key for key in cls.__dict__.get("elastic_batch_counters", ()) if key not in keys]
    return keys


def _scaled_handlers(by_name: dict[str, Any], saved: dict[str, Any], scale: Callable[[Any], Any]) -> dict[str, Any]:
    """Rank 0's handler states with the counters of this process's batches scaled."""
    handlers = dict(saved)
    for name, handler in by_name.items():
        state = handlers.get(name)
        if isinstance(state, dict):
            handlers[name] = _scaled(state, batch_counters(handler), scale)
    return handlers


def _scaled(state: dict[str, Any], keys: list[str], scale: Callable[[Any], Any]) -> dict[str, Any]:
    """``state`` with the entries ``keys`` names (``"a.b"``: entry ``b`` of the dict ``a``) scaled."""
    nested: dict[str, list[str]] = {}
    for key in keys:
        outer, _, inner = key.partition(".")
        if inner:
            nested.setdefault(outer, []).append(inner)
    out = {}
    for key, value in state.items():
        if key in nested and isinstance(value, dict):
            out[key] = _scaled(value, nested[key], scale)
        else:
            out[key] = scale(value) if key in keys else value
    return out


def _combined_metrics(estimator: FitEstimator, saved: list[dict[str, Any]], new_world: int) -> list[dict[str, Any]]:
    """Per new rank: every metric's state, the saved ranks' accumulators combined (module notes)."""
    out: list[dict[str, Any]] = [{} for _ in range(new_world)]
    for metric in estimator.train_metrics + estimator.val_metrics:
        name = metric_name(metric)
        if not all(name in states for states in saved):
            continue
        if not isinstance(metric, Metric):
            warn_user(f"metric {name!r} is not an estimatorch Metric: its per-rank state cannot be combined onto "
                      f"{new_world} processes, so its running value restarts for this epoch (resume on the same "
                      "number of processes, or use estimatorch.metrics, to keep it)")
            continue
        for rank, state in enumerate(metric.combine_rank_states([states[name] for states in saved], new_world)):
            out[rank][name] = state
    return out


def world_size_error(path: str, payload: dict[str, Any]) -> CheckpointError:
    """The refusal of checkpoint ``payload`` (from ``path``), written on another world size, by a
    fit that cannot resume it there."""
    written, now = payload["world_size"], distributed.get_world_size()
    processes = f"{written} process{'es' if written != 1 else ''}"
    fingerprint = payload["ranks"][0].get("fingerprint") if payload["ranks"] else None
    if isinstance(fingerprint, dict) and is_elastic(fingerprint):
        return CheckpointError(f"{path} was written by {processes} of an elastic run; this run has {now}: pass "
                               "CheckpointHandler(..., elastic=True) to resume it on another world size (with the "
                               "same batch_size and batch_size x world_size x accumulation_steps)")
    return CheckpointError(f"{path} was written by {processes}; this run has {now}: resume with the same world "
                           "size (a run whose fits all pass CheckpointHandler(..., elastic=True) can resume on another "
                           "world size with the same batch_size x world_size x accumulation_steps)")
