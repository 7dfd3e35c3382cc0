"""GradientUpdateHandler: step the optimizer, with gradient accumulation and clipping."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import distributed
from .._checks import check_positive_int, check_state_keys, is_real
from ..distributed import StepItems
from ..events import BatchBegin, BatchEnd, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd
from ._invariant_step import Reduction, invariant_reduction, release

__all__ = ["GradientUpdateHandler"]


def local(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's tensor on this rank: a sharded (DTensor) gradient's shard, else the gradient."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


def divide_(params: list[torch.nn.Parameter], divisor: Any) -> None:
    """Divide every gradient by ``divisor`` (a number or a device tensor; 1 does nothing)."""
    if not isinstance(divisor, torch.Tensor) and divisor == 1:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_div_(grads, divisor)


class GradientUpdateHandler(StatefulHandler, TrainBegin, BatchBegin, BatchEnd, EpochEnd, TrainEnd):
    """Step the optimizer (and the grad scaler under ``"16-mixed"``), then zero the gradients.

    Runs at priority -2000, first in ``batch_end``. With ``accumulation_steps=k`` the gradients
    of ``k`` batches are summed before a step; an epoch's leftover batches are stepped at its
    end. Accumulated gradients are part of the state, so a resume between steps is exact.

    **The items rule.** A step's loss is the mean over its items, counted over every batch of the
    window and every rank: the labels other than the loss's ``ignore_index`` (-100 for a model's
    own loss, a causal LM's shifted labels) for a token loss, else the samples (see
    :mod:`estimatorch._items`). ``estimator.backward`` weighs each batch's loss by its items, and
    the step divides the summed gradient by the step's items (after DDP's or FSDP's average over
    the ranks, by the items over the ranks' number), before clipping and the step: batch 8 trains
    as 4 x 2 accumulation and as 2 ranks x 4, padded or not, and an uneven last batch weighs its
    samples. Full batches of samples weigh 1, so their window divides by ``k`` as before.

    **world_size_invariant.** Under ``Estimator(world_size_invariant=True)`` no backward is
    synchronised: each batch's gradient is computed alone, weighed by its items and folded into
    the canonical tree over the step's ``S = W x k`` micro-batches; at the window's end the ranks
    combine their partial sums (:func:`estimatorch.distributed.slot_reduction`), and the clip
    takes a norm added up by rows (:func:`estimatorch.distributed.clip_by_rows_`): the same bits
    on any split of the same micro-batches.

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
        self._items: Optional[StepItems] = None  # the fit's items of a step (several micro-batches)
        self._averaged = False  # gradients arrive averaged over the ranks (DDP, FSDP)
        self._slots: Optional[Reduction] = None  # world_size_invariant: the canonical sum of the slots
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
        self._items = estimator.step_items
        self._averaged = distributed.is_distributed()
        plain = self.accumulation_steps == 1 and self.clip_grad_norm is None and estimator.grad_scaler is None
        self._plain_optimizer = estimator.optimizer if plain else None
        net = estimator.train_net
        self._ddp = net if self.accumulation_steps > 1 and isinstance(net, DistributedDataParallel) else None
        self._slots = None
        if estimator.world_size_invariant:
            self._slots = invariant_reduction(estimator, self._params, self.accumulation_steps)
            self._plain_optimizer, self._ddp, self._averaged = None, None, False

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Under DDP, let only the batch that completes a window synchronise its gradients (DDP
        reads the flag in its forward, which must see it as well as the backward); the step's
        items are summed over the ranks from that batch's backward on."""
        closing = self.pending + 1 >= self.accumulation_steps
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = closing
        if self._items is not None:
            self._items.closing = closing
        if self._slots is not None:
            self._slots.begin(self.pending, closing)

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = True  # DDP's default, for whatever runs next
            self._ddp = None
        if self._slots is not None:
            release(estimator)
        self._items = None

    @property
    def reduction(self) -> Optional[Reduction]:
        """The canonical sum of the slots of the current (or last) ``world_size_invariant`` fit,
        with its counts (``bytes_sent``, ``collectives``); None for another fit."""
        return self._slots

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
            items = self._items
            if items is not None and items.weighed:  # a micro-batch on each of several ranks, weighed
                self._divide(estimator, items)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.stepped = True
            return
        if self._slots is not None:  # this batch's gradient, alone, into the tree
            self._slots.fold(self.pending, self._items.weight if self._items is not None else 1.0)
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
        if self._slots is not None:
            self._slots.finish(self.pending)  # the step's sum, the same floats on any split
        items = self._items
        if items is not None:  # the items rule: the summed gradient over the step's items
            if items.weighed:
                self._divide(estimator, items)
        elif self.pending > 1:  # outside fit (a handler driven by hand): the mean of the batches
            divide_(self._params, self.pending)
        if self.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if self._slots is not None:
                distributed.clip_by_rows_(self._params, self.clip_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.pending = 0

    def _divide(self, estimator: EstimatorView, items: StepItems) -> None:
        """Divide the step's summed gradient by its items (over the ranks); a new window."""
        step = estimator.position.batch // self.accumulation_steps if items.wants_step else None
        divide_(self._params, items.divisor(self._averaged, step))
        items.reset()

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
            if self.pending and self._slots is None else None
        items = self._items.state_dict() if self.pending and self._items is not None else None
        state: dict[str, Any] = {"pending": self.pending, "grads": grads, "items": items}
        if self._slots is not None:  # the window's partial sums (this rank's)
            state["slots"] = self._slots.state_dict() if self.pending else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("pending", "grads"), self.name)
        self.pending = state["pending"]
        if self._items is not None:  # (a state of before the items rule has none: the window restarts counting)
            if state.get("items") is not None:
                self._items.load_state_dict(state["items"])
            else:
                self._items.reset()
        if self._slots is not None:
            self._slots.load_state_dict(state.get("slots"))
        if state["grads"] is not None:
            if len(state["grads"]) != len(self._params):
                raise ValueError(f"state of {self.name} holds {len(state['grads'])} gradients for "
                                 f"{len(self._params)} parameters")
            for p, g in zip(self._params, state["grads"]):
                p.grad = None if g is None else g.to(p.device).clone()
