"""The optimizer an ``Estimator`` built without one trains with, and the warning ``fit`` gives once
when it does.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..._checks import warn_user
from .._fit_estimator import FitEstimator

__all__ = ['default_optimizer', 'warn_default_optimizer']


#: the optimizer an ``Estimator`` built without one uses, as its warning shows it.
DEFAULT_OPTIMIZER = "torch.optim.SGD(net.parameters(), lr=0.01)"


def default_optimizer(net: nn.Module) -> Optional[torch.optim.Optimizer]:
    """``Estimator(optimizer=None)``'s optimizer: SGD with lr 0.01 over ``net``'s trainable
    parameters (None without any). Built silently: an estimator only used to evaluate or
    predict never trains with it; ``fit`` warns (:func:`warn_default_optimizer`)."""
    params = [p for p in net.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.01) if params else None


def warn_default_optimizer(estimator: FitEstimator, default: Optional[torch.optim.Optimizer]) -> None:
    """Warn at the user's ``fit`` line when it trains with the default optimizer ``default``
    (still the one it was built with); the estimator passes it until a fit has started, so the
    warning comes once per estimator."""
    if default is not None and estimator.optimizer is default:
        warn_user(f"no optimizer given to Estimator: fit trains with {DEFAULT_OPTIMIZER}. Pass "
                  "Estimator(..., optimizer=...) to choose one")
