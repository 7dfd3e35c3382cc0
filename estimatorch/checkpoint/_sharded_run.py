"""A fit's checkpoints of a net sharded across ranks (FSDP2): what every rank writes into a sharded
checkpoint directory (``_sharded.py``), and the run's part of one read back as a payload the
resume checks like a file's.

Written by every rank at a save (a collective):

- through DCP, the model's and the optimizer's state dicts from
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` (each rank its slices, keyed by
  parameter name, so they load on another number of ranks);
- ``common.pt``: their non-tensor parts (optimizer hyper-parameters, each group's parameter
  names), the format version and the optimizer's class;
- ``rank-{r}.pt``: rank ``r``'s snapshot of the run (``Estimator.state_payload(gather=False)``),
  with the LR scheduler's and grad scaler's states (the same on every rank);
- the DTensors of handler states (an ``EMAHandler``'s average of a sharded net: each rank holds
  its shards) go through DCP with the model's, under ``handlers.{handler}.{key}...``, so that they
  reshard too; the rank's snapshot holds ``{"__in_dcp__": that key}`` in their place. Read back,
  the snapshot holds an empty tensor on the meta device there (the saved global shape and dtype,
  what a resume checks), and :func:`restore_handler_tensors` loads them into the fit's own.

Read back (:func:`read_checkpoint`) as a payload of the single file's layout, whose ``model``
and ``optimizer`` are left out (``None`` and the tensor-less structure) and whose ``sharded``
entry names the directory: the estimator checks the run's part as for a file; the training
state is checked against the directory's metadata and restored with DCP
(``_validate.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .. import distributed
from .._saved import CheckpointError
from .._version import __version__
from ._async import BackgroundWriter
from ._files import PathLike
from ._format import (
    FORMAT_VERSION,
    NewerFormatError,
    _check_safe,
    file_digest,
    load,
    rank_snapshot,
    read_format_version,
    validate,
)
from ._seam import ResumableFit
from ._sharded import (
    _COMMON,
    _absolute,
    begin_sharded,
    check_sharded,
    is_directory,
    load_sharded_tensors,
    read_rank_state,
    save_sharded,
    sharded_digest,
    sharded_marker,
    sharded_tensors,
    write_sharded,
)
from ._sharded import _read as read_part

if TYPE_CHECKING:  # heavy (DTensor and DCP take about a third of torch's own import): typing only
    from torch.distributed.tensor import DTensor

__all__ = ["HANDLERS", "IN_DCP", "SHARDED", "digest_of", "read_checkpoint", "restore_handler_tensors",
           "save_fit_checkpoint", "version_of"]

#: the payload entry naming the directory a sharded checkpoint was read from (absent for a file).
SHARDED = "sharded"
#: the DCP entry holding the DTensors of handler states (``handlers.{handler}.{key}...``).
HANDLERS = "handlers"
#: the key of what a rank's file holds in place of such a DTensor: ``{IN_DCP: its DCP key}``.
IN_DCP = "__in_dcp__"


def save_fit_checkpoint(estimator: ResumableFit, path: PathLike, *, writer: Optional[BackgroundWriter] = None,
                        then: Optional[Callable[[], None]] = None) -> None:
    """Write the current fit of ``estimator`` (its net sharded) as a sharded checkpoint directory
    at ``path``: a collective, every rank calls it.

    With ``writer`` (this rank's :class:`~estimatorch.checkpoint.BackgroundWriter`) it returns
    once this rank's part is copied into the writer's staging buffers: the writer thread writes
    it and completes the directory over :func:`estimatorch.distributed.side_group`, then calls
    ``then()`` (under that group: e.g. rank 0's pointer and retention through ``run_on_main``).
    A background write that failed is raised first, on every rank.

    Raises:
        FileExistsError: ``path`` exists (on every rank).
        OSError: a write failed on some rank (on every rank); nothing is left at ``path``.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict  # heavy: only for a sharded checkpoint

    part = estimator.state_payload(gather=False)
    assert part is not None, "gather=False gives every rank its own part"
    model, optimizer = get_state_dict(estimator.net, estimator.optimizer)
    header = {"format_version": FORMAT_VERSION, "estimatorch_version": __version__,
              "torch_version": str(torch.__version__)}
    snapshot, handler_tensors = _split_handler_tensors(part["snapshot"])
    state = {**header, "model": model, "optimizer": optimizer, "optimizer_class": part["optimizer_class"]}
    if handler_tensors:
        state[HANDLERS] = handler_tensors
    rank_state = {**header, "lr_scheduler": part["lr_scheduler"], "grad_scaler": part["grad_scaler"],
                  "snapshot": snapshot}
    _check_safe(rank_state, "payload")
    if writer is None:
        save_sharded(state, rank_state, path)
        if then is not None:
            then()
        return
    error: Optional[BaseException] = None
    try:
        writer.finish_previous()
    except Exception as err:  # noqa: BLE001 - every rank raises it (they agreed on it in the writer)
        error = err
    distributed.raise_on_every_rank(error, "CheckpointHandler writing a checkpoint in the background")
    group = distributed.side_group()  # (created at the first save: every rank is here)
    path = _absolute(path)
    tmp = begin_sharded(path)
    local, specs = _local_shards(state)

    def write(staged: Any) -> None:
        write_sharded(_sharded_again(staged[0], specs), staged[1], path, tmp, group)
        if then is not None:
            with distributed.on_group(group):
                then()

    writer.submit((local, rank_state), write)


# -- the DTensors of handler states ---------------------------------------------------------------
def _handler_key(path: tuple) -> str:
    """The DCP key (after ``handlers.``) of a handler state's tensor at ``path`` (its name first)."""
    return ".".join(str(part) for part in path)


def _split_handler_tensors(snapshot: dict[str, Any]) -> tuple[dict[str, Any], dict[str, DTensor]]:
    """``snapshot`` with every DTensor of a handler state replaced by ``{IN_DCP: key}``, and those
    DTensors by key (what DCP writes under ``handlers.``)."""
    from torch.distributed.tensor import DTensor  # heavy: only for a sharded checkpoint

    tensors: dict[str, DTensor] = {}

    def walk(value: Any, path: tuple) -> Any:
        if isinstance(value, DTensor):
            key = _handler_key(path)
            tensors[key] = value
            return {IN_DCP: key}
        if isinstance(value, dict):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*path, i)) for i, v in enumerate(value))
        return value

    handlers = {name: walk(state, (name,)) for name, state in snapshot.get("handlers", {}).items()}
    return ({**snapshot, "handlers": handlers} if tensors else snapshot), tensors


def _meta_in_place_of(snapshot: Any, saved: dict[str, tuple[tuple[int, ...], torch.dtype]], source: str) -> Any:
    """A rank's snapshot read back: each ``{IN_DCP: key}`` replaced by an empty tensor on the meta
    device of the saved global shape and dtype."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict) and len(value) == 1 and IN_DCP in value:
            key = value[IN_DCP]
            if key not in saved:
                raise CheckpointError(f"{source} holds no tensor handlers.{key}, which a handler state refers to")
            shape, dtype = saved[key]
            return torch.empty(shape, dtype=dtype, device="meta")
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("handlers"), dict):
        return snapshot  # validate() names what is wrong
    return {**snapshot, "handlers": walk(snapshot["handlers"])}


def restore_handler_tensors(estimator: ResumableFit, payload: dict[str, Any]) -> None:
    """Load the handler tensors of a sharded checkpoint into this fit's own (a collective: every
    rank loads its slices, on any world size): each meta tensor in the snapshot this rank resumes
    is replaced by a tensor laid out as the fit's at the same place of the same handler's state
    (from ``state_payload(gather=False)``: on this world size, its shards), filled from DCP's
    files, which the handler's ``load_state_dict`` then takes as it resumes (as it takes a
    file's: nothing of the handler changes before).

    Raises:
        CheckpointError: this fit has no such tensor, or one of another shape or dtype.
    """
    path = payload.get(SHARDED)
    if path is None or not sharded_tensors(path, HANDLERS):
        return  # (its metadata, read once more: small)
    snapshot = rank_snapshot(payload, distributed.get_rank())
    part = estimator.state_payload(gather=False)
    assert part is not None, "gather=False gives every rank its own part"
    live = part["snapshot"]["handlers"]
    targets: dict[str, torch.Tensor] = {}
    places: list[tuple[Any, Any, str]] = []

    def walk(value: Any, current: Any, path: tuple) -> None:
        items = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, list) else ()
        for k, v in items:
            where = (*path, k)
            mine = current.get(k) if isinstance(current, dict) else \
                current[k] if isinstance(current, (list, tuple)) and k < len(current) else None
            if isinstance(v, torch.Tensor) and v.is_meta:
                if not isinstance(mine, torch.Tensor):
                    raise CheckpointError(f"the state of handler {path[0]!r} holds a tensor at "
                                          f"{list(where[1:])} that this fit's handler does not have")
                targets[_handler_key(where)] = torch.empty_like(mine)  # laid out as this fit's, filled by DCP
                places.append((value, k, _handler_key(where)))
            else:
                walk(v, mine, where)

    for name, state in snapshot["handlers"].items():
        if name in live:  # a saved handler this fit has not: its state is not read
            walk(state, live[name], (name,))
    saved = sharded_tensors(path, HANDLERS)
    for key, tensor in targets.items():
        shape, dtype = saved[key]  # (the snapshot's meta tensors came from there)
        if shape != tuple(tensor.shape) or dtype != tensor.dtype:
            raise CheckpointError(f"sharded checkpoint {path!r}: handlers.{key} is {dtype} of shape {list(shape)}; "
                                  f"this fit's is {tensor.dtype} of shape {list(tensor.shape)}")
    if targets:  # the same on every rank: the same handlers read the same snapshot layout
        load_sharded_tensors(path, {HANDLERS: targets})
    for container, k, key in places:
        container[k] = targets[key]


def _local_shards(state: Any, path: tuple = ()) -> tuple[Any, dict[tuple, DTensor]]:
    """``state`` with every DTensor replaced by its local shard (a view, no copy), and the
    DTensors by where they were (their layout, to rebuild them around the staged copies)."""
    from torch.distributed.tensor import DTensor  # heavy: only for a sharded checkpoint

    specs: dict[tuple, DTensor] = {}

    def walk(value: Any, where: tuple) -> Any:
        if isinstance(value, DTensor):
            specs[where] = value
            return value.to_local().detach()
        if isinstance(value, dict):
            return {k: walk(v, (*where, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*where, i)) for i, v in enumerate(value))
        return value

    return walk(state, path), specs


def _sharded_again(staged: Any, specs: dict[tuple, DTensor]) -> Any:
    """The staged local shards wrapped as the DTensors they were (global shape, placements, mesh),
    with no communication: what DCP plans and writes from."""
    from torch.distributed.tensor import DTensor  # heavy: only for a sharded checkpoint

    def walk(value: Any, where: tuple) -> Any:
        if where in specs:
            live = specs[where]
            if live.device_mesh.device_type == value.device.type:
                return DTensor.from_local(value, live.device_mesh, live.placements, run_check=False,
                                          shape=live.shape, stride=live.stride())
            # a GPU mesh: from_local would copy the staged shard back to the GPU
            return DTensor(value, live._spec, requires_grad=False)
        if isinstance(value, dict):
            return {k: walk(v, (*where, k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*where, i)) for i, v in enumerate(value))
        return value

    return walk(staged, ())


def _checked_version(part: Any, source: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise CheckpointError(f"{source} is not part of an estimatorch checkpoint")
    version = part.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{source} has format version {version!r}; this estimatorch reads sharded "
                              f"checkpoints of format {FORMAT_VERSION}")
    return part


def read_sharded_payload(path: PathLike) -> dict[str, Any]:
    """The run's part of the sharded checkpoint at ``path`` as a payload (no tensor is read).

    Raises:
        CheckpointError: the directory is incomplete or damaged, naming it and the reason.
    """
    path = _absolute(path)
    marker = check_sharded(path)
    common = _checked_version(read_part(os.path.join(path, _COMMON)), repr(os.path.join(path, _COMMON)))
    ranks = [_checked_version(read_rank_state(path, rank), f"rank {rank}'s file in {path!r}")
             for rank in range(marker["world_size"])]
    handler_tensors = sharded_tensors(path, HANDLERS)
    payload = {
        "format_version": FORMAT_VERSION,
        "estimatorch_version": marker.get("estimatorch_version"),
        "torch_version": marker.get("torch_version"),
        "world_size": marker["world_size"],
        "model": None,  # in DCP's files: checked against the metadata, loaded by restore
        "optimizer": common.get("optimizer"),  # its tensors are None here
        "optimizer_class": common.get("optimizer_class"),
        "lr_scheduler": ranks[0].get("lr_scheduler"),
        "grad_scaler": ranks[0].get("grad_scaler"),
        "ranks": [_meta_in_place_of(part.get("snapshot"), handler_tensors, repr(path)) for part in ranks],
        SHARDED: path,
    }
    validate(payload, source=repr(path))
    return payload


def read_checkpoint(path: PathLike) -> dict[str, Any]:
    """A checkpoint's payload: a file loaded (:func:`~estimatorch.checkpoint.load`), or a sharded
    checkpoint directory's run part (:func:`read_sharded_payload`)."""
    return read_sharded_payload(path) if is_directory(path) else load(path)


def digest_of(path: PathLike) -> str:
    """What ranks compare to know they read the same checkpoint: a file's bytes, or a sharded
    directory's marker and metadata."""
    return sharded_digest(path) if is_directory(path) else file_digest(path)


def version_of(path: PathLike) -> Optional[int]:
    """The format version of a checkpoint file or sharded directory; None when unreadable (a
    directory without its marker included). A sharded layout newer than this library's reads
    as a newer format."""
    if not is_directory(path):
        return read_format_version(path)
    try:
        sharded_marker(path)
    except NewerFormatError:
        return FORMAT_VERSION + 1
    except CheckpointError:
        return None
    return FORMAT_VERSION
