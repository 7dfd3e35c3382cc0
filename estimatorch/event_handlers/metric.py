"""MetricHandler: update the train metrics after every batch."""

from __future__ import annotations

from typing import Any

from ..events import BatchEnd, EpochBegin, EstimatorView, StatefulHandler
from ..metrics.base import as_metric_list, split_loss_metrics, update_metrics

__all__ = ["MetricHandler"]


class MetricHandler(StatefulHandler, EpochBegin, BatchEnd):
    """Reset the metrics at each epoch's start and update them after every batch.

    Loss metrics are updated with the batch loss, the others with ``(pred, label)``; the values
    stay on the device (no host sync per step). Runs at priority -1000, before handlers that
    read the metrics. The metrics' accumulators are saved with the estimator's metrics, by
    name: metric names must be unique (the estimator refuses two metrics of one name; names get
    a ``train_`` / ``val_`` prefix), and they are the keys of ``History``, the log lines and the
    CSV and TensorBoard columns.

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

    def listens_to(self, event: str) -> bool:
        """Nothing to update: no call per step."""
        return event != "batch_end" or bool(self.metrics)

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        for metric in self.metrics:
            metric.reset()

    def batch_end(self, estimator: EstimatorView, *, pred: Any, label: Any, loss: Any, **kwargs: Any) -> None:
        update_metrics(self._loss_metrics, self._other_metrics, pred, label, loss)
