"""``Estimator.predict``: the forward of every batch, outputs joined on the CPU in sample order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

import torch

from ... import distributed
from ..._batches import map_tensors
from ...checkpoint import is_sharded_module
from .._fit_estimator import FitEstimator
from .._setup.arguments import PRECISIONS
from .evaluation import check_inference_args, run_batches

__all__ = ["join_outputs", "run_prediction"]


class _Ragged(Exception):
    """Per-batch outputs that do not join into one structure."""


def _to_host(obj: Any, non_blocking: bool, amp: Optional[torch.dtype] = None) -> Any:
    """Every tensor of a (nested) output on the CPU; asynchronous from CUDA (the caller
    synchronises once, before the values are read). Tensors of the autocast dtype ``amp``
    (mixed precision's working dtype) come back as float32."""
    def host(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if amp is not None and tensor.dtype == amp:
            tensor = tensor.float()
        return tensor.to("cpu", non_blocking=non_blocking)

    return map_tensors(obj, host)


def _join(items: Sequence[Any], axis: int) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        if first.dim() <= axis or not all(isinstance(t, torch.Tensor) for t in items):
            raise _Ragged
        try:
            return torch.cat(list(items), dim=axis)
        except RuntimeError as err:  # shapes differ off the batch axis
            raise _Ragged from err
    if isinstance(first, list):
        if not all(isinstance(x, list) for x in items):
            raise _Ragged
        return [x for item in items for x in item]
    if isinstance(first, tuple):
        if not all(type(x) is type(first) and len(x) == len(first) for x in items):
            raise _Ragged
        joined = [_join([x[i] for x in items], axis) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
    if isinstance(first, Mapping):
        keys = list(first)
        if not all(isinstance(x, Mapping) and list(x) == keys for x in items):
            raise _Ragged
        return {k: _join([x[k] for x in items], axis) for k in keys}
    raise _Ragged


def join_outputs(outputs: Sequence[Any], batch_axis: int = 0) -> Any:
    """Join per-batch outputs (in batch order) into what ``predict`` returns.

    A tensor is concatenated along ``batch_axis``; a tuple (a namedtuple stays one) or a dict
    gives the same structure with each element joined; a list (per-sample outputs, e.g. a
    detection model's list of dicts) is joined into one list. When the outputs do not join
    (not tensors, 0-dim tensors, shapes that differ off the batch axis, structures that differ
    between batches), the list of per-batch outputs is returned.

    Example:
        >>> join_outputs([torch.zeros(2, 3), torch.ones(1, 3)]).shape
        torch.Size([3, 3])
        >>> join_outputs([(torch.zeros(2), ["a", "b"]), (torch.ones(1), ["c"])])
        (tensor([0., 0., 1.]), ['a', 'b', 'c'])
        >>> join_outputs([torch.tensor(0.5), torch.tensor(1.5)])
        [tensor(0.5000), tensor(1.5000)]
    """
    try:
        return _join(outputs, batch_axis)
    except _Ragged:
        return list(outputs)


def run_prediction(estimator: FitEstimator, data: Iterable[Any], batch_axis: int, event_handlers: Any) -> Any:
    """``Estimator.predict`` (see its docstring)."""
    # a sharded net's ranks run every forward together: one holding nothing pads, then raises
    together = distributed.is_distributed() and is_sharded_module(estimator.val_net)
    handlers = check_inference_args(data, "data", batch_axis, event_handlers, check_empty=not together)
    processor = estimator.batch_processor
    predict_batch = getattr(processor, "predict_batch", None)
    non_blocking = estimator.device.type == "cuda"
    amp = PRECISIONS[estimator.precision]  # "bf16-mixed" / "16-mixed": outputs come back as float32
    outputs: list[Any] = []

    def forward(batch: Any) -> Any:
        if predict_batch is not None:
            return predict_batch(estimator, batch, batch_axis)
        _, _, pred, _ = processor.evaluate_batch(estimator, batch, batch_axis)  # a processor without predict_batch
        return pred

    def step(batch: Any) -> tuple[Any, Any, Any]:
        pred = forward(batch)
        outputs.append(_to_host(pred, non_blocking, amp))
        return pred, None, None

    shard = run_batches(estimator, data, "data", handlers, step, agree_on_empty=False, forward=forward)
    if non_blocking:
        torch.cuda.synchronize(estimator.device)  # the copies to the host are complete
    if shard.split:
        outputs = shard.merge(distributed.gather_objects(outputs))
    return join_outputs(outputs, batch_axis)
