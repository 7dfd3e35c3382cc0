"""The checkpoint file: format, atomic save, safe load, discovery of the newest valid file, and
migration of older format versions.

A checkpoint is one ``torch.save`` file holding only tensors and plain python values, loaded with
``torch.load(weights_only=True)``: opening a checkpoint can never run code. Format version 2:

- ``format_version``, ``estimatorch_version``, ``torch_version``, ``world_size``;
- ``model``, ``optimizer``, ``lr_scheduler``, ``grad_scaler``: their ``state_dict()`` (or None);
- ``ranks``: one snapshot per rank, each with ``position`` (epoch, batch, step, phase, stop),
  ``plan``, ``handlers`` (every handler's state by name), ``metrics`` (accumulators),
  ``history``, ``data`` (data-stream state), ``fingerprint`` (what shapes the data stream:
  dataset length, batch size, drop_last, world size, seed, sampler) and ``rng`` (every
  generator of that rank).

Version 1 (estimatorch's first layout) held one process's snapshot at the top level;
:func:`migrate` upgrades it. A file newer than this library is refused.

Command line::

    python -m estimatorch.checkpoint migrate DIR       # upgrade every older file in DIR
    python -m estimatorch.checkpoint inspect FILE      # print what a file holds
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import shutil
import sys
from collections import OrderedDict
from typing import Any, Callable, Optional, Union

import torch

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "atomic_save",
    "build_payload",
    "checkpoint_name",
    "find_latest",
    "list_checkpoints",
    "load",
    "migrate",
    "rank_snapshot",
    "restore_training_state",
]

FORMAT_VERSION = 2
_SNAPSHOT_KEYS = ("position", "plan", "handlers", "metrics", "history", "data", "fingerprint", "rng")
#: what a version-2 snapshot adds (``Estimator._resume_plan`` / ``_restore`` read both).
_SNAPSHOT_KEYS_2 = (*_SNAPSHOT_KEYS, "partial", "evaluated")
_TOP_KEYS = ("model", "optimizer", "lr_scheduler", "grad_scaler", "ranks", "world_size")
_LATEST_SUFFIX = "-latest"
_PLAIN = (type(None), bool, int, float, str, bytes)

logger = logging.getLogger("estimatorch")
PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, invalid, too new, or for other data."""


# -- names --------------------------------------------------------------------------------------
def checkpoint_name(prefix: str, epoch: int, batch: int) -> str:
    """``{prefix}-epoch{E}batch{B}.pt``: E epochs completed and B batches trained when written."""
    return f"{prefix}-epoch{epoch}batch{batch}.pt"


def _pattern(prefix: str) -> re.Pattern:
    return re.compile(rf"{re.escape(prefix)}-epoch(\d+)batch(\d+)\.pt")


def list_checkpoints(model_dir: PathLike, prefix: str) -> list[tuple[int, int, str]]:
    """The periodic checkpoints of ``prefix`` in ``model_dir``, oldest first, as
    ``(epoch, batch, path)``. Names must match exactly: ``model-epoch1batch10x.pt`` or another
    prefix's files are never listed (so never deleted by retention)."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        return []
    pattern = _pattern(prefix)
    found = []
    for name in os.listdir(model_dir):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)), int(match.group(2)), os.path.join(model_dir, name)))
    return sorted(found)


# -- writing ------------------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def _create_temporary(directory: str, name: str) -> tuple[int, str]:
    """Create ``.{name}.<random>.tmp`` in ``directory`` with the permissions ``open()`` would
    give (``tempfile.mkstemp`` makes files readable by their owner only)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name for {name!r} in {directory!r}")


def atomic_save(obj: Any, path: PathLike, *, writer: Callable[[Any, Any], None] = torch.save) -> None:
    """Write ``obj`` to ``path`` so that ``path`` is either the old file or the complete new one.

    The bytes go to a temporary file in the same directory, which is flushed and fsynced, then
    renamed over ``path`` with ``os.replace``; the directory is fsynced last. A failure leaves
    no temporary file behind.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = _create_temporary(directory, os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            writer(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _write_text(text: str, f: Any) -> None:
    f.write(text.encode("utf-8"))


def write_latest(model_dir: PathLike, prefix: str, path: PathLike) -> None:
    """Point ``{prefix}-latest`` at ``path`` (atomically; written after the checkpoint)."""
    atomic_save(os.path.basename(os.fspath(path)) + "\n",
                os.path.join(os.fspath(model_dir), prefix + _LATEST_SUFFIX), writer=_write_text)


def _check_safe(obj: Any, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` would not load back."""
    if type(obj) in _PLAIN or isinstance(obj, (torch.Tensor, torch.Size, torch.dtype, torch.device)):
        return
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            if type(key) not in _PLAIN:
                raise TypeError(f"checkpoint state {where} has a key of type {type(key).__name__}")
            _check_safe(value, f"{where}[{key!r}]")
        return
    if type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            _check_safe(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"checkpoint state {where} is a {type(obj).__name__}; a checkpoint holds only tensors and "
        "plain python values (dict, list, tuple, str, int, float, bool, None) so that loading it can "
        "never run code. Convert it in that handler's state_dict()."
    )


def build_payload(estimator: Any) -> Optional[dict[str, Any]]:
    """Everything needed to resume ``estimator``'s current fit. A collective under
    torch.distributed: every rank must call it (each contributes its snapshot); global rank 0
    gets the payload, the other ranks None."""
    from . import __version__, distributed

    snapshot = estimator._snapshot(estimator._run)
    ranks = distributed.gather_to_main(snapshot)
    if ranks is None:  # not rank 0: its snapshot went there
        return None
    for other in ranks[1:]:  # states the same on every rank are stored once, with rank 0's
        for name in snapshot.get("shared", ()):
            other["handlers"].pop(name, None)
    payload = {
        "format_version": FORMAT_VERSION,
        "estimatorch_version": __version__,
        "torch_version": str(torch.__version__),
        "world_size": len(ranks),
        "model": estimator.net.state_dict(),
        "optimizer": estimator.optimizer.state_dict(),
        "lr_scheduler": estimator.lr_scheduler.state_dict() if estimator.lr_scheduler is not None else None,
        "grad_scaler": estimator.grad_scaler.state_dict() if estimator.grad_scaler is not None else None,
        "ranks": ranks,
    }
    _check_safe(payload, "payload")
    return payload


# -- reading ------------------------------------------------------------------------------------
def _migrate_1_to_2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept one process's snapshot at the top level (``format_version`` 1, the keys of
    ``_SNAPSHOT_KEYS``, an optional ``evaluated``, and the training states), and neither the
    library versions nor ``partial``."""
    snapshot = {key: payload[key] for key in _SNAPSHOT_KEYS}
    snapshot["partial"] = False
    snapshot["evaluated"] = payload.get("evaluated", False)
    return {
        "format_version": 2,
        "estimatorch_version": "unknown (format 1)",
        "torch_version": "unknown (format 1)",
        "world_size": 1,
        "model": payload["model"],
        "optimizer": payload["optimizer"],
        "lr_scheduler": payload.get("lr_scheduler"),
        "grad_scaler": payload.get("grad_scaler"),
        "ranks": [snapshot],
    }


#: version -> function upgrading a payload of that version to the next one.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _migrate_1_to_2}


def migrate(payload: dict[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """Upgrade ``payload`` to :data:`FORMAT_VERSION`; refuse a newer or unknown version."""
    version = payload.get("format_version") if isinstance(payload, dict) else None
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{source} is not an estimatorch checkpoint (format_version={version!r})")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{source} has format version {version}, newer than this estimatorch understands "
            f"({FORMAT_VERSION}); upgrade estimatorch to load it"
        )
    while version < FORMAT_VERSION:
        try:
            payload = MIGRATIONS[version](payload)
        except KeyError as err:  # a damaged old file: say so instead of a bare KeyError
            raise CheckpointError(f"{source} has format version {version} but lacks {err}; "
                                  "it cannot be upgraded") from err
        version = payload["format_version"]
    return payload


def validate(payload: dict[str, Any], source: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` naming what a (current-version) payload lacks."""
    for key in ("format_version", *_TOP_KEYS):
        if key not in payload:
            raise CheckpointError(f"{source} is missing {key!r}")
    ranks = payload["ranks"]
    if not isinstance(ranks, list) or len(ranks) != payload["world_size"] or not ranks:
        raise CheckpointError(f"{source} holds {len(ranks) if isinstance(ranks, list) else ranks!r} "
                              f"rank snapshots for world size {payload['world_size']}")
    for rank, snapshot in enumerate(ranks):
        if not isinstance(snapshot, dict):
            raise CheckpointError(f"{source}: the snapshot of rank {rank} is a {type(snapshot).__name__}, not a dict")
        for key in _SNAPSHOT_KEYS_2:
            if key not in snapshot:
                raise CheckpointError(f"{source}: the snapshot of rank {rank} is missing {key!r}")


def load(path: PathLike) -> dict[str, Any]:
    """Load, migrate and validate a checkpoint (tensors on the CPU), without running code.

    Raises:
        CheckpointError: the file is unreadable, invalid, or of a newer format.
    """
    path = os.fspath(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # truncated, corrupt, or holding objects weights_only refuses
        raise CheckpointError(f"cannot read checkpoint {path!r}: {err}") from err
    payload = migrate(payload, source=repr(path))
    validate(payload, source=repr(path))
    return payload


def find_latest(model_dir: PathLike, prefix: str) -> Optional[tuple[str, dict[str, Any]]]:
    """The newest checkpoint of ``prefix`` (most epochs, then batches) that loads and validates,
    as ``(path, payload)``; a file that fails is skipped with a warning. None when there is none.

    The ``{prefix}-latest`` pointer is not needed to choose: a crash between writing a checkpoint
    and its pointer must not hide that checkpoint.
    """
    for _, _, path in reversed(list_checkpoints(model_dir, prefix)):
        try:
            return path, load(path)
        except (CheckpointError, OSError) as err:
            logger.warning("Skipping checkpoint %s: %s", path, err)
    return None


def rank_snapshot(payload: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s snapshot, with the states stored once (see ``shared_state``) filled in."""
    snapshot = dict(payload["ranks"][rank])
    shared = payload["ranks"][0]["handlers"]
    snapshot["handlers"] = {**{name: shared[name] for name in snapshot.get("shared", ()) if name in shared},
                            **snapshot["handlers"]}
    return snapshot


def restore_training_state(estimator: Any, payload: dict[str, Any]) -> None:
    """Load model, optimizer, LR scheduler and grad scaler states into ``estimator``."""
    estimator.net.load_state_dict(payload["model"])
    estimator.optimizer.load_state_dict(payload["optimizer"])
    for attr in ("lr_scheduler", "grad_scaler"):
        target, state = getattr(estimator, attr), payload[attr]
        if (target is None) != (state is None):
            raise CheckpointError(f"the checkpoint {'has' if state is not None else 'has no'} {attr} state "
                                  f"but the estimator {'has no' if target is None else 'has a'} {attr}")
        if target is not None:
            target.load_state_dict(state)
    if payload["ranks"][0]["position"]["step"] > 0:
        # The optimizer stepped before the checkpoint (in the process that wrote it): tell the LR
        # scheduler's "step() before optimizer.step()" check, which reads this torch marker.
        estimator.optimizer._opt_called = True


# -- command line -------------------------------------------------------------------------------
def _migrate_dir(directory: str) -> int:
    upgraded = refused = 0
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # not a loadable file: report and go on
            print(f"skip {name}: unreadable ({err})")
            continue
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version == FORMAT_VERSION:
            print(f"ok   {name}: already format {FORMAT_VERSION}")
            continue
        try:
            payload = migrate(raw, source=name)
            validate(payload, source=name)
        except CheckpointError as err:
            print(f"FAIL {name}: {err}")
            refused += 1
            continue
        backup = f"{path}.v{version}"
        if not os.path.exists(backup):
            shutil.copy2(path, backup)
        atomic_save(payload, path)
        print(f"up   {name}: format {version} -> {FORMAT_VERSION} (original kept as {os.path.basename(backup)})")
        upgraded += 1
    print(f"{upgraded} upgraded, {refused} refused")
    return 2 if refused else 0


def _inspect(path: str) -> int:
    payload = load(path)
    first = payload["ranks"][0]
    print(f"{path}: format {payload['format_version']}, estimatorch {payload['estimatorch_version']}, "
          f"torch {payload['torch_version']}, world size {payload['world_size']}")
    print(f"position {first['position']}, plan {first['plan']}")
    print(f"fingerprint {first['fingerprint']}")
    print(f"handlers {sorted(first['handlers'])}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m estimatorch.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_migrate = sub.add_parser("migrate", help="upgrade every older checkpoint in a directory in place "
                                               "(the original is kept as FILE.v<old version>)")
    p_migrate.add_argument("directory")
    p_inspect = sub.add_parser("inspect", help="print what a checkpoint holds")
    p_inspect.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.command == "migrate":
            if not os.path.isdir(args.directory):
                parser.error(f"directory {args.directory!r} does not exist")
            return _migrate_dir(args.directory)
        return _inspect(args.file)
    except (CheckpointError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
