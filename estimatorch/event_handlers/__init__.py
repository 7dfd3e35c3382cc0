"""Event mixins and the built-in handlers (one module each).

A handler subscribes to events by inheriting their mixins (see :mod:`.mixins`); ``fit`` sorts
handlers by ``priority`` (lower first).
"""

from .._schedule import EventFilter
from ..events import (
    EVENTS,
    BackwardBegin,
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    EpochBegin,
    EpochEnd,
    ForwardBegin,
    ForwardEnd,
    StatefulHandler,
    TrainBegin,
    TrainEnd,
)
from .checkpoint_handler import CheckpointHandler
from .csv_logger import CSVLoggerHandler
from .early_stopping import EarlyStoppingHandler
from .ema import EMAHandler
from .gradient_update import GradientUpdateHandler
from .lambda_handler import LambdaHandler
from .logging_handler import LoggingHandler
from .lr_scheduler import LRSchedulerHandler
from .meter import MeterHandler
from .metric import MetricHandler
from .profiler import ProfilerHandler
from .progress_bar import ProgressBarHandler
from .speed_monitor import SpeedMonitor
from .stopping import StoppingHandler
from .swa import SWAHandler
from .tensorboard import TensorBoardHandler
from .terminate_on_nan import NonFiniteError, TerminateOnNaNHandler
from .trackers.mlflow_handler import MLflowHandler
from .trackers.wandb_handler import WandbHandler
from .validation import ValidationHandler

__all__ = [
    "EVENTS",
    "BackwardBegin",
    "BackwardEnd",
    "BatchBegin",
    "BatchEnd",
    "CSVLoggerHandler",
    "CheckpointHandler",
    "EMAHandler",
    "EarlyStoppingHandler",
    "EpochBegin",
    "EpochEnd",
    "EventFilter",
    "ForwardBegin",
    "ForwardEnd",
    "GradientUpdateHandler",
    "LRSchedulerHandler",
    "LambdaHandler",
    "LoggingHandler",
    "MLflowHandler",
    "MetricHandler",
    "NonFiniteError",
    "ProfilerHandler",
    "ProgressBarHandler",
    "SpeedMonitor",
    "StatefulHandler",
    "SWAHandler",
    "StoppingHandler",
    "TrainBegin",
    "TrainEnd",
    "ValidationHandler",
    "MeterHandler",
    "TensorBoardHandler",
    "TerminateOnNaNHandler",
    "WandbHandler",
]
