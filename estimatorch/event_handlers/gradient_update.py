"""GradientUpdateHandler: step the optimizer, with gradient accumulation and clipping."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import distributed
from .._checks import check_positive_int, check_state_keys, is_real
from ..events import BatchBegin, BatchEnd, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd

__all__ = ["GradientUpdateHandler"]


class GradientUpdateHandler(StatefulHandler, TrainBegin, BatchBegin, BatchEnd, EpochEnd, TrainEnd):
    """Step the optimizer (and the grad scaler under ``"16-mixed"``), then zero the gradients.

    Runs at priority -2000, first in ``batch_end``. With ``accumulation_steps=k`` the gradients
    of ``k`` batches are averaged before a step; an epoch's leftover batches are stepped at its
    end. Accumulated gradients are part of the state, so a resume between steps is exact.

    Under DDP with ``k > 1`` only the batch that completes a window synchronises gradients
    across ranks (DDP's ``no_sync`` for the forward and backward of the ``k - 1`` others); a
    window cut short (an epoch's leftover, a stop) is averaged across ranks in one all-reduce
    before its step. The accumulated gradients then differ per rank, so each rank's are saved.

    Args:
        accumulation_steps: batches per optimizer step. Defaults to 1.
        clip_grad_norm: clip the gradients' total 2-norm to this value before stepping.
            Defaults to None (no clipping).

    Example:
        >>> h = GradientUpdateHandler(accumulation_steps=4, clip_grad_norm=1.0)
        >>> h.accumulation_steps, h.clip_grad_norm
        (4, 1.0)
    """

    priority = -2000
    accumulation_steps: int
    state_attributes = ("pending",)
    # gradients accumulated under DDP's no_sync differ per rank: saved for every rank

    def __init__(self, accumulation_steps: int = 1, clip_grad_norm: Optional[float] = None):
        self.accumulation_steps = check_positive_int(accumulation_steps, "accumulation_steps")
        if clip_grad_norm is not None and (not is_real(clip_grad_norm) or not clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a positive number or None, got {clip_grad_norm!r}")
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.pending = 0
        self._params: list[torch.nn.Parameter] = []
        self._plain_optimizer: Any = None
        self._ddp: Optional[DistributedDataParallel] = None  # synchronised only at a window's end
        #: whether the optimizer stepped at the last batch_end (read by handlers that follow
        #: optimizer steps, e.g. a per-batch LR schedule under gradient accumulation)
        self.stepped = False

    def listens_to(self, event: str) -> bool:
        """``batch_begin`` (choosing whether DDP synchronises this batch) only with accumulation."""
        return event != "batch_begin" or self.accumulation_steps > 1

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.pending = 0
        self._params = [p for group in estimator.optimizer.param_groups for p in group["params"]]
        # Gradients left by earlier work (a fit that failed mid-accumulation, a manual backward)
        # must not leak into this run's first step; a resume loads its saved ones afterwards.
        estimator.optimizer.zero_grad(set_to_none=True)
        plain = self.accumulation_steps == 1 and self.clip_grad_norm is None and estimator.grad_scaler is None
        self._plain_optimizer = estimator.optimizer if plain else None
        net = estimator.train_net
        self._ddp = net if self.accumulation_steps > 1 and isinstance(net, DistributedDataParallel) else None

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Under DDP, let only the batch that completes a window synchronise its gradients (DDP
        reads the flag in its forward, which must see it as well as the backward)."""
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = self.pending + 1 >= self.accumulation_steps

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = True  # DDP's default, for whatever runs next
            self._ddp = None

    @property
    def capturable_batch_end(self) -> bool:
        """A step of every batch (no accumulation) can be recorded in the step's CUDA graph: the
        clipping and the optimizer's step are device work (its capturable mode, which
        ``cuda_graphs=True`` turns on). A subclass overriding ``batch_end`` must say so itself."""
        return self.accumulation_steps == 1 and type(self).batch_end is GradientUpdateHandler.batch_end

    def record_batch_end(self, estimator: EstimatorView) -> Callable[[], None]:
        """After each replay the optimizer has stepped (``stepped``, read by per-batch schedules)."""
        return self._replayed

    def _replayed(self) -> None:
        self.stepped = True

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        optimizer = self._plain_optimizer
        if optimizer is not None:  # the common case, kept short: it runs every step
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.stepped = True
            return
        self.pending += 1
        self.stepped = self.pending >= self.accumulation_steps
        if self.stepped:
            self._step(estimator)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.stepped = bool(self.pending)  # an epoch's leftover batches: one more step
        if self.pending:
            self._step(estimator)

    def _step(self, estimator: EstimatorView) -> None:
        optimizer, scaler = estimator.optimizer, estimator.grad_scaler
        if self._ddp is not None and self.pending < self.accumulation_steps:
            self._synchronise(self._ddp)  # a window cut short: its batches ran under no_sync
        if self.pending > 1:
            for p in self._params:
                if p.grad is not None:
                    p.grad.div_(self.pending)
        if self.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.pending = 0

    def _synchronise(self, ddp: DistributedDataParallel) -> None:
        """Average the accumulated gradients over the ranks, as DDP's synchronised backward would
        have (a parameter without a gradient counts as zeros, so every rank sends the same shapes)."""
        params = [p for p in ddp.module.parameters() if p.requires_grad]  # what DDP synchronises
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        distributed.all_reduce_mean_([p.grad for p in params], ddp.process_group)

    def state_dict(self) -> dict[str, Any]:
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in self._params] \
            if self.pending else None
        return {"pending": self.pending, "grads": grads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("pending", "grads"), self.name)
        self.pending = state["pending"]
        if state["grads"] is not None:
            if len(state["grads"]) != len(self._params):
                raise ValueError(f"state of {self.name} holds {len(state['grads'])} gradients for "
                                 f"{len(self._params)} parameters")
            for p, g in zip(self._params, state["grads"]):
                p.grad = None if g is None else g.to(p.device).clone()
