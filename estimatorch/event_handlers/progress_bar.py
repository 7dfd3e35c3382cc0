"""ProgressBarHandler: tqdm bars for epochs, batches and validation."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional

from .. import _console, distributed
from .._checks import check_state_keys, is_real
from ..events import BatchEnd, EpochBegin, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd
from ..metrics.base import Metric, as_metric_list, metric_name
from . import _bars

__all__ = ["ProgressBarHandler"]

#: the epoch bar without a rate (the remaining time says it): room for the epoch's values.
_EPOCH_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def _bar(read_postfix: Optional[Callable[[], dict[str, str]]] = None, **kwargs: Any) -> Any:
    return _bars.bar(read_postfix, **kwargs)


def _values(metrics: list[Any]) -> dict[str, str]:
    """This rank's running values, formatted (no collective: the bars live on rank 0 only)."""
    values: dict[str, str] = {}
    for metric in metrics:
        if isinstance(metric, Metric):
            value = metric.compute(sync=False)
        elif distributed.get_world_size() == 1:
            value = float(metric.compute())
        else:
            continue
        values[metric_name(metric)] = f"{value:.4g}"
    return values


class _ValidationBar(EpochBegin, BatchEnd, EpochEnd):
    """Attached to every ``evaluate`` during fit: a bar over the validation batches."""

    def __init__(self, owner: "ProgressBarHandler", val_data: Any):
        self.owner = owner
        self.total = len(val_data) if hasattr(val_data, "__len__") else None

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.owner._catch_up()  # validation may take a while: the batch bar shows where training is
        metrics = list(estimator.val_metrics)
        self.owner._val_bar = _bar(lambda: _values(metrics), total=self.total, desc="validation", unit="batch",
                                   leave=False, file=self.owner._output(), mininterval=self.owner.refresh_interval)

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.owner._val_bar.update(1)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.owner._close_val_bar()


class ProgressBarHandler(StatefulHandler, TrainBegin, TrainEnd, EpochBegin, EpochEnd, BatchEnd):
    """Progress bars (``tqdm`` text bars): in a terminal, or as plain text in a Jupyter notebook.

    Training by epochs shows two bars (epochs, and batches in the current epoch); training by
    ``batches`` shows one. Validation during fit shows its own bar; the batch bar is brought up
    to date before it starts. The batch bar's postfix shows the running train metrics (the
    validation bar's, the val metrics), with the learning rate (of the first param group) after
    the first value, read from the device only when tqdm redraws the bar, at
    most every ``refresh_interval`` seconds, so other steps pay no host sync. The epoch bar
    shows the last finished epoch's values, val metrics first, as many as fit the line.

    Postfixes name metrics as Keras does (``loss``, ``val_loss``; ``accuracy`` shortened to
    ``acc``) and hold what fits the output's width (80 columns when it is unknown), so a bar
    is never cut short. In a Jupyter notebook (and no ``file``) the bars are one output of
    plain text, replaced at each redraw: the saved notebook shows their final state. Only
    global rank 0 draws; log lines printed to the console meanwhile go above the bars, never
    into them, and bars never reach a log file. Bars are closed when training ends or raises;
    a fit ended by an error or Ctrl-C leaves its batch bar, to show where it stopped.
    ``fit`` adds one when stderr is a terminal or in a notebook.

    Args:
        refresh_interval: the least time between two redraws, in seconds (tqdm's
            ``mininterval``). Defaults to 0.5.
        metrics: the train metrics in the postfix. Defaults to the estimator's train metrics.
        file: where bars are drawn. Defaults to a plain-text output of the notebook cell in
            Jupyter, else ``sys.stderr``, chosen at ``fit`` start.

    Example:
        >>> ProgressBarHandler(refresh_interval=1.0).refresh_interval
        1.0
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("batch_in_epoch", "total_batches")

    priority = float("inf")
    state_attributes = ("batch_in_epoch", "epochs_done", "total_batches")

    def __init__(self, refresh_interval: float = 0.5, metrics: Any = None, file: Any = None):
        if not is_real(refresh_interval) \
                or not refresh_interval >= 0:
            raise ValueError(f"refresh_interval must be a non-negative number of seconds, got {refresh_interval!r}")
        items = None if metrics is None else as_metric_list(metrics, "metrics")
        if file is not None and not callable(getattr(file, "write", None)):
            raise TypeError(f"file must be a writable stream or None, got {file!r}")
        self.refresh_interval = float(refresh_interval)
        self.metrics = items
        self.file = file
        self.batch_in_epoch = self.epochs_done = self.total_batches = 0
        self._file: Any = None
        self._display: Optional[_bars.NotebookDisplay] = None
        self._epoch_bar: Any = None
        self._batch_bar: Any = None
        self._val_bar: Any = None
        self._redirect: Optional[_bars.ConsoleRedirect] = None
        self._active = False
        self._shown: list[Any] = []
        self._optimizer: Any = None
        self._per_epoch: Optional[int] = None
        self._max_epoch: Optional[int] = None
        self._unshown = 0  # batches done but not yet passed to the bar
        self._next_draw = 0.0

    # -- bars ------------------------------------------------------------------------------
    def _output(self) -> Any:
        """Where a new bar writes: its own line of the notebook output, or the stream."""
        return self._display.stream() if self._display is not None else self._file

    def _catch_up(self) -> None:
        """Show every batch done so far, now (before a validation, which may take a while)."""
        if self._batch_bar is not None:
            self._pass_batches()
            self._batch_bar.refresh()

    def _close_val_bar(self) -> None:
        if self._val_bar is not None:
            self._val_bar.close()
        self._val_bar = None

    def _pass_batches(self) -> None:
        """Give the bar the batches done since it last heard: at most every ``refresh_interval``
        from ``batch_end`` (tqdm would not redraw sooner anyway), and before it closes."""
        if self._unshown and self._batch_bar is not None:
            self._batch_bar.update(self._unshown)
        self._unshown = 0
        self._next_draw = time.monotonic() + self.refresh_interval

    def _close(self) -> None:
        try:
            self._pass_batches()
            self._close_val_bar()
            for bar in (self._batch_bar, self._epoch_bar):
                if bar is not None:
                    bar.close()
        finally:
            self._batch_bar = self._epoch_bar = None
            self._display = None
            if self._redirect is not None:
                self._redirect.close()
                self._redirect = None

    def _new_batch_bar(self, **kwargs: Any) -> Any:
        shown, optimizer = self._shown, self._optimizer

        def postfix() -> dict[str, str]:  # the running loss, the learning rate now, the other values
            values = list(_values(shown).items())
            if optimizer is not None and optimizer.param_groups:
                values.insert(1, ("lr", f"{optimizer.param_groups[0]['lr']:.3g}"))  # kept on a narrow line
            return dict(values)

        return _bar(postfix, unit="batch", file=self._output(), mininterval=self.refresh_interval, **kwargs)

    def _epoch_desc(self, epoch: int) -> str:
        return f"epoch {epoch + 1}/{self._max_epoch}"

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._close()
        self.batch_in_epoch = self.epochs_done = self.total_batches = 0
        self._active = distributed.is_main_process()
        if not self._active:
            return
        self._file = self.file if self.file is not None else sys.stderr
        if self.file is None and _console.in_notebook():
            self._display = _bars.NotebookDisplay()  # bars as text in the cell: no console to share
        else:
            self._redirect = _bars.ConsoleRedirect(estimator.logger, _bars.bar_class())
        self._shown = self.metrics if self.metrics is not None else list(estimator.train_metrics)
        self._optimizer = estimator.optimizer
        self._per_epoch = estimator.batches_per_epoch
        self._max_epoch = estimator.max_epoch
        if self._max_epoch is not None:
            self._epoch_bar = _bar(total=self._max_epoch, desc="epochs", unit="epoch", file=self._output(),
                                   bar_format=_EPOCH_FORMAT)
        else:
            self._batch_bar = self._new_batch_bar(total=estimator.max_batch, desc="batches")

    def evaluation_handlers(self, val_data: Any) -> list[Any]:
        """The handlers ``evaluate`` attaches during fit: a validation bar (rank 0 only)."""
        return [_ValidationBar(self, val_data)] if self._active else []

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.batch_in_epoch = 0
        if not self._active or self._epoch_bar is None:
            return
        if self._batch_bar is not None:
            self._pass_batches()
            self._batch_bar.close()
        # The loop's position already names a resumed epoch (the counters come back later).
        self._batch_bar = self._new_batch_bar(total=self._per_epoch, desc=self._epoch_desc(estimator.position.epoch),
                                              leave=False)

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.batch_in_epoch += 1
        self.total_batches += 1
        if self._active:
            self._unshown += 1
            if time.monotonic() >= self._next_draw:
                self._pass_batches()

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.epochs_done += 1
        if not self._active or self._epoch_bar is None:
            return
        if self._batch_bar is not None:
            self._pass_batches()
            self._batch_bar.close()
            self._batch_bar = None
        shown = (list(estimator.val_metrics) if estimator.validated else []) + self._shown
        room = self._epoch_bar.postfix_room(_bars.EPOCH_SLACK)
        self._epoch_bar.set_postfix(_bars.fit_postfix(_values(shown), room), refresh=False)
        self._epoch_bar.update(1)

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._batch_bar is not None and not estimator.position.stop:
            self._batch_bar.leave = True  # ended by an error or Ctrl-C: the bar stays to say where
        self._active = False
        self._shown = []
        self._close()

    # -- state -----------------------------------------------------------------------------
    def _move(self, bar: Any, n: int) -> None:
        self._unshown = 0
        bar.n = bar.initial = bar.last_print_n = n  # rates count from the resume
        read, bar.read_postfix = bar.read_postfix, None  # the metrics are restored after the handlers
        try:
            bar.refresh()
        finally:
            bar.read_postfix = read

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, self.state_attributes, self.name)
        self.batch_in_epoch, self.epochs_done, self.total_batches = (
            int(state["batch_in_epoch"]), int(state["epochs_done"]), int(state["total_batches"]))
        if not self._active:
            return
        if self._epoch_bar is not None:
            self._move(self._epoch_bar, self.epochs_done)
            if self._batch_bar is not None:  # a mid-epoch resume: the epoch's bar exists
                self._batch_bar.set_description(self._epoch_desc(self.epochs_done), refresh=False)
                self._move(self._batch_bar, self.batch_in_epoch)
        elif self._batch_bar is not None:
            self._move(self._batch_bar, self.total_batches)
