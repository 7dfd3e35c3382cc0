"""One writer per model_dir: a second fit gets a clear error naming the holder, a lock left by a
dead process is taken over with a warning, and the lock is released however the fit ends."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import LOCK_NAME, DirectoryLock, DirectoryLockedError
from estimatorch.event_handlers import BatchEnd
from tests.checkpoint.runs import build, dir_state, fit_run
from tests.conftest import Count

fcntl = pytest.importorskip("fcntl", reason="the directory lock needs fcntl.flock (POSIX)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HOLD = """
import sys
from estimatorch.checkpoint import DirectoryLock
lock = DirectoryLock(sys.argv[1]); lock.acquire()
print("locked", flush=True)
if sys.argv[2] == "die":
    import os; os._exit(0)   # dies holding it: the kernel drops the flock, the record stays
sys.stdin.read()             # holds it until the test closes stdin
lock.release()
"""


def _holder(directory, how="hold"):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def lock_is_free(directory) -> bool:
    """Whether another open file description could lock ``directory`` now (flock locks of one
    process conflict across descriptions too)."""
    path = os.path.join(directory, LOCK_NAME)
    if not os.path.exists(path):
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_second_writer_fails_at_start_naming_the_process_that_holds_the_lock(tmp_path):
    holder = _holder(tmp_path)
    try:
        before = dir_state(tmp_path)
        estimator, loader = build()
        count = Count()
        with pytest.raises(DirectoryLockedError) as info:
            estimator.fit(loader, epochs=1, event_handlers=[count, CheckpointHandler(tmp_path, batch_period=1)])
        message = str(info.value)
        assert f"pid {holder.pid}" in message and f"host {socket.gethostname()}" in message
        assert "one process writes to a checkpoint directory at a time" in message.lower()
        assert count.batches == 0 and dir_state(tmp_path) == before
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    run = fit_run(tmp_path)  # free again once the holder is done
    assert run.count.batches > 0 and lock_is_free(tmp_path) and not (tmp_path / LOCK_NAME).exists()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, estimatorch_log):
    dead = _holder(tmp_path, "die")
    dead.wait(timeout=60)
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert record["pid"] == dead.pid
    run = fit_run(tmp_path)
    warnings = [r.getMessage() for r in estimatorch_log if r.levelno == logging.WARNING and "taking over" in r.getMessage()]
    assert len(warnings) == 1 and f"pid {dead.pid}" in warnings[0]
    assert run.count.batches > 0 and not (tmp_path / LOCK_NAME).exists()


class Explode(BatchEnd):
    def batch_end(self, estimator, **kwargs):
        raise RuntimeError("boom")


class RefuseAtFitStart(BatchEnd):
    """A handler whose own start check fails after the CheckpointHandler's passed."""

    def batch_end(self, estimator, **kwargs):
        pass

    def check_fit(self, estimator, resume):
        raise ValueError("this handler refuses")


class LockSeen(BatchEnd):
    def __init__(self, directory):
        self.directory, self.free = directory, []

    def batch_end(self, estimator, **kwargs):
        self.free.append(lock_is_free(self.directory))


@pytest.mark.parametrize("ending", ["finished", "exception-in-a-batch", "another-handler-refuses-at-start"])
def test_the_lock_is_held_during_fit_and_released_however_it_ends(tmp_path, ending):
    seen = LockSeen(tmp_path)
    extra = {"finished": [seen], "exception-in-a-batch": [seen, Explode()],
             "another-handler-refuses-at-start": [seen, RefuseAtFitStart()]}[ending]
    if ending == "finished":
        fit_run(tmp_path, extra=extra)
    else:
        with pytest.raises((RuntimeError, ValueError), match="boom|refuses"):
            fit_run(tmp_path, extra=extra)
    assert all(free is False for free in seen.free)
    assert lock_is_free(tmp_path) and not (tmp_path / LOCK_NAME).exists()
    assert checkpoint._lock._HELD == {}


def test_two_handlers_of_one_fit_share_the_directory(tmp_path):
    estimator, loader = build()
    handlers = [CheckpointHandler(tmp_path, batch_period=1, epoch_period=None),
                CheckpointHandler(tmp_path, model_prefix="epochs", epoch_period=1)]
    handlers[1].name = "EpochCheckpoints"
    estimator.fit(loader, epochs=2, event_handlers=handlers)
    assert checkpoint.list_checkpoints(tmp_path, "model") and checkpoint.list_checkpoints(tmp_path, "epochs")
    assert lock_is_free(tmp_path) and not (tmp_path / LOCK_NAME).exists()


def _sleep(seconds):
    time.sleep(seconds)


def test_a_process_forked_while_the_lock_is_held_does_not_keep_it(tmp_path):
    lock = DirectoryLock(tmp_path)
    lock.acquire()
    child = multiprocessing.get_context("fork").Process(target=_sleep, args=(5,))
    child.start()
    try:
        lock.release()
        assert child.is_alive() and lock_is_free(tmp_path)
    finally:
        child.terminate()
        child.join()


def test_check_changes_nothing_and_accepts_this_process(tmp_path):
    lock = DirectoryLock(tmp_path)
    lock.check()
    assert os.listdir(tmp_path) == []
    lock.acquire()
    DirectoryLock(tmp_path).check()  # this process holds it: fine
    lock.release()
    assert os.listdir(tmp_path) == []
