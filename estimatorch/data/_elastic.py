"""Elastic mode: a training stream laid out in global optimizer steps, so that a run can resume on
another world size and train the same samples in every optimizer step.

A fit is elastic when one of its handlers asks for it (``CheckpointHandler(..., elastic=True)``):
:func:`configure_elastic` then lays its ``DataLoader`` out with an :class:`ElasticLayout`, from
the first step of the first run on (a checkpoint written without it keeps its world size).

**Layout.** With ``b`` samples per batch and process, ``W`` processes and ``k`` accumulation
steps, an optimizer step trains ``S = W * k`` micro-batches ("slots") of ``b`` samples. The
epoch's order (a function of ``(seed, epoch)``, the same on any world size) is cut into steps of
``G = b * S`` samples and each step into its slots: slot ``m`` of step ``s`` holds the positions
``s*G + m*b`` to ``s*G + (m+1)*b - 1`` (:func:`slot_positions`). Rank ``r`` trains the slots
``r*k`` to ``r*k + k - 1`` of every step, in that order: one accumulation window is one
contiguous run of ``k*b`` samples. Any ``(W, k)`` with the same ``S`` and ``b`` gives each slot
the same samples; only the process that trains it changes.

**An epoch's last step** holds the ``R < G`` samples left, unless ``drop_last`` drops them; they
are shared out over the ``S`` slots in sizes that differ by at most one (the first ``R mod S``
slots take one more); with fewer samples than slots, slot ``m >= R`` repeats the epoch's sample
``m - R``. Every rank trains ``k`` batches in every step, so no rank waits for another and no
accumulation window is cut short at an epoch's end.

**Randomness.** Before each micro-batch, torch's generators (the CPU's and the estimator's CUDA
device's), python's ``random`` and :func:`estimatorch.rng.default_numpy_rng` are reseeded from
``(seed, epoch, s * S + m)`` (:func:`estimatorch.rng.seed_position`): the dropout of a slot does
not depend on the process that trains it. Draws between micro-batches (in ``epoch_end`` or
``epoch_begin`` handlers) continue from the last reseed.

**What a resume on another world size reproduces** (``estimatorch.estimator._elastic_resume`` maps
the checkpoint): the samples and the random draws of every micro-batch, hence the same losses;
the parameters bit for bit where the gradient sums are added in the same order (2 ranks <-> 1
rank x 2 accumulation steps: DDP's ``g0 / 2 + g1 / 2`` and the accumulated ``(g0 + g1) / 2`` are
the same floats), else to float rounding (4 ranks -> 2 x 2: gloo adds four gradients in another
order than two sums of two). Not reproduced: BatchNorm running statistics (DDP broadcasts rank
0's buffers before each forward, so with W ranks they follow rank 0's micro-batches, with one
rank every micro-batch in turn; the batch statistics a training step normalises with are the
micro-batch's own, the same on any topology), draws made in ``epoch_begin``/``epoch_end``
handlers (they continue from the last micro-batch this rank trained), and metric values to the
last bit (accumulators are combined in another order).

Example:
    >>> [list(slot_positions(10, batch_size=2, slots=2, step=s, slot=m)) for s in (0, 2) for m in (0, 1)]
    [[0, 1], [2, 3], [8], [9]]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional, Union

import torch

from .. import distributed, rng
from ..events import accumulation_steps, declared
from ..samplers import check_permutation, order_fingerprint
from ..samplers.resumable import ResumableDistributedSampler, ResumableRandomSampler, ResumableSequentialSampler
from ._iterable_streams import check_num_workers
from ._streams import _LoaderStream

__all__ = ["ElasticLayout", "check_fingerprint", "configure_elastic", "is_elastic", "slot_positions"]

#: the fingerprint key that marks an elastic stream (its value: the layout's name).
LAYOUT_KEY = "layout"
_ELASTIC = "elastic"


def slot_positions(n: int, batch_size: int, slots: int, step: int, slot: int) -> Union[range, list[int]]:
    """The positions, in an epoch's order of ``n`` samples, of slot ``slot`` of step ``step``
    (see the module notes); a pure function of its arguments.

    Example:
        >>> slot_positions(7, batch_size=4, slots=2, step=0, slot=1)  # a last step of 7: 4 and 3
        range(4, 7)
        >>> slot_positions(5, batch_size=4, slots=8, step=0, slot=6)  # 5 samples, 8 slots: repeats
        [1]
    """
    size = batch_size * slots
    start = step * size
    left = n - start
    if left >= size:
        return range(start + slot * batch_size, start + (slot + 1) * batch_size)
    if left >= slots:
        each, extra = divmod(left, slots)
        low = start + slot * each + min(slot, extra)
        return range(low, low + each + (slot < extra))
    return [start + slot] if slot < left else [(slot - left) % n]


class ElasticLayout:
    """Which samples each batch of this rank holds, and the seed of its random draws.

    Args:
        order: ``order(epoch)``, the epoch's order of every sample (an int64 tensor).
        order_key: what determines ``order`` (recorded in the fingerprint).
        n: the dataset's length.
        batch_size: samples per batch and process.
        world_size: processes.
        rank: this process's rank.
        accumulation_steps: batches per optimizer step and process.
        drop_last: drop an epoch's incomplete last step.
        seed: the seed random draws derive from.
        device: the device whose CUDA generator is reseeded too. Defaults to None (the CPU only).
        permutation: how ``order`` shuffles (``"feistel"`` is recorded in the fingerprint).
            Defaults to None (``"randperm"``, or not shuffled).
    """

    def __init__(self, order: Callable[[int], Any], order_key: Sequence[Any], n: int, batch_size: int,
                 world_size: int, rank: int, accumulation_steps: int, drop_last: bool, seed: int,
                 device: Optional[torch.device] = None, permutation: Optional[str] = None):
        self._order = order
        self.order_key = list(order_key)
        self.permutation = permutation
        self.n, self.batch_size, self.drop_last, self.seed, self.device = n, batch_size, drop_last, seed, device
        self.world_size, self.rank, self.accumulation_steps = world_size, rank, accumulation_steps
        self.slots = world_size * accumulation_steps
        full, rest = divmod(n, batch_size * self.slots)
        self.steps = full + (1 if rest and not drop_last else 0)
        self.batches_per_epoch = self.steps * accumulation_steps

    def slot(self, batch: int) -> tuple[int, int]:
        """``(step, slot)`` of this rank's batch ``batch`` of an epoch."""
        step, within = divmod(batch, self.accumulation_steps)
        return step, self.rank * self.accumulation_steps + within

    def micro_batch(self, batch: int) -> int:
        """The epoch-wide index of this rank's batch ``batch``: ``step * slots + slot``."""
        step, slot = self.slot(batch)
        return step * self.slots + slot

    def index_batches(self, epoch: int, start: int) -> Iterator[list[int]]:
        """This rank's batches of sample indices in ``epoch``, from its batch ``start``."""
        order = self._order(epoch)
        for batch in range(start, self.batches_per_epoch):
            positions = slot_positions(self.n, self.batch_size, self.slots, *self.slot(batch))
            picked = order[positions.start:positions.stop] if isinstance(positions, range) else order[positions]
            yield picked.tolist()

    def reseeding(self, batches: Iterator[Any], epoch: int, start: int) -> Iterator[Any]:
        """``batches`` (this rank's, from batch ``start``), reseeding the generators from the
        position before each is handed on."""
        for batch_index, batch in enumerate(batches, start):
            rng.seed_position(self.seed, epoch, self.micro_batch(batch_index), device=self.device)
            yield batch

    def fingerprint(self) -> dict[str, Any]:
        """What shapes the global stream: the same on every world size of the same global batch."""
        return {LAYOUT_KEY: _ELASTIC, "dataset_len": self.n, "batch_size": self.batch_size,
                "micro_batches_per_step": self.slots, "drop_last": self.drop_last, "order": self.order_key,
                "seed": self.seed, **order_fingerprint(self)}


def _order_of(sampler: Any) -> Optional[tuple[Callable[[int], Any], list[Any], bool]]:
    """``(order, order_key, drop_last)`` of a sampler whose epoch order does not depend on the
    world size (``order(epoch)`` an ``EpochOrder``, computed where it is read); None for any other."""
    kind = type(sampler)
    if kind is ResumableDistributedSampler:
        key = ["shuffled", sampler.seed] if sampler.shuffle else ["sequential", None]
        return sampler.order_view, key, sampler.drop_last
    if kind is ResumableRandomSampler:
        return sampler.epoch_view, ["shuffled", sampler.seed], False
    if kind is ResumableSequentialSampler:
        return sampler.epoch_view, ["sequential", None], False
    return None


#: what the user passed, by the stream ``make_train_stream`` made of it (for messages).
_GIVEN = {"_SequenceStream": "a list or tuple of batches", "StatefulIterableStream": "an IterableDataset",
          "_ReplayStream": "an iterable of batches without indices (a generator, an IterableDataset...)",
          "_EpochReplayStream": "a Hugging Face datasets.IterableDataset",
          "_StreamingStream": "a MosaicML StreamingDataset (whose samples streaming itself lays out over "
                              "the ranks)"}


def configure_elastic(stream: Any, handlers: Sequence[Any], device: torch.device) -> None:
    """Lay ``stream`` out in global steps when one of ``handlers`` asks for elastic checkpoints
    (``elastic_checkpoints``); raises ``ValueError`` before any work when its data
    cannot be laid out so."""
    if not any(declared(h, "elastic_checkpoints") for h in handlers):
        return
    why = ("elastic=True lays the samples of every optimizer step out over the processes, so train_data "
           "must be a map-style DataLoader with a batch_size and a sampler estimatorch orders by (seed, "
           "epoch): shuffle=True or False, a torch DistributedSampler or an estimatorch ResumableRandomSampler, "
           "ResumableSequentialSampler or ResumableDistributedSampler")
    if not isinstance(stream, _LoaderStream):
        given = _GIVEN.get(type(stream).__name__, type(stream).__name__)
        raise ValueError(f"{why}; got train_data that is {given}")
    batch_size = stream.batch_size
    found = _order_of(stream.sampler) if batch_size is not None else None
    if found is None or batch_size is None:
        raise ValueError(f"{why}; got a DataLoader with batch_size={stream.batch_size!r} and a {stream.sampler_name}")
    order, key, sampler_drops = found
    accumulation = accumulation_steps(handlers)
    layout = ElasticLayout(order, key, stream.dataset_len, batch_size, distributed.get_world_size(),
                           distributed.get_rank(), accumulation, stream.drop_last or sampler_drops, stream.seed,
                           device, getattr(stream.sampler, "permutation", None))
    if layout.batches_per_epoch == 0:
        raise ValueError(f"train_data yields no optimizer step with elastic=True and drop_last=True: "
                         f"{layout.n} samples, fewer than one global batch of {layout.batch_size} x "
                         f"{layout.world_size} processes x {accumulation} accumulation steps")
    stream.use_layout(layout)


def is_elastic(fingerprint: dict[str, Any]) -> bool:
    """Whether a data fingerprint is an elastic layout's."""
    return fingerprint.get(LAYOUT_KEY) == _ELASTIC


def check_fingerprint(saved: dict[str, Any], now: dict[str, Any], source: str) -> None:
    """Refuse to resume from ``source`` when its data fingerprint ``saved`` differs from this
    fit's ``now``, naming what differs (an elastic layout on one side only, or another global
    batch, in words)."""
    if is_elastic(saved) != is_elastic(now):
        if is_elastic(now):
            raise ValueError(f"cannot resume from {source} with elastic=True: it was written by a fit without it "
                             "(its samples are laid out per process); resume it without elastic=True")
        raise ValueError(f"cannot resume from {source}: it was written by a fit with CheckpointHandler(..., "
                         "elastic=True) (its samples are laid out in global steps): resume with elastic=True")
    check_permutation(saved.get("permutation"), now.get("permutation"), source)
    if "dataset" in saved and "dataset" in now:  # a stateful IterableDataset: one state per worker
        check_num_workers(saved.get("num_workers"), now.get("num_workers"), source)
    if is_elastic(now) and saved.get("batch_size") != now.get("batch_size"):
        raise ValueError(f"cannot resume from {source}: batch_size would change (saved {saved.get('batch_size')!r}, "
                         f"now {now.get('batch_size')!r}). Elastic resume keeps every micro-batch's samples: keep "
                         "batch_size, and change only world_size x accumulation_steps (their product stays "
                         f"{saved.get('micro_batches_per_step')!r})")
    if is_elastic(now) and saved.get("micro_batches_per_step") != now.get("micro_batches_per_step"):
        before, after = (f"{fp.get('batch_size')!r} samples x {fp.get('micro_batches_per_step')!r} micro-batches"
                         for fp in (saved, now))
        raise ValueError(f"cannot resume from {source}: the global batch would change (saved {before} per optimizer "
                         f"step, now {after}, from batch_size x world_size x accumulation_steps). Elastic resume keeps "
                         "the samples of every optimizer step: keep batch_size, and world_size x accumulation_steps")
    diffs = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        same = "drop_last and seed" if is_elastic(now) else "drop_last, world size and seed"
        raise ValueError(f"cannot resume from {source}: the data stream differs ({'; '.join(diffs)}). "
                         f"Resume with the same data, batch size, {same}.")
