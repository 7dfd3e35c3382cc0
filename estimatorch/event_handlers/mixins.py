"""The event mixins, kept here for the import path of earlier releases: they live in
:mod:`estimatorch.events.mixins`, the handler contract."""

from ..events.mixins import (  # BATCH_EVENTS: for imports of earlier releases
    BATCH_EVENTS,  # noqa: F401
    EVENTS,
    BackwardBegin,
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    ForwardBegin,
    ForwardEnd,
    TrainBegin,
    TrainEnd,
)

__all__ = [
    "EVENTS",
    "BackwardBegin",
    "BackwardEnd",
    "BatchBegin",
    "BatchEnd",
    "EpochBegin",
    "EpochEnd",
    "ForwardBegin",
    "ForwardEnd",
    "TrainBegin",
    "TrainEnd",
]
