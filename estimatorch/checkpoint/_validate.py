"""Check a checkpoint against the fit that would resume from it, before anything is restored.

Every key the restore reads is checked: types (a string where a number belongs), every model
tensor's shape and dtype, the optimizer's groups and state, the LR scheduler and grad scaler,
the position, plan, history, data and metric states, the handler entries this fit loads, and
the RNG states. Nothing here changes the estimator. The data fingerprint and the plan are the
estimator's to check (``Estimator.request_resume``).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from .. import rng
from ._format import CheckpointError, rank_snapshot
from ._model import load_model_state, model_state

__all__ = ["check_against_fit", "check_training_state", "restore_training_state"]

#: optimizer state entries that hold one value per element of their parameter (torch.optim).
_ELEMENTWISE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
                          "acc_delta", "sum", "ax", "prev", "step_size", "exp_inf", "grad_avg"})
_PHASES = ("start", "batch_end", "epoch_end")
#: what the estimator reads from a saved position (a newer field may be absent from older files).
_POSITION_KEYS = ("epoch", "batch", "step", "phase", "stop")
_PLAN_KEYS = ("epochs", "batches")
_MISSING = object()


# -- words ----------------------------------------------------------------------------------------
def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}"
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def _kind(value: Any) -> str:
    if isinstance(value, numbers.Number):
        return "number"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (str, bytes)):
        return "text"
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return type(value).__name__


_WORDS = {"number": "a number", "tensor": "a tensor or a number", "text": "a string", "dict": "a dict",
          "sequence": "a list or tuple"}


def _check_like(saved: Any, current: Any, where: str) -> None:
    """``saved`` may take the place of ``current``: the same kind of value (numbers and tensors
    stand for each other); None on either side is accepted (an unset value)."""
    if saved is None or current is None:
        return
    have, want = _kind(saved), _kind(current)
    if have == want or {have, want} == {"number", "tensor"}:
        return
    raise CheckpointError(f"{where} must be {_WORDS.get(want, 'a ' + want)}, got {_show(saved)}")


def _check_count(value: Any, where: str) -> None:
    if value is _MISSING:
        raise CheckpointError(f"{where} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{where} must be a non-negative int, got {_show(value)}")


def _check_dict(value: Any, where: str) -> dict:
    if value is _MISSING:
        raise CheckpointError(f"{where} is missing")
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{where} must be a dict, got {_show(value)}")
    return dict(value)


def _check_keys(saved: Mapping, current: Mapping, where: str) -> None:
    missing = [k for k in current if k not in saved]
    extra = [k for k in saved if k not in current]
    if missing or extra:
        parts = ([f"lacks {missing[:5]}"] if missing else []) + ([f"has unknown {extra[:5]}"] if extra else [])
        raise CheckpointError(f"{where} {' and '.join(parts)}")


# -- the training state -----------------------------------------------------------------------------
def _check_model(net: torch.nn.Module, saved: Any) -> None:
    saved = _check_dict(saved, "the model state")
    reference = model_state(net)
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
            raise CheckpointError(f"model entry {key!r} is {_show(have)} in the checkpoint, "
                                  f"{_show(want)} in this net")


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, saved_class: Any, same_torch: bool) -> None:
    if isinstance(saved_class, str) and saved_class != type(optimizer).__name__:
        raise CheckpointError(f"the optimizer state is of a {saved_class}; this fit's optimizer is a "
                              f"{type(optimizer).__name__}")
    saved = _check_dict(saved, "the optimizer state")
    groups = saved.get("param_groups", _MISSING)
    if groups is _MISSING or not isinstance(groups, (list, tuple)):
        raise CheckpointError(f"the optimizer state's 'param_groups' must be a list, got "
                              f"{'nothing' if groups is _MISSING else _show(groups)}")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the optimizer state has {len(groups)} parameter groups; this optimizer has "
                              f"{len(optimizer.param_groups)}")
    params: dict[Any, torch.Tensor] = {}
    for i, (group, current) in enumerate(zip(groups, optimizer.param_groups)):
        group = _check_dict(group, f"optimizer parameter group {i}")
        ids = group.get("params", _MISSING)
        if not isinstance(ids, (list, tuple)) or len(ids) != len(current["params"]):
            have = "no 'params'" if ids is _MISSING else f"{len(ids)} parameters" if isinstance(ids, (list, tuple)) \
                else _show(ids)
            raise CheckpointError(f"optimizer parameter group {i} has {have}; this optimizer's has "
                                  f"{len(current['params'])}")
        if same_torch:  # (an LR scheduler adds "initial_lr": its presence is checked with the scheduler)
            _check_keys({k: v for k, v in group.items() if k != "initial_lr"},
                        {k: v for k, v in current.items() if k != "initial_lr"}, f"optimizer parameter group {i}")
        for key, value in current.items():
            if key != "params" and key in group:
                _check_like(group[key], value, f"optimizer parameter group {i}[{key!r}]")
        params.update(zip(ids, current["params"]))
    state = _check_dict(saved.get("state", _MISSING), "the optimizer state's 'state'")
    for index, entry in state.items():
        if index not in params:
            raise CheckpointError(f"the optimizer state holds parameter {index!r}, which no parameter group lists")
        entry = _check_dict(entry, f"optimizer state of parameter {index}")
        for key, value in entry.items():
            where = f"optimizer state of parameter {index}[{key!r}]"
            if _kind(value) not in ("number", "tensor", "sequence") and value is not None:
                raise CheckpointError(f"{where} must be a tensor or a number, got {_show(value)}")
            if key in _ELEMENTWISE and isinstance(value, torch.Tensor) and value.shape != params[index].shape:
                raise CheckpointError(f"{where} is {_show(value)}; its parameter has shape "
                                      f"{list(params[index].shape)}")


def _check_optional(target: Any, saved: Any, attr: str, same_torch: bool) -> None:
    if (target is None) != (saved is None):
        raise CheckpointError(f"the checkpoint {'has' if saved is not None else 'has no'} {attr} state "
                              f"but the estimator {'has no' if target is None else 'has a'} {attr}")
    if target is None:
        return
    saved = _check_dict(saved, f"the {attr} state")
    current = target.state_dict()
    if same_torch:
        _check_keys(saved, current, f"the {attr} state of this {type(target).__name__}")
    for key, value in current.items():
        if key in saved:
            _check_like(saved[key], value, f"the {attr} state[{key!r}]")


def check_training_state(estimator: Any, payload: dict[str, Any]) -> None:
    """Check model, optimizer, LR scheduler and grad scaler states against ``estimator``.

    Raises:
        CheckpointError: saying what does not fit, in words.
    """
    same_torch = payload.get("torch_version") == str(torch.__version__)
    _check_model(estimator.net, payload["model"])
    _check_optional(estimator.lr_scheduler, payload["lr_scheduler"], "lr_scheduler", same_torch)
    _check_optional(estimator.grad_scaler, payload["grad_scaler"], "grad_scaler", same_torch)
    _check_optimizer(estimator.optimizer, payload["optimizer"], payload.get("optimizer_class"), same_torch)


# -- one rank's snapshot ------------------------------------------------------------------------------
def _check_position(position: Any, reference: dict[str, Any], where: str) -> None:
    position = _check_dict(position, where)
    missing = [key for key in _POSITION_KEYS if key not in position]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    unknown = [key for key in position if key not in reference]
    if unknown:
        raise CheckpointError(f"{where} has unknown {unknown}")
    for key in ("epoch", "batch", "step"):
        _check_count(position[key], f"{where}[{key!r}]")
    if position["phase"] not in _PHASES:
        raise CheckpointError(f"{where}['phase'] must be one of {list(_PHASES)}, got {_show(position['phase'])}")
    if not isinstance(position["stop"], bool):
        raise CheckpointError(f"{where}['stop'] must be a bool, got {_show(position['stop'])}")


def _check_plan(plan: Any) -> None:
    plan = _check_dict(plan, "plan")
    missing = [key for key in _PLAN_KEYS if key not in plan]
    if missing:
        raise CheckpointError(f"plan lacks {missing}")
    for key, value in plan.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise CheckpointError(f"plan[{key!r}] must be a positive int or None, got {_show(value)}")


def _check_history(history: Any) -> None:
    history = _check_dict(history, "history")
    epochs, values = history.get("epochs", _MISSING), history.get("values", _MISSING)
    if not isinstance(epochs, (list, tuple)) or not all(isinstance(e, int) and not isinstance(e, bool) for e in epochs):
        raise CheckpointError(f"history['epochs'] must be a list of ints, got "
                              f"{'nothing' if epochs is _MISSING else _show(epochs)}")
    for name, series in _check_dict(values, "history['values']").items():
        if not isinstance(series, (list, tuple)) or any(_kind(v) != "number" for v in series):
            raise CheckpointError(f"history['values'][{name!r}] must be a list of numbers, got {_show(series)}")


def _check_rng(state: Any) -> None:
    state = _check_dict(state, "rng")
    reference = rng.get_state(cuda=False)
    _check_keys({k: v for k, v in state.items() if k != "cuda"}, reference, "rng")
    python, want = state["python"], reference["python"]
    if not (isinstance(python, (list, tuple)) and len(python) == 3 and isinstance(python[0], int)
            and isinstance(python[1], (list, tuple)) and len(python[1]) == len(want[1])
            and all(isinstance(x, int) for x in python[1]) and (python[2] is None or isinstance(python[2], float))):
        raise CheckpointError(f"rng['python'] is not a state of python's random module: {_show(python)}")
    torch_state, want_torch = state["torch"], reference["torch"]
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8 \
            or torch_state.shape != want_torch.shape:
        raise CheckpointError(f"rng['torch'] must be {_show(want_torch)}, got {_show(torch_state)}")
    numpy_state, want_numpy = _check_dict(state["numpy"], "rng['numpy']"), reference["numpy"]
    if numpy_state.get("bit_generator") != want_numpy["bit_generator"]:
        raise CheckpointError(f"rng['numpy'] is a state of {numpy_state.get('bit_generator')!r}, "
                              f"expected {want_numpy['bit_generator']!r}")
    _check_keys(numpy_state, want_numpy, "rng['numpy']")
    inner = _check_dict(numpy_state["state"], "rng['numpy']['state']")
    _check_keys(inner, want_numpy["state"], "rng['numpy']['state']")
    for key, value in [*inner.items(), ("has_uint32", numpy_state["has_uint32"]), ("uinteger", numpy_state["uinteger"])]:
        if isinstance(value, bool) or not isinstance(value, int):
            raise CheckpointError(f"rng['numpy'] entry {key!r} must be an int, got {_show(value)}")
    cuda = state.get("cuda")
    if cuda is not None:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not isinstance(cuda, (list, tuple)) or not all(
                isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
            raise CheckpointError(f"rng['cuda'] must be a list of uint8 tensors, got {_show(cuda)}")
        if len(cuda) != have:
            raise CheckpointError(f"rng['cuda'] holds {len(cuda)} CUDA generator states but this process sees "
                                  f"{have} CUDA devices")


def _check_handlers(saved: dict[str, Any], handlers: Mapping[str, Any]) -> None:
    for name, handler in handlers.items():
        if name not in saved or not callable(getattr(handler, "load_state_dict", None)):
            continue  # a handler without saved state starts fresh (the estimator warns)
        attrs = getattr(handler, "_state_attrs", None)
        if not attrs:
            continue  # a handler of yours: its load_state_dict is the judge
        state = _check_dict(saved[name], f"the state of handler {name!r}")
        for attr in attrs:
            if attr not in state:
                raise CheckpointError(f"the state of handler {name!r} lacks {attr!r}")
            _check_like(state[attr], getattr(handler, attr, None), f"the state of handler {name!r}[{attr!r}]")


def _check_metrics(saved: Any, metrics: list[Any]) -> None:
    from ..metrics.base import Metric, metric_name

    saved = _check_dict(saved, "metrics")
    for metric in metrics:
        name = metric_name(metric)
        if name not in saved or not callable(getattr(metric, "load_state_dict", None)):
            continue
        state = _check_dict(saved[name], f"the state of metric {name!r}")
        if not isinstance(metric, Metric):
            continue
        for attr, default in metric._defaults.items():
            if attr not in state:
                raise CheckpointError(f"the state of metric {name!r} lacks {attr!r}")
            _check_like(state[attr], default, f"the state of metric {name!r}[{attr!r}]")
        if not isinstance(state.get("pending", []), (list, tuple)):
            raise CheckpointError(f"the state of metric {name!r}['pending'] must be a list, got {_show(state['pending'])}")


def _check_snapshot(estimator: Any, snapshot: dict[str, Any]) -> None:
    run = estimator._run
    _check_plan(snapshot["plan"])
    for key in ("partial", "evaluated"):
        if not isinstance(snapshot[key], bool):
            raise CheckpointError(f"{key!r} must be a bool, got {_show(snapshot[key])}")
    if not isinstance(snapshot.get("pending_stop", False), bool):  # absent in files of earlier versions
        raise CheckpointError(f"'pending_stop' must be a bool, got {_show(snapshot['pending_stop'])}")
    fingerprint = _check_dict(snapshot["fingerprint"], "fingerprint")
    if not all(isinstance(key, str) for key in fingerprint):
        raise CheckpointError(f"fingerprint keys must be strings, got {list(fingerprint)}")
    _check_history(snapshot["history"])
    data, want = _check_dict(snapshot["data"], "data"), run.stream.state_dict()
    for key, value in want.items():
        if key not in data:
            raise CheckpointError(f"the data state lacks {key!r}")
        _check_like(data[key], value, f"the data state[{key!r}]")
    _check_handlers(snapshot["handlers"], run.dispatch.by_name)
    _check_metrics(snapshot["metrics"], estimator.train_metrics + estimator.val_metrics)
    _check_rng(snapshot["rng"])


def check_against_fit(estimator: Any, payload: dict[str, Any], rank: int, source: str) -> None:
    """Check everything a resume of ``estimator``'s current fit as rank ``rank`` would read from
    ``payload`` (loaded and migrated by :func:`~estimatorch.checkpoint.load`), without changing
    anything.

    Raises:
        CheckpointError: naming ``source`` and what is wrong, in words.
    """
    try:
        reference = dataclasses.asdict(estimator.position)
        for r, snapshot in enumerate(payload["ranks"]):
            _check_position(snapshot["position"], reference, f"the position of rank {r}")
        if rank >= len(payload["ranks"]):
            raise CheckpointError(f"it holds {len(payload['ranks'])} rank snapshots, none for rank {rank}")
        check_training_state(estimator, payload)
        _check_snapshot(estimator, rank_snapshot(payload, rank))
    except CheckpointError as err:
        raise CheckpointError(f"{source}: {err}") from None


def restore_training_state(estimator: Any, payload: dict[str, Any]) -> None:
    """Load model, optimizer, LR scheduler and grad scaler states into ``estimator``, after
    checking all four (nothing is loaded when one does not fit).

    Raises:
        CheckpointError: a state does not fit ``estimator``.
    """
    check_training_state(estimator, payload)
    load_model_state(estimator.net, payload["model"])
    estimator.optimizer.load_state_dict(payload["optimizer"])
    for attr in ("lr_scheduler", "grad_scaler"):
        target = getattr(estimator, attr)
        if target is not None:
            target.load_state_dict(payload[attr])
    if payload["ranks"][0]["position"]["step"] > 0:
        # The optimizer stepped before the checkpoint (in the process that wrote it): tell the LR
        # scheduler's "step() before optimizer.step()" check, which reads this torch marker.
        estimator.optimizer._opt_called = True
