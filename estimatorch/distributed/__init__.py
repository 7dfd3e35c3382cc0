"""Process groups, torchrun detection, a spawn launcher for one machine, the collectives
estimatorch needs, and the watch over the ranks: the room of everything distributed.

Every function works without ``torch.distributed`` initialised: a single process is rank 0 of a
world of size 1, and the collectives return their input.

Launching:

- ``torchrun --nproc-per-node=N script.py``, ``srun python script.py`` (SLURM) or a
  PyTorchJob: call :func:`init_from_env` (``fit`` does it for you when no process group exists
  yet); :mod:`estimatorch.distributed.cluster` reads the launchers' variables
  (also importable as ``estimatorch.cluster``).
- :func:`spawn` starts ``nprocs`` processes on this machine and initialises the group in each.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from . import cluster
from ._fsdp_slots import FsdpSlotReduction
from ._grad_norm import clip_by_rows_
from ._groups import gloo_group
from ._rank_watch import RankWatch, Watchdog, mark_agreed
from ._replicas import ReplicaDivergenceError, differing_ranks, gather_fingerprints, state_fingerprint, state_tensors
from ._slot_reduction import SlotReduction, slot_reduction
from ._spawn import RankFailedError, portable_exception, spawn
from ._step_items import StepItems

__all__ = ["all_reduce_max_async", "all_reduce_mean_", "all_reduce_states", "all_reduce_sum", "barrier",
           "broadcast_object", "clip_by_rows_", "collective_device", "differing_ranks", "FsdpSlotReduction",
           "gather_fingerprints", "gather_objects", "gather_to_main", "get_local_rank", "get_rank", "get_world_size",
           "init_from_env", "is_distributed", "is_main_process", "NullWriter", "on_group", "PendingMax",
           "raise_on_every_rank", "rank_zero_writer", "RankFailedError", "RankWatch", "REDUCTIONS",
           "ReplicaDivergenceError", "run_on_main", "share_outcome", "side_group", "slot_reduction", "SlotReduction",
           "spawn", "state_fingerprint", "state_tensors", "StepItems", "Watchdog"]


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """The global rank: the process group's; before one exists, the launcher's
    (:func:`estimatorch.distributed.cluster.detect`: torchrun's ``RANK``, SLURM's ``SLURM_PROCID``...; 0
    without one, or with variables that contradict each other, which ``fit`` refuses), so that
    "print on rank 0" before ``fit`` (which starts the group) prints once."""
    return dist.get_rank() if _initialized() else cluster.current().rank


def get_world_size() -> int:
    """The number of processes: the process group's; before one exists, the launcher's
    (``WORLD_SIZE``, ``SLURM_NTASKS``...; 1 without one). Collectives need :func:`is_distributed`,
    not this."""
    return dist.get_world_size() if _initialized() else cluster.current().world_size


def get_local_rank() -> int:
    """The rank on this machine: the launcher's (``LOCAL_RANK``, ``SLURM_LOCALID``, ``RANK``
    modulo ``LOCAL_WORLD_SIZE`` in a PyTorchJob), else 0."""
    return cluster.current().local_rank


def is_main_process() -> bool:
    """True on global rank 0: the only process that writes files, events and logs."""
    return get_rank() == 0


def init_from_env(backend: Optional[str] = None) -> bool:
    """Initialise the default process group from the launcher's variables: torchrun's, SLURM's
    (``srun``), a PyTorchJob's (:func:`estimatorch.distributed.cluster.init_process_group`).

    Args:
        backend: Defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``.

    Returns:
        True when a group was created, False when one already existed or no launcher started
        several processes.

    Raises:
        RuntimeError: the launcher's variables are inconsistent (named in the message).
    """
    return cluster.init_process_group(backend)


def collective_device() -> torch.device:
    """The device the default group's backend reduces on (CUDA for NCCL, else the CPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Mapping[str, Union[torch.Tensor, int, float]],
                   device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """Sum a dict of tensors and numbers over every rank in one collective.

    Every rank must call it with the same keys and shapes. Returns tensors on ``device``
    (defaults to the collective's device); the input is not modified.
    """
    keys = list(values)
    out_device = device or collective_device()
    if not is_distributed():
        return {k: torch.as_tensor(values[k], device=out_device) for k in keys}
    flat = [torch.as_tensor(values[k]).to(collective_device(), torch.float64).reshape(-1) for k in keys]
    sizes = [t.numel() for t in flat]
    packed = torch.cat(flat)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    out: dict[str, torch.Tensor] = {}
    for key, part in zip(keys, packed.split(sizes)):
        ref = torch.as_tensor(values[key])
        dtype = ref.dtype if ref.is_floating_point() else torch.float64
        out[key] = part.reshape(ref.shape).to(device=out_device, dtype=dtype)
    return out


#: the reductions :func:`all_reduce_states` knows (a metric state's ``reduce``).
REDUCTIONS = ("sum", "mean", "min", "max", "cat")


def _reduced_dtype(ref: torch.Tensor, reduction: str) -> torch.dtype:
    if reduction == "mean" and not ref.is_floating_point():
        return torch.float64
    if ref.dtype == torch.bool and reduction == "sum":
        return torch.int64
    return ref.dtype


def _local_cat(value: Any) -> Optional[torch.Tensor]:
    """A ``cat`` state as one tensor (None for an empty list)."""
    if isinstance(value, torch.Tensor):
        return value
    items = [torch.as_tensor(t) for t in value]
    return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in items]) if items else None


def all_reduce_states(values: Mapping[str, Any], reductions: Mapping[str, str],
                      device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """Reduce each value over every rank by its own reduction, in at most three collectives.

    ``reductions[key]`` is one of :data:`REDUCTIONS`:

    - ``"sum"``, ``"mean"``, ``"min"``, ``"max"``: a tensor or a python number, of the same shape
      on every rank. Sums and means travel in one ``all_reduce`` (in float64: integers are exact
      up to 2**53), maxima and (negated) minima in a second; each only when some key needs it.
      ``"mean"`` is the sum divided by the world size.
    - ``"cat"``: a tensor, or a list of tensors, concatenated along dim 0, rank 0's first (sizes
      along dim 0 may differ between ranks). All of them travel in one gather of objects through
      the host. An empty list on every rank gives ``torch.zeros(0)``.

    Every rank must call it with the same keys and reductions (as with any collective). Without
    a process group it reduces over this process alone.

    Args:
        values: ``{key: tensor, number or list of tensors}``; not modified.
        reductions: ``{key: reduction}`` for every key of ``values``.
        device: where the results go. Defaults to the collective's device.

    Returns:
        ``{key: tensor}``: ``sum``/``min``/``max`` keep the value's dtype (python ints become
        int64, floats float64), ``mean`` gives a floating dtype.

    Example:
        >>> out = all_reduce_states({"hits": 3, "best": torch.tensor(0.5), "seen": [torch.tensor([1, 2])]},
        ...                         {"hits": "sum", "best": "max", "seen": "cat"})
        >>> int(out["hits"]), float(out["best"]), out["seen"].tolist()
        (3, 0.5, [1, 2])
    """
    keys = list(values)
    for key in keys:
        if reductions.get(key) not in REDUCTIONS:
            raise ValueError(f"the reduction of {key!r} must be one of {list(REDUCTIONS)}, got {reductions.get(key)!r}")
    out_device = device or collective_device()
    world = get_world_size() if is_distributed() else 1
    out: dict[str, torch.Tensor] = {}
    for kinds, op in ((("sum", "mean"), "sum"), (("max", "min"), "max")):
        group = [k for k in keys if reductions[k] in kinds]
        if not group:
            continue
        refs = {k: torch.as_tensor(values[k]) for k in group}
        flat = [refs[k].detach().to(collective_device(), torch.float64).reshape(-1) for k in group]
        flat = [-t if reductions[k] == "min" else t for k, t in zip(group, flat)]
        packed = torch.cat(flat)
        if world > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        for key, part in zip(group, packed.split([t.numel() for t in flat])):
            reduction, ref = reductions[key], refs[key]
            if reduction == "min":
                part = -part
            elif reduction == "mean":
                part = part / world
            out[key] = part.reshape(ref.shape).to(device=out_device, dtype=_reduced_dtype(ref, reduction))
    cats = [k for k in keys if reductions[k] == "cat"]
    if cats:
        local = {k: _local_cat(values[k]) for k in cats}
        if world > 1:  # through the host: sizes may differ between ranks
            every = gather_objects({k: None if t is None else t.detach().cpu() for k, t in local.items()})
        else:
            every = [local]
        for key in cats:
            parts = [rank_values[key] for rank_values in every if rank_values[key] is not None]
            out[key] = torch.cat(parts).to(out_device) if parts else torch.zeros(0, device=out_device)
    return {k: out[k] for k in keys}


_THREAD = threading.local()  # .group: the group this thread's collectives use (see on_group)


def side_group() -> Any:
    """A gloo group of every rank for work on a background thread (a checkpoint written while
    the steps go on): its collectives never interleave with those of the training thread, which
    use the default group. Created at the first call (a collective: every rank calls it at the
    same point), then reused; None without a process group."""
    return gloo_group("side") if _initialized() else None


@contextlib.contextmanager
def on_group(group: Any) -> Iterator[None]:
    """Within the block, this thread's agreement collectives (:func:`run_on_main`,
    :func:`raise_on_every_rank`, :func:`broadcast_object`, :func:`barrier`...) run over
    ``group`` (e.g. :func:`side_group` on a writer thread); None leaves them as they are."""
    before = getattr(_THREAD, "group", None)
    _THREAD.group = group if group is not None else before
    try:
        yield
    finally:
        _THREAD.group = before


def _flag_group() -> Any:
    """A gloo group for host-side flags, so deciding a stop never touches the GPU (or this
    thread's group, see :func:`on_group`)."""
    override = getattr(_THREAD, "group", None)
    if override is not None:
        return override
    return None if dist.get_backend() == "gloo" else gloo_group("flags")


class PendingMax:
    """The result of :func:`all_reduce_max_async`: read it with :meth:`wait`."""

    __slots__ = ("_tensor", "_work", "_values")

    def __init__(self, tensor: torch.Tensor, work: Any):
        self._tensor = tensor
        self._work = work
        self._values: Optional[tuple[int, ...]] = None

    def is_completed(self) -> bool:
        """True when :meth:`wait` would return without waiting."""
        return self._values is not None or self._work is None or self._work.is_completed()

    def wait(self) -> tuple[int, ...]:
        """The maxima over every rank (waits for the collective if it is still running)."""
        if self._values is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            self._values = tuple(self._tensor.tolist())
        return self._values


def all_reduce_max_async(values: Sequence[int]) -> PendingMax:
    """Start a host-side all-reduce (MAX) of a few ints over every rank, without waiting for it.

    Every rank must call it at the same point (it is a collective). The flags travel on the CPU
    (a gloo group under NCCL), so starting and reading it never touches the GPU. Without a
    process group the result is ``values`` at once.

    Example:
        >>> all_reduce_max_async([0, 1, 2]).wait()  # a single process
        (0, 1, 2)
    """
    tensor = torch.tensor(list(values), dtype=torch.int64)
    if not is_distributed():
        return PendingMax(tensor, None)
    return PendingMax(tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_flag_group(), async_op=True))


def all_reduce_mean_(tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """Average ``tensors`` over every rank, in place, in one collective per dtype and device
    (gradients DDP did not synchronise). A no-op in a single process."""
    if not is_distributed() or not tensors:
        return
    world = dist.get_world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in bucket])
        flat.div_(world)
        dist.all_reduce(flat, group=group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from ``src`` to every rank and return it."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_flag_group())
    return box[0]


def gather_to_main(obj: Any) -> Optional[list[Any]]:
    """Every rank's object, in rank order, on global rank 0 (None elsewhere)."""
    if not is_distributed():
        return [obj]
    out: Optional[list[Any]] = [None] * get_world_size() if is_main_process() else None
    dist.gather_object(obj, out, dst=0, group=_flag_group())
    return out


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's object, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=_flag_group())
    return out


def share_outcome(error: Optional[BaseException]) -> Optional[tuple[int, BaseException]]:
    """Agree on whether a step every rank took went well, so that a failure on one rank is an
    error on every rank instead of a hang in the next collective.

    Every rank passes the exception it met (or None). Every rank gets ``(rank, exception)`` of the
    lowest rank that failed (that rank its own exception object, the others a copy, or a
    ``RuntimeError`` with its text when it cannot be pickled), or None when every rank
    succeeded. One small collective (nothing without a process group). The exception is marked
    as an agreed outcome, as is any error raised from it: the rank watch does not report it as
    one rank's failure.

    Example:
        >>> share_outcome(None) is None
        True
        >>> share_outcome(ValueError("bad"))
        (0, ValueError('bad'))
    """
    if not is_distributed():
        return None if error is None else (0, error)
    rank = get_rank()
    sent = None
    if error is not None:
        sent = portable_exception(error) or RuntimeError(f"{type(error).__name__}: {error}")
    outcomes = gather_objects(sent)
    for failed, exception in enumerate(outcomes):
        if exception is not None:  # every rank knows of it: none waits for another (distributed/_rank_watch.py)
            return failed, mark_agreed(error if failed == rank and error is not None else exception)
    return None


def raise_on_every_rank(error: Optional[BaseException], what: str = "a step every rank took") -> None:
    """Raise on every rank when any rank met an error (:func:`share_outcome`, one small
    collective; without a process group it raises ``error`` itself, if any).

    The rank that failed raises its own exception (traceback kept); every other rank raises a copy
    of it, with a note (Python 3.11+) naming the rank that failed and ``what`` it was doing.

    Example:
        >>> raise_on_every_rank(None)  # nothing failed anywhere: returns
    """
    failure = share_outcome(error)
    if failure is None:
        return
    rank, exception = failure  # (marked as agreed by share_outcome)
    if exception is error:
        raise exception
    if hasattr(exception, "add_note"):
        exception.add_note(f"{what}: rank {rank} failed with this error (a copy of it); this rank stops too")
    raise exception


_T = TypeVar("_T")


def run_on_main(fn: Callable[[], _T], what: str) -> Optional[_T]:
    """Run ``fn()`` on global rank 0 only (a file write, a directory check) and agree on the
    outcome: rank 0 gets its result and the other ranks None, or every rank raises its error
    (:func:`raise_on_every_rank`, one small collective). Every rank must call it.

    Example:
        >>> run_on_main(lambda: 42, "a test")
        42
    """
    result: Optional[_T] = None
    error: Optional[BaseException] = None
    if is_main_process():
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - every rank must hear of it
            error = err
    raise_on_every_rank(error, what)
    return result


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier(group=_flag_group())


_W = TypeVar("_W")


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


class NullWriter:
    """A writer that does nothing: what :func:`rank_zero_writer` gives every rank but 0.

    Every method call (``add_scalar``, ``add_histogram``, ``flush``, ``close``...) is accepted
    and ignored, so code that writes runs unchanged on every rank (QuantLab's *writer stub*).

    Example:
        >>> NullWriter().add_scalar("loss", 0.5, 1) is None
        True
    """

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _ignore

    def __repr__(self) -> str:
        return "NullWriter()"


def rank_zero_writer(factory: Callable[[], _W]) -> Union[_W, NullWriter]:
    """``factory()`` on global rank 0, a :class:`NullWriter` on every other rank.

    The one place where writers (TensorBoard event files, ...) are gated by rank: other ranks
    never call ``factory``, so they create no file, and their writes do nothing.

    Args:
        factory: creates the real writer, e.g. ``lambda: SummaryWriter(log_dir)``.

    Example:
        >>> rank_zero_writer(lambda: "a real writer")  # rank 0 of a single process
        'a real writer'
    """
    return factory() if is_main_process() else NullWriter()
