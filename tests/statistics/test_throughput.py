"""Throughput: samples per second over an epoch, resumable."""

from __future__ import annotations

import pytest
import torch

from estimatorch.statistics import Throughput


class Est:
    batch_axis = 0


def test_counts_samples_from_label_shapes():
    stat = Throughput()
    stat.epoch_begin(Est())
    for n in (8, 8, 3):
        stat.batch_end(Est(), label=torch.zeros(n))
    assert stat.samples == 19 and stat.reduction == "sum" and stat.running
    assert stat.scalars()[""] > 0


def test_state_carries_samples_and_seconds():
    stat = Throughput()
    stat.epoch_begin(Est())
    stat.batch_end(Est(), label=torch.zeros(10))
    state = stat.state_dict()
    assert state["samples"] == 10 and state["seconds"] > 0
    resumed = Throughput()
    resumed.epoch_begin(Est())
    resumed.load_state_dict(state)
    assert resumed.samples == 10 and resumed.state_dict()["seconds"] >= state["seconds"]
    with pytest.raises(ValueError, match="seconds"):
        resumed.load_state_dict({"samples": 1})
