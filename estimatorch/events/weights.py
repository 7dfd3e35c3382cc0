"""The weights an evaluation during ``fit`` runs on: the first handler of the fit that keeps
weights for evaluation (:meth:`.Handler.evaluation_weights`, an average of the weights) puts them
into the net for the block, and takes them out again after it.

The estimator enters it around each evaluation of a fit (the validation, an ``evaluate`` a
handler calls), a ``CheckpointHandler`` around a weights export; neither knows which handler
averages the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

from .handler import declared
from .view import EstimatorView

__all__ = ["evaluation_weights"]


@contextlib.contextmanager
def evaluation_weights(estimator: EstimatorView) -> Iterator[Optional[str]]:
    """Within the block ``estimator.net`` holds the weights the first handler of the current fit
    that keeps some for evaluation gives (in dispatch order); yields their name (``"EMA"``), or
    None when no handler does (outside ``fit`` too): the net keeps its own weights.

    Example:
        >>> class View:
        ...     handlers = ()
        >>> with evaluation_weights(View()) as name:
        ...     print(name)
        None
    """
    for handler in estimator.handlers:
        context = declared(handler, "evaluation_weights")(estimator)
        if context is not None:
            with context as name:
                yield name
            return
    yield None
