"""LoggingHandler: the lines it logs, and the log file across resumes."""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

from estimatorch import distributed
from estimatorch.event_handlers import BatchEnd, CheckpointHandler, LambdaHandler, LoggingHandler, ValidationHandler
from estimatorch.event_handlers.logging_handler import format_metrics
from tests.conftest import make_batches, make_estimator

N_BATCHES = 4  # per epoch
FILE_NAME = re.compile(r"(?P<run>.+)_[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}(_\d+)?\.log")


@pytest.fixture
def lines():
    """The messages of the ``estimatorch`` logger."""
    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    handler = Keep()
    logger = logging.getLogger("estimatorch")
    logger.addHandler(handler)
    yield kept
    logger.removeHandler(handler)


def ctrl_c_at(step):
    return LambdaHandler(batch_end=lambda est, **kw: signal.raise_signal(signal.SIGINT), once=step)


def test_a_line_every_log_interval_batches_and_every_epoch(lines):
    est = make_estimator()
    history = est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=2,
                      event_handlers=[LoggingHandler(log_interval=2)])
    assert lines[0].startswith("Training begin: SGD (lr 0.1) on cpu, 2 epochs, seed")
    batch_lines = [ln for ln in lines if "[Batch" in ln]
    assert [re.match(r"\[Epoch (\d)/2\]\[Batch (\d)\]\[Samples (\d+)\]", ln).groups() for ln in batch_lines] == [
        ("1", "2", "16"), ("1", "4", "32"), ("2", "2", "16"), ("2", "4", "32")]
    assert all("val_" not in ln for ln in batch_lines)
    epoch_lines = [ln for ln in lines if "Finished in" in ln and ln.startswith("[Epoch")]
    for epoch, line in enumerate(epoch_lines):
        values = {name: history[name][epoch] for name in history.metrics}
        assert line.endswith(f"{N_BATCHES} batches: {format_metrics(values)}")
    final = {name: history[name][-1] for name in history.metrics}
    assert lines[-1].startswith("Train finished in") and lines[-1].endswith(
        f"2 epochs, {2 * N_BATCHES} batches. {format_metrics(final)}")


def test_val_metrics_are_shown_in_the_epochs_that_validated(lines):
    est = make_estimator()
    val = ValidationHandler(make_batches(2, seed=1), est.evaluate, epoch_period=2)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[LoggingHandler(), val])
    epoch_lines = [ln for ln in lines if ln.startswith("[Epoch")]
    assert ["val_loss" in ln for ln in epoch_lines] == [False, True, False]


def test_the_log_file_is_named_after_the_run_and_holds_the_lines(tmp_path, lines):
    est = make_estimator()
    log_dir = tmp_path / "logs" / "nested"
    handler = LoggingHandler(log_dir=log_dir, run_name="mnist")
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler])
    assert os.listdir(log_dir) == [os.path.basename(handler.log_file)]
    assert FILE_NAME.fullmatch(os.path.basename(handler.log_file)).group("run") == "mnist"
    with open(handler.log_file, encoding="utf-8") as f:
        logged = [line.rstrip("\n") for line in f]
    assert len(logged) == len(lines) and all(entry.endswith(line) for entry, line in zip(logged, lines))
    assert all(not isinstance(h, logging.FileHandler) for h in est.logger.handlers)  # closed and removed


def test_every_fit_gets_its_own_file(tmp_path):
    est = make_estimator()
    handler = LoggingHandler(log_dir=tmp_path)
    names = set()
    for _ in range(2):
        est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[handler])
        names.add(handler.log_file)
    assert len(names) == 2 and sorted(os.listdir(tmp_path)) == sorted(os.path.basename(n) for n in names)


def test_a_run_resumed_in_process_continues_its_file(tmp_path):
    est = make_estimator()
    handler = LoggingHandler(log_dir=tmp_path)
    handlers = [handler, ctrl_c_at(6)]
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=handlers)
    first = handler.log_file
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=handlers, resume=True)
    assert handler.log_file == first and os.listdir(tmp_path) == [os.path.basename(first)]
    with open(first, encoding="utf-8") as f:
        text = f.read()
    assert text.count("Training begin") == 2
    assert [int(e) for e in re.findall(r"\[Epoch (\d)/3\] Finished", text)] == [1, 2, 3]
    # the Ctrl-C run says so; the resumed one finishes
    assert re.findall(r"Train (finished in|interrupted after)", text) == ["interrupted after", "finished in"]


def test_a_run_resumed_from_a_checkpoint_continues_its_file(tmp_path):
    est = make_estimator()
    ckpt = CheckpointHandler(tmp_path / "ckpt", epoch_period=1)
    first = LoggingHandler(log_dir=tmp_path / "logs")
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[first, ckpt, ctrl_c_at(N_BATCHES + 1)])
    est = make_estimator()  # a new process
    second = LoggingHandler(log_dir=tmp_path / "logs")
    ckpt = CheckpointHandler(tmp_path / "ckpt", epoch_period=1, resume_from_checkpoint=True)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[second, ckpt])
    assert second.log_file == first.log_file and len(os.listdir(tmp_path / "logs")) == 1
    with open(first.log_file, encoding="utf-8") as f:
        text = f.read()
    assert text.count("Training begin") == 2
    assert [int(e) for e in re.findall(r"\[Epoch (\d)/3\] Finished", text)] == [1, 2, 3]


def test_other_ranks_create_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    handler = LoggingHandler(log_dir=tmp_path / "logs")
    make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[handler])
    assert handler.log_file is None and not os.path.exists(tmp_path / "logs")


def test_the_file_is_closed_when_training_raises(tmp_path, lines):
    def boom(est, **kw):
        raise RuntimeError("boom")

    est = make_estimator()
    handler = LoggingHandler(log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler, LambdaHandler(batch_end=boom, once=3)])
    # the error escaped batch 3's batch_end before this handler (priority +inf) saw it
    assert lines[-1].startswith("Train interrupted after") and "0 epochs, 2 batches" in lines[-1]
    assert all(not isinstance(h, logging.FileHandler) for h in est.logger.handlers)
    est.logger.info("after the run")
    with open(handler.log_file, encoding="utf-8") as f:
        assert "after the run" not in f.read()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"log_interval": 0}, ValueError, "log_interval must be 'epoch' or a positive int, got 0"),
    ({"log_interval": "batch"}, ValueError, "log_interval"),
    ({"log_interval": True}, ValueError, "log_interval"),
    ({"run_name": "a/b"}, ValueError, "run_name"),
    ({"log_dir": 5}, TypeError, "log_dir"),
    ({"metrics": ["train_loss"]}, TypeError, "metrics"),
])
def test_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        LoggingHandler(**kwargs)


def test_a_line_per_epoch_costs_nothing_per_step():
    """log_interval='epoch' does not subscribe to batch_end: no call per step."""
    assert not isinstance(LoggingHandler(), BatchEnd)
    assert isinstance(LoggingHandler(log_interval=5), BatchEnd)


def test_state_round_trip():
    est = make_estimator()
    handler = LoggingHandler(log_interval=2)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler])
    state = handler.state_dict()
    assert (state["current_epoch"], state["batch_in_epoch"], state["samples_in_epoch"]) == (2, N_BATCHES, 32)
    other = LoggingHandler(log_interval=2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(ValueError, match="log_file"):
        other.load_state_dict({k: v for k, v in state.items() if k != "log_file"})
