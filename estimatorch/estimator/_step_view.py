"""What a training step uses of the estimator: the module it calls, the mixed-precision context,
the items rule's weighing and ``backward``. A base class of :class:`~estimatorch.estimator.Estimator`,
which sets the attributes these read."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from .. import distributed

__all__ = ["StepView"]

_NO_AUTOCAST = contextlib.nullcontext()  # reusable: entering it does nothing


class StepView:
    """The members a batch processor calls during a step; :class:`Estimator` sets the attributes."""

    net: nn.Module
    device: torch.device
    cuda_graphs: bool
    grad_scaler: Optional[torch.amp.GradScaler]
    _ddp: Optional[nn.Module]
    _amp_dtype: Optional[torch.dtype]
    _step_items: Optional[distributed.StepItems]

    @property
    def train_net(self) -> nn.Module:
        """The module the training step calls: ``net``, wrapped in DDP under torch.distributed
        (unless it is sharded: see ``strategy``)."""
        return self._ddp if self._ddp is not None else self.net

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed-precision context of ``precision`` (a no-op for ``"32"``)."""
        if self._amp_dtype is None:
            return _NO_AUTOCAST
        # a captured step (cuda_graphs) keeps no cast weights across the graph: PyTorch's advice
        return torch.autocast(self.device.type, dtype=self._amp_dtype, cache_enabled=not self.cuda_graphs)

    @property
    def weighs_items(self) -> bool:
        """True during a fit whose optimizer steps span several micro-batches (accumulation, or
        several processes): :meth:`backward` then weighs each micro-batch's loss by its items, so
        that a step trains on the mean over every item of its micro-batches (see :meth:`backward`)."""
        return self._step_items is not None

    @property
    def step_items(self) -> Optional[distributed.StepItems]:
        """The items of the optimizer step under way, which ``GradientUpdateHandler`` divides the
        step's summed gradient by; None outside ``fit`` or when a step is one micro-batch."""
        return self._step_items

    def backward(self, loss: torch.Tensor, items: Any = None, *, mean: bool = True) -> None:
        """``loss.backward()``, scaled under ``"16-mixed"``; a per-sample loss is averaged.

        Where an optimizer step spans several micro-batches (:attr:`weighs_items`), the loss is
        weighed by its items first, so that the step's gradient, which ``GradientUpdateHandler``
        divides by the step's items on every rank, is that of the mean over all of them.

        Args:
            loss: the micro-batch's loss.
            items: how many items ``loss`` is over: a device tensor (labels other than the
                loss's ``ignore_index``, say) or an int. Defaults to None: the micro-batch's
                samples, counted along ``batch_axis`` from the batch ``fit`` passed to
                ``fit_batch`` (``BatchProcessor`` passes the count of :mod:`estimatorch._items`).
            mean: ``loss`` is the mean over its items; False: their sum (``reduction="sum"``),
                which the step divides by its items too. Defaults to True.

        Example:
            >>> from estimatorch import Estimator
            >>> net = nn.Linear(2, 1)
            >>> est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
            >>> est.backward(nn.functional.mse_loss(net(torch.ones(4, 2)), torch.zeros(4, 1)), items=4)
            >>> net.weight.grad.shape
            torch.Size([1, 2])
        """
        if loss.dim() > 0:
            loss = loss.mean()
        step_items = self._step_items
        if step_items is not None:
            loss = step_items.weigh(loss, items, mean)
        elif not mean:  # one micro-batch per step: the mean over its items
            if items is None:
                raise ValueError("backward(loss, mean=False) needs items=: the count the summed loss divides by")
            loss = loss / (items.clamp(min=1) if isinstance(items, torch.Tensor) else max(items, 1))
        if self.grad_scaler is not None:
            loss = self.grad_scaler.scale(loss)
        loss.backward()
