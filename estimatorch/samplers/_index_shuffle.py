"""A keyed bijection over ``[0, n)``: the index at any position of an epoch's pseudo-random
order, computed directly, so that nothing of size ``n`` is ever held and positioning anywhere
costs O(1) (after Grain's ``index_shuffle`` and MosaicML Streaming's shuffles).

The resumable samplers and :class:`~estimatorch.samplers.ReproducibleShuffleSampler` choose an
epoch's order with their ``permutation`` argument:

- ``"randperm"``: ``torch.randperm(n)`` from a generator seeded with ``(seed, epoch)``. O(n)
  memory and time at every epoch start and every resume (a billion int64 indices are 8 GB).
- ``"feistel"``: :class:`IndexShuffle`, O(1) memory and O(1) work per index.
- ``"auto"`` (the default): ``"randperm"`` up to :data:`AUTO_THRESHOLD` samples, so the orders
  (and checkpoints) of smaller datasets are the ones they always were, ``"feistel"`` above it.

**The construction.** ``[0, n)`` is embedded in a rectangle of ``a * b >= n`` cells, ``a =
ceil(sqrt(n))`` and ``b = ceil(n / a)``, so fewer than ``a`` cells lie outside (a fraction
below ``1 / sqrt(n)``). A position ``p`` is the pair ``(p // b, p % b)``; each of
:data:`ROUNDS` Feistel rounds maps ``(left, right)`` to ``(right, (left + F_k(right)) mod
|left|)``, a bijection whatever the round function ``F_k`` (a multiply-xorshift hash of 32-bit
values keyed by 32 bits derived from ``(seed, epoch, round)``; every product stays below 2**63,
so int64 arithmetic is exact). A result outside ``[0, n)`` is mapped again (cycle-walking) until
it falls inside: still a bijection, and rare. A batch of positions is mapped as tensor
operations; only the few that walk are mapped again.

Example:
    >>> import torch
    >>> shuffle = IndexShuffle(10, seed=0, epoch=0)
    >>> order = shuffle(torch.arange(10))
    >>> sorted(order.tolist()) == list(range(10))
    True
    >>> torch.equal(shuffle(torch.tensor([7, 3])), order[[7, 3]])
    True
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import rng
from .._checks import is_int

__all__ = ["AUTO_THRESHOLD", "MAX_LENGTH", "PERMUTATIONS", "ROUNDS", "IndexShuffle", "check_permutation",
           "order_fingerprint", "resolve_permutation"]

#: the values of a ``permutation`` argument.
PERMUTATIONS = ("auto", "randperm", "feistel")
#: ``permutation="auto"`` picks ``"feistel"`` for more samples than this, else ``"randperm"``
#: (2**24: a randperm of that many costs 128 MB and about half a second at every epoch start).
AUTO_THRESHOLD = 2**24
#: the longest order :class:`IndexShuffle` permutes (every intermediate value fits int64).
MAX_LENGTH = 2**62
#: Feistel rounds (an even number, so a position's two halves end where they started).
ROUNDS = 6

_LEGACY = "randperm"
_SALT = 0xF315_7E1  # keys the rounds apart from every other seed derived from (seed, epoch)
_MASK32 = 0xFFFF_FFFF
_MUL1, _MUL2 = 0x7FEB_352D, 0x2C1B_3C6D  # odd and below 2**31: a 32-bit value times one fits int64


def resolve_permutation(permutation: Any, n: int) -> str:
    """The order an argument ``permutation`` gives ``n`` samples: ``"randperm"`` or ``"feistel"``.

    Raises:
        ValueError: ``permutation`` is not one of :data:`PERMUTATIONS`.
    """
    if not isinstance(permutation, str) or permutation not in PERMUTATIONS:
        raise ValueError(f"permutation must be 'auto', 'randperm' or 'feistel', got {permutation!r}")
    if permutation == "auto":
        return "feistel" if n > AUTO_THRESHOLD else _LEGACY
    return permutation


def order_fingerprint(obj: Any) -> dict[str, str]:
    """``{"permutation": ...}`` for an object whose ``permutation`` is not ``"randperm"``, else
    ``{}``: fingerprints and states written before the choice existed stay what they were."""
    permutation = getattr(obj, "permutation", None)
    return {} if permutation in (None, _LEGACY) else {"permutation": permutation}


def check_permutation(saved: Optional[str], now: Optional[str], source: str) -> None:
    """Refuse to resume ``source``, saved with the order ``saved``, with another order ``now``
    (None, as :func:`order_fingerprint` leaves it out, means ``"randperm"``).

    Raises:
        ValueError: naming both orders and the argument that chooses them.
    """
    saved, now = saved or _LEGACY, now or _LEGACY
    if saved != now:
        raise ValueError(
            f"cannot resume from {source}: it was written with permutation={saved!r} and this one uses "
            f"permutation={now!r}, so every epoch would train its samples in another order. Pass "
            f"permutation={saved!r} to the sampler (ResumableRandomSampler, ResumableDistributedSampler or "
            f"ReproducibleShuffleSampler; the DataLoader's sampler for fit); the default 'auto' picks "
            f"'feistel' above {AUTO_THRESHOLD} samples")


class IndexShuffle:
    """The permutation of ``[0, n)`` keyed by ``(seed, epoch)``: ``shuffle(positions)`` is the
    index at each position (see the module notes).

    Args:
        n: the length of the order, at most :data:`MAX_LENGTH`.
        seed: an int in ``[0, 2**64)``.
        epoch: a non-negative int.

    Example:
        >>> import torch
        >>> IndexShuffle(5, seed=1, epoch=0)(torch.arange(5)).sort().values.tolist()
        [0, 1, 2, 3, 4]
    """

    def __init__(self, n: int, seed: int, epoch: int):
        if not is_int(n) or not 0 <= n <= MAX_LENGTH:
            raise ValueError(f"n must be an int in [0, 2**62], got {n!r}")
        self.n = n
        self._rows = math.isqrt(n - 1) + 1 if n > 1 else 1
        self._cols = max(-(-n // self._rows), 1)
        self._keys = [rng.derive_seed(seed, epoch, _SALT, r) & _MASK32 for r in range(ROUNDS)]

    def _rounds(self, positions: torch.Tensor) -> torch.Tensor:
        """The Feistel network: a bijection of ``[0, rows * cols)``."""
        left = torch.div(positions, self._cols, rounding_mode="floor")
        right = positions - left * self._cols
        size_left, size_right = self._rows, self._cols
        for key in self._keys:
            mixed = right ^ key  # below 2**32: right <= 2**31, key < 2**32
            mixed.mul_(_MUL1).bitwise_and_(_MASK32)
            mixed.bitwise_xor_(mixed >> 15)
            mixed.mul_(_MUL2).bitwise_and_(_MASK32)
            mixed.bitwise_xor_(mixed >> 13)
            left.add_(mixed).remainder_(size_left)
            left, right, size_left, size_right = right, left, size_right, size_left
        return left.mul_(size_right).add_(right)

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The indices at ``positions``, a 1-D int64 tensor of values in ``[0, n)`` (a new tensor)."""
        indices = self._rounds(positions)
        walking = (indices >= self.n).nonzero().squeeze(1)
        while walking.numel():  # cycle-walking: fewer than 1 in sqrt(n) positions take a step
            stepped = self._rounds(indices[walking])
            indices[walking] = stepped
            walking = walking[stepped >= self.n]
        return indices
