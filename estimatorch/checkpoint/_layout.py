"""Which files one :class:`~estimatorch.CheckpointHandler` writes in its directory, by its options."""

from __future__ import annotations

import dataclasses
import os

from . import _store
from ._files import (
    best_name,
    best_weights_name,
    checkpoint_name,
    latest_name,
    list_checkpoints,
    list_weights,
    sharded_checkpoint_name,
    weights_name,
)

__all__ = ["Layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files of one handler: training checkpoints or weights exports (``weights``), periodic
    ones or not (``periodic``), and the best one or not (``best``), named by ``prefix``; the
    periodic checkpoints of a sharded net are directories (``sharded``).

    Example:
        >>> layout = Layout("runs", "model", weights=True, periodic=False, best=True)
        >>> layout.due(epoch=2, batch=20, is_best=True), layout.due(epoch=3, batch=30, is_best=False)
        (['model-best.weights.pt'], [])
        >>> Layout("runs", "model", weights=False, periodic=True, best=False).describe()
        'model-epoch{E}batch{B}.pt and the model-latest pointer'
    """

    model_dir: str
    prefix: str
    weights: bool
    periodic: bool
    best: bool
    sharded: bool = False

    @property
    def resumable(self) -> bool:
        """True when it writes periodic training checkpoints, which a fit can resume from."""
        return self.periodic and not self.weights

    def periodic_name(self, epoch: int, batch: int) -> str:
        if self.weights:
            return weights_name(self.prefix, epoch, batch)
        return (sharded_checkpoint_name if self.sharded else checkpoint_name)(self.prefix, epoch, batch)

    def best_name(self) -> str:
        return (best_weights_name if self.weights else best_name)(self.prefix)

    def due(self, epoch: int, batch: int, is_best: bool, periodic: bool = True) -> list[str]:
        """The names to write at a save after ``epoch`` epochs and ``batch`` batches: the periodic
        file first (unless not ``periodic`` at this save), then the best one."""
        names = [self.periodic_name(epoch, batch)] if self.periodic and periodic else []
        return names + ([self.best_name()] if is_best else [])

    def existing(self) -> list[str]:
        """The names of files of this kind (checkpoints or exports) and prefix already in the
        directory, periodic ones oldest first, then the best one, whatever the options: another
        run's files of the same names are never mixed with this run's."""
        listed = (list_weights if self.weights else list_checkpoints)(self.model_dir, self.prefix)
        names = [os.path.basename(path) for _, _, path in listed]
        if _store.exists(os.path.join(self.model_dir, self.best_name())):
            names.append(self.best_name())
        return names

    def describe(self) -> str:
        """The files it writes, in words (with ``{E}`` and ``{B}`` for the numbers)."""
        files = [self.periodic_name("{E}", "{B}")] if self.periodic else []  # type: ignore[arg-type]
        files += [self.best_name()] if self.best else []
        if self.resumable:
            files.append(f"the {latest_name(self.prefix)} pointer")
        if not files:
            return "nothing"
        return ", ".join(files[:-1]) + (" and " if len(files) > 1 else "") + files[-1]

    def shares_files_with(self, other: "Layout") -> bool:
        """True when both would write files of the same names."""
        return (self.prefix, self.weights) == (other.prefix, other.weights) \
            and os.path.realpath(self.model_dir) == os.path.realpath(other.model_dir)
