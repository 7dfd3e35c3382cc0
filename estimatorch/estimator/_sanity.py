"""The sanity pass ``fit`` runs before training (Lightning's ``num_sanity_val_steps``): the first
batches of ``val_data`` through the validation path, so that a mistake there is reported before
the first step instead of after a whole training epoch.

Nothing of the run changes: the val metrics are updated in copies, no handler hears of it, every
random generator (and the val loader's own) is put back, and the training data is not touched,
so a run with the pass is bitwise a run without it, resumed or not.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from .. import distributed
from .._batches import to_device
from .._checks import check_positive_int
from ..checkpoint import is_sharded_module
from ..data import in_step
from ..metrics.base import Metric, split_loss_metrics, update_metrics
from ._evaluation import _inference_mode, _seeded

__all__ = ["sanity_pass"]


def sanity_pass(estimator: Any, val_data: Optional[Iterable[Any]], steps: Any, batch_axis: int) -> None:
    """Take ``steps`` batches of ``val_data`` through ``val_net``, ``val_loss`` and copies of the
    val metrics (each computed once, on this rank alone); under torch.distributed the ranks then
    agree on the outcome (one small collective), so a failure on one rank stops every rank.

    Raises:
        ValueError: ``steps`` is not a non-negative int, or the pass failed: the message names
            ``val_data``, the batch and the error (chained), and how to skip the pass.
    """
    check_positive_int(steps, "num_sanity_val_steps", minimum=0)
    if val_data is None or steps == 0 or isinstance(val_data, Iterator):
        return
    error: Optional[Exception] = None
    try:
        _check_batches(estimator, val_data, steps, batch_axis)
    except Exception as err:  # noqa: BLE001 - every rank must hear of it (a sharded net's forward is a collective)
        error = err
    distributed.raise_on_every_rank(error, "fit's sanity pass over val_data")


def _check_batches(estimator: Any, val_data: Iterable[Any], steps: int, batch_axis: int) -> None:
    loss_metrics, other_metrics = split_loss_metrics([copy.deepcopy(m) for m in estimator.val_metrics])
    for metric in loss_metrics + other_metrics:
        metric.reset()
    generators = _loader_generators(val_data)
    saved = [g.get_state() for g in generators]
    where = "its batch 1"
    try:
        with _inference_mode(estimator):  # eval mode, no gradients, every global generator kept
            batches = itertools.islice(_seeded(val_data, estimator.seed), steps)
            index = 1
            for batch, own in _own_or_padding(estimator, batches):
                batch = to_device(batch, estimator.device)
                _, label, pred, loss = estimator.batch_processor.evaluate_batch(estimator, batch, batch_axis)
                if own:  # (a padding forward's result is discarded)
                    update_metrics(loss_metrics, other_metrics, pred, label, loss)
                    index += 1
                    where = f"its batch {index}"
            where = "the val metrics' compute()"
            for metric in loss_metrics + other_metrics:
                if isinstance(metric, Metric):
                    metric.compute(sync=False)
                elif not distributed.is_distributed():  # another library's compute may be a collective
                    metric.compute()
    except Exception as err:  # noqa: BLE001 - reported as val_data's, with the cause chained
        raise ValueError(
            f"val_data failed the sanity pass before training (at {where}, through val_net, val_loss and the "
            f"val metrics): {type(err).__name__}: {err}. Fix val_data (or the val metrics), or pass "
            "num_sanity_val_steps=0 to skip this check") from err
    finally:
        for generator, state in zip(generators, saved):
            generator.set_state(state)


def _own_or_padding(estimator: Any, batches: Iterable[Any]) -> Iterable[tuple[Any, bool]]:
    """``(batch, own)`` pairs: this rank's batches, and for a sharded ``val_net`` under
    torch.distributed padding ones until every rank has run out, so that every rank runs as many
    forwards (each gathers parameters from every rank) when ranks hold different numbers of
    batches (data each rank holds itself, shorter than ``num_sanity_val_steps``)."""
    if distributed.is_distributed() and is_sharded_module(estimator.val_net):
        return in_step(batches)
    return ((batch, True) for batch in batches)


def _loader_generators(data: Any) -> list[torch.Generator]:
    """The generators reading ``data`` draws from besides the global ones (a DataLoader's and its
    sampler's), whose state the pass puts back."""
    if not isinstance(data, DataLoader):
        return []
    found = [data.generator, getattr(data.sampler, "generator", None),
             getattr(getattr(data, "batch_sampler", None), "generator", None)]
    unique: dict[int, torch.Generator] = {}
    for generator in found:
        if isinstance(generator, torch.Generator):
            unique.setdefault(id(generator), generator)
    return list(unique.values())

