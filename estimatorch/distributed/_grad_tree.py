"""The canonical tree over an optimizer step's ``S`` slots (micro-batches): the one order in which
their gradients are added, whatever process holds which slot (``world_size_invariant``).

**The tree.** A node over ``n > 1`` slots splits at ``m``, the largest power of two below ``n``:
its left child holds the first ``m`` slots, its right child the others, and its sum is left +
right. So the step's sum is ``B1 + (B2 + (B3 + ...))`` over the blocks of ``S``'s binary
decomposition (``S = 6``: ``(s0+s1)+(s2+s3)`` plus ``s4+s5``), each block a perfect binary tree.
Every block of ``2^p`` slots that starts at a multiple of ``2^p`` (an *aligned block*) is a node
of it, and a rank's contiguous slots ``[r k, r k + k)`` split into a few maximal aligned blocks
(its *frontier*: one for a power-of-two ``k`` at an aligned start, at most ``2 log2 k`` else).

**Folding.** :class:`Frontier` is a binary counter over global slot indices: slots pushed left to
right merge with the node before them while the two make an aligned block, so a rank holds
``O(log k)`` partial sums at any time; :func:`combine` then adds frontier nodes (its own, or
every rank's after an exchange) up the rest of the tree. Addition is elementwise, so a shard of
every node (the same elements of each) combines into the same shard of the sum: the tree can be
finished shard by shard on different ranks.

Example:
    >>> blocks(3, 8)  # slots 3 to 7: slot 3, then the aligned block 4-7
    [(3, 1), (4, 4)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Frontier", "Node", "blocks", "combine", "split"]


def split(n: int) -> int:
    """The size of the left child of a node over ``n >= 2`` slots: the largest power of two below ``n``.

    Example:
        >>> [split(n) for n in (2, 3, 4, 5, 8, 9)]
        [1, 2, 2, 4, 4, 8]
    """
    return 1 << ((n - 1).bit_length() - 1)


def blocks(lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal aligned blocks ``(start, size)`` of slots ``[lo, hi)``, left to right: what a
    :class:`Frontier` holds after slots ``lo`` to ``hi - 1`` were pushed."""
    out: list[tuple[int, int]] = []
    for slot in range(lo, hi):
        start, size = slot, 1
        while out and out[-1][1] == size and out[-1][0] + size == start and out[-1][0] % (2 * size) == 0:
            start = out.pop()[0]
            size *= 2
        out.append((start, size))
    return out


@dataclass
class Node:
    """The sum of slots ``start`` to ``start + size - 1``, as tensors (a gradient per parameter, or
    one flat shard)."""

    start: int
    size: int
    tensors: list[torch.Tensor]


class Frontier:
    """The canonical tree's partial sums of the slots pushed so far (a binary counter)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def push(self, slot: int, tensors: list[torch.Tensor]) -> None:
        """Fold slot ``slot``'s tensors in (slots arrive left to right; ``tensors`` become the
        node's: they are added to in place)."""
        node = Node(slot, 1, tensors)
        nodes = self.nodes
        while nodes and nodes[-1].size == node.size and nodes[-1].start + node.size == node.start \
                and nodes[-1].start % (2 * node.size) == 0:
            left = nodes.pop()
            torch._foreach_add_(left.tensors, node.tensors)
            node = Node(left.start, 2 * node.size, left.tensors)
        nodes.append(node)

    def clear(self) -> None:
        self.nodes = []


def combine(nodes: list[Node], slots: int) -> Optional[list[torch.Tensor]]:
    """The canonical sum over ``[0, slots)`` of ``nodes`` (aligned blocks, disjoint; a slot none
    holds adds nothing: a step cut short), added in place into the leftmost node's tensors;
    None when no node holds anything."""
    by_place = {(n.start, n.size): n.tensors for n in nodes}

    def node(lo: int, hi: int) -> Optional[list[torch.Tensor]]:
        found = by_place.get((lo, hi - lo))
        if found is not None or hi - lo == 1:
            return found
        mid = lo + split(hi - lo)
        left, right = node(lo, mid), node(mid, hi)
        if left is None or right is None:
            return right if left is None else left
        torch._foreach_add_(left, right)
        return left

    return node(0, slots) if slots > 0 else None
