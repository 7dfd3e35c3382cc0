"""Metric accumulators of the saved ranks are combined by each state's reduction when an elastic
checkpoint is mapped onto another world size."""

from __future__ import annotations

import torch

from estimatorch import event_handlers
from estimatorch.estimator._state.elastic_resume import _scaled, batch_counters
from estimatorch.event_handlers.mixins import BATCH_EVENTS
from estimatorch.metrics import Metric
from estimatorch.statistics import WeightNorm


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
    return metric.state_dict()


def test_saved_ranks_combine_into_new_ranks_by_each_states_reduction():
    saved = [_state([1.0, 2.0]), _state([5.0]), _state([3.0, 3.0]), _state([0.5])]
    first, second = EveryReduction().combine_rank_states(saved, 2)
    assert float(first["total"]) == 14.5 and first["count"] == 6  # sums: on rank 0
    assert float(second["total"]) == 0.0 and second["count"] == 0  # the others: the default
    assert float(first["average"]) == float(second["average"]) == (1.5 + 5 + 3 + 0.5) / 4  # means: everywhere
    assert float(first["worst"]) == float(second["worst"]) == 5.0  # maxima: everywhere
    assert [t.tolist() for t in first["items"]] == [[1.0, 2.0], [5.0], [3.0, 3.0], [0.5]] and second["items"] == []
    assert first["pending"] == second["pending"] == []


def _built(name, tmp_path):
    special = {
        "CheckpointHandler": lambda cls: cls(str(tmp_path)),
        "ValidationHandler": lambda cls: cls([(1, 2)], lambda *a, **k: None),
        "TensorBoardHandler": lambda cls: cls(str(tmp_path)),
        "MeterHandler": lambda cls: cls([WeightNorm()], writer=event_handlers.TensorBoardHandler(str(tmp_path))),
        "LambdaHandler": lambda cls: cls(batch_end=print, epoch_end=print),
    }
    cls = getattr(event_handlers, name)
    return special.get(name, lambda cls: cls())(cls)


COUNTING = ["StoppingHandler", "CheckpointHandler", "ValidationHandler", "LoggingHandler", "ProgressBarHandler",
            "TerminateOnNaNHandler", "TensorBoardHandler", "MeterHandler", "LambdaHandler"]


def test_the_counters_scaled_on_a_topology_change_are_state_keys_of_their_handlers(tmp_path):
    for name in COUNTING:
        handler = _built(name, tmp_path)
        state, keys = handler.state_dict(), batch_counters(handler)
        assert keys, f"{name} counts batches: it declares elastic_batch_counters"
        for key in keys:
            outer, _, inner = key.partition(".")
            assert outer in state and (not inner or isinstance(state[outer], dict)), (name, key)
    assert "batch_end" in BATCH_EVENTS and "epoch_end" not in BATCH_EVENTS


def test_a_subclass_adds_counters_to_those_of_its_base():
    class Mine(event_handlers.LoggingHandler):
        elastic_batch_counters = ("mine",)

    assert batch_counters(Mine()) == ["mine", *event_handlers.LoggingHandler.elastic_batch_counters]


def test_counters_in_a_nested_state_are_scaled_and_nothing_else():
    state = {"counts": {"batch_end": 3, "epoch_end": 1}, "every": 3}
    keys = batch_counters(event_handlers.LambdaHandler(batch_end=print))
    assert _scaled(state, keys, lambda count: count * 2) == {"counts": {"batch_end": 6, "epoch_end": 1}, "every": 3}
