"""The estimator as a checkpoint store sees it: :class:`ResumableFit`, the seam through which a
store takes a fit's state to disk and brings it back. It is declared here, at the store's layer,
because the store imports nothing above it; the handlers' ``EstimatorView`` extends it (a handler
hands the estimator to the store) and ``Estimator`` satisfies it."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import nn

__all__ = ["ResumableFit"]


class ResumableFit(Protocol):
    """The fit in progress, for a store: its training state, and the payload seam
    (``Estimator.state_payload`` / ``check_payload`` / ``load_payload``)."""

    #: the model (its plain module's keys are saved whatever wraps it)
    net: nn.Module
    #: the optimizer (a torch optimizer, or None)
    optimizer: Any
    #: the learning-rate scheduler the estimator steps (through ``LRSchedulerHandler``), or None
    lr_scheduler: Any
    #: the gradient scaler of ``precision="fp16"``, else None
    grad_scaler: Optional[torch.amp.GradScaler]

    def state_payload(self, *, gather: bool = True) -> Optional[dict[str, Any]]:
        """Everything needed to resume the current fit (rank 0's; None on the others)."""

    def check_payload(self, payload: dict[str, Any], source: str, *, rank: Optional[int] = None) -> dict[str, Any]:
        """Check a payload against the current fit without changing anything."""

    def load_payload(self, payload: dict[str, Any], source: str) -> None:
        """Resume the current fit from a checked payload."""
