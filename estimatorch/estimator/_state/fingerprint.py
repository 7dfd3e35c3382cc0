"""The fingerprint of the training state a checkpoint holds: taken at every save (the parameters'
and optimizer state's bits, see :mod:`estimatorch.distributed._replicas`), recorded in the snapshot
as ``state_fingerprint``, and checked once a resume has restored that state, before the first
step: a restore that does not give back the bits that were saved (a damaged file that still reads,
a restore that casts or drops a value) is named then, not discovered as a drift of the results."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ... import distributed
from ..._saved import CheckpointError
from .._fit_estimator import FitEstimator

__all__ = ["check_restored", "training_fingerprint"]


def training_fingerprint(estimator: FitEstimator) -> torch.Tensor:
    """The fingerprint of this rank's parameters and optimizer state (0-dim int64, on the
    device: no host-device synchronisation)."""
    return distributed.state_fingerprint(distributed.state_tensors(estimator.net, estimator.optimizer))


def check_restored(estimator: FitEstimator, expected: Optional[Any], source: str) -> None:
    """The state restored from ``source`` has the fingerprint saved with it (``expected``: an
    int64 tensor, or None for a file of an earlier version: nothing to check).

    Raises:
        CheckpointError: naming ``source`` and both fingerprints.
    """
    if expected is None:
        return
    want, have = int(expected), int(training_fingerprint(estimator))
    if have != want:
        raise CheckpointError(
            f"the training state restored from {source} is not the state that was saved: its fingerprint is "
            f"{have & (2**64 - 1):#018x}, the checkpoint recorded {want & (2**64 - 1):#018x} (the file is damaged "
            "though it reads, or the restore changed a value). Nothing was trained from it: resume from an "
            "older checkpoint (move this one away)")
