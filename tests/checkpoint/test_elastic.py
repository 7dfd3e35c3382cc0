"""Metric accumulators of the saved ranks are combined by each state's reduction when an elastic
checkpoint is mapped onto another world size."""

from __future__ import annotations

import torch

from estimatorch.checkpoint._elastic import BATCH_COUNTERS, _combine_states
from estimatorch.metrics import Metric


class EveryReduction(Metric):
    def __init__(self):
        super().__init__("every")
        self.add_state("total", torch.tensor(0.0))
        self.add_state("count", 0)
        self.add_state("average", torch.tensor(0.0), reduce="mean")
        self.add_state("worst", torch.tensor(float("-inf")), reduce="max")
        self.add_state("items", [], reduce="cat")

    def update(self, preds, target):
        self.total += preds.sum()
        self.count += len(preds)
        self.average = preds.mean()
        self.worst = torch.maximum(self.worst, preds.max())
        self.items.append(preds)

    def _value(self, states):
        return states["total"] / states["count"]


def _state(values):
    metric = EveryReduction()
    metric.update(torch.tensor(values), None)
    return metric._states()


def test_saved_ranks_combine_into_new_ranks_by_each_states_reduction():
    folded = [_state([1.0, 2.0]), _state([5.0]), _state([3.0, 3.0]), _state([0.5])]
    first, second = _combine_states(EveryReduction(), folded, 2)
    assert float(first["total"]) == 14.5 and first["count"] == 6  # sums: on rank 0
    assert float(second["total"]) == 0.0 and second["count"] == 0  # the others: the default
    assert float(first["average"]) == float(second["average"]) == (1.5 + 5 + 3 + 0.5) / 4  # means: everywhere
    assert float(first["worst"]) == float(second["worst"]) == 5.0  # maxima: everywhere
    assert [t.tolist() for t in first["items"]] == [[1.0, 2.0], [5.0], [3.0, 3.0], [0.5]] and second["items"] == []
    assert first["pending"] == second["pending"] == []


def test_the_counters_scaled_on_a_topology_change_are_state_keys_of_their_handlers():
    from estimatorch import event_handlers

    for name, keys in BATCH_COUNTERS.items():
        handler_cls = getattr(event_handlers, name)
        assert set(keys) <= set(getattr(handler_cls, "_state_attrs", ())) | {"current_batch"}, name
