"""What the estimator is built from and ``fit`` checks before any work: the arguments, the metric
lists, the default optimizer and handlers, the logger.
"""

from .metrics import metric_lists
from .optimizer import default_optimizer

__all__ = ["default_optimizer", "metric_lists"]  # what the Estimator is built with
