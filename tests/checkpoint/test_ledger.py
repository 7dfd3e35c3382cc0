"""The run's ledger as the store keeps it: steps trained again counted from where later attempts
resumed, a checkpoint's ledger and the progress mark's combined, the totals and goodput derived
from the parts of each attempt's time, and a damaged ledger named by ``checkpoint.load``."""

from __future__ import annotations

import copy

import pytest

from estimatorch.checkpoint import (
    PARTS,
    CheckpointError,
    check_ledger,
    ledger_summary,
    ledger_table,
    merge_ledgers,
    scale_steps,
    settle,
)


def entry(attempt, resumed_from, last_step, ended="finished", *, started=0.0, seconds=10.0, steps=6.0, data=None,
          exact=True):
    times = dict.fromkeys(PARTS, 0.0)
    times.update(steps=steps, data=data, startup=seconds - steps - (data or 0.0))
    return {"attempt": attempt, "started": started, "resumed_from": resumed_from, "last_step": last_step,
            "exact": exact, "ended": ended, "reason": None, "world_size": 1, "seconds": seconds, "times": times,
            "steps_lost": 0}


def three_attempts():
    return [entry(1, None, 13, "killed", started=0.0), entry(2, 10, 27, "signal", started=20.0),
            entry(3, 27, 40, started=40.0)]


@pytest.mark.parametrize("resumes, last, lost", [
    ([None, 10, 27], [13, 27, 40], [3, 0, 0]),  # the run
    ([None, 10, 5], [13, 27, 40], [8, 17, 0]),  # the third resumed before both: both lose their steps past 5
    ([None, 10, 10], [13, 12, 40], [3, 2, 0]),  # the second died before its first checkpoint
    ([None], [40], [0]),
])
def test_steps_lost_are_those_past_the_earliest_later_resume(resumes, last, lost):
    attempts = [entry(i + 1, r, s) for i, (r, s) in enumerate(zip(resumes, last))]
    expected = []
    for i, a in enumerate(attempts):
        later = [b["resumed_from"] or 0 for b in attempts[i + 1:]]
        start = a["resumed_from"] or 0
        expected.append(max(0, a["last_step"] - max(start, min(later))) if later else 0)
    assert expected == lost  # the rule, spelled out
    assert [a["steps_lost"] for a in settle(attempts)] == lost


def test_the_summary_counts_the_wall_time_and_the_kept_steps_time():
    attempts = three_attempts()
    total = ledger_summary({"run_id": "r", "attempts": attempts})
    wall = attempts[-1]["started"] + attempts[-1]["seconds"] - attempts[0]["started"]
    kept = 6.0 * (13 - 3) / 13 + 6.0 + 6.0  # each attempt's step time, for its share of kept steps
    assert total["steps_lost"] == 3 and [a["steps_lost"] for a in total["attempts"]] == [3, 0, 0]
    assert total["seconds"] == pytest.approx(wall)
    assert total["seconds_between"] == pytest.approx(wall - 30.0)
    assert total["seconds_lost"] == pytest.approx(wall - kept)
    assert total["goodput"] == pytest.approx(kept / wall) and 0 < total["goodput"] < 1


def test_data_waits_count_as_the_steps_time_where_measured():
    one = entry(1, None, 10, steps=4.0, data=2.0)
    assert ledger_summary({"run_id": "r", "attempts": [one]})["goodput"] == pytest.approx(6.0 / 10.0)


def test_a_later_mark_of_the_same_run_speaks_for_the_attempts_after_the_checkpoint():
    saved = {"run_id": "r", "attempts": [entry(1, None, 10, "running", exact=False)]}
    marked = {"run_id": "r", "attempts": [entry(1, None, 13, "killed"), entry(2, 10, 12, "running")]}
    merged = merge_ledgers(saved, marked, over=True)
    # the second's steps are lost once a later attempt resumes before step 12 (not known yet)
    assert [(a["ended"], a["last_step"], a["steps_lost"]) for a in merged["attempts"]] == \
        [("killed", 13, 3), ("killed", 12, 0)]
    assert merged["attempts"][1]["reason"] == "no word from it after step 12"


def test_a_mark_of_another_run_or_an_older_one_is_ignored():
    saved = {"run_id": "r", "attempts": [entry(1, None, 13, "killed"), entry(2, 10, 20, "running", exact=False)]}
    other = {"run_id": "s", "attempts": [entry(1, None, 99, "running")]}
    older = {"run_id": "r", "attempts": [entry(1, None, 13, "running")]}
    for marked in (other, older, None):
        merged = merge_ledgers(copy.deepcopy(saved), marked, over=True)
        assert [a["last_step"] for a in merged["attempts"]] == [13, 20]
        assert merged["attempts"][-1]["ended"] == "killed"
        assert merged["attempts"][-1]["reason"] == "no word from it after step 20 (or later: no progress mark was found)"
    kept = merge_ledgers(copy.deepcopy(saved), None, over=False)
    assert kept["attempts"][-1]["ended"] == "running"  # inspect cannot tell without a mark
    assert merge_ledgers(None, older, over=True) is None  # a file of an earlier version: no ledger to continue


def test_an_elastic_resume_scales_the_steps_like_the_position():
    attempts = scale_steps(three_attempts(), lambda count: count // 2 * 4)
    assert [(a["resumed_from"], a["last_step"], a["steps_lost"]) for a in attempts] == \
        [(None, 24, 4), (20, 52, 0), (52, 80, 0)]


@pytest.mark.parametrize("change, words", [
    (lambda ledger: ledger.update(run_id=""), "ledger['run_id'] must be a non-empty str"),
    (lambda ledger: ledger["attempts"][1].update(ended="lost"), "ledger['attempts'][1]['ended'] must be one of"),
    (lambda ledger: ledger["attempts"][0].pop("seconds"), "ledger['attempts'][0] lacks ['seconds']"),
    (lambda ledger: ledger["attempts"][2]["times"].update(steps="1"), "['times']['steps'] must be a number"),
    (lambda ledger: ledger["attempts"][2].update(resumed_from=-1), "['resumed_from'] must be a non-negative int"),
])
def test_a_damaged_ledger_is_named(change, words):
    ledger = {"run_id": "r", "attempts": three_attempts()}
    check_ledger(ledger)
    change(ledger)
    with pytest.raises(CheckpointError) as caught:
        check_ledger(ledger)
    assert words in str(caught.value)


def test_the_table_has_a_row_per_attempt_and_the_totals():
    total = ledger_summary({"run_id": "r", "attempts": three_attempts()})
    lines = ledger_table(total)
    assert lines[0].startswith("ledger of run r: 3 attempt(s)")
    rows = [line.split() for line in lines[2:5]]
    assert [(row[0], row[3], row[4], row[5], row[6]) for row in rows] == \
        [("1", "-", "13", "killed", "3"), ("2", "10", "27", "signal", "0"), ("3", "27", "40", "finished", "0")]
    assert lines[-1].startswith("total: 3 steps trained again;") and f"goodput {total['goodput']:.3f}" in lines[-1]
