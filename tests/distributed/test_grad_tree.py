"""The canonical tree over a step's slots: its blocks, the binary counter that folds a rank's slots,
and the combination of every rank's partial sums, the same floats for any split (W, k) of S slots
and for any sharding of the elements; a left-to-right sum is not (the test can tell)."""

from __future__ import annotations

import pytest
import torch

from estimatorch.distributed._grad_tree import Frontier, Node, blocks, combine, split


def _leaves(slots, n=257, seed=0):
    """Gradients whose additions round differently in different orders (magnitudes 1e-4 to 1e4)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 5, (n,), generator=g) for _ in range(slots)]


def _reference(leaves, lo, hi):
    """The tree by its definition: split at the largest power of two below the node's size."""
    if hi - lo == 1:
        return leaves[lo].clone()
    mid = lo + split(hi - lo)
    return _reference(leaves, lo, mid) + _reference(leaves, mid, hi)


def _on_split(leaves, world):
    """Each of ``world`` ranks folds its contiguous slots; the frontiers are combined."""
    k = len(leaves) // world
    nodes = []
    for rank in range(world):
        frontier = Frontier()
        for slot in range(rank * k, rank * k + k):
            frontier.push(slot, [leaves[slot].clone()])
        assert [(n.start, n.size) for n in frontier.nodes] == blocks(rank * k, rank * k + k)
        nodes += frontier.nodes
    return combine(nodes, len(leaves))[0]


def test_split_and_blocks():
    assert [split(n) for n in range(2, 10)] == [1, 2, 2, 4, 4, 4, 4, 8]
    assert blocks(0, 8) == [(0, 8)] and blocks(0, 6) == [(0, 4), (4, 2)]
    assert blocks(2, 4) == [(2, 2)] and blocks(3, 6) == [(3, 1), (4, 2)] and blocks(1, 4) == [(1, 1), (2, 2)]


@pytest.mark.parametrize("slots", [1, 2, 3, 4, 6, 8, 12])
def test_every_split_of_the_slots_sums_the_same_floats(slots):
    leaves = _leaves(slots)
    want = _reference(leaves, 0, slots)
    for world in (w for w in range(1, slots + 1) if slots % w == 0):
        assert torch.equal(_on_split(leaves, world), want), (slots, world)


def test_a_left_to_right_sum_is_not_the_same_floats():
    """What the tree is for: another order of the same additions rounds otherwise."""
    leaves = _leaves(8)
    running = leaves[0].clone()
    for leaf in leaves[1:]:
        running += leaf
    assert not torch.equal(running, _reference(leaves, 0, 8))


def test_shards_of_every_node_combine_into_the_shards_of_the_sum():
    leaves = _leaves(6, n=10)
    want = _reference(leaves, 0, 6)
    for cut in ((0, 3), (3, 7), (7, 10)):
        nodes = []
        for rank in range(3):  # 3 ranks x 2 slots, then only elements cut[0]:cut[1] of each node
            frontier = Frontier()
            for slot in (2 * rank, 2 * rank + 1):
                frontier.push(slot, [leaves[slot].clone()])
            nodes += [Node(n.start, n.size, [n.tensors[0][cut[0]:cut[1]].clone()]) for n in frontier.nodes]
        assert torch.equal(combine(nodes, 6)[0], want[cut[0]:cut[1]])


def test_a_step_cut_short_adds_the_slots_it_holds():
    leaves = _leaves(4)
    nodes = [Node(0, 1, [leaves[0].clone()]), Node(2, 1, [leaves[2].clone()])]  # 2 ranks x 1 of 2 slots
    assert torch.equal(combine(nodes, 4)[0], leaves[0] + leaves[2])
    assert combine([], 4) is None
