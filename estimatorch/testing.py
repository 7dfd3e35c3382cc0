"""Test helpers for your own suite: :func:`assert_resumable` proves a training setup resumes
bit-identically from a checkpoint at any step.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from estimatorch import Estimator
    >>> from estimatorch.testing import assert_resumable
    >>> def make():
    ...     torch.manual_seed(0)
    ...     net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    ...     return Estimator(net, nn.CrossEntropyLoss(),
    ...                      optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    >>> data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]
    >>> assert_resumable(make, data, epochs=2, stop_at=[2, 3], quiet=True)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import math
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch

from .estimator import default_logger
from .event_handlers import BatchEnd, CheckpointHandler, ProgressBarHandler
from .events import EstimatorView

__all__ = ["assert_resumable"]


class SimulatedCrash(BaseException):
    """Raised right after the checkpoint at the stop step, like a process killed there."""


class _Trace(BatchEnd):
    """Records each step's loss (as float.hex) and a digest of the parameters after it."""

    priority = float("inf")  # after the optimizer step (-2000)

    def __init__(self) -> None:
        self.losses: list[str] = []
        self.digests: list[str] = []

    def batch_end(self, estimator: EstimatorView, *, loss: Any, **kwargs: Any) -> None:
        value = loss.detach().float().mean() if isinstance(loss, torch.Tensor) else loss
        self.losses.append(float(value).hex())
        h = hashlib.blake2b(digest_size=16)
        for p in estimator.net.parameters():
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        self.digests.append(h.hexdigest())


class CrashAfter(BatchEnd):
    """Crashes at the boundary after step ``step``, once the checkpoint there is written."""

    priority = float("inf")

    def __init__(self, step: int):
        self.step = step
        self.seen = 0

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.seen += 1
        if self.seen == self.step:
            estimator.at_boundary(self._crash)

    def _crash(self) -> None:
        raise SimulatedCrash(self.step)


def _tensors_equal(a: Any, b: Any, where: str) -> Optional[str]:
    """The first place two nested states differ, or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                or a.dtype != b.dtype or not torch.equal(a, b):
            return where
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{where} (keys {sorted(map(str, set(a) ^ set(b)))})"
        for key in a:
            found = _tensors_equal(a[key], b[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} (length {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _tensors_equal(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return None if same else where


def _default_stops(per_epoch: Optional[int], total: int) -> list[int]:
    points = {1, total, max(1, total // 2)}
    if per_epoch:
        points |= {per_epoch, min(per_epoch + 1, total), max(1, per_epoch // 2)}
    return sorted(p for p in points if 1 <= p <= total)


def assert_resumable(make_estimator: Callable[[], Any], train_data: Any, *, epochs: Optional[int] = None,
                     batches: Optional[int] = None, val_data: Any = None,
                     event_handlers: Union[Callable[[], list[Any]], Sequence[Any], None] = None,
                     stop_at: Optional[Iterable[int]] = None, workdir: Optional[str] = None,
                     quiet: bool = False, batches_per_epoch: Optional[int] = None) -> None:
    """Fail unless stopping after any of ``stop_at`` steps and resuming from the checkpoint there,
    in a fresh estimator, reproduces the uninterrupted run bit for bit.

    For each stop step k, a fresh ``make_estimator()`` trains with a ``CheckpointHandler`` and
    crashes right after the checkpoint of step k; another fresh estimator resumes from it. Every
    later step's loss (compared as ``float.hex``) and parameters, and the final parameters and
    optimizer state, must equal the uninterrupted run's.

    Args:
        make_estimator: builds the same estimator each call (seed the model's initialisation).
        train_data: the training data, or a zero-argument function returning it.
        epochs: the plan (exactly one of ``epochs``/``batches``).
        batches: the plan.
        val_data: passed to ``fit``. Defaults to None.
        event_handlers: extra handlers, or a function returning fresh ones. Defaults to None.
        stop_at: steps (1-based) to stop after. Defaults to the first step, the middle, and the
            last step, the end of the first epoch and the start of the second.
        workdir: where checkpoints go. Defaults to a temporary directory, removed afterwards.
        quiet: silence the estimator's INFO log lines and the default progress bar while it
            runs (a bar among ``event_handlers`` is kept). Defaults to False.
        batches_per_epoch: passed to ``fit``. Defaults to None.

    Raises:
        AssertionError: naming the stop step and the first step (or state) that differs. When a
            resumed run differs, a second uninterrupted run is trained to tell the two causes
            apart: the message starts with ``resume differs:`` when the two uninterrupted runs
            agree, and with ``setup not deterministic:`` when they do not (then the setup itself
            does not give the same bits twice, resumed or not).
    """
    def data() -> Any:
        return train_data() if callable(train_data) and not hasattr(train_data, "__iter__") else train_data

    def extra() -> list[Any]:
        handlers = [] if event_handlers is None else (
            list(event_handlers()) if callable(event_handlers) else list(event_handlers))
        if quiet and not any(isinstance(h, ProgressBarHandler) for h in handlers):
            handlers.append(ProgressBarHandler(file=io.StringIO()))  # takes the default bar's place, unseen
        return handlers

    plan: dict[str, Any] = {"epochs": epochs, "batches": batches, "batches_per_epoch": batches_per_epoch}
    logger = default_logger()  # set up first: the level put back afterwards is the one fit logs at
    level = logger.level
    if quiet:
        logger.setLevel(logging.WARNING)

    def uninterrupted() -> tuple[_Trace, Any, tuple]:
        trace = _Trace()
        est = make_estimator()
        est.fit(data(), val_data=val_data, event_handlers=[*extra(), trace], **plan)
        return trace, est, (est.net.state_dict(), est.optimizer.state_dict())

    try:
        with tempfile.TemporaryDirectory() if workdir is None else contextlib.nullcontext(workdir) as root:
            reference, est, final = uninterrupted()
            total = len(reference.losses)
            stops = sorted(set(stop_at)) if stop_at is not None else _default_stops(est.batches_per_epoch, total)
            for k in stops:
                if not 1 <= k <= total:
                    raise ValueError(f"stop_at holds {k}, outside the run's steps 1..{total}")
                directory = f"{root}/stop{k}"
                stopped = make_estimator()
                try:
                    stopped.fit(data(), val_data=val_data, **plan, event_handlers=[
                        *extra(), CheckpointHandler(directory, batch_period=k, epoch_period=None, max_checkpoints=1),
                        CrashAfter(k)])
                except SimulatedCrash:
                    pass
                resumed_trace = _Trace()
                resumed = make_estimator()
                resumed.fit(data(), val_data=val_data, **plan, event_handlers=[
                    *extra(), CheckpointHandler(directory, batch_period=k, epoch_period=None, max_checkpoints=1,
                                                resume_from_checkpoint=True), resumed_trace])
                got = (resumed.net.state_dict(), resumed.optimizer.state_dict())
                try:
                    _compare(k, reference, resumed_trace, final, got)
                except AssertionError as err:
                    # Is the setup deterministic by itself? A second uninterrupted run tells.
                    again, _, again_final = uninterrupted()
                    try:
                        _compare(0, reference, again, final, again_final, who="a second uninterrupted run")
                    except AssertionError as differs:
                        raise AssertionError(
                            f"setup not deterministic: {differs}, so no resume can be judged. Make the run "
                            "reproducible first (seed the net in make_estimator; Estimator(deterministic=True); "
                            "see docs/resume.md, 'What cannot be bitwise')") from None
                    raise AssertionError(f"resume differs: {err} (two uninterrupted runs agree)") from None
    finally:
        logger.setLevel(level)


def _compare(k: int, reference: _Trace, resumed: _Trace, final: tuple, got: tuple,
             who: Optional[str] = None) -> None:
    """Raise at the first step after ``k`` (loss, then parameters after it) or final state that
    differs; the message starts with ``who`` (default: the run resumed after step ``k``)."""
    who = f"resumed after step {k}" if who is None else who
    expected = list(zip(reference.losses[k:], reference.digests[k:]))
    for i, ((want_loss, want_params), (loss, params)) in enumerate(zip(expected, zip(resumed.losses, resumed.digests))):
        step = k + i + 1
        if loss != want_loss:
            raise AssertionError(f"{who}: the loss of step {step} differs "
                                 f"({float.fromhex(loss)!r} vs {float.fromhex(want_loss)!r} uninterrupted)")
        if params != want_params:
            raise AssertionError(f"{who}: the parameters after step {step} differ")
    if len(resumed.losses) != len(expected):
        raise AssertionError(f"{who}: it trained {len(resumed.losses)} steps, "
                             f"the uninterrupted run {len(expected)} more")
    for name, want, have in (("parameters", final[0], got[0]), ("optimizer state", final[1], got[1])):
        where = _tensors_equal(want, have, name)
        if where:
            raise AssertionError(f"{who}: the final {where} differ")
