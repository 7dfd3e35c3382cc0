"""What a path names (a file, the latest pointer, a directory's newest valid file), weights
exports, and ``load_weights`` from every kind of file."""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict

import pytest
import torch
from torch import nn

from estimatorch import checkpoint
from estimatorch.checkpoint import CheckpointError
from tests.checkpoint import runs
from tests.conftest import assert_tree_equal


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The run of ``runs``: a checkpoint after every batch and the latest pointer."""
    return runs.fit_run(tmp_path_factory.mktemp("locate"))


def model_of(path) -> dict:
    return dict(checkpoint.load(path)["model"])


# -- saved_files: which files, newest first -----------------------------------------------------------
def test_saved_files_orders_periodic_files_by_progress_then_best_files_by_time(tmp_path):
    periodic = ["a-epoch0batch3.pt", "a-epoch1batch10.pt", "b-epoch1batch9.pt", "a-epoch1batch10.weights.pt",
                "a-epoch0batch2.weights.pt"]
    best = ["a-best.pt", "b-best.weights.pt"]
    ignored = ["a-latest", ".a-epoch1batch11.pt.0123456789ab.tmp", "a-epoch1batch12.pt.v1", "notes.txt",
               "a-epoch1batch13x.pt", ".estimatorch.lock"]
    for i, name in enumerate(periodic + best + ignored):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, ns=(10**9 * (i + 1),) * 2)
    (tmp_path / "c-epoch9batch99.pt").mkdir()  # a directory is not a file
    names = [os.path.basename(p) for p in checkpoint.saved_files(tmp_path)]
    # most batches first; at the same point a checkpoint before an export; best files last, newest first
    assert names == ["a-epoch1batch10.pt", "a-epoch1batch10.weights.pt", "b-epoch1batch9.pt", "a-epoch0batch3.pt",
                     "a-epoch0batch2.weights.pt", "b-best.weights.pt", "a-best.pt"]


# -- locate and load_weights ----------------------------------------------------------------------------
def test_load_weights_of_a_checkpoint_is_its_model_state(reference):
    path = os.path.join(reference.dir, runs.name(3))
    assert_tree_equal(dict(checkpoint.load_weights(path)), model_of(path), "model")


def test_load_weights_of_the_pointer_and_of_the_directory(reference):
    newest = os.path.join(reference.dir, runs.name(runs.STEPS))
    assert checkpoint.read_latest(reference.dir, "model") == runs.name(runs.STEPS)
    for path in (os.path.join(reference.dir, "model-latest"), reference.dir):
        found = checkpoint.locate(path)
        assert (found.path, found.kind, found.skipped) == (newest, "checkpoint", [])
        assert found.how
        assert_tree_equal(dict(checkpoint.load_weights(path)), model_of(newest), path)
    assert_tree_equal(model_of(newest), dict(reference.estimator.net.state_dict()), "the final model")


def test_a_directory_skips_unreadable_newer_files_with_a_warning(reference, tmp_path, estimatorch_log):
    runs.copy_files(reference, tmp_path, range(1, runs.STEPS + 1))
    (tmp_path / runs.name(runs.STEPS)).write_bytes(b"")  # a write that never completed
    checkpoint.atomic_save({"format_version": checkpoint.FORMAT_VERSION + 1}, tmp_path / "model-epoch9batch99.pt")
    found = checkpoint.locate(tmp_path)
    assert os.path.basename(found.path) == runs.name(runs.STEPS - 1)
    assert [s.split(":")[0] for s in found.skipped] == ["model-epoch9batch99.pt", runs.name(runs.STEPS)]
    assert "newer estimatorch" in found.skipped[0] and "empty" in found.skipped[1]
    checkpoint.load_weights(tmp_path)
    warned = [r.getMessage() for r in estimatorch_log if r.levelname == "WARNING"]
    assert len(warned) == 2 and runs.name(runs.STEPS) in warned[1]


def test_a_weights_export_round_trips_with_plain_torch(tmp_path):
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    path = tmp_path / "model-best.weights.pt"
    checkpoint.atomic_save(checkpoint.weights_state(net), path)
    raw = torch.load(path, weights_only=True)
    assert isinstance(raw, OrderedDict) and raw._metadata == net.state_dict()._metadata  # module versions kept
    found = checkpoint.locate(path)
    assert found.kind == "weights" and found.how == ""
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh.load_state_dict(checkpoint.load_weights(path))
    assert_tree_equal(dict(fresh.state_dict()), dict(net.state_dict()), "weights")


def test_weights_state_has_the_plain_modules_keys_on_the_cpu():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    plain = list(net.state_dict())
    assert list(checkpoint.weights_state(nn.DataParallel(net))) == plain
    assert list(checkpoint.weights_state(torch.compile(net, backend="eager"))) == plain
    inside = nn.Sequential(torch.compile(net, backend="eager"))  # a compiled submodule
    assert "0._orig_mod.0.weight" in inside.state_dict()
    assert list(checkpoint.weights_state(inside)) == [f"0.{key}" for key in plain]
    state = checkpoint.weights_state(net)
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())


@pytest.mark.parametrize("obj, expected", [
    ({"w": torch.zeros(2)}, True),
    (OrderedDict(w=torch.zeros(2), b=torch.ones(1)), True),
    ({"w": torch.zeros(2), "layer._extra_state": {"any": 1}}, True),
    ({"w": torch.zeros(2), "n": 3}, False),
    ({"format_version": 2, "w": torch.zeros(2)}, False),
    ({1: torch.zeros(2)}, False),
    ([torch.zeros(2)], False),
    (torch.zeros(2), False),
])
def test_is_weights(obj, expected):
    assert checkpoint.is_weights(obj) is expected


# -- what is not a checkpoint, in words ---------------------------------------------------------------
def _pointer(directory, text: str):
    path = directory / "model-latest"
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, exc, words", [
    (lambda d: d / "missing.pt", FileNotFoundError, ["no such file or directory", "missing.pt"]),
    (lambda d: (d / "notes.txt").write_text("hello") and d / "notes.txt", CheckpointError,
     ["not a file torch.save wrote", "notes.txt"]),
    (lambda d: (torch.save(torch.zeros(2), d / "t.pt"), d / "t.pt")[1], CheckpointError,
     ["neither an estimatorch checkpoint nor a weights export", "a Tensor"]),
    (lambda d: d, CheckpointError, ["holds no checkpoint or weights export"]),
    (lambda d: ((d / "model-epoch0batch1.pt").write_bytes(b"PK\x03\x04junk"), d)[1], CheckpointError,
     ["none of the 1", "model-epoch0batch1.pt"]),
    (lambda d: _pointer(d, "model-epoch0batch7.pt\n"), CheckpointError,
     ["names 'model-epoch0batch7.pt', which is not in"]),
    (lambda d: _pointer(d, "../outside.pt\n"), CheckpointError, ["should name a file in its directory"]),
    (lambda d: _pointer(d, ""), CheckpointError, ["should name a file in its directory"]),
])
def test_what_names_no_checkpoint_is_a_clear_error(tmp_path, make, exc, words):
    directory = tmp_path / "d"
    directory.mkdir()
    (tmp_path / "outside.pt").write_bytes(b"x")  # exists, but outside the pointer's directory
    path = make(directory)
    with pytest.raises(exc) as info:
        checkpoint.load_weights(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert "Unsupported operand" not in str(info.value) and "Errno 21" not in str(info.value)


def test_the_pointer_never_leads_outside_its_directory(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    shutil.copy(os.devnull, tmp_path / "x.pt")
    _pointer(inner, os.path.join("..", "x.pt"))
    with pytest.raises(CheckpointError, match="should name a file"):
        checkpoint.locate(inner / "model-latest")
