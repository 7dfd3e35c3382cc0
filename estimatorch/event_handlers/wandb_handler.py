"""The public path of :class:`~estimatorch.event_handlers.WandbHandler`, which lives beside the other
tracker and their shared base in :mod:`estimatorch.event_handlers.trackers.wandb_handler`."""

from .trackers.wandb_handler import WandbHandler

__all__ = ["WandbHandler"]
