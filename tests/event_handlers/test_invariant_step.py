"""What a ``world_size_invariant`` fit warns of at its start: torch thread counts that differ
between the ranks (the gathered counts, by rank; the running statistics' warning is in
test_gradient_update.py)."""

from __future__ import annotations

import warnings

import pytest

from estimatorch.event_handlers._invariant_step import warn_thread_counts


def test_thread_counts_that_differ_between_ranks_are_named_and_equal_ones_are_not():
    with pytest.warns(UserWarning, match=r"run torch on \[2, 1\] threads \(by rank\).*torch.set_num_threads"):
        warn_thread_counts([2, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_thread_counts([4, 4, 4])
        warn_thread_counts([1])
