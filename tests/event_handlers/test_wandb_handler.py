"""WandbHandler against W&B in offline mode: the run files it writes are read back (a ``.wandb``
file is a LevelDB-style log of ``Record`` protobufs)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys

import pytest

from estimatorch import distributed
from estimatorch.event_handlers import CheckpointHandler, LambdaHandler, WandbHandler
from tests.conftest import Count, CrashAt, free_port, make_batches, make_estimator

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

N_BATCHES, EPOCHS = 4, 3  # batches per epoch, epochs
_BLOCK, _HEADER = 32768, 7  # the log's block size; a record header: crc32, length, type


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No network, no console capture, no telemetry: W&B writes only local files."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_DISABLE_CODE": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_ERROR_REPORTING": "false", "WANDB_X_DISABLE_STATS": "true",
                       "WANDB_X_DISABLE_META": "true"}.items():
        monkeypatch.setenv(key, value)
    # W&B reads the environment once per process, when its first run starts (its global setup):
    # a run another test started earlier (the contract test's) would keep online mode for this one
    wandb.teardown()
    yield
    wandb.teardown()


def read_records(path):
    """Every ``Record`` in a ``.wandb`` file: a 7-byte W&B header, then 32 KiB blocks of records
    (FULL = 1, or FIRST = 2, MIDDLE = 3, LAST = 4 pieces of one record)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pieces, pos = [], [], _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0:  # zero padding to the end of a block
            pos += left
            continue
        pieces.append(data[pos + _HEADER:pos + _HEADER + length])
        pos += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            records.append(record)
            pieces = []
    return records


def offline_runs(directory):
    """``{offline-run directory: records}`` under ``<directory>/wandb``, oldest first.

    W&B's service writes the run files in its own process, and ``run.finish()`` may return
    before it has flushed them (wandb 0.31: a 7-byte file in about 1 read of 2 after the
    process's first run); stopping the service, as W&B does at exit, flushes them."""
    wandb.teardown()
    root = os.path.join(directory, "wandb")
    runs = sorted(d for d in os.listdir(root) if d.startswith("offline-run-"))
    out = {}
    for name in runs:
        (file,) = [f for f in os.listdir(os.path.join(root, name)) if f.endswith(".wandb")]
        out[os.path.join(root, name)] = read_records(os.path.join(root, name, file))
    return out


def history_of(records):
    """``{key: [(W&B step, value)]}`` of the run's history rows."""
    points = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_"):
                    points.setdefault(key, []).append((record.history.step.num, value))
    return points


def one(records, kind):
    (record,) = [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]
    return record


def _handler(directory, **kwargs) -> WandbHandler:
    return WandbHandler(project="tests", dir=str(directory), **kwargs)


def _fit(est, handlers, **kwargs):
    return est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=EPOCHS,
                   event_handlers=handlers, **kwargs)


# -- what is logged -------------------------------------------------------------------------
def test_the_offline_run_holds_config_every_metric_and_the_history(tmp_path):
    est = make_estimator(seed=3)
    handler = _handler(tmp_path, log_interval=2, name="first")
    history = _fit(est, [handler, CheckpointHandler(tmp_path / "ckpt")])

    ((run_dir, records),) = offline_runs(tmp_path).items()
    assert one(records, "run").run_id == handler.run_id and one(records, "run").display_name == "first"
    config = {}
    for record in records:
        if record.WhichOneof("record_type") in ("config", "run"):
            updates = record.config.update if record.HasField("config") else record.run.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    assert config["optimizer"] == "SGD" and config["batch_size"] == "8" and config["seed"] == "3"
    assert config["world_size"] == "1" and config["epochs"] == str(EPOCHS)
    assert config["handler.CheckpointHandler.epoch_period"] == "1"

    points = history_of(records)
    for name in history.keys():
        assert [v for _, v in points[f"epoch/{name}"]] == history[name], name
    assert [v for _, v in points["epoch"]] == history.epochs
    assert [s for s, _ in points["epoch/train_loss"]] == [N_BATCHES * e for e in history.epochs]
    assert [s for s, _ in points["batch/train_loss"]] == list(range(2, N_BATCHES * EPOCHS + 1, 2))
    assert one(records, "exit").exit_code == 0
    with open(os.path.join(run_dir, "files", "history.json")) as f:
        assert json.load(f) == history.to_dict()


def test_checkpoints_are_in_the_summary_and_an_artifact_when_asked(tmp_path):
    handler = _handler(tmp_path, log_checkpoints=True)
    _fit(make_estimator(), [handler, CheckpointHandler(tmp_path / "ckpt", max_checkpoints=2)])
    ((_, records),) = offline_runs(tmp_path).items()
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in record.summary.update})
    assert summary["checkpoints"] == sorted(str(p) for p in (tmp_path / "ckpt").glob("*.pt"))
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [a.type for a in artifacts] == ["model"]
    assert sorted(e.path for e in artifacts[0].manifest.contents) == \
        sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt"))


def test_the_summary_lists_the_checkpoint_written_when_a_sigterm_stopped_the_fit(tmp_path):
    """The preemption checkpoint CheckpointHandler writes in its train_end (after the tracker's)
    is in the summary, and the one retention removed then is not."""
    with pytest.raises(SystemExit):
        _fit(make_estimator(), [_handler(tmp_path), CheckpointHandler(tmp_path / "ckpt", max_checkpoints=1),
                                _sigterm_at(6)])
    ((_, records),) = offline_runs(tmp_path).items()
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in record.summary.update})
    held = sorted(str(p) for p in (tmp_path / "ckpt").glob("*.pt"))
    assert [os.path.basename(p) for p in held] == ["model-epoch1batch6.pt"]
    assert summary["checkpoints"] == held


# -- how a run ends -------------------------------------------------------------------------
def _sigterm_at(step):
    return LambdaHandler(batch_end=lambda est, **kw: signal.raise_signal(signal.SIGTERM), once=step)


@pytest.mark.parametrize("stop, error, exit_code, preempted", [
    (lambda: CrashAt(6), RuntimeError, 1, False),
    (lambda: _sigterm_at(6), SystemExit, 128 + signal.SIGTERM, True),
])
def test_the_exit_code_says_how_the_fit_ended(tmp_path, stop, error, exit_code, preempted):
    with pytest.raises(error):
        _fit(make_estimator(), [_handler(tmp_path), stop()])
    ((_, records),) = offline_runs(tmp_path).items()
    assert one(records, "exit").exit_code == exit_code
    assert any(r.WhichOneof("record_type") == "preempting" for r in records) == preempted


# -- resume ---------------------------------------------------------------------------------
def test_a_run_resumed_from_a_checkpoint_continues_the_same_run_id(tmp_path):
    def handlers(resume):
        return [_handler(tmp_path, log_interval=1),
                CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=6, resume_from_checkpoint=resume)]

    first = handlers(False)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(make_estimator(), [*first, CrashAt(10)])
    resumed = handlers(True)
    history = _fit(make_estimator(), resumed)

    (before, after) = offline_runs(tmp_path).values()
    assert one(before, "run").run_id == one(after, "run").run_id == first[0].run_id == resumed[0].run_id
    assert [s for s, _ in history_of(before)["batch/train_loss"]] == list(range(1, 10))
    assert [s for s, _ in history_of(after)["batch/train_loss"]] == list(range(7, N_BATCHES * EPOCHS + 1))
    assert [v for _, v in history_of(after)["epoch/train_loss"]] == history["train_loss"][1:]  # epochs 2, 3
    assert one(after, "exit").exit_code == 0


# -- bad input before any step --------------------------------------------------------------
def test_bad_arguments_are_refused_before_any_step(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    count = Count()
    with pytest.raises(ValueError, match=f"dir '{tmp_path}/a_file' is a file, not a directory"):
        _fit(make_estimator(), [count, WandbHandler(dir=str(tmp_path / "a_file"))])
    with pytest.raises(ValueError, match="mode must be one of W&B's modes .* got 'sideways'"):
        _fit(make_estimator(), [count, WandbHandler(mode="sideways")])
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ValueError, match="the W&B server .*mode='online'.* is unreachable"):
        _fit(make_estimator(), [count, WandbHandler(mode="online", dir=str(tmp_path))])
    assert count.batches == 0 and os.listdir(tmp_path) == ["a_file"]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="id is managed by WandbHandler"):
        WandbHandler(id="abc")
    with pytest.raises(ValueError, match="resume is managed by WandbHandler"):
        WandbHandler(resume="must")
    with pytest.raises(ValueError, match="log_interval must be a positive int or None, got -1"):
        WandbHandler(log_interval=-1)


def test_without_wandb_estimatorch_imports_and_the_handler_names_the_extra():
    code = ("import sys; sys.modules['wandb'] = None\n"
            "import estimatorch\n"
            "from estimatorch.event_handlers import WandbHandler\n"
            "try:\n    WandbHandler()\nexcept ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "estimatorch[wandb]"' in out


# -- two gloo processes ---------------------------------------------------------------------
def _train(root: str) -> dict:
    handler = WandbHandler(project="tests", dir=root, log_interval=2, mode="offline")
    history = _fit(make_estimator(), [handler])
    return {"run_id": handler.run_id, "history": history.to_dict()}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_write_one_run(tmp_path):
    zero, one_ = distributed.spawn(_train, 2, str(tmp_path), backend="gloo")
    assert zero["run_id"] and one_["run_id"] is None
    ((_, records),) = offline_runs(tmp_path).items()
    assert one(records, "run").run_id == zero["run_id"]
    points = history_of(records)
    assert [v for _, v in points["epoch/train_loss"]] == zero["history"]["train_loss"] == one_["history"]["train_loss"]
    assert [s for s, _ in points["batch/train_loss"]] == list(range(2, N_BATCHES * EPOCHS + 1, 2))
