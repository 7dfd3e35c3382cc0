"""What every training stream shares: the :class:`TrainStream` interface, and the settings a
rebuilt :class:`~torch.utils.data.DataLoader` keeps from the user's."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Callable, Optional

from torch.utils.data import DataLoader

from .. import distributed
from ._workers import IgnoreStopSignals

__all__ = ["TrainStream", "identity", "length_of", "loader_kwargs"]

#: the salt of a rebuilt loader's generator seed, derived from (seed, epoch, salt).
LOADER_SALT = 0x10AD


class TrainStream:
    """Per-epoch iterators over the training data that can start at any batch."""

    #: batches in a full epoch, when known.
    batches_per_epoch: Optional[int] = None
    #: True when resuming positions the data without loading skipped batches.
    exact: bool = True

    def __init__(self, seed: int):
        self.seed = seed

    def fingerprint(self) -> dict[str, Any]:
        """What shapes the data stream; a resume with a different fingerprint is refused."""
        return {"world_size": distributed.get_world_size(), "seed": self.seed}

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def refuse(self, fingerprint: dict[str, Any], source: str) -> None:
        """Raise a ``ValueError`` when a checkpoint of this ``fingerprint`` can never resume this
        stream (not merely an invalid file, which the store skips for an older one)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output before the next :meth:`epoch_iter`."""

    def close(self) -> None:
        """Release what the stream holds once ``fit`` is over (worker processes)."""


def identity(batch: Any) -> Any:
    return batch


def length_of(data: Any) -> Optional[int]:
    """``len(data)``, or None when it has none (a DataLoader over an IterableDataset raises)."""
    try:
        return len(data)
    except TypeError:
        return None


def _quiet_workers(loader: DataLoader[Any]) -> Optional[Callable[[int], Any]]:
    """``loader``'s ``worker_init_fn``, wrapped so that its workers ignore Ctrl-C and SIGTERM."""
    fn = loader.worker_init_fn
    if loader.num_workers == 0 or isinstance(fn, IgnoreStopSignals):
        return fn
    return IgnoreStopSignals(fn)


def loader_kwargs(loader: DataLoader[Any]) -> dict[str, Any]:
    """The settings of ``loader`` that a rebuilt loader keeps."""
    kwargs: dict[str, Any] = dict(
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=_quiet_workers(loader),
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    params = inspect.signature(DataLoader.__init__).parameters
    if "in_order" in params:
        kwargs["in_order"] = getattr(loader, "in_order", True)
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    return kwargs


