"""What every training stream shares: :class:`TrainStream`, the protocol between the loop and
the data (what a resumable stream gives ``fit``), and the settings a rebuilt
:class:`~torch.utils.data.DataLoader` keeps from the user's."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader

from .. import distributed
from .._checks import warn_user
from ._elastic import ElasticLayout, elastic_refusal
from ._fingerprint import compare_fingerprints
from ._workers import IgnoreStopSignals

__all__ = ["TrainStream", "identity", "length_of", "loader_kwargs"]

#: the salt of a rebuilt loader's generator seed, derived from (seed, epoch, salt).
LOADER_SALT = 0x10AD


class TrainStream:
    """A resumable training stream: per-epoch iterators over the training data that start at any
    batch, and what a checkpoint needs to come back to the same batch. ``fit`` reads it through
    this interface only, whichever adapter opened it (see :class:`~estimatorch.data.StreamAdapter`).

    The loop's use, in order: :meth:`fingerprint` and :meth:`state_dict` at every checkpoint; on a
    resume :meth:`check_fingerprint` (before anything is restored), :meth:`load_state_dict`, then
    :meth:`epoch_iter` from the saved position; :meth:`close` when ``fit`` ends. A subclass
    overrides :meth:`epoch_iter` and, when it keeps a position of its own, the state pair.

    Attributes:
        seed: the seed of the fit (every random draw of the stream derives from it).
        batches_per_epoch: batches in a full epoch, None when unknown (an iterable without a length).
        exact: True when :meth:`epoch_iter` positions at a batch without relying on the data
            yielding the same batches when iterated again (a replay of an unknown iterable is
            not exact: ``fit`` warns at its start when it may resume).
        layout: the :class:`~estimatorch.data.ElasticLayout` of the batches once
            :meth:`use_elastic` laid them out in global optimizer steps, else None.
        kind: what the user passed, in words, for messages ("a list or tuple of batches").
        batch_size: the samples of a full batch, when known (a DataLoader's ``batch_size``).
        even_shares: True when every process's batch ``i`` of an epoch holds as many samples as
            every other process's (a distributed sampler's equal, padded shares).
        stops_while_fetching: whether a signal may stop the fit at once while the next batch is
            being made (the loop's ``signals.stoppable``). False where the training process makes
            it itself and a half-made batch would advance what the checkpoint saves (the dataset's
            own state, your generators): the signal then stops at the boundary after that batch's
            step, so the state saved is the state of that boundary wherever the signal lands.
    """

    batches_per_epoch: Optional[int] = None
    exact: bool = True
    layout: Optional[ElasticLayout] = None
    kind: str = "an iterable of batches"
    batch_size: Optional[int] = None
    even_shares: bool = False
    stops_while_fetching: bool = True

    def __init__(self, seed: int):
        self.seed = seed

    def fingerprint(self) -> dict[str, Any]:
        """What shapes the data stream (a flat dict of plain values, saved with every checkpoint);
        a resume with a different fingerprint is refused."""
        return {"world_size": distributed.get_world_size(), "seed": self.seed}

    def check_fingerprint(self, saved: dict[str, Any], source: str) -> None:
        """Raise a ``ValueError`` naming what differs when a checkpoint of fingerprint ``saved``
        (read from ``source``) cannot resume this stream. The one judge of that question: ``fit``
        asks it before it checks or restores anything else of the checkpoint."""
        compare_fingerprints(saved, self.fingerprint(), source)

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:  # pragma: no cover - abstract
        """The batches of epoch ``epoch`` from batch ``start`` (0-based) to the epoch's end; empty
        when ``start`` is the epoch's length (a checkpoint at its last batch)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What :meth:`epoch_iter` needs besides ``(epoch, start)`` to resume at the batch after the
        last one it yielded (plain values and tensors: ``torch.load(weights_only=True)`` reads it)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output before the next :meth:`epoch_iter`."""

    def use_elastic(self, accumulation_steps: int, device: Optional[torch.device] = None) -> None:
        """Lay the batches out in global optimizer steps (``CheckpointHandler(..., elastic=True)``):
        every process's batch ``b`` holds the samples of its slot in the step, whatever the world
        size; sets :attr:`layout`. Raises a ``ValueError`` naming the data when it cannot be laid
        out so (the default: only a map-style loader with a known order can)."""
        raise elastic_refusal(f"train_data that is {self.kind}")

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
    if loader.num_workers > 0 and getattr(loader, "in_order", True) is False:
        # in arrival order, the batch at a position depends on the workers' timing: a resume at
        # batch k would train some samples twice and others never (and no two runs agree)
        warn_user(
            f"train_data's {type(loader).__name__} has in_order=False with num_workers={loader.num_workers}: "
            "its batches would train in the order the workers finish them, which no run repeats and no "
            "checkpoint can position (a resume would train some samples twice and skip others). fit "
            "trains them in the sampler's order (in_order=True); the batches are the same, only a slow "
            "batch is no longer overtaken.")
    params = inspect.signature(DataLoader.__init__).parameters
    if "in_order" in params:
        kwargs["in_order"] = True  # see above: the order is the sampler's, for an exact resume
    if getattr(loader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = loader.pin_memory_device
    return kwargs


