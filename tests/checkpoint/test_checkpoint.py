"""estimatorch.checkpoint: names, atomic save, safe load, versions and migration, discovery of the
newest valid file, and the command line.

Real checkpoints come from the run of ``tests/fixtures/make_v1_checkpoint.py`` (tiny, and exact
in float64, so that its committed version-1 file can be resumed on any machine).
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.checkpoint import FORMAT_VERSION, CheckpointError
from estimatorch.event_handlers import BatchEnd, StatefulHandler
from tests.conftest import LossRecorder, assert_same_training_state, assert_tree_equal
from tests.fixtures import make_v1_checkpoint as v1

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = v1.EPOCHS * v1.BATCHES_PER_EPOCH


# -- helpers ------------------------------------------------------------------------------------
def periodic_name(step: int) -> str:
    """The name of the fixture run's batch-period checkpoint after ``step`` batches."""
    return checkpoint.checkpoint_name("model", (step - 1) // v1.BATCHES_PER_EPOCH, step)


def fit_fixture_run(directory: Any, **handler_kwargs: Any) -> SimpleNamespace:
    """Train the fixture's configuration, saving after every batch into ``directory``."""
    estimator, loader = v1.build()
    recorder = LossRecorder()
    handler = CheckpointHandler(directory, batch_period=1, epoch_period=None, max_checkpoints=None,
                                **handler_kwargs)
    history = estimator.fit(loader, epochs=v1.EPOCHS, event_handlers=[handler, recorder])
    return SimpleNamespace(estimator=estimator, losses=recorder.losses, history=history, dir=directory)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The fixture's configuration trained without interruption, a checkpoint after every batch."""
    run = fit_fixture_run(tmp_path_factory.mktemp("reference"))
    assert len(run.losses) == STEPS
    return run


def save_raw(obj: Any, path: Any) -> str:
    torch.save(obj, path)
    return os.fspath(path)


# -- names and listing ---------------------------------------------------------------------------
def test_checkpoint_name_holds_epochs_and_batches():
    assert checkpoint.checkpoint_name("run", 2, 14) == "run-epoch2batch14.pt"


def test_list_checkpoints_matches_exact_names_in_numeric_order(tmp_path):
    wanted = ["model-epoch0batch9.pt", "model-epoch0batch10.pt", "model-epoch1batch10.pt"]
    decoys = ["model-epoch0batch1x.pt", "modelx-epoch0batch1.pt", "model2-epoch0batch1.pt",
              "model-best.pt", "model-latest", "model-epoch0batch1.pt.v1", ".model-epoch0batch1.pt.x.tmp",
              "xmodel-epoch0batch1.pt"]
    for name in wanted + decoys:
        (tmp_path / name).write_bytes(b"")
    listed = checkpoint.list_checkpoints(tmp_path, "model")
    assert listed == [(0, 9, str(tmp_path / wanted[0])), (0, 10, str(tmp_path / wanted[1])),
                      (1, 10, str(tmp_path / wanted[2]))]


def test_list_checkpoints_escapes_the_prefix(tmp_path):
    (tmp_path / "mXdel-epoch0batch1.pt").write_bytes(b"")
    (tmp_path / "m.del-epoch0batch2.pt").write_bytes(b"")
    assert [b for _, b, _ in checkpoint.list_checkpoints(tmp_path, "m.del")] == [2]


def test_list_checkpoints_of_a_missing_directory_is_empty(tmp_path):
    assert checkpoint.list_checkpoints(tmp_path / "missing", "model") == []


# -- atomic save -----------------------------------------------------------------------------------
def test_atomic_save_writes_the_whole_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.pt"
    checkpoint.atomic_save({"weight": torch.arange(6.0)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["weight"], torch.arange(6.0))
    assert os.listdir(tmp_path) == ["model.pt"]


def test_atomic_save_gives_the_permissions_of_a_plain_open(tmp_path):
    checkpoint.atomic_save({"weight": torch.zeros(1)}, tmp_path / "model.pt")
    with open(tmp_path / "plain.pt", "wb"):
        pass
    assert os.stat(tmp_path / "model.pt").st_mode == os.stat(tmp_path / "plain.pt").st_mode


def _failing_writer(exc_type: type[BaseException]):
    """A writer that writes half of a real checkpoint's bytes, then fails (a crash, a full disk)."""

    def writer(obj: Any, f: Any) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        raise exc_type("failed in the middle of the write")

    return writer


@pytest.mark.parametrize("exc_type", [OSError, KeyboardInterrupt])
def test_atomic_save_failing_mid_write_keeps_the_previous_file(tmp_path, exc_type):
    path = tmp_path / "model.pt"
    checkpoint.atomic_save({"weight": torch.zeros(4)}, path)
    before = path.read_bytes()
    with pytest.raises(exc_type, match="middle of the write"):
        checkpoint.atomic_save({"weight": torch.ones(1000)}, path, writer=_failing_writer(exc_type))
    assert path.read_bytes() == before
    assert torch.equal(torch.load(path, weights_only=True)["weight"], torch.zeros(4))
    assert os.listdir(tmp_path) == ["model.pt"]


def test_atomic_save_failing_mid_write_creates_nothing(tmp_path):
    with pytest.raises(OSError):
        checkpoint.atomic_save({"weight": torch.ones(1000)}, tmp_path / "model.pt", writer=_failing_writer(OSError))
    assert os.listdir(tmp_path) == []


# -- safety: plain values only ---------------------------------------------------------------------
class StateHandler(StatefulHandler, BatchEnd):
    """A handler whose state is given."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


@pytest.mark.parametrize("state, where, kind", [
    ({"seen": {1, 2}}, "['StateHandler']['seen']", "set"),
    ({"log": [1, {"fn": print}]}, "['StateHandler']['log'][1]['fn']", "builtin_function_or_method"),
    ({"opaque": object()}, "['StateHandler']['opaque']", "object"),
    ({("a", 1): 0}, "['StateHandler']", "tuple"),
])
def test_build_payload_refuses_non_plain_handler_state(tmp_path, state, where, kind):
    estimator, loader = v1.build()
    handlers = [StateHandler(state), CheckpointHandler(tmp_path, batch_period=1)]
    with pytest.raises(TypeError) as info:
        estimator.fit(loader, epochs=1, event_handlers=handlers)
    assert where in str(info.value) and kind in str(info.value)
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".pt")]


_CALLS: list[Any] = []


def _record_call(*args: Any) -> None:
    _CALLS.append(args)


class CallOnUnpickle:
    """Unpickling this calls ``_record_call``: what a malicious file would do."""

    def __reduce__(self) -> Any:
        return (_record_call, ("unpickled",))


@pytest.mark.parametrize("make_obj", [lambda: os.system, CallOnUnpickle], ids=["os.system", "reduce"])
def test_load_never_unpickles_code(tmp_path, make_obj):
    path = save_raw({"format_version": FORMAT_VERSION, "x": make_obj()}, tmp_path / "model-epoch0batch1.pt")
    _CALLS.clear()
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(path)
    assert _CALLS == []
    assert checkpoint.find_latest(tmp_path, "model") is None
    assert _CALLS == []


def test_the_reduce_file_would_run_code_if_unpickled(tmp_path):
    """The premise of the test above: an unrestricted load does call the function."""
    path = save_raw({"x": CallOnUnpickle()}, tmp_path / "evil.pt")
    _CALLS.clear()
    torch.load(path, weights_only=False)
    assert _CALLS == [("unpickled",)]


# -- versions --------------------------------------------------------------------------------------
def test_load_refuses_a_newer_format_naming_both_versions(reference, tmp_path):
    payload = checkpoint.load(os.path.join(reference.dir, periodic_name(1)))
    payload["format_version"] = FORMAT_VERSION + 1
    path = save_raw(payload, tmp_path / "model.pt")
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    message = str(info.value)
    assert f"newer estimatorch (format {FORMAT_VERSION + 1};" in message
    assert f"up to format {FORMAT_VERSION})" in message and "choose another model_dir" in message
    assert isinstance(info.value, checkpoint.NewerFormatError)


def _valid_payload(reference: SimpleNamespace) -> dict:
    return checkpoint.load(os.path.join(reference.dir, periodic_name(1)))


@pytest.mark.parametrize("make, match", [
    (lambda ref: {"model": {}}, "not an estimatorch checkpoint"),
    (lambda ref: torch.zeros(3), "not an estimatorch checkpoint"),
    (lambda ref: {"format_version": True}, "not an estimatorch checkpoint"),
    (lambda ref: {"format_version": 0}, "not an estimatorch checkpoint"),
    (lambda ref: {"format_version": 1, "model": {}}, "format version 1 but lacks"),
    (lambda ref: {k: v for k, v in _valid_payload(ref).items() if k != "ranks"}, "missing 'ranks'"),
    (lambda ref: dict(_valid_payload(ref), world_size=2), "1 rank snapshots for world size 2"),
    (lambda ref: dict(_valid_payload(ref), ranks=[{k: v for k, v in _valid_payload(ref)["ranks"][0].items()
                                                    if k != "handlers"}]), "rank 0 is missing 'handlers'"),
], ids=["no-version", "tensor", "bool-version", "version-0", "damaged-v1", "no-ranks", "world-size",
        "no-handlers"])
def test_load_refuses_what_is_not_a_valid_checkpoint(reference, tmp_path, make, match):
    path = save_raw(make(reference), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(path)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint\n"], ids=["empty", "text"])
def test_load_refuses_unreadable_files(tmp_path, content):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(path)


def test_load_refuses_a_truncated_checkpoint(reference, tmp_path):
    with open(os.path.join(reference.dir, periodic_name(1)), "rb") as f:
        data = f.read()
    path = tmp_path / "model.pt"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(path)


def test_load_of_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "model.pt")


def test_restore_training_state_refuses_a_missing_scheduler(reference):
    payload = checkpoint.load(os.path.join(reference.dir, periodic_name(1)))
    estimator, _ = v1.build()
    bare = Estimator(estimator.net, nn.MSELoss(), optimizer=torch.optim.SGD(estimator.net.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="lr_scheduler"):
        checkpoint.restore_training_state(bare, payload)


# -- discovery -------------------------------------------------------------------------------------
def test_find_latest_is_none_without_checkpoints(tmp_path):
    assert checkpoint.find_latest(tmp_path / "missing", "model") is None
    (tmp_path / "model2-epoch0batch1.pt").write_bytes(b"")
    (tmp_path / "model-best.pt").write_bytes(b"")
    assert checkpoint.find_latest(tmp_path, "model") is None


def test_find_latest_skips_a_corrupt_newest_file_and_resume_uses_the_next(reference, tmp_path, estimatorch_log):
    newest = v1.STEP
    for step in range(1, newest + 1):
        shutil.copy(os.path.join(reference.dir, periodic_name(step)), tmp_path)
    checkpoint.write_latest(tmp_path, "model", tmp_path / periodic_name(newest))
    corrupt = tmp_path / periodic_name(newest)
    corrupt.write_bytes(corrupt.read_bytes()[:100])  # a crash without atomic writes, a bad disk

    path, payload = checkpoint.find_latest(tmp_path, "model")
    assert path == str(tmp_path / periodic_name(newest - 1))
    assert payload["ranks"][0]["position"]["step"] == newest - 1
    assert any(r.levelno == logging.WARNING and periodic_name(newest) in r.getMessage() for r in estimatorch_log)

    resumed = fit_fixture_run(tmp_path, resume_from_checkpoint=True)
    assert resumed.losses == reference.losses[newest - 1:]
    assert_same_training_state(resumed.estimator, reference.estimator)
    checkpoint.load(corrupt)  # rewritten by the resumed run


@pytest.mark.parametrize("key", ["partial", "rng", "position"])
def test_a_newest_file_whose_snapshot_lacks_a_key_is_skipped_naming_it(reference, tmp_path, estimatorch_log, key):
    """The store reads the envelope; the estimator's check (``check_payload``) finds what a rank's
    snapshot lacks, and the resume falls back to the previous file."""
    newest = v1.STEP
    for step in (newest - 1, newest):
        shutil.copy(os.path.join(reference.dir, periodic_name(step)), tmp_path)
    payload = checkpoint.load(tmp_path / periodic_name(newest))
    del payload["ranks"][0][key]
    torch.save(payload, tmp_path / periodic_name(newest))

    resumed = fit_fixture_run(tmp_path, resume_from_checkpoint=True)
    assert resumed.losses == reference.losses[newest - 1:]
    assert any(r.levelno == logging.WARNING and periodic_name(newest) in r.getMessage()
               and f"rank 0 is missing {key!r}" in r.getMessage() for r in estimatorch_log)


def test_find_latest_takes_the_newest_file_even_when_the_pointer_lags(reference, tmp_path):
    """A crash after writing a checkpoint but before its pointer must not hide that checkpoint."""
    for step in (1, 2):
        shutil.copy(os.path.join(reference.dir, periodic_name(step)), tmp_path)
    checkpoint.write_latest(tmp_path, "model", tmp_path / periodic_name(1))
    path, payload = checkpoint.find_latest(tmp_path, "model")
    assert path == str(tmp_path / periodic_name(2)) and payload["ranks"][0]["position"]["step"] == 2


def test_find_latest_ignores_an_unreadable_pointer(reference, tmp_path, estimatorch_log):
    shutil.copy(os.path.join(reference.dir, periodic_name(2)), tmp_path)
    (tmp_path / "model-latest").write_bytes(b"\xff\xfe\x00garbage")
    path, _ = checkpoint.find_latest(tmp_path, "model")
    assert path == str(tmp_path / periodic_name(2))


# -- the version-1 fixture and migration ----------------------------------------------------------
def _expected_fixture_position() -> dict:
    return {"epoch": v1.STEP // v1.BATCHES_PER_EPOCH, "batch": v1.STEP % v1.BATCHES_PER_EPOCH,
            "step": v1.STEP, "phase": "batch_end", "stop": False}


def test_v1_fixture_has_the_first_layout():
    raw = torch.load(v1.FIXTURE, map_location="cpu", weights_only=True)
    assert raw["format_version"] == 1
    assert set(raw) == {"format_version", "model", "optimizer", "lr_scheduler", "grad_scaler", *v1.V1_SNAPSHOT_KEYS}
    assert raw["position"] == _expected_fixture_position()


def test_v1_fixture_loads_migrated_in_memory():
    raw = torch.load(v1.FIXTURE, map_location="cpu", weights_only=True)
    payload = checkpoint.load(v1.FIXTURE)
    assert payload["format_version"] == FORMAT_VERSION and payload["world_size"] == 1
    (snapshot,) = payload["ranks"]
    assert snapshot["position"] == _expected_fixture_position()
    assert snapshot["partial"] is False
    for key in v1.V1_SNAPSHOT_KEYS:
        assert_tree_equal(snapshot[key], raw[key], key)
    for key in ("model", "optimizer", "lr_scheduler", "grad_scaler"):
        assert_tree_equal(payload[key], raw[key], key)


def test_v1_fixture_resumes_bit_identically(reference, tmp_path):
    same_start = checkpoint.load(os.path.join(reference.dir, periodic_name(v1.STEP)))
    assert_tree_equal(checkpoint.load(v1.FIXTURE)["model"], same_start["model"],
                      "the fixture's model vs this machine's run at the same step")
    shutil.copy(v1.FIXTURE, tmp_path)
    resumed = fit_fixture_run(tmp_path, resume_from_checkpoint=True)
    assert resumed.losses == reference.losses[v1.STEP:]
    assert_same_training_state(resumed.estimator, reference.estimator)
    assert_tree_equal(resumed.history.to_dict(), reference.history.to_dict(), "history")


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "estimatorch.checkpoint", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_migrate_upgrades_in_place_keeps_the_original_and_refuses_newer(tmp_path):
    name = os.path.basename(v1.FIXTURE)
    path = tmp_path / name
    shutil.copy(v1.FIXTURE, path)
    original = path.read_bytes()

    done = _run_cli("migrate", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RuntimeWarning" not in done.stderr
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw["format_version"] == FORMAT_VERSION and len(raw["ranks"]) == 1
    assert (tmp_path / f"{name}.v1").read_bytes() == original
    assert_tree_equal(checkpoint.load(path), checkpoint.load(v1.FIXTURE), "migrated file")
    assert sorted(os.listdir(tmp_path)) == [name, f"{name}.v1"]

    newer = tmp_path / "model-epoch9batch99.pt"
    save_raw({"format_version": FORMAT_VERSION + 1}, newer)
    newer_bytes, upgraded = newer.read_bytes(), path.read_bytes()
    done = _run_cli("migrate", str(tmp_path))
    assert done.returncode == 2
    assert f"(format {FORMAT_VERSION + 1};" in done.stdout and "model-epoch9batch99.pt" in done.stdout
    assert newer.read_bytes() == newer_bytes and path.read_bytes() == upgraded
    assert (tmp_path / f"{name}.v1").read_bytes() == original


@pytest.mark.slow
def test_cli_inspect_prints_the_position():
    done = _run_cli("inspect", v1.FIXTURE)
    assert done.returncode == 0, done.stderr
    assert f"position {_expected_fixture_position()}" in done.stdout
    assert "format 2" in done.stdout


def test_cli_reports_errors_with_exit_status_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        checkpoint.main(["migrate", str(tmp_path / "missing")])
    assert info.value.code == 2
    assert checkpoint.main(["inspect", str(tmp_path / "missing.pt")]) == 2
    assert "missing.pt" in capsys.readouterr().err
    newer = save_raw({"format_version": FORMAT_VERSION + 1}, tmp_path / "model.pt")
    assert checkpoint.main(["inspect", newer]) == 2
    assert f"(format {FORMAT_VERSION + 1};" in capsys.readouterr().err


def test_atomic_save_syncs_the_file_then_renames_then_syncs_the_directory(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.atomic_save({"x": torch.zeros(2)}, tmp_path / "model-epoch0batch1.pt")
    assert calls == [("fsync", False), ("replace", "model-epoch0batch1.pt"), ("fsync", True)]
