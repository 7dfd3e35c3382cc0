"""Signals during fit (in this process; the subprocess and multi-process versions are in
tests/integration/test_preemption.py and tests/estimator/stopping/test_stop_agreement.py): SIGTERM and a
first Ctrl-C stop at a step boundary, CheckpointHandler saves it, the handlers are restored, an
ignored SIGINT, a handler of the user's and other threads are left alone, the messages fit where
the user is."""

from __future__ import annotations

import collections.abc
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from estimatorch import CheckpointHandler, _console, checkpoint
from estimatorch.estimator._setup import handlers as fit_setup
from estimatorch.estimator import estimator as estimator_module
from estimatorch.estimator._stopping.interrupts import stop_message
from estimatorch.event_handlers import BatchEnd, EpochEnd
from tests.conftest import Count, assert_tree_equal, losses_recorder, make_batches, make_estimator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalAt(BatchEnd, EpochEnd):
    """Sends ``signals`` to this process during the batch_end of step ``step`` (or, with
    ``step=None``, during the first epoch_end), as a user or a cluster would, mid-step."""

    def __init__(self, *signals, step=None):
        self.signals, self.step = signals, step

    def batch_end(self, est, **kw):
        if est.position.step + 1 == self.step:
            for signum in self.signals:
                signal.raise_signal(signum)

    def epoch_end(self, est, **kw):
        if self.step is None:
            for signum in self.signals:
                signal.raise_signal(signum)
            self.step = -1


def saved_names(model_dir):
    return [os.path.basename(p) for _, _, p in checkpoint.list_checkpoints(model_dir, "model")]


def handlers_now():
    return {s: signal.getsignal(s) for s in SIGNALS}


@pytest.fixture
def default_signals():
    """Python's default handlers for both signals, whatever the suite was started with."""
    saved = handlers_now()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield handlers_now()
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def loader():
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)  # 6 batches per epoch


def test_sigterm_stops_at_the_step_boundary_then_raises_system_exit_143(default_signals):
    est, count = make_estimator(), Count()
    finally_ran = []
    with pytest.raises(SystemExit) as info:
        try:
            est.fit(loader(), epochs=3, event_handlers=[SignalAt(signal.SIGTERM, step=8), count])
        finally:
            finally_ran.append(True)
    assert info.value.code == 128 + signal.SIGTERM and finally_ran
    assert est.interruption == "SIGTERM" and est.position.step == count.batches == 8
    assert handlers_now() == default_signals


@pytest.mark.parametrize("signum, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_signal_checkpoints_its_boundary_and_the_resume_is_bit_identical(signum, exc, tmp_path, default_signals,
                                                                          estimatorch_log):
    """CheckpointHandler every 5 batches, a signal during step 8: a checkpoint of step 8 is
    written in train_end (the log says where) and resuming from it ends bit-identical to an
    uninterrupted run."""
    def run(model_dir, *handlers):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
        est = estimator_module.Estimator(net, torch.nn.CrossEntropyLoss(), seed=5,
                                         optimizer=torch.optim.AdamW(net.parameters(), lr=0.01))
        losses, rec = losses_recorder()
        ckpt = CheckpointHandler(model_dir, batch_period=5, epoch_period=None, max_checkpoints=None,
                                 resume_from_checkpoint=True)
        est.fit(loader(), epochs=3, event_handlers=[ckpt, rec, *handlers])
        return est, losses

    reference, full = run(tmp_path / "reference")
    with pytest.raises(exc):
        run(tmp_path / "run", SignalAt(signum, step=8))
    assert saved_names(tmp_path / "run") == ["model-epoch0batch5.pt", "model-epoch1batch8.pt"]
    name = signal.Signals(signum).name
    saved = [r.getMessage() for r in estimatorch_log if r.getMessage().startswith("Saved checkpoint of step 8")]
    assert saved == [f"Saved checkpoint of step 8 to {tmp_path / 'run' / 'model-epoch1batch8.pt'} ({name})"]
    resumed, rest = run(tmp_path / "run")
    assert rest == full[8:]
    assert_tree_equal(resumed.net.state_dict(), reference.net.state_dict())
    assert_tree_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict())


def test_a_boundary_just_saved_is_not_saved_twice(tmp_path, default_signals, estimatorch_log):
    est = make_estimator()
    with pytest.raises(SystemExit):
        est.fit(loader(), epochs=3, event_handlers=[
            SignalAt(signal.SIGTERM, step=5), CheckpointHandler(tmp_path, batch_period=5, epoch_period=None)])
    assert est.interruption == "SIGTERM" and est.position.step == 5
    assert saved_names(tmp_path) == ["model-epoch0batch5.pt"]
    assert not [r for r in estimatorch_log if "Saved checkpoint of step" in r.getMessage()]


def test_a_signal_during_epoch_end_stops_at_the_epoch_boundary(tmp_path, default_signals):
    est, count = make_estimator(), Count()
    with pytest.raises(KeyboardInterrupt):
        est.fit(loader(), epochs=3, event_handlers=[SignalAt(signal.SIGINT), count,
                                                    CheckpointHandler(tmp_path, epoch_period=2)])
    assert (count.batches, count.epochs) == (6, 1)
    assert est.interruption == "SIGINT" and est.position.phase == "epoch_end" and est.position.epoch == 1
    assert saved_names(tmp_path) == ["model-epoch1batch6.pt"]


class SignallingBatches(collections.abc.Sequence):
    """A list of batches that sends a signal while batch ``at`` is being fetched."""

    def __init__(self, batches, at, signum):
        self.batches, self.at, self.signum = batches, at, signum

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        if i == self.at:
            signal.raise_signal(self.signum)
        return self.batches[i]


@pytest.mark.parametrize("signum, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_signal_while_waiting_for_data_stops_at_once_at_the_boundary(signum, exc, default_signals):
    """No step more: the fetch of batch 3 is abandoned, the state is that of step 3's end."""
    est, count = make_estimator(), Count()
    with pytest.raises(exc):
        est.fit(SignallingBatches(make_batches(n_batches=6), 3, signum), epochs=2, event_handlers=[count])
    assert count.batches == est.position.step == 3 and est.position.phase == "batch_end"
    assert est.interruption == signal.Signals(signum).name


def test_a_signal_before_the_first_step_of_a_resume_writes_nothing_again(tmp_path, default_signals):
    batches = make_batches(n_batches=6)
    options = dict(batch_period=3, epoch_period=None, max_checkpoints=None)
    make_estimator().fit(batches, epochs=1, event_handlers=[CheckpointHandler(tmp_path, **options)])
    written = {name: os.stat(tmp_path / name).st_mtime_ns for name in os.listdir(tmp_path)}
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):  # the fetch of epoch 2's first batch: no step trained
        est.fit(SignallingBatches(batches, 0, signal.SIGINT), epochs=2,
                event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True, **options)])
    assert (est.position.step, est.interruption) == (6, "SIGINT")
    files = {name: os.stat(tmp_path / name).st_mtime_ns for name in os.listdir(tmp_path)}
    assert files.pop(checkpoint.PROGRESS_NAME, None) is not None  # the run's ledger counts the attempt
    assert files == written


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, default_signals):
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(loader(), epochs=2, event_handlers=[SignalAt(signal.SIGINT, signal.SIGINT, step=2),
                                                    CheckpointHandler(tmp_path, batch_period=5, epoch_period=None)])
    assert est.interruption is None and est.position.step == 1  # mid-step 2: its boundary was never reached
    assert checkpoint.list_checkpoints(tmp_path, "model") == []
    assert handlers_now() == default_signals


def test_sigterm_after_a_ctrl_c_ends_with_sigterms_status(default_signals):
    est = make_estimator()
    with pytest.raises(SystemExit) as info:
        est.fit(loader(), epochs=2, event_handlers=[SignalAt(signal.SIGINT, signal.SIGTERM, step=2)])
    assert info.value.code == 143 and est.interruption == "SIGTERM" and est.position.step == 2


def test_an_ignored_sigint_and_a_users_sigterm_handler_are_left_alone(default_signals):
    received = []

    def mine(signum, frame):
        received.append(signum)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a job started in the background
    signal.signal(signal.SIGTERM, mine)
    est, count = make_estimator(), Count()
    est.fit(loader(), epochs=1, event_handlers=[SignalAt(signal.SIGINT, signal.SIGTERM, step=2), count])
    assert count.batches == 6 and est.interruption is None  # neither stopped the fit
    assert received == [signal.SIGTERM]
    assert handlers_now() == {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: mine}


def test_fit_in_another_thread_installs_no_handler(default_signals):
    seen, errors = [], []

    class Probe(BatchEnd):
        def batch_end(self, est, **kw):
            seen.append(handlers_now())

    def train():
        try:
            make_estimator().fit(make_batches(n_batches=2), epochs=1, event_handlers=[Probe()])
        except BaseException as err:  # noqa: BLE001 - reported to the main thread
            errors.append(err)

    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
    assert errors == [] and seen == [default_signals] * 2


def test_the_handlers_are_restored_after_a_fit_that_fails(default_signals):
    class Fail(BatchEnd):
        def batch_end(self, est, **kw):
            assert handlers_now() != default_signals  # installed during fit
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        make_estimator().fit(make_batches(), epochs=1, event_handlers=[Fail()])
    assert handlers_now() == default_signals


def test_a_signal_after_the_last_step_still_ends_the_process(default_signals):
    """One arriving once the loop is over (here in train_end) is not lost either: fit raises
    it once train_end is done, without claiming a checkpointed boundary."""
    from estimatorch.event_handlers import TrainEnd

    class Late(TrainEnd):
        def train_end(self, est, **kw):
            signal.raise_signal(signal.SIGTERM)

    est = make_estimator()
    with pytest.raises(SystemExit):
        est.fit(make_batches(), epochs=1, event_handlers=[Late()])
    assert est.interruption is None and est.position.stop


@pytest.mark.parametrize("notebook, handler, words", [
    (True, None, ["Ctrl-C: stopping at the end of the current step", "fit(..., resume=True) continues"]),
    (False, None, ["No CheckpointHandler", "lost", "resume_from_checkpoint=True"]),
    (False, dict(resume_from_checkpoint=True), ["writing a checkpoint of it", "Rerunning the script resumes"]),
    (False, dict(), ["writing a checkpoint of it", "rerun with CheckpointHandler(..., resume_from_checkpoint=True)"]),
    (False, dict(save_weights_only=True), ["No CheckpointHandler writes resumable checkpoints", "lost"]),  # an export
])
def test_the_ctrl_c_message_fits_where_you_are(notebook, handler, words, tmp_path, default_signals,
                                               estimatorch_log, monkeypatch):
    monkeypatch.setattr(_console, "in_notebook", lambda: notebook)
    monkeypatch.setattr(fit_setup, "interactive", lambda: False)  # no default bar (no IPython here)
    handlers = [SignalAt(signal.SIGINT, step=2)]
    if handler is not None:
        handlers.append(CheckpointHandler(tmp_path, **handler))
    with pytest.raises(KeyboardInterrupt):
        make_estimator().fit(make_batches(), epochs=1, event_handlers=handlers)
    message = [r.getMessage() for r in estimatorch_log if r.getMessage().startswith("Ctrl-C")]
    assert len(message) == 1 and all(word in message[0] for word in words), message


def test_the_sigterm_message_names_the_exit_status():
    text = stop_message("SIGTERM", notebook=True, checkpointing=True, resumes=True, multi=True)
    assert "SystemExit(143)" in text and "all processes stop at the same one" in text
    assert "resume=True) continues" not in text  # a notebook's kernel is being shut down: no hint


class SignalInWorker(torch.utils.data.Dataset):
    """Sends ``signum`` to the DataLoader worker that loads sample ``at`` (a terminal's Ctrl-C or
    SLURM's SIGTERM reaches the whole process group, workers included)."""

    def __init__(self, n, at, signum):
        self.x, self.at, self.signum = torch.arange(n, dtype=torch.float32).reshape(n, 1).repeat(1, 4), at, signum

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.at and torch.utils.data.get_worker_info() is not None:
            signal.raise_signal(self.signum)
        return self.x[i], i % 3


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("signum", SIGNALS, ids=["SIGINT", "SIGTERM"])
def test_dataloader_workers_ignore_the_signals_the_main_process_decides_on(context, signum, default_signals):
    """A worker that took Ctrl-C as KeyboardInterrupt (or died of SIGTERM) would leave the main
    process, which trains on to a step boundary, with "DataLoader worker exited unexpectedly"."""
    data = torch.utils.data.DataLoader(SignalInWorker(24, at=13, signum=signum), batch_size=4, num_workers=1,
                                       multiprocessing_context=context)
    est, count = make_estimator(), Count()
    est.fit(data, epochs=1, event_handlers=[count])
    assert count.batches == 6 and est.interruption is None


class SignalsParentWhileFetching(torch.utils.data.Dataset):
    """In a DataLoader worker, sample ``at`` takes long and sends ``signum`` to the main process
    meanwhile, which by then waits for that batch (the others are prefetched within milliseconds)."""

    def __init__(self, n, at, signum):
        self.x, self.at, self.signum = torch.arange(n, dtype=torch.float32).reshape(n, 1).repeat(1, 4), at, signum

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i == self.at:
            time.sleep(2.0)
            os.kill(os.getppid(), self.signum)
            time.sleep(0.5)
        return self.x[i], i % 3


@pytest.mark.slow
@pytest.mark.parametrize("signum, exc", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_stop_while_waiting_for_a_worker_shuts_the_workers_down_before_fit_raises(signum, exc, default_signals):
    """The stop raised inside the DataLoader's wait must not keep its iterator, and so its workers
    (which ignore SIGTERM), alive through the error's traceback: a script that does not catch it
    would otherwise wait for them at exit forever (multiprocessing joins its children there)."""
    data = torch.utils.data.DataLoader(SignalsParentWhileFetching(24, at=13, signum=signum), batch_size=4,
                                       num_workers=1)
    est = make_estimator()
    with pytest.raises(exc) as caught:
        est.fit(data, epochs=1)
    assert est.interruption == signal.Signals(signum).name and est.position.step == 3  # batch 4 holds sample 13
    assert caught.value is not None and multiprocessing.active_children() == []


EXITS_DESPITE_A_LIVE_WORKER = """
import torch
from estimatorch.data import IgnoreStopSignals

loader = torch.utils.data.DataLoader(list(range(64)), batch_size=4, num_workers=2, worker_init_fn=IgnoreStopSignals())
iterator = iter(loader)  # never shut down: still referenced when the interpreter exits
print(next(iterator).tolist(), next(iterator).tolist(), flush=True)  # one batch from each worker: both ignore SIGTERM
"""


@pytest.mark.slow
def test_a_process_whose_loader_was_never_shut_down_still_exits(tmp_path):
    """Workers that ignore SIGTERM would hang multiprocessing's exit (SIGTERM, then an unbounded
    join); the exit hook gives them a bounded wait, then SIGKILL, and says so."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_DESPITE_A_LIVE_WORKER)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[0, 1, 2, 3] [4, 5, 6, 7]", proc.stderr[-2000:]
    said = proc.stdout + proc.stderr  # the estimatorch logger (stdout) once fit set it up, else stderr
    assert "2 worker process(es) still ran at exit" in said and "ended with SIGKILL" in said
