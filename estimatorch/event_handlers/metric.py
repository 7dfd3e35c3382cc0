"""MetricHandler: update the train metrics after every batch."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from ..events import BatchEnd, EpochBegin, EstimatorView, StatefulHandler, TrainBegin
from ..metrics.base import as_metric_list, split_loss_metrics, update_metrics

__all__ = ["MetricHandler"]


class MetricHandler(StatefulHandler, TrainBegin, EpochBegin, BatchEnd):
    """Reset the metrics at each epoch's start and update them after every batch.

    Loss metrics are updated with the batch loss, the others with ``(pred, label)``; the values
    stay on the device (no host sync per step). Runs at priority -1000, before handlers that
    read the metrics. The metrics' accumulators are saved with the estimator's metrics, by
    name: metric names must be unique (the estimator refuses two metrics of one name; names get
    a ``train_`` / ``val_`` prefix), and they are the keys of ``History``, the log lines and the
    CSV and TensorBoard columns.

    Under ``Estimator(cuda_graphs=True)``, when every metric is ``capturable`` (the built-in
    ones are), the updates are folded at every batch (:meth:`~estimatorch.metrics.Metric.update_now`)
    and recorded in the train step's CUDA graph: a replay updates the metrics on the device, and
    the host only adds each batch's counts.

    Args:
        metrics: the metric objects to update, normally ``est.train_metrics``.

    Example:
        >>> import torch
        >>> from estimatorch.metrics import Loss
        >>> m = Loss()
        >>> h = MetricHandler([m])
        >>> h.batch_end(None, batch=None, pred=None, label=torch.zeros(4), loss=torch.tensor(0.5))
        >>> m.compute()
        0.5
    """

    priority = -1000

    def __init__(self, metrics: Any):
        items = as_metric_list(metrics, "metrics")
        self.metrics = items
        self._loss_metrics, self._other_metrics = split_loss_metrics(items)
        self._now = False  # fold at every batch: a fit whose step a CUDA graph records
        self._grown: list[dict[str, Union[int, float]]] = []  # the last batch's count increments

    def listens_to(self, event: str) -> bool:
        """Nothing to update: no call per step."""
        return event != "batch_end" or bool(self.metrics)

    @property
    def capturable_batch_end(self) -> bool:
        """Every metric's update can be recorded in a CUDA graph (``Metric.capturable``). A
        subclass overriding ``batch_end`` or ``train_begin`` (which chooses to fold each update at
        once) must say so itself."""
        own = type(self).batch_end is MetricHandler.batch_end and type(self).train_begin is MetricHandler.train_begin
        return own and all(getattr(metric, "capturable", False) for metric in self.metrics)

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Under ``cuda_graphs=True``, fold every update at once, at every batch, warm-up and
        eager batches included: a resumed run then folds exactly as an uninterrupted one."""
        self._now = estimator.cuda_graphs and self.capturable_batch_end

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for metric in self.metrics:
            metric.reset()

    def batch_end(self, estimator: EstimatorView, *, pred: Any, label: Any, loss: Any, **kwargs: Any) -> None:
        if self._now:
            self._grown = [m.update_now(loss, label) for m in self._loss_metrics] + \
                [m.update_now(pred, label) for m in self._other_metrics]
            return
        update_metrics(self._loss_metrics, self._other_metrics, pred, label, loss)

    def record_batch_end(self, estimator: EstimatorView) -> Callable[[], None]:
        """After each replay, add the recorded batch's counts (the graph added its totals); an
        accumulator replaced since (not updated in place) is an error naming the metric."""
        if not self._now:  # train_begin did not run: the updates were deferred, out of the graph's reach
            raise RuntimeError(f"{self.name}: recorded in a CUDA graph without folding its updates at once; "
                               "its train_begin must run (call super().train_begin in an override)")
        metrics = [*self._loss_metrics, *self._other_metrics]
        grown = list(zip(metrics, self._grown))
        held = [(m, attr, getattr(m, attr)) for m in metrics for attr in m.state_defaults()
                if isinstance(getattr(m, attr), torch.Tensor)]

        def replayed() -> None:
            for metric, attr, tensor in held:
                if getattr(metric, attr) is not tensor:
                    raise RuntimeError(
                        f"metric {metric.name!r}: its accumulator {attr!r} was replaced during a fit whose step "
                        "a CUDA graph records (cuda_graphs=True), which adds to the recorded tensor; update "
                        "or reset accumulators in place")
            for metric, amount in grown:
                metric.add_counts(amount)

        return replayed
