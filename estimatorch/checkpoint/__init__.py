"""The checkpoint file: format, atomic save, safe load, validation against a fit, discovery of the
newest usable file, the directory lock, and migration of older format versions.

A checkpoint is one ``torch.save`` file holding only tensors and plain python values, loaded with
``torch.load(weights_only=True)``: opening a checkpoint can never run code. Format version 2:

- ``format_version``, ``estimatorch_version``, ``torch_version``, ``world_size``;
- ``model``, ``optimizer``, ``lr_scheduler``, ``grad_scaler``: their ``state_dict()`` (or None);
  the model's keys are the plain module's, whatever wraps it (``torch.compile``, DDP);
- ``optimizer_class``: the optimizer's class name (absent from older files);
- ``ranks``: one snapshot per rank, each with ``position`` (epoch, batch, step, phase, stop),
  ``plan``, ``handlers`` (every handler's state by name), ``metrics`` (accumulators),
  ``history``, ``data`` (data-stream state), ``fingerprint`` (what shapes the data stream:
  dataset length, batch size, drop_last, world size, seed, sampler) and ``rng`` (every
  generator of that rank); since the ledger, ``ledger`` (the run's attempts, on rank 0: see
  ``_ledger.py``) and ``state_fingerprint`` (the parameters' and optimizer state's bitwise
  fingerprint, checked after a restore). Files without them load as before.

Version 1 (estimatorch's first layout) held one process's snapshot at the top level;
:func:`migrate` upgrades it. A file newer than this library is refused
(:class:`NewerFormatError`), never skipped, pruned or overwritten.

A directory written by :class:`~estimatorch.CheckpointHandler` holds
``{prefix}-epoch{E}batch{B}.pt`` files, ``{prefix}-best.pt``, the ``{prefix}-latest`` pointer, the
progress mark ``.estimatorch-progress`` (``_progress.py``: the last attempt's last step, for the
run's ledger) and, while a fit writes, the lock file ``.estimatorch.lock``; with
``save_weights_only=True`` it writes weights exports instead,
``{prefix}-epoch{E}batch{B}.weights.pt`` and ``{prefix}-best.weights.pt``:
the model's state dict alone (plain module keys, CPU tensors), which plain PyTorch loads with
``torch.load(path, weights_only=True)``. :func:`load_weights` returns that state dict from any
checkpoint, export, pointer or directory.

A model sharded across ranks (FSDP2) is stored as a directory ``{prefix}-epoch{E}batch{B}.dcp``
written by every rank (``_sharded.py``, ``_sharded_run.py``) with the same guarantees (written
aside, marked complete last, renamed; validated before restore; found, agreed on, pruned and
pointed at like a file); :func:`load_weights` and ``inspect`` read one.

A directory may also be a prefix on an object store, named by an fsspec URL (``s3://bucket/run``)
and reached with ``storage_options`` (``_store.py``): the same files, as objects, each uploaded
whole (a sharded directory in place, its marker object last: ``_sharded_store.py``); a lease
object (``_lease.py``) stands for the lock. ``file://`` URLs are plain paths.

Command line (exit status 0 when done, 2 on an error, the message on stderr)::

    python -m estimatorch.checkpoint inspect PATH      # a file, a {prefix}-latest pointer, or a directory
    python -m estimatorch.checkpoint inspect s3://bucket/run --storage-option key=... # or a URL of one
    python -m estimatorch.checkpoint migrate DIR       # upgrade every older file in DIR in place
"""

from .._saved import CheckpointError
from ._async import BackgroundWriter, Staging
from ._cli import main
from ._files import (
    atomic_save,
    best_name,
    best_weights_name,
    checkpoint_name,
    latest_name,
    list_checkpoints,
    list_weights,
    prune,
    read_latest,
    remove_checkpoint,
    remove_orphan_temporaries,
    sharded_checkpoint_name,
    weights_name,
    write_latest,
)
from ._format import (
    FORMAT_VERSION,
    MIGRATIONS,
    NewerFormatError,
    build_payload,
    file_digest,
    load,
    migrate,
    rank_snapshot,
    read_format_version,
    validate,
)
from ._frozen import frozen_keys
from ._layout import Layout
from ._lease import LeaseLostError
from ._ledger import (
    ENDINGS,
    PARTS,
    attempt_times,
    check_ledger,
    ledger_summary,
    ledger_table,
    merge_ledgers,
    scale_steps,
    settle,
)
from ._locate import Located, load_into, load_weights, locate, saved_files
from ._lock import LOCK_NAME, DirectoryLock, DirectoryLockedError
from ._model import is_sharded_module, load_model_state, model_state, plain_key, plain_module
from ._progress import PROGRESS_NAME, ProgressMark, progress_path, read_progress
from ._resume import agree_on_checkpoint, choose_checkpoint, find_latest, format_versions, refuse_newer
from ._run_state import PHASES, PLAN_KEYS, POSITION_KEYS, SNAPSHOT, check_positions, check_snapshot_structure
from ._seam import ResumableFit
from ._sharded_run import read_checkpoint, save_fit_checkpoint
from ._store import check_reachable, exists, is_url
from ._store import configure as configure_store
from ._validate import check_against_fit, check_training_state, restore_training_state
from ._weights import is_weights, read_saved, weights_state
from ._writer_process import ProcessWriter, SharedStaging, WriterProcessError, make_writer, process_writer_supported

__all__ = [
    "ENDINGS",
    "PARTS",
    "PROGRESS_NAME",
    "ProgressMark",
    "attempt_times",
    "check_ledger",
    "merge_ledgers",
    "progress_path",
    "read_progress",
    "scale_steps",
    "settle",
    "ledger_summary",
    "ledger_table",
    "FORMAT_VERSION",
    "PHASES",
    "PLAN_KEYS",
    "POSITION_KEYS",
    "SNAPSHOT",
    "check_positions",
    "check_snapshot_structure",
    "LOCK_NAME",
    "BackgroundWriter",
    "ProcessWriter",
    "SharedStaging",
    "WriterProcessError",
    "process_writer_supported",
    "make_writer",
    "CheckpointError",
    "DirectoryLock",
    "DirectoryLockedError",
    "LeaseLostError",
    "Layout",
    "ResumableFit",
    "Staging",
    "NewerFormatError",
    "atomic_save",
    "best_weights_name",
    "build_payload",
    "check_against_fit",
    "check_reachable",
    "configure_store",
    "exists",
    "is_url",
    "checkpoint_name",
    "find_latest",
    "list_checkpoints",
    "list_weights",
    "load",
    "is_sharded_module",
    "frozen_keys",
    "load_into",
    "load_model_state",
    "load_weights",
    "locate",
    "migrate",
    "model_state",
    "rank_snapshot",
    "read_checkpoint",
    "remove_checkpoint",
    "restore_training_state",
    "save_fit_checkpoint",
    "sharded_checkpoint_name",
    "validate",
    "weights_name",
    "weights_state",
]
