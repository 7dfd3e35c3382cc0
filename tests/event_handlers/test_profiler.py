"""ProfilerHandler: traces for exactly the scheduled steps, on the chosen ranks, none elsewhere."""

from __future__ import annotations

import json
import os
import re

import pytest

import estimatorch
from estimatorch import distributed
from estimatorch.event_handlers import ProfilerHandler
from estimatorch.events import Dispatch
from tests.conftest import make_batches, make_estimator

N_BATCHES = 4  # per epoch


def steps_in(path: str) -> list[int]:
    """The ``step N`` ranges a Chrome trace holds."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    return sorted({int(m.group(1)) for e in events if (m := re.fullmatch(r"step (\d+)", str(e.get("name", ""))))})


def test_traces_hold_exactly_the_scheduled_steps(tmp_path):
    profiler = ProfilerHandler(tmp_path, wait=1, warmup=1, active=2, repeat=2)
    assert profiler.scheduled_steps(3 * N_BATCHES) == [3, 4, 7, 8]
    make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[profiler])
    board = sorted(p for p in profiler.traces if p.endswith(".pt.trace.json"))
    chrome = sorted(p for p in profiler.traces if os.sep + "chrome" + os.sep in p)
    assert len(board) == len(chrome) == 2
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(p) for p in board] + ["chrome"])
    assert all(os.path.basename(p).startswith("rank0.") for p in board)
    assert sorted(os.path.basename(p).split(".")[1] for p in chrome) == ["steps3-4", "steps7-8"]
    for path in board + chrome:  # the warmup step and the others left out
        assert steps_in(path) in ([3, 4], [7, 8]), (path, steps_in(path))


def test_repeat_0_profiles_every_cycle_and_a_cut_cycle_writes_what_it_recorded(tmp_path):
    profiler = ProfilerHandler(tmp_path, wait=0, warmup=0, active=3, repeat=0)
    make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[profiler])
    chrome = sorted(p for p in profiler.traces if "chrome" in p)
    assert [steps_in(p) for p in chrome] == [[1, 2, 3], [4]]


def test_a_rank_not_chosen_writes_nothing_and_is_not_called(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "get_rank", lambda: 1)
    profiler = ProfilerHandler(tmp_path / "traces", wait=0, warmup=0, active=2, ranks=[0])
    assert not any(Dispatch([profiler]).batch_end) and not any(Dispatch([profiler]).batch_begin)
    make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[profiler])
    assert profiler.traces == [] and not os.path.exists(tmp_path / "traces")


def test_a_chosen_rank_names_its_files(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "get_rank", lambda: 1)
    profiler = ProfilerHandler(tmp_path, wait=0, warmup=1, active=1, ranks=None)
    make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[profiler])
    assert [os.path.basename(p).split(".")[0] for p in profiler.traces] == ["rank1", "rank1"]
    assert [steps_in(p) for p in profiler.traces] == [[2], [2]]


def test_a_resumed_fit_continues_the_schedule(tmp_path):
    est = make_estimator()
    est.fit(make_batches(N_BATCHES), epochs=1)
    profiler = ProfilerHandler(tmp_path, wait=2, warmup=1, active=2, repeat=2)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[profiler], resume=True)
    # steps 5..12 run: cycle 1 records 4-5 (only 5 runs here, its warmup at 3 was before), cycle 2 9-10
    assert profiler.scheduled_steps(12) == [4, 5, 9, 10]
    assert [steps_in(p) for p in profiler.traces if "chrome" in p] == [[5], [9, 10]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(active=0), "active must be an int >= 1, got 0"),
    (dict(wait=-1), "wait must be an int >= 0, got -1"),
    (dict(ranks=["0"]), "ranks must be None or non-negative ints"),
    (dict(record_shapes=1), "record_shapes must be a bool, got 1"),
])
def test_bad_arguments_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ProfilerHandler(tmp_path, **kwargs)


def test_exported():
    assert estimatorch.ProfilerHandler is ProfilerHandler
