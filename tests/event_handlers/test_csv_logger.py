"""CSVLoggerHandler: a row per epoch while training runs, one file across resumes."""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch
from torch import nn

from estimatorch import CSVLoggerHandler, Estimator, distributed
from estimatorch.event_handlers import CheckpointHandler, EpochEnd, LambdaHandler, ValidationHandler
from tests.conftest import Count, ctrl_c_at, make_batches, make_estimator

N_BATCHES = 4  # per epoch
VAL = make_batches(2, seed=1)


def read(path, separator=","):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f, delimiter=separator))


def as_history_row(history, i, columns):
    """The CSV row fit's History implies for epoch index ``i``: empty where nothing was computed."""
    cells = [str(history.epochs[i])]
    for name in columns[1:]:
        value = history[name][i]
        cells.append("" if math.isnan(value) else repr(value))
    return cells


def test_a_row_per_epoch_with_every_metric_and_the_learning_rate(tmp_path):
    est = make_estimator()
    path = tmp_path / "logs" / "train.csv"
    val = ValidationHandler(VAL, est.evaluate, epoch_period=2)
    history = est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[CSVLoggerHandler(path), val])
    rows = read(path)
    assert rows[0] == ["epoch", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr"]
    assert rows[1:] == [as_history_row(history, i, rows[0]) for i in range(3)]
    assert rows[1][3] == "" and rows[2][3] != ""  # val metrics only where the epoch validated


def test_each_row_is_on_disk_when_its_epoch_ends(tmp_path):
    path = tmp_path / "train.csv"
    seen = []

    class Reader(EpochEnd):
        priority = float("inf")  # after the logger (same priority, given later)

        def epoch_end(self, estimator, **kwargs):
            seen.append(len(read(path)))

    make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[CSVLoggerHandler(path), Reader()])
    assert seen == [2, 3, 4]  # the header and one more row each epoch


def test_separator_and_several_param_groups(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD([{"params": net[0].parameters(), "lr": 0.1}, {"params": net[2].parameters(), "lr": 0.01}])
    path = tmp_path / "train.tsv"
    Estimator(net, nn.CrossEntropyLoss(), optimizer=opt).fit(
        make_batches(N_BATCHES), epochs=1, event_handlers=[CSVLoggerHandler(path, separator="\t")])
    rows = read(path, "\t")
    assert rows[0][-2:] == ["lr_group0", "lr_group1"] and rows[1][-2:] == ["0.1", "0.01"]


def test_an_existing_file_is_never_overwritten(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("precious\n")
    count = Count()
    with pytest.raises(FileExistsError, match="append=True"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[count, CSVLoggerHandler(path)])
    assert path.read_text() == "precious\n" and count.batches == 0


def test_append_adds_a_fits_rows_after_the_existing_ones(tmp_path):
    path = tmp_path / "train.csv"
    est = make_estimator()
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[CSVLoggerHandler(path)])
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[CSVLoggerHandler(path, append=True)])
    rows = read(path)
    assert len(rows) == 1 + 2 + 1 and [r[0] for r in rows[1:]] == ["1", "2", "1"]  # one header


def test_append_refuses_a_file_of_other_columns(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("epoch,loss\n1,0.5\n")
    with pytest.raises(ValueError, match="starts with the header 'epoch,loss'"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[CSVLoggerHandler(path, append=True)])
    assert path.read_text() == "epoch,loss\n1,0.5\n"


# -- resume ---------------------------------------------------------------------------------------
def reference(tmp_path, epochs=3):
    path = tmp_path / "reference.csv"
    make_estimator().fit(make_batches(N_BATCHES), val_data=VAL, epochs=epochs, event_handlers=[CSVLoggerHandler(path)])
    return read(path)


def test_a_run_resumed_in_process_continues_the_file(tmp_path):
    path = tmp_path / "train.csv"
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), val_data=VAL, epochs=3, event_handlers=[CSVLoggerHandler(path), ctrl_c_at(6)])
    assert len(read(path)) == 2
    est.fit(make_batches(N_BATCHES), val_data=VAL, epochs=3, event_handlers=[CSVLoggerHandler(path)], resume=True)
    assert read(path) == reference(tmp_path)


@pytest.mark.parametrize("append", [False, True])
def test_rows_written_after_the_checkpoint_are_cut_on_resume(tmp_path, append):
    """A crash two epochs after the last checkpoint: the resumed run writes those epochs again;
    each must show once, and what the file held before this run stays."""
    path = tmp_path / "train.csv"
    if append:  # an earlier run's rows: kept
        make_estimator().fit(make_batches(N_BATCHES), val_data=VAL, epochs=1, event_handlers=[CSVLoggerHandler(path)])
    before = read(path) if append else []

    def crash(est, **kw):
        raise RuntimeError("the machine went down")

    est = make_estimator()
    ckpt = CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=6)
    with pytest.raises(RuntimeError, match="went down"):
        est.fit(make_batches(N_BATCHES), val_data=VAL, epochs=4,
                event_handlers=[CSVLoggerHandler(path, append=append), ckpt, LambdaHandler(batch_end=crash, once=14)])
    assert len(read(path)) == max(len(before), 1) + 3  # epochs 1-3 written; the checkpoint is in epoch 2

    est = make_estimator()  # a new process: everything comes from the checkpoint at batch 6
    ckpt = CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=6, resume_from_checkpoint=True)
    est.fit(make_batches(N_BATCHES), val_data=VAL, epochs=4, event_handlers=[CSVLoggerHandler(path, append=append), ckpt])
    expected = reference(tmp_path, epochs=4)
    assert read(path) == (before + expected[1:] if append else expected)


def test_a_resume_refuses_a_file_that_does_not_hold_its_rows(tmp_path):
    path = tmp_path / "train.csv"
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[CSVLoggerHandler(path), ctrl_c_at(6)])
    path.write_text("epoch\n")  # replaced meanwhile: cutting it would destroy someone's data
    with pytest.raises(ValueError, match="does not hold the .* bytes this run had written"):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[CSVLoggerHandler(path)], resume=True)
    assert path.read_text() == "epoch\n"


def test_a_resume_whose_file_is_gone_starts_it_again_with_a_warning(tmp_path):
    path = tmp_path / "train.csv"
    est = make_estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[CSVLoggerHandler(path), ctrl_c_at(6)])
    path.unlink()
    with pytest.warns(UserWarning, match="is gone"):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[CSVLoggerHandler(path)], resume=True)
    assert [r[0] for r in read(path)] == ["epoch", "2", "3"]


def test_the_state_holds_counts_and_a_position_never_a_path(tmp_path):
    path = tmp_path / "train.csv"
    h = CSVLoggerHandler(path)
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    assert h.state_dict() == {"rows": 2, "size": os.path.getsize(path)}
    other = CSVLoggerHandler(tmp_path / "other.csv")
    other.load_state_dict(h.state_dict())  # outside fit: no file is touched
    assert other.state_dict() == h.state_dict() and not os.path.exists(tmp_path / "other.csv")
    with pytest.raises(ValueError, match="size"):
        other.load_state_dict({"rows": 1, "size": -5})


def test_the_path_is_logged_once_at_the_start(tmp_path, estimatorch_log):
    path = tmp_path / "train.csv"
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[CSVLoggerHandler(path)])
    assert [r.getMessage() for r in estimatorch_log if str(path) in r.getMessage()] == [f"CSV log: {path}"]


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    h = CSVLoggerHandler(tmp_path / "train.csv")
    make_estimator().fit(make_batches(N_BATCHES), epochs=2, event_handlers=[h])
    assert os.listdir(tmp_path) == [] and h.rows == 2


# -- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"path": 3}, TypeError, "path must be a path"),
    ({"path": ""}, TypeError, "path must be a path"),
    ({"separator": ", "}, ValueError, "separator must be one character"),
    ({"separator": "\n"}, ValueError, "separator"),
    ({"append": 1}, TypeError, "append must be a bool, got 1"),
])
def test_arguments_are_checked(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CSVLoggerHandler(**{"path": tmp_path / "a.csv", **kwargs})


@pytest.mark.parametrize("case", ["a directory", "in a file", "a dangling symlink", "/dev/null"])
def test_a_path_that_cannot_be_written_is_refused_before_any_step(tmp_path, case):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    path, reason = {"a directory": (tmp_path, "is a directory, not a file"),
                    "in a file": (a_file / "train.csv", "cannot be created: .* is a file, not a directory"),
                    "a dangling symlink": (dangling, "is a symbolic link to .*, which does not exist"),
                    "/dev/null": ("/dev/null", "is a device, not a regular file")}[case]
    count = Count()
    with pytest.raises(ValueError, match=reason):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[count, CSVLoggerHandler(path)])
    assert count.batches == 0 and sorted(os.listdir(tmp_path)) == ["a_file", "dangling"]
