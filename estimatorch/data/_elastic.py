"""Elastic mode: a training stream laid out in global optimizer steps, so that a run can resume on
another world size and train the same samples in every optimizer step.

A fit is elastic when one of its handlers asks for it (``CheckpointHandler(..., elastic=True)``):
``fit`` then opens its stream with ``elastic_steps`` (:func:`estimatorch.data.open_stream`), and
a map-style loader's stream lays its batches out with an :class:`ElasticLayout`
(:func:`elastic_layout`), from the first step of the first run on (a checkpoint written without
it keeps its world size). Another stream kind refuses (:func:`elastic_refusal`).

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

**What a resume on another world size reproduces** (``estimatorch.estimator._state.elastic_resume`` maps
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
from ..samplers import order_fingerprint
from ..samplers.resumable import ResumableDistributedSampler, ResumableRandomSampler, ResumableSequentialSampler
from ._fingerprint import ELASTIC, LAYOUT_KEY

__all__ = ["ElasticLayout", "elastic_layout", "elastic_refusal", "slot_positions"]

#: what elastic=True needs of train_data, in words.
_NEEDS = ("elastic=True lays the samples of every optimizer step out over the processes, so train_data "
          "must be a map-style DataLoader with a batch_size and a sampler estimatorch orders by (seed, "
          "epoch): shuffle=True or False, a torch DistributedSampler or an estimatorch ResumableRandomSampler, "
          "ResumableSequentialSampler or ResumableDistributedSampler")


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

    def step_samples(self, step: int) -> int:
        """The samples the ``S`` slots of step ``step`` of an epoch hold together (a sample repeated
        to fill a slot counts each time): ``b * S``, but in an epoch's last, incomplete step.

        Example:
            >>> layout = ElasticLayout(None, [], 10, 2, 1, 0, 2, False, 0)
            >>> [layout.step_samples(s) for s in range(3)]
            [4, 4, 2]
        """
        size = self.batch_size * self.slots
        left = self.n - step * size
        return size if left >= size else max(left, self.slots)

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
        return {LAYOUT_KEY: ELASTIC, "dataset_len": self.n, "batch_size": self.batch_size,
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


def elastic_refusal(given: str) -> ValueError:
    """The ``ValueError`` of data that cannot be laid out in global steps; ``given`` says what it
    is ("train_data that is a list or tuple of batches")."""
    return ValueError(f"{_NEEDS}; got {given}")


def elastic_layout(sampler: Any, sampler_name: str, n: int, batch_size: Optional[int], drop_last: bool, seed: int,
                   accumulation_steps: int, device: Optional[torch.device]) -> ElasticLayout:
    """The layout of a map-style loader's ``n`` samples in global steps of this process group,
    ``accumulation_steps`` batches of ``batch_size`` per process and step; raises ``ValueError``
    before any work when its sampler has no order estimatorch knows or no step fits."""
    found = _order_of(sampler) if batch_size is not None else None
    if found is None or batch_size is None:
        raise elastic_refusal(f"a DataLoader with batch_size={batch_size!r} and a {sampler_name}")
    order, key, sampler_drops = found
    layout = ElasticLayout(order, key, n, batch_size, distributed.get_world_size(), distributed.get_rank(),
                           accumulation_steps, drop_last or sampler_drops, seed, device,
                           getattr(sampler, "permutation", None))
    if layout.batches_per_epoch == 0:
        raise ValueError(f"train_data yields no optimizer step with elastic=True and drop_last=True: "
                         f"{layout.n} samples, fewer than one global batch of {layout.batch_size} x "
                         f"{layout.world_size} processes x {accumulation_steps} accumulation steps")
    return layout
