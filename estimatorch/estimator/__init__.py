"""The Estimator, its step (BatchProcessor) and what fit returns (History)."""

from .batch_processor import BatchProcessor
from .estimator import Estimator, Position
from .history import History

__all__ = ["BatchProcessor", "Estimator", "History", "Position"]
