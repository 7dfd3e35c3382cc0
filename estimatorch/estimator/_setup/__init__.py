"""What the estimator is built from and ``fit`` checks before any work: the arguments, the metric
lists, the default optimizer and handlers, the logger.
"""
