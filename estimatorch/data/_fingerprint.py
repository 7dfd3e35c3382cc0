"""The judge of a saved data fingerprint: may a checkpoint of that fingerprint resume this stream?

A fingerprint is a flat dict of what shapes a stream (its kind, its length, its batch size,
``drop_last``, the world size, the seed...): :meth:`TrainStream.fingerprint` writes it into every
checkpoint, and :meth:`TrainStream.check_fingerprint` judges a saved one with
:func:`compare_fingerprints`, the one place the rules live. A stream kind with a rule of its own
(a stateful ``IterableDataset``: the number of workers) states it first, in its own
``check_fingerprint``, then defers to this one.

Example:
    >>> compare_fingerprints({"seed": 0, "dataset_len": 8}, {"seed": 0, "dataset_len": 8}, "f.pt")
    >>> try:
    ...     compare_fingerprints({"seed": 0, "dataset_len": 8}, {"seed": 0, "dataset_len": 9}, "f.pt")
    ... except ValueError as err:
    ...     print(str(err).split(". ")[0])
    cannot resume from f.pt: the data stream differs (dataset_len: saved 8, now 9)
"""

from __future__ import annotations

from typing import Any

from .. import distributed
from ..samplers import check_permutation

__all__ = ["LAYOUT_KEY", "compare_fingerprints", "is_elastic"]

#: the fingerprint key that marks an elastic stream (its value: the layout's name).
LAYOUT_KEY = "layout"
ELASTIC = "elastic"


def is_elastic(fingerprint: dict[str, Any]) -> bool:
    """Whether a data fingerprint is an elastic layout's (see :class:`~estimatorch.data.ElasticLayout`)."""
    return fingerprint.get(LAYOUT_KEY) == ELASTIC


def compare_fingerprints(saved: dict[str, Any], now: dict[str, Any], source: str) -> None:
    """Refuse to resume from ``source`` when its data fingerprint ``saved`` differs from this
    fit's ``now``, naming what differs (an elastic layout on one side only, or another global
    batch, in words; else every key whose value differs, both values shown).

    Raises:
        ValueError: the fingerprints differ.
    """
    if is_elastic(saved) != is_elastic(now):
        if is_elastic(now):
            raise ValueError(f"cannot resume from {source} with elastic=True: it was written by a fit without it "
                             "(its samples are laid out per process); resume it without elastic=True")
        raise ValueError(f"cannot resume from {source}: it was written by a fit with CheckpointHandler(..., "
                         "elastic=True) (its samples are laid out in global steps): resume with elastic=True")
    check_permutation(saved.get("permutation"), now.get("permutation"), source)
    if is_elastic(now) and saved.get("batch_size") != now.get("batch_size"):
        raise ValueError(f"cannot resume from {source}: batch_size would change (saved {saved.get('batch_size')!r}, "
                         f"now {now.get('batch_size')!r}). Elastic resume keeps every micro-batch's samples: keep "
                         "batch_size, and change only world_size x accumulation_steps (their product stays "
                         f"{saved.get('micro_batches_per_step')!r})")
    if is_elastic(now) and saved.get("micro_batches_per_step") != now.get("micro_batches_per_step"):
        before, after = (f"{fp.get('batch_size')!r} samples x {fp.get('micro_batches_per_step')!r} micro-batches"
                         for fp in (saved, now))
        slots, world = saved.get("micro_batches_per_step"), distributed.get_world_size()
        split = (f"accumulation_steps={slots // world} on {world} process{'es' if world > 1 else ''}"
                 if isinstance(slots, int) and slots % world == 0 else
                 f"no accumulation_steps keeps {slots!r} micro-batches on {world} processes: resume on a number of "
                 f"processes that divides {slots!r}")
        raise ValueError(f"cannot resume from {source}: the global batch would change (saved {before} per optimizer "
                         f"step, now {after}, from batch_size x world_size x accumulation_steps). Elastic resume keeps "
                         f"the samples of every optimizer step: keep batch_size, and world_size x accumulation_steps "
                         f"({split})")
    diffs = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        same = "drop_last and seed" if is_elastic(now) else "drop_last, world size and seed"
        raise ValueError(f"cannot resume from {source}: the data stream differs ({'; '.join(diffs)}). "
                         f"Resume with the same data, batch size, {same}.")
