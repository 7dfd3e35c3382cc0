"""CheckpointHandler(async_save=True): the step waits only for a copy of the state, a writer process
writes it (``async_save="thread"``: a thread; each test runs with both where it can). What is
written is the state at the boundary; the files, pointer and retention are those of a
synchronous save; a failed background write is raised at the next save or in train_end, naming
the file and the errno, with the earlier files kept; Ctrl-C during a write saves both.
(SIGTERM in a subprocess: tests/integration/test_preemption.py; kills during background writes:
tests/integration/test_fault_injection.py; the writer process's own faults:
tests/checkpoint/test_writer_process.py; two ranks: test_checkpoint_handler_distributed.py.)"""

from __future__ import annotations

import errno
import os
import pickle
import threading

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import ProcessWriter, _files
from estimatorch.event_handlers import BatchBegin, BatchEnd
from tests.conftest import assert_tree_equal, ctrl_c_at, losses_recorder, make_batches, make_estimator

#: async_save values: the writer process (the default) and the writer thread.
KINDS = pytest.mark.parametrize("kind", [True, "thread"], ids=["process", "thread"])


def _files_in(directory):
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


class Gate:
    """Hold every background write of a periodic checkpoint until the training thread opens the
    gate (from the next step's ``batch_begin``), so that the step runs during the write (for
    the writer process: before the writer thread hands the staged copy to it)."""

    def __init__(self, monkeypatch):
        self.opened, self.held = threading.Event(), []
        real, real_handover = checkpoint.atomic_save, ProcessWriter._write

        def hold(path):
            if threading.current_thread() is not threading.main_thread() and os.fspath(path).endswith(".pt"):
                self.held.append(os.path.basename(path))
                assert self.opened.wait(60), "the training thread never opened the gate"
                self.opened.clear()

        def held(obj, path, **kwargs):
            hold(path)
            real(obj, path, **kwargs)

        def held_handover(writer, staged, paths):
            hold(paths[0])
            real_handover(writer, staged, paths)

        monkeypatch.setattr(checkpoint, "atomic_save", held)
        monkeypatch.setattr(ProcessWriter, "_write", held_handover)


class Snapshot(BatchEnd):
    """A deep copy of model and optimizer at every step's end (after the optimizer step): the
    state each boundary's checkpoint must hold."""

    priority = float("inf")

    def __init__(self):
        self.states = {}

    def batch_end(self, estimator, **kwargs):
        self.states[estimator.position.step + 1] = {
            "model": {k: v.clone() for k, v in estimator.net.state_dict().items()},
            "exp_avg": [s["exp_avg"].clone() for s in estimator.optimizer.state.values()]}


class Scribble(BatchBegin):
    """Right after a save returned (the next step's start): change parameters and optimizer state
    in place, let the held write go on and wait until it is done; then put the values back, so
    that training goes on unchanged."""

    def __init__(self, gate, handler):
        self.gate, self.handler, self.scribbled = gate, handler, 0

    def batch_begin(self, estimator, **kwargs):
        if not self.handler._writer.busy:
            return
        saved = [(p, p.detach().clone()) for p in estimator.net.parameters()]
        saved += [(s["exp_avg"], s["exp_avg"].clone()) for s in estimator.optimizer.state.values()]
        with torch.no_grad():
            for tensor, _ in saved:
                tensor.fill_(1234.5)
        self.gate.opened.set()
        self.handler._writer.join()  # the whole write ran while the live state held 1234.5
        self.scribbled += 1
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)


def _adam_estimator():
    est = make_estimator()
    est.optimizer = torch.optim.Adam(est.net.parameters(), lr=0.05)
    return est


@KINDS
def test_parameters_changed_right_after_the_save_returns_never_reach_the_file(kind, tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save=kind)
    est, snapshot, scribble = _adam_estimator(), Snapshot(), Scribble(gate, handler)
    est.fit(make_batches(6), batches=5, event_handlers=[handler, snapshot, scribble])
    assert gate.held == ["model-epoch0batch2.pt", "model-epoch0batch4.pt"]  # each write waited for the scribble
    assert scribble.scribbled == 2
    for step in (2, 4):
        payload = checkpoint.load(tmp_path / checkpoint.checkpoint_name("model", 0, step))
        assert_tree_equal(payload["model"], snapshot.states[step]["model"], f"model at step {step}")
        assert_tree_equal([s["exp_avg"] for s in payload["optimizer"]["state"].values()],
                          snapshot.states[step]["exp_avg"], f"exp_avg at step {step}")


@pytest.mark.parametrize("max_checkpoints", [2, None])
def test_background_writes_leave_the_files_a_synchronous_save_leaves(tmp_path, max_checkpoints):
    results = {}
    for async_save in (False, True, "thread"):
        directory = tmp_path / str(async_save)
        est, (losses, recorder) = _adam_estimator(), losses_recorder()
        handler = CheckpointHandler(directory, batch_period=1, max_checkpoints=max_checkpoints, async_save=async_save)
        est.fit(make_batches(4), epochs=2, event_handlers=[handler, recorder])
        files = _files_in(directory)
        payloads = {name: checkpoint.load(directory / name) for name in files if name.endswith(".pt")}
        results[async_save] = (files, losses, payloads, checkpoint.read_latest(directory, "model"), handler)
    (files, losses, payloads, latest, _), *background = results.values()
    for files_a, losses_a, payloads_a, latest_a, handler in background:
        assert files_a == files and latest_a == latest and losses_a == losses
        for name in payloads:
            for key in ("model", "optimizer"):
                assert_tree_equal(payloads_a[name][key], payloads[name][key], f"{name} {key}")
        assert handler._writer.staging.nbytes == _tensor_bytes(payloads_a[latest])  # one copy of the state


def _tensor_bytes(tree):
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


@KINDS
def test_the_staging_buffers_are_reused_from_save_to_save(kind, tmp_path):
    est = _adam_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, max_checkpoints=None, async_save=kind)
    seen: list[dict] = []

    class Buffers(BatchBegin):  # the buffers of the model's and the optimizer's tensors, after each save
        def batch_begin(self, estimator, **kwargs):
            seen.append({path: buf.data_ptr() for path, buf in handler._writer.staging._buffers.items()
                         if path[0] in ("model", "optimizer")})

    est.fit(make_batches(5), batches=5, event_handlers=[handler, Buffers()])
    params = len(list(est.net.parameters()))
    assert seen[0] == {} and len(seen[1]) == params + 3 * params  # the model's, and Adam's step and two moments
    assert seen[1] == seen[2] == seen[3] == seen[4]  # the same buffers from save to save


def _fail_on(monkeypatch, name, code=errno.ENOSPC):
    """Creating the temporary file of checkpoint ``name`` fails as on a full disk."""
    real = _files._create_temporary

    def create(directory, target):
        if target == name:
            raise OSError(code, os.strerror(code))
        return real(directory, target)

    monkeypatch.setattr(_files, "_create_temporary", create)


class Steps(BatchBegin):
    def __init__(self):
        self.started = 0

    def batch_begin(self, estimator, **kwargs):
        self.started += 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_failed_background_write_is_raised_at_the_next_save_and_keeps_the_earlier_files(tmp_path, monkeypatch,
                                                                                          code):
    _fail_on(monkeypatch, checkpoint.checkpoint_name("model", 0, 4), code)
    est, steps = _adam_estimator(), Steps()
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=None, async_save="thread")
    with pytest.raises(OSError) as raised:
        est.fit(make_batches(8), batches=8, event_handlers=[handler, steps])
    assert raised.value.errno == code and os.strerror(code) in str(raised.value)
    assert repr(str(tmp_path / "model-epoch0batch4.pt")) in str(raised.value)
    assert est.position.step == 6 and steps.started == 6  # raised at the next save, step 6's boundary
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-latest"]  # the earlier file is kept
    assert checkpoint.read_latest(tmp_path, "model") == "model-epoch0batch2.pt"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert checkpoint.LOCK_NAME not in os.listdir(tmp_path)  # released: another fit may write here


def test_a_failed_last_write_is_raised_in_train_end_and_the_previous_checkpoint_is_kept(tmp_path, monkeypatch):
    _fail_on(monkeypatch, checkpoint.checkpoint_name("model", 0, 4))
    est = _adam_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, max_checkpoints=1, async_save="thread")
    with pytest.raises(OSError, match="model-epoch0batch4.pt") as raised:
        est.fit(make_batches(8), batches=4, event_handlers=[handler])
    assert raised.value.errno == errno.ENOSPC and est.position.step == 4
    assert _files_in(tmp_path) == ["model-epoch0batch2.pt", "model-latest"]
    assert checkpoint.read_latest(tmp_path, "model") == "model-epoch0batch2.pt"
    assert checkpoint.load(tmp_path / "model-epoch0batch2.pt")["ranks"][0]["position"]["step"] == 2


@KINDS
def test_ctrl_c_during_a_background_write_saves_both_checkpoints_and_resumes_bit_identically(kind, tmp_path,
                                                                                             monkeypatch):
    reference_losses, recorder = losses_recorder()
    reference = _adam_estimator()
    reference.fit(make_batches(8), batches=8, event_handlers=[recorder])

    gate = Gate(monkeypatch)

    class OpenLate(BatchEnd):  # the write of step 4 is held until Ctrl-C was pressed in step 5
        def batch_end(self, estimator, **kwargs):
            if estimator.position.step + 1 == 5:
                gate.opened.set()

    est = _adam_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=4, epoch_period=None, max_checkpoints=None, async_save=kind)
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(8), batches=8, event_handlers=[handler, ctrl_c_at(5), OpenLate()])
    assert gate.held == ["model-epoch0batch4.pt"] and est.interruption == "SIGINT"
    assert _files_in(tmp_path) == ["model-epoch0batch4.pt", "model-epoch0batch5.pt", "model-latest"]
    assert checkpoint.read_latest(tmp_path, "model") == "model-epoch0batch5.pt"
    monkeypatch.undo()  # no gate for the resumed run

    losses, recorder = losses_recorder()
    resumed = _adam_estimator()
    resumed.fit(make_batches(8), batches=8, event_handlers=[
        CheckpointHandler(tmp_path, batch_period=4, epoch_period=None, max_checkpoints=None, async_save=kind,
                          resume_from_checkpoint=True), recorder])
    assert losses == reference_losses[5:]
    assert_tree_equal(resumed.net.state_dict(), reference.net.state_dict(), "model")
    assert_tree_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict(), "optimizer")


def test_a_save_that_finds_the_previous_write_running_waits_and_says_so_once(tmp_path, monkeypatch, estimatorch_log):
    release = threading.Event()
    real = checkpoint.atomic_save

    def slow(obj, path, **kwargs):
        if os.fspath(path).endswith(".pt"):
            release.wait(0.2)  # slower than a step: every save finds the previous write running
        real(obj, path, **kwargs)

    monkeypatch.setattr(checkpoint, "atomic_save", slow)
    est = _adam_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, max_checkpoints=2, async_save="thread")
    est.fit(make_batches(6), batches=6, event_handlers=[handler])
    waits = [r for r in estimatorch_log if "Waiting for the previous checkpoint write" in r.getMessage()]
    assert len(waits) == 1 and handler._writer.waits == 5
    assert _files_in(tmp_path) == ["model-epoch0batch5.pt", "model-epoch0batch6.pt", "model-latest"]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_save_must_be_a_bool_or_a_writer_kind(tmp_path, value):
    with pytest.raises(ValueError, match=f"async_save must be False, True, 'process' or 'thread', got {value!r}"):
        CheckpointHandler(tmp_path, async_save=value)


@KINDS
def test_a_weights_export_in_the_background_holds_the_boundarys_weights(kind, tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    handler = CheckpointHandler(tmp_path, batch_period=2, epoch_period=None, save_weights_only=True,
                                max_checkpoints=None, async_save=kind)
    est, snapshot, scribble = _adam_estimator(), Snapshot(), Scribble(gate, handler)
    est.fit(make_batches(6), batches=3, event_handlers=[handler, snapshot, scribble])
    assert gate.held == ["model-epoch0batch2.weights.pt"] and scribble.scribbled == 1
    assert_tree_equal(torch.load(tmp_path / "model-epoch0batch2.weights.pt", weights_only=True),
                      snapshot.states[2]["model"], "weights at step 2")


@KINDS
def test_a_handler_that_wrote_in_the_background_pickles_without_its_buffers(kind, tmp_path):
    handler = CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, async_save=kind)
    _adam_estimator().fit(make_batches(2), batches=2, event_handlers=[handler])
    assert handler._writer.staging.nbytes > 0
    copy = pickle.loads(pickle.dumps(handler))
    assert copy.async_save and copy._writer.staging.nbytes == 0 and not copy._writer.busy
