"""The warning ``fit`` gives at its start for data whose random draws no seed can fix.

:class:`NondeterministicDataWarning` is a ``UserWarning`` of its own, so that a user whose
functions draw nothing (a tokenizer) can silence it by category::

    warnings.filterwarnings("ignore", category=estimatorch.data.NondeterministicDataWarning)

and :func:`warn_threaded_maps` is the one place that words it, for every library that runs a
user's functions in threads of its own (a library that knows a function to be deterministic
leaves it out of what it passes); :func:`warn_async_maps` words it for ``async`` functions that a
library runs concurrently, ahead of the training.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._checks import warn_user

__all__ = ["NondeterministicDataWarning", "warn_async_maps", "warn_threaded_maps"]


class NondeterministicDataWarning(UserWarning):
    """``train_data`` runs functions of yours in threads, or ``async`` ones concurrently: their
    draws from the global generators (``torch.rand``, ``random``, ``np.random``) happen in an order
    no seed fixes, so a random one gives other values on every run, or after a resume."""


def warn_threaded_maps(owner: str, maps: Sequence[tuple[str, str]]) -> None:
    """Warn (once, at fit start) that ``owner``'s ``maps`` run in threads and drew randomness.

    Args:
        owner: what the user passed, in words (``"train_data's datasets.IterableDataset"``).
        maps: ``(what, where)`` per function that drew from a global generator (a library's
            adapter probes them; one that draws nothing, a tokenizer, is left out):
            ``(".map(augment)", "before its .shuffle()")``.
    """
    if not maps:
        return
    listed = "; ".join(f"{what} {where}" for what, where in maps)
    warn_user(
        f"{owner} runs functions of yours in the library's prefetch threads that drew from the global "
        f"generators on their first examples: {listed}. Draws there from the "
        "global generators (torch.rand, random, np.random) happen in an order no seed fixes, so a random one "
        "gives other values on every run, resumed or not, and races the model's own draws (dropout). Make "
        "such a function draw nothing (or from a generator seeded from the example), or apply it after "
        "the .shuffle() / interleave_datasets(); if their draws need not be reproducible, silence this with "
        "warnings.filterwarnings('ignore', category=estimatorch.data.NondeterministicDataWarning).",
        NondeterministicDataWarning)


def warn_async_maps(owner: str, maps: Sequence[str]) -> None:
    """Warn (once, at fit start) that ``owner``'s ``async`` ``maps`` (``".map(name)"``, those a
    probe saw draw from a global generator) run concurrently and are not resumed exactly."""
    if not maps:
        return
    warn_user(
        f"{owner} runs async functions of yours that drew from the global generators on their first examples: "
        f"{'; '.join(maps)}. The library runs many calls of an async function at once in an event loop, ahead of "
        "what is trained, and a resume runs those in flight again: their draws (torch.rand, random, np.random) "
        "interleave in an order no seed fixes, so a resumed run trains on other values than the uninterrupted one. "
        "Make such a function draw nothing (or from a generator seeded from the example) or make it a plain "
        "function (seeded by fit, resumed exactly); if their draws need not be reproducible, silence this with "
        "warnings.filterwarnings('ignore', category=estimatorch.data.NondeterministicDataWarning).",
        NondeterministicDataWarning)
