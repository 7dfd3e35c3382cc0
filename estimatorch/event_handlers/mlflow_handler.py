"""The public path of :class:`~estimatorch.event_handlers.MLflowHandler`, which lives beside the other
tracker and their shared base in :mod:`estimatorch.event_handlers.trackers.mlflow_handler`."""

from .trackers.mlflow_handler import MLflowHandler

__all__ = ["MLflowHandler"]
