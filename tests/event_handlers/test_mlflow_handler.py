"""MLflowHandler against MLflow's real sqlite store in a temporary directory, read back with
``MlflowClient``."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from estimatorch import distributed
from estimatorch.event_handlers import CheckpointHandler, LambdaHandler, MLflowHandler
from tests.conftest import Count, CrashAt, ctrl_c_at, free_port, make_batches, make_estimator

mlflow = pytest.importorskip("mlflow")

N_BATCHES, EPOCHS = 4, 3  # batches per epoch, epochs


def _uri(directory) -> str:
    return f"sqlite:///{os.path.join(directory, 'runs.db')}"  # an absolute path: four slashes


def _handler(directory, **kwargs) -> MLflowHandler:
    return MLflowHandler(_uri(directory), experiment_name="tests", artifact_location=str(directory / "artifacts"),
                         **kwargs)


def _fit(est, handlers, **kwargs):
    return est.fit(make_batches(N_BATCHES), val_data=make_batches(2, seed=1), epochs=EPOCHS,
                   event_handlers=handlers, **kwargs)


def read_run(directory, run_id):
    """``(run, {key: [(step, value)]})`` from the store."""
    client = mlflow.MlflowClient(_uri(directory))
    run = client.get_run(run_id)
    return run, {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
                 for key in run.data.metrics}


def runs_of(directory):
    client = mlflow.MlflowClient(_uri(directory))
    return client.search_runs([client.get_experiment_by_name("tests").experiment_id])


def artifact(directory, run, path):
    root = run.info.artifact_uri.removeprefix("file://")
    return os.path.join(root, path)


def assert_one_point_per_step(metrics):
    for key, points in metrics.items():
        steps = [step for step, _ in points]
        assert len(steps) == len(set(steps)), f"{key} logged a step twice: {sorted(steps)}"


# -- what is logged -------------------------------------------------------------------------
def test_params_every_metric_history_and_status_read_back(tmp_path):
    est = make_estimator(seed=3)
    handler = _handler(tmp_path, log_interval=2, run_name="first")
    history = _fit(est, [handler, CheckpointHandler(tmp_path / "ckpt", max_checkpoints=2)])

    run, metrics = read_run(tmp_path, handler.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    params = run.data.params
    assert params["optimizer"] == "SGD" and float(params["optimizer.lr"]) == est.optimizer.param_groups[0]["lr"]
    assert params["batch_size"] == "8" and params["world_size"] == "1" and params["seed"] == "3"
    assert params["precision"] == "32" and params["epochs"] == str(EPOCHS) and params["model"] == "Sequential"
    assert params["handler.CheckpointHandler.max_checkpoints"] == "2"
    assert params["handler.MLflowHandler.log_interval"] == "2"
    for name in history.keys():  # every metric and the learning rate, per epoch, as History holds them
        assert metrics[f"epoch/{name}"] == list(zip(history.epochs, history[name])), name
    batch_steps = list(range(2, N_BATCHES * EPOCHS + 1, 2))
    for name in ("train_loss", "train_accuracy", "lr"):
        assert [step for step, _ in metrics[f"batch/{name}"]] == batch_steps
    assert metrics["batch/train_loss"][1][1] == history["train_loss"][0]  # batch 4 ends epoch 1
    with open(artifact(tmp_path, run, "history.json")) as f:
        assert json.load(f) == history.to_dict()
    kept = sorted(str(p) for p in (tmp_path / "ckpt").glob("*.pt"))
    assert run.data.tags["estimatorch.checkpoints"].split("\n") == kept and len(kept) == 2


@pytest.mark.slow  # several fits against a sqlite store: seconds each
def test_checkpoints_are_uploaded_as_artifacts_when_asked(tmp_path):
    est = make_estimator()
    handler = _handler(tmp_path, log_checkpoints=True)
    export = CheckpointHandler(tmp_path / "ckpt", monitor=est.val_metrics[0], save_best_only=True,
                               save_weights_only=True)
    _fit(est, [handler, export])
    run, _ = read_run(tmp_path, handler.run_id)
    files = sorted(os.listdir(artifact(tmp_path, run, "checkpoints")))
    assert files == sorted(os.listdir(tmp_path / "ckpt")) == ["model-best.weights.pt"]


def _held(directory):
    """The checkpoints in ``directory``: files and sharded directories, the pointer and the lock aside."""
    return sorted(str(p) for p in directory.iterdir() if p.name.startswith("model-epoch"))


@pytest.mark.parametrize("options", [{}, pytest.param({"async_save": True}, marks=pytest.mark.slow),
                                     pytest.param({"sharded": True}, marks=pytest.mark.slow)],
                         ids=["files", "async_save", "sharded"])
def test_the_tag_lists_what_the_checkpoint_handler_announced_after_a_sigterm(tmp_path, options):
    """The tracker's train_end runs before CheckpointHandler's (priority -500), which writes the
    preemption checkpoint and prunes an older one: the run ends after every train_end, with what
    was announced, so the tag names the file a resume uses and none retention deleted (also for
    a background write, and for sharded directories)."""
    handler = _handler(tmp_path, log_checkpoints=bool(options.get("sharded")))
    saver = CheckpointHandler(tmp_path / "ckpt", max_checkpoints=1, **options)
    with pytest.raises(SystemExit):
        _fit(make_estimator(), [handler, saver, _sigterm_at(6)])
    run, _ = read_run(tmp_path, handler.run_id)
    assert run.info.status == "KILLED"
    held = _held(tmp_path / "ckpt")
    assert [os.path.basename(p) for p in held] == ["model-epoch1batch6" + (".dcp" if options.get("sharded") else ".pt")]
    assert run.data.tags["estimatorch.checkpoints"].split("\n") == held
    if options.get("sharded"):  # the directory is uploaded whole, under its name
        uploaded = artifact(tmp_path, run, f"checkpoints/{os.path.basename(held[0])}")
        assert sorted(os.listdir(uploaded)) == sorted(os.listdir(held[0]))


@pytest.mark.slow  # several fits against a sqlite store: seconds each
def test_one_instance_opens_a_new_run_for_every_fit(tmp_path):
    handler = _handler(tmp_path)
    est = make_estimator()
    _fit(est, [handler])
    first = handler.run_id
    _fit(est, [handler])
    assert handler.run_id != first and len(runs_of(tmp_path)) == 2


# -- how a run ends -------------------------------------------------------------------------
def _sigterm_at(step):
    return LambdaHandler(batch_end=lambda est, **kw: signal.raise_signal(signal.SIGTERM), once=step)


@pytest.mark.slow  # several fits against a sqlite store: seconds each
@pytest.mark.parametrize("stop, error, status", [
    (lambda: CrashAt(6), RuntimeError, "FAILED"),
    (lambda: ctrl_c_at(6), KeyboardInterrupt, "KILLED"),
    (lambda: _sigterm_at(6), SystemExit, "KILLED"),
])
def test_the_run_ends_failed_on_an_error_and_killed_on_a_signal(tmp_path, stop, error, status):
    handler = _handler(tmp_path, log_interval=1)
    with pytest.raises(error):
        _fit(make_estimator(), [handler, stop()])
    run, metrics = read_run(tmp_path, handler.run_id)
    assert run.info.status == status
    assert [step for step, _ in metrics["batch/train_loss"]][-1] == (5 if error is RuntimeError else 6)


# -- resume ---------------------------------------------------------------------------------
@pytest.mark.slow  # several fits against a sqlite store: seconds each
def test_a_run_interrupted_and_resumed_in_process_continues_the_same_run(tmp_path):
    reference = _handler(tmp_path / "reference", log_interval=1)
    _fit(make_estimator(), [reference])
    _, expected = read_run(tmp_path / "reference", reference.run_id)

    est, handler = make_estimator(), _handler(tmp_path, log_interval=1)
    with pytest.raises(KeyboardInterrupt):
        _fit(est, [handler, ctrl_c_at(6)])
    run_id = handler.run_id
    _fit(est, [handler], resume=True)
    assert handler.run_id == run_id and len(runs_of(tmp_path)) == 1
    run, metrics = read_run(tmp_path, run_id)
    assert run.info.status == "FINISHED"
    assert metrics == expected  # every point once, with the uninterrupted run's values


@pytest.mark.slow  # several fits against a sqlite store: seconds each
def test_a_run_resumed_from_a_checkpoint_logs_each_step_once(tmp_path):
    """A crash at batch 10, after the checkpoint at batch 6: batches 7-9 and epoch 2 were logged
    after it. The resumed fit continues the same run and logs none of them twice."""
    reference = _handler(tmp_path / "reference", log_interval=1)
    _fit(make_estimator(), [reference])
    _, expected = read_run(tmp_path / "reference", reference.run_id)

    def handlers(resume):
        return [_handler(tmp_path, log_interval=1),
                CheckpointHandler(tmp_path / "ckpt", epoch_period=None, batch_period=6, resume_from_checkpoint=resume)]

    first = handlers(False)
    with pytest.raises(RuntimeError, match="crash"):
        _fit(make_estimator(), [*first, CrashAt(10)])
    _, before = read_run(tmp_path, first[0].run_id)
    assert before["batch/train_loss"][-1][0] == 9 and before["epoch/train_loss"][-1][0] == 2  # past the checkpoint

    resumed = handlers(True)
    _fit(make_estimator(), resumed)  # a new process: the run id comes from the checkpoint
    assert resumed[0].run_id == first[0].run_id and len(runs_of(tmp_path)) == 1
    run, metrics = read_run(tmp_path, first[0].run_id)
    assert run.info.status == "FINISHED"
    assert_one_point_per_step(metrics)
    assert metrics == expected


# -- bad input before any step --------------------------------------------------------------
@pytest.mark.parametrize("case", ["malformed", "unreachable", "a file in the way", "a device", "file store"])
def test_a_tracking_uri_that_cannot_be_used_is_refused_before_any_step(tmp_path, case):
    (tmp_path / "a_file").write_text("x")
    uri, match = {
        "malformed": ("nosuchscheme://x", "tracking_uri 'nosuchscheme://x' cannot be used: .*unsupported URI"),
        "unreachable": (f"http://127.0.0.1:{free_port()}", "tracking_uri 'http://127.0.0.1:.*' is unreachable"),
        "a file in the way": (f"sqlite:///{tmp_path}/a_file/runs.db",
                              f"tracking_uri '{tmp_path}/a_file/runs.db' cannot be created: .* is a file"),
        "a device": ("sqlite:////dev/null/runs.db", "tracking_uri '/dev/null/runs.db' cannot be created"),
        "file store": (f"file://{tmp_path}/a_file", f"tracking_uri '{tmp_path}/a_file' is a file, not a directory"),
    }[case]
    count = Count()
    with pytest.raises(ValueError, match=match):
        _fit(make_estimator(), [count, MLflowHandler(uri)])
    assert count.batches == 0 and sorted(os.listdir(tmp_path)) == ["a_file"]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="log_interval must be a positive int or None, got 0"):
        MLflowHandler(log_interval=0)
    with pytest.raises(ValueError, match="experiment_name must be a non-empty str or None, got ''"):
        MLflowHandler(experiment_name="")
    with pytest.raises(TypeError, match="log_checkpoints must be a bool"):
        MLflowHandler(log_checkpoints="yes")


def test_without_mlflow_estimatorch_imports_and_the_handler_names_the_extra():
    code = ("import sys; sys.modules['mlflow'] = None\n"
            "import estimatorch\n"
            "from estimatorch.event_handlers import MLflowHandler\n"
            "try:\n    MLflowHandler()\nexcept ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "estimatorch[mlflow]"' in out


def test_state_round_trips_and_a_state_naming_a_path_is_not_obeyed(tmp_path):
    handler = _handler(tmp_path)
    _fit(make_estimator(), [handler])
    state = handler.state_dict()
    fresh = _handler(tmp_path)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    fresh.load_state_dict({**state, "run_id": "../elsewhere"})
    assert fresh.run_id is None
    with pytest.raises(ValueError, match="missing the key 'history'"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "history"})


# -- two gloo processes ---------------------------------------------------------------------
def _train(root: str) -> dict:
    from pathlib import Path

    handler = _handler(Path(root), log_interval=2)
    history = _fit(make_estimator(), [handler])
    return {"rank": distributed.get_rank(), "run_id": handler.run_id, "history": history.to_dict()}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_write_one_run(tmp_path):
    zero, one = distributed.spawn(_train, 2, str(tmp_path), backend="gloo")
    assert zero["run_id"] and one["run_id"] is None  # only rank 0 opens a run
    assert len(runs_of(tmp_path)) == 1
    run, metrics = read_run(tmp_path, zero["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    assert_one_point_per_step(metrics)
    history = zero["history"]
    assert history == one["history"]  # values reduced across both processes
    for name, values in history.items():
        if name != "epoch":
            assert [v for _, v in metrics[f"epoch/{name}"]] == values and not any(map(math.isnan, values))
