"""TensorBoardHandler: event files read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import copy
import math
import os
import re
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from estimatorch import Estimator, distributed
from estimatorch.event_handlers import (
    CheckpointHandler,
    LambdaHandler,
    TensorBoardHandler,
    ValidationHandler,
)
from estimatorch.event_handlers._event_files import carry_over_events, event_files
from estimatorch.events import subscribes
from tests.conftest import Count, ctrl_c_at, make_batches, make_estimator

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

N_BATCHES = 4  # per epoch
TIMING_TAGS = {"epoch/samples_per_sec", "batch/samples_per_sec"}


def read_events(run_dir):
    """``({tag: [(step, value)]}, accumulator)``; nothing is purged by the reader itself, so
    forked or duplicated steps in the files show up."""
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "histograms": 0}, purge_orphaned_data=False)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def f32(value):
    return float(np.float32(value))  # event files store scalars as float32


def assert_no_fork(scalars):
    for tag, events in scalars.items():
        steps = [s for s, _ in events]
        assert steps == sorted(set(steps)), f"{tag} has duplicated or out-of-order steps: {steps}"


# -- what is written ------------------------------------------------------------------------
def test_epoch_scalars_match_the_history(tmp_path):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path)
    history = est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=[tb])
    scalars, _ = read_events(tb.run_dir)
    for name in history.metrics:
        assert scalars[f"epoch/{name}"] == [(e, f32(v)) for e, v in zip(history.epochs, history[name])]
    assert scalars["epoch/lr"] == [(e, f32(v)) for e, v in zip(history.epochs, history["lr"])]
    assert all(v > 0 for _, v in scalars["epoch/samples_per_sec"])
    assert not any(tag.startswith("batch/") for tag in scalars)  # no log_interval: epoch level only


def test_step_level_validations_are_written_at_their_steps(tmp_path):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path)
    val = ValidationHandler(make_batches(2, seed=1), est.evaluate, epoch_period=None, batch_period=3)
    history = est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb, val])
    scalars, _ = read_events(tb.run_dir)
    validations = history.validations
    assert validations.steps == [3, 6, 9, 12]
    for name in ("val_loss", "val_accuracy"):
        assert scalars[f"batch/{name}"] == [(s, f32(v)) for s, v in zip(validations.steps, validations[name])]


def test_val_metrics_are_written_only_in_epochs_that_validated(tmp_path):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path)
    val = ValidationHandler(make_batches(2, seed=1), est.evaluate, epoch_period=2)
    history = est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb, val])
    scalars, _ = read_events(tb.run_dir)
    validated = [(e, f32(v)) for e, v in zip(history.epochs, history["val_loss"]) if not math.isnan(v)]
    assert scalars["epoch/val_loss"] == validated == [(2, validated[0][1])]
    assert [s for s, _ in scalars["epoch/train_loss"]] == [1, 2, 3]


def test_batch_scalars_every_log_interval_at_the_global_batch_count(tmp_path):
    est = make_estimator()
    running = []
    probe = LambdaHandler(batch_end=lambda e, **kw: running.append(e.train_metrics[0].compute()), every=3)
    tb = TensorBoardHandler(tmp_path, log_interval=3)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb, probe])
    scalars, _ = read_events(tb.run_dir)
    steps = list(range(3, 3 * N_BATCHES + 1, 3))
    assert scalars["batch/train_loss"] == [(s, f32(v)) for s, v in zip(steps, running)]
    for tag in ("batch/train_accuracy", "batch/lr", "batch/samples_per_sec"):
        assert [s for s, _ in scalars[tag]] == steps


def test_learning_rate_of_each_param_group_is_the_one_the_epoch_used(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    lrs, gamma = (0.1, 0.01), 0.5
    opt = torch.optim.SGD([{"params": net[0].parameters(), "lr": lrs[0]},
                           {"params": net[2].parameters(), "lr": lrs[1]}])
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt,
                    lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma))
    tb = TensorBoardHandler(tmp_path)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb])
    scalars, _ = read_events(tb.run_dir)
    for i, lr in enumerate(lrs):
        assert scalars[f"epoch/lr_group{i}"] == [(e, f32(lr * gamma ** (e - 1))) for e in (1, 2, 3)]


def test_weight_and_gradient_histograms_every_histogram_period(tmp_path):
    est = make_estimator()
    grads, weights = [], []
    record_grads = LambdaHandler(backward_end=lambda e, **kw: grads.append(
        {n: float(p.grad.double().sum()) for n, p in e.net.named_parameters()}), every=2)
    record_weights = LambdaHandler(batch_end=lambda e, **kw: weights.append(
        {n: float(p.detach().double().sum()) for n, p in e.net.named_parameters()}), every=2)
    tb = TensorBoardHandler(tmp_path, histogram_period=2)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[tb, record_grads, record_weights])
    _, acc = read_events(tb.run_dir)
    steps = [2, 4, 6, 8]
    for name, param in est.net.named_parameters():
        for kind, recorded in (("gradients", grads), ("weights", weights)):
            events = acc.Histograms(f"{kind}/{name}")
            assert [e.step for e in events] == steps
            assert all(e.histogram_value.num == param.numel() for e in events)
            assert [e.histogram_value.sum for e in events] == pytest.approx([r[name] for r in recorded], rel=1e-5)


def test_gradient_histograms_subscribe_to_backward_end_only_when_asked(tmp_path):
    plain, hist = TensorBoardHandler(tmp_path), TensorBoardHandler(tmp_path, histogram_period=5)
    assert not subscribes(plain, "backward_end")
    assert subscribes(hist, "backward_end") and isinstance(hist, TensorBoardHandler)
    assert plain.name == hist.name == "TensorBoardHandler"  # same state key either way


def test_the_run_directory_is_named_after_the_run_and_new_for_every_fit(tmp_path):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path / "runs", run_name="mnist")
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[tb])
    first = tb.run_dir
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[tb])
    assert first != tb.run_dir
    for run_dir in (first, tb.run_dir):
        assert os.path.dirname(run_dir) == str(tmp_path / "runs")
        assert re.fullmatch(r"mnist_[A-Z][a-z]{2}\d{2}_\d{2}-\d{2}-\d{2}(_\d+)?", os.path.basename(run_dir))
        assert len(event_files(run_dir)) == 1


def test_the_run_directory_is_opened_and_logged_once_at_the_first_steps_end(tmp_path, estimatorch_log):
    """Not at train_begin: a resume (known only after it) may name the run's directory."""
    est = make_estimator()
    seen = []
    probe = LambdaHandler(batch_end=lambda e, **kw: seen.append(os.listdir(tmp_path)))
    tb = TensorBoardHandler(tmp_path)
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[tb, probe])
    assert seen[0] == [] and all(s == [os.path.basename(tb.run_dir)] for s in seen[1:])
    assert len(event_files(tb.run_dir)) == 1
    logged = [r.getMessage() for r in estimatorch_log if tb.run_dir in r.getMessage()]
    assert logged == [f"TensorBoard: writing to {tb.run_dir} (view with: tensorboard --logdir {tmp_path})"]


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path / "runs", log_interval=1, histogram_period=1)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[tb])
    assert not os.path.exists(tmp_path / "runs") and tb.run_dir is None
    assert isinstance(tb.writer, distributed.NullWriter)


# -- resume ---------------------------------------------------------------------------------
def reference_run(tmp_path, **tb_kwargs):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path / "reference", **tb_kwargs)
    history = est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=[tb])
    return read_events(tb.run_dir)[0], history


def assert_same_curves(scalars, reference):
    assert_no_fork(scalars)
    assert set(scalars) == set(reference)
    for tag in set(reference) - TIMING_TAGS:
        assert scalars[tag] == reference[tag], tag
    for tag in TIMING_TAGS & set(reference):
        assert [s for s, _ in scalars[tag]] == [s for s, _ in reference[tag]]


def test_an_interrupted_run_resumed_in_process_continues_the_same_curves(tmp_path):
    reference, ref_history = reference_run(tmp_path, log_interval=1)
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path / "runs", log_interval=1)
    handlers = [tb, ctrl_c_at(6)]
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=handlers)
    run_dir = tb.run_dir
    history = est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=handlers,
                      resume=True)
    assert tb.run_dir == run_dir and os.listdir(tmp_path / "runs") == [os.path.basename(run_dir)]
    scalars, _ = read_events(run_dir)
    assert_same_curves(scalars, reference)
    assert history.to_dict() == ref_history.to_dict()


def test_a_run_resumed_from_a_checkpoint_deletes_the_events_written_after_it(tmp_path):
    """A crash at batch 10, after the checkpoint at batch 6: batches 7-10 and the end of epoch 2
    were written after it. The resumed run writes them again; each must show once."""
    reference, _ = reference_run(tmp_path, log_interval=1)

    def crash(est, **kw):
        raise RuntimeError("the machine went down")

    est = make_estimator()
    tb = TensorBoardHandler(tmp_path / "runs", log_interval=1)
    ckpt = CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=6)
    with pytest.raises(RuntimeError, match="went down"):
        est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3,
                event_handlers=[tb, ckpt, LambdaHandler(batch_end=crash, once=10)])
    run_dir = tb.run_dir
    before, _ = read_events(run_dir)
    assert before["batch/train_loss"][-1][0] == 10 and before["epoch/train_loss"][-1][0] == 2  # past the checkpoint

    est = make_estimator()  # a new process: everything comes from the checkpoint at batch 6
    tb = TensorBoardHandler(tmp_path / "runs", log_interval=1)
    ckpt = CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=6, resume_from_checkpoint=True)
    est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=3, event_handlers=[tb, ckpt])
    assert tb.run_dir == run_dir
    assert len(event_files(run_dir)) == 1  # the old file's valid events moved into the new one
    scalars, _ = read_events(run_dir)
    assert_same_curves(scalars, reference)


# -- the event-file helper ------------------------------------------------------------------
def test_carry_over_keeps_valid_events_in_order_with_their_wall_times(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    old = SummaryWriter(tmp_path)
    for step in range(1, 6):
        old.add_scalar("batch/loss", step * 1.5, step)
    for epoch in (1, 2):
        old.add_scalar("epoch/loss", epoch * 10.0, epoch)
    old.close()
    before = read_events(str(tmp_path))[1]
    walls = {e.step: e.wall_time for e in before.Scalars("batch/loss")}
    files = event_files(str(tmp_path))
    new = SummaryWriter(tmp_path)
    copied = carry_over_events(files, lambda tag, step: step <= (1 if tag.startswith("epoch/") else 3),
                               new.file_writer)
    new.add_scalar("batch/loss", 99.0, 4)
    new.close()
    assert copied == 4 and not any(os.path.exists(f) for f in files)
    scalars, acc = read_events(str(tmp_path))
    assert scalars == {"batch/loss": [(1, 1.5), (2, 3.0), (3, 4.5), (4, 99.0)], "epoch/loss": [(1, 10.0)]}
    assert {e.step: e.wall_time for e in acc.Scalars("batch/loss")[:3]} == {s: walls[s] for s in (1, 2, 3)}


# -- arguments and state --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"log_dir": 3}, TypeError, "log_dir"),
    ({"log_dir": ""}, TypeError, "log_dir"),
    ({"run_name": "a/b"}, ValueError, "run_name"),
    ({"run_name": ""}, ValueError, "run_name"),
    ({"log_interval": 0}, ValueError, "log_interval"),
    ({"histogram_period": -1}, ValueError, "histogram_period"),
    ({"flush_secs": 0}, ValueError, "flush_secs"),
])
def test_arguments_are_checked(tmp_path, kwargs, error, match):
    kwargs = {"log_dir": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        TensorBoardHandler(**kwargs)


def test_state_round_trip_and_missing_key(tmp_path):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[tb])
    state = tb.state_dict()
    assert state == {"run_id": tb.run_id, "current_epoch": 2, "total_batches": 2 * N_BATCHES}
    assert tb.run_dir == str(tmp_path / f"train_{tb.run_id}")  # the state holds a name, not the path
    other = TensorBoardHandler(tmp_path)
    other.load_state_dict(state)
    assert other.state_dict() == state
    del state["total_batches"]
    with pytest.raises(ValueError, match="total_batches"):
        other.load_state_dict(state)


# -- files come from the arguments ------------------------------------------------------------
def _interrupted(tmp_path, at=6):
    """An estimator whose fit with a TensorBoardHandler on ``tmp_path / "runs"`` was stopped at ``at``."""
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path / "runs", log_interval=1)
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb, ctrl_c_at(at)])
    return est, tb


def test_a_state_that_names_another_directory_is_not_obeyed(tmp_path):
    """A plain-data checkpoint naming another run_dir once made the resumed run write there and
    delete the event files it found."""
    victim = tmp_path / "victim"
    writer = __import__("torch.utils.tensorboard", fromlist=["SummaryWriter"]).SummaryWriter(victim)
    for step in (1, 2, 3, 50):
        writer.add_scalar("batch/train_loss", float(step), step)
    writer.close()
    before = {f: os.path.getsize(f) for f in event_files(str(victim))}
    est, _ = _interrupted(tmp_path)
    interrupted = est._last  # what a checkpoint holds: plain data anyone could edit
    for state in ({"run_dir": str(victim)}, {"run_dir": str(victim), "run_id": None}, {"run_id": str(victim)},
                  {"run_id": "../../victim"}):
        snapshot = est._last = copy.deepcopy(interrupted)
        saved = {k: v for k, v in snapshot["handlers"]["TensorBoardHandler"].items() if k != "run_id"}
        snapshot["handlers"]["TensorBoardHandler"] = dict(saved, **state)
        tb = TensorBoardHandler(tmp_path / "runs", log_interval=1)
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb], resume=True)
        assert os.path.dirname(tb.run_dir) == str(tmp_path / "runs")
        assert {f: os.path.getsize(f) for f in event_files(str(victim))} == before
    assert sorted(os.listdir(tmp_path)) == ["runs", "victim"]


def test_a_resumed_run_finds_its_directory_by_name_under_its_own_log_dir(tmp_path):
    est, first = _interrupted(tmp_path)
    shutil.move(str(tmp_path / "runs"), str(tmp_path / "moved"))
    tb = TensorBoardHandler(tmp_path / "moved", log_interval=1)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb], resume=True)
    assert tb.run_dir == str(tmp_path / "moved" / os.path.basename(first.run_dir))
    assert os.listdir(tmp_path / "moved") == [os.path.basename(first.run_dir)]
    scalars, _ = read_events(tb.run_dir)
    assert [s for s, _ in scalars["batch/train_loss"]] == list(range(1, 3 * N_BATCHES + 1))


def test_a_state_from_an_older_version_continues_its_run_by_name(tmp_path):
    """Older states held the run directory's path: its name is looked for under this log_dir."""
    est, first = _interrupted(tmp_path)
    snapshot = est._last
    run_id = snapshot["handlers"]["TensorBoardHandler"].pop("run_id")
    snapshot["handlers"]["TensorBoardHandler"]["run_dir"] = f"/somewhere/else/train_{run_id}"
    tb = TensorBoardHandler(tmp_path / "runs", log_interval=1)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[tb], resume=True)
    assert tb.run_dir == first.run_dir and not os.path.exists("/somewhere/else")


@pytest.mark.parametrize("case", ["a file", "a dangling symlink", "/dev/null"])
def test_a_log_dir_that_cannot_hold_runs_is_refused_before_any_step(tmp_path, case):
    """TensorBoardHandler(log_dir=<a file>) once failed after 4 steps."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    path, reason = {"a file": (a_file, "is a file, not a directory"),
                    "a dangling symlink": (dangling, "is a symbolic link to .*, which does not exist"),
                    "/dev/null": ("/dev/null", "is a device, not a directory")}[case]
    count = Count()
    with pytest.raises(ValueError, match=f"log_dir '{re.escape(str(path))}' {reason}"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[count, TensorBoardHandler(path)])
    assert count.batches == 0 and sorted(os.listdir(tmp_path)) == ["a_file", "dangling"]
