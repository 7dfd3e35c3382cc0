"""The loop ``evaluate`` and ``predict`` share: ``val_net`` in eval mode without gradients, every
random generator kept, the four epoch/batch events fired, over this rank's share of the data
(:mod:`estimatorch.data._sharding`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Callable, Optional

import torch

from ... import distributed, rng
from ..._batches import to_device
from ..._checks import is_int
from ...checkpoint import is_sharded_module
from ...data import InferenceData, for_inference, in_step, seeded_for_inference
from ...events import Dispatch, check_handlers, declared, evaluation_weights, order_handlers
from ...metrics.base import split_loss_metrics, update_metrics
from .._fit_estimator import FitEstimator

__all__ = ["check_inference_args", "evaluate_batches", "evaluate_groups", "run_batches"]

#: ``step(batch) -> (pred, label, loss)``: what ``batch_end`` handlers receive.
Step = Callable[[Any], "tuple[Any, Any, Any]"]

def check_inference_args(data: Any, arg: str, batch_axis: Any, event_handlers: Any, *,
                         check_empty: bool = True) -> list[Any]:
    """Check ``evaluate``/``predict`` arguments before any work; returns the handler list.

    Args:
        check_empty: refuse data known to be empty (a length of 0). Defaults to True; evaluate
            under torch.distributed leaves it to the ranks' agreement (a rank may hold nothing).
    """
    if isinstance(data, torch.Tensor):
        raise TypeError(f"{arg} must be an iterable of batches (a DataLoader, a list...), got Tensor; for one "
                        "tensor x pass [x] (one batch) or DataLoader(TensorDataset(x), batch_size=...)")
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(f"{arg} must be an iterable of batches (a DataLoader, a list...), got {type(data).__name__}")
    if check_empty and isinstance(data, Sized):
        try:
            empty = len(data) == 0
        except TypeError:  # a DataLoader over an IterableDataset has no length
            empty = False
        if empty:
            raise ValueError(f"{arg} is empty: a {type(data).__name__} of length 0")
    if not is_int(batch_axis) or batch_axis < 0:
        raise ValueError(f"batch_axis must be a non-negative int, got {batch_axis!r}")
    return check_handlers(event_handlers)


@contextlib.contextmanager
def _inference_mode(estimator: FitEstimator) -> Iterator[None]:
    """``val_net`` in eval mode without gradients; its mode and every generator restored after.

    A DataLoader draws its workers' base seed from the global generator: evaluating must not
    shift the training's random stream (dropout) by validating or not.
    """
    net = estimator.val_net
    was_training = net.training
    net.eval()
    try:
        with torch.no_grad(), rng.keep_random_state():
            yield
    finally:
        net.train(was_training)


def _dispatch(estimator: FitEstimator, handlers: list[Any], batches: Iterable[Any]) -> Dispatch:
    """The caller's handlers, and during ``fit`` the companions fit's handlers attach (the
    progress bar's validation bar), which see this rank's batches."""
    handlers = list(handlers)
    for handler in estimator.handlers:
        handlers.extend(declared(handler, "evaluation_handlers")(batches))
    return Dispatch(order_handlers(handlers, []))


def _own_or_padding(shard: InferenceData, limit: Optional[int], sharded: bool) -> Iterable[tuple[Any, bool]]:
    """``(batch, own)`` pairs: this rank's batches (at most ``limit``), and for a sharded net
    padding ones, so that every rank runs as many forwards (:mod:`estimatorch.data._sharding`)."""
    batches = shard.batches if limit is None else itertools.islice(shard.batches, limit)
    if sharded and not shard.split and distributed.is_distributed():
        return in_step(batches)  # lengths unknown: agreed batch by batch
    own = shard.own if sharded and shard.own is not None else None
    return ((batch, own is None or i < own) for i, batch in enumerate(batches))


def run_batches(estimator: FitEstimator, data: Iterable[Any], arg: str, handlers: list[Any], step: Step, *,
                agree_on_empty: bool, limit: Optional[int] = None,
                forward: Optional[Callable[[Any], Any]] = None) -> InferenceData:
    """Fire ``epoch_begin``, then per batch ``batch_begin``, ``step``, ``batch_end``, then
    ``epoch_end``, over this rank's batches of ``data``.

    For a sharded ``val_net`` (FSDP2: each forward gathers parameters from every rank) every
    rank runs as many forwards: a rank with a batch fewer of a split loader, or that has run out
    of data it holds itself (the ranks agree before each batch: one small all-reduce per batch),
    runs ``forward`` on a padding batch and discards its result, firing no event (:mod:`estimatorch.data._sharding`).

    Args:
        agree_on_empty: with data each rank holds itself, under torch.distributed, raise only
            when no rank saw a batch (one collective, every rank alike); else raise when this
            rank saw none.
        limit: at most this many of this rank's batches (``fit(val_batches=...)``). Defaults
            to None (all).

    Raises:
        ValueError: no batches (before ``epoch_end``).
    """
    with _inference_mode(estimator):
        sharded = forward is not None and is_sharded_module(estimator.val_net)
        seeded = seeded_for_inference(data, estimator.seed)
        shard = for_inference(seeded, arg, pad=sharded)
        dispatch = _dispatch(estimator, handlers, shard.batches)
        device = estimator.device
        dispatch.fire("epoch_begin", estimator)
        seen = 0
        for batch, own in _own_or_padding(shard, limit, sharded):
            batch = to_device(batch, device)
            if not own:
                assert forward is not None
                forward(batch)  # padding: the other ranks' forward needs this rank's shards
                continue
            dispatch.fire("batch_begin", estimator, batch=batch)
            pred, label, loss = step(batch)
            dispatch.fire("batch_end", estimator, batch=batch, pred=pred, label=label, loss=loss)
            seen += 1
        if not shard.split:  # a split loader was checked for batches before it started
            if agree_on_empty and distributed.is_distributed():
                seen = sum(distributed.gather_objects(seen))
            if seen == 0:
                raise ValueError(f"{arg} yielded no batches")
        dispatch.fire("epoch_end", estimator)
    return shard


def evaluate_groups(estimator: FitEstimator, groups: list[tuple[str, Any, list[Any]]], batch_axis: int,
                    event_handlers: Any, *, limit: Optional[int] = None) -> Optional[str]:
    """``Estimator.evaluate`` over each ``(arg, data, metrics)`` group (an eval set), every
    group's arguments checked first. During ``fit`` the net holds the weights a handler keeps for
    evaluation meanwhile (an average: :func:`~estimatorch.events.evaluation_weights`); returns
    their name, None for the net's own."""
    checked = [check_inference_args(data, arg, batch_axis, event_handlers, check_empty=not distributed.is_distributed())
               for arg, data, _ in groups]
    with evaluation_weights(estimator) as weights:
        for (_, data, metrics), handlers in zip(groups, checked):
            evaluate_batches(estimator, data, batch_axis, handlers, limit=limit, metrics=metrics)
    return weights


def evaluate_batches(estimator: FitEstimator, val_data: Iterable[Any], batch_axis: int, handlers: list[Any], *,
                     limit: Optional[int] = None, metrics: Optional[list[Any]] = None) -> None:
    """Reset the val metrics (``metrics``: one eval set's; None: the estimator's) and update them
    over ``val_data`` (``Estimator.evaluate``'s loop), at most ``limit`` batches of this rank's
    (None: all)."""
    metrics = estimator.val_metrics if metrics is None else metrics
    loss_metrics, other_metrics = split_loss_metrics(metrics)
    for metric in metrics:
        metric.reset()
    evaluate_batch = estimator.batch_processor.evaluate_batch

    def step(batch: Any) -> tuple[Any, Any, Any]:
        _, label, pred, loss = evaluate_batch(estimator, batch, batch_axis)
        update_metrics(loss_metrics, other_metrics, pred, label, loss)
        return pred, label, loss

    # compute() is a collective: every rank calls evaluate, so agreeing on emptiness is safe.
    run_batches(estimator, val_data, "val_data", handlers, step, agree_on_empty=True, limit=limit,
                forward=lambda batch: evaluate_batch(estimator, batch, batch_axis))
