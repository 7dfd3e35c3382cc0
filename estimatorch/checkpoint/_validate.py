"""Check a checkpoint against the fit that would resume from it, before anything is restored, and
restore the training state (model, optimizer, LR scheduler, grad scaler).

A sharded checkpoint's payload (``payload["sharded"]`` names its directory) holds no model or
optimizer tensors: they are checked against the directory's metadata (every name, global shape
and dtype; each parameter group's parameter names) and restored through DCP, on any number of
ranks, into a sharded net or a plain one (each reads the slices it holds, or the whole
tensors); a single file is never restored into a sharded net.

The store checks the training state itself: every model tensor's shape and dtype, the
optimizer's groups and state, the LR scheduler and grad scaler. Everything else a resume reads
(position, plan, history, data, handler and metric states, generators, and the mapping of an
elastic run onto another world size) is the estimator's, checked through its seam
(``estimator.check_payload``). Nothing here changes the estimator but
:func:`restore_training_state`.
"""

from __future__ import annotations

from typing import Any

import torch

from .._saved import MISSING, CheckpointError, check_dict, check_keys, check_like, kind, show
from ._frozen import check_frozen, load_partial_state
from ._model import is_sharded_module, model_state, plain_module
from ._seam import ResumableFit
from ._sharded import check_sharded, load_sharded, sharded_tensors
from ._sharded_run import restore_handler_tensors

__all__ = ["check_against_fit", "check_training_state", "restore_training_state"]

#: optimizer state entries that hold one value per element of their parameter (torch.optim).
_ELEMENTWISE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                          "acc_delta", "sum", "ax", "prev", "step_size", "exp_inf", "grad_avg"})


# -- the training state -----------------------------------------------------------------------------
def _check_model(net: torch.nn.Module, saved: Any, frozen: Any = None) -> None:
    saved = check_dict(saved, "the model state")
    reference = model_state(net)
    if frozen is not None:  # an adapter-only checkpoint: the frozen parameters are this net's own
        check_frozen(net, saved, frozen)
        reference = {k: v for k, v in reference.items() if k not in frozen}
    missing = [k for k in reference if k not in saved]
    extra = [k for k in saved if k not in reference]
    if missing or extra:
        words = [f"this net's {missing[:5]} {'are' if len(missing) > 1 else 'is'} missing"] if missing else []
        words += [f"{extra[:5]} {'are' if len(extra) > 1 else 'is'} not in this net"] if extra else []
        raise CheckpointError(f"the model state does not fit this net: {'; '.join(words)} "
                              "(a checkpoint of another model?)")
    for key, want in reference.items():
        have = saved[key]
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(have, torch.Tensor) or have.shape != want.shape or have.dtype != want.dtype:
            raise CheckpointError(f"model entry {key!r} is {show(have)} in the checkpoint, "
                                  f"{show(want)} in this net")


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, saved_class: Any, same_torch: bool) -> None:
    if isinstance(saved_class, str) and saved_class != type(optimizer).__name__:
        raise CheckpointError(f"the optimizer state is of a {saved_class}; this fit's optimizer is a "
                              f"{type(optimizer).__name__}")
    saved = check_dict(saved, "the optimizer state")
    groups = saved.get("param_groups", MISSING)
    if groups is MISSING or not isinstance(groups, (list, tuple)):
        raise CheckpointError(f"the optimizer state's 'param_groups' must be a list, got "
                              f"{'nothing' if groups is MISSING else show(groups)}")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the optimizer state has {len(groups)} parameter groups; this optimizer has "
                              f"{len(optimizer.param_groups)}")
    params: dict[Any, torch.Tensor] = {}
    for i, (group, current) in enumerate(zip(groups, optimizer.param_groups)):
        group = check_dict(group, f"optimizer parameter group {i}")
        ids = group.get("params", MISSING)
        if not isinstance(ids, (list, tuple)) or len(ids) != len(current["params"]):
            have = "no 'params'" if ids is MISSING else f"{len(ids)} parameters" if isinstance(ids, (list, tuple)) \
                else show(ids)
            raise CheckpointError(f"optimizer parameter group {i} has {have}; this optimizer's has "
                                  f"{len(current['params'])}")
        if same_torch:  # (an LR scheduler adds "initial_lr": its presence is checked with the scheduler)
            check_keys({k: v for k, v in group.items() if k != "initial_lr"},
                        {k: v for k, v in current.items() if k != "initial_lr"}, f"optimizer parameter group {i}")
        for key, value in current.items():
            if key != "params" and key in group:
                check_like(group[key], value, f"optimizer parameter group {i}[{key!r}]")
        params.update(zip(ids, current["params"]))
    state = check_dict(saved.get("state", MISSING), "the optimizer state's 'state'")
    for index, entry in state.items():
        if index not in params:
            raise CheckpointError(f"the optimizer state holds parameter {index!r}, which no parameter group lists")
        entry = check_dict(entry, f"optimizer state of parameter {index}")
        for key, value in entry.items():
            where = f"optimizer state of parameter {index}[{key!r}]"
            if kind(value) not in ("number", "tensor", "sequence") and value is not None:
                raise CheckpointError(f"{where} must be a tensor or a number, got {show(value)}")
            if key in _ELEMENTWISE and isinstance(value, torch.Tensor) and value.shape != params[index].shape:
                raise CheckpointError(f"{where} is {show(value)}; its parameter has shape "
                                      f"{list(params[index].shape)}")


def _check_optional(target: Any, saved: Any, attr: str, same_torch: bool) -> None:
    if (target is None) != (saved is None):
        raise CheckpointError(f"the checkpoint {'has' if saved is not None else 'has no'} {attr} state "
                              f"but the estimator {'has no' if target is None else 'has a'} {attr}")
    if target is None:
        return
    saved = check_dict(saved, f"the {attr} state")
    current = target.state_dict()
    if same_torch:
        check_keys(saved, current, f"the {attr} state of this {type(target).__name__}")
    for key, value in current.items():
        if key in saved:
            check_like(saved[key], value, f"the {attr} state[{key!r}]")


def _check_kind(net: torch.nn.Module, payload: dict[str, Any]) -> bool:
    """Whether ``payload`` is a sharded checkpoint's (a directory: any net loads one, sharded or
    not); a file is refused for a sharded net."""
    sharded = payload.get("sharded") is not None
    if not sharded and is_sharded_module(net):
        raise CheckpointError("it was written by a fit of a net that was not sharded and this net is sharded "
                              "(FSDP2): resume it with strategy='ddp', or start the sharded run in another model_dir")
    return sharded


def _check_sharded_state(net: torch.nn.Module, optimizer: torch.optim.Optimizer, payload: dict[str, Any]) -> None:
    """A sharded checkpoint's model and optimizer tensors (from its metadata) against ``net`` and
    ``optimizer``: every name, global shape and dtype, and each group's parameter names."""
    path = payload["sharded"]
    check_sharded(path, {"model": dict(model_state(net))})
    names = {id(p): name for name, p in plain_module(net).named_parameters()}
    saved = check_dict(payload["optimizer"], "the optimizer state")
    groups = saved.get("param_groups")
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        have = len(groups) if isinstance(groups, (list, tuple)) else "no"
        raise CheckpointError(f"the optimizer state has {have} parameter groups; this optimizer has "
                              f"{len(optimizer.param_groups)}")
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (group, current) in enumerate(zip(groups, optimizer.param_groups)):
        wanted = [names.get(id(p), "?") for p in current["params"]]
        saved_names = group.get("params") if isinstance(group, dict) else None
        if not isinstance(saved_names, (list, tuple)) or list(saved_names) != wanted:
            listed = list(saved_names[:5]) if isinstance(saved_names, (list, tuple)) else show(group)
            raise CheckpointError(f"optimizer parameter group {i} holds the parameters {listed}; this "
                                  f"optimizer's holds {wanted[:5]}{' ...' if len(wanted) > 5 else ''}")
        shapes.update((names[id(p)], tuple(p.shape)) for p in current["params"] if id(p) in names)
    for key, (shape, _) in sharded_tensors(path, "optimizer").items():
        parts = key.split(".")  # state.{parameter name}.{entry}
        name, entry = ".".join(parts[1:-1]), parts[-1]
        if parts[0] == "state" and entry in _ELEMENTWISE and name in shapes and shape != shapes[name]:
            raise CheckpointError(f"optimizer state of {name}[{entry!r}] has shape {list(shape)}; its parameter "
                                  f"has shape {list(shapes[name])}")


def check_training_state(estimator: ResumableFit, payload: dict[str, Any]) -> None:
    """Check model, optimizer, LR scheduler and grad scaler states against ``estimator``.

    Raises:
        CheckpointError: saying what does not fit, in words.
    """
    same_torch = payload.get("torch_version") == str(torch.__version__)
    if _check_kind(estimator.net, payload):
        _check_sharded_state(estimator.net, estimator.optimizer, payload)
        if isinstance(payload.get("optimizer_class"), str) \
                and payload["optimizer_class"] != type(estimator.optimizer).__name__:
            raise CheckpointError(f"the optimizer state is of a {payload['optimizer_class']}; this fit's "
                                  f"optimizer is a {type(estimator.optimizer).__name__}")
        _check_optional(estimator.lr_scheduler, payload["lr_scheduler"], "lr_scheduler", same_torch)
        _check_optional(estimator.grad_scaler, payload["grad_scaler"], "grad_scaler", same_torch)
        return
    _check_model(estimator.net, payload["model"], payload.get("frozen"))
    _check_optional(estimator.lr_scheduler, payload["lr_scheduler"], "lr_scheduler", same_torch)
    _check_optional(estimator.grad_scaler, payload["grad_scaler"], "grad_scaler", same_torch)
    _check_optimizer(estimator.optimizer, payload["optimizer"], payload.get("optimizer_class"), same_torch)


def check_against_fit(estimator: ResumableFit, payload: dict[str, Any], rank: int, source: str) -> dict[str, Any]:
    """Check everything a resume of ``estimator``'s current fit as rank ``rank`` would read from
    ``payload`` (loaded and migrated by :func:`~estimatorch.checkpoint.load`), without changing
    anything: the run's state through ``estimator.check_payload`` (which maps the payload of an
    elastic run onto this world size), then the training state.

    Returns:
        the payload as the fit reads it (mapped, for an elastic fit on another world size).

    Raises:
        CheckpointError: naming ``source`` and what is wrong, in words.
    """
    payload = estimator.check_payload(payload, source, rank=rank)
    try:
        check_training_state(estimator, payload)
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None
    return payload


def _in_this_mode(saved: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """``saved`` (an optimizer's ``state_dict``) with each group's ``capturable`` flag and the
    kind of its learning rate (a float or a tensor) taken from ``optimizer``'s: a state saved
    by a captured step (``cuda_graphs=True``: capturable, the rate a device tensor) resumes an
    eager fit, on a GPU or on the CPU, where a capturable optimizer cannot step; the values are
    the saved ones. A captured fit makes the optimizer capturable again before its first step."""
    groups = saved.get("param_groups")
    mine = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not isinstance(mine, list) or len(groups) != len(mine):
        return saved  # check_training_state compared them already; a foreign layout loads as it is
    fitted = []
    for group, current in zip(groups, mine):
        group = dict(group)
        if "capturable" in group and "capturable" in current:
            group["capturable"] = current["capturable"]
        if isinstance(group.get("lr"), torch.Tensor) and not isinstance(current.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])  # on the CPU: read once, at the resume
        fitted.append(group)
    return {**saved, "param_groups": fitted}


def restore_training_state(estimator: ResumableFit, payload: dict[str, Any]) -> None:
    """Load model, optimizer, LR scheduler and grad scaler states into ``estimator``, after
    checking all four (nothing is loaded when one does not fit).

    Raises:
        CheckpointError: a state does not fit ``estimator``.
    """
    check_training_state(estimator, payload)
    if payload.get("sharded") is not None:  # a collective: every rank loads its slices
        from torch.distributed.checkpoint.state_dict import (  # heavy: only for a sharded checkpoint
            get_state_dict,
            set_state_dict,
        )

        model, optimizer = get_state_dict(estimator.net, estimator.optimizer)
        state, _ = load_sharded(payload["sharded"], {"model": model, "optimizer": optimizer})
        set_state_dict(estimator.net, estimator.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        restore_handler_tensors(estimator, payload)  # an EMAHandler's shards, say
    else:
        load_partial_state(estimator.net, payload["model"], payload.get("frozen"))
        estimator.optimizer.load_state_dict(_in_this_mode(payload["optimizer"], estimator.optimizer))
    for key, target in (("lr_scheduler", estimator.lr_scheduler), ("grad_scaler", estimator.grad_scaler)):
        if target is not None:
            target.load_state_dict(payload[key])
