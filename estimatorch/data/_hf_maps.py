"""A ``datasets`` ``.map(batched=True)`` or ``.filter(batched=True)`` whose draws are a function
of its position.

datasets resumes a batched map (a batched filter is one) from the state taken before the map
batch the position fell inside: it calls the function on that whole batch again and skips the
examples already yielded. The function's draws from the global generators then come from the
generators' state at the resume, not from the state they had when it first ran: other values,
silently (issue 39).

:func:`seed_batched_maps` makes each call of every batched ``.map()``/``.filter()`` function in a
pipeline draw from generators seeded from ``(seed, epoch, map, rank, worker, index of the batch's
first example)``, the same in the uninterrupted run and in the call a resume repeats; in the
training process the caller's generators are put back after the call, so the map's draws never
shift the model's. The index is the one datasets passes with ``with_indices=True`` (counted in the
map's own state, so restored with it); the wrapper takes it, and passes it on only if the map
asked for it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection, Iterator
from typing import Any

from torch.utils.data import get_worker_info

from .. import distributed, rng

__all__ = ["async_maps", "seed_batched_maps"]

_MAP_SALT = 0x3A9B
_STEPS = ("MappedExamplesIterable", "FilteredExamplesIterable")  # a filter is a map adding a mask


class _SeededBatchedMap:
    """A batched ``.map()`` function called with seeded generators (picklable: it goes to the
    DataLoader workers with the dataset)."""

    def __init__(self, function: Any, with_indices: bool, seed: int, number: int, epoch: Any):
        self.function, self.with_indices = function, with_indices
        self.seed, self.number = seed, number
        self.rank = distributed.get_rank()  # read here: a DataLoader worker may not see the process group
        self.epoch = epoch  # the dataset's epoch (a tensor datasets shares with persistent workers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        indices = args[-1]  # datasets passes the batch's example indices last (with_indices=True)
        if not self.with_indices:
            args = args[:-1]
        info = get_worker_info()
        place = rng.derive_seed(_MAP_SALT, self.number, self.rank, 0 if info is None else info.id + 1)
        first = indices[0] if len(indices) else -1
        with rng.sample_seeding(self.seed, int(self.epoch), restore=info is None) as seed_call:
            seed_call(first, salt=place)
            return self.function(*args, **kwargs)


def _nodes(root: Any) -> Iterator[Any]:
    todo = [root]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        yield node
        todo.append(getattr(node, "ex_iterable", None))
        todo.extend(getattr(node, "ex_iterables", None) or ())


def seed_batched_maps(dataset: Any, seed: int, threaded: Collection[int] = ()) -> int:
    """Wrap every synchronous ``.map(batched=True)`` and ``.filter(batched=True)`` function of
    ``dataset`` (a ``datasets.IterableDataset``) in place (again on a later ``fit``: only the seed
    changes), except the steps datasets runs in threads of its own (``threaded``: their ``id``s):
    seeding the global generators there would race the training thread's own draws (dropout), and
    their draws are not reproducible anyway (``fit`` names those that draw at its start); ``async``
    ones are left as they are too (their calls run concurrently, ahead of the training: named at
    fit start when they draw, see :func:`async_maps`). Returns how many it wrapped."""
    epoch = getattr(dataset, "_epoch", 0)
    count = 0
    for node in _nodes(getattr(dataset, "_ex_iterable", None)):
        if type(node).__name__ not in _STEPS or not node.batched or id(node) in threaded:
            continue
        filters = type(node).__name__ == "FilteredExamplesIterable"
        # a filter calls its function through datasets' add_mask, and rebuilds itself (in a worker,
        # with another format) from the function it was given: that one is wrapped
        function = node.mask_function if filters else node.function
        if isinstance(function, _SeededBatchedMap):
            function.seed, function.epoch, function.rank = seed, epoch, distributed.get_rank()
        elif not inspect.iscoroutinefunction(node.function):
            seeded = _SeededBatchedMap(function, bool(node.with_indices), seed, count, epoch)
            if filters:
                mask = node.function  # functools.partial(add_mask, function, mask_column_name=...)
                node.mask_function = seeded
                node.function = functools.partial(mask.func, seeded, *mask.args[1:], **mask.keywords)
            else:
                node.function = seeded
            node.with_indices = True
        else:
            continue
        count += 1
    return count


def async_maps(dataset: Any, threaded: Collection[int] = ()) -> list[Any]:
    """The ``.map()``/``.filter()`` steps of ``dataset`` whose function is ``async`` (outside
    datasets' threads, named for those already): datasets runs up to a thousand of their calls
    concurrently in an event loop, ahead of what is trained, and a resume runs those in flight again;
    their draws from the global generators interleave in an order no seed fixes."""
    return [node for node in _nodes(getattr(dataset, "_ex_iterable", None))
            if type(node).__name__ in _STEPS and id(node) not in threaded
            and inspect.iscoroutinefunction(node.function)]
