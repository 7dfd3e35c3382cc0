"""Statistic base classes, after QuantLab's meter: instantaneous vs running.

A :class:`Statistic` watches the training step through the events :class:`MeterHandler`
forwards to it, measures with tensor ops on the device, and hands its values over when they are
written:

- an :class:`InstantaneousStatistic` measures on its firing steps only (every ``period`` steps
  from ``start``) and is written at that step's ``batch_end``, at step = global batch count;
- a :class:`RunningStatistic` accumulates on every step of an epoch and is written at the
  epoch's end under ``epoch/<name>``, at step = epoch number. Its accumulators are its state.

The other axis, callback-free vs callback-based (hooks), is :mod:`.callback`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Union

import torch

from .._checks import check_positive_int, check_state_keys
from .._schedule import EventFilter
from ..events import EstimatorView

__all__ = ["InstantaneousStatistic", "RunningStatistic", "Statistic", "select_parameters"]

#: the per-step events a statistic may listen to (``batch_end`` always reaches it).
STEP_EVENTS = frozenset({"batch_begin", "forward_begin", "forward_end", "backward_begin", "backward_end"})

Value = Union[torch.Tensor, float]


class Statistic:
    """Base of every statistic: a name, the events it needs, and how ranks combine its values.

    Subclasses implement the per-step methods they need (``batch_begin``, ``forward_begin``,
    ``forward_end``, ``backward_begin``, ``backward_end`` — listed in ``events`` — and
    ``batch_end``) and :meth:`scalars` / :meth:`histograms`.

    Args:
        name: the tag prefix of its values. Defaults to the class's ``default_name``.

    Example:
        >>> class Steps(RunningStatistic):
        ...     default_name = "steps"
        ...     def reset(self): self.count = 0
        ...     def batch_end(self, estimator, **kwargs): self.count += 1
        ...     def scalars(self): return {"": float(self.count)}
        >>> s = Steps()
        >>> s.reset(); s.batch_end(None); s.scalars()
        {'': 1.0}
    """

    default_name: ClassVar[str] = "statistic"
    #: per-step events besides ``batch_end`` this statistic listens to (see ``STEP_EVENTS``).
    events: ClassVar[frozenset] = frozenset()
    #: how the values of the ranks combine before rank 0 writes them: ``"mean"`` or ``"sum"``.
    reduction: ClassVar[str] = "mean"
    #: True for running statistics (written per epoch), False for instantaneous ones.
    running: ClassVar[bool] = False

    def __init__(self, name: Optional[str] = None):
        if name is not None and (not isinstance(name, str) or not name or name.startswith("/")):
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name or self.default_name

    # -- the run ---------------------------------------------------------------------------
    def setup(self, estimator: EstimatorView) -> None:
        """Called at ``fit`` start (``train_begin``): resolve modules and parameters, reset."""
        self.reset()

    def teardown(self) -> None:
        """Called when ``fit`` ends, also on an exception: release what the run holds."""

    def reset(self) -> None:
        """Clear the measurements (running statistics: at each epoch's start)."""

    def fires(self, step: int) -> bool:
        """Whether this statistic acts on global batch ``step`` (1-based)."""
        return True

    # -- per step (override the ones listed in ``events``, and batch_end) -------------------
    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Called after the batch's ``batch_end`` handlers up to the meter's priority."""

    # -- values ----------------------------------------------------------------------------
    def scalars(self) -> dict[str, Value]:
        """``{key: value}``; written as ``<name>/<key>`` (``<name>`` for the key ``""``).

        Values may stay on the device: the meter moves them to the host in one transfer.
        """
        return {}

    def histograms(self) -> dict[str, torch.Tensor]:
        """``{key: tensor}`` of values to histogram, tagged like :meth:`scalars`."""
        return {}

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The accumulators (plain tensors and python values). Defaults to nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        check_state_keys(state, self.state_dict(), f"statistic {self.name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class InstantaneousStatistic(Statistic):
    """A statistic measured on its firing steps only: the steps that are multiples of
    ``period``, from step ``start`` on (global batch counts, from 1).

    Args:
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to the class's ``default_name``.

    Example:
        >>> s = InstantaneousStatistic(period=10, start=15)
        >>> [step for step in range(1, 50) if s.fires(step)]
        [20, 30, 40]
    """

    running = False

    def __init__(self, period: int = 100, start: int = 1, name: Optional[str] = None):
        super().__init__(name)
        self.period = check_positive_int(period, "period")
        self.start = check_positive_int(start, "start")
        self._filter = EventFilter(every=period, after=start - 1)

    def fires(self, step: int) -> bool:
        return self._filter(step)


class ParameterStatistic(InstantaneousStatistic):
    """An instantaneous statistic with one value per selected parameter.

    Subclasses fill ``self._values`` (name -> 0-dim tensor) on firing steps from
    ``self._params``, the ``(name, parameter)`` pairs chosen at setup.

    Args:
        params: parameter names (as in ``net.named_parameters()``). Defaults to every
            trainable parameter.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to the class's ``default_name``.

    Example:
        >>> ParameterStatistic(["0.weight"], period=5).params
        ['0.weight']
    """

    def __init__(self, params: Optional[list[str]] = None, *, period: int = 100, start: int = 1,
                 name: Optional[str] = None):
        super().__init__(period=period, start=start, name=name)
        self.params = check_names(params, "params")

    def setup(self, estimator: EstimatorView) -> None:
        self._params = select_parameters(estimator.net, self.params, type(self).__name__)
        super().setup(estimator)

    def reset(self) -> None:
        self._values: dict[str, Value] = {}

    def scalars(self) -> dict[str, Value]:
        return dict(self._values)


class RunningStatistic(Statistic):
    """A statistic accumulated over every step of an epoch and written at the epoch's end.

    Subclasses keep their accumulators on the device and list them in :meth:`state_dict`, so
    a resumed run continues the epoch's accumulation.

    Args:
        name: Defaults to the class's ``default_name``.

    Example:
        >>> RunningStatistic().running
        True
    """

    running = True

    def epoch_begin(self, estimator: EstimatorView) -> None:
        """Called at each epoch's start; starts a new accumulation."""
        self.reset()


def select_parameters(net: torch.nn.Module, names: Optional[list[str]],
                      owner: str) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` pairs of ``net``: those named, or every trainable one.

    Raises:
        ValueError: naming a parameter ``net`` does not have.
    """
    params = dict(net.named_parameters())
    if names is None:
        return [(n, p) for n, p in params.items() if p.requires_grad]
    for n in names:
        if n not in params:
            raise ValueError(f"{owner}: the network has no parameter {n!r}; it has {sorted(params)}")
    return [(n, params[n]) for n in names]


def check_names(names: Any, arg: str) -> Optional[list[str]]:
    """Validate an optional list of module or parameter names."""
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{arg} must be a list of names or None, got {names!r}")
    if not names:
        raise ValueError(f"{arg} must name at least one, got {names!r}")
    return list(names)
