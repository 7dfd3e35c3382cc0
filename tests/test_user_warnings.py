"""Warnings raised during fit point at the user's line (their fit call), not a line of the
library, and say what to do (``estimatorch._checks.warn_user``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from estimatorch import CheckpointHandler
from estimatorch._checks import warn_user
from tests.conftest import make_batches, make_estimator


class NotPersistent:
    """A metric that keeps no state, as a torchmetrics metric whose states are not persistent."""

    name = "mean_pred"
    higher_is_better = True

    def __init__(self):
        self.total = torch.zeros(())

    def update(self, pred, label):
        self.total += pred.float().mean()

    def compute(self):
        return self.total

    def reset(self):
        self.total = torch.zeros(())

    def state_dict(self):
        return {}


def test_warn_user_reports_the_first_frame_outside_the_package():
    with pytest.warns(UserWarning, match="hello") as record:
        warn_user("hello")
    assert record[0].filename == __file__


def test_a_metric_without_state_warns_at_the_fit_line_with_the_fix(tmp_path):
    est = make_estimator(train_metrics=[NotPersistent()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        est.fit(make_batches(2), epochs=1,
                event_handlers=[CheckpointHandler(tmp_path, batch_period=1, epoch_period=None)])
    ours = [w for w in record if "keeps no state" in str(w.message)]
    assert len(ours) == 2  # train_mean_pred and its val copy, once each
    assert all("metric.persistent(True)" in str(w.message) and w.filename == __file__ for w in ours)


class CountsUpdates(NotPersistent):
    """As a torchmetrics metric: a persistent state, and an update count outside it whose zero
    makes compute() warn (torchmetrics' "called before the update method")."""

    def __init__(self):
        super().__init__()
        self._update_count = 0

    def update(self, pred, label):
        super().update(pred, label)
        self._update_count += 1

    def compute(self):
        if self._update_count == 0:
            warnings.warn("The ``compute`` method of metric CountsUpdates was called before the ``update`` method")
        return self.total

    def reset(self):
        super().reset()
        self._update_count = 0

    def state_dict(self):
        return {"total": self.total.clone()}

    def load_state_dict(self, state):
        self.total = state["total"].clone()


def test_rerunning_a_finished_run_does_not_warn_that_restored_metrics_were_never_updated(tmp_path):
    def run():
        est = make_estimator(train_metrics=[CountsUpdates()])
        est.fit(make_batches(2), val_data=make_batches(1), epochs=1,
                event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True)])

    run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()  # nothing left to train: the values shown are the restored ones
