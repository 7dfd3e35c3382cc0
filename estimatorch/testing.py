"""Test helpers for your own suite: :func:`assert_resumable` proves a training setup resumes
bit-identically from a checkpoint at any step; :func:`check_stream_adapter` proves the stream a
data adapter opens (see :mod:`estimatorch.data`) resumes exactly at every kind of position.

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
import random
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch

from . import rng
from .data import TrainStream, open_stream
from .estimator import default_logger
from .event_handlers import BatchEnd, CheckpointHandler, ProgressBarHandler
from .events import EstimatorView

__all__ = ["assert_resumable", "check_stream_adapter"]


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


# -- the adapter conformance check ----------------------------------------------------------------
def _plain(value: Any) -> Any:
    """``value`` with numpy arrays as tensors (compared bitwise like them)."""
    if type(value).__module__ == "numpy" and hasattr(value, "shape"):
        return torch.as_tensor(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _step_draws() -> None:
    """What a training step draws from the global generators (dropout, a random augmentation of
    the step): the stream must neither shift them nor depend on them."""
    torch.rand(1)
    random.random()
    rng.default_numpy_rng().random()


def _round_trip(state: Any) -> Any:
    """``state`` as a checkpoint gives it back (``torch.save``, then ``torch.load(weights_only=True)``)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _reference(stream: TrainStream, epochs: int) -> tuple[list[list[Any]], dict[tuple[int, int], tuple[Any, Any]]]:
    """Every epoch's batches, and at each boundary ``(epoch, batches done)`` the stream's state
    and the generators' (``(0, 0)``: before the first; ``(epoch + 1, 0)``: after the epoch's
    iterator ended)."""
    batches: list[list[Any]] = []
    saved = {(0, 0): (_round_trip(stream.state_dict()), rng.get_state())}
    for epoch in range(epochs):
        batches.append([])
        for batch in stream.epoch_iter(epoch, 0):
            batches[-1].append(_plain(batch))
            _step_draws()
            saved[(epoch, len(batches[-1]))] = (_round_trip(stream.state_dict()), rng.get_state())
        saved[(epoch + 1, 0)] = (_round_trip(stream.state_dict()), rng.get_state())
    return batches, saved


def check_stream_adapter(make_data: Callable[[int], Any], *, num_workers: Sequence[int] = (0, 2), epochs: int = 2,
                         seed: int = 0) -> None:
    """Check that the training stream ``fit`` opens for your data resumes exactly: the conformance
    check of a data adapter (``estimatorch.data.register_adapter``), run on your own data.

    For each worker count, the stream of ``make_data(num_workers)`` (opened by the registered
    adapters, as ``fit`` opens it) is read for ``epochs`` epochs, with a step's random draws
    between batches; then fresh streams of fresh data resume from its states (saved as a
    checkpoint saves them, with the generators' states) at the start, the middle of the first
    epoch, its last batch, and after it, and must yield the same batches to the last bit, and
    accept the saved fingerprint, and leave the global generators as the uninterrupted read left
    them at each epoch's end. It also checks ``batches_per_epoch`` where the stream knows it.

    Args:
        make_data: ``make_data(num_workers)`` -> what you pass to ``fit`` as ``train_data``,
            built afresh at each call; how it uses ``num_workers`` (a ``DataLoader``'s, a pool of
            readers...) is yours.
        num_workers: the worker counts to check. Defaults to (0, 2).
        epochs: epochs read, at least 2. Defaults to 2.
        seed: the fit's seed. Defaults to 0.

    Raises:
        AssertionError: naming the position, the worker count and the first batch that differs
            (or the fingerprint refused, the batch count wrong).
        ValueError: ``epochs`` is below 2, or the data's first epoch has fewer than 2 batches.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from estimatorch.testing import check_stream_adapter
        >>> data = TensorDataset(torch.arange(12.0))
        >>> check_stream_adapter(lambda workers: DataLoader(data, batch_size=3, shuffle=True), num_workers=(0,))
    """
    if not isinstance(epochs, int) or epochs < 2:
        raise ValueError(f"epochs must be an int of at least 2 (a resume after the first epoch), got {epochs!r}")
    for workers in num_workers:
        with rng.keep_random_state():
            rng.seed_everything(seed)
            stream = open_stream(make_data(workers), seed)
            try:
                fingerprint = _round_trip(stream.fingerprint())
                batches, saved = _reference(stream, epochs)
                known = stream.batches_per_epoch
            finally:
                stream.close()
            n = len(batches[0])
            if n < 2:
                raise ValueError(f"make_data({workers}) gives {n} batch(es) an epoch: the check needs at least 2")
            if known is not None and known != n:
                raise AssertionError(f"with num_workers={workers}: batches_per_epoch says {known}, "
                                     f"but the first epoch yielded {n} batches")
            for (epoch, done), where in (((0, 0), "the start"), ((0, n // 2), "the middle of an epoch"),
                                          ((0, n), "an epoch's last batch"), ((1, 0), "after the first epoch")):
                _check_resume(make_data, workers, seed, fingerprint, batches, saved, epoch, done, where)


def _check_resume(make_data: Callable[[int], Any], workers: int, seed: int, fingerprint: Any,
                  batches: list[list[Any]], saved: dict[tuple[int, int], tuple[Any, Any]], epoch: int, done: int,
                  where: str) -> None:
    at = f"resumed at {where} (epoch {epoch}, after batch {done}) with num_workers={workers}"
    state, generators = saved[(epoch, done)]
    rng.seed_everything(seed)
    stream = open_stream(make_data(workers), seed)
    try:
        try:
            stream.check_fingerprint(fingerprint, "the saved stream")
        except ValueError as err:
            raise AssertionError(f"{at}: a fresh stream refuses its own fingerprint: {err}") from None
        stream.load_state_dict(state)
        rng.set_state(generators)
        for e in range(epoch, len(batches)):
            got = []
            for batch in stream.epoch_iter(e, done if e == epoch else 0):
                got.append(_plain(batch))
                _step_draws()
            want = batches[e][done:] if e == epoch else batches[e]
            for i, (a, b) in enumerate(zip(want, got)):
                if _tensors_equal(a, b, "batch") is not None:
                    first = (done if e == epoch else 0) + i
                    raise AssertionError(f"{at}: epoch {e}'s batch {first} differs from the uninterrupted "
                                         f"read's ({_tensors_equal(a, b, 'batch')})")
            if len(got) != len(want):
                raise AssertionError(f"{at}: epoch {e} yielded {len(got)} batches after the position, the "
                                     f"uninterrupted read {len(want)}")
            differs = _tensors_equal(_plain(rng.get_state()), _plain(saved[(e + 1, 0)][1]), "the generators")
            if differs is not None:
                raise AssertionError(f"{at}: after epoch {e} {differs} differ from the uninterrupted read's: the "
                                     "stream draws from the global generators (a DataLoader without a generator "
                                     "of its own draws its workers' seed there), which shifts the model's dropout")
    finally:
        stream.close()

