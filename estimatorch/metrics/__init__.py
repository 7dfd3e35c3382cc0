"""Metrics that accumulate on the device and reduce across ranks inside ``compute()``.

Any object with the same duck type (``update(preds, target)``, ``compute()``, ``reset()``), such
as a torchmetrics metric, is accepted wherever a metric is.
"""

from .accuracy import Accuracy, TopKAccuracy
from .base import Metric, is_metric, metric_name
from .classification import F1Score, Precision, Recall
from .loss import Loss
from .perplexity import Perplexity
from .regression import MeanAbsoluteError, MeanSquaredError

__all__ = [
    "Accuracy",
    "F1Score",
    "Loss",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Metric",
    "Perplexity",
    "Precision",
    "Recall",
    "TopKAccuracy",
    "is_metric",
    "metric_name",
]
