"""Whether the ``.map()`` / ``.filter()`` functions that ``datasets`` runs in its prefetch threads
(or, ``async``, concurrently in an event loop) draw from the global generators: probed when ``fit``
starts, on the first examples, so that the standard tokenize-then-shuffle pipeline (a tokenizer
draws nothing) is not warned about.

datasets 5 feeds a ``.shuffle()`` over several input shards from threads, one per shard, and runs
what comes before the shuffle in them; draws there from torch's, python's or numpy's global
generator happen in an order no seed fixes. The probe runs a copy of each such step of the
pipeline (with what is below it) in this thread over its first examples, one batch of a batched
map, watching the generators' states; every generator is put back afterwards.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import torch

from .. import rng

__all__ = ["drawing_steps", "drawing_threaded_maps", "threaded_maps"]

_STEPS = ("MappedExamplesIterable", "FilteredExamplesIterable")


def threaded_maps(pipeline: Iterator[tuple[Any, Optional[str]]]) -> list[tuple[Any, str]]:
    """The ``.map()``/``.filter()`` steps of a pipeline (``(step, where)`` pairs, the last step
    first; ``where`` is None for a step not run in threads) that run in threads, as ``(step,
    where)``, the first step first."""
    return [(node, where) for node, where in pipeline if where and type(node).__name__ in _STEPS][::-1]


def drawing_threaded_maps(pipeline: Iterator[tuple[Any, Optional[str]]], examples: int = 2) -> list[tuple[str, str]]:
    """The threaded steps (:func:`threaded_maps`) whose probe drew from a global generator, beyond
    what the steps before them drew, as ``(".map(name)", where)``; a step that cannot be probed
    counts as drawing (said in its name)."""
    return drawing_steps(threaded_maps(pipeline), examples)


def drawing_steps(steps: list[tuple[Any, str]], examples: int = 2) -> list[tuple[str, str]]:
    """Of ``steps`` (``(step, where)``, the first step of the pipeline first), those whose probe
    drew from a global generator beyond what the steps before them drew, as ``(".map(name)",
    where)``; a step that cannot be probed counts as drawing (said in its name)."""
    found = []
    below = False
    for node, where in steps:
        try:
            drew = _draws(node, examples)
        except Exception as err:  # noqa: BLE001 - a probe that fails leaves the doubt: named, not hidden
            found.append((f"{_name(node)} (not probed: {type(err).__name__}: {err})", where))
            continue
        if drew and not below:
            found.append((_name(node), where))
        below = below or drew
    return found


def _draws(node: Any, examples: int) -> bool:
    """Whether iterating a copy of ``node`` over its first ``examples`` draws from a generator."""
    probe = copy.deepcopy(node)  # iterating a step moves its own state: never the pipeline's
    with rng.keep_random_state():
        before = _states()
        examples_of = iter(probe)
        try:
            for _ in itertools.islice(examples_of, examples):
                pass
        finally:
            close = getattr(examples_of, "close", None)
            if close is not None:
                close()
            for loop, _ in getattr(probe, "_owned_loops_and_tasks", ()):  # an async step's event loop
                if not loop.is_running():
                    loop.close()
        return _states() != before


def _states() -> tuple[Any, ...]:
    """Every global generator's state, comparable with ``==``."""
    legacy: Any = np.random.get_state()
    return (torch.get_rng_state().numpy().tobytes(), random.getstate(),
            repr(rng.default_numpy_rng().bit_generator.state), legacy[0], legacy[1].tobytes(), legacy[2:])


def _name(node: Any) -> str:
    # a filter's function is datasets' add_mask around the user's (its mask_function)
    function = getattr(node, "mask_function", None) or getattr(node, "function", None)
    kind = ".map" if type(node).__name__ == "MappedExamplesIterable" else ".filter"
    return f"{kind}({getattr(function, '__qualname__', repr(function))})"
