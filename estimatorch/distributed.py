"""Process groups, torchrun detection, a spawn launcher for one machine, and the collectives
estimatorch needs.

Every function works without ``torch.distributed`` initialised: a single process is rank 0 of a
world of size 1, and the collectives return their input.

Launching:

- ``torchrun --nproc-per-node=N script.py``: call :func:`init_from_env` (``fit`` does it for you
  when torchrun's variables are set and no process group exists yet).
- :func:`spawn` starts ``nprocs`` processes on this machine and initialises the group in each.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist

__all__ = [
    "all_reduce_sum",
    "any_rank",
    "barrier",
    "broadcast_object",
    "collective_device",
    "gather_objects",
    "gather_to_main",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_from_env",
    "is_distributed",
    "is_main_process",
    "NullWriter",
    "rank_zero_writer",
    "spawn",
    "torchrun_env",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """The global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def get_local_rank() -> int:
    """The rank on this machine (``LOCAL_RANK``, else 0)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    """True on global rank 0: the only process that writes files, events and logs."""
    return get_rank() == 0


def torchrun_env() -> bool:
    """True when torchrun (or a compatible launcher) set the rendezvous variables."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def init_from_env(backend: Optional[str] = None) -> bool:
    """Initialise the default process group from torchrun's variables.

    Args:
        backend: Defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``.

    Returns:
        True when a group was created, False when one already existed or the variables are
        absent.
    """
    if not dist.is_available() or dist.is_initialized() or not torchrun_env():
        return False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank())
    dist.init_process_group(backend=backend)
    return True


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
        out[key] = part.reshape(ref.shape).to(device=out_device, dtype=ref.dtype if ref.is_floating_point() else torch.float64)
    return out


_FLAG_GROUP: Any = None


def _flag_group() -> Any:
    """A gloo group for host-side flags, so deciding a stop never touches the GPU."""
    global _FLAG_GROUP
    if dist.get_backend() == "gloo":
        return None
    if _FLAG_GROUP is None:
        _FLAG_GROUP = dist.new_group(backend="gloo")
    return _FLAG_GROUP


def any_rank(*flags: bool) -> Any:
    """For each flag, True on every rank when it is true on any rank (one host-side collective).

    Returns a bool for one flag, a tuple of bools for several.
    """
    if not is_distributed():
        values = tuple(bool(f) for f in flags)
    else:
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_flag_group())
        values = tuple(bool(v) for v in t.tolist())
    return values[0] if len(values) == 1 else values


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


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if is_distributed():
        dist.barrier(group=_flag_group())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(local_rank: int, fn: Callable[..., Any], nprocs: int, port: int,
                 backend: str, args: tuple) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, rank=local_rank, world_size=nprocs)
    try:
        fn(*args)
    finally:
        global _FLAG_GROUP
        _FLAG_GROUP = None
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: Optional[str] = None) -> None:
    """Run ``fn(*args)`` in ``nprocs`` processes on this machine, each in one process group.

    ``fn`` must be importable (defined at module level). Raises the first child's error.

    Args:
        fn: the function each process runs.
        nprocs: the number of processes (>= 1).
        backend: Defaults to ``"nccl"`` when there is a CUDA device per process, else ``"gloo"``.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(fn, nprocs, _free_port(), backend, args), nprocs=nprocs, join=True)


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
