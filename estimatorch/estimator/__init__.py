"""The Estimator, its step (BatchProcessor) and what fit returns (History)."""

from ._setup.logger import default_logger as default_logger  # re-exported: testing and the demo use it
from ._state.run import Position
from .batch_processor import BatchProcessor
from .estimator import Estimator
from .history import History, Validations

__all__ = ["BatchProcessor", "Estimator", "History", "Position", "Validations"]
