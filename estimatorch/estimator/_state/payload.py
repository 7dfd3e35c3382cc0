"""The payload a checkpoint store moves: the training state and every rank's snapshot, as
``Estimator.state_payload`` gives it and ``check_payload`` / ``load_payload`` take it back (the
store interface is described in docs/architecture.md)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ... import checkpoint, distributed
from ..._saved import CheckpointError
from .._fit_estimator import FitEstimator
from .elastic_resume import map_payload, world_size_error
from .fingerprint import training_fingerprint
from .run import Run, check_positions, check_snapshot, take_snapshot

__all__ = ["check_payload", "payload_of", "snapshot_to_resume"]


def payload_of(estimator: FitEstimator, run: Run, gather: bool = True) -> Optional[dict[str, Any]]:
    """Every rank's snapshot gathered on global rank 0 with the training state (None elsewhere);
    or, without ``gather``, this rank's part on every rank: its ``snapshot``, ``rank``,
    ``world_size`` and the training state but ``model`` and ``optimizer`` (a sharded store
    writes those through DCP)."""
    snapshot = take_snapshot(estimator, run)
    snapshot["state_fingerprint"] = _saved_fingerprint(estimator, run)
    run.ledger.saved(snapshot["ledger"])
    rest = {
        "optimizer_class": type(estimator.optimizer).__name__,
        "lr_scheduler": estimator.lr_scheduler.state_dict() if estimator.lr_scheduler is not None else None,
        "grad_scaler": estimator.grad_scaler.state_dict() if estimator.grad_scaler is not None else None,
    }
    if not gather:
        return {"world_size": distributed.get_world_size(), "rank": distributed.get_rank(), **rest,
                "snapshot": snapshot}
    ranks = distributed.gather_to_main(snapshot)
    if ranks is None:  # not rank 0: its snapshot went there
        return None
    return {
        "world_size": len(ranks),
        "model": checkpoint.model_state(estimator.net),
        "optimizer": estimator.optimizer.state_dict(),
        **rest,
        "ranks": ranks,
    }


def _saved_fingerprint(estimator: FitEstimator, run: Run) -> Union[int, torch.Tensor]:
    """The fingerprint of the state this save holds (an int); with the replica check on, once
    every rank has the same (else the save raises ``ReplicaDivergenceError`` before anything is
    written). On a CUDA device in one process it stays there, a tensor (staged with the state: no
    synchronisation)."""
    if run.replicas is not None:
        pos = run.pos
        return int(run.replicas.check(estimator, pos.step, f"the check before the checkpoint of step {pos.step} "
                                      "(not written)"))
    fingerprint = training_fingerprint(estimator)
    return int(fingerprint) if fingerprint.device.type == "cpu" or distributed.is_distributed() else fingerprint


def check_payload(estimator: FitEstimator, run: Run, payload: dict[str, Any], source: str, rank: int) -> dict[str, Any]:
    """``payload`` mapped onto this fit (an elastic run's) and checked as rank ``rank`` reads it."""
    payload = map_payload(estimator, run, payload, source)
    try:
        check_positions(payload["ranks"])
        if rank >= len(payload["ranks"]):
            raise CheckpointError(f"it holds {len(payload['ranks'])} rank snapshots, none for rank {rank}")
        snapshot = checkpoint.rank_snapshot(payload, rank)
        # The data's refusal comes before any other check (a state of another layout would read as a
        # damaged file, skipped for an older one); a file of another world size is load_payload's to refuse.
        if isinstance(snapshot.get("fingerprint"), dict) and payload["world_size"] == distributed.get_world_size():
            run.stream.check_fingerprint(snapshot["fingerprint"], source)
        check_snapshot(estimator, run, snapshot)
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None
    return payload


def snapshot_to_resume(estimator: FitEstimator, payload: dict[str, Any], source: str) -> dict[str, Any]:
    """This rank's snapshot in ``payload``, once it is known to be of this world size; marks the
    optimizer as stepped when the run had trained."""
    if payload["world_size"] != distributed.get_world_size():
        raise world_size_error(source, payload)
    snapshot = checkpoint.rank_snapshot(payload, distributed.get_rank())
    if not payload.get("sharded"):  # a file holds rank 0's state: every rank restores that
        snapshot["state_fingerprint"] = payload["ranks"][0].get("state_fingerprint")
    if snapshot["position"]["step"] > 0 and estimator.optimizer is not None:
        # The optimizer stepped before the checkpoint (in the process that wrote it): tell the LR
        # scheduler's "step() before optimizer.step()" check, which reads this torch marker.
        estimator.optimizer._opt_called = True
    return snapshot
