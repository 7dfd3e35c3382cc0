"""CheckpointHandler: periodic, best and resumable checkpoints, and weights exports for inference."""

from __future__ import annotations

import logging
import math
import os
import weakref
from typing import Any, Optional, Union

from ... import checkpoint, distributed
from ..._checks import check_positive_int, check_state_keys, is_real, warn_user
from ..._schedule import EventFilter
from ...events import BatchEnd, EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd, ValidationEnd
from ...events.monitor import improved, resolve_mode
from ...metrics.base import metric_name
from ._arguments import check_arguments
from ._directory import CheckpointDirectory, absolute
from ._writes import CheckpointWrites

__all__ = ["CheckpointHandler"]

logger = logging.getLogger("estimatorch")


class CheckpointHandler(StatefulHandler, TrainBegin, TrainEnd, BatchEnd, EpochEnd, ValidationEnd):
    """Save resumable checkpoints every few epochs and/or batches and resume from the newest; or export weights.

    A checkpoint holds the model (under the plain module's keys, also for a ``torch.compile``d
    net), optimizer, LR scheduler, grad scaler, every handler's state, the metric accumulators,
    every rank's RNG states, the data position and a fingerprint of the data stream (see
    :mod:`estimatorch.checkpoint`). It is written when the event that triggered it has reached
    every handler, so its state is the same whatever the handlers' priorities, to
    ``{model_prefix}-epoch{E}batch{B}.pt`` (E epochs completed and B batches trained). Only
    global rank 0 writes. At ``fit`` start it logs the directory and the files it writes there.

    **A net sharded across ranks** (FSDP2: ``strategy="fsdp"``, or a net sharded with
    ``fully_shard``) is checkpointed as a directory ``{model_prefix}-epoch{E}batch{B}.dcp``
    that every rank writes its part of, with the guarantees below (written aside, marked
    complete, renamed, then pointer and retention; checked before restore, falling back past a
    damaged one; resharded under ``elastic=True``). With ``async_save`` each rank copies its
    shards into its staging buffers and its writer thread writes them, the ranks agreeing over
    a process group of their own. The best checkpoint (``save_best``, ``save_best_only``) is
    refused there; weights exports gather the full weights into one plain file.
    ``sharded=True`` writes such directories for a plain net too; a directory resumes a fit of
    a plain net as well as of a sharded one, on any number of ranks.

    **Writing.** Each save writes a temporary file, fsyncs it, renames it into place and fsyncs
    the directory; then (when it improved) ``{model_prefix}-best.pt`` the same way; then the
    ``{model_prefix}-latest`` pointer (atomically); then retention deletes the oldest periodic
    files beyond ``max_checkpoints``, and temporaries of interrupted writes are removed. A kill at
    any moment leaves every checkpoint complete and the pointer naming an existing file. A failed
    write (a full disk, an I/O error, a read-only filesystem) raises an ``OSError`` naming the
    file and the reason and leaves the earlier files and the pointer as they were.

    **Writing in the background** (``async_save=True``). A save copies the state's tensors into
    shared memory and returns; a writer process (started at the first save of a fit, stopped at
    its end) pickles and writes the file the same way, off the training process's GIL, then a
    thread moves the pointer and prunes, so the step waits only for the copy (from CUDA: pinned
    buffers, copied on a side stream the next kernels wait for, so the host does not wait at
    all). A writer process that dies is an error naming its pid and how it ended. The file
    holds the state at the boundary, whatever the steps during the write change. Staging memory: one copy of the
    state (model, optimizer and the rest, about the checkpoint's size), reused from save to save.
    One write runs at a time: a save that finds the previous one running waits for it (logged
    once per fit). A write that failed is raised (naming the file and the errno) at the next save
    and in ``train_end``, on every rank; the files written before it are kept. ``train_end``
    (also after SIGTERM or Ctrl-C) waits for the write in flight, then saves as without it.

    **One writer per directory.** At ``fit`` start rank 0 takes a lock in ``model_dir`` (an
    ``flock`` on ``.estimatorch.lock``, which records host and pid) and holds it until the fit
    ends, however it ends. A second fit into the same ``model_dir`` fails at start with
    :class:`~estimatorch.checkpoint.DirectoryLockedError` naming the process that holds it; a
    lock left by a process that died is taken over with a logged warning. (On a network
    filesystem this needs working ``flock``, as NFS v4 provides.) Handlers of one fit share it.

    **Resuming.** With ``resume_from_checkpoint=True``, ``fit`` resumes from the newest checkpoint
    of ``model_prefix`` in ``model_dir`` that loads and validates against this fit (every key,
    type and tensor shape the resume reads: model, optimizer, scheduler, handler and metric
    states, position, RNG), and continues its plan exactly where it stopped. A file that fails is
    reported (name and reason) and the previous one is tried, with a warning; when checkpoints
    exist but none fits, ``fit`` stops at start (nothing is changed); without any, it starts
    fresh (unless ``save_best`` would overwrite a ``-best.pt`` that is there). A file written by
    a newer estimatorch stops ``fit`` at start and is never pruned or overwritten. Under
    torch.distributed rank 0 chooses the file and every rank loads that file from its own
    ``model_dir``, checking it reads the same bytes: a rank that cannot is an error on every
    rank, never a hang. ``model_dir`` should therefore be on a filesystem every node sees (with
    node-local directories, copy rank 0's files to every node before resuming). Without
    ``resume_from_checkpoint``, ``fit`` refuses to start in a directory that already holds
    checkpoints of that prefix, so nothing saved is ever overwritten.

    **Elastic resume.** With ``elastic=True`` (on every fit of the run, from the first) the
    training samples are laid out in global optimizer steps and every micro-batch's random draws
    are seeded from its place in the step, so the run can resume on another world size that keeps
    ``batch_size`` and ``world_size x accumulation_steps``: every optimizer step trains the same
    samples.
    The checkpoint must be at an optimizer step (not inside an accumulation window); the saved
    ranks' states are mapped onto the new ones (:mod:`estimatorch.estimator._state.elastic_resume`). Without
    it a different world size is refused, and an elastic file resumes only an elastic fit (and
    the reverse).

    **The best checkpoint** (``save_best``; ``save_best_only`` for an export) holds the weights
    that were measured. For a val metric the monitor is read at every validation
    (``validation_end``: each epoch's, and each step-level one of
    ``ValidationHandler(batch_period=N)``), and when it improved ``{model_prefix}-best.pt`` is
    written at the boundary right after that validation, whether or not a periodic save is due
    there (one at the same boundary writes both); a periodic save never rewrites it with a value
    measured at another step. Any other monitor (a train metric) is read at the periodic saves.
    With ``restore_best=True`` a fit that ends by its plan or a stop (early stopping) loads the
    best file's weights into the net at its end (Trainer's ``load_best_model_at_end``; a fit
    stopped by a signal or an error keeps its weights, which a resume continues from).

    **Adapter-only checkpoints.** For a net with frozen parameters (a PEFT LoRA model over its
    base, a frozen backbone) a checkpoint holds, by default, the trainable parameters, every
    buffer, the optimizer and the rest of the run's state, and a fingerprint (shape, dtype,
    digest) of each frozen parameter instead of its values: a resume takes the frozen weights from
    the model the script builds (the same pretrained base) and refuses one whose frozen weights
    differ, naming the first. ``save_frozen=True`` writes them too. Why by default: frozen weights
    never change during a fit, the script that resumes builds them anyway, and on a real base they
    are gigabytes per checkpoint, times ``max_checkpoints``. :func:`~estimatorch.checkpoint.load_into`
    loads such a checkpoint into a net built on the base (then ``net.save_pretrained(dir)`` writes
    the adapter, ``net.merge_and_unload()`` gives the merged model); weights exports
    (``save_weights_only``) hold the whole model, for inference.

    **Retention** deletes only periodic files of ``model_prefix`` that this fit wrote or that
    belong to the run it resumed (readable files up to the one it resumed from), never the file
    the pointer names, never ``-best.pt``, never a file it skipped as unusable or cannot read.

    **Exports for inference** (Keras' ``ModelCheckpoint`` options). ``save_weights_only=True``
    writes the model's weights alone instead of checkpoints:
    ``{model_prefix}-epoch{E}batch{B}.weights.pt`` and ``{model_prefix}-best.weights.pt``, each a
    plain state dict of the unwrapped module (no ``module.`` or ``_orig_mod.`` in its keys, tensors
    on the CPU) that plain PyTorch loads: ``net.load_state_dict(torch.load(path, weights_only=True))``.
    ``save_best_only=True`` writes no periodic file, only the best one, whenever ``monitor`` improves at a check (every
    ``epoch_period`` epochs and/or ``batch_period`` batches); ``initial_value_threshold`` makes
    the best file wait until ``monitor`` beats that value. Exports are written atomically, like
    checkpoints, and never pruned (``max_checkpoints`` counts checkpoints only). A handler with
    either option writes nothing a fit can resume from, so ``resume_from_checkpoint=True`` is
    refused with it: to resume and export, give the fit two handlers (their states are saved
    in the resumable one's checkpoints, so the export's best value survives a resume)::

        CheckpointHandler(model_dir, resume_from_checkpoint=True)
        CheckpointHandler(model_dir, monitor=est.val_metrics[0], save_best_only=True,
                          save_weights_only=True)

    An export's files from another run are never overwritten: when they are there at ``fit``
    start, the fit is refused unless it resumes (``fit(..., resume=True)``, or a
    ``CheckpointHandler`` with ``resume_from_checkpoint=True`` among its handlers), and they are
    replaced only once this handler's state came back with that resume (else the save that would
    replace one raises ``FileExistsError`` and writes nothing).
    :func:`estimatorch.checkpoint.load_weights` returns the weights of any checkpoint, export,
    ``-latest`` pointer or directory.

    **Object storage.** ``model_dir`` may be an fsspec URL, ``"s3://bucket/run"`` (the
    ``estimatorch[s3]`` extra; ``gs://``, ``az://``... with their fsspec package), reached with
    ``storage_options`` (endpoint, credentials), with the same guarantees by the store's own
    means: each checkpoint is one object uploaded whole (written in memory first), the pointer
    after it; a lease object with conditional writes stands for the lock; incomplete uploads of
    a killed writer are aborted at the next fit start; a failed upload (after bounded retries)
    keeps the previous checkpoint and pointer and raises naming the URL. The store is checked at
    ``fit`` start (protocol, bucket, credentials, endpoint), before any step (docs/checkpoints.md).
    A sharded (FSDP2) checkpoint is written in place, one object per file, every rank its own;
    rank 0 writes its marker object last, once every rank's part is uploaded: a directory without
    it is never resumed from, and is removed at the next fit start.

    **Counters.** ``current_epoch`` and ``current_batch`` are the epochs completed and batches
    trained in the current fit, those before a resume included, whatever the periods set: they
    are read from the estimator's position (during an event, as of the boundary before it; at a
    save, up to the save), keep the last fit's values after it, and are saved in the state.

    Args:
        model_dir: the directory (created if missing); a file, a dangling symlink or a directory
            this process cannot write is a ``ValueError`` at ``fit`` start. Or an fsspec URL of a
            prefix on an object store (``"s3://bucket/run"``; ``file://`` is a plain path).
        model_prefix: file name prefix. Defaults to ``"model"``.
        monitor: a metric's name (e.g. ``"val_loss"``, resolved at ``fit`` start) or a metric
            the estimator owns, for ``save_best`` / ``save_best_only``. Defaults
            to None.
        verbose: 1 logs every save. Defaults to 0.
        save_best: also keep ``{model_prefix}-best.pt``, the checkpoint where ``monitor`` was
            best, checked at every periodic save. Defaults to False.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (from the monitor's ``higher_is_better``).
            Defaults to ``"auto"``.
        epoch_period: save every this many epochs; None for never. Defaults to 1.
        batch_period: save every this many batches (over the run); None for never. One file per
            step: an epoch end's checkpoint replaces the batch checkpoint of the same step.
            Defaults to None.
        max_checkpoints: periodic checkpoints kept (the oldest are deleted, also ones from before
            a resume); None keeps all. Defaults to 5.
        resume_from_checkpoint: resume from the newest usable checkpoint in ``model_dir``.
            Defaults to False.
        save_best_only: write only the best file (needs ``monitor``), no periodic ones.
            Defaults to False.
        save_weights_only: write the model's weights alone (``.weights.pt`` files), not the
            training state. Defaults to False.
        initial_value_threshold: write the best file only once ``monitor`` beats this value
            (needs ``save_best`` or ``save_best_only``). Defaults to None.
        elastic: lay the training samples out in global optimizer steps, so that the run can
            resume on another world size with the same ``batch_size`` and ``world_size x
            accumulation_steps`` (see :mod:`estimatorch.data._elastic`); set it from the
            run's first fit on, and on every resume. Bit-identical on any such split where the
            estimator is ``world_size_invariant=True`` (which lays the samples out so itself).
            Defaults to False.
        async_save: write checkpoints in the background; the step waits only for a copy of the
            state into reused buffers (see above): True (or ``"process"``) by a writer process
            (where none can run, not on Linux, True falls back to a thread, logged),
            ``"thread"`` by a writer thread (which holds the GIL while it writes; a sharded
            net's directories are always written by threads). Defaults to False.
        sharded: write checkpoints as directories every rank writes its part of (see above):
            None for a net sharded across ranks only, True also for a plain net (its checkpoints
            then load on any number of ranks, into a sharded net or a plain one), False never
            (refused for a sharded net). Defaults to None.
        storage_options: for a URL ``model_dir``, fsspec's arguments of its filesystem (for S3:
            ``key``, ``secret``, ``client_kwargs={"endpoint_url": ...}``); None takes the
            environment's. Defaults to None.
        restore_best: at the end of a fit that ran its plan or stopped early, load the weights
            of the best file (needs ``save_best`` or ``save_best_only``), logged with its step
            and value. Defaults to False.
        save_frozen: for a net with frozen parameters (a PEFT LoRA model, a frozen backbone),
            also write them into each checkpoint; by default a checkpoint holds the trainable
            parameters, the buffers and a fingerprint of the frozen ones (see above). Defaults
            to False.

    Example:
        >>> import tempfile
        >>> handler = CheckpointHandler(tempfile.mkdtemp(), batch_period=100, max_checkpoints=3)
        >>> handler.batch_period, handler.max_checkpoints, handler.current_batch
        (100, 3, 0)
    """

    #: state keys counting this process's batches (scaled by an elastic resume on another world size).
    elastic_batch_counters = ("current_batch",)

    state_attributes = ("current_epoch", "current_batch", "best")

    def __init__(self, model_dir: Union[str, os.PathLike], model_prefix: str = "model", monitor: Any = None,
                 verbose: int = 0, save_best: bool = False, mode: str = "auto", epoch_period: Optional[int] = 1,
                 batch_period: Optional[int] = None, max_checkpoints: Optional[int] = 5,
                 resume_from_checkpoint: bool = False, *, save_best_only: bool = False,
                 save_weights_only: bool = False, initial_value_threshold: Optional[float] = None,
                 elastic: bool = False, async_save: Union[bool, str] = False, sharded: Optional[bool] = None,
                 storage_options: Optional[dict[str, Any]] = None, restore_best: bool = False,
                 save_frozen: bool = False):
        self.monitor_name = check_arguments(  # each error names the argument and its value
            model_dir, model_prefix, monitor, verbose, save_best, mode, epoch_period, batch_period, max_checkpoints,
            resume_from_checkpoint, save_best_only, save_weights_only, initial_value_threshold, elastic)
        self.epoch_period, self.batch_period, self.max_checkpoints = epoch_period, batch_period, max_checkpoints
        self.storage_options = storage_options
        self.model_dir = checkpoint.configure_store(os.fspath(model_dir), storage_options)  # a URL, or a path
        self.model_prefix = model_prefix
        self.monitor = monitor
        self.verbose = verbose
        self.save_best = save_best
        self._mode = mode
        self.mode = resolve_mode(mode, monitor, "CheckpointHandler", unresolved=self.monitor_name is not None) \
            if monitor is not None else mode
        self.resume_from_checkpoint = resume_from_checkpoint
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.elastic = elastic  # the estimator reads elastic_checkpoints at fit start
        self.async_save = async_save
        if sharded is not None and not isinstance(sharded, bool):
            raise TypeError(f"sharded must be None, True or False, got {sharded!r}")
        self.sharded = sharded
        if not isinstance(restore_best, bool):
            raise TypeError(f"restore_best must be True or False, got {restore_best!r}")
        if restore_best and not (save_best or save_best_only):
            raise ValueError("restore_best=True loads the best file's weights at the end: pass save_best=True (or "
                             "save_best_only=True) with monitor=")
        self.restore_best = restore_best
        if not isinstance(save_frozen, bool):
            raise TypeError(f"save_frozen must be True or False, got {save_frozen!r}")
        self.save_frozen = save_frozen
        self._val_monitor = False  # decided at train_begin: a val metric is read at its validations
        self._writer = checkpoint.make_writer(async_save)  # rank 0's (every rank's if sharded)
        self.initial_value_threshold = None if initial_value_threshold is None else float(initial_value_threshold)
        layout = checkpoint.Layout(self.model_dir, model_prefix, weights=save_weights_only,
                                   periodic=not save_best_only, best=save_best or save_best_only)
        self._directory = CheckpointDirectory(  # its checks at fit start, lock, pointer and retention
            layout, sharded=sharded, storage_options=storage_options, resume_from_checkpoint=resume_from_checkpoint,
            max_checkpoints=self.max_checkpoints, best_option="save_best" if save_best else
            "save_best_only" if save_best_only else None)
        self._writes = CheckpointWrites(self._directory, self._writer)  # the files of a save
        self._epoch_filter = EventFilter(every=epoch_period) if epoch_period else None
        self._batch_filter = EventFilter(every=batch_period) if batch_period else None
        self._estimator: Optional[weakref.ref] = None  # the estimator of the fit in progress
        self._reset()

    def resolve_monitor(self, metric: Any) -> None:
        """Monitor ``metric``, the estimator's metric of the name given (at ``fit`` start)."""
        self.monitor, self.mode = metric, resolve_mode(self._mode, metric, "CheckpointHandler")

    def _reset(self) -> None:
        self._epochs = self._batches = 0  # the counters outside fit (after it, or loaded)
        if self.initial_value_threshold is not None:
            self.best = self.initial_value_threshold
        else:
            self.best = math.inf if self.mode == "min" else -math.inf
        self._directory.reset()
        self._saved_step = -1  # the step of this run's last periodic checkpoint
        self.best_step = 0  # the step of the best file's validation (or save)
        self._best_pending: Optional[float] = None  # an improvement a validation found, saved at its boundary
        self._periodic_due = self._queued = False  # what the boundary's save writes, and that it is queued
        self._validations = 0  # the validations this fit's monitor was read at
        self._resumed_step = -1  # the step of the checkpoint this fit resumed from
        self._warned_nan = False

    def listens_to(self, event: str) -> bool:
        """Only the events of the periods set: no call per batch without a ``batch_period``."""
        return {"batch_end": self.batch_period, "epoch_end": self.epoch_period}.get(event, True) is not None

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work: ``model_dir`` is usable, no other fit writes there, nothing saved would
        be overwritten or is of a newer format (see :class:`CheckpointDirectory`)."""
        self._directory.check_fit(estimator, resume)

    @property
    def _layout(self) -> checkpoint.Layout:
        """The files this handler writes (whether checkpoints are directories: from ``fit`` start)."""
        return self._directory.layout

    @property
    def saved(self) -> list[str]:
        """On rank 0, the periodic files retention owns, oldest first."""
        return self._directory.saved

    @property
    def checkpoint_location(self) -> Optional[str]:
        """``model_dir`` when this handler writes checkpoints a fit resumes from (not only exports)."""
        return self.model_dir if self._layout.resumable else None

    @property
    def resumes_run(self) -> bool:
        """``resume_from_checkpoint``: ``train_begin`` resumes from the newest checkpoint."""
        return self.resume_from_checkpoint

    @property
    def elastic_checkpoints(self) -> bool:
        """``elastic``: the checkpoints resume on another world size."""
        return self.elastic

    @property
    def resumable(self) -> bool:
        """True when this handler writes checkpoints a fit resumes from (not only exports)."""
        return self._layout.resumable

    @property
    def name(self) -> str:
        """The key its state is saved under. Defaults to ``"CheckpointHandler"``; for an exporter
        (``save_best_only`` / ``save_weights_only``) it says what it writes, e.g.
        ``"CheckpointHandler[model-best.weights]"``, so that a resume never gives its state to
        another CheckpointHandler of the fit (or theirs to it), whatever their order."""
        given = self.__dict__.get("_name")
        if given or self._layout.resumable:
            return given or type(self).__name__
        best, weights = "-best" if self.save_best_only else "", ".weights" if self.save_weights_only else ""
        return f"{type(self).__name__}[{self.model_prefix}{best}{weights}]"

    @name.setter
    def name(self, value: str) -> None:
        StatefulHandler.name.fset(self, value)  # type: ignore[attr-defined]

    # -- counters --------------------------------------------------------------------------
    def _fitting(self) -> Any:
        return self._estimator() if self._estimator is not None else None

    @property
    def current_epoch(self) -> int:
        """Epochs completed in the current fit (else the last one, or a loaded state), those
        before a resume included."""
        estimator = self._fitting()
        return estimator.position.epoch if estimator is not None else self._epochs

    @property
    def current_batch(self) -> int:
        """Batches trained in the current fit (else the last one, or a loaded state), over all
        its epochs, those before a resume included."""
        estimator = self._fitting()
        return estimator.position.step if estimator is not None else self._batches

    def state_dict(self) -> dict[str, Any]:
        """The counters, ``best`` and ``best_step`` (optional on load: states saved before it was
        kept resume as before)."""
        return {**super().state_dict(), "best_step": self.best_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (during a resume the counters follow the restored
        position, which holds the same numbers); raises ``ValueError`` naming a missing key."""
        check_state_keys(state, self.state_attributes, self.name)
        self.best_step = check_positive_int(state.get("best_step", 0), f"state of {self.name}: best_step", minimum=0)
        epochs = check_positive_int(state["current_epoch"], f"state of {self.name}: current_epoch", minimum=0)
        batches = check_positive_int(state["current_batch"], f"state of {self.name}: current_batch", minimum=0)
        best = state["best"]
        if not is_real(best):
            raise TypeError(f"state of {self.name}: best must be a number, got {best!r}")
        self._epochs, self._batches, self.best = epochs, batches, float(best)
        if self._fitting() is not None:
            self._directory.foreign = frozenset()  # this run's exports: the resumed state knows their best

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._writer is not None:
            self._writer.reset()  # (waits for a write a second Ctrl-C left running)
        self._reset()
        self._estimator = weakref.ref(estimator)
        self._val_monitor = self._layout.best and any(m is self.monitor for m in estimator.val_metrics)
        directory = self._directory
        directory.check_siblings(other._directory for other in estimator.handlers
                                 if other is not self and isinstance(other, CheckpointHandler))
        found = distributed.run_on_main(lambda: directory.open(estimator), "CheckpointHandler opening model_dir")
        if not self._layout.resumable:
            directory.foreign = frozenset(distributed.broadcast_object(sorted(directory.foreign)))
            return
        if not self.resume_from_checkpoint or estimator.resume_pending:  # pending: fit(..., resume=True)
            return
        found = checkpoint.agree_on_checkpoint(estimator, self.model_dir, found,
                                               lambda path, payload: estimator.load_payload(payload, path))
        if found is None:
            estimator.logger.info("No checkpoint of prefix %r in %s: starting a new run", self.model_prefix,
                                  self.model_dir)
            return
        checkpoint.restore_training_state(estimator, found[1])
        directory.step_file = (estimator.resume_step, found[0])
        # that boundary is saved already: a signal before the first step saves nothing again
        self._resumed_step = -1 if estimator.resume_step is None else estimator.resume_step

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        try:
            self._writes.finish(estimator)
            self._save_interrupted(estimator)
            if self._val_monitor and not self._validations and estimator.position.step:
                warn_user(f"CheckpointHandler: no validation ran in this fit, so {metric_name(self.monitor)} (the "
                          "monitor) was never read and no best file was written: pass val_data to fit (or a "
                          "ValidationHandler), or monitor a train metric")
            self._restore_best(estimator)
        finally:
            self._epochs, self._batches = self.current_epoch, self.current_batch
            self._estimator = None
            if self._writer is not None:
                self._writer.close()  # the lock is held until the last file is durable
            self._directory.release_lock()

    def _save_interrupted(self, estimator: EstimatorView) -> None:
        """Preemption loses no step: when ``fit`` ends because of SIGTERM or Ctrl-C at a step
        boundary (``estimator.interruption``), save that boundary, unless this fit just did or
        trained nothing (exports, which no fit resumes from, are left alone). Every rank calls it
        (the save is a collective) and decides alike."""
        reason, pos = estimator.interruption, estimator.position
        if reason is None or not self._layout.resumable or pos.step in (0, self._saved_step, self._resumed_step):
            return
        self._save(estimator, background=False)  # the process exits once it is durable
        name = self._layout.periodic_name(pos.epoch, pos.step)  # a sharded net's is a directory
        estimator.logger.info("Saved checkpoint of step %d to %s (%s)", pos.step,
                              os.path.join(self.model_dir, name), reason)

    def _restore_best(self, estimator: EstimatorView) -> None:
        """``restore_best``: the best file's weights into the net, when the fit ran its plan or
        stopped early (every rank reads the file: ``model_dir`` is one every rank sees)."""
        if not self.restore_best or not estimator.position.stop or estimator.interruption is not None:
            return
        path = os.path.join(self.model_dir, self._layout.best_name())
        if not checkpoint.exists(path):
            estimator.logger.info("restore_best: no %s was written (%s never improved): the weights stay the "
                                  "last step's", path, metric_name(self.monitor))
            return
        checkpoint.load_into(estimator.net, path)
        estimator.logger.info("Restored the weights of step %d (best %s: %.6g) from %s", self.best_step,
                              metric_name(self.monitor), self.best, path)

    def validation_end(self, estimator: EstimatorView, *, values: Any, step: int, **kwargs: Any) -> None:
        """A val monitor is read here: an improvement writes the best file at this boundary."""
        if not self._val_monitor:
            return
        self._validations += 1
        name = metric_name(self.monitor)
        value = float(values[name]) if name in values else float(self.monitor.compute())
        if math.isnan(value) and not self._warned_nan:
            self._warned_nan = True  # once per fit
            warn_user(f"CheckpointHandler: {name} is nan at the validation of step {step}: not an improvement, "
                      "the best file stays as it is")
        if not math.isnan(value) and improved(value, self.best, self.mode):
            self._best_pending = value
            self._queue_save(estimator)

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._batch_filter is not None and self._batch_filter(estimator.position.step + 1):  # with this batch
            self._periodic_due = True
            self._queue_save(estimator)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._epoch_filter is None:
            return
        pos = estimator.position
        if not self._epoch_filter(pos.epoch + 1):  # with this epoch
            return
        if pos.stop and pos.step == self._saved_step:
            # A stop cut this epoch short right after a batch checkpoint. That file stays the
            # newest: resumed with a larger plan it continues the epoch exactly, while one written
            # after this epoch_end would start the next epoch. (The same plan redoes epoch_end.)
            return
        self._periodic_due = True
        self._queue_save(estimator)

    def _queue_save(self, estimator: EstimatorView) -> None:
        """One save at the coming boundary, writing what is due there (periodic, best or both)."""
        if not self._queued:
            self._queued = True
            estimator.at_boundary(lambda: self._boundary_save(estimator))

    def _boundary_save(self, estimator: EstimatorView) -> None:
        periodic, self._periodic_due, self._queued = self._periodic_due, False, False
        self._save(estimator, periodic=periodic)

    # -- saving ----------------------------------------------------------------------------
    def _check_best(self, position: Any) -> tuple[bool, Optional[float]]:
        """Whether ``monitor`` improved on the best, and its value: for a val metric, what the
        validation before this boundary found (:meth:`validation_end`); for another, its value
        now (a collective)."""
        if not self._layout.best:
            return False, None
        if self._val_monitor:
            value, self._best_pending = self._best_pending, None
            if value is not None:
                self.best_step = position.step
            return value is not None, value
        value = float(self.monitor.compute())
        if math.isnan(value):
            # a batch save in the first epoch, before its validation: nan is expected there
            expected = position.phase == "batch_end" and position.epoch == 0
            if not self._warned_nan and not expected:
                self._warned_nan = True  # once per fit: a val monitor is nan at every save before validating
                warn_user(f"CheckpointHandler: {metric_name(self.monitor)} is nan (not computed yet?); the best file "
                          "is updated only with a value: monitor a metric validation computes before the save "
                          "(ValidationHandler's epoch_period), or save at epoch ends")
            return False, value
        better = improved(value, self.best, self.mode)
        if better:
            self.best_step = position.step
        return better, value

    def _save(self, estimator: EstimatorView, background: bool = True, periodic: bool = True) -> None:
        """Write what is due at the current boundary (with ``async_save``, and ``background``,
        hand it to the writer): the periodic file when ``periodic``, the best one when the monitor
        improved; :class:`CheckpointWrites` writes it. A collective: every rank calls it."""
        pos = estimator.position
        is_best, value = self._check_best(pos)
        names = self._writes.due(pos, is_best, periodic=periodic)
        if not names:
            return
        best = value if is_best else None
        if best is not None:
            self.best = best  # before the payload: the checkpoint holds it
        if self._layout.resumable and periodic:
            self._saved_step = pos.step
        note = f" (best {metric_name(self.monitor)}: {best:.6g})" if best is not None else ""
        self._writes.save(estimator, names, note=note if self.verbose else None, background=background,
                          periodic=periodic, save_frozen=self.save_frozen)

