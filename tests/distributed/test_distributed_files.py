"""Only global rank 0 creates files: log files, TensorBoard events, bars. Statistics are reduced
across ranks before rank 0 writes them."""

from __future__ import annotations

import io
import os

import pytest

from estimatorch import distributed
from estimatorch.event_handlers import (
    LoggingHandler,
    MeterHandler,
    ProgressBarHandler,
    TensorBoardHandler,
    TerminateOnNaNHandler,
)
from estimatorch.statistics import GradientNorm, InstantaneousStatistic
from tests.conftest import make_batches, make_estimator


# -- the writer stub ------------------------------------------------------------------------
def test_rank_zero_writer_calls_the_factory_on_rank_0_only(monkeypatch):
    made = []
    assert distributed.rank_zero_writer(lambda: made.append(1) or "writer") == "writer" and made == [1]
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    stub = distributed.rank_zero_writer(lambda: made.append(2))
    assert isinstance(stub, distributed.NullWriter) and made == [1]


def test_the_null_writer_accepts_any_call_and_does_nothing():
    stub = distributed.NullWriter()
    assert stub.add_scalar("a", 1.0, 1) is None and stub.add_histogram("b", [1], global_step=2) is None
    assert stub.flush() is None and stub.close() is None
    with pytest.raises(AttributeError):
        stub.__fspath__  # not a path, not anything it is not asked to be
    assert repr(stub) == "NullWriter()"


# -- two gloo processes ---------------------------------------------------------------------
class RankValue(InstantaneousStatistic):
    """``rank + 1`` on every rank, averaged (or summed) across them."""

    def batch_end(self, estimator, **kwargs):
        self.value = float(distributed.get_rank() + 1)

    def scalars(self):
        return {"": self.value}


class RankSum(RankValue):
    reduction = "sum"


def _train(root: str) -> dict:
    est = make_estimator()
    tb = TensorBoardHandler(os.path.join(root, "tb"), log_interval=2, histogram_period=4)
    meter = MeterHandler([RankValue(period=2, name="rank_mean"), RankSum(period=2, name="rank_sum"),
                          GradientNorm(period=2)], writer=tb)
    log = LoggingHandler(log_interval=2, log_dir=os.path.join(root, "logs"))
    bar_out = io.StringIO()
    handlers = [tb, meter, log, TerminateOnNaNHandler(check_every=2), ProgressBarHandler(file=bar_out)]
    est.fit(make_batches(4), val_data=make_batches(2, seed=1), epochs=2, event_handlers=handlers)
    return {"pid": os.getpid(), "log_file": log.log_file, "run_dir": tb.run_dir, "bar": bar_out.getvalue()}


@pytest.mark.distributed
def test_only_rank_0_creates_files_and_statistics_are_reduced(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    zero, one = distributed.spawn(_train, 2, str(tmp_path), backend="gloo")
    assert one["log_file"] is None and one["run_dir"] is None and one["bar"] == ""
    assert zero["log_file"] and zero["run_dir"] and "epochs:" in zero["bar"]
    assert sorted(os.listdir(tmp_path)) == ["logs", "tb"]
    assert os.listdir(tmp_path / "logs") == [os.path.basename(zero["log_file"])]
    assert os.listdir(tmp_path / "tb") == [os.path.basename(zero["run_dir"])]
    events = os.listdir(zero["run_dir"])
    assert len(events) == 1 and f".{zero['pid']}." in events[0]  # written by rank 0's process

    acc = EventAccumulator(zero["run_dir"], size_guidance={"scalars": 0})
    acc.Reload()
    values = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("rank_mean", "rank_sum")}
    assert values == {"rank_mean": [(s, 1.5) for s in (2, 4, 6, 8)], "rank_sum": [(s, 3.0) for s in (2, 4, 6, 8)]}
    assert [e.step for e in acc.Scalars("epoch/val_loss")] == [1, 2]
    with open(zero["log_file"], encoding="utf-8") as f:
        assert "2 processes" in f.read()
