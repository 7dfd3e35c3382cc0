"""The checkpoint writer process of ``CheckpointHandler(async_save=True)``, with faults injected
into it: started once per fit at the first save and stopped at its end; killed mid-write (an
error naming its pid and the signal at the next save, never a hang; the earlier files and the
pointer kept; the run resumed from them ends bitwise as an uninterrupted one); a file-size limit
(RLIMIT_FSIZE) in the writer, raised like a full disk; dead between two saves; deaf to SIGINT
and SIGTERM while it writes. (Writes equal to synchronous ones, Ctrl-C during a write:
tests/event_handlers/test_checkpoint_handler_async.py; SIGTERM to a training script:
tests/integration/test_preemption.py; a real full disk: tests/integration/test_disk_errors.py.)"""

from __future__ import annotations

import errno
import os
import resource
import signal
import time

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import ProcessWriter, SharedStaging, WriterProcessError
from estimatorch.event_handlers import BatchBegin, BatchEnd
from tests.conftest import assert_tree_equal, losses_recorder, make_batches, make_estimator

pytestmark = pytest.mark.skipif(not checkpoint.process_writer_supported(), reason="the writer process needs Linux")


def _adam_estimator():
    est = make_estimator()
    est.optimizer = torch.optim.Adam(est.net.parameters(), lr=0.05)
    return est


def _files_in(directory):
    """The files in ``directory``, but the progress mark (a failed attempt leaves it for the ledger)."""
    return sorted(name for name in os.listdir(directory) if name != checkpoint.PROGRESS_NAME)


class AtStep(BatchBegin, BatchEnd):
    """Run ``before(pid)`` at the end of step ``step`` (before its save) and ``after(pid)`` at the
    start of the next step (its save submitted), with the writer process's pid."""

    priority = float("inf")

    def __init__(self, handler, step, before=None, after=None):
        self.handler, self.step, self.before, self.after = handler, step, before, after

    def batch_end(self, estimator, **kwargs):
        if estimator.position.step + 1 == self.step and self.before is not None:
            self.before(self.handler._writer.pid)

    def batch_begin(self, estimator, **kwargs):
        if estimator.position.step == self.step and self.after is not None:
            self.after(self.handler._writer.pid)


def _wait_until_dead(pid):
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)  # a zombie until its parent waits: then os.kill still succeeds
        if _zombie(pid):
            return
    raise AssertionError(f"process {pid} still runs")


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_one_writer_process_per_fit_started_at_the_first_save_and_stopped_at_the_end(tmp_path):
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=True)
    pids = []

    class Pids(BatchBegin):
        def batch_begin(self, estimator, **kwargs):
            pids.append(handler._writer.pid)

    _adam_estimator().fit(make_batches(7), batches=7, event_handlers=[handler, Pids()])
    assert pids[:2] == [None, None] and pids[2] is not None and len(set(pids[2:])) == 1  # one, reused
    assert handler._writer.pid is None
    _wait_until_dead(pids[2])
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-epoch0batch4.pt", "model-epoch0batch6.pt",
                                   "model-latest"]


def test_a_writer_process_killed_mid_write_is_an_error_naming_it_and_the_run_resumes_bitwise(tmp_path):
    reference_losses, recorder = losses_recorder()
    reference = _adam_estimator()
    reference.fit(make_batches(8), batches=8, event_handlers=[recorder])

    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=True)
    killed = []

    def stop(pid):  # the save of step 4 is handed to a writer that cannot run ...
        handler._writer.join()  # (once it wrote step 2's file)
        os.kill(pid, signal.SIGSTOP)

    def kill(pid):  # ... and is killed with it pending
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)

    est = _adam_estimator()
    with pytest.raises(WriterProcessError) as raised:
        est.fit(make_batches(8), batches=8, event_handlers=[handler, AtStep(handler, 4, stop, kill)])
    message = str(raised.value)
    assert f"writer process (pid {killed[0]}) was killed by signal SIGKILL" in message
    assert repr(str(tmp_path / "model-epoch0batch4.pt")) in message
    assert est.position.step == 6  # raised at the next save
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-latest"]
    assert checkpoint.read_latest(tmp_path, "model") == "model-epoch0batch2.pt"

    losses, recorder = losses_recorder()
    resumed = _adam_estimator()
    resumed.fit(make_batches(8), batches=8, event_handlers=[
        CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=True,
                          resume_from_checkpoint=True), recorder])
    assert losses == reference_losses[2:]
    assert_tree_equal(resumed.net.state_dict(), reference.net.state_dict(), "model")
    assert_tree_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict(), "optimizer")
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def test_a_file_size_limit_in_the_writer_is_raised_at_the_next_save_naming_the_file(tmp_path):
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=True)

    def limit(pid):  # after the first file: the next one cannot grow past 100 bytes
        handler._writer.join()
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (100, 100))

    est = _adam_estimator()
    with pytest.raises(OSError) as raised:
        est.fit(make_batches(8), batches=8, event_handlers=[handler, AtStep(handler, 3, before=limit)])
    assert raised.value.errno == errno.EFBIG and os.strerror(errno.EFBIG) in str(raised.value)
    assert repr(str(tmp_path / "model-epoch0batch4.pt")) in str(raised.value)
    assert est.position.step == 6
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-latest"]  # no temporary left
    assert checkpoint.read_latest(tmp_path, "model") == "model-epoch0batch2.pt"
    assert checkpoint.LOCK_NAME not in os.listdir(tmp_path)


def test_a_writer_process_dead_between_two_saves_is_an_error_at_the_next(tmp_path):
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=True)
    killed = []

    def kill(pid):
        handler._writer.join()  # idle: step 2's file is written
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)
        handler._writer._proc.wait(timeout=60)  # (its threads too: a zombie leader is not enough)

    with pytest.raises(WriterProcessError, match=r"writer process \(pid \d+\) was killed by signal SIGKILL between "
                                                 "two saves") as raised:
        _adam_estimator().fit(make_batches(8), batches=8, event_handlers=[handler, AtStep(handler, 3, before=kill)])
    assert f"(pid {killed[0]})" in str(raised.value)
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-latest"]


def test_sigint_and_sigterm_to_the_writer_process_do_not_cut_its_write_short(tmp_path):
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=True)
    signalled = []

    def signal_it(pid):
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(pid, sig)
        signalled.append(pid)

    _adam_estimator().fit(make_batches(6), batches=6, event_handlers=[handler, AtStep(handler, 4, after=signal_it)])
    assert signalled
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-epoch0batch4.pt", "model-epoch0batch6.pt",
                                   "model-latest"]
    assert checkpoint.load(tmp_path / "model-epoch0batch4.pt")["ranks"][0]["position"]["step"] == 4


def test_shared_staging_keeps_a_buffers_place_and_lays_out_only_new_tensors():
    staging = SharedStaging()
    staging.stage({"w": torch.ones(3), "pending": [torch.tensor(1.0)]})
    first = dict(staging._buffers)
    areas = set(staging.areas)
    copy, _ = staging.stage({"w": torch.full((3,), 2.0), "pending": [torch.tensor(1.0), torch.tensor(2.0)]})
    assert staging._buffers[("w",)].data_ptr() == first[("w",)].data_ptr() and copy["w"].tolist() == [2.0, 2.0, 2.0]
    assert areas < set(staging.areas) and len(staging.areas) == 2  # one more area, for the new tensor only
    staging.stage({"w": torch.zeros(4)})  # w changed shape, pending is gone: only the new area is kept
    assert len(staging.areas) == 1 and staging.nbytes == 16


def test_a_writer_written_file_stores_each_tensor_alone(tmp_path):
    """The writer process rebuilds each buffer as a tensor of its own storage: a file holds no
    other tensor's bytes (a view of the whole area would save all of it)."""
    writer, path = ProcessWriter(), str(tmp_path / "state.pt")
    try:
        writer.submit_files({"a": torch.arange(3.0), "b": torch.ones(1000)}, [path], then=lambda: None)
        writer.wait()
    finally:
        writer.close()
    loaded = torch.load(path, weights_only=True)
    assert loaded["a"].untyped_storage().nbytes() == 12 and loaded["a"].tolist() == [0.0, 1.0, 2.0]
