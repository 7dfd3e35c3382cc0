"""The rank watch's pieces in one process: the watchdog's arguments, errors every rank raised
at once (not published), and the watchdog in a fit of one process (it reports and never stops
the run). Where a thread is and the summary line: tests/distributed/test_rank_where.py. The multi-process
behaviour is in tests/estimator/stopping/test_rank_failure.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, Watchdog, distributed
from estimatorch.distributed._rank_watch import RankWatch, _LocalStore, _one_line, mark_agreed
from estimatorch.event_handlers import BatchEnd


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "10"])
def test_a_watchdog_timeout_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises((ValueError, TypeError), match="watchdog"):
        Estimator(nn.Linear(2, 2), nn.MSELoss(), watchdog=value)


def test_a_watchdog_action_other_than_log_or_raise_is_refused():
    with pytest.raises(ValueError, match="watchdog action must be 'log' or 'raise', got 'kill'"):
        Watchdog(10, action="kill")


def test_an_estimator_takes_seconds_or_a_watchdog():
    assert Estimator(nn.Linear(2, 2), nn.MSELoss()).watchdog is None
    assert repr(Estimator(nn.Linear(2, 2), nn.MSELoss(), watchdog=30).watchdog) == "Watchdog(30, action='log')"
    dog = Watchdog(5, action="raise")
    assert Estimator(nn.Linear(2, 2), nn.MSELoss(), watchdog=dog).watchdog is dog


def test_a_worker_error_is_told_on_one_line():
    text = "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback:\n  File x\nValueError: boom\n"
    assert _one_line(text) == "Caught ValueError in DataLoader worker process 0. ... ValueError: boom"
    assert _one_line("plain") == "plain"


def test_an_error_every_rank_raised_at_once_is_not_told_as_one_ranks_failure():
    watch = RankWatch(lambda: 0, logging.getLogger("test"), None, lambda: ".")
    watch.multi = True  # as under a process group, with the store in memory
    watch.failed(mark_agreed(ValueError("rank 0 could not save")), 3)
    assert watch._get("failed") is None
    watch.failed(ValueError("only here"), 3)
    assert '"text": "only here"' in watch._get("failed")
    assert watch.peer_failure() is None  # its own failure is no peer's


class _SlowOnce(torch.utils.data.Dataset):
    """Sample 12 (step 4 of batches of 4) takes ``pause`` seconds, once."""

    def __init__(self, pause):
        self.pause, self.paused = pause, False

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if i == 12 and not self.paused:
            self.paused = True
            time.sleep(self.pause)
        return torch.full((2,), float(i)), torch.tensor(i % 2)


def test_the_watchdog_in_one_process_reports_a_stall_and_lets_the_run_finish(tmp_path, caplog):
    torch.manual_seed(0)
    net = nn.Linear(2, 2)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), watchdog=1)
    loader = torch.utils.data.DataLoader(_SlowOnce(pause=4.0), batch_size=4)
    with caplog.at_level(logging.WARNING, logger="estimatorch"):
        history = est.fit(loader, epochs=1, event_handlers=[CheckpointHandler(str(tmp_path), epoch_period=1)])
    assert len(history["train_loss"]) == 1 and est.position.step == 8  # never stopped
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("watchdog: no step")]
    assert len(summaries) == 1  # one report per stall
    assert summaries[0].startswith("watchdog: no step completed for 1 s; behind: rank 0: step 3, in the dataset's "
                                   "__getitem__ (test_rank_watch.py:")
    stacks = list(tmp_path.glob("hang_stacks_rank0_step3_*.txt"))
    assert len(stacks) == 1 and "_SlowOnce" not in stacks[0].read_text() and "__getitem__" in stacks[0].read_text()


def test_no_watch_thread_runs_in_one_process_without_a_watchdog():
    net = nn.Linear(2, 2)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    seen = []

    class Threads(BatchEnd):
        def batch_end(self, estimator, **kw):
            seen.extend(t.name for t in threading.enumerate())

    est.fit([(torch.randn(2, 2), torch.randn(2, 2))], epochs=1, event_handlers=[Threads()])
    assert "estimatorch-rank-watch" not in seen and not distributed.is_distributed()


def _pair():
    """Two ranks' watches over one store in memory, as under a process group of two."""
    store = _LocalStore()
    watches = []
    for rank in range(2):
        watch = RankWatch(lambda: 0, logging.getLogger("test"), None, lambda: ".")
        watch.store, watch.rank, watch.world, watch.multi = store, rank, 2, True
        watches.append(watch)
    return watches


def test_another_ranks_failure_is_named_and_an_error_every_rank_met_stays_its_own():
    w0, w1 = _pair()
    w1.failed(ValueError("bad label"), 4)
    error = w0.peer_error(RuntimeError("Connection closed by peer"))
    assert isinstance(error, distributed.RankFailedError) and error.rank == 1
    assert str(error) == "rank 1 failed at step 5: ValueError: bad label; rank 0 stopped too"
    assert "ValueError: bad label" in error.remote_traceback
    assert w0.peer_error(ValueError("bad label")) is None  # rank 0 met the same error itself
    assert w1.peer_error(ValueError("bad label")) is None  # its own failure
    assert w1._events() == 1  # announced once


def test_the_first_failure_is_the_one_told():
    w0, w1 = _pair()
    w1.failed(ValueError("first"), 2)
    w0.failed(KeyError("second"), 2)
    assert w0.peer_failure()["text"] == "first" and w1.peer_failure() is None
