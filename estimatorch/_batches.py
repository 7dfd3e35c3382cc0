"""The batch conventions: ``(data, label)`` splitting, inputs passed to the net, moves to the
device (on CUDA, on a side stream: :class:`SideStreamCopy`), and the number of samples in a
batch (from shapes, without a device sync).

Lowest layer: handlers, statistics and the estimator all count and split batches the same way.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

__all__ = ["SideStreamCopy", "batch_mover", "batch_size_of", "call_loss", "call_net", "map_tensors", "split_batch",
           "split_inputs", "tensors_in", "to_device"]


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) tuple, list or dict to ``device``; copies from the CPU
    to an accelerator are ``non_blocking`` (truly asynchronous from pinned memory)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        return obj.to(device, non_blocking=device.type != "cpu")
    if type(obj) is list and len(obj) == 2:  # the common collated (data, label) batch
        data, label = obj
        if type(data) is torch.Tensor and type(label) is torch.Tensor and data.device == device \
                and label.device == device:
            return obj
    if isinstance(obj, tuple):
        moved = [to_device(x, device) for x in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else tuple(moved)
    if isinstance(obj, list):
        return [to_device(x, device) for x in obj]
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def batch_mover(device: torch.device) -> Callable[[Any], Any]:
    """How the train loop moves each batch to ``device``: a :class:`SideStreamCopy` on CUDA,
    :func:`to_device` anywhere else (the CPU path is unchanged).

    Example:
        >>> move = batch_mover(torch.device("cpu"))
        >>> x = torch.zeros(2)
        >>> move([x, x])[0] is x
        True
    """
    if device.type == "cuda":
        return SideStreamCopy(device)
    return functools.partial(to_device, device=device)


class SideStreamCopy:
    """Move batches to a CUDA device on a side stream, so that the copy of batch k+1 runs
    while the kernels of step k (queued before it on the current stream) still run.

    Each call queues the batch's host-to-device copies (asynchronous from pinned memory: give
    the ``DataLoader`` ``pin_memory=True``) on its own stream, records an event after them and
    makes the current stream wait for that event, a wait on the device, never on the host. The
    copies' memory is marked as used by the current stream, so the allocator does not hand it
    out again before the step that reads it is done. A batch already on the device is returned
    as :func:`to_device` returns it, with no stream work.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def __call__(self, batch: Any) -> Any:
        if all(t.device == self.device for t in tensors_in(batch)):
            return to_device(batch, self.device)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            moved = to_device(batch, self.device)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        current.wait_event(ready)
        for tensor in tensors_in(moved):
            tensor.record_stream(current)
        return moved


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``, through tuples, named tuples, lists
    and mappings (as :func:`to_device` walks a batch; other objects are kept).

    Example:
        >>> map_tensors({"x": [torch.ones(1)], "n": 3}, lambda t: t * 2)
        {'x': [tensor([2.])], 'n': 3}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        moved = [map_tensors(x, fn) for x in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else tuple(moved)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) tuple, list or dict batch."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    if isinstance(obj, Mapping):
        return [t for x in obj.values() for t in tensors_in(x)]
    return []


def split_batch(batch: Any) -> tuple[Any, Any]:
    """Split a batch into ``(data, label)``.

    The convention:

    - ``(data, label)``: a pair; ``data`` may itself be a tuple of inputs;
    - ``(x1, x2, ..., label)``: the last element is the label, the others are the inputs;
    - ``{"label": y, **inputs}`` (or ``"labels"``): the rest of the dict are keyword inputs.
    """
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) > 2:
            return tuple(batch[:-1]), batch[-1]
    elif isinstance(batch, Mapping):
        for key in ("label", "labels"):
            if key in batch:
                return {k: v for k, v in batch.items() if k != key}, batch[key]
        raise ValueError(f"a dict batch needs a 'label' or 'labels' key, got keys {sorted(batch)}")
    raise TypeError(
        "a batch must be a (data, label) pair, a tuple whose last element is the label, or a dict "
        f"with a 'label' key; got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        + ". Replace the BatchProcessor to train on other batch layouts."
    )


def split_inputs(batch: Any) -> Any:
    """The inputs of a batch to predict on: the batch without its label, when it has one.

    - a tensor, or anything but a tuple, list or dict: the input itself;
    - ``(x,)``: ``x`` (a ``TensorDataset(x)`` loader yields one-element batches);
    - ``(data, label)`` or ``(x1, ..., label)``: the last element is the label, as in
      :func:`split_batch`; for several inputs without a label, pass ``((x1, x2),)`` or a dict;
    - a dict: without its ``"label"`` / ``"labels"`` key, if any (keyword inputs).

    Example:
        >>> import torch
        >>> x, y = torch.zeros(2, 3), torch.ones(2)
        >>> split_inputs(x) is x, split_inputs((x,)) is x, split_inputs((x, y)) is x
        (True, True, True)
        >>> split_inputs({"a": x, "label": y}).keys()
        dict_keys(['a'])
    """
    if type(batch) is torch.Tensor:
        return batch
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k not in ("label", "labels")}
    if isinstance(batch, (tuple, list)):
        return batch[0] if len(batch) == 1 else split_batch(batch)[0]
    return batch


def call_net(net: Callable[..., Any], data: Any) -> Any:
    """``net(data)``; a tuple of inputs is unpacked, a dict is passed as keywords. Inputs that
    do not fit ``net.forward`` are a ``TypeError`` that says what the batch held and how to fix it."""
    try:
        if type(data) is torch.Tensor:  # the common case first: no abstract-class checks
            return net(data)
        if isinstance(data, tuple):
            return net(*data)
        if isinstance(data, Mapping):
            return net(**data)
        return net(data)
    except TypeError as err:
        args = data if isinstance(data, tuple) else () if isinstance(data, Mapping) else (data,)
        mismatch = _inputs_mismatch(net, args, data if isinstance(data, Mapping) else {})
        if mismatch is None:  # a TypeError from inside forward: not ours to explain
            raise
        raise TypeError(mismatch) from err


def call_loss(loss: Callable[..., Any], pred: Any, label: Any, data_arg: str) -> Any:
    """``loss(pred, label)`` on a batch of ``data_arg`` (``"train_data"``, ``"val_data"``); a
    failure the labels' dtype or shape explains (float or int32 class indices, a target of
    another shape) is re-raised, as the same type, with the labels' format and the fix added; a
    ``transformers`` output handed to a loss (a ``TypeError``, or a loss of None) says to build
    the estimator without a loss."""
    try:
        value = loss(pred, label)
    except (RuntimeError, ValueError, IndexError, TypeError) as err:
        if type(err) is TypeError:  # what a loss function says of a transformers output
            hint = _OWN_LOSS_HINT if _model_output(pred) else None
        else:
            hint = _label_hint(pred, label, data_arg) if type(err) in (RuntimeError, ValueError, IndexError) else None
        if hint is None:
            raise
        raise type(err)(f"{err}. {hint}") from err
    if value is None:
        raise TypeError(f"loss(pred, label) returned None on a batch of {data_arg}"
                        + (f". {_OWN_LOSS_HINT}" if _model_output(pred) else ""))
    return value


#: what to do when a ``transformers`` model's output reaches a loss function.
_OWN_LOSS_HINT = ("The net returned a model output with logits (a transformers model?) and the batch's "
                  "'labels' went to the loss as the label, not to the model, so the model computed no loss. "
                  "Build Estimator(model, optimizer=...) without a loss: the whole batch, labels included, then "
                  "goes to the model and fit trains on the loss it returns (docs/transformers.md)")


def _model_output(pred: Any) -> bool:
    """A ``transformers`` ``ModelOutput`` or a dict of logits: what no loss function takes."""
    return isinstance(pred, Mapping) and "logits" in pred


def _label_hint(pred: Any, label: Any, data_arg: str) -> Optional[str]:
    """What the labels hold beside the predictions, and the formats the loss may want."""
    if not isinstance(pred, torch.Tensor) or not isinstance(label, torch.Tensor):
        return None
    got = (f"The labels of {data_arg} (each batch's last element or its 'label' key) are {label.dtype} of shape "
           f"{tuple(label.shape)} for predictions of shape {tuple(pred.shape)}")
    if pred.dim() == label.dim() + 1:  # class indices beside (N, C, ...) scores
        if label.is_floating_point() or label.dtype not in (torch.int64, torch.uint8):
            return (f"{got}: class indices must be int64, so pass label.long() (in your Dataset, collate_fn or "
                    f"batch), or one-hot/probability targets of shape {tuple(pred.shape)}")
        return None
    if pred.shape != label.shape:
        return (f"{got}: the loss wants class indices of shape {tuple(pred.shape[:1] + pred.shape[2:])} "
                f"(int64, label.long()) or targets of the predictions' shape {tuple(pred.shape)}")
    return None


def _inputs_mismatch(net: Any, args: tuple, kwargs: Mapping) -> Optional[str]:
    """Why ``net`` cannot take these inputs, or None when its signature accepts them."""
    while isinstance(getattr(net, "module", None), torch.nn.Module) or \
            isinstance(getattr(net, "_orig_mod", None), torch.nn.Module):  # DDP, torch.compile
        inner = getattr(net, "module", None)
        net = inner if isinstance(inner, torch.nn.Module) else net._orig_mod
    forward = getattr(net, "forward", net)
    try:
        inspect.signature(forward).bind(*args, **kwargs)
        return None
    except TypeError as err:
        reason = str(err)
    except ValueError:  # no signature to check against (a builtin)
        return None
    given = f"{len(args)} positional input(s)" + (f" and the keywords {sorted(kwargs)}" if kwargs else "")
    return (f"{type(net).__name__}.forward{inspect.signature(forward)} cannot take what the batch gave it: "
            f"{given} ({reason}). A batch (x1, ..., xn, label) gives its first n parts as inputs and its "
            "last as the label; a dict batch gives its keys (but 'label'/'labels') as keywords. Make the "
            "batches match forward, or pass Estimator(..., batch_processor=...) with a BatchProcessor that "
            "splits your batches.")


def batch_size_of(value: Any, batch_axis: int = 0) -> int:
    """The number of samples in a label or data structure (from shapes: no device sync)."""
    if isinstance(value, torch.Tensor):
        return value.shape[batch_axis] if value.dim() > batch_axis else 1
    if isinstance(value, (tuple, list)) and value:
        return batch_size_of(value[0], batch_axis)
    if isinstance(value, Mapping) and value:
        return batch_size_of(next(iter(value.values())), batch_axis)
    return 1
