"""The directory of one :class:`~estimatorch.CheckpointHandler`, a collaborator the handler holds
with its own state: what it checks and opens at ``fit`` start (its directory is usable and no
other fit writes there, nothing saved would be overwritten, the kind of checkpoint the net needs:
a file, or a directory for a sharded net), and on rank 0 the lock, the orphaned temporaries, the
checkpoint to resume from, and after each save the pointer and retention."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from typing import Any, Optional

import torch

from ... import checkpoint, distributed
from ...events import EstimatorView, declared
from .._paths import check_output_dir

__all__ = ["CheckpointDirectory", "absolute"]

logger = logging.getLogger("estimatorch")


class CheckpointDirectory:
    """``model_dir`` as one CheckpointHandler writes it, with the state that goes with it.

    The options are the handler's, fixed at its construction; the state: ``layout`` (the files
    written; whether checkpoints are directories is settled at ``fit`` start), ``lock`` (held on
    rank 0 during a fit), ``foreign`` (export files of another run, until the handler's state
    comes back with a resume) and, on rank 0, ``saved`` (the periodic files retention owns,
    oldest first) and ``step_file`` (the step of the newest and its file).
    """

    def __init__(self, layout: checkpoint.Layout, *, sharded: Optional[bool],
                 storage_options: Optional[dict[str, Any]], resume_from_checkpoint: bool,
                 max_checkpoints: Optional[int], best_option: Optional[str]):
        self.layout = layout
        self.model_dir, self.model_prefix, self.save_weights_only = layout.model_dir, layout.prefix, layout.weights
        self.sharded = sharded
        self.storage_options = storage_options
        self.resume_from_checkpoint = resume_from_checkpoint
        self.max_checkpoints = max_checkpoints
        #: the argument that asked for a best file (``"save_best"`` or ``"save_best_only"``), for errors
        self.best_option = best_option
        self.lock: Optional[checkpoint.DirectoryLock] = None
        self.reset()

    def reset(self) -> None:
        """Forget the files of a previous fit (at its start)."""
        self.saved: list[str] = []
        self.step_file: tuple[Optional[int], str] = (-1, "")
        self.foreign: frozenset[str] = frozenset()

    def refuse_existing(self, names: list[str], why: str = "") -> None:
        kind = "weights exports" if self.save_weights_only else "checkpoints"
        remedy = ("resume the run that wrote them (fit(..., resume=True), or a CheckpointHandler with "
                  "resume_from_checkpoint=True in the fit)" if not self.layout.resumable
                  else "pass resume_from_checkpoint=True to continue that run")
        raise FileExistsError(
            f"model_dir {self.model_dir!r} already holds {kind} of prefix {self.model_prefix!r} "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}){why}; {remedy}, or choose another "
            "model_dir or model_prefix (nothing was changed)")

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """The handler's ``check_fit``. Before any work: ``model_dir`` is usable, no other fit
        writes there, and nothing saved would be overwritten (``fit(..., resume=True)`` continues
        this estimator's own run, which may have written those files) or is of a newer format.
        (An export's files are checked in ``train_begin``, which sees whether another handler
        resumes.) ``fit`` agrees on the outcome of every rank's start checks, so an error raised
        here on rank 0 only stops every rank."""
        shards = checkpoint.is_sharded_module(estimator.net) or (
            estimator.strategy == "fsdp" and torch.distributed.is_available()
            and torch.distributed.is_initialized())  # fit shards it
        if shards and self.sharded is False and not self.save_weights_only:
            raise ValueError("CheckpointHandler(sharded=False) but the net is sharded across ranks (FSDP2): its "
                             "checkpoints are directories every rank writes its part of; leave sharded=None")
        sharded = shards or self.sharded is True
        url = checkpoint.is_url(self.model_dir)
        if url:  # again in this process (a handler sent to a spawned one keeps its options only)
            checkpoint.configure_store(self.model_dir, self.storage_options)
        if sharded and not self.save_weights_only and self.best_option is not None:
            raise ValueError(f"CheckpointHandler({self.best_option}=True) is not available for a net sharded across "
                             "ranks (FSDP2) yet: its checkpoints are directories written by every rank. "
                             "Drop it, and export the best weights as one plain file with a second "
                             "CheckpointHandler(model_dir, monitor=..., save_best_only=True, "
                             "save_weights_only=True)")
        self.layout = dataclasses.replace(self.layout, sharded=sharded)
        if distributed.is_main_process():
            if url:  # protocol, endpoint, credentials, bucket: before any step, nothing written
                checkpoint.check_reachable(self.model_dir)
            else:
                check_output_dir(self.model_dir, "model_dir")
            checkpoint.DirectoryLock(self.model_dir).check()
            if self.layout.resumable and not (self.resume_from_checkpoint or resume):
                names = self.layout.existing()
                if names:
                    self.refuse_existing(names)
            if not self.save_weights_only:
                checkpoint.refuse_newer(checkpoint.format_versions(self.model_dir, self.model_prefix))
        elif not url and os.path.lexists(self.model_dir) and not os.path.isdir(self.model_dir):
            # the other ranks only read (their model_dir may be node-local, or not there yet)
            raise ValueError(f"model_dir {self.model_dir!r} is not a directory on rank {distributed.get_rank()}")

    def check_siblings(self, others: Iterable[CheckpointDirectory]) -> None:
        """Refuse a fit where another handler's directory (of ``others``) gets the same files."""
        for other in others:
            if self.layout.shares_files_with(other.layout):
                raise ValueError(f"two CheckpointHandlers of this fit write the same files ({self.layout.describe()} "
                                 f"in {self.model_dir!r}): give one of them another model_prefix")

    def open(self, estimator: EstimatorView) -> Optional[tuple[str, dict[str, Any]]]:
        """On rank 0: lock ``model_dir``, refuse another run's files, clear orphaned temporaries,
        refuse newer-format files, choose the checkpoint to resume from (when asked), and list the
        files retention owns."""
        if not checkpoint.is_url(self.model_dir):  # an object store has no directories to make
            os.makedirs(self.model_dir, exist_ok=True)
        self.lock = checkpoint.DirectoryLock(self.model_dir)
        self.lock.acquire()
        names = self.layout.existing()  # again, under the lock: a fit may have written them since check_fit
        resuming = self.resume_from_checkpoint or estimator.resume_pending
        if names and not self.layout.resumable:
            if not (estimator.resume_pending or any(declared(h, "resumes_run") for h in estimator.handlers)):
                self.refuse_existing(names, " and this fit resumes no run")
            self.foreign = frozenset(names)
        elif names and not resuming:
            self.refuse_existing(names)
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
                if found is None and self.best_option == "save_best" and best in names:
                    self.refuse_existing([best], " but no periodic checkpoint to resume from")
            best_path = os.path.join(self.model_dir, checkpoint.best_name(self.model_prefix))
            # Files from before a resume count towards max_checkpoints; unreadable or skipped ones are not ours.
            self.saved = [path for path, version in versions.items()
                          if self.layout.resumable and version is not None and path != best_path
                          and path not in skipped]
            if found is not None:  # finish a prune a killed writer left undone (after its pointer)
                checkpoint.prune(self.saved, self.max_checkpoints, keep=found[0])
        estimator.logger.info("CheckpointHandler writes %s to %s", self.layout.describe(), self.model_dir
                              if checkpoint.is_url(self.model_dir) else os.path.abspath(self.model_dir))
        return found

    def settle(self, paths: list[str], step_now: int, periodic: bool = True) -> list[str]:
        """On rank 0, once a save's files (``paths``, the periodic one first, when ``periodic``)
        are written at step ``step_now``: the pointer, retention and orphaned temporaries.
        Returns the files removed."""
        kept = list(self.saved)
        if self.layout.resumable and periodic:
            if paths[0] in self.saved:
                self.saved.remove(paths[0])
            self.saved.append(paths[0])
            checkpoint.write_latest(self.model_dir, self.model_prefix, paths[0])
            step, earlier = self.step_file
            self.step_file = (step_now, paths[0])
            if step == step_now and earlier != paths[0]:  # one file per step: an epoch end
                self.saved = [path for path in self.saved if path != earlier]  # replaces its batch save
                checkpoint.remove_checkpoint(earlier)
            checkpoint.prune(self.saved, self.max_checkpoints, keep=paths[0])
        checkpoint.remove_orphan_temporaries(self.model_dir)
        return [path for path in kept if path not in self.saved and path not in paths]

    def release_lock(self) -> None:
        """Give ``model_dir`` back to other writers (a no-op where no lock is held)."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


def absolute(path: str) -> str:
    """A local path made absolute; a URL (``s3://bucket/run/...``) as it is."""
    return path if checkpoint.is_url(path) else os.path.abspath(path)
