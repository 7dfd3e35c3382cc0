"""The :class:`Metric` base: accumulators that stay on the device until :meth:`compute`."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

from .. import distributed

__all__ = ["Metric", "as_metric_list", "is_metric", "metric_name", "split_loss_metrics", "update_metrics"]


class Metric:
    """Base class for metrics that accumulate on the device and reduce across ranks.

    Subclasses declare their accumulators with :meth:`add_state` and implement :meth:`update`
    and :meth:`_value`. Tensor accumulators live on the metric's device: ``update`` never moves a
    value to the host. :meth:`compute` is the only place where a value crosses to the host; under
    ``torch.distributed`` it first reduces every accumulator over the ranks (so every rank must
    call it, as with any collective), each by the ``reduce`` it was declared with:

    - ``"sum"`` (the default): counts and totals;
    - ``"mean"``: the average of the ranks' values;
    - ``"min"`` / ``"max"``: a smallest or largest value seen (declare it with the identity as
      default, ``+inf`` / ``-inf``, so a rank that saw nothing does not count);
    - ``"cat"``: a list of tensors that ``update`` appends to (default ``[]``), or a tensor;
      :meth:`_value` receives the concatenation along dim 0 of every rank's items, rank 0's
      first (``torch.zeros(0)`` when there are none anywhere).

    :meth:`_value` receives the reduced states the same way in one process, so a metric gives
    the value over all ranks' samples. The reduction costs one collective for sums and means,
    one for maxima and minima, and one host gather for ``cat`` states, each only if used.

    Batched updates: a subclass may hand an update to :meth:`_defer` instead of applying it; up
    to ``max_pending`` updates (holding at most ``max_pending_bytes`` of tensors) are then folded
    into the accumulators in one vectorised pass by its :meth:`_fold` (whose results are combined
    with each state by its ``reduce``: added for sums and means, the larger or smaller kept for
    maxima and minima, appended for ``cat``), which saves a training
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

        A custom metric whose state is a maximum (summed, it would be wrong across ranks):

        >>> class MaxError(Metric):
        ...     higher_is_better = False
        ...     def __init__(self):
        ...         super().__init__("max_error")
        ...         self.add_state("worst", torch.tensor(float("-inf")), reduce="max")
        ...     def update(self, preds, target):
        ...         self.worst = torch.maximum(self.worst, (preds - target).abs().max())
        ...     def _value(self, states):
        ...         return states["worst"]
        >>> m = MaxError()
        >>> m.update(torch.tensor([1.0, 5.0]), torch.tensor([0.0, 0.0]))
        >>> m.update(torch.tensor([3.0]), torch.tensor([0.0]))
        >>> m.compute()
        5.0
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
    #: True when :meth:`update` can be recorded in a CUDA graph (``Estimator(cuda_graphs=True)``):
    #: it reads no value on the host (its checks read shapes and dtypes only), every accumulator
    #: is a ``"sum"``, its tensors are updated in place, and its number accumulators are ints
    #: that grow by the same amount for every batch of one shape (a float's growth, read as a
    #: difference, is not exact). See :meth:`update_now`.
    capturable = False

    def __init__(self, name: Optional[str] = None, *, device: Union[str, torch.device, None] = None):
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name or self.default_name
        self.device = _device(device)
        self._defaults: dict[str, Any] = {}
        self._reductions: dict[str, str] = {}
        self._pending: list[Any] = []
        self._pending_bytes = 0

    # -- declaration -----------------------------------------------------------------------
    def add_state(self, attr: str, default: Union[torch.Tensor, int, float, list], reduce: str = "sum") -> None:
        """Declare an accumulator: a tensor (kept on ``self.device``), a python number, or a list
        of tensors.

        Python numbers suit counts known on the host (batch sizes); tensors suit values computed
        on the device; a list (``reduce="cat"``) collects per-update tensors. :meth:`reset`
        returns the state to a copy of ``default``.

        Args:
            attr: the attribute that holds the state (not ``"pending"``, which ``state_dict``
                uses).
            default: the state's value after :meth:`reset`.
            reduce: how :meth:`compute` combines this state over the ranks: ``"sum"``,
                ``"mean"``, ``"min"``, ``"max"`` or ``"cat"`` (see the class notes).
                Defaults to ``"sum"``.
        """
        if not isinstance(attr, str) or not attr.isidentifier() or attr == "pending":
            raise ValueError(f"attr must be an identifier other than 'pending', got {attr!r}")
        if reduce not in distributed.REDUCTIONS:
            raise ValueError(f"reduce must be one of {list(distributed.REDUCTIONS)}, got {reduce!r}")
        if isinstance(default, list):
            if reduce != "cat":
                raise ValueError(f"a list state ({attr!r}) must use reduce='cat', got reduce={reduce!r}")
            if not all(isinstance(t, torch.Tensor) for t in default):
                raise TypeError(f"the default of {attr!r} must be a list of tensors, got {default!r}")
        elif reduce == "cat" and not isinstance(default, torch.Tensor):
            raise TypeError(f"a 'cat' state ({attr!r}) needs a list or a tensor default, got {default!r}")
        elif isinstance(default, bool) or not isinstance(default, (torch.Tensor, int, float)):
            raise TypeError(f"the default of {attr!r} must be a tensor, an int or a float, got {default!r}")
        self._defaults[attr] = default
        self._reductions[attr] = reduce
        setattr(self, attr, self._fresh(default))

    def _fresh(self, default: Any) -> Any:
        if isinstance(default, torch.Tensor):
            return default.detach().clone().to(self.device)
        if isinstance(default, list):
            return [t.detach().clone().to(self.device) for t in default]
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
                state = getattr(self, attr)
                if self._reductions[attr] in ("sum", "mean") and isinstance(state, torch.Tensor):
                    state.add_(increment)
                else:
                    setattr(self, attr, _combine(self._reductions[attr], state, increment))

    def _states(self) -> dict[str, Any]:
        """The accumulators with the pending updates folded in (into copies)."""
        states = {attr: getattr(self, attr) for attr in self._defaults}
        if self._pending:
            for attr, increment in self._fold(self._pending).items():
                states[attr] = _combine(self._reductions[attr], states[attr], increment)
        return states

    def update_now(self, preds: Any, target: Any) -> dict[str, Union[int, float]]:
        """:meth:`update`, folded into the accumulators at once (tensors added to in place, no
        update left pending): the update a captured train step records in its CUDA graph.
        Returns how much each number accumulator grew, which a replay of the graph does not
        repeat: :meth:`add_counts` adds it after each replay.

        Example:
            >>> from estimatorch.metrics import Loss
            >>> m = Loss()
            >>> total = m.total
            >>> m.update_now(torch.tensor(2.0), torch.zeros(4))
            {'count': 4}
            >>> m.total is total, float(m.total)
            (True, 8.0)
        """
        numbers = {attr: getattr(self, attr) for attr, default in self._defaults.items()
                   if not isinstance(default, (torch.Tensor, list))}
        self.update(preds, target)
        self._commit_pending()
        return {attr: getattr(self, attr) - before for attr, before in numbers.items()}

    def add_counts(self, grown: Mapping[str, Union[int, float]]) -> None:
        """Add ``grown`` (what :meth:`update_now` returned) to the number accumulators: the host
        side of a replayed update."""
        for attr, amount in grown.items():
            setattr(self, attr, getattr(self, attr) + amount)

    def reset(self) -> None:
        """Clear the accumulators. A tensor is cleared in place (a CUDA graph that adds to it
        keeps adding to the same memory); one of another shape, dtype or device is replaced."""
        for attr, default in self._defaults.items():
            current = getattr(self, attr)
            if isinstance(default, torch.Tensor) and isinstance(current, torch.Tensor) and \
                    current.shape == default.shape and current.dtype == default.dtype and _on(current, self.device) \
                    and (torch.is_inference_mode_enabled() or not current.is_inference()):
                if default.numel() == 1 and default.device.type == "cpu":
                    current.fill_(default.item())  # a number from the host: no copy to wait for
                else:
                    current.copy_(default)
            else:
                setattr(self, attr, self._fresh(default))
        self._pending, self._pending_bytes = [], 0

    def compute(self, *, sync: bool = True) -> float:
        """Return the metric's value as a python float (``nan`` before any update).

        Args:
            sync: reduce the accumulators over every rank first (each by its ``reduce``). Every
                rank must then call it. Defaults to True; pass False for a rank-local value
                (e.g. a progress bar).
        """
        states = self._states()
        if sync and distributed.is_distributed():  # a process group exists (not only torchrun's variables)
            states = distributed.all_reduce_states(states, self._reductions, self.device)
        else:  # this rank alone: ``cat`` states concatenated as a reduction would
            states = {k: _concatenated(v, self.device) if self._reductions[k] == "cat" else v
                      for k, v in states.items()}
        value = self._value(states)
        return float(value) if isinstance(value, torch.Tensor) else float(value)

    def to(self, device: Union[str, torch.device]) -> "Metric":
        """Move the accumulators to ``device`` and return ``self``."""
        self.device = _device(device)
        for attr in self._defaults:
            value = getattr(self, attr)
            if isinstance(value, torch.Tensor):
                setattr(self, attr, value.to(self.device))
            elif isinstance(value, list):
                setattr(self, attr, [t.to(self.device) for t in value])
        self._pending = _map_tensors(self._pending, lambda t: t.to(self.device))
        return self

    def state_dict(self) -> dict[str, Any]:
        """The accumulators and pending updates (tensors cloned: later updates do not change it)."""
        if self._fold_order_free:
            self._commit_pending()
        state = {attr: _copy_state(getattr(self, attr)) for attr in self._defaults}
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
            if isinstance(default, list):
                if not isinstance(value, (list, tuple)):
                    raise ValueError(f"state of metric {self.name!r}: {attr!r} must be a list of tensors, "
                                     f"got {type(value).__name__}")
                value = [torch.as_tensor(t).to(self.device).clone() for t in value]
            elif isinstance(default, torch.Tensor):
                value = torch.as_tensor(value).to(device=self.device, dtype=default.dtype).clone()
            setattr(self, attr, value)
        pending = _map_tensors(list(state.get("pending", [])), lambda t: t.to(self.device).clone())
        self._pending = [tuple(item) for item in pending]
        self._pending_bytes = sum(t.numel() * t.element_size() for item in self._pending for t in item
                                  if isinstance(t, torch.Tensor))

    # -- saved states across ranks -----------------------------------------------------------
    def upgrade_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` as an earlier release saved it, with the accumulators added since filled in:
        what :meth:`load_state_dict` and a checkpoint's checks read. The base adds nothing; a
        metric that declares a new accumulator overrides it, so older checkpoints still resume."""
        return state

    def state_defaults(self) -> dict[str, Any]:
        """The accumulators declared with :meth:`add_state`, each with (a copy of) its default:
        what a :meth:`state_dict` holds besides ``"pending"``."""
        return {attr: _copy_state(default) for attr, default in self._defaults.items()}

    def combine_rank_states(self, states: Sequence[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
        """The :meth:`state_dict` of this metric on each of ``len(states)`` ranks, combined into
        the states of ``world_size`` ranks whose :meth:`compute` gives the same value.

        Pending updates are folded first. Each accumulator is combined by its ``reduce``: rank 0
        takes the sum (``"sum"``) and the concatenation in rank order (``"cat"``) and the other
        ranks start from the default; every rank takes the mean (``"mean"``) and the minimum or
        maximum (``"min"``/``"max"``). An elastic resume maps a checkpoint's metrics onto another
        world size with it.

        Example:
            >>> from estimatorch.metrics import Loss
            >>> saved = []
            >>> for value, n in ((1.0, 2), (4.0, 1)):
            ...     m = Loss()
            ...     m.update(torch.tensor(value), torch.zeros(n))
            ...     saved.append(m.state_dict())
            >>> first, second = Loss().combine_rank_states(saved, world_size=2)
            >>> merged = Loss()
            >>> merged.load_state_dict(first)
            >>> merged.compute(), second["count"]
            (2.0, 0)
        """
        folded = []
        for state in states:
            scratch = copy.deepcopy(self)
            scratch.load_state_dict(state)
            folded.append(scratch._states())
        ranks: list[dict[str, Any]] = [{"pending": []} for _ in range(world_size)]
        for attr, reduce in self._reductions.items():
            values = [each[attr] for each in folded]
            total = values[0]
            for value in values[1:]:
                total = _combine("sum" if reduce == "mean" else reduce, total, value)
            if reduce == "mean":
                total = total / len(values)
            everywhere = reduce in ("mean", "min", "max")
            for rank, state in enumerate(ranks):
                state[attr] = _copy_state(total if everywhere or rank == 0 else self._fresh(self._defaults[attr]))
        return ranks

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` (the CPU for None); an unknown device names the argument."""
    if device is None:
        return torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r} ({err})") from None


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device`` (``cuda`` without an index: any CUDA device)."""
    return tensor.device.type == device.type and device.index in (None, tensor.device.index)


def _combine(reduce: str, state: Any, increment: Any) -> Any:
    """A state with a folded increment, by the state's reduction (a new object)."""
    if reduce in ("sum", "mean"):
        return state + increment
    if reduce in ("max", "min"):
        if not isinstance(state, torch.Tensor) and not isinstance(increment, torch.Tensor):
            return max(state, increment) if reduce == "max" else min(state, increment)
        pick = torch.maximum if reduce == "max" else torch.minimum
        ref = increment if isinstance(increment, torch.Tensor) else state
        return pick(torch.as_tensor(state, device=ref.device), torch.as_tensor(increment, device=ref.device))
    if isinstance(state, list):
        return state + (list(increment) if isinstance(increment, (list, tuple)) else [increment])
    return torch.cat([state, increment])


def _concatenated(value: Any, device: torch.device) -> torch.Tensor:
    """A ``cat`` state as one tensor, as :func:`distributed.all_reduce_states` gives it."""
    if isinstance(value, torch.Tensor):
        return value
    items = [t.reshape(1) if t.dim() == 0 else t for t in value]
    return torch.cat(items) if items else torch.zeros(0, device=device)


def _copy_state(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [t.detach().clone() for t in value]
    return value


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
    with the predictions (a metric counts as a loss metric if it sets ``is_loss_metric = True``,
    as :class:`~estimatorch.metrics.Loss` does)."""
    losses = [m for m in metrics if getattr(m, "is_loss_metric", False)]
    return losses, [m for m in metrics if not any(m is loss for loss in losses)]


def update_metrics(loss_metrics: list[Any], other_metrics: list[Any], pred: Any, label: Any,
                   loss: Any) -> None:
    """Update loss metrics with ``(loss, label)`` and the others with ``(pred, label)``."""
    for metric in loss_metrics:
        metric.update(loss, label)
    for metric in other_metrics:
        try:
            metric.update(pred, label)
        except (AttributeError, TypeError) as err:  # no cost unless raised
            hint = _model_output_hint(metric, pred)
            if hint is None:
                raise
            raise TypeError(hint) from err


def _model_output_hint(metric: Any, pred: Any) -> Optional[str]:
    """What to do when a metric was handed a model's whole output (a ``transformers``
    ``ModelOutput`` or a dict with ``logits``, which a custom loss read), None for anything else."""
    if isinstance(pred, torch.Tensor):
        return None
    logits = pred.get("logits") if isinstance(pred, Mapping) else getattr(pred, "logits", None)
    if not isinstance(logits, torch.Tensor):
        return None
    return (f"{metric_name(metric)}.update(preds, target) got a {type(pred).__name__}, the model's whole output "
            "(it holds 'logits'), where metrics take tensors: with a loss given, the prediction is what the net "
            "returned, handed to your loss as it is. Read its logits for the metrics: build Estimator(model, "
            "optimizer=...) without a loss (the model's own loss; metrics then get output.logits), or give a "
            "BatchProcessor whose fit_batch and evaluate_batch return output.logits as the prediction "
            "(docs/migration.md, 'a compute_loss override')")
