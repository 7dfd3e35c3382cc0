"""What the epoch that is ending records beside its metrics: the learning rates it trained with,
and what handlers measured of it (a ``SpeedMonitor``'s step split, FLOP/s, memory).

Handlers declare both (:meth:`.Handler.epoch_rates`, :meth:`.Handler.epoch_readings`); ``History``,
the loggers and the trackers read them through these functions, so neither the loop nor a logger
knows which handler measured what.
"""

from __future__ import annotations

from typing import Any

from .handler import Handler
from .view import EstimatorView

__all__ = ["epoch_learning_rates", "epoch_readings", "learning_rate_names", "optimizer_rates"]


def learning_rate_names(groups: int) -> list[str]:
    """The names learning rates are recorded under: ``lr`` for one param group, else ``lr_group<i>``.

    Example:
        >>> learning_rate_names(1), learning_rate_names(2)
        (['lr'], ['lr_group0', 'lr_group1'])
    """
    return ["lr"] if groups == 1 else [f"lr_group{i}" for i in range(groups)]


def optimizer_rates(optimizer: Any) -> list[float]:
    """The learning rate of each of ``optimizer``'s param groups, as floats."""
    return [float(group["lr"]) for group in optimizer.param_groups]


def epoch_learning_rates(estimator: EstimatorView) -> dict[str, float]:
    """The learning rate of each param group in the epoch that is ending, by
    :func:`learning_rate_names`: the rate the epoch trained with. For a per-epoch schedule or
    ``ReduceLROnPlateau`` that is the rate at the end of its batches, before any
    ``LRSchedulerHandler`` of this fit stepped at its ``epoch_end`` (as Keras records
    ``learning_rate``); for a per-batch schedule, the rate of the epoch's last optimizer step
    (before the scheduler stepped after it: a cosine decayed to 0 shows the last rate a batch
    trained with, not the 0 no batch used). The first handler that declares the epoch's rates
    (:meth:`.Handler.epoch_rates`) says them; without one they are the optimizer's. This is what
    ``History``, ``LoggingHandler``, ``CSVLoggerHandler`` and ``TensorBoardHandler`` show. (A rate
    changed at ``epoch_end`` by your own handler shows as changed.)

    Call it from ``epoch_end`` (or after it, before the next epoch begins).
    """
    epoch = estimator.position.epoch
    for handler in estimator.handlers:
        declared = handler.epoch_rates(epoch) if isinstance(handler, Handler) else None
        if declared is not None:
            rates = [float(rate) for rate in declared]
            break
    else:
        rates = optimizer_rates(estimator.optimizer)
    return dict(zip(learning_rate_names(len(rates)), rates))


def epoch_readings(estimator: EstimatorView) -> dict[str, float]:
    """What the fit's handlers measured of the epoch that is ending
    (:meth:`.Handler.epoch_readings`, in dispatch order; a name the first says is kept), e.g. a
    ``SpeedMonitor``'s values at its ``epoch_end``; empty without one.

    Call it from ``epoch_end`` at a priority above the measuring handler's (or after it).
    """
    epoch = estimator.position.epoch
    values: dict[str, float] = {}
    for handler in estimator.handlers:
        if isinstance(handler, Handler):
            for name, value in handler.epoch_readings(epoch).items():
                values.setdefault(name, value)
    return values
