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


def test_sequence_batches_also_count_tokens_per_second():
    stat = Throughput()
    stat.epoch_begin(Est())
    for _ in range(3):
        stat.batch_end(Est(), label=torch.zeros(4, 16, dtype=torch.long))  # a language model's targets
    assert (stat.samples, stat.tokens) == (12, 192)
    scalars = stat.scalars()
    assert set(scalars) == {"", "tokens"} and scalars["tokens"] == pytest.approx(scalars[""] * 16)
    resumed = Throughput()
    resumed.epoch_begin(Est())
    resumed.load_state_dict(stat.state_dict())
    assert resumed.tokens == 192
    resumed.load_state_dict({"samples": 3, "seconds": 1.0})  # a state of an earlier version
    assert resumed.tokens == 0


def test_other_batches_show_samples_per_second_only():
    stat = Throughput()
    stat.epoch_begin(Est())
    stat.batch_end(Est(), label=torch.zeros(4, 16))  # float targets (regression): not tokens
    stat.batch_end(Est(), label=torch.zeros(4, dtype=torch.long))
    assert stat.tokens == 0 and set(stat.scalars()) == {""}
