"""The handlers ``fit`` adds to the user's: the built-in default set (which the handler package
decides, :mod:`estimatorch.event_handlers.defaults`), with a progress bar where one is shown.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Optional

from ... import _console
from ...event_handlers.defaults import default_handlers as _built_in_defaults
from .._fit_estimator import FitEstimator

__all__ = ['default_handlers', 'interactive']


def interactive() -> bool:
    """True in a terminal or a Jupyter kernel: where a progress bar is shown by default."""
    if _console.in_notebook():
        return True
    stream = sys.stderr
    return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


def default_handlers(estimator: FitEstimator, user: list[object],
                     val_data: Optional[Iterable[object]]) -> list[object]:
    """The handlers ``fit`` adds: each default whose type none of ``user`` has (the handler
    package decides which; a progress bar where :func:`interactive`)."""
    return _built_in_defaults(
        user, train_metrics=estimator.train_metrics, evaluate=estimator.evaluate, val_data=val_data,
        lr_scheduler=estimator.lr_scheduler,
        scheduled=estimator.lr_scheduler is not None or estimator.lr_scheduler_factory is not None,
        lr_scheduler_interval=estimator.lr_scheduler_interval, progress_bar=interactive())
