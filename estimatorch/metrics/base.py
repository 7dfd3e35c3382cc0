"""The :class:`Metric` base: accumulators that stay on the device until :meth:`compute`."""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from .. import distributed

__all__ = ["Metric", "as_metric_list", "is_metric", "metric_name", "split_loss_metrics", "update_metrics"]


class Metric:
    """Base class for metrics that accumulate on the device and reduce across ranks.

    Subclasses declare their accumulators with :meth:`add_state` and implement :meth:`update`
    and :meth:`_value`. Tensor accumulators live on the metric's device: ``update`` never moves a
    value to the host. :meth:`compute` is the only place where a value crosses to the host; under
    ``torch.distributed`` it sums the accumulators over every rank first (so every rank must call
    it, as with any collective).

    Batched updates: a subclass may hand an update to :meth:`_defer` instead of applying it; up
    to ``max_pending`` updates (holding at most ``max_pending_bytes`` of tensors) are then folded
    into the accumulators in one vectorised pass by its :meth:`_fold`, which saves a training
    step several small device operations. ``compute`` folds pending updates into a copy, and
    folds are committed only every ``max_pending`` updates, so results do not depend on when a
    value was read; pending updates are part of :meth:`state_dict`, so a resumed run folds
    exactly as an uninterrupted one. Set ``max_pending = 1`` to fold every update at once (e.g.
    when outputs live in buffers that the next step overwrites, as with CUDA graphs).

    Args:
        name: the metric's display name. Defaults to the class's ``default_name``.
        device: where accumulators live. Defaults to the CPU; the estimator moves its metrics to
            its own device.

    Example:
        >>> import torch
        >>> from estimatorch.metrics import Accuracy
        >>> acc = Accuracy()
        >>> acc.update(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1]))
        >>> acc.compute()
        0.5
    """

    default_name = "metric"
    #: True when a larger value is better (used by ``mode='auto'``).
    higher_is_better = True
    #: updates kept pending before they are folded into the accumulators (1: fold each one).
    max_pending = 1
    #: fold early once pending updates hold this many bytes of tensors.
    max_pending_bytes = 8 << 20
    #: True when folding order cannot change the result (integer sums): state_dict folds first.
    _fold_order_free = False

    def __init__(self, name: Optional[str] = None, *, device: Union[str, torch.device, None] = None):
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name or self.default_name
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._defaults: dict[str, Any] = {}
        self._pending: list[Any] = []
        self._pending_bytes = 0

    # -- declaration -----------------------------------------------------------------------
    def add_state(self, attr: str, default: Union[torch.Tensor, int, float]) -> None:
        """Declare an accumulator: a tensor (kept on ``self.device``) or a python number.

        Python numbers suit counts known on the host (batch sizes); tensors suit values computed
        on the device. Both are summed across ranks by :meth:`compute`.
        """
        self._defaults[attr] = default
        setattr(self, attr, self._fresh(default))

    def _fresh(self, default: Any) -> Any:
        if isinstance(default, torch.Tensor):
            return default.detach().clone().to(self.device)
        return default

    # -- the metric protocol ---------------------------------------------------------------
    def update(self, preds: Any, target: Any) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _value(self, states: dict[str, Any]) -> torch.Tensor:  # pragma: no cover - abstract
        """Turn (reduced) accumulators into the metric's value, a 0-dim tensor."""
        raise NotImplementedError

    def _fold(self, items: list[Any]) -> dict[str, torch.Tensor]:  # pragma: no cover - abstract
        """The increments of the accumulators for pending updates ``items`` (see :meth:`_defer`)."""
        raise NotImplementedError

    def _defer(self, item: Any, nbytes: int) -> None:
        """Keep an update pending; fold the pending ones once there are ``max_pending`` of them
        (or ``max_pending_bytes``)."""
        self._pending.append(item)
        self._pending_bytes += nbytes
        if len(self._pending) >= self.max_pending or self._pending_bytes >= self.max_pending_bytes:
            self._commit_pending()

    def _commit_pending(self) -> None:
        if self._pending:
            items, self._pending, self._pending_bytes = self._pending, [], 0
            for attr, increment in self._fold(items).items():
                getattr(self, attr).add_(increment)

    def _states(self) -> dict[str, Any]:
        """The accumulators with the pending updates folded in (into copies)."""
        states = {attr: getattr(self, attr) for attr in self._defaults}
        if self._pending:
            for attr, increment in self._fold(self._pending).items():
                states[attr] = states[attr] + increment
        return states

    def reset(self) -> None:
        """Clear the accumulators."""
        for attr, default in self._defaults.items():
            setattr(self, attr, self._fresh(default))
        self._pending, self._pending_bytes = [], 0

    def compute(self, *, sync: bool = True) -> float:
        """Return the metric's value as a python float (``nan`` before any update).

        Args:
            sync: sum the accumulators over every rank first. Every rank must then call it.
                Defaults to True; pass False for a rank-local value (e.g. a progress bar).
        """
        states = self._states()
        if sync and distributed.get_world_size() > 1:
            states = distributed.all_reduce_sum(states, self.device)
        value = self._value(states)
        return float(value) if isinstance(value, torch.Tensor) else float(value)

    def to(self, device: Union[str, torch.device]) -> "Metric":
        """Move the accumulators to ``device`` and return ``self``."""
        self.device = torch.device(device)
        for attr in self._defaults:
            value = getattr(self, attr)
            if isinstance(value, torch.Tensor):
                setattr(self, attr, value.to(self.device))
        self._pending = _map_tensors(self._pending, lambda t: t.to(self.device))
        return self

    def state_dict(self) -> dict[str, Any]:
        """The accumulators and pending updates (tensors cloned: later updates do not change it)."""
        if self._fold_order_free:
            self._commit_pending()
        state = {
            attr: (value.detach().clone() if isinstance(value, torch.Tensor) else value)
            for attr, value in ((a, getattr(self, a)) for a in self._defaults)
        }
        state["pending"] = _map_tensors(self._pending, lambda t: t.detach().clone())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore accumulators saved by :meth:`state_dict`.

        Raises:
            ValueError: naming the first missing accumulator.
        """
        for attr, default in self._defaults.items():
            if attr not in state:
                raise ValueError(f"state of metric {self.name!r} is missing the key {attr!r}")
            value = state[attr]
            if isinstance(default, torch.Tensor):
                value = torch.as_tensor(value).to(device=self.device, dtype=default.dtype).clone()
            setattr(self, attr, value)
        pending = _map_tensors(list(state.get("pending", [])), lambda t: t.to(self.device).clone())
        self._pending = [tuple(item) for item in pending]
        self._pending_bytes = sum(t.numel() * t.element_size() for item in self._pending for t in item
                                  if isinstance(t, torch.Tensor))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _map_tensors(items: list[Any], fn: Any) -> list[Any]:
    """Apply ``fn`` to every tensor of a list of tuples."""
    return [tuple(fn(x) if isinstance(x, torch.Tensor) else x for x in item) for item in items]


def _ratio(numerator: torch.Tensor, count: Union[int, float, torch.Tensor]) -> torch.Tensor:
    if isinstance(count, torch.Tensor):
        return numerator / count
    if count == 0:
        return torch.tensor(math.nan)
    return numerator / count


def is_metric(obj: Any) -> bool:
    """True for a :class:`Metric` or anything with its duck type (``update``, ``compute``,
    ``reset``), e.g. a torchmetrics metric."""
    if isinstance(obj, Metric):
        return True
    if isinstance(obj, type):
        return False
    return all(callable(getattr(obj, m, None)) for m in ("update", "compute", "reset"))


def as_metric_list(metrics: Any, arg: str) -> list[Any]:
    """One metric or a list/tuple of them, as a list (None: empty); anything else is a
    ``TypeError`` naming ``arg`` and the value."""
    if metrics is None:
        return []
    items = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
    for item in items:
        if not is_metric(item):
            raise TypeError(f"{arg} must hold metrics (objects with update/compute/reset), got {item!r}")
    return items


def metric_name(metric: Any) -> str:
    """The display name of any metric-like object."""
    name = getattr(metric, "name", None)
    return name if isinstance(name, str) and name else type(metric).__name__.lower()


def split_loss_metrics(metrics: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(loss metrics, other metrics)``: loss metrics are updated with the loss, the others
    with the predictions (a metric counts as a loss metric if it is a ``Loss`` or sets
    ``is_loss_metric = True``)."""
    from .loss import Loss

    losses = [m for m in metrics if isinstance(m, Loss) or getattr(m, "is_loss_metric", False)]
    return losses, [m for m in metrics if not any(m is l for l in losses)]


def update_metrics(loss_metrics: list[Any], other_metrics: list[Any], pred: Any, label: Any,
                   loss: Any) -> None:
    """Update loss metrics with ``(loss, label)`` and the others with ``(pred, label)``."""
    for metric in loss_metrics:
        metric.update(loss, label)
    for metric in other_metrics:
        metric.update(pred, label)
