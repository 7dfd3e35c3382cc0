"""estimatorch: a PyTorch training loop with mixin event handlers and bit-identical resume.

>>> from estimatorch import Estimator
"""

from ._version import __version__
from . import distributed, metrics, rng, samplers  # noqa: E402
from .estimator import BatchProcessor, Estimator, History  # noqa: E402
from .event_handlers import (  # noqa: E402
    CheckpointHandler,
    EarlyStoppingHandler,
    GradientUpdateHandler,
    LambdaHandler,
    LoggingHandler,
    LRSchedulerHandler,
    MetricHandler,
    ProgressBarHandler,
    StoppingHandler,
    ValidationHandler,
)

from . import statistics  # noqa: E402
from .event_handlers import MeterHandler, TensorBoardHandler, TerminateOnNaNHandler  # noqa: E402
from .event_handlers import CSVLoggerHandler, NonFiniteError  # noqa: E402

__all__ = [
    "BatchProcessor",
    "CSVLoggerHandler",
    "CheckpointHandler",
    "EarlyStoppingHandler",
    "Estimator",
    "GradientUpdateHandler",
    "History",
    "LRSchedulerHandler",
    "LambdaHandler",
    "LoggingHandler",
    "MetricHandler",
    "NonFiniteError",
    "ProgressBarHandler",
    "StoppingHandler",
    "ValidationHandler",
    "__version__",
    "distributed",
    "metrics",
    "rng",
    "samplers",
    "MeterHandler",
    "TensorBoardHandler",
    "TerminateOnNaNHandler",
    "statistics",
]
