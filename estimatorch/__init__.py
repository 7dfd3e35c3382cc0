"""estimatorch: a PyTorch training loop with mixin event handlers and bit-identical resume.

>>> from estimatorch import Estimator
"""

from . import (
    distributed,
    metrics,
    rng,
    samplers,
    statistics,
)
from ._version import __version__
from .distributed import Watchdog
from .estimator import BatchProcessor, Estimator, History
from .event_handlers import (
    CheckpointHandler,
    CSVLoggerHandler,
    EarlyStoppingHandler,
    EMAHandler,
    GradientUpdateHandler,
    LambdaHandler,
    LoggingHandler,
    LRSchedulerHandler,
    MeterHandler,
    MetricHandler,
    NonFiniteError,
    ProfilerHandler,
    ProgressBarHandler,
    SpeedMonitor,
    StoppingHandler,
    SWAHandler,
    TensorBoardHandler,
    TerminateOnNaNHandler,
    ValidationHandler,
)

__all__ = [
    "BatchProcessor",
    "CSVLoggerHandler",
    "CheckpointHandler",
    "EMAHandler",
    "EarlyStoppingHandler",
    "Estimator",
    "GradientUpdateHandler",
    "History",
    "LRSchedulerHandler",
    "LambdaHandler",
    "LoggingHandler",
    "MetricHandler",
    "NonFiniteError",
    "ProfilerHandler",
    "ProgressBarHandler",
    "SpeedMonitor",
    "SWAHandler",
    "StoppingHandler",
    "ValidationHandler",
    "Watchdog",
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
