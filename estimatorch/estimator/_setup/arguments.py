"""Argument checks for ``Estimator`` and ``fit``: each names the argument and the value, and
runs before any step and before any file is written."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Optional, Union, cast

import torch
from torch import nn

from ... import distributed
from ..._checks import check_bool, check_positive_int, is_int
from ...events import handler_name
from .eval_sets import eval_sets

__all__ = ["PRECISIONS", "check_fit_arguments", "check_iterable", "check_limits", "check_lr_scheduler",
           "check_flags", "check_optimizer", "check_unique_handlers", "precision_name", "resolve_device"]

#: canonical precision name -> autocast dtype (None: no autocast).
PRECISIONS = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_ALIASES = {"bf16": "bf16-mixed", "fp16": "16-mixed", "16": "16-mixed"}


def check_iterable(value: Any, arg: str, *, reread: bool = False) -> None:
    """An iterable of batches; with ``reread``, one that can be read more than once and is not
    known to be empty (checked without iterating it)."""
    if isinstance(value, (torch.Tensor, str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{arg} must be an iterable of batches (a DataLoader, a list...), got {type(value).__name__}")
    if not reread:
        return
    if isinstance(value, Iterator):
        raise TypeError(f"{arg} is an iterator ({type(value).__name__}), which can be read only once; "
                        "pass a list or a DataLoader")
    try:
        empty = len(cast(Sized, value)) == 0
    except TypeError:  # no length (e.g. a DataLoader over an IterableDataset)
        empty = False
    if empty:
        raise ValueError(f"{arg} is empty: a {type(value).__name__} of length 0")


def precision_name(precision: Union[str, int]) -> str:
    """The canonical name of ``precision``: ``'bf16'`` -> ``'bf16-mixed'``, ``'fp16'`` and ``'16'``
    (or the int ``16``) -> ``'16-mixed'``; the int ``32`` -> ``'32'``.

    Example:
        >>> precision_name("bf16"), precision_name(16), precision_name("32")
        ('bf16-mixed', '16-mixed', '32')
    """
    if isinstance(precision, bool) or not isinstance(precision, (str, int)):
        raise ValueError(f"precision must be one of {_choices()}, got {precision!r}")
    name = _ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {_choices()}, got {precision!r}")
    return name


def _choices() -> list[str]:
    return [*PRECISIONS, *(a for a in _ALIASES if a not in PRECISIONS)]


def resolve_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device`` this machine can train on (CUDA for this process's local
    rank, else the CPU, when None)."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", distributed.get_local_rank() % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be a torch.device, a device string or None, got {device!r}") from err
    kind = resolved.type
    if kind == "meta":
        raise ValueError(f"device={device!r} holds no data (shapes only): training needs a real device such as "
                         "'cpu' or 'cuda'")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        elif resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
        return resolved
    if kind != "cpu" and not _available(resolved):
        raise ValueError(f"device={device!r} but {kind!r} is not available in this torch build or on this machine")
    return resolved


def _available(device: torch.device) -> bool:
    """Whether ``device`` can hold a tensor: the backend's own ``is_available()`` where torch has
    one (``torch.mps``, ``torch.xpu``, ...), else a zero-size allocation."""
    backend = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        return False
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError, ValueError, ImportError):  # 'not here', many ways
        return False
    return True


def check_estimator_arguments(net: Any, loss: Any, val_net: Any, val_loss: Any, optimizer: Any,
                              batch_processor: Any) -> None:
    """The types of ``Estimator``'s arguments, and an optimizer that trains the net."""
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be callable, e.g. torch.nn.CrossEntropyLoss(), or None (the model computes "
                        f"its own loss), got {loss!r}")
    if val_net is not None and not isinstance(val_net, nn.Module):
        raise TypeError(f"val_net must be a torch.nn.Module or None, got {type(val_net).__name__}")
    if val_loss is not None and not callable(val_loss):
        raise TypeError(f"val_loss must be callable or None, got {val_loss!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    check_optimizer(optimizer, net)
    if batch_processor is not None and not all(
            callable(getattr(batch_processor, m, None)) for m in ("fit_batch", "evaluate_batch")):
        raise TypeError(f"batch_processor must have fit_batch and evaluate_batch methods, got {batch_processor!r}")


def check_flags(**flags: Any) -> None:
    """``Estimator``'s boolean switches (by name) are bools, and not contradictory."""
    for name, value in flags.items():
        check_bool(value, name)
    if flags.get("deterministic") and flags.get("cudnn_benchmark"):
        raise ValueError("deterministic=True and cudnn_benchmark=True contradict each other; choose one")
    if flags.get("world_size_invariant") and flags.get("cuda_graphs"):
        raise ValueError("world_size_invariant=True and cuda_graphs=True cannot be combined: the invariant step "
                         "folds each micro-batch's gradient on the host's schedule, which a CUDA graph cannot "
                         "record; choose one")


def check_optimizer(optimizer: Optional[torch.optim.Optimizer], net: nn.Module) -> None:
    """An optimizer over none of ``net``'s trainable parameters trains nothing of it: refused.
    Parameters of other modules beside some of the net's (a loss with weights, a second module
    a custom BatchProcessor trains) are fine."""
    if optimizer is None:
        return
    own = {id(p) for p in net.parameters() if p.requires_grad}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if own and not any(id(p) in own for p in held):
        raise ValueError(
            f"optimizer holds {len(held)} parameter(s), none of them net's ({type(net).__name__}): it was built "
            "over another module's parameters (an earlier copy of the net?), so fit would train nothing. "
            "Build it from this net: torch.optim.SGD(net.parameters(), ...)")


def check_unique_handlers(handlers: Sequence[Any], arg: str = "event_handlers") -> None:
    """The same handler instance passed twice would receive every event twice."""
    seen: dict[int, int] = {}
    for i, handler in enumerate(handlers):
        first = seen.setdefault(id(handler), i)
        if first != i:
            raise ValueError(f"{arg} holds the same {handler_name(handler)} instance twice (positions {first} "
                             f"and {i}): it would receive every event twice. Pass it once, or two instances")


def check_fit_arguments(train_data: Any, val_data: Any, epochs: Any, batches: Any, batch_axis: Any,
                        resume: Any) -> None:
    """``fit``'s own arguments (the handlers and the estimator are checked after)."""
    if (epochs is None) == (batches is None):
        raise ValueError(f"pass exactly one of epochs and batches, got epochs={epochs!r} and batches={batches!r}")
    check_positive_int(epochs, "epochs", allow_none=True)
    check_positive_int(batches, "batches", allow_none=True)
    if not is_int(batch_axis) or batch_axis < 0:
        raise ValueError(f"batch_axis must be a non-negative int, got {batch_axis!r}")
    check_bool(resume, "resume")
    sets = eval_sets(val_data)
    for name, data in (sets.items() if sets is not None else [(None, val_data)] if val_data is not None else []):
        check_iterable(data, "val_data" if name is None else f"val_data[{name!r}]", reread=True)
    if epochs is not None and epochs > 1 and isinstance(train_data, Iterator):
        raise TypeError(f"train_data is an iterator ({type(train_data).__name__}), which can be read only "
                        f"once, but epochs={epochs}; pass a list or a DataLoader, or train with batches=")


def check_lr_scheduler(lr_scheduler: Any, optimizer: Any, interval: Any) -> tuple[Any, Any, str]:
    """``Estimator``'s ``lr_scheduler`` and ``lr_scheduler_interval``: returns ``(scheduler,
    factory, interval)``, one of the first two None (both without a schedule). A scheduler must
    be one of ``optimizer``; a factory is any other callable, ``(optimizer, total_steps) ->
    scheduler``. An interval of None is a factory's unit, ``"batch"`` (its ``total_steps`` are
    optimizer steps, as ``transformers``' ``get_*_schedule_with_warmup`` count them), and
    ``"epoch"`` for a scheduler (PyTorch's convention: ``scheduler.step()`` after each epoch)."""
    if interval not in (None, "epoch", "batch"):
        raise ValueError(f"lr_scheduler_interval must be 'epoch' or 'batch' (or None: 'batch' for a callable "
                         f"lr_scheduler, 'epoch' for a scheduler), got {interval!r}")
    if lr_scheduler is None:
        return None, None, interval or "epoch"
    if all(callable(getattr(lr_scheduler, method, None)) for method in ("step", "state_dict")):
        if getattr(lr_scheduler, "optimizer", None) is not optimizer:
            raise ValueError("lr_scheduler must schedule this estimator's optimizer")
        return lr_scheduler, None, interval or "epoch"
    if callable(lr_scheduler):
        _check_factory_arity(lr_scheduler)
        return None, lr_scheduler, interval or "batch"
    raise TypeError("lr_scheduler must be a torch LR scheduler or a callable (optimizer, total_steps) -> "
                    f"scheduler, got {lr_scheduler!r}")


def _check_factory_arity(factory: Callable[..., Any]) -> None:
    """A factory ``fit`` will call as ``factory(optimizer, total_steps)``: one that cannot take
    two positional arguments (``lambda optimizer: ...``) is refused now, not at fit start."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: fit will tell
        return
    try:
        signature.bind(None, 0)
    except TypeError:
        raise TypeError(f"lr_scheduler is called as lr_scheduler(optimizer, total_steps), but {factory!r} takes "
                        f"{signature}: give it both parameters, e.g. lambda optimizer, total_steps: "
                        "torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps), or pass a "
                        "scheduler built over the optimizer") from None


def check_limits(batches_per_epoch: Any, val_batches: Any) -> None:
    """``fit``'s per-epoch limits: positive ints or None."""
    check_positive_int(batches_per_epoch, "batches_per_epoch", allow_none=True)
    check_positive_int(val_batches, "val_batches", allow_none=True)
