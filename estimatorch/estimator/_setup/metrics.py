"""An ``Estimator``'s metric lists: the train metrics (a ``Loss`` first, ``Accuracy`` for a
classification loss), the val metrics (copies of them unless given), each named
``train_<name>`` / ``val_<name>``, unique, on the estimator's device."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ...metrics import Accuracy, Loss
from ...metrics.base import as_metric_list, metric_name

__all__ = ["metric_lists", "train_metric_list", "val_metric_list"]


def _rename(metric: Any, prefix: str) -> Any:
    name = metric_name(metric)
    if not name.startswith(prefix):
        base = name.split("_", 1)[1] if name.startswith(("train_", "val_")) else name
        metric.name = prefix + base
    return metric


def metric_lists(train_metrics: Any, val_metrics: Any, loss: Any, device: torch.device
                 ) -> tuple[list[Any], list[Any]]:
    """``Estimator``'s train and val metrics (:func:`train_metric_list`,
    :func:`val_metric_list`), their names unique, moved to ``device`` where they can be."""
    train = train_metric_list(train_metrics, loss)
    val = val_metric_list(val_metrics, train)
    names = [metric_name(m) for m in train + val]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"metric names must be unique, got {duplicated[0]!r} more than once")
    for metric in train + val:
        if callable(getattr(metric, "to", None)):
            metric.to(device)
    return train, val


def train_metric_list(train_metrics: Any, loss: Any) -> list[Any]:
    """The train metrics: those given (a ``Loss`` added first when none is), or ``Loss`` plus
    ``Accuracy`` for a classification loss; each named ``train_<name>``."""
    metrics = as_metric_list(train_metrics, "train_metrics")
    if train_metrics is None and isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
        metrics.append(Accuracy())
    if not any(isinstance(m, Loss) for m in metrics):
        metrics.insert(0, Loss())
    return [_rename(m, "train_") for m in metrics]


def val_metric_list(val_metrics: Any, train_metrics: list[Any]) -> list[Any]:
    """The val metrics: those given (a ``Loss`` added first when none is), else deep copies of
    the train metrics; each named ``val_<name>``."""
    if val_metrics is None:
        return [_rename(copy.deepcopy(m), "val_") for m in train_metrics]
    metrics = as_metric_list(val_metrics, "val_metrics")
    if not any(isinstance(m, Loss) for m in metrics):
        metrics.insert(0, Loss())
    return [_rename(m, "val_") for m in metrics]


