"""The :class:`Metric` base: accumulators that stay on the device until :meth:`compute`."""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from .. import distributed

__all__ = ["Metric", "is_metric", "metric_name", "split_loss_metrics", "update_metrics"]


class Metric:
    """Base class for metrics that accumulate on the device and reduce across ranks.

    Subclasses declare their accumulators with :meth:`add_state` and implement :meth:`update`
    and :meth:`_value`. Tensor accumulators live on the metric's device: ``update`` never moves a
    value to the host. :meth:`compute` is the only place where a value crosses to the host; under
    ``torch.distributed`` it sums the accumulators over every rank first (so every rank must call
    it, as with any collective).

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

    def __init__(self, name: Optional[str] = None, *, device: Union[str, torch.device, None] = None):
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name or self.default_name
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._defaults: dict[str, Any] = {}

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

    def reset(self) -> None:
        """Clear the accumulators."""
        for attr, default in self._defaults.items():
            setattr(self, attr, self._fresh(default))

    def compute(self, *, sync: bool = True) -> float:
        """Return the metric's value as a python float (``nan`` before any update).

        Args:
            sync: sum the accumulators over every rank first. Every rank must then call it.
                Defaults to True; pass False for a rank-local value (e.g. a progress bar).
        """
        states = {attr: getattr(self, attr) for attr in self._defaults}
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
        return self

    def state_dict(self) -> dict[str, Any]:
        """The accumulators (tensors cloned, so later updates do not change the result)."""
        return {
            attr: (value.detach().clone() if isinstance(value, torch.Tensor) else value)
            for attr, value in ((a, getattr(self, a)) for a in self._defaults)
        }

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


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
