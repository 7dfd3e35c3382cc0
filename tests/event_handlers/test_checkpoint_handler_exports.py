"""CheckpointHandler's inference exports: ``save_weights_only``, ``save_best_only`` and
``initial_value_threshold``; exports never pruned and never overwriting another run's; a weights
export loaded by plain PyTorch in a process without estimatorch."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint
from tests.conftest import (Count, CrashAt, ScriptedValLoss, assert_tree_equal, make_batches, make_estimator,
                            without_sanity_pass)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def scripted_estimator(values: list[float]) -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    val_loss=ScriptedValLoss(values))
    return without_sanity_pass(est)


def fit_scripted(estimator: Estimator, handlers: list, epochs: int, **kwargs: Any) -> Any:
    return estimator.fit(make_batches(2), val_data=make_batches(1), epochs=epochs, event_handlers=handlers, **kwargs)


def improvements(values: list[float], initial: float = math.inf) -> list[int]:
    """1-based epochs where a loss in ``values`` beat ``initial`` and every earlier value."""
    best, epochs = initial, []
    for epoch, value in enumerate(values, start=1):
        if value < best:
            best = value
            epochs.append(epoch)
    return epochs


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every file the handler writes from now on, in order, as (name, what was saved)."""
    written: list[tuple[str, Any]] = []
    real_save = checkpoint.atomic_save

    def recording_save(obj: Any, path: Any, **kwargs: Any) -> None:
        written.append((os.path.basename(path), obj))
        real_save(obj, path, **kwargs)

    monkeypatch.setattr(checkpoint, "atomic_save", recording_save)
    return written


def names_written(writes: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in writes]


def weights_files(directory: Any, prefix: str = "model") -> list[str]:
    return [os.path.basename(p) for _, _, p in checkpoint.list_weights(directory, prefix)]


# -- save_weights_only ---------------------------------------------------------------------------
def test_weights_only_writes_plain_state_dicts_that_match_the_checkpoints(tmp_path, writes):
    """Beside a resumable handler saving at the same points, every export holds exactly the
    model of the checkpoint of the same point, as a plain state dict on the CPU."""
    estimator = make_estimator()
    exporter = CheckpointHandler(tmp_path, epoch_period=1, batch_period=3, save_weights_only=True)
    resumable = CheckpointHandler(tmp_path, model_prefix="ckpt", epoch_period=1, batch_period=3, max_checkpoints=None)
    estimator.fit(make_batches(4), epochs=2, event_handlers=[exporter, resumable])
    exports = weights_files(tmp_path)
    checkpoints = [os.path.basename(p) for _, _, p in checkpoint.list_checkpoints(tmp_path, "ckpt")]
    assert len(exports) == len(checkpoints) > 2
    assert [n.replace(".weights.pt", "").replace("model-", "") for n in exports] == \
           [n.replace(".pt", "").replace("ckpt-", "") for n in checkpoints]
    for export, full in zip(exports, checkpoints):
        state = torch.load(tmp_path / export, weights_only=True)
        assert type(state) is type(estimator.net.state_dict()) and list(state) == list(estimator.net.state_dict())
        assert all(t.device.type == "cpu" for t in state.values())
        assert_tree_equal(dict(state), dict(checkpoint.load(tmp_path / full)["model"]), export)
    assert not (tmp_path / "model-latest").exists()  # exports have no pointer
    assert all(name.endswith(".weights.pt") for name, _ in writes if name.startswith("model-"))


def test_exports_are_never_pruned(tmp_path):
    estimator = make_estimator()
    exporter = CheckpointHandler(tmp_path, epoch_period=None, batch_period=1, max_checkpoints=1,
                                 save_weights_only=True)
    resumable = CheckpointHandler(tmp_path, model_prefix="ckpt", epoch_period=None, batch_period=1, max_checkpoints=1)
    estimator.fit(make_batches(4), epochs=2, event_handlers=[exporter, resumable])
    steps = 2 * 4
    assert len(weights_files(tmp_path)) == steps
    assert len(checkpoint.list_checkpoints(tmp_path, "ckpt")) == 1  # retention still prunes checkpoints


def test_exports_are_written_atomically_and_their_orphans_are_removed(tmp_path, monkeypatch):
    orphan = tmp_path / ".model-best.weights.pt.0123456789ab.tmp"
    orphan.write_bytes(b"half")
    calls = []
    real = checkpoint.atomic_save
    monkeypatch.setattr(checkpoint, "atomic_save", lambda obj, path, **kw: (calls.append(path), real(obj, path, **kw)))
    estimator = make_estimator()
    estimator.fit(make_batches(2), epochs=1, event_handlers=[
        CheckpointHandler(tmp_path, monitor=estimator.train_metrics[0], save_best_only=True, save_weights_only=True)])
    assert [os.path.basename(p) for p in calls] == ["model-best.weights.pt"]
    assert not orphan.exists()
    assert sorted(os.listdir(tmp_path)) == ["model-best.weights.pt"]


# -- save_best_only, initial_value_threshold -------------------------------------------------------------
@pytest.mark.parametrize("weights", [True, False], ids=["weights", "checkpoint"])
def test_save_best_only_writes_the_best_alone_on_each_improvement(tmp_path, writes, weights):
    values = [3.0, 2.0, 2.5, 1.0, 1.0, 0.5, 0.7]
    expected = improvements(values)
    assert 0 < len(expected) < len(values)
    estimator = scripted_estimator(values)
    best = CheckpointHandler(tmp_path, monitor=estimator.val_metrics[0], save_best_only=True, save_weights_only=weights)
    reference = CheckpointHandler(tmp_path, model_prefix="ckpt", max_checkpoints=None)
    fit_scripted(estimator, [best, reference], epochs=len(values))
    name = checkpoint.best_weights_name("model") if weights else checkpoint.best_name("model")
    ckpt_writes = [n for n in names_written(writes) if n.startswith("ckpt-")]
    assert [n for n in names_written(writes) if n.startswith("model")] == [name] * len(expected)
    assert sorted(os.listdir(tmp_path)) == sorted([name, *ckpt_writes, "ckpt-latest"])
    best_epoch = expected[-1]
    at_best = checkpoint.load(tmp_path / checkpoint.checkpoint_name("ckpt", best_epoch, 2 * best_epoch))["model"]
    assert_tree_equal(dict(checkpoint.load_weights(tmp_path / name)), dict(at_best), name)
    assert best.best == min(values)


@pytest.mark.parametrize("threshold", [1.8, 0.1])
def test_initial_value_threshold_waits_for_the_monitor_to_beat_it(tmp_path, writes, threshold):
    values = [3.0, 2.0, 1.5, 2.5, 1.0]
    expected = improvements(values, initial=threshold)
    estimator = scripted_estimator(values)
    handler = CheckpointHandler(tmp_path, monitor=estimator.val_metrics[0], save_best_only=True,
                                save_weights_only=True, initial_value_threshold=threshold)
    assert handler.best == threshold
    fit_scripted(estimator, [handler], epochs=len(values))
    best_writes = [n for n in names_written(writes) if n == "model-best.weights.pt"]
    assert len(best_writes) == len(expected)
    assert (tmp_path / "model-best.weights.pt").exists() == bool(expected)
    assert handler.best == (values[expected[-1] - 1] if expected else threshold)


def test_initial_value_threshold_in_mode_max_with_save_best(tmp_path, writes):
    values = [0.1, 0.5, 0.3, 0.9]
    estimator = scripted_estimator(values)
    handler = CheckpointHandler(tmp_path, monitor=estimator.val_metrics[0], save_best=True, mode="max",
                                initial_value_threshold=0.4)
    fit_scripted(estimator, [handler], epochs=len(values))
    best_positions = [obj["ranks"][0]["position"]["epoch"] for n, obj in writes if n == "model-best.pt"]
    assert best_positions == [2, 4]  # 0.5 then 0.9 beat 0.4; 0.1 and 0.3 do not
    assert len([n for n in names_written(writes) if n.startswith("model-epoch")]) == len(values)


def test_a_best_only_monitor_not_computed_yet_warns_once_and_writes_nothing(tmp_path):
    estimator = make_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, save_best_only=True,
                                monitor=estimator.val_metrics[0])
    with pytest.warns(UserWarning, match="no validation ran in this fit, so val_loss") as caught:
        estimator.fit(make_batches(), epochs=2, event_handlers=[handler])
    assert sum("no validation ran" in str(w.message) for w in caught) == 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".pt")]


# -- never overwrite another run's exports -------------------------------------------------------------
def snapshot(directory: Any) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


def exporter_for(estimator: Estimator, directory: Any) -> CheckpointHandler:
    return CheckpointHandler(directory, monitor=estimator.val_metrics[0], save_best_only=True, save_weights_only=True)


def test_a_fresh_fit_refuses_another_runs_export_before_any_step(tmp_path):
    first = scripted_estimator([1.0])
    fit_scripted(first, [exporter_for(first, tmp_path)], epochs=1)
    before = snapshot(tmp_path)
    estimator, count = scripted_estimator([0.5]), Count()
    with pytest.raises(FileExistsError, match="model-best.weights.pt") as info:
        fit_scripted(estimator, [exporter_for(estimator, tmp_path), count], epochs=1)
    assert "fit(..., resume=True)" in str(info.value)
    assert count.batches == 0
    assert snapshot(tmp_path) == before


def _two_handlers(estimator: Estimator, directory: Any, resume: bool) -> list:
    return [exporter_for(estimator, directory),
            CheckpointHandler(directory, model_prefix="ckpt", batch_period=1, max_checkpoints=None,
                              resume_from_checkpoint=resume)]


@pytest.mark.parametrize("later, replaced", [(5.0, False), (0.5, True)], ids=["worse", "better"])
def test_a_resumed_run_keeps_the_exports_best_and_replaces_it_only_when_beaten(tmp_path, later, replaced):
    values = [1.0, 2.0, later]
    first = scripted_estimator(values)
    with pytest.raises(RuntimeError, match="crash"):
        fit_scripted(first, [*_two_handlers(first, tmp_path, resume=False), CrashAt(4)], epochs=3)
    before = (tmp_path / "model-best.weights.pt").read_bytes()

    estimator = scripted_estimator(values)  # a new process: the scripted losses restart at the first value
    estimator.val_loss.calls = 1  # the run validated once before the crash (epoch 1); epoch 2 resumes mid-way
    handlers = _two_handlers(estimator, tmp_path, resume=True)
    fit_scripted(estimator, handlers, epochs=3)
    assert handlers[0].best == min(values)
    assert ((tmp_path / "model-best.weights.pt").read_bytes() != before) == replaced


def test_a_resume_whose_checkpoint_lacks_the_exporters_state_never_replaces_its_file(tmp_path):
    (tmp_path / "model-best.weights.pt").write_bytes(b"another run's export")
    first = scripted_estimator([1.0, 1.0])
    with pytest.raises(RuntimeError, match="crash"):  # a run without the exporter leaves a checkpoint
        fit_scripted(first, [_two_handlers(first, tmp_path, resume=False)[1], CrashAt(2)], epochs=2)
    estimator = scripted_estimator([0.5, 0.4])
    with pytest.warns(UserWarning, match="no saved state"), pytest.raises(FileExistsError, match="another run"):
        fit_scripted(estimator, _two_handlers(estimator, tmp_path, resume=True), epochs=2)
    assert (tmp_path / "model-best.weights.pt").read_bytes() == b"another run's export"


def test_an_in_process_resume_continues_the_export(tmp_path):
    values = [2.0, 1.0, 0.5]
    estimator = scripted_estimator(values)
    handler = exporter_for(estimator, tmp_path)
    fit_scripted(estimator, [handler], epochs=2)
    fit_scripted(estimator, [handler], epochs=3, resume=True)
    assert handler.best == min(values)
    assert_tree_equal(dict(checkpoint.load_weights(tmp_path / "model-best.weights.pt")),
                      dict(checkpoint.weights_state(estimator.net)), "export")


def test_two_handlers_writing_the_same_files_are_refused_before_any_step(tmp_path):
    estimator, count = make_estimator(), Count()
    with pytest.raises(ValueError, match="another model_prefix"):
        estimator.fit(make_batches(2), epochs=1, event_handlers=[
            CheckpointHandler(tmp_path), CheckpointHandler(tmp_path, batch_period=1), count])
    assert count.batches == 0 and not [n for n in os.listdir(tmp_path) if n.endswith(".pt")]


# -- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(save_weights_only=1), TypeError, ["save_weights_only", "1"]),
    (dict(save_best_only="yes"), TypeError, ["save_best_only", "'yes'"]),
    (dict(save_best_only=True), ValueError, ["save_best_only", "monitor"]),
    (dict(save_weights_only=True, resume_from_checkpoint=True), ValueError,
     ["resume_from_checkpoint", "save_weights_only", "second CheckpointHandler"]),
    (dict(save_best_only=True, monitor="metric", resume_from_checkpoint=True), ValueError,
     ["resume_from_checkpoint", "save_best_only"]),
    (dict(save_best=True, monitor="metric", initial_value_threshold="1"), TypeError, ["initial_value_threshold", "'1'"]),
    (dict(save_best=True, monitor="metric", initial_value_threshold=True), TypeError, ["initial_value_threshold"]),
    (dict(save_best=True, monitor="metric", initial_value_threshold=math.nan), ValueError,
     ["initial_value_threshold", "nan"]),
    (dict(initial_value_threshold=0.5), ValueError, ["initial_value_threshold", "0.5", "save_best"]),
])
def test_bad_export_arguments_name_the_argument_and_value(tmp_path, kwargs, exc, words):
    if kwargs.get("monitor") == "metric":
        kwargs["monitor"] = make_estimator().val_metrics[0]
    with pytest.raises(exc) as info:
        CheckpointHandler(tmp_path, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# -- load_weights and plain PyTorch ----------------------------------------------------------------------
def test_load_weights_reads_every_kind_of_file_the_handler_writes(tmp_path):
    estimator = make_estimator()
    estimator.fit(make_batches(2), epochs=2, event_handlers=[
        CheckpointHandler(tmp_path, monitor=estimator.train_metrics[0], save_best=True),
        CheckpointHandler(tmp_path, monitor=estimator.train_metrics[0], save_best=True, save_weights_only=True)])
    final = dict(estimator.net.state_dict())
    for name in ["model-epoch2batch4.pt", "model-epoch2batch4.weights.pt", "model-latest", ""]:
        assert_tree_equal(dict(checkpoint.load_weights(tmp_path / name)), final, name or "the directory")


PLAIN_TORCH = r"""
import json, sys
import torch
from torch import nn
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
net.load_state_dict(torch.load(sys.argv[1], weights_only=True))
x = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    out = net.eval()(x)
json.dump({"out": out.tolist(), "estimatorch": "estimatorch" in sys.modules,
           "modules": sorted(m for m in sys.modules if m.startswith("estimatorch"))}, sys.stdout)
"""


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_a_weights_export_loads_in_plain_pytorch_without_estimatorch(tmp_path, compiled):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))  # the net the serving script builds
    model = torch.compile(net, backend="eager") if compiled else net
    estimator = Estimator(model, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    estimator.fit(make_batches(4), epochs=1, event_handlers=[
        CheckpointHandler(tmp_path / "run", monitor=estimator.train_metrics[0], save_best_only=True,
                          save_weights_only=True)])
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    torch.save(x, tmp_path / "x.pt")
    script = tmp_path / "serve.py"
    script.write_text(PLAIN_TORCH)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run" / "model-best.weights.pt"),
                           str(tmp_path / "x.pt")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["estimatorch"] is False and result["modules"] == []
    with torch.no_grad():
        expected = net.eval()(x)
    assert torch.equal(torch.tensor(result["out"]), expected)


def test_an_exporters_state_is_saved_under_its_own_name_whatever_the_order(tmp_path):
    estimator = make_estimator()
    monitor = estimator.train_metrics[0]
    handlers = [CheckpointHandler(tmp_path, monitor=monitor, save_best_only=True, save_weights_only=True),
                CheckpointHandler(tmp_path, model_prefix="full", monitor=monitor, save_best_only=True),
                CheckpointHandler(tmp_path, model_prefix="ckpt")]
    estimator.fit(make_batches(2), epochs=1, event_handlers=handlers)
    saved = checkpoint.load(tmp_path / checkpoint.checkpoint_name("ckpt", 1, 2))["ranks"][0]["handlers"]
    expected = ["CheckpointHandler[model-best.weights]", "CheckpointHandler[full-best]", "CheckpointHandler"]
    assert [h.name for h in handlers] == expected
    assert all(name in saved for name in expected)
    handlers[0].name = "export"
    assert handlers[0].name == "export"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_export_of_a_cuda_run_holds_cpu_tensors(tmp_path):
    """A serving process without a GPU loads it without map_location; load_weights of a CUDA
    run's checkpoint gives CPU tensors too."""
    estimator = make_estimator(device="cuda")
    estimator.fit(make_batches(2), epochs=1, event_handlers=[
        CheckpointHandler(tmp_path, save_weights_only=True), CheckpointHandler(tmp_path, model_prefix="ckpt")])
    final = {k: v.cpu() for k, v in estimator.net.state_dict().items()}
    assert all(v.device.type == "cuda" for v in estimator.net.state_dict().values())
    export = torch.load(tmp_path / checkpoint.weights_name("model", 1, 2), weights_only=True)
    from_checkpoint = checkpoint.load_weights(tmp_path / checkpoint.checkpoint_name("ckpt", 1, 2))
    for state in (export, from_checkpoint):
        assert all(v.device.type == "cpu" for v in state.values())
        assert_tree_equal(dict(state), final, "weights")
