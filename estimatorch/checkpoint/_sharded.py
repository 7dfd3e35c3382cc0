"""Sharded checkpoints: one directory per checkpoint, every rank writing its own part.

A model sharded with FSDP2 (``fully_shard``) holds each parameter and optimizer moment as a
``DTensor``, a slice per rank. Its checkpoint is written through ``torch.distributed.checkpoint``
(DCP): each rank writes its slices in parallel, and the directory loads on another number of
ranks (DCP reads whatever slices each rank's template asks for). A directory
``{prefix}-epoch{E}batch{B}.dcp`` holds:

- ``.metadata`` and ``__{rank}_{n}.distcp``: DCP's files, holding **tensors only** (the model's
  and the optimizer's; their non-tensor parts travel in ``common.pt``);
- ``common.pt``: the state with every DCP tensor replaced by ``None`` (optimizer hyper-parameters,
  steps kept as numbers), written by rank 0;
- ``rank-{r}.pt``: rank ``r``'s own state (generators, data position, handler states): DCP
  de-duplicates a value saved under one key on every rank, so per-rank state stays out of it;
- ``estimatorch.json``: written last, the marker that the directory is complete (format, world
  size, versions).

Written like a single file (:func:`~estimatorch.checkpoint.atomic_save`): into a temporary
directory ``.{name}.{hex}.tmp`` that every rank writes into, each file fsynced, the marker last,
the directory fsynced, renamed to its name, the parent fsynced. A killed writer leaves a
temporary directory that discovery never takes for a checkpoint. Reading runs no code: the
``.pt`` files load with ``weights_only=True``, DCP's ``.metadata`` through an unpickler that knows
DCP's metadata classes only, and DCP's data holds tensors only (no pickled objects).

On an object store (a URL) there is no rename: the directory is written in place under its name,
every file one object, and rank 0 writes the marker last, once every rank's part is uploaded
(``_sharded_store.py``); a directory without its marker is never a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import secrets
import shutil
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import distributed
from .._saved import CheckpointError
from .._version import __version__
from . import _store
from ._files import _IN_FLIGHT, MARKER, PathLike, _fsync_dir, _write_error, _write_text, atomic_save
from ._format import NewerFormatError
from ._format import _read as read_file
from ._lease import check_writer
from ._sharded_store import METADATA as _METADATA
from ._sharded_store import _read_bytes, _reader, _writer

if TYPE_CHECKING:  # heavy (DTensor and DCP take about a third of torch's own import): typing only
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "MARKER",
    "SHARDED_FORMAT",
    "is_sharded",
    "load_sharded",
    "load_sharded_tensors",
    "read_sharded_weights",
    "save_sharded",
    "sharded_digest",
    "sharded_marker",
    "sharded_tensors",
]

#: the sharded layout's version (in the marker).
SHARDED_FORMAT = 1
_COMMON = "common.pt"
logger = logging.getLogger("estimatorch")


def _rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _absolute(path: PathLike) -> str:
    """A local path made absolute; a URL as it is."""
    path = os.fspath(path)
    return path if _store.is_url(path) else os.path.abspath(path)


def is_directory(path: PathLike) -> bool:
    """A directory; at a URL, a prefix some objects are under."""
    return _store.isdir(os.fspath(path))


# -- the tensors DCP holds, the rest ------------------------------------------------------------
def flatten_tensors(state: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf of a nested dict/list ``state`` under DCP's dotted key (``model.0.weight``,
    ``optimizer.state.0.weight.exp_avg``, ``optimizer.param_groups.0.params.1``).

    Example:
        >>> sorted(flatten_tensors({"model": {"w": torch.ones(1)}, "lr": 0.1}))
        ['model.w']
    """
    out: dict[str, torch.Tensor] = {}

    def visit(value: Any, key: str) -> None:
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                visit(v, f"{key}.{i}" if key else str(i))

    visit(state, prefix)
    return out


def _without_tensors(value: Any) -> Any:
    """``value`` with every tensor leaf replaced by None (what ``common.pt`` keeps)."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, Mapping):
        return {k: _without_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_tensors(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_without_tensors(v) for v in value)
    return value


def _merge(template: Any, common: Any) -> Any:
    """``common``'s non-tensor values laid over ``template``'s tensors (loaded in place)."""
    if isinstance(template, torch.Tensor):
        return template
    if isinstance(template, Mapping) and isinstance(common, Mapping):
        return {k: _merge(template[k], v) if k in template else v for k, v in common.items()}
    if isinstance(template, (list, tuple)) and isinstance(common, (list, tuple)) and len(template) == len(common):
        return type(common)(_merge(t, c) for t, c in zip(template, common))
    return common


# -- writing ------------------------------------------------------------------------------------
def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _agree(error: Optional[BaseException], what: str) -> None:
    distributed.raise_on_every_rank(error, what)


def _dcp_module() -> Any:
    """``torch.distributed.checkpoint``, imported at the first sharded checkpoint a process reads or
    writes (with DTensor, about a third of torch's own import time, which no other fit pays)."""
    import torch.distributed.checkpoint as dcp  # heavy: only where a checkpoint is sharded

    return dcp


def _dcp(fn: Any, state: dict[str, Any], process_group: Any = None, **kwargs: Any) -> None:
    """``dcp.save``/``dcp.load`` of ``state`` (over ``process_group``, by default the default
    group), in one process without its warning that it assumes one process (that is what
    estimatorch asks for there)."""
    single = not distributed.is_distributed()
    if process_group is not None and not single:
        kwargs["process_group"] = process_group
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        fn(state, no_dist=single, **kwargs)


def save_sharded(state: Mapping[str, Any], rank_state: Any, path: PathLike) -> str:
    """Write a sharded checkpoint directory at ``path`` (a collective: every rank calls it with
    its part: ``state`` holds the sharded ``model``/``optimizer`` state dicts, e.g. from
    ``torch.distributed.checkpoint.state_dict.get_state_dict``; ``rank_state`` this rank's own).

    ``path`` must not exist: a checkpoint is never overwritten. Returns ``path``.

    Raises:
        FileExistsError: ``path`` exists (on every rank).
        OSError: a write failed on some rank (on every rank, naming the file and keeping the
            errno); no directory is left at ``path``.
    """
    path = _absolute(path)
    return write_sharded(state, rank_state, path, begin_sharded(path))


def begin_sharded(path: PathLike) -> str:
    """The first part of :func:`save_sharded` (a collective): rank 0 creates the temporary
    directory every rank writes into; every rank gets its path.

    At a URL the directory is written in place (there is no rename): its own path is returned.

    Raises:
        FileExistsError: ``path`` exists (on every rank).
    """
    path = _absolute(path)
    parent, name = os.path.split(path)

    def create() -> str:
        if _store.is_url(path):
            check_writer(path)  # before any rank writes: a lease another writer took over stops it
            if _store.exists(path):
                raise FileExistsError(f"sharded checkpoint {path!r} already exists; a checkpoint is never "
                                      "overwritten")
            return path
        if os.path.exists(path):
            raise FileExistsError(f"sharded checkpoint {path!r} already exists; a checkpoint is never overwritten")
        tmp = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
        _IN_FLIGHT.add(tmp)  # never an orphan for this process's cleanup
        try:
            os.mkdir(tmp)
        except OSError as err:
            _IN_FLIGHT.discard(tmp)
            raise _write_error(tmp, err) from err
        return tmp

    return distributed.broadcast_object(distributed.run_on_main(create, "creating a sharded checkpoint"))


def write_sharded(state: Mapping[str, Any], rank_state: Any, path: PathLike, tmp: str, group: Any = None) -> str:
    """The rest of :func:`save_sharded` (a collective over ``group``, by default the ranks'
    own): every rank writes its part into ``tmp`` (from :func:`begin_sharded`), then rank 0
    marks the directory complete and renames it to ``path``. With :func:`distributed.side_group
    <estimatorch.distributed.side_group>` it runs on a background thread while the training
    thread's collectives go on."""
    path = _absolute(path)
    parent, url = os.path.dirname(path), _store.is_url(path)
    rank, world = distributed.get_rank(), distributed.get_world_size()
    error: Optional[BaseException] = None
    dcp = _dcp_module()
    with distributed.on_group(group):
        try:
            try:
                _dcp(dcp.save, flatten_tensors(state), storage_writer=_writer(tmp), process_group=group)
            except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
                error = err
            if error is None:
                try:
                    atomic_save(rank_state, os.path.join(tmp, _rank_file(rank)))
                    if rank == 0:
                        atomic_save(_without_tensors(state), os.path.join(tmp, _COMMON))
                except OSError as err:
                    error = err
            _agree(error, f"writing the sharded checkpoint {path}")

            def finish() -> None:
                for entry in os.listdir(tmp) if not url else ():  # DCP fsyncs its data; a shared fs: all
                    _fsync_file(os.path.join(tmp, entry))
                marker = {"estimatorch_sharded": SHARDED_FORMAT, "world_size": world,
                          "estimatorch_version": __version__, "torch_version": torch.__version__,
                          "id": secrets.token_hex(8)}  # tells two writes of one name apart (digest)
                # every rank's part is uploaded (the agreement above): the marker makes it complete
                atomic_save(json.dumps(marker, indent=1) + "\n", os.path.join(tmp, MARKER), writer=_write_text)
                if url:  # written in place: no rename
                    return
                _fsync_dir(tmp)
                if os.path.exists(path):
                    raise FileExistsError(f"sharded checkpoint {path!r} appeared while it was written")
                os.rename(tmp, path)
                _fsync_dir(parent)

            distributed.run_on_main(finish, f"completing the sharded checkpoint {path}")
        except BaseException:
            if rank == 0:
                _discard_partial(tmp)
            raise
        finally:
            _IN_FLIGHT.discard(tmp)
    return path


def _discard_partial(tmp: str) -> None:
    """Remove what a failed write left (a local temporary directory; at a URL the partial
    directory, which has no marker: never taken for a checkpoint if this fails too)."""
    if not _store.is_url(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        _store.remove(tmp, prefix=True)
    except OSError as err:
        logger.warning("Could not remove the incomplete sharded checkpoint %s: %s (removed at the next fit start)",
                       tmp, err)


# -- reading ------------------------------------------------------------------------------------
def is_sharded(path: PathLike) -> bool:
    """``path`` is a directory holding the completion marker of a sharded checkpoint."""
    return _store.isfile(os.path.join(os.fspath(path), MARKER))


def sharded_marker(path: PathLike) -> dict[str, Any]:
    """The marker of the sharded checkpoint at ``path``, checked.

    Raises:
        CheckpointError: no marker (an incomplete directory), or one that is not ours.
    """
    path = os.fspath(path)
    marker_path = os.path.join(path, MARKER)
    try:
        marker = json.loads(_read_bytes(marker_path).decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is not a complete sharded checkpoint: it has no {MARKER} "
                              "(a writer that was killed leaves such a directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{marker_path!r} cannot be read: {err}") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("estimatorch_sharded"), int) \
            or not isinstance(marker.get("world_size"), int) or marker["world_size"] < 1:
        raise CheckpointError(f"{marker_path!r} is not an estimatorch sharded checkpoint marker")
    if marker["estimatorch_sharded"] > SHARDED_FORMAT:
        raise NewerFormatError(f"{path!r} was written by a newer estimatorch ({marker.get('estimatorch_version')}, "
                              f"sharded format {marker['estimatorch_sharded']}); upgrade estimatorch to read it")
    return marker


def sharded_digest(path: PathLike) -> str:
    """A SHA-256 of the marker and DCP's metadata of the sharded checkpoint at ``path``: ranks
    compare it to know they read the same checkpoint (the marker holds a random id per write)."""
    h = hashlib.sha256()
    for name in (MARKER, _METADATA):
        h.update(_read_bytes(os.path.join(os.fspath(path), name)))
    return h.hexdigest()


def _metadata(path: str) -> Metadata:
    try:
        return _reader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"sharded checkpoint {path!r} has no {_METADATA} file") from None
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointError(f"{os.path.join(path, _METADATA)!r} cannot be read: {err}") from None


def check_sharded(path: PathLike, template: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Check a sharded checkpoint before anything is restored from it: the marker, DCP's metadata,
    every shard file the metadata names (present and long enough), every rank's file, and, with
    ``template`` (the state it would load into), that every tensor it holds is there with the
    same global shape and dtype. Returns the marker.

    Raises:
        CheckpointError: naming the checkpoint and what is wrong, in words.
    """
    path = os.fspath(path)
    marker = sharded_marker(path)
    metadata = _metadata(path)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    sizes = _store.sizes(path)  # one listing (of objects, at a URL)
    for relative, size in sorted(needed.items()):
        shard = os.path.join(path, relative)
        have = sizes.get(relative)
        if have is None:
            raise CheckpointError(f"sharded checkpoint {path!r} is missing its shard {relative!r}")
        if have < size:
            raise CheckpointError(f"shard {shard!r} is truncated: {have} bytes where its metadata needs {size}")
    for name in [_COMMON] + [_rank_file(r) for r in range(marker["world_size"])]:
        if name not in sizes:
            raise CheckpointError(f"sharded checkpoint {path!r} is missing {name!r}")
    if template is not None:
        _check_template(path, metadata, flatten_tensors(template))
    return marker


def _check_template(path: str, metadata: Metadata, wanted: Mapping[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # heavy: a sharded checkpoint's

    saved = metadata.state_dict_metadata
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"sharded checkpoint {path!r} does not hold {', '.join(missing[:3])}{more} "
                              "(saved from another model or optimizer?)")
    extra = sorted(k for k in saved if k not in wanted and k.split(".", 1)[0] in {w.split(".", 1)[0] for w in wanted})
    if extra:
        raise CheckpointError(f"sharded checkpoint {path!r} holds {', '.join(extra[:3])}, which this model "
                              "and optimizer do not have (saved from another model?)")
    for key, tensor in wanted.items():
        entry = saved[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"sharded checkpoint {path!r}: {key} is not a tensor there")
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(f"sharded checkpoint {path!r}: {key} has shape {tuple(entry.size)}, "
                                  f"this model's has {tuple(tensor.shape)}")
        if entry.properties.dtype != tensor.dtype:
            raise CheckpointError(f"sharded checkpoint {path!r}: {key} is {entry.properties.dtype}, "
                                  f"this model's is {tensor.dtype}")


def load_sharded(path: PathLike, template: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """Load a sharded checkpoint into ``template`` (a collective: every rank passes the state
    dicts it would save, e.g. ``get_state_dict(model, optimizer)``; their tensors, DTensors
    included, are filled in place from whatever slices this rank holds, on any world size).

    Returns ``(state, rank_state)``: ``template`` with the saved non-tensor values (optimizer
    hyper-parameters) laid over it, for ``set_state_dict``; and this rank's own state from the
    rank that had the same number when it was saved (None when that rank did not exist).

    Raises:
        CheckpointError: the directory fails :func:`check_sharded` against ``template``.
    """
    path = os.fspath(path)
    marker = check_sharded(path, template)
    _dcp(_dcp_module().load, flatten_tensors(template), storage_reader=_reader(path))
    common = _read(os.path.join(path, _COMMON))
    rank = distributed.get_rank()
    rank_state = _read(os.path.join(path, _rank_file(rank))) if rank < marker["world_size"] else None
    return _merge(template, common), rank_state


def load_sharded_tensors(path: PathLike, template: Mapping[str, Any]) -> None:
    """Fill ``template``'s tensors (DTensors included) in place from the sharded checkpoint at
    ``path`` (a collective, as :func:`load_sharded`; checked by the caller)."""
    _dcp(_dcp_module().load, flatten_tensors(template), storage_reader=_reader(os.fspath(path)))


def read_rank_state(path: PathLike, rank: int) -> Any:
    """Rank ``rank``'s own state in the sharded checkpoint at ``path``."""
    return _read(os.path.join(os.fspath(path), _rank_file(rank)))


def _read(file: str) -> Any:
    try:
        return read_file(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file!r} is missing") from None


def sharded_tensors(path: PathLike, key: str = "model") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (global shape, dtype)}`` of the ``key`` tensors a sharded checkpoint holds, read
    from its metadata alone (nothing is loaded)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # heavy: a sharded checkpoint's

    prefix = key + "."
    return {k[len(prefix):]: (tuple(v.size), v.properties.dtype)
            for k, v in _metadata(os.fspath(path)).state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}


def read_sharded_weights(path: PathLike, key: str = "model") -> dict[str, torch.Tensor]:
    """The full, plain model state dict (CPU tensors, the plain module's keys) from a sharded
    checkpoint, in a process without a process group (for inference).

    Raises:
        CheckpointError: the checkpoint is incomplete or damaged.
    """
    path = os.fspath(path)
    check_sharded(path)
    prefix = key + "."
    state = {prefix + k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in sharded_tensors(path, key).items()}
    if not state:
        raise CheckpointError(f"sharded checkpoint {path!r} holds no {key!r} tensors")
    dcp = _dcp_module()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=_reader(path), no_dist=True)
    except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's is a BaseException
        raise CheckpointError(f"sharded checkpoint {path!r} cannot be read: {err}") from None
    return {k[len(prefix):]: v for k, v in state.items()}
