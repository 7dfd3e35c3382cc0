"""What ``fit`` returns: the per-epoch value of every train and validation metric."""

from __future__ import annotations

import csv
import math
import os
from typing import Any, Optional, Union

from .._checks import check_state_keys

__all__ = ["History", "Validations"]


class Validations:
    """Every validation of a fit, in the order they ran, with the step each validated:
    ``history.validations``. A step-level validation (``ValidationHandler(batch_period=N)``)
    is here, and so is each per-epoch one, at the epoch's last step.

    ``validations["val_loss"]`` is the list of values, one per validation (``nan`` where a
    validation did not measure that metric); ``validations.steps`` the batches trained when each
    ran (the step it validated, counted over the fit from 1), ``validations.epochs`` the epoch it
    ran in (from 1). ``fit`` saves them with every checkpoint, beside the per-epoch values.

    Example:
        >>> v = Validations()
        >>> v.record(3, 1, {"val_loss": 0.9})
        >>> v.record(6, 2, {"val_loss": 0.7})
        >>> v.steps, v.epochs, v["val_loss"], len(v)
        ([3, 6], [1, 2], [0.9, 0.7], 2)
    """

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.epochs: list[int] = []
        self._values: dict[str, list[float]] = {}

    def record(self, step: int, epoch: int, values: dict[str, float]) -> None:
        """Append one validation's values; metrics missing from ``values`` get ``nan``."""
        n = len(self.steps)
        self.steps.append(int(step))
        self.epochs.append(int(epoch))
        for name, value in values.items():
            self._values.setdefault(name, [math.nan] * n).append(float(value))
        for column in self._values.values():
            if len(column) == n:
                column.append(math.nan)

    def keys(self) -> list[str]:
        """The metric names recorded."""
        return list(self._values)

    def __getitem__(self, name: str) -> list[float]:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"no metric {name!r} among the validations; they have {self.keys()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        return f"Validations(steps={self.steps}, metrics={self.keys()})"

    def to_dict(self) -> dict[str, list[Any]]:
        """``{"step": [...], "epoch": [...], name: [...], ...}`` with copies of the lists."""
        return {"step": list(self.steps), "epoch": list(self.epochs), **{k: list(v) for k, v in self._values.items()}}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "epochs": list(self.epochs),
                "values": {k: list(v) for k, v in self._values.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("steps", "epochs", "values"), "History.validations")
        self.steps, self.epochs = [int(s) for s in state["steps"]], [int(e) for e in state["epochs"]]
        self._values = {k: [float(x) for x in v] for k, v in state["values"].items()}


class History:
    """Per-epoch values of every metric and of the learning rate, in the order epochs finished.

    ``history["train_loss"]`` is the list of values, one per recorded epoch; a metric that was
    not computed in an epoch (validation every other epoch, say) holds ``nan`` there. Keys are
    the metric names (``train_<name>``, ``val_<name>``: unique, the estimator refuses two
    metrics of one name) and the learning rate each epoch trained with: ``lr`` for an optimizer
    with one param group, else ``lr_group0``, ``lr_group1``... (the rate at the end of the
    epoch's batches, before a per-epoch schedule steps: see
    :func:`~estimatorch.event_handlers.lr_scheduler.epoch_learning_rates`). Learning rates come
    after the metrics. ``history.epochs`` holds the epoch numbers (1-based). Every validation,
    step-level ones included, is also in :attr:`validations` with the step it ran at. ``fit``
    saves the history with every checkpoint, so a resumed run returns the whole run's history.

    Example:
        >>> h = History()
        >>> h.record(1, {"train_loss": 0.9, "lr": 0.1})
        >>> h.record(2, {"train_loss": 0.5, "val_loss": 1.0, "lr": 0.05})
        >>> h["train_loss"], h["lr"], h.epochs
        ([0.9, 0.5], [0.1, 0.05], [1, 2])
        >>> h.metrics, h.learning_rates
        (['train_loss', 'val_loss'], ['lr'])
        >>> math.isnan(h["val_loss"][0])
        True
    """

    def __init__(self) -> None:
        self.epochs: list[int] = []
        self._values: dict[str, list[float]] = {}
        #: every validation with its step (:class:`Validations`)
        self.validations = Validations()
        #: the run's ledger once ``fit`` returned or raised, on global rank 0 (None elsewhere and
        #: before): every attempt of the run (also those before a resume) and the totals, as
        #: ``python -m estimatorch.checkpoint inspect DIR --json`` prints them under ``ledger``
        #: (docs/observability.md). Not part of :meth:`state_dict`.
        self.ledger: Optional[dict[str, Any]] = None

    @property
    def goodput(self) -> Optional[float]:
        """The share of the run's wall time spent on training steps that were kept (every
        attempt of the run counted), from :attr:`ledger`; None before ``fit`` ended or off rank 0."""
        return self.ledger["goodput"] if self.ledger is not None else None

    def record(self, epoch: int, values: dict[str, float]) -> None:
        """Append one epoch's values; metrics missing from ``values`` get ``nan``."""
        n = len(self.epochs)
        self.epochs.append(int(epoch))
        added = False
        for name, value in values.items():
            added = added or name not in self._values
            self._values.setdefault(name, [math.nan] * n).append(float(value))
        for column in self._values.values():
            if len(column) == n:
                column.append(math.nan)
        if added:  # learning rates stay after the metrics
            self._values = dict(sorted(self._values.items(), key=lambda item: _is_learning_rate(item[0])))

    @property
    def metrics(self) -> list[str]:
        """The recorded metric names (the learning rates are :attr:`learning_rates`)."""
        return [name for name in self._values if not _is_learning_rate(name)]

    @property
    def learning_rates(self) -> list[str]:
        """The recorded learning-rate names: ``["lr"]``, or ``["lr_group0", ...]``."""
        return [name for name in self._values if _is_learning_rate(name)]

    def keys(self) -> list[str]:
        """Every recorded name: :attr:`metrics`, then :attr:`learning_rates`."""
        return list(self._values)

    def __getitem__(self, name: str) -> list[float]:
        try:
            return self._values[name]
        except KeyError:
            raise KeyError(f"no metric {name!r} in the history; it has {self.keys()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __len__(self) -> int:
        return len(self.epochs)

    def __repr__(self) -> str:
        last = {k: v[-1] for k, v in self._values.items()} if self.epochs else {}
        return f"History(epochs={len(self.epochs)}, last={last})"

    def to_dict(self) -> dict[str, list[Any]]:
        """``{"epoch": [...], name: [...], ...}`` with copies of the lists."""
        return {"epoch": list(self.epochs), **{k: list(v) for k, v in self._values.items()}}

    def to_csv(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write one row per epoch, a column per metric (``nan`` cells left empty).

        Refuses to overwrite an existing file.
        """
        path = os.fspath(path)
        if os.path.exists(path):
            raise FileExistsError(f"path {path!r} already exists; choose a new file name")
        table = self.to_dict()
        with open(path, "x", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(list(table))
            for row in zip(*table.values()):
                writer.writerow(["" if isinstance(v, float) and math.isnan(v) else v for v in row])

    def plot(self, metrics: Optional[list[str]] = None, *, ax: Any = None) -> Any:
        """Plot train vs validation curves, one panel per metric (needs matplotlib).

        Args:
            metrics: base names to plot (``"loss"`` plots ``train_loss`` and ``val_loss``;
                ``"lr"`` the learning rate). Defaults to every recorded metric.
            ax: a list of matplotlib axes to draw on, one per metric. Defaults to a new figure.

        Returns:
            The matplotlib figure.
        """
        try:
            import matplotlib.pyplot as plt  # optional: estimatorch[plot]
            from matplotlib.ticker import MaxNLocator
        except ImportError as err:
            raise ImportError(
                "History.plot() needs matplotlib: pip install 'estimatorch[plot]'"
            ) from err
        bases = metrics or _base_names(self.metrics)
        if not bases:
            raise ValueError("the history is empty: there is nothing to plot")
        if ax is None:
            fig, grid = plt.subplots(1, len(bases), figsize=(4.5 * len(bases), 3.5), squeeze=False)
            axes = list(grid[0])
        else:
            axes = list(ax) if isinstance(ax, (list, tuple)) else [ax]
            fig = axes[0].figure
        if len(axes) != len(bases):
            raise ValueError(f"ax holds {len(axes)} axes for {len(bases)} metrics {bases}")
        for axis, base in zip(axes, bases):
            for prefix in ("train_", "val_", ""):
                name = prefix + base
                if name in self._values:
                    axis.plot(self.epochs, self._values[name], marker="o", label=name)
            axis.set_xlabel("epoch")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole: no 1.5 tick
            axis.set_title(base)
            axis.legend()
        fig.tight_layout()
        return fig

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": list(self.epochs), "values": {k: list(v) for k, v in self._values.items()},
                "validations": self.validations.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (``validations`` optional: a state saved before
        they were kept has none)."""
        check_state_keys(state, ("epochs", "values"), "History")
        self.epochs = list(state["epochs"])
        self._values = {k: list(v) for k, v in state["values"].items()}
        self.validations = Validations()
        if state.get("validations") is not None:
            self.validations.load_state_dict(state["validations"])


def _is_learning_rate(name: str) -> bool:
    return name == "lr" or (name.startswith("lr_group") and name[len("lr_group"):].isdigit())


def _base_names(names: list[str]) -> list[str]:
    bases: list[str] = []
    for name in names:
        base = name.split("_", 1)[1] if name.startswith(("train_", "val_")) else name
        if base not in bases:
            bases.append(base)
    return bases
