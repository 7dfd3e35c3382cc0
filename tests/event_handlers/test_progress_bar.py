"""ProgressBarHandler: tqdm output captured in a stream; counts, postfix, cleanup, rank gating."""

from __future__ import annotations

import io
import re
import signal
import sys

import pytest

from estimatorch import _console, distributed
from estimatorch.event_handlers import LambdaHandler, LoggingHandler, ProgressBarHandler, ValidationHandler, _bars
from estimatorch.event_handlers import progress_bar as progress_bar_module
from estimatorch.event_handlers._bars import short_name
from estimatorch.metrics import Accuracy, Metric, TopKAccuracy
from tests.conftest import make_batches, make_estimator

N_BATCHES = 4  # per epoch


def frames(text):
    """Every drawn state of every bar, in order (cursor moves dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)
    return [f.strip() for f in re.split(r"[\r\n]", text) if f.strip()]


def last(text, desc):
    drawn = [f for f in frames(text) if f.startswith(desc + ":")]
    assert drawn, f"no {desc!r} bar in {text!r}"
    return drawn[-1]


def count(frame):
    return tuple(int(x) for x in re.search(r"\| *(\d+)/(\d+) \[", frame).groups())


def postfix(frame):
    inside = frame[frame.rindex("[") + 1:frame.rindex("]")]
    return dict(part.split("=", 1) for part in inside.split(", ") if "=" in part)


def shown_values(history, names, epoch=-1):
    """What a postfix may show of ``names`` in ``epoch``: short name -> formatted value."""
    return {short_name(name): f"{history[name][epoch]:.4g}" for name in names}


def fit_with_bar(est=None, refresh_interval=0.0, **fit_kwargs):
    est = est or make_estimator()
    out = io.StringIO()
    bar = ProgressBarHandler(refresh_interval=refresh_interval, file=out)
    fit_kwargs.setdefault("event_handlers", [])
    fit_kwargs["event_handlers"] = [bar, *fit_kwargs["event_handlers"]]
    history = est.fit(make_batches(N_BATCHES), **fit_kwargs)
    return out.getvalue(), history, bar


def test_training_by_epochs_shows_an_epoch_bar_and_a_bar_per_epoch():
    text, history, _ = fit_with_bar(epochs=3, val_data=make_batches(2, seed=1))
    epochs = last(text, "epochs")
    assert count(epochs) == (3, 3)
    assert "val_loss" in postfix(epochs)  # the last epoch's values, val metrics first
    assert postfix(epochs).items() <= shown_values(history, history.metrics).items()
    for epoch in (1, 2, 3):
        frame = last(text, f"epoch {epoch}/3")
        assert count(frame) == (N_BATCHES, N_BATCHES)
        assert "loss" in postfix(frame)  # the running train metrics, then the learning rate
        values = {k: v for k, v in postfix(frame).items() if k != "lr"}
        assert values.items() <= shown_values(history, ["train_loss", "train_accuracy"], epoch - 1).items()
    assert not any(f.startswith("batches:") for f in frames(text))


def test_the_batch_bar_shows_the_learning_rate_as_it_changes(monkeypatch):
    import torch

    monkeypatch.setattr(_bars, "DEFAULT_WIDTH", 200)  # room for every value on the stream
    est = make_estimator()
    est.lr_scheduler = torch.optim.lr_scheduler.StepLR(est.optimizer, step_size=1, gamma=0.5)
    text, _, _ = fit_with_bar(est, epochs=2)
    first, second = last(text, "epoch 1/2"), last(text, "epoch 2/2")
    assert list(postfix(first))[:2] == ["loss", "lr"]  # right after the loss: kept on a narrow line
    assert (postfix(first)["lr"], postfix(second)["lr"]) == ("0.1", "0.05")


def test_training_by_batches_shows_one_bar():
    text, history, _ = fit_with_bar(batches=6)
    frame = last(text, "batches")
    assert count(frame) == (6, 6) and "loss" in postfix(frame)
    assert not any(f.startswith(("epochs:", "epoch ")) for f in frames(text))


def test_validation_has_its_own_bar():
    text, history, _ = fit_with_bar(epochs=2, val_data=make_batches(3, seed=1))
    drawn = [f for f in frames(text) if f.startswith("validation:")]
    assert count(drawn[-1]) == (3, 3)
    assert "val_loss" in postfix(drawn[-1])
    assert postfix(drawn[-1]).items() <= shown_values(history, ["val_loss", "val_accuracy"]).items()


def test_the_batch_bar_is_up_to_date_before_validation_starts():
    # no redraw ever comes due on its own: only the catch-up before validation draws the count
    text, _, _ = fit_with_bar(refresh_interval=1e9, epochs=2, val_data=make_batches(3, seed=1))
    drawn = frames(text)
    for epoch in (1, 2):
        start = next(i for i, f in enumerate(drawn) if f.startswith(f"epoch {epoch}/2:"))
        validation = next(i for i, f in enumerate(drawn) if i > start and f.startswith("validation:"))
        before = [f for f in drawn[start:validation] if f.startswith(f"epoch {epoch}/2:")]
        assert count(before[-1]) == (N_BATCHES, N_BATCHES)


@pytest.mark.parametrize("n_val", [0, 2])
def test_every_line_fits_80_columns_with_a_real_bar(monkeypatch, n_val):
    monkeypatch.setenv("COLUMNS", "81")  # tqdm draws COLUMNS - 1 = 80 characters on a stream
    est = make_estimator(train_metrics=[Accuracy(), TopKAccuracy(top_k=2)])  # long names
    text, history, _ = fit_with_bar(est, epochs=3, val_data=make_batches(n_val, seed=1) if n_val else None)
    drawn = frames(text)
    assert drawn and all(len(f) <= 80 for f in drawn)
    for frame in drawn:
        inside = frame.split("|")[1]  # the bar itself: never squeezed to a character
        assert len(inside) >= 10, frame
        for name, value in postfix(frame).items():  # no metric is cut: whole names, whole values
            assert name in {short_name(m) for m in history.metrics} | {"lr"}, frame
            float(value)
    epochs = last(text, "epochs")
    candidates = [short_name(m.name) for m in (est.val_metrics if n_val else []) + est.train_metrics]
    shown = list(postfix(epochs))
    assert shown and shown == candidates[:len(shown)]  # val metrics first, then as many as fit


@pytest.fixture
def notebook(monkeypatch):
    """Pretend to run in a Jupyter kernel; returns the texts the bars' display showed, in order."""
    updates = []

    class Handle:
        def update(self, data, raw=False):
            assert raw and set(data) == {"text/plain"}
            updates.append(data["text/plain"])

    monkeypatch.setattr(_console, "in_notebook", lambda: True)
    monkeypatch.setattr(_bars, "_open_display", Handle)
    return updates


def test_in_a_notebook_bars_are_one_plain_text_output(notebook, capsys):
    updates = notebook
    est = make_estimator()
    before = list(est.logger.handlers)
    during = []
    probe = LambdaHandler(batch_end=lambda e, **kw: during.append(list(e.logger.handlers)), once=1)
    bar = ProgressBarHandler(refresh_interval=0.0)
    history = est.fit(make_batches(N_BATCHES), epochs=3, val_data=make_batches(2, seed=1),
                      event_handlers=[bar, probe])
    final = updates[-1]
    assert final.startswith("epochs: 100%|") and "\n" not in final and "\r" not in final
    assert count(final) == (3, 3) and postfix(final).items() <= shown_values(history, history.metrics).items()
    assert any(u.count("\n") == 1 and "epoch 2/3:" in u for u in updates)  # epochs and batches, one line each
    assert any(u.count("\n") == 2 and "validation:" in u for u in updates)
    assert during == [before]  # log lines need no detour around bars that are not on the console
    assert capsys.readouterr().err == ""


def count_reads(monkeypatch):
    """Calls of Metric.compute(sync=False): what the bars read."""
    reads = []
    original = Metric.compute

    def compute(self, *, sync=True):
        if not sync:
            reads.append(self.name)
        return original(self, sync=sync)

    monkeypatch.setattr(Metric, "compute", compute)
    return reads


def test_the_postfix_is_read_only_when_the_bar_redraws(monkeypatch):
    reads = count_reads(monkeypatch)
    counts = []
    for n_batches in (N_BATCHES, 3 * N_BATCHES):
        reads.clear()
        est = make_estimator()
        bar = ProgressBarHandler(refresh_interval=1e9, file=io.StringIO())  # redraws never come due
        est.fit(make_batches(n_batches), epochs=2, event_handlers=[bar])
        counts.append(len(reads))
    n_metrics = len(make_estimator().train_metrics)
    assert counts == [2 * n_metrics] * 2  # the epoch bar's postfix, once per epoch: not per step
    reads.clear()
    fit_with_bar(refresh_interval=0.0, epochs=2)  # a redraw at every step reads at every step
    assert len(reads) >= 2 * N_BATCHES * n_metrics


def test_only_global_rank_0_draws(monkeypatch):
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)
    text, history, bar = fit_with_bar(epochs=2, val_data=make_batches(2, seed=1))
    assert text == "" and len(history) == 2 and bar.total_batches == 2 * N_BATCHES


def track_bars(monkeypatch):
    created = []
    original = progress_bar_module._bar

    def bar(*args, **kwargs):
        created.append(original(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr(progress_bar_module, "_bar", bar)
    return created


@pytest.mark.parametrize("where", ["train", "validation"])
def test_every_bar_is_closed_when_training_raises(monkeypatch, where):
    created = track_bars(monkeypatch)

    def boom(est, **kwargs):
        raise RuntimeError("boom")

    est = make_estimator()
    val = make_batches(3, seed=1)
    if where == "validation":
        probe = LambdaHandler(batch_end=boom, once=2)
        bar = ProgressBarHandler(file=io.StringIO())
        handlers = [bar, ValidationHandler(val, est.evaluate, event_handlers=[probe])]
    else:
        bar = ProgressBarHandler(file=io.StringIO())
        handlers = [bar, LambdaHandler(batch_end=boom, once=N_BATCHES + 2)]
    with pytest.raises(RuntimeError, match="boom"):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=handlers)
    names = {b.desc for b in created}
    assert ("validation" in names) == (where == "validation")
    assert created and all(b.disable for b in created)  # tqdm marks a closed bar disabled


@pytest.mark.parametrize("order", ["logging_first", "bar_first"])
def test_console_logging_is_routed_around_the_bars_and_restored(tmp_path, capsys, order):
    est = make_estimator()
    before = list(est.logger.handlers)
    during = []
    logging_handler = LoggingHandler(log_dir=tmp_path)
    bar = ProgressBarHandler(file=io.StringIO())
    probe = LambdaHandler(batch_end=lambda e, **kw: during.append([type(h).__name__ for h in e.logger.handlers]),
                          once=1)
    handlers = [logging_handler, bar] if order == "logging_first" else [bar, logging_handler]
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[*handlers, probe])
    assert "_BarSafe" in during[0] and "FileHandler" in during[0]
    assert est.logger.handlers == before  # the log file's handler is gone, the console one is back
    assert "Training begin" in capsys.readouterr().out  # still printed, through tqdm.write


def test_bars_never_reach_the_log_file(tmp_path, capsys):
    est = make_estimator()
    logging_handler = LoggingHandler(log_interval=1, log_dir=tmp_path)
    est.fit(make_batches(N_BATCHES), epochs=2, val_data=make_batches(2, seed=1),
            event_handlers=[ProgressBarHandler(refresh_interval=0.0), logging_handler])
    err = capsys.readouterr().err
    assert "epochs:" in err and "batch/s" in err  # the bars went to stderr
    with open(logging_handler.log_file, encoding="utf-8") as f:
        log = f.read()
    assert "Training begin" in log and "[Epoch 2/2] Finished" in log
    assert not re.search(r"\d+%\||\|#|batch/s|epoch/s|\r", log)


def test_fit_adds_a_bar_when_stderr_is_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    make_estimator().fit(make_batches(N_BATCHES), epochs=2)
    assert count(last(terminal.getvalue(), "epochs")) == (2, 2)
    plain = io.StringIO()
    monkeypatch.setattr(sys, "stderr", plain)
    make_estimator().fit(make_batches(N_BATCHES), epochs=2)
    assert plain.getvalue() == ""


def test_a_resumed_fit_continues_the_counts():
    est = make_estimator()
    first, second = io.StringIO(), io.StringIO()
    ctrl_c = LambdaHandler(batch_end=lambda e, **kw: signal.raise_signal(signal.SIGINT), once=N_BATCHES + 2)
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[ProgressBarHandler(refresh_interval=0.0, file=first),
                                                                   ctrl_c])
    bar = ProgressBarHandler(refresh_interval=0.0, file=second)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=[bar, ctrl_c], resume=True)
    drawn = frames(second.getvalue())
    assert not any("nan" in f for f in drawn)  # never the metrics of before their restore
    epoch_two = [count(f)[0] for f in drawn if f.startswith("epoch 2/3:")]
    assert epoch_two[1:] == list(range(2, N_BATCHES + 1))  # drawn empty, then moved to the saved batch
    assert not any(f.startswith("epoch 1/3:") for f in drawn)
    assert count(last(second.getvalue(), "epochs")) == (3, 3)
    assert (bar.epochs_done, bar.total_batches) == (3, 3 * N_BATCHES)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"refresh_interval": -1}, ValueError, "refresh_interval"),
    ({"refresh_interval": True}, ValueError, "refresh_interval"),
    ({"metrics": ["loss"]}, TypeError, "metrics"),
    ({"file": "bar.txt"}, TypeError, "file"),
])
def test_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        ProgressBarHandler(**kwargs)


def test_state_round_trip():
    _, _, bar = fit_with_bar(epochs=2)
    state = bar.state_dict()
    assert state == {"batch_in_epoch": N_BATCHES, "epochs_done": 2, "total_batches": 2 * N_BATCHES}
    other = ProgressBarHandler()
    other.load_state_dict(state)
    assert other.state_dict() == state
    with pytest.raises(ValueError, match="epochs_done"):
        other.load_state_dict({"batch_in_epoch": 0, "total_batches": 0})


def test_the_default_file_is_chosen_at_each_fit(monkeypatch):
    bar = ProgressBarHandler(refresh_interval=0.0)
    streams = [io.StringIO(), io.StringIO()]
    for stream in streams:
        monkeypatch.setattr(sys, "stderr", stream)
        make_estimator().fit(make_batches(N_BATCHES), epochs=1, event_handlers=[bar])
    assert all("epochs:" in s.getvalue() for s in streams) and bar.file is None


def test_a_fit_ended_by_an_error_leaves_its_batch_bar(notebook):
    def boom(est, **kwargs):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[
            ProgressBarHandler(refresh_interval=0.0), LambdaHandler(batch_end=boom, once=N_BATCHES + 2)])
    epochs, batches = notebook[-1].split("\n")
    assert count(epochs) == (1, 3) and batches.startswith("epoch 2/3:") and count(batches) == (1, N_BATCHES)
    make_estimator().fit(make_batches(N_BATCHES), epochs=3, event_handlers=[ProgressBarHandler(refresh_interval=0.0)])
    assert "\n" not in notebook[-1]  # a finished fit shows its epochs bar alone
