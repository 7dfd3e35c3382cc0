"""CheckpointHandler: names, retention, best, refusal, fingerprint and plan checks, exact resume
from every checkpoint of a run, state round trip and argument validation."""

from __future__ import annotations

import math
import os
import random
import shutil
import warnings
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from estimatorch import CheckpointHandler, Estimator, ValidationHandler, checkpoint, rng
from estimatorch.event_handlers import BatchEnd, EpochBegin, EpochEnd
from estimatorch.events import subscribes
from estimatorch.metrics import Loss
from tests.conftest import (
    CrashAt,
    LossRecorder,
    ScriptedValLoss,
    assert_same_training_state,
    assert_tree_equal,
    losses_recorder,
    make_batches,
    make_estimator,
    without_sanity_pass,
)

# -- the run that every exactness test resumes -------------------------------------------------
FEATURES, CLASSES = 5, 3
SAMPLES, BATCH_SIZE, EPOCHS = 26, 4, 3
BATCHES = -(-SAMPLES // BATCH_SIZE)  # 7: the last batch holds 2 samples
STEPS = EPOCHS * BATCHES


class AugmentedDataset(Dataset):
    """Map-style; every sample draws random augmentation from torch, estimatorch's numpy
    generator and python ``random``."""

    def __init__(self, n: int = SAMPLES):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(FEATURES)
        x = x * float(rng.default_numpy_rng().uniform(0.8, 1.2))
        if random.random() < 0.5:
            x = x.flip(0)
        return x, self.y[i]


class EventCounter(EpochBegin, EpochEnd, BatchEnd):
    """Counts the events it receives (of the loop, or of ``evaluate`` when given to it)."""

    def __init__(self) -> None:
        self.epoch_begins = self.epoch_ends = self.batches = 0

    def epoch_begin(self, estimator: Any, **kwargs: Any) -> None:
        self.epoch_begins += 1

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.epoch_ends += 1

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.batches += 1


def build(*, seed: int = 0, samples: int = SAMPLES, batch_size: int = BATCH_SIZE,
          drop_last: bool = False) -> tuple[Estimator, DataLoader]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, CLASSES))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    estimator = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, lr_scheduler=scheduler, seed=seed)
    loader = DataLoader(AugmentedDataset(samples), batch_size=batch_size, shuffle=True, drop_last=drop_last,
                        num_workers=0)
    return estimator, loader


def val_batches() -> list:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(6, FEATURES, generator=g), torch.randint(0, CLASSES, (6,), generator=g))
            for _ in range(2)]


def fit_run(directory: Any, *, epochs: int = EPOCHS, build_kwargs: Optional[dict] = None,
            **handler_kwargs: Any) -> SimpleNamespace:
    """Build the run afresh and fit it with a CheckpointHandler in ``directory``."""
    estimator, loader = build(**(build_kwargs or {}))
    initial = {k: v.clone() for k, v in estimator.net.state_dict().items()}
    recorder, loop, evaluations = LossRecorder(), EventCounter(), EventCounter()
    kwargs = dict(batch_period=1, epoch_period=1, max_checkpoints=None)
    kwargs.update(handler_kwargs)
    handlers = [CheckpointHandler(directory, **kwargs),
                ValidationHandler(val_batches(), estimator.evaluate, event_handlers=[evaluations]),
                recorder, loop]
    run = SimpleNamespace(estimator=estimator, initial=initial, losses=recorder.losses, loop=loop,
                          evaluations=evaluations, dir=directory, history=None)
    run.history = estimator.fit(loader, epochs=epochs, event_handlers=handlers)
    return run


def batch_save_position(step: int, batches: int = BATCHES) -> tuple[int, int]:
    """(epochs completed, batches trained) of a batch-period save after ``step`` batches."""
    return (step - 1) // batches, step


# Every save of the reference run: a batch-period save after each step, an epoch-period save
# after each epoch (one file per step: at an epoch's last batch, epoch{E+1}batch{B} replaces
# epoch{E}batch{B}, which the batch-only reference keeps).
BATCH_SAVES = [batch_save_position(step) for step in range(1, STEPS + 1)]
EPOCH_SAVES = [(epoch, epoch * BATCHES) for epoch in range(1, EPOCHS + 1)]


def name(epoch: int, step: int, prefix: str = "model") -> str:
    return checkpoint.checkpoint_name(prefix, epoch, step)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The run without interruption, a checkpoint after every batch and every epoch."""
    run = fit_run(tmp_path_factory.mktemp("reference"))
    assert len(run.losses) == STEPS and run.evaluations.epoch_ends == EPOCHS
    return run


@pytest.fixture(scope="module")
def batch_reference(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The same run with batch saves only: it keeps the saves at an epoch's last batch."""
    return fit_run(tmp_path_factory.mktemp("batch_reference"), epoch_period=None)


def periodic_files(directory: Any, prefix: str = "model") -> list[str]:
    return [os.path.basename(p) for _, _, p in checkpoint.list_checkpoints(directory, prefix)]


def latest(directory: Any, prefix: str = "model") -> str:
    with open(os.path.join(directory, f"{prefix}-latest"), encoding="utf-8") as f:
        return f.read().strip()


def small_fit(directory: Any, *, epochs: int = 2, n_batches: int = 4, estimator: Optional[Estimator] = None,
              extra: Optional[list] = None, **handler_kwargs: Any) -> SimpleNamespace:
    """A fast fit on a list of batches (the conftest model) with a CheckpointHandler."""
    estimator = estimator if estimator is not None else make_estimator()
    handler = CheckpointHandler(directory, **handler_kwargs)
    recorder = LossRecorder()
    history = estimator.fit(make_batches(n_batches), epochs=epochs,
                            event_handlers=[handler, recorder, *(extra or [])])
    return SimpleNamespace(estimator=estimator, handler=handler, losses=recorder.losses, history=history)


# -- names and the latest pointer ----------------------------------------------------------------
@pytest.mark.parametrize("epoch_period, epochs", [(1, 3), (2, 5)])
def test_epoch_mode_names(tmp_path, epoch_period, epochs):
    n_batches = 4
    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, epoch_period=epoch_period, max_checkpoints=None)
    expected = [name(e, e * n_batches) for e in range(1, epochs + 1) if e % epoch_period == 0]
    assert periodic_files(tmp_path) == expected
    # the progress mark stays where the last epoch's end is not saved (it tells the run's ledger so)
    mark = [checkpoint.PROGRESS_NAME] if epochs % epoch_period else []
    assert sorted(os.listdir(tmp_path)) == sorted([*expected, "model-latest", *mark])
    assert latest(tmp_path) == expected[-1]


@pytest.mark.parametrize("batch_period", [1, 3, 4])
def test_batch_mode_names(tmp_path, batch_period):
    n_batches, epochs = 4, 2
    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, epoch_period=None, batch_period=batch_period,
              max_checkpoints=None, model_prefix="run")
    steps = [s for s in range(1, epochs * n_batches + 1) if s % batch_period == 0]
    expected = [name(*batch_save_position(s, n_batches), prefix="run") for s in steps]
    assert periodic_files(tmp_path, "run") == expected
    assert latest(tmp_path, "run") == expected[-1]


def test_both_periods_at_an_epochs_last_batch_give_one_file(tmp_path):
    """One checkpoint per step: batch_period=20 with the default epoch_period=1 wrote two 13 MB
    files of step 120 (the batch save and the epoch end's); the epoch end's now replaces the
    other, and uses up one place of max_checkpoints, not two."""
    n_batches = 4
    small_fit(tmp_path, epochs=2, n_batches=n_batches, epoch_period=1, batch_period=2, max_checkpoints=None)
    assert periodic_files(tmp_path) == [name(0, 2), name(1, 4), name(1, 6), name(2, 8)]
    assert latest(tmp_path) == name(2, 8)
    assert checkpoint.load(tmp_path / name(1, 4))["ranks"][0]["position"]["phase"] == "epoch_end"


def test_a_resume_from_an_epochs_last_batch_save_replaces_it_at_the_epoch_end(tmp_path):
    n_batches = 4
    small_fit(tmp_path / "whole", epochs=1, n_batches=n_batches, epoch_period=None, batch_period=n_batches)
    (tmp_path / "run").mkdir()
    shutil.copy(tmp_path / "whole" / name(0, n_batches), tmp_path / "run")
    small_fit(tmp_path / "run", epochs=1, n_batches=n_batches, epoch_period=1, batch_period=n_batches,
              resume_from_checkpoint=True)
    assert periodic_files(tmp_path / "run") == [name(1, n_batches)]


def test_the_latest_pointer_is_written_last(tmp_path, writes):
    fit_scripted(tmp_path, [3.0, 2.0, 2.5])
    files = [file for file, _ in writes]
    # each save: the periodic file, the best file when it improved, then the pointer to the former
    assert files == [name(1, 2), "model-best.pt", "model-latest", name(2, 4), "model-best.pt", "model-latest",
                     name(3, 6), "model-latest"]
    pointers = [text.strip() for file, text in writes if file == "model-latest"]
    assert pointers == [name(1, 2), name(2, 4), name(3, 6)]


def test_verbose_logs_every_save(tmp_path, estimatorch_log):
    small_fit(tmp_path, epochs=2, epoch_period=1, verbose=1)
    saved = [r.getMessage() for r in estimatorch_log if r.getMessage().startswith("Saved checkpoint")]
    assert [os.path.basename(m.split()[-1]) for m in saved] == periodic_files(tmp_path)


# -- retention ---------------------------------------------------------------------------------
def test_max_checkpoints_keeps_the_newest(tmp_path):
    n_batches, epochs = 4, 2
    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, epoch_period=None, batch_period=1, max_checkpoints=2)
    last = epochs * n_batches
    assert periodic_files(tmp_path) == [name(*batch_save_position(s, n_batches)) for s in (last - 1, last)]
    assert latest(tmp_path) == name(*batch_save_position(last, n_batches))


def test_a_resume_finishes_the_prune_a_killed_writer_left_undone(tmp_path):
    """Killed after writing the pointer, before pruning: one file too many is left. A resume
    prunes it at start, even when it has nothing left to train (then it saves nothing)."""
    n_batches, epochs = 4, 1
    options = dict(epoch_period=None, batch_period=1)
    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, max_checkpoints=3, **options)
    assert len(periodic_files(tmp_path)) == 3  # as if a max_checkpoints=2 run died before its prune
    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, max_checkpoints=2, resume_from_checkpoint=True,
              **options)
    assert periodic_files(tmp_path) == [name(*batch_save_position(s, n_batches)) for s in (n_batches - 1, n_batches)]
    assert latest(tmp_path) == name(*batch_save_position(n_batches, n_batches))


def test_max_checkpoints_none_keeps_all(tmp_path):
    n_batches, epochs = 4, 2
    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, epoch_period=1, batch_period=1, max_checkpoints=None)
    steps = range(1, epochs * n_batches + 1)
    expected = sorted([batch_save_position(s, n_batches) for s in steps if s % n_batches] +
                      [(e, e * n_batches) for e in range(1, epochs + 1)])  # one file per step
    assert periodic_files(tmp_path) == [name(*p) for p in expected]


def test_files_written_before_a_resume_count_towards_max_checkpoints(tmp_path):
    """Lightning #18687 / Gluon: a resumed run must prune the files of the run it continues."""
    n_batches, epochs, crash = 4, 2, 5
    with pytest.raises(RuntimeError, match="crash"):
        small_fit(tmp_path, epochs=epochs, n_batches=n_batches, epoch_period=None, batch_period=1,
                  max_checkpoints=3, extra=[CrashAt(crash)])
    before = [name(*batch_save_position(s, n_batches)) for s in range(crash - 3, crash)]
    assert periodic_files(tmp_path) == before

    small_fit(tmp_path, epochs=epochs, n_batches=n_batches, epoch_period=None, batch_period=1, max_checkpoints=2,
              resume_from_checkpoint=True)
    last = epochs * n_batches
    assert periodic_files(tmp_path) == [name(*batch_save_position(s, n_batches)) for s in (last - 1, last)]


def test_retention_never_deletes_by_prefix_match(tmp_path):
    decoys = ["model-epoch0batch1x.pt", "modelx-epoch0batch1.pt", "model2-epoch0batch1.pt", "model-best.pt",
              "model-epoch0batch1.pt.v1"]
    for decoy in decoys:
        (tmp_path / decoy).write_bytes(decoy.encode())
    small_fit(tmp_path, epochs=2, epoch_period=None, batch_period=1, max_checkpoints=1, resume_from_checkpoint=True)
    for decoy in decoys:
        assert (tmp_path / decoy).read_bytes() == decoy.encode()
    assert len(periodic_files(tmp_path)) == 1


def test_best_is_never_pruned(tmp_path):
    estimator = make_estimator()
    run = small_fit(tmp_path, estimator=estimator, epochs=3, epoch_period=1, max_checkpoints=1, save_best=True,
                    monitor=estimator.train_metrics[0])
    assert periodic_files(tmp_path) == [name(3, 12)]
    assert (tmp_path / "model-best.pt").exists()
    assert run.history.epochs == [1, 2, 3]


# -- best --------------------------------------------------------------------------------------
@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every file written from now on, in order, as (file name, position) for checkpoints and
    (file name, text) for the latest pointer."""
    _files = getattr(checkpoint, "_files", checkpoint)  # the module write_latest's atomic_save lives in
    written: list[tuple[str, Any]] = []
    real_save = checkpoint.atomic_save

    def recording_save(obj: Any, path: Any, **kwargs: Any) -> None:
        written.append((os.path.basename(path), obj["ranks"][0]["position"] if isinstance(obj, dict) else obj))
        real_save(obj, path, **kwargs)

    monkeypatch.setattr(checkpoint, "atomic_save", recording_save)  # the handler's checkpoint files
    monkeypatch.setattr(_files, "atomic_save", recording_save)  # the pointer (write_latest)
    return written


def fit_scripted(directory: Any, values: list[float], epochs: Optional[int] = None,
                 **handler_kwargs: Any) -> CheckpointHandler:
    """Fit ``epochs`` epochs (one per value by default), validating with the scripted values in
    turn, with ``save_best`` on the validation loss at every epoch end."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    estimator = without_sanity_pass(Estimator(net, nn.CrossEntropyLoss(), val_loss=ScriptedValLoss(values),
                                              optimizer=torch.optim.SGD(net.parameters(), lr=0.1)))
    handler = CheckpointHandler(directory, monitor=estimator.val_metrics[0], save_best=True, **handler_kwargs)
    estimator.fit(make_batches(2), val_data=make_batches(1), epochs=epochs or len(values), event_handlers=[handler])
    return handler


def best_epochs(writes: list[tuple[str, dict]]) -> list[int]:
    return [position["epoch"] for file, position in writes if file == "model-best.pt"]


def improvements(values: list[float], better: Any) -> list[int]:
    """1-based epochs where ``values`` beat every earlier non-nan value."""
    best, epochs = None, []
    for epoch, value in enumerate(values, start=1):
        if not math.isnan(value) and (best is None or better(value, best)):
            best = value
            epochs.append(epoch)
    return epochs


def test_best_is_written_only_on_improvement_of_a_loss(tmp_path, writes):
    values = [3.0, 2.0, 2.5, 1.0, 1.0, 0.5]
    expected = improvements(values, lambda new, old: new < old)
    assert 0 < len(expected) < len(values)
    handler = fit_scripted(tmp_path, values)
    assert handler.mode == "min"
    assert best_epochs(writes) == expected
    best = checkpoint.load(tmp_path / "model-best.pt")
    assert best["ranks"][0]["position"]["epoch"] == expected[-1]
    assert best["ranks"][0]["handlers"]["CheckpointHandler"]["best"] == min(values)


def test_best_with_mode_max(tmp_path, writes):
    values = [1.0, 2.0, 1.5, 3.0]
    handler = fit_scripted(tmp_path, values, mode="max")
    assert handler.mode == "max"
    assert best_epochs(writes) == improvements(values, lambda new, old: new > old)


def test_a_best_monitor_not_computed_yet_warns_once_and_writes_no_best(tmp_path):
    # a val monitor is read at validations: without val_data none runs, which the fit's end says once
    estimator = make_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, save_best=True,
                                monitor=estimator.val_metrics[0])
    with pytest.warns(UserWarning, match="no validation ran in this fit, so val_loss") as caught:
        estimator.fit(make_batches(), epochs=2, event_handlers=[handler])
    assert sum("no validation ran" in str(w.message) for w in caught) == 1
    assert not any("best" in name for name in os.listdir(tmp_path))
    assert any(name.endswith(".pt") for name in os.listdir(tmp_path))  # the batch saves happened


def test_batch_saves_before_the_first_validation_do_not_warn(tmp_path):
    """Monitoring val_loss with batch_period: the first epoch's saves come before its validation,
    where nan is what the monitor holds (examples/char_lm.py's setup)."""
    estimator = make_estimator()
    handler = CheckpointHandler(tmp_path, batch_period=1, epoch_period=1, save_best=True, monitor="val_loss")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        estimator.fit(make_batches(), val_data=make_batches(2), epochs=2, event_handlers=[handler])
    assert (tmp_path / "model-best.pt").exists()


def test_best_auto_mode_follows_the_metric():
    estimator = make_estimator()  # CrossEntropyLoss: a loss and an accuracy metric
    loss, accuracy = estimator.val_metrics[0], estimator.val_metrics[1]
    assert not loss.higher_is_better and accuracy.higher_is_better
    assert CheckpointHandler("d", monitor=loss, save_best=True).mode == "min"
    assert CheckpointHandler("d", monitor=accuracy, save_best=True).mode == "max"


def test_nan_monitor_warns_and_keeps_the_best(tmp_path, writes):
    values = [2.0, math.nan, 1.0]
    with pytest.warns(UserWarning, match="nan"):
        handler = fit_scripted(tmp_path, values)
    assert best_epochs(writes) == improvements(values, lambda new, old: new < old)
    assert 2 not in best_epochs(writes)
    assert handler.best == 1.0


def test_a_resumed_run_keeps_the_best_value(tmp_path, writes):
    values = [1.0, 3.0, 2.0]  # the best is before the resume point; later values are worse
    fit_scripted(tmp_path / "first", values[:1], epochs=1)
    (tmp_path / "second").mkdir()
    shutil.copy(tmp_path / "first" / name(1, 2), tmp_path / "second")
    writes.clear()
    handler = fit_scripted(tmp_path / "second", values[1:], epochs=len(values), resume_from_checkpoint=True)
    assert [file for file, _ in writes if file.endswith(".pt")] == [name(2, 4), name(3, 6)]  # no best
    assert handler.best == values[0]


def test_monitor_must_belong_to_the_estimator(tmp_path):
    with pytest.raises(ValueError, match="does not own"):
        small_fit(tmp_path, monitor=Loss(), save_best=True)
    assert not os.listdir(tmp_path)


# -- refusal: never overwrite another run -------------------------------------------------------
def snapshot_dir(directory: Any) -> dict[str, tuple[bytes, int]]:
    return {n: ((directory / n).read_bytes(), os.stat(directory / n).st_mtime_ns) for n in os.listdir(directory)}


@pytest.mark.parametrize("existing", ["periodic", "best"])
def test_refuses_a_directory_with_this_prefixs_checkpoints(tmp_path, existing):
    small_fit(tmp_path, epochs=1, epoch_period=1)
    if existing == "best":
        for file in periodic_files(tmp_path):
            os.replace(tmp_path / file, tmp_path / "model-best.pt")
    before = snapshot_dir(tmp_path)
    estimator = make_estimator()
    params = {k: v.clone() for k, v in estimator.net.state_dict().items()}
    counter = EventCounter()
    with pytest.raises(FileExistsError, match="resume_from_checkpoint=True"):
        small_fit(tmp_path, estimator=estimator, epochs=1, extra=[counter])
    assert counter.batches == 0 and counter.epoch_begins == 0
    assert_tree_equal(estimator.net.state_dict(), params, "model")
    assert snapshot_dir(tmp_path) == before


def test_another_prefix_in_the_same_directory_is_fine(tmp_path):
    small_fit(tmp_path, epochs=1, epoch_period=1)
    before = snapshot_dir(tmp_path)
    run = small_fit(tmp_path, epochs=1, epoch_period=1, model_prefix="other")
    assert len(run.losses) == 4
    assert periodic_files(tmp_path, "other") == [name(1, 4, "other")]
    assert {n: v for n, v in snapshot_dir(tmp_path).items() if n in before} == before


def test_resume_in_an_empty_directory_starts_fresh(tmp_path, estimatorch_log):
    plain = make_estimator()
    plain_losses = LossRecorder()
    plain.fit(make_batches(), epochs=2, event_handlers=[plain_losses])
    run = small_fit(tmp_path / "new", epochs=2, resume_from_checkpoint=True)
    assert run.losses == plain_losses.losses
    assert any("No checkpoint" in r.getMessage() for r in estimatorch_log)
    assert periodic_files(tmp_path / "new") == [name(1, 4), name(2, 8)]


def test_a_resume_with_nothing_to_resume_never_lets_save_best_overwrite_a_best_file(tmp_path):
    small_fit(tmp_path, epochs=1, epoch_period=1)
    for file in periodic_files(tmp_path):
        os.replace(tmp_path / file, tmp_path / "model-best.pt")  # a best file, no periodic one
    before = snapshot_dir(tmp_path)
    estimator, counter = make_estimator(), EventCounter()
    with pytest.raises(FileExistsError, match="no periodic checkpoint to resume from"):
        small_fit(tmp_path, estimator=estimator, epochs=1, extra=[counter], resume_from_checkpoint=True,
                  save_best=True, monitor=estimator.train_metrics[0])
    assert counter.batches == 0 and snapshot_dir(tmp_path) == before
    run = small_fit(tmp_path, epochs=1, resume_from_checkpoint=True)  # without save_best it never writes one
    assert len(run.losses) == 4 and (tmp_path / "model-best.pt").read_bytes() == before["model-best.pt"][0]


def test_the_save_schedule_follows_the_position_even_from_a_state_that_counted_wrong(tmp_path):
    """Older files of an epoch_period handler hold current_batch 0 whatever ran: a resume with a
    batch_period must still save at the run's batches N, 2N, ..."""
    n_batches, period = 4, 3
    small_fit(tmp_path, epochs=1, n_batches=n_batches, epoch_period=1)
    path = tmp_path / name(1, n_batches)
    payload = torch.load(path, weights_only=True)
    payload["ranks"][0]["handlers"]["CheckpointHandler"]["current_batch"] = 0
    torch.save(payload, path)
    small_fit(tmp_path, epochs=3, n_batches=n_batches, epoch_period=None, batch_period=period,
              max_checkpoints=None, resume_from_checkpoint=True)
    steps = [step for _, step, _ in checkpoint.list_checkpoints(tmp_path, "model")][1:]
    assert steps == list(range(period * (n_batches // period + 1), 3 * n_batches + 1, period))


def test_in_process_resume_with_files_of_its_own_run(tmp_path):
    """fit(..., resume=True) continues the estimator's own run, whose files are in model_dir."""
    whole = small_fit(tmp_path / "whole", epochs=2, epoch_period=None, batch_period=1)
    estimator = make_estimator()
    handler = CheckpointHandler(tmp_path / "split", epoch_period=None, batch_period=1)
    first, second = LossRecorder(), LossRecorder()
    estimator.fit(make_batches(), epochs=1, event_handlers=[handler, first])
    estimator.fit(make_batches(), epochs=2, event_handlers=[handler, second], resume=True)
    assert first.losses + second.losses == whole.losses
    assert_tree_equal(estimator.net.state_dict(), whole.estimator.net.state_dict(), "model")
    # a new run of that estimator (no resume) still may not overwrite them
    params = {k: v.clone() for k, v in estimator.net.state_dict().items()}
    before = snapshot_dir(tmp_path / "split")
    with pytest.raises(FileExistsError):
        estimator.fit(make_batches(), epochs=2, event_handlers=[handler])
    assert_tree_equal(estimator.net.state_dict(), params, "model")
    assert snapshot_dir(tmp_path / "split") == before


# -- fingerprint and plan -------------------------------------------------------------------------
@pytest.mark.parametrize("build_kwargs, keys", [
    (dict(batch_size=BATCH_SIZE + 1), ["batch_size"]),
    (dict(samples=SAMPLES - 1), ["dataset_len"]),
    (dict(drop_last=True), ["drop_last"]),
    (dict(seed=1), ["seed"]),
    (dict(seed=1, batch_size=BATCH_SIZE + 1), ["batch_size", "seed"]),
])
def test_a_different_data_stream_is_refused_before_training(reference, tmp_path, build_kwargs, keys):
    shutil.copy(reference.dir / name(*BATCH_SAVES[2]), tmp_path)
    estimator, loader = build(**build_kwargs)
    params = {k: v.clone() for k, v in estimator.net.state_dict().items()}
    counter = EventCounter()
    handler = CheckpointHandler(tmp_path, resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="data stream differs") as info:
        estimator.fit(loader, epochs=EPOCHS, event_handlers=[handler, counter])
    message = str(info.value)
    for key in ("batch_size", "dataset_len", "drop_last", "seed", "world_size", "sampler"):
        assert (f"{key}: saved" in message) == (key in keys), key
    assert counter.batches == 0 and counter.epoch_begins == 0
    assert_tree_equal(estimator.net.state_dict(), params, "model")


def test_a_finished_plan_has_nothing_to_resume(reference, tmp_path, estimatorch_log):
    shutil.copy(reference.dir / name(*EPOCH_SAVES[-1]), tmp_path)
    run = fit_run(tmp_path, resume_from_checkpoint=True)
    assert any("Nothing to resume" in r.getMessage() for r in estimatorch_log)
    assert run.losses == [] and run.loop.epoch_begins == 0 and run.evaluations.epoch_ends == 0
    assert_same_training_state(run.estimator, reference.estimator)
    assert_tree_equal(run.history.to_dict(), reference.history.to_dict(), "history")


def test_a_finished_plan_resumed_with_more_epochs_matches_the_longer_run(reference, tmp_path):
    longer = fit_run(tmp_path / "longer", epochs=EPOCHS + 1)
    assert longer.losses[:STEPS] == reference.losses  # the longer run starts as the reference
    (tmp_path / "resumed").mkdir()
    shutil.copy(reference.dir / name(*EPOCH_SAVES[-1]), tmp_path / "resumed")
    resumed = fit_run(tmp_path / "resumed", epochs=EPOCHS + 1, resume_from_checkpoint=True)
    assert resumed.losses == longer.losses[STEPS:] and len(resumed.losses) == BATCHES
    assert_same_training_state(resumed.estimator, longer.estimator)
    assert_tree_equal(resumed.history.to_dict(), longer.history.to_dict(), "history")


def test_a_smaller_plan_than_the_checkpoint_is_refused_before_training(reference, tmp_path):
    shutil.copy(reference.dir / name(*EPOCH_SAVES[1]), tmp_path)
    estimator, loader = build()
    counter = EventCounter()
    with pytest.raises(ValueError, match="beyond the plan epochs=1"):
        estimator.fit(loader, epochs=1, event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True),
                                                         counter])
    assert counter.batches == 0 and counter.epoch_begins == 0


# -- exactness: resume from every checkpoint of a run ---------------------------------------------
def _resume_and_compare(reference: SimpleNamespace, tmp_path: Any, epoch: int, step: int,
                        source: Optional[SimpleNamespace] = None) -> SimpleNamespace:
    file = name(epoch, step)
    shutil.copy((source or reference).dir / file, tmp_path)
    saved = checkpoint.load(tmp_path / file)
    run = fit_run(tmp_path, resume_from_checkpoint=True)
    assert run.losses == reference.losses[step:]
    assert_same_training_state(run.estimator, reference.estimator)
    assert_tree_equal(run.history.to_dict(), reference.history.to_dict(), "history")
    # every remaining epoch end ran once (the interrupted epoch's included), no empty epoch
    assert run.loop.epoch_begins == EPOCHS - epoch
    assert run.evaluations.epoch_ends == EPOCHS - epoch
    assert run.estimator.lr_scheduler.last_epoch - saved["lr_scheduler"]["last_epoch"] == EPOCHS - epoch
    assert run.history.epochs == list(range(1, EPOCHS + 1))
    return run


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. "no saved state", LR scheduler order
@pytest.mark.slow
@pytest.mark.parametrize("epoch, step", BATCH_SAVES, ids=[name(*p) for p in BATCH_SAVES])
def test_resume_from_every_batch_checkpoint_is_bit_identical(reference, batch_reference, tmp_path, epoch, step):
    _resume_and_compare(reference, tmp_path, epoch, step, batch_reference)


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. "no saved state", LR scheduler order
@pytest.mark.parametrize("epoch, step", EPOCH_SAVES, ids=[name(*p) for p in EPOCH_SAVES])
def test_resume_from_every_epoch_checkpoint_is_bit_identical(reference, tmp_path, epoch, step):
    _resume_and_compare(reference, tmp_path, epoch, step)


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. "no saved state", LR scheduler order
@pytest.mark.parametrize("step", [BATCHES + 3, 2 * BATCHES])
def test_resume_mid_epoch_and_at_an_epochs_last_batch(reference, batch_reference, tmp_path, step):
    """Fast representatives of the slow test above: the interrupted epoch's train metrics come
    back (accumulators restored), and an epoch's last batch runs its epoch end exactly once."""
    epoch = batch_save_position(step)[0]
    run = _resume_and_compare(reference, tmp_path, epoch, step, batch_reference)
    for metric in ("train_loss", "train_accuracy"):
        assert run.history[metric][epoch].hex() == reference.history[metric][epoch].hex()


def test_reference_files_are_all_there(reference):
    expected = sorted([p for p in BATCH_SAVES if p[1] % BATCHES] + EPOCH_SAVES)
    assert periodic_files(reference.dir) == [name(*p) for p in expected]
    assert latest(reference.dir) == name(*EPOCH_SAVES[-1])


# -- handler state ---------------------------------------------------------------------------------
def test_state_dict_round_trip(tmp_path):
    handler = CheckpointHandler(tmp_path)
    handler.load_state_dict({"current_epoch": 2, "current_batch": 9, "best": 0.25})  # saved before best_step
    assert handler.state_dict() == {"current_epoch": 2, "current_batch": 9, "best": 0.25, "best_step": 0}
    handler.load_state_dict({"current_epoch": 2, "current_batch": 9, "best": 0.25, "best_step": 6})
    state = handler.state_dict()
    other = CheckpointHandler(tmp_path)
    other.load_state_dict(state)
    assert (other.current_epoch, other.current_batch, other.best, other.best_step) == (2, 9, 0.25, 6)


def test_the_counters_are_read_only(tmp_path):
    handler = CheckpointHandler(tmp_path)
    with pytest.raises(AttributeError):
        handler.current_epoch = 3
    with pytest.raises(AttributeError):
        handler.current_batch = 3


@pytest.mark.parametrize("key, value, exc", [("current_epoch", -1, ValueError), ("current_batch", 1.5, ValueError),
                                             ("best", "low", TypeError), ("best", True, TypeError)])
def test_load_state_dict_refuses_bad_values(tmp_path, key, value, exc):
    state = dict(CheckpointHandler(tmp_path).state_dict(), **{key: value})
    with pytest.raises(exc, match=key):
        CheckpointHandler(tmp_path).load_state_dict(state)


@pytest.mark.parametrize("missing", ["current_epoch", "current_batch", "best"])
def test_load_state_dict_names_a_missing_key(tmp_path, missing):
    state = CheckpointHandler(tmp_path).state_dict()
    del state[missing]
    with pytest.raises(ValueError, match=repr(missing)):
        CheckpointHandler(tmp_path).load_state_dict(state)


def test_a_resumed_run_keeps_the_save_schedule(tmp_path):
    """The counters come back: resumed at a step off the batch_period schedule, the run writes
    the files the uninterrupted run wrote from there on, with the same contents."""
    n_batches, period = 4, 3
    assert n_batches % period  # the epoch-end file to resume from is off the batch schedule
    kwargs = dict(epochs=3, n_batches=n_batches, epoch_period=1, batch_period=period, max_checkpoints=None)
    whole = small_fit(tmp_path / "whole", **kwargs)
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "whole" / name(1, n_batches), tmp_path / "resumed")
    resumed = small_fit(tmp_path / "resumed", resume_from_checkpoint=True, **kwargs)
    expected = [n for (_, step, _), n in zip(checkpoint.list_checkpoints(tmp_path / "whole", "model"),
                                             periodic_files(tmp_path / "whole")) if step >= n_batches]
    assert periodic_files(tmp_path / "resumed") == expected
    for file in expected:
        assert_tree_equal(checkpoint.load(tmp_path / "resumed" / file)["model"],
                          checkpoint.load(tmp_path / "whole" / file)["model"], file)
    assert resumed.handler.state_dict() == whole.handler.state_dict()


def test_one_instance_serves_two_fits(tmp_path):
    handler = CheckpointHandler(tmp_path / "run", epoch_period=1, batch_period=3, max_checkpoints=3)
    results = []
    for attempt in ("first", "second"):
        estimator = make_estimator()
        estimator.fit(make_batches(), epochs=3, event_handlers=[handler])
        done = tmp_path / attempt
        os.replace(tmp_path / "run", done)  # the next fit starts in an empty model_dir
        results.append({n: checkpoint.load(done / n)["model"] for n in periodic_files(done)})
    assert list(results[0]) == list(results[1]) and len(results[0]) == 3
    for file in results[0]:
        assert_tree_equal(results[0][file], results[1][file], file)


# -- arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(max_checkpoints=0), ValueError, ["max_checkpoints", "0"]),
    (dict(max_checkpoints=-2), ValueError, ["max_checkpoints", "-2"]),
    (dict(max_checkpoints=2.5), ValueError, ["max_checkpoints", "2.5"]),
    (dict(epoch_period=0), ValueError, ["epoch_period", "0"]),
    (dict(batch_period=-1), ValueError, ["batch_period", "-1"]),
    (dict(batch_period=True), ValueError, ["batch_period", "True"]),
    (dict(epoch_period=None, batch_period=None), ValueError, ["epoch_period", "batch_period", "None"]),
    (dict(verbose=2), ValueError, ["verbose", "2"]),
    (dict(model_prefix="a/b"), ValueError, ["model_prefix", "'a/b'"]),
    (dict(model_prefix=""), ValueError, ["model_prefix", "''"]),
    (dict(model_prefix=3), ValueError, ["model_prefix", "3"]),
    (dict(mode="best"), ValueError, ["mode", "'best'"]),
    (dict(save_best=True), ValueError, ["save_best", "monitor"]),
    (dict(save_best="yes"), TypeError, ["save_best", "'yes'"]),
    (dict(resume_from_checkpoint=1), TypeError, ["resume_from_checkpoint", "1"]),
    (dict(monitor=3), TypeError, ["monitor", "3"]),
])
def test_bad_arguments_name_the_argument_and_value(tmp_path, kwargs, exc, words):
    with pytest.raises(exc) as info:
        CheckpointHandler(tmp_path, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("model_dir", [3, "", None])
def test_bad_model_dir(model_dir):
    with pytest.raises(TypeError, match="model_dir"):
        CheckpointHandler(model_dir)


def test_bad_mode_with_a_monitor():
    estimator = make_estimator()
    with pytest.raises(ValueError, match="'best'"):
        CheckpointHandler("d", monitor=estimator.val_metrics[0], mode="best")


def test_a_batches_plan_cut_mid_epoch_extends_exactly_from_its_batch_checkpoint(tmp_path):
    """batches=5 of an 8-batch epoch, saving every batch and every epoch: the cut epoch's end
    writes no second file over the same step, so a resume with a larger plan continues the
    epoch at batch 6 exactly as an uninterrupted run does."""
    data = make_batches(n_batches=8)

    whole, rec = losses_recorder()
    reference = make_estimator()
    reference.fit(data, batches=20, event_handlers=[rec])

    make_estimator().fit(data, batches=5, event_handlers=[CheckpointHandler(tmp_path, batch_period=1, max_checkpoints=None)])
    assert [os.path.basename(p) for _, _, p in checkpoint.list_checkpoints(tmp_path, "model")][-1] == "model-epoch0batch5.pt"
    rest, rec = losses_recorder()
    resumed = make_estimator()
    resumed.fit(data, batches=20, event_handlers=[rec, CheckpointHandler(tmp_path, batch_period=1, max_checkpoints=None,
                                                                         resume_from_checkpoint=True)])
    assert rest == whole[5:]
    assert_tree_equal(reference.net.state_dict(), resumed.net.state_dict(), "model")


def test_subscribes_only_to_the_periods_set(tmp_path):
    assert not subscribes(CheckpointHandler(tmp_path), "batch_end")
    assert subscribes(CheckpointHandler(tmp_path), "epoch_end")
    per_batch = CheckpointHandler(tmp_path, batch_period=5, epoch_period=None)
    assert subscribes(per_batch, "batch_end") and not subscribes(per_batch, "epoch_end")


# -- write order and pruning ------------------------------------------------------------------------
def test_the_pointer_is_written_before_pruning_and_never_names_a_removed_file(tmp_path, writes, monkeypatch):
    """With max_checkpoints=1 a kill between prune and pointer used to leave model-latest naming
    a deleted file: now the pointer is rewritten first."""
    events = []
    real_remove = os.remove

    def remove(path, *args, **kwargs):
        if os.path.basename(path) != checkpoint.PROGRESS_NAME:  # (removed at the end: a checkpoint tells it all)
            pointer = latest(tmp_path)
            events.append(("remove", os.path.basename(path), pointer, (tmp_path / pointer).exists()))
        return real_remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", remove)
    small_fit(tmp_path, epochs=1, n_batches=3, epoch_period=None, batch_period=1, max_checkpoints=1)
    assert [file for _, file, _, _ in events] == [name(0, 1), name(0, 2)]
    for _, file, pointer, exists in events:  # at each removal the pointer already names the newer file
        assert pointer != file and exists
    files = [file for file, _ in writes]
    assert files == [name(0, 1), "model-latest", name(0, 2), "model-latest", name(0, 3), "model-latest"]


def test_prune_tolerates_a_file_removed_by_someone_else_meanwhile(tmp_path, monkeypatch):
    """The exists-then-remove race: another process deletes the file just before we do."""
    real_remove = os.remove

    def remove_after_someone_else(path, *args, **kwargs):
        if os.path.exists(path):
            real_remove(path)  # the other process wins the race
        return real_remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", remove_after_someone_else)
    run = small_fit(tmp_path, epochs=1, n_batches=4, epoch_period=None, batch_period=1, max_checkpoints=2)
    assert len(run.losses) == 4
    assert periodic_files(tmp_path) == [name(0, 3), name(0, 4)]


def test_pruning_never_deletes_an_unreadable_file_or_one_skipped_as_unusable(tmp_path, estimatorch_log):
    small_fit(tmp_path, epochs=1, n_batches=4, epoch_period=None, batch_period=1, max_checkpoints=None)
    (tmp_path / name(0, 1)).write_bytes(b"not a checkpoint: kept, never counted")
    foreign = name(5, 99)  # the newest name, another model's file: skipped, never pruned
    payload = torch.load(tmp_path / name(0, 4), weights_only=True)
    payload["model"] = nn.Linear(2, 2).state_dict()
    torch.save(payload, tmp_path / foreign)
    foreign_bytes = (tmp_path / foreign).read_bytes()

    small_fit(tmp_path, epochs=2, n_batches=4, epoch_period=None, batch_period=1, max_checkpoints=1,
              resume_from_checkpoint=True)
    assert any(foreign in r.getMessage() and "another model" in r.getMessage() for r in estimatorch_log)
    assert periodic_files(tmp_path) == [name(0, 1), name(1, 8), foreign]
    assert (tmp_path / name(0, 1)).read_bytes() == b"not a checkpoint: kept, never counted"
    assert (tmp_path / foreign).read_bytes() == foreign_bytes
    assert latest(tmp_path) == name(1, 8)


class WritesAfterTheChecks(BatchEnd):
    """Another fit finishing in ``directory`` between our start checks and our lock: it runs its
    ``check_fit`` after the CheckpointHandler's and writes a checkpoint there."""

    def __init__(self, directory: Any, source: Any) -> None:
        self.directory, self.source = directory, source

    def check_fit(self, estimator: Any, resume: bool) -> None:
        shutil.copy(self.source, self.directory)

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        pass


def test_files_appearing_between_the_start_checks_and_the_lock_are_refused_untouched(tmp_path):
    small_fit(tmp_path / "other", epochs=1, epoch_period=1)
    (tmp_path / "new").mkdir()
    counter = EventCounter()
    with pytest.raises(FileExistsError, match="resume_from_checkpoint=True"):
        small_fit(tmp_path / "new", epochs=1, epoch_period=1, max_checkpoints=1,
                  extra=[counter, WritesAfterTheChecks(tmp_path / "new", tmp_path / "other" / name(1, 4))])
    assert counter.batches == 0
    assert (tmp_path / "new" / name(1, 4)).read_bytes() == (tmp_path / "other" / name(1, 4)).read_bytes()
    assert sorted(os.listdir(tmp_path / "new")) == [name(1, 4)]
