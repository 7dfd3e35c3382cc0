"""Where a thread is, in words, and the watchdog's summary line over the ranks
(:mod:`estimatorch.distributed._rank_where`)."""

from __future__ import annotations

import sys
import threading
import time

import torch

from estimatorch.distributed._rank_where import summarize, where_is


def _frame_of(target):
    """Run ``target(event)`` in a thread until it blocks; returns its innermost frame and a release."""
    release, started = threading.Event(), threading.Event()
    thread = threading.Thread(target=target, args=(started, release), daemon=True)
    thread.start()
    started.wait(5)
    time.sleep(0.1)
    return sys._current_frames()[thread.ident], lambda: (release.set(), thread.join(5))


class _Frozen(torch.utils.data.Dataset):
    def __init__(self, started, release):
        self.started, self.release = started, release

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.started.set()
        self.release.wait(10)
        return torch.zeros(2)


def test_where_names_the_datasets_getitem_and_the_line():
    def target(started, release):
        next(iter(torch.utils.data.DataLoader(_Frozen(started, release), batch_size=2)))

    frame, release = _frame_of(target)
    try:
        line = _Frozen.__getitem__.__code__.co_firstlineno + 2
        assert where_is(frame) == f"in the dataset's __getitem__ (test_rank_where.py:{line})"
    finally:
        release()


def test_where_names_the_collate_function():
    def target(started, release):
        def collate(samples):
            started.set()
            release.wait(10)
            return samples

        next(iter(torch.utils.data.DataLoader(list(range(4)), batch_size=2, collate_fn=collate)))

    frame, release = _frame_of(target)
    try:
        assert where_is(frame).startswith("in the DataLoader's collate (test_rank_where.py:")
    finally:
        release()


def test_where_names_a_plain_function_and_a_thread_that_ended():
    def target(started, release):
        started.set()
        release.wait(10)

    frame, release = _frame_of(target)
    try:
        assert where_is(frame).startswith("in target (test_rank_where.py:")
    finally:
        release()
    assert where_is(None) == "gone (its training thread ended)"


def test_the_summary_names_the_rank_behind_before_the_ranks_waiting_for_it():
    statuses = {0: {"step": 12, "where": "in backward (under DDP ...)", "path": "/run/hang_stacks_rank0_step12_1.txt"},
                1: {"step": 12, "where": "in the dataset's __getitem__ (data.py:41)", "path": None},
                2: {"step": 13, "where": "waiting in a collective (all_reduce)", "path": None}}
    assert summarize(statuses, 4, 60) == (
        "watchdog: no step completed for 60 s; behind: rank 1: step 12, in the dataset's __getitem__ (data.py:41)"
        " | others: rank 0: step 12, in backward (under DDP ...); rank 2: step 13, waiting in a collective "
        "(all_reduce) | no answer from rank 3 | stacks: /run/hang_stacks_rank*")
    # every rank waiting: the fewest steps decide
    waiting = {0: {"step": 3, "where": "waiting in a collective (barrier)"},
               1: {"step": 4, "where": "waiting in a collective (barrier)"}}
    assert summarize(waiting, 2, 1.5).startswith("watchdog: no step completed for 1.5 s; behind: rank 0: step 3,")
