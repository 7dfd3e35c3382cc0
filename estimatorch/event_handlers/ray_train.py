"""RayTrainReportHandler: each epoch's metrics to Ray Train (``ray.train.report``), so that Ray's
results and Tune's schedulers see them. Needs the extra ``estimatorch[ray]``."""

from __future__ import annotations

import math
from typing import Any, Optional

from ..events import EstimatorView
from ..events.mixins import EpochEnd
from ..metrics.base import metric_name
from .trackers._base import require

__all__ = ["RayTrainReportHandler"]


class RayTrainReportHandler(EpochEnd):
    """Report each epoch's train and val metrics with ``ray.train.report``, from every worker (a
    report is a collective of Ray's workers), inside ``TorchTrainer``'s training function.

    The metrics are the estimator's own, reduced over every rank (``compute()``), under their
    names (``train_loss``, ``val_accuracy``...), with ``epoch`` (counted from 1); a metric
    without a value yet (``nan``: a val metric before any validation) is left out.

    Args:
        checkpoint_dir: a directory to hand to Ray as the epoch's checkpoint
            (``ray.train.Checkpoint.from_directory``, from rank 0 only; e.g. the ``model_dir``
            of your ``CheckpointHandler``). Ray copies it into the run's storage path at each
            report. Defaults to None (metrics only).
        priority: Defaults to 1000 (after validation and checkpoints, before logging).

    Example:
        >>> handler = RayTrainReportHandler()
        >>> handler.checkpoint_dir is None
        True
    """

    def __init__(self, checkpoint_dir: Optional[str] = None, priority: float = 1000):
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, str):
            raise TypeError(f"checkpoint_dir must be a str or None, got {type(checkpoint_dir).__name__}")
        self.checkpoint_dir = checkpoint_dir
        self.priority = priority

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        train = require("ray.train", "ray", "RayTrainReportHandler")
        metrics: dict[str, float] = {"epoch": float(estimator.position.epoch + 1)}
        for metric in list(estimator.train_metrics) + list(estimator.val_metrics):
            value = float(metric.compute())
            if not math.isnan(value):
                metrics[metric_name(metric)] = value
        checkpoint = None
        if self.checkpoint_dir is not None and train.get_context().get_world_rank() == 0:
            checkpoint = train.Checkpoint.from_directory(self.checkpoint_dir)
        train.report(metrics, checkpoint=checkpoint)
