"""What a path names: a checkpoint or weights export, the ``{prefix}-latest`` pointer (the file it
names), or a directory (its newest valid file); and :func:`load_weights` on top of it."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
from typing import Any, Optional

import torch
from torch import nn

from . import _store
from ._files import PathLike
from ._format import CheckpointError, rank_snapshot
from ._frozen import load_partial_state
from ._model import load_model_state
from ._sharded import check_sharded, is_directory, is_sharded, read_rank_state, read_sharded_weights, sharded_tensors
from ._sharded_run import HANDLERS
from ._weights import read_saved

__all__ = ["Located", "load_into", "load_weights", "locate", "saved_files"]

logger = logging.getLogger("estimatorch")

_POINTER = re.compile(r".+-latest")
_PERIODIC = re.compile(r".+-epoch(\d+)batch(\d+)(\.weights)?\.pt")
_PERIODIC_SHARDED = re.compile(r".+-epoch(\d+)batch(\d+)\.dcp")
_BEST = re.compile(r".+-best(?:\.weights)?\.pt")


@dataclasses.dataclass
class Located:
    """The file a path led to, and what it holds."""

    #: the file read
    path: str
    #: ``"checkpoint"`` (a training checkpoint), ``"weights"`` (a weights export) or
    #: ``"sharded"`` (a sharded checkpoint directory)
    kind: str
    #: the checkpoint's payload, the export's state dict, or a sharded checkpoint's marker
    content: Any
    #: how the path given led to ``path``, in words ("" when it is that file)
    how: str = ""
    #: files of a directory that were newer but could not be read, as "name: reason"
    skipped: list[str] = dataclasses.field(default_factory=list)


def saved_files(directory: PathLike) -> list[str]:
    """The checkpoints, sharded checkpoint directories and weights exports in ``directory`` (any
    prefix), newest first: periodic ones by batches trained, then epochs (a checkpoint before a
    weights export of the same point), then the best files, the most recently written first.
    Pointers, temporaries, incomplete sharded directories and other files are not listed."""
    directory = os.fspath(directory)
    periodic, best = [], []
    for name in _store.listdir(directory):
        path = os.path.join(directory, name)
        sharded = _PERIODIC_SHARDED.fullmatch(name)
        if sharded and is_sharded(path):
            periodic.append(((int(sharded.group(2)), int(sharded.group(1)), True, name), path))
            continue
        match, is_best = _PERIODIC.fullmatch(name), _BEST.fullmatch(name)
        if not (match or is_best) or not _store.isfile(path):
            continue
        if match:
            periodic.append(((int(match.group(2)), int(match.group(1)), match.group(3) is None, name), path))
        else:
            best.append(((_store.mtime(path), name), path))
    return [path for _, path in sorted(periodic, reverse=True)] + [path for _, path in sorted(best, reverse=True)]


def _follow(pointer: str) -> str:
    """The file a ``{prefix}-latest`` pointer names (in the pointer's directory)."""
    try:
        if _store.is_url(pointer):
            name = _store.read_bytes(pointer).decode("utf-8").strip()
        else:
            with open(pointer, encoding="utf-8") as f:
                name = f.read().strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer!r} is not a {{prefix}}-latest pointer: it is not text") from None
    if not name or name in (".", "..") or os.path.basename(name) != name or (os.altsep and os.altsep in name):
        raise CheckpointError(f"pointer {pointer!r} should name a file in its directory, but holds {name[:80]!r}")
    target = os.path.join(os.path.dirname(pointer), name)
    if not _store.isfile(target) and not is_sharded(target):
        where = os.path.dirname(pointer) or "."
        raise CheckpointError(f"pointer {pointer!r} names {name!r}, which is not in {where!r} "
                              "(removed or moved since the pointer was written?)")
    return target


def _read(path: str, header: bool = False) -> tuple[str, Any]:
    """``read_saved`` for a file; a sharded checkpoint directory is checked, and its marker read."""
    if is_directory(path):
        return "sharded", check_sharded(path)
    return read_saved(path, header)


def locate(path: PathLike, storage_options: Optional[dict[str, Any]] = None, header: bool = False) -> Located:
    """Read what ``path`` names, without running code: a checkpoint or weights export file; a
    sharded checkpoint directory (checked, not loaded); a ``{prefix}-latest`` pointer (what it
    names); or a directory: its newest checkpoint or export that can be read (see
    :func:`saved_files`; newer ones that cannot are listed in ``skipped``).

    ``path`` may be an fsspec URL (``s3://bucket/prefix/model-latest``), reached with
    ``storage_options`` (fsspec's: endpoint, credentials). With ``header``, an object is read
    only up to its tensors, which come back on the meta device (what ``inspect`` shows).

    Raises:
        FileNotFoundError: nothing is at ``path``.
        CheckpointError: saying why ``path`` names no readable checkpoint or export.
    """
    path = _store.configure(os.fspath(path), storage_options, arg="path")
    if not _store.exists(path):
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
    if is_sharded(path):
        return Located(path, "sharded", check_sharded(path))
    if _store.isdir(path):
        return _newest(path, header)
    if _POINTER.fullmatch(os.path.basename(path)):
        target = _follow(path)
        kind, content = _read(target, header)
        return Located(target, kind, content, how=f"{path} points to it")
    kind, content = read_saved(path, header)
    return Located(path, kind, content)


def _newest(directory: str, header: bool = False) -> Located:
    files = saved_files(directory)
    if not files:
        raise CheckpointError(f"directory {directory!r} holds no checkpoint or weights export (files named "
                              "PREFIX-epochEbatchB.pt, PREFIX-best.pt, or the same ending in .weights.pt)")
    skipped = []
    for path in files:
        try:
            kind, content = _read(path, header)
        except FileNotFoundError:  # removed since it was listed
            continue
        except (CheckpointError, OSError) as err:
            skipped.append(f"{os.path.basename(path)}: {err}")
            continue
        how = f"the newest valid of {len(files)} checkpoint and export files in {directory}"
        return Located(path, kind, content, how=how, skipped=skipped)
    raise CheckpointError(f"none of the {len(files)} checkpoint and export files in {directory!r} can be read: "
                          + "; ".join(skipped[:3]) + ("; ..." if len(skipped) > 3 else ""))


def load_weights(path: PathLike, storage_options: Optional[dict[str, Any]] = None, *,
                 handler: Optional[str] = None) -> Any:
    """The model's weights as a plain state dict (tensors on the CPU, the plain module's keys) from
    a checkpoint, a weights export, a sharded checkpoint directory (gathered in full in this
    process; no process group needed), a ``{prefix}-latest`` pointer or a directory (its newest
    checkpoint that can be read; newer ones that cannot are skipped with a warning). Nothing is
    unpickled but tensors and plain values.

    Args:
        path: a file or a directory; or an fsspec URL of an object or prefix on an object store
            (``s3://bucket/run/model-latest``: needs the ``estimatorch[s3]`` extra, or the
            protocol's fsspec package).
        storage_options: for a URL, fsspec's arguments of its filesystem (endpoint, credentials),
            e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``;
            without them the environment's (``AWS_ACCESS_KEY_ID``...).
        handler: the name of a handler whose state in the checkpoint holds weights of the model
            (under its key ``"weights"``, by parameter name: an ``EMAHandler``'s or
            ``SWAHandler``'s average): the model's state with those in place of its parameters.
            Only a resumable checkpoint holds handler states. Defaults to None (the model's own
            weights).

    Returns:
        A state dict for ``net.load_state_dict(...)`` on the plain module (not compiled, not
        wrapped in DDP). An adapter-only checkpoint (of a net with frozen parameters) holds the
        trainable parameters and buffers alone: load it into a net built on the same base with
        :func:`load_into`, which checks the frozen ones.

    Raises:
        FileNotFoundError: nothing is at ``path``.
        CheckpointError: ``path`` names no readable checkpoint or export (the reason in words).

    Example:
        >>> import os, tempfile, torch
        >>> from estimatorch.checkpoint import atomic_save, best_weights_name
        >>> path = os.path.join(tempfile.mkdtemp(), best_weights_name("model"))
        >>> atomic_save(torch.nn.Linear(2, 1).state_dict(), path)
        >>> net = torch.nn.Linear(2, 1)
        >>> net.load_state_dict(load_weights(path))
        <All keys matched successfully>
    """
    found = locate(path, storage_options)
    for reason in found.skipped:
        logger.warning("load_weights: skipping %s", reason)
    if found.how:
        logger.info("load_weights: %s (%s)", found.path, found.how)
    if found.kind == "sharded":
        model = read_sharded_weights(found.path)
    else:
        model = found.content["model"] if found.kind == "checkpoint" else found.content
    if handler is None:
        return model
    if found.kind == "weights":
        raise CheckpointError(f"{found.path!r} is a weights export, which holds no handler state: "
                              f"load_weights(handler={handler!r}) reads a checkpoint")
    weights = _handler_weights(found, handler)
    out = type(model)(model)
    for name, tensor in weights.items():
        if name not in out:
            raise CheckpointError(f"the weights of handler {handler!r} in {found.path!r} name {name!r}, which the "
                                  "model's state does not hold")
        out[name] = tensor.detach().cpu()
    return out


def _handler_weights(found: Located, handler: str) -> dict[str, Any]:
    """The ``weights`` entry of ``handler``'s state in a checkpoint (through DCP for the shards of
    a sharded checkpoint's)."""
    if found.kind == "sharded":
        key = f"{HANDLERS}.{handler}.weights"
        if sharded_tensors(found.path, key):
            return read_sharded_weights(found.path, key)
        snapshot = read_rank_state(found.path, 0).get("snapshot", {})
    else:
        snapshot = rank_snapshot(found.content, 0)
    states = snapshot.get("handlers", {}) if isinstance(snapshot, dict) else {}
    state = states.get(handler)
    weights = state.get("weights") if isinstance(state, dict) else None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        holding = sorted(name for name, s in states.items()
                         if isinstance(s, dict) and isinstance(s.get("weights"), dict))
        raise CheckpointError(f"{found.path!r} holds no weights of a handler {handler!r}"
                              + (f"; these handlers' states hold some: {holding}" if holding else
                                 "; no handler state of it holds weights"))
    return weights


def load_into(net: nn.Module, path: PathLike, storage_options: Optional[dict[str, Any]] = None) -> nn.Module:
    """Load the weights of a checkpoint or an export (found as :func:`load_weights` finds it) into
    ``net`` and return it. An adapter-only checkpoint (a PEFT model's: trainable parameters only)
    keeps ``net``'s frozen parameters, after checking they are the ones it trained on: then
    ``net.save_pretrained(dir)`` writes the adapter and ``net.merge_and_unload()`` gives the
    merged model.

    Raises:
        CheckpointError: ``path`` names nothing readable, or ``net``'s frozen parameters differ
            from the checkpoint's (the first one named).
    """
    found = locate(path, storage_options)
    for reason in found.skipped:
        logger.warning("load_into: skipping %s", reason)
    if found.kind == "checkpoint":
        load_partial_state(net, found.content["model"], found.content.get("frozen"))
    else:
        load_model_state(net, read_sharded_weights(found.path) if found.kind == "sharded" else found.content)
    return net
