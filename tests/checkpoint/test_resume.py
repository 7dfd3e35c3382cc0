"""Never delete what you cannot read as older: a checkpoint of a newer format stops the fit at
start and is never skipped, pruned or overwritten."""

from __future__ import annotations

import logging
import os

import pytest

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import FORMAT_VERSION, NewerFormatError
from tests.checkpoint.runs import BATCHES, build, copy_files, dir_state, fit_run, name, rewrite
from tests.conftest import Count


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fit_run(tmp_path_factory.mktemp("reference"))


def _newer(payload):
    payload["format_version"] = FORMAT_VERSION + 1


def _fit_expecting_refusal(directory, **handler_kwargs):
    before = dir_state(directory)
    estimator, loader = build()
    count = Count()
    with pytest.raises(NewerFormatError) as info:
        estimator.fit(loader, epochs=2, event_handlers=[count, CheckpointHandler(directory, batch_period=1,
                                                                                 max_checkpoints=1, **handler_kwargs)])
    assert count.batches == 0 and count.epochs == 0
    assert dir_state(directory) == before  # nothing deleted, nothing overwritten, no lock left
    return str(info.value)


@pytest.mark.parametrize("newer_steps", [[BATCHES + 2], [1, BATCHES + 2], [1], [1, 2, BATCHES + 2]],
                         ids=["newest", "newest-and-oldest", "oldest-below-a-valid-newest", "every-file"])
def test_a_newer_format_stops_the_fit_at_start_and_nothing_is_deleted(reference, tmp_path, newer_steps):
    steps = [1, 2, BATCHES + 2]
    copy_files(reference, tmp_path, steps)
    for step in newer_steps:
        rewrite(tmp_path / name(step), _newer)
    message = _fit_expecting_refusal(tmp_path, resume_from_checkpoint=True)
    assert any(name(step) in message for step in newer_steps)
    assert f"newer estimatorch (format {FORMAT_VERSION + 1};" in message
    assert "upgrade, or choose another model_dir" in message


def test_a_newer_best_file_stops_the_fit_at_start(reference, tmp_path):
    copy_files(reference, tmp_path, [1])
    os.replace(tmp_path / name(1), tmp_path / "model-best.pt")
    copy_files(reference, tmp_path, [2])
    rewrite(tmp_path / "model-best.pt", _newer)
    assert "model-best.pt" in _fit_expecting_refusal(tmp_path, resume_from_checkpoint=True)


def test_find_latest_refuses_a_newer_file_instead_of_skipping_it(reference, tmp_path, estimatorch_log):
    copy_files(reference, tmp_path, [1, 2])
    rewrite(tmp_path / name(2), _newer)
    with pytest.raises(NewerFormatError, match=name(2)):
        checkpoint.find_latest(tmp_path, "model")
    assert not [r for r in estimatorch_log if r.levelno == logging.WARNING]


def test_without_resume_a_directory_of_newer_files_is_refused_untouched(reference, tmp_path):
    copy_files(reference, tmp_path, [1])
    rewrite(tmp_path / name(1), _newer)
    before = dir_state(tmp_path)
    estimator, loader = build()
    with pytest.raises(FileExistsError, match="resume_from_checkpoint=True"):
        estimator.fit(loader, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=1)])
    assert dir_state(tmp_path) == before


def test_format_versions_reads_headers_and_none_for_unreadable_files(reference, tmp_path):
    copy_files(reference, tmp_path, [1, 2])
    rewrite(tmp_path / name(2), _newer)
    (tmp_path / name(3)).write_bytes(b"")
    versions = checkpoint.format_versions(tmp_path, "model")
    assert versions == {str(tmp_path / name(1)): FORMAT_VERSION, str(tmp_path / name(2)): FORMAT_VERSION + 1,
                        str(tmp_path / name(3)): None}
