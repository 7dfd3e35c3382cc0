"""CheckpointHandler: periodic, best and resumable checkpoints."""

from __future__ import annotations

import logging
import math
import os
import warnings
from typing import Any, Optional, Union

from .. import distributed
from ..metrics.base import is_metric, metric_name
from ._base import StatefulHandler, check_file_prefix, check_positive_int
from ._paths import check_output_dir
from ._schedule import EventFilter
from ._subscribe import periodic_events, with_events
from .early_stopping import improved, resolve_mode
from .mixins import TrainBegin, TrainEnd

__all__ = ["CheckpointHandler"]

logger = logging.getLogger("estimatorch")


def _checkpoint() -> Any:
    """``estimatorch.checkpoint``, imported on first use (it needs the rest of the package, which
    imports this module while it initialises)."""
    from .. import checkpoint

    return checkpoint


class CheckpointHandler(StatefulHandler, TrainBegin, TrainEnd):
    """Save everything needed to resume, every few epochs and/or batches; resume from the newest.

    A checkpoint holds the model (under the plain module's keys, also for a ``torch.compile``d
    net), optimizer, LR scheduler, grad scaler, every handler's state, the metric accumulators,
    every rank's RNG states, the data position and a fingerprint of the data stream (see
    :mod:`estimatorch.checkpoint`). It is written when the event that triggered it has reached
    every handler, so its state is the same whatever the handlers' priorities, to
    ``{model_prefix}-epoch{E}batch{B}.pt`` (E epochs completed and B batches trained). Only
    global rank 0 writes.

    **Writing.** Each save writes a temporary file, fsyncs it, renames it into place and fsyncs
    the directory; then (when it improved) ``{model_prefix}-best.pt`` the same way; then the
    ``{model_prefix}-latest`` pointer (atomically); then retention deletes the oldest periodic
    files beyond ``max_checkpoints``, and temporaries of interrupted writes are removed. A kill at
    any moment leaves every checkpoint complete and the pointer naming an existing file. A failed
    write (a full disk, an I/O error, a read-only filesystem) raises an ``OSError`` naming the
    file and the reason and leaves the earlier files and the pointer as they were.

    **One writer per directory.** At ``fit`` start rank 0 takes a lock in ``model_dir`` (an
    ``flock`` on ``.estimatorch.lock``, which records host and pid) and holds it until the fit
    ends, however it ends. A second fit into the same ``model_dir`` fails at start with
    :class:`~estimatorch.checkpoint.DirectoryLockedError` naming the process that holds it; a
    lock left by a process that died is taken over with a logged warning. (On a network
    filesystem this needs working ``flock``, as NFS v4 provides.)

    **Resuming.** With ``resume_from_checkpoint=True``, ``fit`` resumes from the newest checkpoint
    of ``model_prefix`` in ``model_dir`` that loads and validates against this fit (every key,
    type and tensor shape the resume reads: model, optimizer, scheduler, handler and metric
    states, position, RNG), and continues its plan exactly where it stopped. A file that fails is
    reported (name and reason) and the previous one is tried, with a warning; when checkpoints
    exist but none fits, ``fit`` stops at start (nothing is changed); without any, it starts
    fresh. A file written by a newer estimatorch stops ``fit`` at start and is never pruned or
    overwritten. Under torch.distributed rank 0 chooses the file and every rank loads that file
    from its own ``model_dir``, checking it reads the same bytes: a rank that cannot is an error
    on every rank, never a hang. ``model_dir`` should therefore be on a filesystem every node
    sees (with node-local directories, copy rank 0's files to every node before resuming).
    Without ``resume_from_checkpoint``, ``fit`` refuses to start in a directory that already
    holds checkpoints of that prefix, so nothing saved is ever overwritten.

    **Retention** deletes only periodic files of ``model_prefix`` that this fit wrote or that
    belong to the run it resumed (readable files up to the one it resumed from), never the file
    the pointer names, never ``-best.pt``, never a file it skipped as unusable or cannot read.

    Args:
        model_dir: the directory (created if missing); a file, a dangling symlink or a directory
            this process cannot write is a ``ValueError`` at ``fit`` start.
        model_prefix: file name prefix. Defaults to ``"model"``.
        monitor: a metric the estimator owns, for ``save_best``. Defaults to None.
        verbose: 1 logs every save. Defaults to 0.
        save_best: also keep ``{model_prefix}-best.pt``, the checkpoint where ``monitor`` was
            best, checked at every periodic save. Defaults to False.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the monitor's ``higher_is_better``).
            Defaults to ``"auto"``.
        epoch_period: save every this many epochs; None for never. Defaults to 1.
        batch_period: save every this many batches (over the run); None for never. Defaults to None.
        max_checkpoints: periodic files kept (the oldest are deleted, also ones from before a
            resume); None keeps all. Defaults to 5.
        resume_from_checkpoint: Defaults to False.

    Example:
        >>> import tempfile
        >>> handler = CheckpointHandler(tempfile.mkdtemp(), batch_period=100, max_checkpoints=3)
        >>> handler.batch_period, handler.max_checkpoints
        (100, 3)
    """

    _state_attrs = ("current_epoch", "current_batch", "best")

    def __new__(cls, *args: Any, **kwargs: Any) -> "CheckpointHandler":
        return super().__new__(with_events(cls, periodic_events(cls, args, kwargs)))  # only the periods set

    def __init__(self, model_dir: Union[str, os.PathLike], model_prefix: str = "model", monitor: Any = None,
                 verbose: int = 0, save_best: bool = False, mode: str = "auto", epoch_period: Optional[int] = 1,
                 batch_period: Optional[int] = None, max_checkpoints: Optional[int] = 5,
                 resume_from_checkpoint: bool = False):
        if not isinstance(model_dir, (str, os.PathLike)) or not os.fspath(model_dir):
            raise TypeError(f"model_dir must be a directory path, got {model_dir!r}")
        check_file_prefix(model_prefix, "model_prefix")
        if monitor is not None and not is_metric(monitor):
            raise TypeError(f"monitor must be a metric the estimator owns, got {monitor!r}")
        if verbose not in (0, 1):
            raise ValueError(f"verbose must be 0 or 1, got {verbose!r}")
        for arg, value in (("save_best", save_best), ("resume_from_checkpoint", resume_from_checkpoint)):
            if not isinstance(value, bool):
                raise TypeError(f"{arg} must be a bool, got {value!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if save_best and monitor is None:
            raise ValueError("save_best=True needs monitor= (a metric, e.g. est.val_metrics[0])")
        self.epoch_period = check_positive_int(epoch_period, "epoch_period", allow_none=True)
        self.batch_period = check_positive_int(batch_period, "batch_period", allow_none=True)
        if epoch_period is None and batch_period is None:
            raise ValueError("epoch_period and batch_period are both None: nothing would be saved")
        self.max_checkpoints = check_positive_int(max_checkpoints, "max_checkpoints", allow_none=True)
        self.model_dir = os.fspath(model_dir)
        self.model_prefix = model_prefix
        self.monitor = monitor
        self.verbose = verbose
        self.save_best = save_best
        self.mode = resolve_mode(mode, monitor, "CheckpointHandler") if monitor is not None else mode
        self.resume_from_checkpoint = resume_from_checkpoint
        self._epoch_filter = EventFilter(every=epoch_period) if epoch_period else None
        self._batch_filter = EventFilter(every=batch_period) if batch_period else None
        self._lock: Any = None  # the model_dir lock, held on rank 0 during fit
        self._reset()

    def _reset(self) -> None:
        self.current_epoch = 0
        self.current_batch = 0
        self.best = math.inf if self.mode == "min" else -math.inf
        self.saved: list[str] = []
        self._saved_step = -1  # the step of this run's last save
        self._warned_nan = False

    def _existing(self) -> list[str]:
        """The names of this prefix's checkpoints already in ``model_dir`` (periodic and best)."""
        checkpoint = _checkpoint()
        names = [os.path.basename(p) for _, _, p in checkpoint.list_checkpoints(self.model_dir, self.model_prefix)]
        if os.path.exists(os.path.join(self.model_dir, checkpoint.best_name(self.model_prefix))):
            names.append(checkpoint.best_name(self.model_prefix))
        return names

    def _refuse_existing(self, names: list[str]) -> None:
        raise FileExistsError(
            f"model_dir {self.model_dir!r} already holds checkpoints of prefix {self.model_prefix!r} "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); pass "
            "resume_from_checkpoint=True to continue that run, or choose another model_dir or model_prefix"
        )

    def _check_fit(self, estimator: Any, resume: bool) -> None:
        """Before any work, on every rank together: ``model_dir`` is usable, no other fit writes
        there, and nothing saved would be overwritten (``fit(..., resume=True)`` continues this
        estimator's own run, which may have written those files) or is of a newer format."""
        checkpoint = _checkpoint()
        error: Optional[Exception] = None
        try:
            if distributed.is_main_process():
                check_output_dir(self.model_dir, "model_dir")
                checkpoint.DirectoryLock(self.model_dir).check()
                if not (self.resume_from_checkpoint or resume):
                    names = self._existing()
                    if names:
                        self._refuse_existing(names)
                checkpoint.refuse_newer(checkpoint.format_versions(self.model_dir, self.model_prefix))
            elif os.path.lexists(self.model_dir) and not os.path.isdir(self.model_dir):
                # the other ranks only read (their model_dir may be node-local, or not there yet)
                raise ValueError(f"model_dir {self.model_dir!r} is not a directory on rank {distributed.get_rank()}")
        except Exception as err:  # noqa: BLE001 - every rank must hear of it (share_outcome)
            error = err
        failure = distributed.share_outcome(error)
        if failure is not None:
            raise failure[1]

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: Any, **kwargs: Any) -> None:
        self._reset()
        checkpoint = _checkpoint()
        found, error = None, None
        if distributed.is_main_process():
            try:
                found = self._open_directory(estimator)
            except Exception as err:  # noqa: BLE001 - every rank must hear of it (share_outcome)
                error = err
        failure = distributed.share_outcome(error)
        if failure is not None:
            raise failure[1]
        if not self.resume_from_checkpoint or estimator.resume_pending:  # pending: fit(..., resume=True)
            return
        rank = distributed.get_rank()
        found = checkpoint.agree_on_checkpoint(
            estimator, self.model_dir, found,
            lambda path, payload: estimator.request_resume(checkpoint.rank_snapshot(payload, rank), source=path))
        if found is None:
            estimator.logger.info("No checkpoint of prefix %r in %s: starting a new run", self.model_prefix, self.model_dir)
            return
        checkpoint.restore_training_state(estimator, found[1])

    def _open_directory(self, estimator: Any) -> Optional[tuple[str, dict[str, Any]]]:
        """On rank 0: lock ``model_dir``, clear orphaned temporaries, refuse newer-format files,
        choose the checkpoint to resume from (when asked), and list the files retention owns."""
        checkpoint = _checkpoint()
        os.makedirs(self.model_dir, exist_ok=True)
        self._lock = checkpoint.DirectoryLock(self.model_dir)
        self._lock.acquire()
        if not (self.resume_from_checkpoint or estimator.resume_pending):
            names = self._existing()  # again, under the lock: a fit may have written them since _check_fit
            if names:
                self._refuse_existing(names)
        removed = checkpoint.remove_orphan_temporaries(self.model_dir)
        if removed:
            logger.info("Removed %d temporary file(s) of interrupted writes from %s", len(removed), self.model_dir)
        versions = checkpoint.format_versions(self.model_dir, self.model_prefix)
        checkpoint.refuse_newer(versions)
        found, skipped = None, []
        if self.resume_from_checkpoint and not estimator.resume_pending:
            found, skipped = checkpoint.choose_checkpoint(estimator, self.model_dir, self.model_prefix)
        best = os.path.join(self.model_dir, checkpoint.best_name(self.model_prefix))
        # Files from before a resume count towards max_checkpoints; unreadable or skipped ones are not ours.
        self.saved = [path for path, version in versions.items()
                      if version is not None and path != best and path not in skipped]
        return found

    def train_end(self, estimator: Any, **kwargs: Any) -> None:
        self._release_lock()

    def _release_lock(self) -> None:
        """Give ``model_dir`` back to other writers (a no-op where no lock is held)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.current_batch += 1
        if self._batch_filter is not None and self._batch_filter(self.current_batch):
            estimator.at_boundary(lambda: self._save(estimator))

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.current_epoch += 1
        if self._epoch_filter is None or not self._epoch_filter(self.current_epoch):
            return
        pos = estimator.position
        if pos.stop and pos.step == self._saved_step:
            # A stop cut this epoch short right after a batch checkpoint. That file stays the
            # newest: resumed with a larger plan it continues the epoch exactly, while one written
            # after this epoch_end would start the next epoch. (The same plan redoes epoch_end.)
            return
        estimator.at_boundary(lambda: self._save(estimator))

    # -- saving ----------------------------------------------------------------------------
    def _save(self, estimator: Any) -> None:
        """Write a checkpoint of the current boundary. A collective: every rank calls it."""
        best_value = float(self.monitor.compute()) if self.save_best else None  # a collective
        is_best = best_value is not None and not math.isnan(best_value) and improved(best_value, self.best, self.mode)
        if best_value is not None and math.isnan(best_value) and not self._warned_nan:
            self._warned_nan = True  # once per fit: a val monitor is nan at every save before validating
            warnings.warn(f"CheckpointHandler: {metric_name(self.monitor)} is nan (not computed yet?); "
                          "the best checkpoint is updated only with a value", stacklevel=2)
        if is_best:
            self.best = best_value
        checkpoint = _checkpoint()
        self._saved_step = estimator.position.step
        payload = checkpoint.build_payload(estimator)  # a collective: every rank contributes
        if not distributed.is_main_process():
            return
        pos = estimator.position
        path = os.path.join(self.model_dir, checkpoint.checkpoint_name(self.model_prefix, pos.epoch, pos.step))
        checkpoint.atomic_save(payload, path)
        if path in self.saved:
            self.saved.remove(path)
        self.saved.append(path)
        if is_best:
            checkpoint.atomic_save(payload, os.path.join(self.model_dir, checkpoint.best_name(self.model_prefix)))
        checkpoint.write_latest(self.model_dir, self.model_prefix, path)
        self._prune(keep=path)
        checkpoint.remove_orphan_temporaries(self.model_dir)
        if self.verbose:
            estimator.logger.info("Saved checkpoint %s%s", path,
                                  f" (best {metric_name(self.monitor)}: {best_value:.6g})" if is_best else "")

    def _prune(self, keep: str) -> None:
        """Delete the oldest files retention owns beyond ``max_checkpoints``, never ``keep`` (the
        file the pointer names)."""
        if self.max_checkpoints is None:
            return
        while len(self.saved) > self.max_checkpoints:
            old = next(path for path in self.saved if path != keep)
            self.saved.remove(old)
            try:
                os.remove(old)
            except FileNotFoundError:  # already gone: nothing to do
                continue
