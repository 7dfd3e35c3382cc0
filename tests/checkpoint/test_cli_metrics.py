"""``python -m estimatorch.checkpoint inspect`` shows the metrics a checkpoint recorded and the
best value its monitoring handlers kept (what Keras and Lightning users look for)."""

from __future__ import annotations

from estimatorch import CheckpointHandler, EarlyStoppingHandler, checkpoint
from tests.conftest import make_batches, make_estimator


def inspect(path, capsys) -> list[str]:
    assert checkpoint.main(["inspect", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out.splitlines()


def test_inspect_shows_the_last_epochs_metrics_and_the_best_monitored_values(tmp_path, capsys):
    history = make_estimator().fit(make_batches(4), val_data=make_batches(2, seed=1), epochs=3, event_handlers=[
        CheckpointHandler(tmp_path, monitor="val_loss", save_best=True), EarlyStoppingHandler("val_accuracy")])
    path = tmp_path / checkpoint.read_latest(tmp_path, "model")
    lines = inspect(path, capsys)
    saved = checkpoint.load(path)["ranks"][0]
    values = saved["history"]["values"]
    assert values["val_loss"] == history["val_loss"]
    shown = ", ".join(f"{name} {series[-1]:.6g}" for name, series in values.items())
    assert f"metrics of epoch 3: {shown}" in lines
    stopper = saved["handlers"]["EarlyStoppingHandler"]
    assert min(values["val_loss"]) == saved["handlers"]["CheckpointHandler"]["best"]  # what CheckpointHandler kept
    assert (f"best monitored value: CheckpointHandler {min(values['val_loss']):.6g}; "
            f"EarlyStoppingHandler {max(values['val_accuracy']):.6g} (epoch {stopper['best_epoch']})") in lines


def test_a_checkpoint_before_any_epochs_end_says_so(tmp_path, capsys):
    make_estimator().fit(make_batches(4), epochs=1,
                         event_handlers=[CheckpointHandler(tmp_path, batch_period=1, epoch_period=None)])
    lines = inspect(tmp_path / "model-epoch0batch1.pt", capsys)
    assert "metrics: none recorded yet (no epoch finished)" in lines
    assert not any(line.startswith("best monitored value") for line in lines)
