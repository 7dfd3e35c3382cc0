"""The items of an optimizer step: every micro-batch's loss weighed by its items, and the step's
summed gradient divided by the items of every micro-batch of the window on every rank, so that
the step trains on the mean over its items (the items rule; the counts: :mod:`estimatorch._items`).

A micro-batch of ``n`` items whose loss is their mean is weighed by ``n / u`` (its gradient is then
that of its items' sum, over ``u``); one whose loss is their sum by ``1 / u``. ``u`` is the unit of
a count: 1 for a count of labels (a device tensor), the samples of a full micro-batch for a count of
samples (a Python int), so that full micro-batches of samples weigh exactly 1 and train as before,
bit for bit, and only an uneven one (an epoch's last) is weighed. The step divides by ``N / u``,
``N`` the step's items (exact integers, summed as such): a window of ``k`` full micro-batches of
samples divides by ``k``, as a mean of means did.

Under DDP the gradients arrive averaged over the ``W`` ranks, so the step divides by ``N / W / u``
(the same floats as one process's ``/ (N / u)`` for a power-of-two ``W``: halving is exact).
``N`` needs no collective where every rank counts the same (samples of a distributed sampler's
equal shares: ``N = W x local``) or where the layout knows it (an elastic step of samples);
otherwise one all-reduce of one integer per optimizer step, started before the window's last
backward (``closing``) where the handler knows it comes, on a group of its own under gloo so that
it does not queue in front of the gradients.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from ._groups import gloo_group

__all__ = ["StepItems"]

Number = Union[torch.Tensor, int, float]


class StepItems:
    """This rank's items of the optimizer step under way, and the step's divisor.

    Args:
        world_size: the ranks a step spans.
        unit: the samples of a full micro-batch (the unit of a count of samples), or None to
            take the first count of samples seen (kept in the state).
        ranks_agree: every rank's window counts the same (no collective needed).
        leaves: the slot gradients are weighed by the reduction (``world_size_invariant``):
            :meth:`weigh` returns the loss as it is and records its weight in :attr:`weight`.
        step_total: ``step_total(step)``, the samples of optimizer step ``step`` of the epoch
            over every rank, where the data's layout knows it. Defaults to None.

    Example:
        >>> items = StepItems(world_size=1, unit=4, ranks_agree=True, accumulation_steps=2)
        >>> loss = items.weigh(torch.tensor(2.0), 4)   # a full micro-batch: weighs 1
        >>> loss = items.weigh(torch.tensor(2.0), 2)   # a half one: weighs 0.5
        >>> items.divisor(averaged=False), float(loss)
        (1.5, 1.0)
    """

    def __init__(self, world_size: int, unit: Optional[int], ranks_agree: bool, *, leaves: bool = False,
                 step_total: Optional[Callable[[int], int]] = None, accumulation_steps: int = 1):
        self.world_size, self.unit, self.ranks_agree, self.leaves = world_size, unit, ranks_agree, leaves
        self.step_total = step_total
        #: one micro-batch per rank and step, as many samples on every rank: their weights cancel out
        self._cancels = accumulation_steps == 1 and ranks_agree and not leaves
        #: a micro-batch of this window was weighed: the step divides (read by the handler)
        self.weighed = False
        #: the window's items on this rank so far (an exact integer: an int or an int64 tensor)
        self.local: Number = 0
        #: the weight of the last micro-batch's gradient (read by the reduction under ``leaves``)
        self.weight: Number = 1.0
        #: the next :meth:`weigh` is the window's last: start the count's all-reduce then
        self.closing = True
        #: the items of a micro-batch whose step passes none: its samples (set by the loop)
        self.default: Any = 1
        #: all-reduces started (counted for the tests)
        self.collectives = 0
        self._work: Any = None
        self._summed: Optional[torch.Tensor] = None

    # -- a micro-batch ---------------------------------------------------------------------------
    def weigh(self, loss: torch.Tensor, items: Any = None, mean: bool = True) -> torch.Tensor:
        """``loss`` (of ``items`` items, their mean or their sum) as the step's backward takes it,
        its items counted."""
        count = self.default if items is None else items
        tensor = isinstance(count, torch.Tensor)
        if self._cancels and not tensor and mean:  # the DDP step of before, unchanged
            return loss
        self.weighed = True
        if not tensor and self.unit is None:
            self.unit = max(int(count), 1)
        unit = 1 if tensor or self.unit is None else self.unit
        self.local = self.local + count
        if mean:
            weight: Number = count if tensor else (1.0 if count == unit else count / unit)
        else:
            weight = 1.0 if unit == 1 else 1.0 / unit
        self.weight = weight
        if self.closing:
            self.start_sum()
        if self.leaves or (not isinstance(weight, torch.Tensor) and weight == 1.0):
            return loss
        if isinstance(weight, torch.Tensor):  # no items: nothing of this micro-batch (a mean over none is NaN)
            return torch.where(weight > 0, loss * weight, torch.zeros_like(loss))
        return loss * weight

    # -- the step ----------------------------------------------------------------------------------
    def start_sum(self) -> None:
        """Start summing the window's count over the ranks (where a collective is needed)."""
        if self._needs_sum() and self._work is None:
            local = self.local
            summed = local.clone() if isinstance(local, torch.Tensor) else torch.tensor(int(local), dtype=torch.int64)
            self._summed = summed
            self._work = dist.all_reduce(summed, group=_count_group(summed), async_op=True)
            self.collectives += 1

    def divisor(self, averaged: bool, step: Optional[int] = None) -> Number:
        """What the step's summed gradient is divided by: ``N / u`` (``averaged``: gradients DDP or
        FSDP averaged over the ranks, ``N / W / u``); ``step``: the optimizer step of the epoch,
        for a layout that knows its items."""
        total = self._total(step)
        if isinstance(total, torch.Tensor):
            total = total.clamp(min=1).to(torch.float32)  # no items in the whole step: its gradient is 0
            return total / self.world_size if averaged else total
        unit = 1 if self.unit is None else self.unit
        value = total / unit if unit != 1 else total
        return value / self.world_size if averaged else value

    @property
    def wants_step(self) -> bool:
        """Whether :meth:`divisor` needs the optimizer step of the epoch (a layout that knows
        each step's items, on several ranks)."""
        return self.step_total is not None and self.world_size > 1 and not self.ranks_agree

    def reset(self) -> None:
        """A new window: nothing counted."""
        self.local, self.weight, self._work, self._summed, self.weighed = 0, 1.0, None, None, False

    def _needs_sum(self) -> bool:
        """Whether the window's count must be summed over the ranks: not in one process, not for
        samples every rank counts alike or the layout knows (labels are counted on each rank)."""
        samples = not isinstance(self.local, torch.Tensor)
        return self.world_size > 1 and not (samples and (self.ranks_agree or self.step_total is not None))

    def _total(self, step: Optional[int]) -> Number:
        if not self._needs_sum():
            if self.world_size == 1:
                return self.local
            if self.ranks_agree:
                return self.local * self.world_size
            assert self.step_total is not None and step is not None, "the step of a layout that knows its samples"
            return self.step_total(step)
        self.start_sum()  # a window cut short: no backward knew it closed
        assert self._summed is not None, "start_sum sums the count across ranks"
        if self._work is not None:
            self._work.wait()
            self._work = None
        summed = self._summed
        if isinstance(self.local, torch.Tensor):
            return summed
        return int(summed)  # a count of samples summed on the CPU: read, no device involved

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's count of the window under way (and the unit, once chosen)."""
        local = self.local.clone() if isinstance(self.local, torch.Tensor) else self.local
        return {"local": local, "unit": self.unit}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.local, self.unit = state["local"], state["unit"] if state["unit"] is not None else self.unit
        self.weighed = True

def _count_group(summed: torch.Tensor) -> Any:
    """Where a count is summed: the default group for a device tensor under NCCL; a gloo group of
    its own for a count on the CPU (under gloo too, so that it never queues in front of DDP's
    gradient buckets on the default group)."""
    if summed.device.type != "cpu":
        return None
    return gloo_group("items")
