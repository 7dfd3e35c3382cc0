"""The sanity pass ``fit`` runs before training (Lightning's ``num_sanity_val_steps``): the first
batches of ``val_data`` through the validation path, so that a mistake there is reported before
the first step instead of after a whole training epoch.

Nothing of the run changes: the val metrics are updated in copies, no handler hears of it, every
random generator (and the val loader's own) is put back, and the training data is not touched,
so a run with the pass is bitwise a run without it, resumed or not.

What it reports: a val batch that breaks the batch rules (``split_batch``'s layouts, inputs that do
not fit ``forward``, labels in a format the loss refuses: the errors of ``estimatorch._batches``
that name their fix) becomes a ``ValueError`` naming ``val_data`` and the batch. Any other
exception (the user's own, raised in ``forward``, the loss or a metric) reaches the caller as the
same object, with the pass's context added as a note (Python 3.11+; on 3.10, which has no notes,
the context goes to the estimator's logger).
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from torch.utils.data import DataLoader

from ... import _batches, distributed
from ..._batches import to_device
from ..._checks import check_positive_int
from ...checkpoint import is_sharded_module
from ...data import in_step, seeded_for_inference
from ...metrics.base import Metric, split_loss_metrics, update_metrics
from .._fit_estimator import FitEstimator
from .._setup.eval_sets import eval_sets
from .evaluation import _inference_mode

__all__ = ["sanity_pass"]


def sanity_pass(estimator: FitEstimator, val_data: Optional[Iterable[Any]], steps: Any, batch_axis: int) -> None:
    """Take ``steps`` batches of ``val_data`` through ``val_net``, ``val_loss`` and copies of the
    val metrics (each computed once, on this rank alone); under torch.distributed the ranks then
    agree on the outcome (one small collective), so a failure on one rank stops every rank.

    Raises:
        ValueError: ``steps`` is not a non-negative int, or a val batch broke the batch rules: the
            message names ``val_data``, the batch and the error (chained), and how to skip the pass.
        Exception: any other error of the pass (the user's net, loss or metric), as raised.
    """
    check_positive_int(steps, "num_sanity_val_steps", minimum=0)
    if val_data is None or steps == 0 or isinstance(val_data, Iterator):
        return
    error: Optional[Exception] = None
    sets = eval_sets(val_data)
    try:
        for data in sets.values() if sets is not None else [val_data]:  # each eval set
            _check_batches(estimator, data, steps, batch_axis)
    except Exception as err:  # noqa: BLE001 - every rank must hear of it (a sharded net's forward is a collective)
        error = err
    distributed.raise_on_every_rank(error, "fit's sanity pass over val_data")


def _check_batches(estimator: FitEstimator, val_data: Iterable[Any], steps: int, batch_axis: int) -> None:
    loss_metrics, other_metrics = split_loss_metrics([copy.deepcopy(m) for m in estimator.val_metrics])
    for metric in loss_metrics + other_metrics:
        metric.reset()
    generators = _loader_generators(val_data)
    saved = [g.get_state() for g in generators]
    where = "its batch 1"
    try:
        with _inference_mode(estimator):  # eval mode, no gradients, every global generator kept
            batches = itertools.islice(seeded_for_inference(val_data, estimator.seed), steps)
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
    except Exception as err:  # a batch-rule error is val_data's; any other passes through
        context = f"at {where}, through val_net, val_loss and the val metrics"
        if _is_batch_rule_error(err):
            raise ValueError(
                f"val_data failed the sanity pass before training ({context}): {type(err).__name__}: {err}. "
                "Fix val_data (or the val metrics), or pass num_sanity_val_steps=0 to skip this check") from err
        _add_context(estimator, err, f"raised by fit's sanity pass over val_data before training ({context}); "
                                     "pass num_sanity_val_steps=0 to skip this check")
        raise
    finally:
        for generator, state in zip(generators, saved):
            generator.set_state(state)


# The batch rules' functions whose own raise statements name a fix: an error whose innermost frame
# is one of them was raised by the rule itself (call_net and call_loss re-raise `from` the cause;
# a bare re-raise of an error from inside forward or the loss keeps the deeper frames).
_RULES = {_batches.split_batch.__code__: False, _batches.call_net.__code__: True,
          _batches.call_loss.__code__: True}


def _is_batch_rule_error(err: BaseException) -> bool:
    """Whether ``err`` is one of the batch rules' own errors (a val batch of the wrong layout,
    inputs that do not fit ``forward``, labels the loss refuses, with the fix named)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    needs_cause = _RULES.get(tb.tb_frame.f_code)
    return needs_cause is not None and (not needs_cause or err.__cause__ is not None)


def _add_context(estimator: FitEstimator, err: BaseException, context: str) -> None:
    """Tell where ``err`` came from without changing it: a note (Python 3.11+), else the log."""
    if sys.version_info >= (3, 11):
        err.add_note(context)
    else:  # pragma: no cover - Python 3.10 has no exception notes
        estimator.logger.error("%s: %s", type(err).__name__, context)


def _own_or_padding(estimator: FitEstimator, batches: Iterable[Any]) -> Iterable[tuple[Any, bool]]:
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

