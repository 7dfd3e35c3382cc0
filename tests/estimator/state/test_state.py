"""The run's stage (``estimator/_state.Stage``): one explicit value the loop moves through, from
which it reads whether ``train_end`` is due, whether the final snapshot is partial and whether the
run is kept."""

from __future__ import annotations

import pytest

from estimatorch.estimator._state.run import Stage
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochBegin, EpochEnd, TrainBegin, TrainEnd
from tests.conftest import make_batches, make_estimator


class StageRecorder(TrainBegin, EpochBegin, BatchBegin, BatchEnd, EpochEnd, TrainEnd):
    """Records the run's stage at every event, and in a boundary action after each batch."""

    def __init__(self, fail_in: str = ""):
        self.seen: list[tuple[str, Stage]] = []
        self.fail_in = fail_in

    def _record(self, est, event):
        self.seen.append((event, est._run.stage))
        if event == self.fail_in:
            raise RuntimeError(f"failed in {event}")

    def train_begin(self, est, **kw):
        self._record(est, "train_begin")

    def epoch_begin(self, est, **kw):
        self._record(est, "epoch_begin")

    def batch_begin(self, est, **kw):
        self._record(est, "batch_begin")

    def batch_end(self, est, **kw):
        self._record(est, "batch_end")
        est.at_boundary(lambda: self.seen.append(("boundary", est._run.stage)))

    def epoch_end(self, est, **kw):
        self._record(est, "epoch_end")

    def train_end(self, est, **kw):
        self._record(est, "train_end")


def test_the_stages_of_a_fit_in_order():
    est, rec = make_estimator(), StageRecorder()
    est.fit(make_batches(n_batches=2), epochs=1, event_handlers=[rec])
    assert rec.seen == [("train_begin", Stage.SETTING_UP), ("epoch_begin", Stage.STEPPING),
                        ("batch_begin", Stage.STEPPING), ("batch_end", Stage.STEPPING), ("boundary", Stage.AT_BOUNDARY),
                        ("batch_begin", Stage.STEPPING), ("batch_end", Stage.STEPPING), ("boundary", Stage.AT_BOUNDARY),
                        ("epoch_end", Stage.STEPPING), ("train_end", Stage.AT_BOUNDARY)]
    assert est._run.stage is Stage.ENDED


def test_a_fit_failing_while_setting_up_is_discarded_and_the_last_one_kept():
    est = make_estimator()
    est.fit(make_batches(n_batches=2), epochs=1, event_handlers=[])
    kept = est._run
    rec = StageRecorder(fail_in="train_begin")
    with pytest.raises(RuntimeError, match="failed in train_begin"):
        est.fit(make_batches(n_batches=2), epochs=2, event_handlers=[rec], resume=True)
    assert rec.seen == [("train_begin", Stage.SETTING_UP), ("train_end", Stage.SETTING_UP)]
    assert est._run is kept and kept.stage is Stage.ENDED


def test_a_fit_failing_mid_step_ends_with_a_partial_snapshot():
    est, rec = make_estimator(), StageRecorder(fail_in="batch_end")
    with pytest.raises(RuntimeError, match="failed in batch_end"):
        est.fit(make_batches(n_batches=2), epochs=1, event_handlers=[rec])
    assert rec.seen[-1] == ("train_end", Stage.STEPPING)
    assert est._run.stage is Stage.ENDED and est._last["partial"] is True


def test_what_each_stage_answers():
    assert [s.began for s in Stage] == [False, True, True, True, True]
    assert [s.holds_state for s in Stage] == [False, False, True, True, True]
