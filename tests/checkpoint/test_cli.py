"""``python -m estimatorch.checkpoint``: ``inspect`` on a file, the latest pointer, a directory or
a weights export; clear errors with exit status 2 for anything else; complete help texts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import _cli
from tests.checkpoint import runs
from tests.fixtures import make_v1_checkpoint as v1

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory):
    """The run of ``runs``: a checkpoint after every batch, the pointer, and a weights export."""
    directory = tmp_path_factory.mktemp("cli")
    return runs.fit_run(directory, extra=[
        CheckpointHandler(directory, epoch_period=None, batch_period=runs.STEPS, save_weights_only=True)])


def inspect(path, capsys) -> tuple[int, str, str]:
    code = checkpoint.main(["inspect", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def position_of(path) -> dict:
    return checkpoint.load(path)["ranks"][0]["position"]


# -- inspect ------------------------------------------------------------------------------------------
def test_inspect_a_checkpoint_file(reference, capsys):
    path = os.path.join(reference.dir, runs.name(3))
    code, out, err = inspect(path, capsys)
    assert (code, err) == (0, "")
    assert out.splitlines()[0].startswith(f"{path}: checkpoint, format {checkpoint.FORMAT_VERSION}")
    assert f"position {position_of(path)}" in out
    numel = sum(t.numel() for t in checkpoint.load(path)["model"].values())
    assert f"{len(checkpoint.load(path)['model'])} tensors, {numel} values" in out


def test_inspect_the_latest_pointer_shows_the_file_it_names(reference, capsys):
    pointer = os.path.join(reference.dir, "model-latest")
    target = os.path.join(reference.dir, checkpoint.read_latest(reference.dir, "model"))
    code, out, err = inspect(pointer, capsys)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"{target} ({pointer} points to it)"
    assert f"position {position_of(target)}" in out


def test_inspect_a_directory_shows_its_newest_valid_file_and_says_which(reference, capsys):
    newest = os.path.join(reference.dir, runs.name(runs.STEPS))
    files = len(checkpoint.saved_files(reference.dir))
    assert files == runs.STEPS + 1  # the checkpoints and the export
    code, out, err = inspect(reference.dir, capsys)
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"{newest} (the newest valid of {files} checkpoint and export files in {reference.dir})"
    assert f"position {position_of(newest)}" in out


def test_inspect_a_directory_whose_newest_file_is_damaged(reference, tmp_path, capsys):
    runs.copy_files(reference, tmp_path, range(1, runs.STEPS + 1))
    with open(tmp_path / runs.name(runs.STEPS), "r+b") as f:
        f.truncate(100)
    code, out, err = inspect(tmp_path, capsys)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{tmp_path / runs.name(runs.STEPS - 1)} (the newest valid")
    assert err.startswith(f"warning: skipped {runs.name(runs.STEPS)}: cannot read checkpoint")


def test_inspect_a_weights_export(reference, capsys):
    path = os.path.join(reference.dir, checkpoint.weights_name("model", runs.EPOCHS - 1, runs.STEPS))  # last batch
    state = torch.load(path, weights_only=True)
    code, out, err = inspect(path, capsys)
    assert (code, err) == (0, "")
    numel = sum(t.numel() for t in state.values())
    assert out.splitlines()[0] == (f"{path}: weights export (a state dict for load_state_dict), "
                                   f"{len(state)} tensors, {numel} values (float32)")
    assert str(list(state)[:8]) in out


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.pt", ["missing.pt' does not exist"]),
    (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", ["not a file torch.save wrote"]),
    (lambda d: (torch.save([1, 2], d / "list.pt"), d / "list.pt")[1], ["neither an estimatorch checkpoint", "a list"]),
    (lambda d: d, ["holds no checkpoint or weights export"]),
    (lambda d: ((d / "model-latest").write_text("model-epoch0batch1.pt\n"), d / "model-latest")[1],
     ["'model-epoch0batch1.pt', which is not in"]),
    (lambda d: (torch.save({"format_version": checkpoint.FORMAT_VERSION + 1}, d / "model.pt"), d / "model.pt")[1],
     [f"(format {checkpoint.FORMAT_VERSION + 1};"]),
], ids=["missing", "text", "list", "empty-directory", "dangling-pointer", "newer"])
def test_inspect_anything_else_is_a_clear_error_with_status_2(tmp_path, capsys, make, words):
    code, out, err = inspect(make(tmp_path), capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1
    for word in words:
        assert word in err, (word, err)


# -- migrate --------------------------------------------------------------------------------------------------
def test_migrate_leaves_weights_exports_alone(reference, tmp_path, capsys):
    export = checkpoint.weights_name("model", runs.EPOCHS - 1, runs.STEPS)
    shutil.copy(os.path.join(reference.dir, export), tmp_path)
    shutil.copy(v1.FIXTURE, tmp_path)
    before = (tmp_path / export).read_bytes()
    assert checkpoint.main(["migrate", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"ok   {export}: a weights export (nothing to upgrade)" in out and "1 upgraded, 0 refused" in out
    assert (tmp_path / export).read_bytes() == before


def test_migrate_on_a_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as info:
        checkpoint.main(["migrate", str(tmp_path / "f")])
    assert info.value.code == 2 and "is not a directory" in capsys.readouterr().err


# -- help -----------------------------------------------------------------------------------------------------
def _words(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("text", [_cli.DESCRIPTION, _cli.INSPECT_HELP, _cli.MIGRATE_HELP])
def test_help_texts_are_one_complete_line(text):
    assert "\n" not in text and text.endswith(".") and text[0].isupper()
    assert not re.search(r"\b(and|or|the|a|of|in|to|with),?\.$", text)


@pytest.mark.parametrize("argv, texts", [
    ([], [_cli.DESCRIPTION, f"inspect {_cli.INSPECT_HELP}", f"migrate {_cli.MIGRATE_HELP}"]),
    (["inspect"], [_cli.INSPECT_HELP]),
    (["migrate"], [_cli.MIGRATE_HELP]),
])
def test_help_shows_every_text_whole(argv, texts, capsys):
    with pytest.raises(SystemExit) as info:
        checkpoint.main([*argv, "--help"])
    assert info.value.code == 0
    out = _words(capsys.readouterr().out)
    for text in texts:
        assert _words(text) in out, text


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        checkpoint.main([])
    assert info.value.code == 2 and "COMMAND" in capsys.readouterr().err


# -- as a program ---------------------------------------------------------------------------------------------
def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "estimatorch.checkpoint", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_program_exits_0_on_the_pointer_and_2_on_a_directory_without_checkpoints(reference, tmp_path):
    done = _run("inspect", os.path.join(reference.dir, "model-latest"))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "points to it" in done.stdout and "position" in done.stdout
    done = _run("inspect", str(tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: directory {str(tmp_path)!r} holds no checkpoint or weights export (files named " \
                          "PREFIX-epochEbatchB.pt, PREFIX-best.pt, or the same ending in .weights.pt)\n"


# -- inspect and load run the checks a resume runs on the run state ------------------------------------------
def _without(payload: dict, *keys) -> dict:
    """``payload`` with the entry at the path ``keys`` removed."""
    inner = payload
    for key in keys[:-1]:
        inner = inner[key]
    del inner[keys[-1]]
    return payload


def _with(payload: dict, value, *keys) -> dict:
    inner = payload
    for key in keys[:-1]:
        inner = inner[key]
    inner[keys[-1]] = value
    return payload


DAMAGES = {
    "no-data": (lambda p: _without(p, "ranks", 0, "data"), "the snapshot of rank 0 is missing 'data'"),
    "no-position": (lambda p: _without(p, "ranks", 0, "position"), "the snapshot of rank 0 is missing 'position'"),
    "bad-phase": (lambda p: _with(p, "middle", "ranks", 0, "position", "phase"), "['phase'] must be one of"),
    "negative-step": (lambda p: _with(p, -1, "ranks", 0, "position", "step"), "['step']"),
    "data-not-dict": (lambda p: _with(p, [1], "ranks", 0, "data"), "data"),
    "metrics-not-dict": (lambda p: _with(p, 3, "ranks", 0, "metrics"), "metrics"),
    "bad-plan": (lambda p: _with(p, {"epochs": 0, "batches": None}, "ranks", 0, "plan"), "plan['epochs']"),
    "bad-history": (lambda p: _with(p, {"epochs": ["x"], "values": {}}, "ranks", 0, "history"), "history['epochs']"),
    "bad-rng": (lambda p: _without(p, "ranks", 0, "rng", "torch"), "rng"),
    "partial-not-bool": (lambda p: _with(p, 1, "ranks", 0, "partial"), "'partial' must be a bool"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_load_and_inspect_refuse_a_damaged_run_state_as_a_resume_does(reference, tmp_path, capsys, damage):
    make, words = DAMAGES[damage]
    source = os.path.join(reference.dir, runs.name(3))
    path = tmp_path / runs.name(3)
    torch.save(make(torch.load(source, weights_only=True)), path)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(path)
    assert repr(str(path)) in str(info.value) and words in str(info.value)
    code, out, err = inspect(path, capsys)
    assert code == 2 and out == "" and words in err
    # a resume refuses it too, with nothing changed
    estimator, loader = runs.build()
    with pytest.raises(checkpoint.CheckpointError, match="can resume this fit"):
        estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[
            CheckpointHandler(tmp_path, epoch_period=None, batch_period=1, resume_from_checkpoint=True)])
    assert sorted(os.listdir(tmp_path)) == [runs.name(3)]


def test_inspect_a_directory_skips_a_damaged_run_state_for_the_previous_file(reference, tmp_path, capsys):
    runs.copy_files(reference, tmp_path, range(1, 4))
    newest = tmp_path / runs.name(3)
    torch.save(_without(torch.load(newest, weights_only=True), "ranks", 0, "data"), newest)
    code, out, err = inspect(tmp_path, capsys)
    assert code == 0
    assert out.splitlines()[0].startswith(f"{tmp_path / runs.name(2)} (the newest valid")
    assert "missing 'data'" in err
