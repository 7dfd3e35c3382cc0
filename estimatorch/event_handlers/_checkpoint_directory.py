"""What a :class:`~estimatorch.CheckpointHandler` checks and opens at ``fit`` start: its directory
is usable and no other fit writes there, nothing saved would be overwritten, the kind of
checkpoint the net needs (a file, or a directory for a sharded net), and on rank 0 the lock, the
orphaned temporaries, the checkpoint to resume from and the files retention owns."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import torch

from .. import checkpoint, distributed
from ..events import EstimatorView, declared
from ._paths import check_output_dir

__all__ = ["DirectoryChecks"]

logger = logging.getLogger("estimatorch")


class DirectoryChecks:
    """The start-of-fit checks and the opening of ``model_dir``, for CheckpointHandler (which
    sets the attributes they read: ``model_dir``, ``model_prefix``, ``_layout`` and the options)."""

    model_dir: str
    model_prefix: str
    _layout: Any
    _foreign: frozenset
    _lock: Any
    saved: list
    save_weights_only: bool
    save_best: bool
    resume_from_checkpoint: bool
    max_checkpoints: Optional[int]
    sharded: Optional[bool]
    storage_options: Optional[dict[str, Any]]

    def _refuse_existing(self, names: list[str], why: str = "") -> None:
        kind = "weights exports" if self.save_weights_only else "checkpoints"
        remedy = ("resume the run that wrote them (fit(..., resume=True), or a CheckpointHandler with "
                  "resume_from_checkpoint=True in the fit)" if not self._layout.resumable
                  else "pass resume_from_checkpoint=True to continue that run")
        raise FileExistsError(
            f"model_dir {self.model_dir!r} already holds {kind} of prefix {self.model_prefix!r} "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}){why}; {remedy}, or choose another "
            "model_dir or model_prefix (nothing was changed)")

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work: ``model_dir`` is usable, no other fit writes there, and nothing saved
        would be overwritten (``fit(..., resume=True)`` continues this estimator's own run, which
        may have written those files) or is of a newer format. (An export's files are checked in
        ``train_begin``, which sees whether another handler resumes.) ``fit`` agrees on the
        outcome of every rank's start checks, so an error raised here on rank 0 only stops every
        rank."""
        shards = checkpoint.is_sharded_module(estimator.net) or (
            getattr(estimator, "strategy", None) == "fsdp" and torch.distributed.is_available()
            and torch.distributed.is_initialized())  # fit shards it
        if shards and self.sharded is False and not self.save_weights_only:
            raise ValueError("CheckpointHandler(sharded=False) but the net is sharded across ranks (FSDP2): its "
                             "checkpoints are directories every rank writes its part of; leave sharded=None")
        sharded = shards or self.sharded is True
        url = checkpoint.is_url(self.model_dir)
        if url:  # again in this process (a handler sent to a spawned one keeps its options only)
            checkpoint.configure_store(self.model_dir, self.storage_options)
        if sharded and not self.save_weights_only:
            for arg in ("save_best", "save_best_only"):
                if getattr(self, arg):
                    raise ValueError(f"CheckpointHandler({arg}=True) is not available for a net sharded across "
                                     "ranks (FSDP2) yet: its checkpoints are directories written by every rank. "
                                     "Drop it, and export the best weights as one plain file with a second "
                                     "CheckpointHandler(model_dir, monitor=..., save_best_only=True, "
                                     "save_weights_only=True)")
        self._layout = dataclasses.replace(self._layout, sharded=sharded)
        if distributed.is_main_process():
            if url:  # protocol, endpoint, credentials, bucket: before any step, nothing written
                checkpoint.check_reachable(self.model_dir)
            else:
                check_output_dir(self.model_dir, "model_dir")
            checkpoint.DirectoryLock(self.model_dir).check()
            if self._layout.resumable and not (self.resume_from_checkpoint or resume):
                names = self._layout.existing()
                if names:
                    self._refuse_existing(names)
            if not self.save_weights_only:
                checkpoint.refuse_newer(checkpoint.format_versions(self.model_dir, self.model_prefix))
        elif not url and os.path.lexists(self.model_dir) and not os.path.isdir(self.model_dir):
            # the other ranks only read (their model_dir may be node-local, or not there yet)
            raise ValueError(f"model_dir {self.model_dir!r} is not a directory on rank {distributed.get_rank()}")

    def _check_siblings(self, estimator: EstimatorView) -> None:
        for other in estimator.handlers:
            if other is not self and isinstance(other, DirectoryChecks) \
                    and self._layout.shares_files_with(other._layout):
                raise ValueError(f"two CheckpointHandlers of this fit write the same files ({self._layout.describe()} "
                                 f"in {self.model_dir!r}): give one of them another model_prefix")

    def _open_directory(self, estimator: EstimatorView) -> Optional[tuple[str, dict[str, Any]]]:
        """On rank 0: lock ``model_dir``, refuse another run's files, clear orphaned temporaries,
        refuse newer-format files, choose the checkpoint to resume from (when asked), and list the
        files retention owns."""
        if not checkpoint.is_url(self.model_dir):  # an object store has no directories to make
            os.makedirs(self.model_dir, exist_ok=True)
        self._lock = checkpoint.DirectoryLock(self.model_dir)
        self._lock.acquire()
        names = self._layout.existing()  # again, under the lock: a fit may have written them since check_fit
        resuming = self.resume_from_checkpoint or estimator.resume_pending
        if names and not self._layout.resumable:
            if not (estimator.resume_pending or any(declared(h, "resumes_run") for h in estimator.handlers)):
                self._refuse_existing(names, " and this fit resumes no run")
            self._foreign = frozenset(names)
        elif names and not resuming:
            self._refuse_existing(names)
        removed = checkpoint.remove_orphan_temporaries(self.model_dir)
        if removed:
            logger.info("Removed %d temporary file(s) or incomplete upload(s) of interrupted writes from %s",
                        len(removed), self.model_dir)
        found: Optional[tuple[str, dict[str, Any]]] = None
        if not self.save_weights_only:
            versions = checkpoint.format_versions(self.model_dir, self.model_prefix)
            checkpoint.refuse_newer(versions)
            skipped: list[str] = []
            if self.resume_from_checkpoint and not estimator.resume_pending:
                found, skipped = checkpoint.choose_checkpoint(estimator, self.model_dir, self.model_prefix)
                best = checkpoint.best_name(self.model_prefix)
                if found is None and self.save_best and best in names:
                    self._refuse_existing([best], " but no periodic checkpoint to resume from")
            best_path = os.path.join(self.model_dir, checkpoint.best_name(self.model_prefix))
            # Files from before a resume count towards max_checkpoints; unreadable or skipped ones are not ours.
            self.saved = [path for path, version in versions.items()
                          if self._layout.resumable and version is not None and path != best_path
                          and path not in skipped]
            if found is not None:  # finish a prune a killed writer left undone (after its pointer)
                checkpoint.prune(self.saved, self.max_checkpoints, keep=found[0])
        estimator.logger.info("CheckpointHandler writes %s to %s", self._layout.describe(), self.model_dir
                              if checkpoint.is_url(self.model_dir) else os.path.abspath(self.model_dir))
        return found
