"""LoggingHandler: the lines it logs, and the log file across resumes."""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import signal

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from estimatorch import Estimator, distributed
from estimatorch.event_handlers import (
    CheckpointHandler,
    LambdaHandler,
    LoggingHandler,
    LRSchedulerHandler,
    ValidationHandler,
)
from estimatorch.event_handlers.logging_handler import format_metrics
from estimatorch.events import subscribes
from tests.conftest import Count, ctrl_c_at, make_batches, make_estimator

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
        assert line.endswith(f"{N_BATCHES} batches: {format_metrics(values)}, lr: {history['lr'][epoch]:.4g}")
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
    # the file is named once per run, and only the file that holds the lines
    assert re.findall(r"Log file: (.*)", text) == [first.log_file, f"continuing {first.log_file}"]
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
    assert lines[-1].startswith("Train failed in step 3 after") and "0 epochs, 2 batches completed" in lines[-1]
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
    assert not subscribes(LoggingHandler(), "batch_end")
    assert subscribes(LoggingHandler(log_interval=5), "batch_end")


def test_state_round_trip():
    est = make_estimator()
    handler = LoggingHandler(log_interval=2)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler])
    state = handler.state_dict()
    assert state == {"current_epoch": 2, "batch_in_epoch": N_BATCHES, "samples_in_epoch": 32, "run_id": None,
                     "validated": False}
    other = LoggingHandler(log_interval=2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(ValueError, match="batch_in_epoch"):
        other.load_state_dict({k: v for k, v in state.items() if k != "batch_in_epoch"})


def test_a_line_per_epoch_keeps_no_batch_count_that_would_lie():
    """Without batch lines the handler does not see batches: it keeps no count of them (None),
    rather than a 0 that says nothing ran."""
    handler = LoggingHandler()
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler])
    assert (handler.batch_in_epoch, handler.samples_in_epoch, handler.current_epoch) == (None, None, 2)
    assert handler.state_dict()["batch_in_epoch"] is None


def test_batch_lines_resumed_from_a_state_without_batch_counts_number_from_the_position(lines):
    """A run saved with log_interval='epoch', resumed with batch lines: batch numbers come from
    the position; the sample count of that epoch is unknown and not shown."""
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[LoggingHandler(), ctrl_c_at(5)])
    lines.clear()
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[LoggingHandler(log_interval=1)], resume=True)
    assert [re.match(r"\[Epoch 2/2\](\[Batch \d\])(\[Samples \d+\])?", ln).groups()
            for ln in lines if "[Batch" in ln] == [("[Batch 2]", None), ("[Batch 3]", None), ("[Batch 4]", None)]


# -- the learning rate ---------------------------------------------------------------------------
def test_the_epoch_line_shows_the_rate_the_epoch_trained_with_and_changes_are_logged(lines):
    """Gluon logged the rate every epoch, Keras logs reductions: here the epoch line shows the rate
    the epoch trained with, and a line after it says when a schedule changed it."""
    est = make_estimator(lr=0.1)
    est.lr_scheduler = StepLR(est.optimizer, step_size=2, gamma=0.5)
    history = est.fit(make_batches(N_BATCHES), epochs=4, event_handlers=[LoggingHandler(), LRSchedulerHandler()])
    rates = [0.1, 0.1, 0.05, 0.05]  # derived: halved after every second epoch
    assert history["lr"] == pytest.approx(rates)
    shown = [ln for ln in lines if ln.startswith("[Epoch")]
    assert [float(ln.rsplit("lr: ", 1)[1]) for ln in shown if "Finished" in ln] == pytest.approx(rates)
    changes = [ln for ln in shown if "Learning rate" in ln]
    assert changes == ["[Epoch 2] Learning rate 0.1 -> 0.05 (StepLR)", "[Epoch 4] Learning rate 0.05 -> 0.025 (StepLR)"]
    assert shown.index(changes[0]) == shown.index(next(ln for ln in shown if ln.startswith("[Epoch 2/4] Finished"))) + 1


def test_learning_rates_of_several_param_groups(lines):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD([{"params": net[0].parameters(), "lr": 0.1}, {"params": net[2].parameters(), "lr": 1e-5}])
    history = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt).fit(make_batches(N_BATCHES), epochs=1)
    assert history.learning_rates == ["lr_group0", "lr_group1"]
    assert [ln for ln in lines if "Finished" in ln][0].endswith("lr_group0: 0.1, lr_group1: 1e-05")


# -- after a resume ------------------------------------------------------------------------------
def test_lines_after_a_resume_count_what_ran_in_this_process(lines):
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[LoggingHandler(log_interval=2), ctrl_c_at(5)])
    lines.clear()
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[LoggingHandler(log_interval=2)], resume=True)
    # resumed after batch 1 of epoch 2: batch 2's line covers 1 batch, the epoch ran 3 of its 4
    assert [re.search(r"/(\d+) batches", ln).group(1) for ln in lines if "[Batch" in ln] == ["1", "2", "2", "2"]
    finished = [ln for ln in lines if "Finished" in ln]
    assert f"{N_BATCHES} batches ({N_BATCHES - 1} since resume):" in finished[0]
    assert "since resume" not in finished[1]
    assert lines[-1].startswith("Train finished in") and \
        f"3 epochs, {3 * N_BATCHES} batches ({3 * N_BATCHES - 5} since resume)." in lines[-1]


def test_a_resume_at_an_epoch_boundary_counts_from_there(lines):
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3,
                event_handlers=[LoggingHandler(), LambdaHandler(epoch_end=lambda e, **k: signal.raise_signal(
                    signal.SIGINT), once=1)])
    lines.clear()
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[LoggingHandler()], resume=True)
    assert all("since resume" not in ln for ln in lines if "Finished in" in ln and ln.startswith("[Epoch"))
    assert f"({2 * N_BATCHES} since resume)" in lines[-1]


def test_a_resume_from_an_epochs_last_batch_counts_none_of_that_epoch(lines, tmp_path):
    """The first boundary after that resume is the epoch's end, where no step has run yet."""
    options = dict(batch_period=N_BATCHES, epoch_period=None, max_checkpoints=None)
    est = make_estimator()
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[CheckpointHandler(tmp_path, **options)])
    lines.clear()
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[
        LoggingHandler(), CheckpointHandler(tmp_path, resume_from_checkpoint=True, **options)])
    finished = [ln for ln in lines if "Finished in" in ln]
    assert f"{N_BATCHES} batches (0 since resume):" in finished[0], finished
    assert lines[-1].startswith("Train finished in") and f"({N_BATCHES} since resume)" in lines[-1], lines[-1]


def test_a_resume_with_nothing_left_to_run_ran_nothing(lines):
    est = make_estimator()
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[LoggingHandler()])
    lines.clear()
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[LoggingHandler()], resume=True)
    assert lines[-1].startswith("Train finished in") and "(0 since resume)" in lines[-1]


@pytest.mark.parametrize("validate", [False, True])
def test_a_resumed_run_shows_val_metrics_only_when_the_run_validated(lines, tmp_path, validate):
    """A resume of a fit without validation data once ended with ``val_loss: nan``."""
    val = {"val_data": make_batches(2, seed=1)} if validate else {}
    make_estimator().fit(make_batches(N_BATCHES), epochs=1, **val, event_handlers=[
        LoggingHandler(), CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    lines.clear()
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[  # no val_data now
        LoggingHandler(), CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    assert lines[-1].startswith("Train finished in") and "since resume" in lines[-1], lines[-1]
    assert ("val_loss" in lines[-1]) is validate and "nan" not in lines[-1], lines[-1]


def test_a_state_saved_without_validated_resumes_as_before(lines):
    """States of earlier versions lack ``validated``: the restored val metrics are shown."""
    state = LoggingHandler().state_dict()
    assert state.pop("validated") is False
    handler = LoggingHandler()
    handler.load_state_dict(state)
    assert handler._saved_validated is None
    handler.load_state_dict({**state, "validated": True})
    assert handler._saved_validated is True


# -- files come from the arguments ---------------------------------------------------------------
def test_the_log_file_is_logged_once_at_the_start(tmp_path, lines):
    handler = LoggingHandler(log_dir=tmp_path)
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler])
    assert [ln for ln in lines if handler.log_file in ln] == [f"Log file: {handler.log_file}"]
    assert lines.index(f"Log file: {handler.log_file}") == 1


def test_a_state_that_names_another_file_is_not_obeyed(tmp_path):
    """A plain-data checkpoint naming another log file once made the resumed run append to it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "train_Jan01_00-00-00.log"
    victim.write_text("someone else's file\n")
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[LoggingHandler(log_dir=tmp_path / "logs"),
                                                                   ctrl_c_at(5)])
    interrupted = est._last  # what a checkpoint holds: plain data anyone could edit
    for state in ({"log_file": str(victim)}, {"log_file": str(victim), "run_id": None},
                  {"run_id": "../elsewhere/train_Jan01_00-00-00"},
                  {"run_id": str(elsewhere)}):
        snapshot = est._last = copy.deepcopy(interrupted)
        snapshot["handlers"]["LoggingHandler"] = dict(snapshot["handlers"]["LoggingHandler"], **state)
        handler = LoggingHandler(log_dir=tmp_path / "logs")
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[handler], resume=True)
        assert victim.read_text() == "someone else's file\n"
        assert os.path.dirname(handler.log_file) == str(tmp_path / "logs")


def test_a_resumed_run_finds_its_file_by_name_under_its_own_log_dir(tmp_path):
    """The state names the run (its time stamp); the directory is the handler's own: a run moved
    to another log_dir continues the file found there."""
    est = make_estimator()
    first = LoggingHandler(log_dir=tmp_path / "old")
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[first, ctrl_c_at(5)])
    shutil.move(str(tmp_path / "old"), str(tmp_path / "new"))
    second = LoggingHandler(log_dir=tmp_path / "new")
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[second], resume=True)
    assert second.log_file == str(tmp_path / "new" / os.path.basename(first.log_file))
    assert os.listdir(tmp_path / "new") == [os.path.basename(first.log_file)]
    with open(second.log_file, encoding="utf-8") as f:
        assert f.read().count("Training begin") == 2


# -- bad log_dir at the door ---------------------------------------------------------------------
def _bad_dirs(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    return {
        "a file": (a_file, "is a file, not a directory"),
        "under a file": (a_file / "logs", "cannot be created: .* is a file, not a directory"),
        "a dangling symlink": (dangling, "is a symbolic link to .*, which does not exist"),
        "/dev/null": ("/dev/null", "is a device, not a directory"),
    }


@pytest.mark.parametrize("case", ["a file", "under a file", "a dangling symlink", "/dev/null"])
def test_a_log_dir_that_cannot_hold_files_is_refused_before_any_step(tmp_path, case, lines):
    path, reason = _bad_dirs(tmp_path)[case]
    count = Count()
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError, match=f"log_dir '{re.escape(str(path))}' {reason}"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[count, LoggingHandler(log_dir=path)])
    assert count.batches == 0 and lines == [] and sorted(os.listdir(tmp_path)) == before


def test_a_log_dir_this_process_cannot_write_is_refused(tmp_path, monkeypatch):
    """os.access decides (as root every directory is writable, so the refusal is simulated)."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).startswith(str(tmp_path)) else
                        real_access(p, mode, **kw))
    with pytest.raises(ValueError, match="is a directory this process cannot write in"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[LoggingHandler(log_dir=tmp_path)])
    with pytest.raises(ValueError, match=r"'.*new' cannot be created: this process cannot write in"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1,
                             event_handlers=[LoggingHandler(log_dir=tmp_path / "new")])


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any directory: the mode bits decide nothing")
def test_a_read_only_log_dir_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot"):
            make_estimator().fit(make_batches(N_BATCHES), epochs=1,
                                 event_handlers=[LoggingHandler(log_dir=tmp_path / "logs")])
    finally:
        tmp_path.chmod(0o700)


def test_a_failing_first_batch_says_the_step_failed_without_nan_values(lines):
    def boom(est, **kw):
        raise RuntimeError("boom")

    est = make_estimator()
    with pytest.raises(RuntimeError, match="boom"):
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[LambdaHandler(batch_end=boom, once=1)])
    assert lines[-1].startswith("Train failed in step 1 after")
    assert "0 batches completed" in lines[-1] and "no batch completed" in lines[-1] and "nan" not in lines[-1]


def test_a_rerun_with_nothing_left_shows_the_restored_val_metrics_and_the_initial_lr(tmp_path, lines):
    from estimatorch import CheckpointHandler

    def run():
        est = make_estimator()
        est.lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(est.optimizer, T_max=2)
        est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=2,
                event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
        return est

    run()
    finished = lines[-1]
    del lines[:]
    run()  # the same command again: nothing left to train
    assert any(line.startswith("Training begin: SGD (lr 0, initial 0.1)") for line in lines)
    assert "val_loss" in finished and lines[-1].split(". ", 1)[1] == finished.split(". ", 1)[1]


def test_the_start_line_summarises_the_model(lines):
    """Parameters (all, trainable), their dtype and device, the precision: counted here by hand."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    net[0].weight.requires_grad_(False)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net[2].parameters(), lr=0.1),
                    precision="bf16")
    est.fit(make_batches(2), epochs=1, event_handlers=[LoggingHandler()])
    total, frozen = 4 * 8 + 8 + 8 * 3 + 3, 4 * 8
    assert lines[0].endswith(f". Model: Sequential, {total} parameters ({total - frozen} trainable), float32 on cpu, "
                             "precision bf16-mixed")


def test_the_start_summary_of_a_lazy_net_counts_what_exists_and_fit_trains_it(lines):
    """A ``LazyLinear`` has no size before its first batch: the summary says so instead of
    failing (``numel`` of an uninitialised parameter raises), and fit trains as before."""
    from estimatorch.event_handlers.logging_handler import model_summary

    net = torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert model_summary(net, "32") == ("Sequential, 18 parameters (18 trainable) + 2 lazy, sized at the first "
                                        "batch, float32 on cpu, precision 32")
    est = Estimator(net, torch.nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    data = [(torch.randn(4, 3), torch.randint(0, 2, (4,))) for _ in range(2)]
    est.fit(data, epochs=1)
    assert "2 lazy, sized at the first batch" in lines[0]
    assert est.position.step == 2
