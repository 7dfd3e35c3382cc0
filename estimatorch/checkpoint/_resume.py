"""Which checkpoint a fit resumes from: the newest that loads and validates against the fit,
chosen by global rank 0 and checked by every rank (same bytes, valid for that rank).

The fit is reached through the estimator's seam only: ``estimator.check_payload(payload, source)``
(check, and map an elastic run's payload onto this world size) and, passed in as ``accept``,
``estimator.load_payload(payload, source)`` (refuse another world size, request the resume).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

from .. import distributed
from . import _store
from ._files import PathLike, best_name, list_checkpoints
from ._format import FORMAT_VERSION, CheckpointError, NewerFormatError, newer_format_error
from ._seam import ResumableFit
from ._sharded_run import digest_of, read_checkpoint, version_of
from ._validate import check_against_fit

__all__ = ["agree_on_checkpoint", "choose_checkpoint", "find_latest", "format_versions", "refuse_newer"]

logger = logging.getLogger("estimatorch")
Found = tuple[str, dict[str, Any]]


def _newest_valid(model_dir: PathLike, prefix: str, check: Optional[Callable[[str, dict[str, Any]], Any]],
                  reasons: dict[str, str]) -> Optional[Found]:
    """The newest file that passes ``check`` (which may return the payload as the fit reads it)."""
    for _, _, path in reversed(list_checkpoints(model_dir, prefix)):
        try:
            payload = read_checkpoint(path)
            if check is not None:
                checked = check(path, payload)
                payload = payload if checked is None else checked
            return path, payload
        except NewerFormatError:
            raise
        except FileNotFoundError:  # removed since it was listed
            continue
        except (CheckpointError, OSError) as err:  # the message names the file
            logger.warning("Skipping a checkpoint: %s", err)
            reasons[path] = str(err)
    return None


def find_latest(model_dir: PathLike, prefix: str,
                check: Optional[Callable[[str, dict[str, Any]], None]] = None) -> Optional[Found]:
    """The newest checkpoint of ``prefix`` (most epochs, then batches) that loads, validates and
    passes ``check(path, payload)``, as ``(path, payload)``; a file that fails is skipped with a
    warning. None when there is none.

    The ``{prefix}-latest`` pointer is not needed to choose: a crash between writing a checkpoint
    and its pointer must not hide that checkpoint.

    Raises:
        NewerFormatError: a file newer than the one chosen was written by a newer estimatorch
            (never skipped: a newer run may be using this directory).
    """
    return _newest_valid(model_dir, prefix, check, {})


def format_versions(model_dir: PathLike, prefix: str) -> dict[str, Optional[int]]:
    """The format version of each checkpoint of ``prefix`` in ``model_dir`` (periodic files and
    sharded directories, oldest first, then the best file), None for one that cannot be read as a
    checkpoint."""
    paths = [path for _, _, path in list_checkpoints(model_dir, prefix)]
    best = os.path.join(os.fspath(model_dir), best_name(prefix))
    if _store.isfile(best):
        paths.append(best)
    return {path: version_of(path) for path in paths}


def refuse_newer(versions: dict[str, Optional[int]]) -> None:
    """Raise :class:`NewerFormatError` for the first file of a format newer than this library's."""
    for path, version in versions.items():
        if version is not None and version > FORMAT_VERSION:
            raise newer_format_error(repr(path), version)


def choose_checkpoint(estimator: ResumableFit, model_dir: PathLike, prefix: str) -> tuple[Optional[Found], list[str]]:
    """On global rank 0: the newest checkpoint that loads and validates against ``estimator``'s
    current fit, and the newer paths skipped on the way (each reported with a warning).

    Raises:
        NewerFormatError: a newer-format file was met.
        CheckpointError: checkpoints exist but none can resume this fit (the reasons are listed).
    """
    reasons: dict[str, str] = {}

    def check(path: str, payload: dict[str, Any]) -> dict[str, Any]:
        return check_against_fit(estimator, payload, distributed.get_rank(), repr(path))

    found = _newest_valid(model_dir, prefix, check, reasons)
    if found is None and reasons:
        listed = "; ".join(list(reasons.values())[:3]) + ("; ..." if len(reasons) > 3 else "")
        raise CheckpointError(
            f"none of the {len(reasons)} checkpoints of prefix {prefix!r} in {os.fspath(model_dir)!r} can resume "
            f"this fit: {listed}. Nothing was changed: make the fit match them (model, optimizer, handlers), "
            "move the files away, or choose another model_dir.")
    return found, list(reasons)


def _load_as_rank(estimator: ResumableFit, model_dir: PathLike, name: str, digest: str, rank: int) -> Found:
    """On a rank other than 0: the file rank 0 chose, from this rank's ``model_dir``, checked to
    hold the same bytes and to fit this rank."""
    path = os.path.join(os.fspath(model_dir), name)
    hint = ("every rank must see the checkpoints rank 0 writes: use a model_dir on a filesystem shared by "
            "all nodes, or copy the files to each node's model_dir before resuming")
    if not _store.exists(path):
        raise CheckpointError(f"rank {rank} has no {name} in its model_dir {os.fspath(model_dir)!r}, the "
                              f"checkpoint rank 0 resumes from; {hint}")
    try:
        same = digest_of(path) == digest
    except OSError as err:
        raise CheckpointError(f"rank {rank} cannot read {path}: {err}; {hint}") from None
    if not same:
        raise CheckpointError(f"rank {rank} reads other bytes in {path} than rank 0 (another file of the same "
                              f"name, or a copy still being written); {hint}")
    return path, check_against_fit(estimator, read_checkpoint(path), rank, repr(path))


def agree_on_checkpoint(estimator: ResumableFit, model_dir: PathLike, found: Optional[Found],
                        accept: Callable[[str, dict[str, Any]], None]) -> Optional[Found]:
    """Every rank: resume from rank 0's choice ``found`` (ignored elsewhere), or from nothing.

    Rank 0 sends the file's name and a digest of its bytes; every other rank loads that name from
    its own ``model_dir``, checks it reads the same bytes and that the file fits it; then every
    rank calls ``accept(path, payload)`` (``estimator.load_payload``: another world size is refused
    there). The outcome is agreed in one collective: a rank that cannot resume is an error on every
    rank, never a hang.

    Raises:
        CheckpointError: (on every rank) a rank could not resume from the chosen file.
    """
    rank, multi = distributed.get_rank(), distributed.is_distributed()
    if multi:
        sent = (os.path.basename(found[0]), digest_of(found[0])) if rank == 0 and found is not None else None
        chosen = distributed.broadcast_object(sent)
    error: Optional[BaseException] = None
    try:
        if multi and rank != 0:
            found = None if chosen is None else _load_as_rank(estimator, model_dir, chosen[0], chosen[1], rank)
        if found is not None:
            accept(*found)
    except Exception as err:  # noqa: BLE001 - every rank must hear of it (share_outcome)
        error = err
    failure = distributed.share_outcome(error)
    if failure is None:
        return found
    failed, exception = failure
    if failed == rank:
        raise exception
    raise CheckpointError(f"rank {failed} cannot resume: {exception}") from exception
