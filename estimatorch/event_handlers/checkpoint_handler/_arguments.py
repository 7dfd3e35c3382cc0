"""The arguments of a :class:`~estimatorch.CheckpointHandler`, checked when it is made, in the
order the handler has always checked them: each error names the argument and its value."""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from ..._checks import check_bool, check_file_prefix, check_positive_int
from ...events.monitor import check_monitor, check_threshold

__all__ = ["check_arguments"]


def check_arguments(model_dir: Union[str, os.PathLike[str]], model_prefix: str, monitor: Any, verbose: int,
                    save_best: bool, mode: str, epoch_period: Optional[int], batch_period: Optional[int],
                    max_checkpoints: Optional[int], resume_from_checkpoint: bool, save_best_only: bool,
                    save_weights_only: bool, initial_value_threshold: Optional[float], elastic: bool
                    ) -> Optional[str]:
    """Raise on the first bad argument (``async_save``, ``sharded`` and ``storage_options`` are
    checked by the handler as it reads them); returns ``monitor``'s name when a name was given."""
    if not isinstance(model_dir, (str, os.PathLike)) or not os.fspath(model_dir):
        raise TypeError(f"model_dir must be a directory path, got {model_dir!r}")
    check_file_prefix(model_prefix, "model_prefix")
    monitor_name = check_monitor(monitor, "CheckpointHandler")
    if verbose not in (0, 1):
        raise ValueError(f"verbose must be 0 or 1, got {verbose!r}")
    for arg, value in (("save_best", save_best), ("resume_from_checkpoint", resume_from_checkpoint),
                       ("save_best_only", save_best_only), ("save_weights_only", save_weights_only),
                       ("elastic", elastic)):
        check_bool(value, arg)
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
    for arg, value in (("save_best", save_best), ("save_best_only", save_best_only)):
        if value and monitor is None:
            raise ValueError(f"{arg}=True needs monitor= (a metric, e.g. est.val_metrics[0])")
    for arg, value in (("save_best_only", save_best_only), ("save_weights_only", save_weights_only)):
        if value and resume_from_checkpoint:
            raise ValueError(f"resume_from_checkpoint=True cannot go with {arg}=True, which writes no checkpoint "
                             "to resume from: give the fit a second CheckpointHandler(model_dir, "
                             "resume_from_checkpoint=True) for the resumable checkpoints")
    check_threshold(initial_value_threshold, save_best or save_best_only)
    check_positive_int(epoch_period, "epoch_period", allow_none=True)
    check_positive_int(batch_period, "batch_period", allow_none=True)
    if epoch_period is None and batch_period is None:
        raise ValueError("epoch_period and batch_period are both None: nothing would be saved")
    check_positive_int(max_checkpoints, "max_checkpoints", allow_none=True)
    return monitor_name
