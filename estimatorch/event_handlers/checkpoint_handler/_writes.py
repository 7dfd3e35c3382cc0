"""How a :class:`~estimatorch.CheckpointHandler` writes (:class:`CheckpointWrites`, which the
handler owns): what is due at a boundary (periodic, best, a sharded net's directory), the files on
rank 0 then the pointer and retention, a save handed to its background writer, and its background
writes ended at ``train_end`` (which ranks wait for the write in flight and where its failure is
raised). The handler decides what to save (the best value, its counters); these write it."""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Optional

import torch

from ... import checkpoint, distributed
from ...events import EstimatorView, PositionView, evaluation_weights
from ._directory import CheckpointDirectory, absolute

__all__ = ["CheckpointWrites", "finish_background_write", "submit_background_write"]


def submit_background_write(writer: checkpoint.BackgroundWriter, state: Any, paths: list[str],
                            write: Callable[[Any, bool], None]) -> None:
    """Hand a save of ``state`` to ``paths`` to the background writer: the files to its process,
    then ``write(None, True)`` on its thread (the pointer, retention); or everything to its
    thread (``async_save="thread"``): ``write(staged, False)``."""
    if isinstance(writer, checkpoint.ProcessWriter):
        writer.submit_files(state, paths, lambda: write(None, True))
    else:
        writer.submit(state, lambda staged: write(staged, False))


def finish_background_write(writer: Optional[checkpoint.BackgroundWriter], sharded: bool,
                            estimator: EstimatorView) -> None:
    """Wait for the background write in flight and raise its failure: on every rank where
    every rank ends the fit at the same boundary (a signal, or the plan's end or a stop with
    no error on its way), else (an error, maybe on this rank only: no collective) where it
    was met. (For a ``sharded`` net every rank has a writer of its own part.)"""
    if writer is None:
        return
    together = estimator.interruption is not None or (estimator.position.stop and sys.exc_info()[1] is None)
    what = "CheckpointHandler writing a checkpoint in the background"
    if sharded:
        error: Optional[BaseException] = None
        try:
            writer.wait()
        except Exception as err:  # noqa: BLE001 - every rank raises it, or this one where ranks part
            error = err
        if together:
            distributed.raise_on_every_rank(error, what)
        elif error is not None:
            raise error
    elif together:
        distributed.run_on_main(writer.wait, what)
    elif distributed.is_main_process():
        writer.wait()


def _own_copy(state: Any) -> Any:
    """A weights state whose tensors are copies (on the CPU, ``weights_state`` refers to the net's)."""
    out = type(state)((k, v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


class CheckpointWrites:
    """The saves of one :class:`~estimatorch.CheckpointHandler`: the files of its ``directory``
    (the lock, pointer and retention are the directory's) and its background ``writer`` (None
    without ``async_save``; rank 0's, every rank's for a sharded net)."""

    def __init__(self, directory: CheckpointDirectory, writer: Optional[checkpoint.BackgroundWriter]):
        self.directory = directory
        self.writer = writer

    def due(self, pos: PositionView, is_best: bool, periodic: bool = True) -> list[str]:
        """The names of the files due at the boundary ``pos`` (``periodic``: the periodic file is
        due; ``is_best``: the monitor improved); raises ``FileExistsError`` (the same on every
        rank: nothing is written anywhere) where one is an export of another run."""
        directory = self.directory
        names = directory.layout.due(pos.epoch, pos.step, is_best, periodic=periodic)
        clash = [name for name in names if name in directory.foreign]
        if clash:
            raise FileExistsError(
                f"{os.path.join(directory.model_dir, clash[0])!r} was there when this fit started and this handler's "
                f"state (its best value) did not come back with the resume, so it belongs to another run and is "
                "left untouched: resume from a checkpoint written with this handler in the fit, move the file "
                "away, or choose another model_prefix")
        return names

    def save(self, estimator: EstimatorView, names: list[str], *, note: Optional[str], background: bool = True,
             periodic: bool = True, save_frozen: bool = False) -> None:
        """Write ``names`` (:meth:`due`; the periodic file first when ``periodic``) at the current
        boundary, with the handler's state as it is now (with ``async_save`` and ``background``,
        handed to the writer); ``note``: what the log line of a save says after the path (None: no
        log line); ``save_frozen``: a net's frozen parameters too (else their fingerprints). A
        collective: every rank calls it."""
        step = estimator.position.step  # the boundary's: a background write runs later
        layout = self.directory.layout
        if layout.sharded and not layout.weights:  # every rank writes its part
            self._save_sharded(estimator, names, note, step, background)
            return
        if layout.weights:  # a sharded net's weights are gathered: a collective
            with evaluation_weights(estimator) as averaged:  # the weights validation runs on (an average)
                state = checkpoint.weights_state(estimator.net) if layout.sharded or distributed.is_main_process() \
                    else None
                if averaged is not None and state is not None:
                    state = _own_copy(state)  # the net's own weights come back when the block ends
        else:
            state = checkpoint.build_payload(estimator, save_frozen=save_frozen)  # a collective
        writer = self.writer if background else None
        if writer is None:  # a full disk on rank 0 stops every rank, never a hang
            distributed.run_on_main(lambda: self._write(estimator, state, names, note, step, periodic=periodic),
                                    "CheckpointHandler writing a checkpoint")
        else:  # the previous background write's failure too
            paths = [os.path.join(self.directory.model_dir, name) for name in names]
            distributed.run_on_main(lambda: submit_background_write(
                writer, state, paths, lambda staged, written: self._write(estimator, staged, names, note, step,
                                                                          written=written, periodic=periodic)),
                                    "CheckpointHandler writing a checkpoint")

    def finish(self, estimator: EstimatorView) -> None:
        """At ``train_end``: wait for the background write in flight and raise its failure
        (:func:`finish_background_write`)."""
        finish_background_write(self.writer, self.directory.layout.sharded, estimator)

    def _save_sharded(self, estimator: EstimatorView, names: list[str], note: Optional[str], step: int,
                      background: bool) -> None:
        """A sharded net's checkpoint directory, written by every rank (a collective; with
        ``async_save`` and ``background``, by each rank's writer thread), then rank 0's pointer
        and retention. A directory of the same name (one the resume skipped as unusable, as a
        file of that name would be replaced) is removed first."""
        path = os.path.join(self.directory.model_dir, names[0])
        distributed.run_on_main(lambda: checkpoint.remove_checkpoint(path), "CheckpointHandler clearing " + path)

        def settle() -> None:
            distributed.run_on_main(lambda: self._write(estimator, None, names, note, step, written=True),
                                    "CheckpointHandler moving the pointer")

        checkpoint.save_fit_checkpoint(estimator, path, writer=self.writer if background else None, then=settle)

    def _write(self, estimator: EstimatorView, state: Any, names: list[str], note: Optional[str], step_now: int,
               written: bool = False, periodic: bool = True) -> None:
        """On rank 0: the files of one save (at step ``step_now``; already ``written`` by the
        writer process, or for a sharded checkpoint), the periodic one first (when ``periodic``),
        then the best one; then the pointer, retention and orphaned temporaries."""
        paths = [os.path.join(self.directory.model_dir, name) for name in names]
        for path in paths if not written else ():
            checkpoint.atomic_save(state, path)
        removed = self.directory.settle(paths, step_now, periodic=periodic)
        estimator.fire("checkpoint_saved", written=[absolute(path) for path in paths],
                       removed=[absolute(path) for path in removed])
        if note is not None:
            kind = "weights export" if self.directory.layout.weights else "checkpoint"
            estimator.logger.info("Saved %s %s%s", kind, paths[0], note)
