"""A training stream over an ``IterableDataset`` that saves its own position (``state_dict`` /
``load_state_dict``), given to ``fit`` directly or in a :class:`~torch.utils.data.DataLoader`
with any number of workers.

The loader is rebuilt around :class:`_StateCapture`, which batches and collates the dataset's
samples itself (as the DataLoader would) and sends every batch with what a resume at that batch
needs, the protocol of torchdata's ``StatefulDataLoader``:

- each worker holds its own copy of the dataset (its own share of the samples, its own state):
  with each batch it sends the number of batches it has made this epoch and, with every
  ``snapshot_every``-th (and its first, and the one its data ends in), that copy's
  ``state_dict()`` taken right after the batch (a snapshot); the training process keeps each
  worker's last snapshot and the number of that worker's batches trained since; a resume gives
  every worker both, and the worker re-makes and discards that many batches from its snapshot
  (reseeded as below, so they are the ones it made before) before it yields: each continues
  where the batch the loop trained last left it. A stream whose state is large (a shuffle
  buffer's content) sets ``snapshot_every`` > 1 so that its state is not copied, pickled and
  sent with every batch; 1 (the default) sends it with each;
- the batches are trained in a fixed round-robin over the workers (batches that arrive early are
  held back), so the order after a resume is the order without one;
- in a worker, the generators are reseeded from ``(seed, epoch, worker, batch)`` before each
  batch: its random draws do not depend on when the worker was started;
- the end of a worker's data is sent too, and recorded with the batch it ended in: a DataLoader
  that ran the dataset to its end to build a partial last batch leaves a dataset whose state may
  read "start of the next pass", and only this record tells that boundary from the other;
- with ``num_workers=0`` the dataset runs in the training process: its state is read when a
  checkpoint is taken, its draws come from your generators (saved and restored with the run),
  and creating the loader's iterator draws nothing from them (the rebuilt loader has a generator
  of its own). A signal that lands while a batch is being made (in ``collate_fn``, the dataset,
  a ``.map()``) lets that batch be made and trained, and stops at the boundary after it: the
  state read there is a boundary's, never a half-made batch's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .. import rng
from ._adapters import DataSource
from ._stream_base import LOADER_SALT, TrainStream, identity, loader_kwargs

__all__ = ["StatefulIterableAdapter", "StatefulIterableStream", "check_num_workers", "is_stateful_iterable"]

_WORKER_SALT = 0x3E11


class _StateCapture(IterableDataset[Any]):
    """What the rebuilt loader iterates: the user's dataset batched and collated here, each batch
    as ``(batch, meta)``; ``meta`` says which worker made it, how many it made this epoch, whether
    the dataset ended with it and (in workers) the dataset's state after it. A worker's last item
    is ``(None, meta)`` with ``meta["end"]``.

    Attributes it does not have itself are the dataset's, read and written: a ``worker_init_fn``
    that configures ``get_worker_info().dataset`` reaches the dataset.
    """

    _OWN = ("dataset", "batch_size", "drop_last", "collate_fn", "seed", "capture", "snapshot_every", "epoch",
            "pending")
    dataset: Any
    batch_size: Optional[int]
    drop_last: bool
    collate_fn: Callable[[Any], Any]
    seed: int
    capture: bool
    #: a worker sends its dataset's state with every this-many batches (and its first and last)
    snapshot_every: int
    epoch: int
    #: per worker, what it resumes from (dataset state, batches made, ended, batches made since
    #: that state); given once
    pending: Optional[list[dict[str, Any]]]

    def __init__(self, dataset: Any, batch_size: Optional[int], drop_last: bool,
                 collate_fn: Callable[[Any], Any], seed: int, capture: bool, snapshot_every: int = 1):
        values = dict(dataset=dataset, batch_size=batch_size, drop_last=drop_last, collate_fn=collate_fn,
                      seed=seed, capture=capture, snapshot_every=snapshot_every, epoch=0, pending=None)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataset" not in self.__dict__:  # while unpickling
            raise AttributeError(name)
        return getattr(self.__dict__["dataset"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __iter__(self) -> Iterator[tuple[Any, dict[str, Any]]]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        epoch, self.epoch = self.epoch, self.epoch + 1  # a persistent worker's copy counts on
        pending, self.pending = self.pending, None  # given once: to the workers created with it
        resume = pending[worker] if pending is not None else None
        made = replay = 0
        if resume is not None:
            if resume["state"] is not None:
                self.dataset.load_state_dict(resume["state"])
            made = resume["batches"]
            if resume["ended"]:
                yield None, self._meta(worker, made, ended=True, end=True)
                return
            replay = resume.get("since", 0)  # the batches made after that state: made again, not sent
            made -= replay
        since = self.snapshot_every  # batches sent since the last state sent (the first sent carries one)
        # in a worker, draws are a function of (seed, epoch, worker, batch); in the training
        # process they stay yours (saved and restored with the run)
        with rng.sample_seeding(self.seed, epoch, restore=False) as seed_batch:
            def reseed(batch: int) -> None:
                if info is not None:
                    seed_batch(batch, salt=_WORKER_SALT + worker)

            reseed(-1)
            it = iter(self.dataset)
            wanted = self.batch_size or 1
            while True:
                reseed(made)
                samples: list[Any] = []
                ended = False
                while len(samples) < wanted:
                    try:
                        samples.append(next(it))
                    except StopIteration:
                        ended = True
                        break
                if not samples or (ended and self.drop_last and self.batch_size is not None):
                    break
                batch = self.collate_fn(samples) if self.batch_size is not None else self.collate_fn(samples[0])
                made += 1
                if replay:  # made (collated too) as before the resume, trained after its state
                    replay -= 1
                    continue
                since += 1
                snapshot = since >= self.snapshot_every or ended
                since = 0 if snapshot else since
                yield batch, self._meta(worker, made, ended, snapshot=snapshot)
                if ended:
                    break
        yield None, self._meta(worker, made, ended=True, end=True)

    def _meta(self, worker: int, made: int, ended: bool, end: bool = False, snapshot: bool = True) -> dict[str, Any]:
        meta: dict[str, Any] = {"worker": worker, "batches": made, "ended": ended, "end": end}
        if self.capture and snapshot:
            meta["state"] = self.dataset.state_dict()
        return meta


def check_num_workers(saved: Optional[int], now: Optional[int], source: str) -> None:
    """Refuse to resume a stateful ``IterableDataset`` on another number of workers."""
    if saved == now:
        return
    raise ValueError(
        f"cannot resume from {source}: its IterableDataset ran in {saved or 0} DataLoader worker(s) "
        f"and this DataLoader has num_workers={now or 0}. Each worker iterates its own copy of the "
        "dataset (its own share of the samples) and the checkpoint holds each copy's state: they "
        f"cannot be shared out over another number of workers. Resume with num_workers={saved or 0}.")


class StatefulIterableStream(TrainStream):
    """An ``IterableDataset`` with ``state_dict``/``load_state_dict``, alone or in a DataLoader
    (any ``num_workers``): every resume continues each copy of the dataset from its own state.

    ``snapshot_every``: with workers, each sends its dataset's state with every this-many of its
    batches (and its first and last); a resume re-makes, in the worker, up to that many batches
    less one. 1 for a small state; a stream whose state is large sets more.
    """

    kind = "an IterableDataset"

    def __init__(self, dataset: Any, loader: Optional[DataLoader[Any]], seed: int, snapshot_every: int = 1):
        super().__init__(seed)
        if not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"snapshot_every must be an int >= 1, got {snapshot_every!r}")
        self.dataset = dataset
        self.workers = loader.num_workers if loader is not None else 0
        # in the training process a half-made batch advances the dataset's state and your generators
        self.stops_while_fetching = self.workers > 0
        self.persistent = loader is not None and loader.persistent_workers
        batch_size = loader.batch_size if loader is not None else None
        collate = loader.collate_fn if loader is not None else identity
        drop_last = loader.drop_last if loader is not None else False
        self._capture = _StateCapture(dataset, batch_size, drop_last, collate, seed, capture=self.workers > 0,
                                      snapshot_every=snapshot_every)
        self._generator = torch.Generator()
        self.loader: Optional[DataLoader[Any]] = None
        if loader is not None:
            self.loader = DataLoader(self._capture, batch_size=None, collate_fn=identity,
                                     generator=self._generator, **loader_kwargs(loader))
        n = max(self.workers, 1)
        self._states: list[Any] = [None] * n  # each worker's last dataset state sent with a trained batch
        self._since = [0] * n  # each worker's batches trained after that state
        self._made = [0] * n  # batches each worker made this epoch, up to the last trained one
        self._ended = [False] * n  # whether each worker's data ended (with its last trained batch)
        self._last = -1  # the worker whose batch trained last
        self._resumed = False
        self._started = False  # the loader's (persistent) workers exist

    def fingerprint(self) -> dict[str, Any]:
        fp = {**super().fingerprint(), "dataset": type(self.dataset).__name__}
        if self.workers:  # a 0-worker stream's fingerprint is the one earlier versions wrote
            fp["num_workers"] = self.workers
        return fp

    def check_fingerprint(self, saved: dict[str, Any], source: str) -> None:
        """The number of workers first (each holds its own copy's state), then the rest."""
        if "dataset" in saved:  # written by a stream of a dataset
            check_num_workers(saved.get("num_workers"), self.workers or None, source)
        super().check_fingerprint(saved, source)

    def state_dict(self) -> dict[str, Any]:
        if not self.workers:
            state = {"dataset": self.dataset.state_dict()}
            return {**state, "ended": True} if self._ended[0] else state
        return {"workers": [{"state": s, "batches": b, "ended": e, "since": k}
                            for s, b, e, k in zip(self._states, self._made, self._ended, self._since)],
                "last": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = True
        if not self.workers:
            self.dataset.load_state_dict(state["dataset"])
            self._ended[0] = bool(state.get("ended", False))
            return
        workers = state.get("workers")
        if not isinstance(workers, list):
            raise ValueError(f"the data state's 'workers' must be a list, got {type(workers).__name__}")
        if len(workers) != self.workers:  # check_fingerprint judged the number: a state at odds with it
            raise ValueError(f"the data state holds {len(workers)} worker states for {self.workers} workers")
        self._states = [w["state"] for w in workers]
        self._made = [int(w["batches"]) for w in workers]
        self._ended = [bool(w["ended"]) for w in workers]
        self._since = [int(w.get("since", 0)) for w in workers]  # absent (written before snapshots): 0
        if any(not 0 <= k <= b for k, b in zip(self._since, self._made)):
            raise ValueError(f"the data state's batches trained since each worker's state, {self._since}, must lie "
                             f"between 0 and its batches made, {self._made}")
        self._last = int(state["last"])

    def close(self) -> None:
        self.loader = None  # its persistent workers, if any, shut down with it

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        resumed, self._resumed = self._resumed, False
        n = max(self.workers, 1)
        if not (resumed and start):  # a new epoch
            self._made, self._ended, self._since, self._last = [0] * n, [False] * n, [0] * n, -1
            if not self.persistent:  # each epoch's workers copy the dataset afresh
                self._states = [None] * n
        elif all(self._ended):
            return iter(())  # the checkpoint was at the epoch's last batch
        if self.workers and not self._started or resumed and start:
            self._capture.pending = [{"state": s, "batches": b, "ended": e, "since": k}
                                     for s, b, e, k in zip(self._states, self._made, self._ended, self._since)]
        self._capture.epoch = epoch
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):  # before its copies reach the workers (a persistent worker's must share it)
            set_epoch(epoch)
        try:
            if self.loader is None:
                items: Iterator[Any] = iter(self._capture)
            else:
                self._generator.manual_seed(rng.derive_seed(self.seed, epoch, LOADER_SALT))
                items = iter(self.loader)  # the workers start here, with their copies of the dataset
                self._started = self.persistent
        finally:
            self._capture.pending = None
        return self._in_order(items)

    def _in_order(self, items: Iterator[tuple[Any, dict[str, Any]]]) -> Iterator[Any]:
        """The batches in round-robin over the workers, from the one after the last trained;
        a worker whose data ended drops out. What each batch says is recorded as it is trained."""
        n = len(self._ended)
        held: list[deque[Any]] = [deque() for _ in range(n)]
        turn = (self._last + 1) % n
        while not all(self._ended):
            worker = turn
            turn = (worker + 1) % n
            if self._ended[worker]:
                continue
            while not held[worker]:
                try:
                    batch, meta = next(items)
                except StopIteration:
                    return
                held[meta["worker"]].append((batch, meta))
            batch, meta = held[worker].popleft()
            before = self._record_of(worker)
            try:
                self._record(worker, meta)
            except BaseException:  # a signal's stop raised before the batch is handed out: not trained
                self._restore(worker, before)
                raise
            if not meta["end"]:
                yield batch  # nothing between the record and here lets a signal handler run

    def _record_of(self, worker: int) -> tuple[Any, int, int, bool, int]:
        return self._states[worker], self._since[worker], self._made[worker], self._ended[worker], self._last

    def _restore(self, worker: int, record: tuple[Any, int, int, bool, int]) -> None:
        (self._states[worker], self._since[worker], self._made[worker], self._ended[worker],
         self._last) = record

    def _record(self, worker: int, meta: dict[str, Any]) -> None:
        """What a batch of ``worker`` says, recorded as it is handed out to be trained (an end
        record: the worker's data ended)."""
        if "state" in meta:
            self._states[worker], self._since[worker] = meta["state"], 0
        elif not meta["end"]:
            self._since[worker] += 1
        self._made[worker], self._ended[worker] = meta["batches"], meta["ended"]
        if not meta["end"]:
            self._last = worker


def is_stateful_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is an ``IterableDataset`` that saves its own position."""
    return isinstance(dataset, IterableDataset) and hasattr(dataset, "state_dict") \
        and hasattr(dataset, "load_state_dict")


class StatefulIterableAdapter:
    """Opens an ``IterableDataset`` with ``state_dict``/``load_state_dict``, in a ``DataLoader``
    (any ``num_workers``) or alone."""

    name = "stateful-iterable"

    def recognises(self, source: DataSource) -> bool:
        return is_stateful_iterable(source.dataset)

    def open(self, source: DataSource) -> TrainStream:
        return StatefulIterableStream(source.dataset, source.loader, source.seed)
