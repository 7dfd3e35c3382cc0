"""_paths: output directories and files checked before any work; run ids that cannot be paths."""

from __future__ import annotations

import os

import pytest

from estimatorch import CheckpointHandler, LambdaHandler, LoggingHandler, TensorBoardHandler
from estimatorch.event_handlers._paths import (
    check_output_dir,
    check_output_file,
    check_run_id,
    legacy_run_id,
    new_run_id,
    path_argument,
)
from tests.conftest import make_batches, make_estimator


@pytest.fixture
def places(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    return {"dir": tmp_path, "file": a_file, "dangling": dangling}


def test_a_directory_that_exists_or_can_be_created_passes(places):
    check_output_dir(str(places["dir"]), "log_dir")
    check_output_dir(str(places["dir"] / "new" / "deeper"), "log_dir")
    assert sorted(os.listdir(places["dir"])) == ["a_file", "dangling"]  # nothing created


@pytest.mark.parametrize("where, message", [
    (lambda p: p["file"], r"log_dir '.*a_file' is a file, not a directory"),
    (lambda p: p["file"] / "sub", r"log_dir '.*a_file/sub' cannot be created: '.*a_file' is a file, not a directory"),
    (lambda p: p["dangling"], r"log_dir '.*dangling' is a symbolic link to '.*nowhere', which does not exist"),
    (lambda p: p["dangling"] / "sub", r"cannot be created: '.*dangling' is a symbolic link to '.*nowhere'"),
    (lambda p: "/dev/null", r"log_dir '/dev/null' is a device, not a directory"),
    (lambda p: "/dev/null/sub", r"log_dir '/dev/null/sub' cannot be created: '/dev/null' is a device"),
])
def test_directories_that_cannot_hold_files(places, where, message):
    with pytest.raises(ValueError, match=message):
        check_output_dir(str(where(places)), "log_dir")


def test_a_directory_this_process_cannot_write(places, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    with pytest.raises(ValueError, match="is a directory this process cannot write in"):
        check_output_dir(str(places["dir"]), "log_dir")
    with pytest.raises(ValueError, match="cannot be created: this process cannot write in"):
        check_output_dir(str(places["dir"] / "new"), "log_dir")
    with pytest.raises(ValueError, match="path '.*a_file' is a file this process cannot write"):
        check_output_file(str(places["file"]), "path")


@pytest.mark.parametrize("where, message", [
    (lambda p: p["dir"], r"path '.*' is a directory, not a file"),
    (lambda p: p["dangling"], r"path '.*dangling' is a symbolic link"),
    (lambda p: "/dev/null", r"path '/dev/null' is a device, not a regular file"),
    (lambda p: p["file"] / "x.csv", r"path '.*a_file/x.csv' cannot be created: '.*a_file' is a file"),
])
def test_files_that_cannot_be_written(places, where, message):
    with pytest.raises(ValueError, match=message):
        check_output_file(str(where(places)), "path")


def test_a_file_that_exists_or_can_be_created_passes(places):
    check_output_file(str(places["file"]), "path")
    check_output_file(str(places["dir"] / "logs" / "train.csv"), "path")


def test_path_argument():
    assert path_argument(os.path.join("a", "b"), "log_dir") == os.path.join("a", "b")
    for bad in (None, "", 3, b"bytes"):
        with pytest.raises(TypeError, match="log_dir must be a path"):
            path_argument(bad, "log_dir")


@pytest.mark.parametrize("value, expected", [
    ("Jan05_12-30-45", "Jan05_12-30-45"), ("Jan05_12-30-45_2", "Jan05_12-30-45_2"),
    ("../x", None), ("/tmp", None), ("a/b", None), ("..", None), (".", None), ("", None), (None, None),
    (5, None), ("x" * 65, None), ("a\x00b", None),
])
def test_a_run_id_is_one_plain_name(value, expected):
    assert check_run_id(value) == expected


def test_new_run_ids_skip_the_taken_ones():
    taken = set()
    ids = []
    for _ in range(3):
        run_id = new_run_id(lambda r: r in taken)
        taken.add(run_id)
        ids.append(run_id)
    assert ids[1] == ids[0] + "_2" and ids[2] == ids[0] + "_3"


def test_an_older_states_path_gives_only_its_name():
    assert legacy_run_id("/elsewhere/train_Jan05_12-30-45.log", "train", ".log") == "Jan05_12-30-45"
    assert legacy_run_id("/elsewhere/train_Jan05_12-30-45/", "train") == "Jan05_12-30-45"
    assert legacy_run_id("/elsewhere/other_Jan05.log", "train", ".log") is None
    assert legacy_run_id(None, "train") is None


# -- names the filesystem cannot hold --------------------------------------------------------------
@pytest.mark.parametrize("check", [check_output_dir, check_output_file])
def test_a_name_longer_than_the_filesystem_allows_names_the_argument(tmp_path, check):
    too_long = tmp_path / ("x" * 300) / "inside"
    with pytest.raises(ValueError, match=r"log_dir .* the name 'x+'\.\.\. in it is 300 bytes long, and this "
                                         r"filesystem allows at most 255; choose a shorter log_dir"):
        check(str(too_long), "log_dir")


def test_a_path_longer_than_the_system_allows_names_the_argument(tmp_path):
    too_long = tmp_path.joinpath(*["d" * 200] * 25)
    with pytest.raises(ValueError, match=r"model_dir .* bytes long as an absolute path, and this system allows "
                                         r"less than \d+; choose a shorter model_dir"):
        check_output_dir(str(too_long), "model_dir")


def test_names_at_the_limit_pass(tmp_path):
    check_output_dir(str(tmp_path / ("x" * 255)), "model_dir")


@pytest.mark.parametrize("make", [
    lambda d: CheckpointHandler(d / ("m" * 256)),
    lambda d: TensorBoardHandler(d / ("t" * 256)),
    lambda d: LoggingHandler(log_dir=d / ("l" * 256)),
], ids=["model_dir", "tensorboard-log_dir", "logging-log_dir"])
def test_fit_refuses_a_directory_name_too_long_before_any_step(tmp_path, make):
    handler = make(tmp_path)
    arg = "model_dir" if isinstance(handler, CheckpointHandler) else "log_dir"
    est, steps = make_estimator(), []
    with pytest.raises(ValueError, match=f"choose a shorter {arg}"):
        est.fit(make_batches(2), epochs=1,
                event_handlers=[handler, LambdaHandler(batch_end=lambda e, **k: steps.append(1))])
    assert steps == [] and os.listdir(tmp_path) == []
