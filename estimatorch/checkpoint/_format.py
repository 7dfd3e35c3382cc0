"""The payload of a checkpoint file: building it, reading it safely, upgrading older versions and
checking its layout."""

from __future__ import annotations

import hashlib
import io
import os
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import _weights_only_unpickler

from .._checks import is_int
from .._saved import CheckpointError
from .._version import __version__
from . import _store
from ._files import PathLike
from ._frozen import split_frozen
from ._run_state import check_run_state
from ._seam import ResumableFit

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "NewerFormatError",
    "build_payload",
    "file_digest",
    "load",
    "migrate",
    "rank_snapshot",
    "read_format_version",
    "validate",
]

FORMAT_VERSION = 2
#: what format 1 held at the top level besides the training states: one process's snapshot
#: (a frozen description of old files; the snapshot of today is declared by the estimator).
_V1_SNAPSHOT_KEYS = ("position", "plan", "handlers", "metrics", "history", "data", "fingerprint", "rng")
_TOP_KEYS = ("model", "optimizer", "lr_scheduler", "grad_scaler", "ranks", "world_size")
_PLAIN = (type(None), bool, int, float, str, bytes)


class NewerFormatError(CheckpointError):
    """A checkpoint written by a newer estimatorch: never skipped, pruned or overwritten."""


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


def build_payload(estimator: ResumableFit, *, save_frozen: bool = False) -> Optional[dict[str, Any]]:
    """Everything needed to resume ``estimator``'s current fit, as a file of this format holds it.
    A collective under torch.distributed: every rank must call it (each contributes its
    snapshot); global rank 0 gets the payload, the other ranks None.

    The state comes from ``estimator.state_payload()`` (the store seam); this adds the format's
    header and stores the handler states the estimator declares the same on every rank
    (``shared``) once, with rank 0's (:func:`rank_snapshot` gives them back). For a net with
    frozen parameters, unless ``save_frozen``, ``model`` holds the trainable parameters and the
    buffers, and ``frozen`` the fingerprints of the frozen ones (``_frozen.py``).
    """
    state = estimator.state_payload()
    if state is None:  # not rank 0: its snapshot went there
        return None
    if not save_frozen:
        model, frozen = split_frozen(estimator.net, state["model"])
        if frozen is not None:
            state = {**state, "model": model, "frozen": frozen}
    ranks = state["ranks"]
    for other in ranks[1:]:
        for name in ranks[0].get("shared", ()):
            other["handlers"].pop(name, None)
    payload = {
        "format_version": FORMAT_VERSION,
        "estimatorch_version": __version__,
        "torch_version": str(torch.__version__),
        **state,
    }
    _check_safe(payload, "payload")
    return payload


# -- versions -----------------------------------------------------------------------------------
def _migrate_1_to_2(payload: dict[str, Any]) -> dict[str, Any]:
    """Version 1 kept one process's snapshot at the top level (``format_version`` 1, the keys of
    ``_V1_SNAPSHOT_KEYS``, an optional ``evaluated``, and the training states), and neither the
    library versions nor ``partial``."""
    snapshot = {key: payload[key] for key in _V1_SNAPSHOT_KEYS}
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


def _version(payload: Any, source: str) -> int:
    version = payload.get("format_version") if isinstance(payload, dict) else None
    if not is_int(version) or version < 1:
        raise CheckpointError(f"{source} is not an estimatorch checkpoint (format_version={version!r})")
    if version > FORMAT_VERSION:
        raise newer_format_error(source, version)
    return version


def newer_format_error(source: str, version: int) -> NewerFormatError:
    """The error for a file of format ``version`` > :data:`FORMAT_VERSION`."""
    return NewerFormatError(
        f"{source} was written by a newer estimatorch (format {version}; this one reads up to format "
        f"{FORMAT_VERSION}); upgrade, or choose another model_dir. The file is left untouched.")


def migrate(payload: dict[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """Upgrade ``payload`` to :data:`FORMAT_VERSION`.

    Raises:
        NewerFormatError: a newer version than this library reads.
        CheckpointError: not an estimatorch payload, or an old one that lacks what it needs.
    """
    version = _version(payload, source)
    while version < FORMAT_VERSION:
        try:
            payload = MIGRATIONS[version](payload)
        except KeyError as err:  # a damaged old file: say so instead of a bare KeyError
            raise CheckpointError(f"{source} has format version {version} but lacks {err}; "
                                  "it cannot be upgraded") from err
        version = payload["format_version"]
    return payload


def validate(payload: dict[str, Any], source: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` naming what a (current-version) payload lacks.

    This checks the envelope (the top-level keys, one entry per rank, the ``handlers`` and
    ``shared`` entries the store itself reads, :func:`rank_snapshot`) and the structure of every
    rank's run state, as a resume checks it before reading it (``_run_state.check_run_state``:
    positions, plan, data, handler and metric states, generators);
    :func:`estimatorch.checkpoint.check_against_fit` checks every key, type and shape a resume
    reads against the fit it resumes.
    """
    for key in ("format_version", *_TOP_KEYS):
        if key not in payload:
            raise CheckpointError(f"{source} is missing {key!r}")
    world_size = payload["world_size"]
    if not is_int(world_size) or world_size < 1:
        raise CheckpointError(f"{source}: world_size must be a positive int, got {world_size!r}")
    ranks = payload["ranks"]
    if not isinstance(ranks, list) or len(ranks) != world_size:
        raise CheckpointError(f"{source} holds {len(ranks) if isinstance(ranks, list) else ranks!r} "
                              f"rank snapshots for world size {world_size}")
    for rank, snapshot in enumerate(ranks):
        if not isinstance(snapshot, dict):
            raise CheckpointError(f"{source}: the snapshot of rank {rank} is a {type(snapshot).__name__}, not a dict")
        if "handlers" not in snapshot:
            raise CheckpointError(f"{source}: the snapshot of rank {rank} is missing 'handlers'")
        if not isinstance(snapshot["handlers"], dict):
            raise CheckpointError(f"{source}: the handler states of rank {rank} are a "
                                  f"{type(snapshot['handlers']).__name__}, not a dict")
        shared = snapshot.get("shared", [])
        if not isinstance(shared, (list, tuple)) or not all(isinstance(name, str) for name in shared):
            raise CheckpointError(f"{source}: 'shared' of rank {rank} must be a list of handler names, got {shared!r}")
    check_run_state(payload, source)


#: how a file ``torch.save`` wrote starts: a zip archive, or (the legacy format) a pickle.
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _head(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError:
        return None


def _read(path: str, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True)`` on the CPU, with the reason in words when it fails. An
    object (a URL) is read whole into memory first."""
    data: Optional[bytes] = None
    if _store.is_url(path):
        data = _store.read_bytes(path)  # FileNotFoundError when there is none
        kwargs.pop("mmap", None)
    elif os.path.isdir(path):
        raise CheckpointError(f"cannot read checkpoint {path!r}: it is a directory")
    try:
        return torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True,
                          **kwargs)
    except FileNotFoundError:
        raise
    except Exception as err:  # truncated, corrupt, or holding objects weights_only refuses
        head = _head(path) if data is None else data[:4]
        if head == b"":
            reason = "the file is empty (0 bytes): a write that never completed"
        elif head is not None and not head.startswith(_TORCH_MAGIC):
            reason = f"it is not a file torch.save wrote (it starts with {head!r})"
        else:
            reason = str(err).strip() or f"{type(err).__name__} (a truncated or damaged file)"
        raise CheckpointError(f"cannot read checkpoint {path!r}: {reason}") from err


def load(path: PathLike) -> dict[str, Any]:
    """Load, migrate and check the layout of a checkpoint (tensors on the CPU), without running
    code.

    Raises:
        NewerFormatError: the file was written by a newer estimatorch.
        CheckpointError: the file is unreadable or invalid.
        FileNotFoundError: there is no such file.
    """
    path = os.fspath(path)
    payload = migrate(_read(path), source=repr(path))
    validate(payload, source=repr(path))
    return payload


def read_format_version(path: PathLike) -> Optional[int]:
    """The format version of a checkpoint file, reading little more than its header (tensors are
    memory-mapped, not read; of an object, a few ranged requests, not the whole of it); None when
    the file cannot be read as a checkpoint."""
    path = os.fspath(path)
    try:
        payload = _url_header(path) if _store.is_url(path) else _read(path, mmap=True)
    except (CheckpointError, OSError):
        return None
    version = payload.get("format_version") if isinstance(payload, dict) else None
    return version if is_int(version) else None


#: the first bytes of an object read for its header (more when its pickle is longer).
_HEAD_BYTES = 1 << 16
_ZIP_END = b"PK\x05\x06"  # the end of a zip archive's central directory (torch.save writes no comment)


def _url_header(url: str) -> Any:
    """The payload of the checkpoint object ``url`` with every tensor on the meta device: its
    ``data.pkl`` (the first record torch.save writes, stored uncompressed; a pickle ends itself,
    so its size need not be known) read with ranged requests, and the archive's end checked to
    be there (a damaged object is unreadable, as :func:`_read` would find it); the whole object
    where its layout is another."""
    head = _store.read_range(url, 0, _HEAD_BYTES)
    fixed = head[:30]
    if len(fixed) < 30 or fixed[:4] != b"PK\x03\x04":
        return _read(url)
    method = int.from_bytes(fixed[8:10], "little")
    name_length, extra_length = int.from_bytes(fixed[26:28], "little"), int.from_bytes(fixed[28:30], "little")
    if method != 0 or not head[30:30 + name_length].endswith(b"data.pkl"):
        return _read(url)  # compressed, or another first record: not what torch.save writes
    if not _store.read_range(url, -22).startswith(_ZIP_END):
        raise CheckpointError(f"cannot read checkpoint {url!r}: it is truncated or damaged (no end of archive)")
    try:
        return _meta_unpickle(_Ranged(url, head, 30 + name_length + extra_length))
    except Exception as err:  # damaged, or holding what weights_only refuses
        raise CheckpointError(f"cannot read checkpoint {url!r}: {err}") from err


class _Ranged:
    """The object ``url`` read from ``start`` as a file, in ranged requests of growing size as
    the reader asks for more (what an unpickler reads of ``data.pkl``, not the tensors after it)."""

    def __init__(self, url: str, head: bytes, start: int):
        self.url, self.data, self.pos, self.end = url, head, start, False

    def _want(self, stop: int) -> None:
        while stop > len(self.data) and not self.end:
            more = _store.read_range(self.url, len(self.data), 2 * len(self.data))
            self.end = len(more) < len(self.data)
            self.data += more

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            raise OSError("reading a checkpoint's header to its end")  # never what an unpickler does
        self._want(self.pos + size)
        chunk = self.data[self.pos:self.pos + size]
        self.pos += len(chunk)
        return chunk

    def readline(self) -> bytes:
        while self.data.find(b"\n", self.pos) < 0 and not self.end:
            self._want(2 * len(self.data))
        stop = self.data.find(b"\n", self.pos)
        return self.read((stop + 1 if stop >= 0 else len(self.data)) - self.pos)


def _meta_unpickle(file: Any) -> Any:
    """torch.load's weights-only unpickler on a checkpoint's ``data.pkl``, every storage an
    empty one on the meta device (nothing is read)."""
    def storage(saved_id: Any) -> Any:
        _, storage_type, _, _, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(numel * dtype.itemsize, device="meta"),
                                          dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(file, encoding="utf-8")
    unpickler.persistent_load = storage  # type: ignore[method-assign]
    return unpickler.load()


def file_digest(path: PathLike) -> str:
    """A SHA-256 of the file's bytes: ranks compare it to know they read the same checkpoint."""
    h = hashlib.sha256()
    if _store.is_url(os.fspath(path)):
        h.update(_store.read_bytes(os.fspath(path)))
        return h.hexdigest()
    with open(os.fspath(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rank_snapshot(payload: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s snapshot, with the states stored once (see ``shared_state``) filled in."""
    snapshot = dict(payload["ranks"][rank])
    shared = payload["ranks"][0]["handlers"]
    snapshot["handlers"] = {**{name: shared[name] for name in snapshot.get("shared", ()) if name in shared},
                            **snapshot["handlers"]}
    return snapshot
