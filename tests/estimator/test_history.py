"""History: what fit returns, its exports and its plot."""

from __future__ import annotations

import csv
import math
import sys

import pytest

from estimatorch import History
from estimatorch.event_handlers import ValidationHandler
from tests.conftest import make_batches, make_estimator


def sample() -> History:
    h = History()
    h.record(1, {"train_loss": 0.9, "train_accuracy": 0.5, "val_loss": 1.0})
    h.record(2, {"train_loss": 0.7, "train_accuracy": 0.6})
    h.record(3, {"train_loss": 0.5, "train_accuracy": 0.7, "val_loss": 0.8})
    return h


def test_record_fills_missing_values_with_nan():
    h = sample()
    h.record(4, {"train_loss": 0.4, "lr": 0.01})  # a metric first seen late
    assert h.epochs == [1, 2, 3, 4] and len(h) == 4
    assert h["train_loss"] == [0.9, 0.7, 0.5, 0.4]
    assert math.isnan(h["val_loss"][1]) and math.isnan(h["val_loss"][3])
    assert [math.isnan(v) for v in h["lr"]] == [True, True, True, False]
    assert h.metrics == ["train_loss", "train_accuracy", "val_loss"] and h.learning_rates == ["lr"]
    assert "val_loss" in h and "val_accuracy" not in h and "lr" in h


def test_learning_rates_come_after_the_metrics():
    """Validation first seen in epoch 2 does not land after the learning rates."""
    h = History()
    h.record(1, {"train_loss": 0.9, "lr_group0": 0.1, "lr_group1": 0.2})
    h.record(2, {"train_loss": 0.8, "val_loss": 0.7, "lr_group0": 0.1, "lr_group1": 0.2})
    assert h.keys() == ["train_loss", "val_loss", "lr_group0", "lr_group1"]
    assert list(h.to_dict()) == ["epoch", *h.keys()]
    assert h.learning_rates == ["lr_group0", "lr_group1"] and h.metrics == ["train_loss", "val_loss"]


def test_a_history_saved_without_learning_rates_continues_with_nan_for_them():
    """A checkpoint written before learning rates were recorded: the earlier epochs' rates are
    unknown (nan), the resumed epochs have theirs."""
    h = History()
    h.load_state_dict({"epochs": [1], "values": {"train_loss": [0.9]}})
    h.record(2, {"train_loss": 0.8, "lr": 0.05})
    assert math.isnan(h["lr"][0]) and h["lr"][1] == 0.05


def test_an_unknown_metric_names_the_known_ones():
    with pytest.raises(KeyError, match=r"no metric 'val_acc'.*'train_accuracy'"):
        sample()["val_acc"]


def test_to_dict_is_a_copy():
    h = sample()
    table = h.to_dict()
    assert list(table) == ["epoch", "train_loss", "train_accuracy", "val_loss"]
    assert table["epoch"] == [1, 2, 3] and table["train_loss"] == [0.9, 0.7, 0.5]
    table["train_loss"].append(0.0)
    table["epoch"].append(4)
    assert h["train_loss"] == [0.9, 0.7, 0.5] and h.epochs == [1, 2, 3]


def test_to_csv_writes_a_row_per_epoch_with_empty_cells_for_nan(tmp_path):
    h = sample()
    path = tmp_path / "history.csv"
    h.to_csv(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["epoch", "train_loss", "train_accuracy", "val_loss"]
    assert rows[1:] == [[str(e), *("" if math.isnan(h[m][i]) else repr(h[m][i]) for m in h.metrics)]
                        for i, e in enumerate(h.epochs)]
    assert rows[2][3] == ""


def test_to_csv_refuses_to_overwrite(tmp_path):
    path = tmp_path / "history.csv"
    path.write_text("precious")
    with pytest.raises(FileExistsError, match="history.csv"):
        sample().to_csv(path)
    assert path.read_text() == "precious"


def test_state_round_trip():
    h = sample()
    other = History()
    other.load_state_dict(h.state_dict())
    assert other.to_dict().keys() == h.to_dict().keys()
    assert other.epochs == h.epochs and other["train_loss"] == h["train_loss"]
    with pytest.raises(ValueError, match="values"):
        other.load_state_dict({"epochs": [1]})


def test_fit_returns_the_history_of_every_metric_per_epoch():
    est = make_estimator()
    val = ValidationHandler(make_batches(2, seed=1), est.evaluate, epoch_period=2)
    h = est.fit(make_batches(4), epochs=3, event_handlers=[val])
    assert h.epochs == [1, 2, 3]
    assert h.metrics == ["train_loss", "train_accuracy", "val_loss", "val_accuracy"]
    assert h.learning_rates == ["lr"] and h["lr"] == [est.optimizer.param_groups[0]["lr"]] * 3
    assert [math.isnan(v) for v in h["val_loss"]] == [True, False, True]
    assert h["train_loss"][-1] == est.train_metrics[0].compute()
    assert repr(h).startswith("History(epochs=3, last={'train_loss'")


# -- plot -----------------------------------------------------------------------------------
@pytest.fixture
def plt():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def lines_of(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_plot_draws_train_and_val_curves_per_metric(plt):
    h = sample()
    fig = h.plot()
    try:
        assert [ax.get_title() for ax in fig.axes] == ["loss", "accuracy"]
        loss, accuracy = (lines_of(ax) for ax in fig.axes)
        assert loss["train_loss"] == (h.epochs, h["train_loss"])
        assert loss["val_loss"][0] == h.epochs and loss["val_loss"][1][0::2] == [1.0, 0.8]
        assert list(accuracy) == ["train_accuracy"]
        assert fig.axes[0].get_xlabel() == "epoch"
    finally:
        plt.close(fig)


def test_plot_puts_ticks_on_whole_epochs_only(plt):
    h = History()
    for epoch in (1, 2, 3):  # few epochs: matplotlib's default locator would add 1.5, 2.5
        h.record(epoch, {"train_loss": 1.0 / epoch})
    fig = h.plot()
    try:
        fig.canvas.draw()
        ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 3]
        assert ticks and all(float(t).is_integer() for t in ticks)
    finally:
        plt.close(fig)


def test_plot_a_chosen_metric_on_given_axes(plt):
    fig, ax = plt.subplots()
    try:
        assert sample().plot(["accuracy"], ax=ax) is fig
        assert list(lines_of(ax)) == ["train_accuracy"]
        with pytest.raises(ValueError, match="1 axes for 2 metrics"):
            sample().plot(["loss", "accuracy"], ax=ax)
    finally:
        plt.close(fig)


def test_plot_an_empty_history_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        History().plot()


def test_plot_without_matplotlib_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match=r"estimatorch\[plot\]"):
        sample().plot()
