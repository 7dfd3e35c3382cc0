"""Checkpoints of format 2 already written still load, validate and resume bit-identically: one
written before the run's state moved into the estimator (the committed ``tests/fixtures/v2`` file,
see ``tests/fixtures/make_v2_checkpoint.py``) and one written by main after the data path moved into
``estimatorch/data/`` (``tests/fixtures/v2-data``, see ``tests/fixtures/make_v2_data_checkpoint.py``).
Both are of the same run, saved at the same step, so they share the uninterrupted reference."""

from __future__ import annotations

import shutil
from types import SimpleNamespace
from typing import Any

import pytest

from estimatorch import checkpoint
from estimatorch.checkpoint import FORMAT_VERSION
from tests.conftest import LossRecorder, assert_same_training_state, assert_tree_equal
from tests.fixtures import make_v1_checkpoint as v1
from tests.fixtures import make_v2_checkpoint as v2
from tests.fixtures import make_v2_data_checkpoint as v2_data

FIXTURES = pytest.mark.parametrize("fixture", [v2.FIXTURE, v2_data.FIXTURE], ids=["v2", "v2-data"])


def fit_fixture_run(directory: Any, **handler_kwargs: Any) -> SimpleNamespace:
    estimator, loader, val = v2.build()
    recorder = LossRecorder()
    handlers = v2.handlers(estimator, directory, **handler_kwargs)
    history = estimator.fit(loader, val_data=val, epochs=v1.EPOCHS, event_handlers=[*handlers, recorder])
    return SimpleNamespace(estimator=estimator, losses=recorder.losses, history=history, handlers=handlers)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return fit_fixture_run(tmp_path_factory.mktemp("reference"))


@FIXTURES
def test_the_v2_fixture_loads_as_format_2_with_every_part_of_the_run(fixture):
    payload = checkpoint.load(fixture)
    assert payload["format_version"] == FORMAT_VERSION == 2
    (snapshot,) = payload["ranks"]
    assert snapshot["position"]["step"] == v2.STEP and snapshot["position"]["phase"] == "batch_end"
    assert "EarlyStoppingHandler" in snapshot["handlers"] and "val_loss" in snapshot["metrics"]
    assert snapshot["history"]["values"]["val_loss"], "the fixture validated once before it was saved"


@FIXTURES
def test_the_v2_fixture_resumes_bit_identically(fixture, reference, tmp_path):
    shutil.copy(fixture, tmp_path)
    resumed = fit_fixture_run(tmp_path, resume_from_checkpoint=True)
    assert len(reference.losses) == v1.EPOCHS * v1.BATCHES_PER_EPOCH
    assert resumed.losses == reference.losses[v2.STEP:]
    assert_same_training_state(resumed.estimator, reference.estimator)
    assert_tree_equal(resumed.history.to_dict(), reference.history.to_dict(), "history")
    saved = checkpoint.load(fixture)["ranks"][0]["handlers"]
    for mine, theirs in zip(resumed.handlers, reference.handlers):
        # the keys the fixture saved (a state key added since, such as EarlyStoppingHandler's
        # best_step, is optional on load: it starts from its default and is not the run's)
        kept = saved.get(mine.name)
        keys = [key for key in mine.state_dict() if kept is None or key in kept]
        assert_tree_equal({k: mine.state_dict()[k] for k in keys}, {k: theirs.state_dict()[k] for k in keys},
                          type(mine).__name__)
