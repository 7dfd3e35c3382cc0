"""CheckpointHandler's public counters in every option combination (they once stayed 0 for the
events a handler does not subscribe to), saved in its state and back after a resume; the
directory logged once at fit start; one handler object across fits (fresh fit: fresh state;
resume: continued state)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochEnd
from tests.conftest import (CrashAt, CtrlC, ScriptedValLoss, assert_tree_equal, make_batches, make_estimator,
                            without_sanity_pass)

N_BATCHES, EPOCHS = 4, 3
STEPS = N_BATCHES * EPOCHS
CRASH = 6  # batch 6 begins: mid second epoch

#: name -> (CheckpointHandler options, whether it writes checkpoints a fit resumes from)
COMBINATIONS = {
    "epochs": (dict(epoch_period=1), True),
    "batches": (dict(epoch_period=None, batch_period=3), True),
    "both": (dict(epoch_period=2, batch_period=3), True),
    "best-only": (dict(epoch_period=1, save_best_only=True), False),
    "weights": (dict(epoch_period=None, batch_period=2, save_weights_only=True), False),
    "best-weights": (dict(epoch_period=1, save_best_only=True, save_weights_only=True), False),
}
pytestmark = [pytest.mark.filterwarnings("ignore:.*has no saved state:UserWarning"),
              pytest.mark.filterwarnings("ignore:CheckpointHandler.*is nan:UserWarning")]


class Probe(BatchEnd, EpochEnd):
    """Reads the handler's counters at every batch and epoch end and says what they should be,
    from its own count of the events since ``start`` (the position a resume starts from)."""

    def __init__(self, handler: CheckpointHandler, start: tuple[int, int] = (0, 0), priority: float = 10):
        self.handler, self.priority = handler, priority
        self.epochs, self.batches = start
        self.seen: list[tuple[int, int]] = []
        self.expected: list[tuple[int, int]] = []

    def _read(self) -> None:
        self.seen.append((self.handler.current_epoch, self.handler.current_batch))

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self._read()
        self.expected.append((self.epochs, self.batches))  # as of the boundary before this batch
        self.batches += 1

    def epoch_end(self, estimator: Any, **kwargs: Any) -> None:
        self._read()
        self.expected.append((self.epochs, self.batches))  # this epoch's batches are done, not the epoch
        self.epochs += 1


def make(directory: Any, estimator: Estimator, combination: str, resume: bool = False) -> CheckpointHandler:
    kwargs, resumable = COMBINATIONS[combination]
    kwargs = dict(kwargs, max_checkpoints=None)
    if kwargs.get("save_best_only"):
        kwargs["monitor"] = estimator.train_metrics[0]
    return CheckpointHandler(directory, resume_from_checkpoint=resume and resumable, **kwargs)


def recorder(directory: Any, resume: bool = False) -> CheckpointHandler:
    """A second handler saving after every batch: its checkpoints hold the first one's state."""
    return CheckpointHandler(directory, model_prefix="ckpt", epoch_period=None, batch_period=1, max_checkpoints=None,
                             resume_from_checkpoint=resume)


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
@pytest.mark.parametrize("priority", [-10, 10], ids=["probe-first", "probe-last"])
def test_the_counters_say_what_ran_in_every_combination(tmp_path, combination, priority):
    estimator = make_estimator()
    handler = make(tmp_path, estimator, combination)
    probe = Probe(handler, priority=priority)
    estimator.fit(make_batches(N_BATCHES), epochs=EPOCHS, event_handlers=[handler, recorder(tmp_path), probe])
    assert len(probe.seen) == STEPS + EPOCHS
    assert probe.seen == probe.expected
    assert (handler.current_epoch, handler.current_batch) == (EPOCHS, STEPS)
    assert handler.state_dict()["current_epoch"] == EPOCHS and handler.state_dict()["current_batch"] == STEPS


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_the_saved_counters_are_the_saves_position(tmp_path, combination):
    """Every checkpoint after a batch holds the handler's counters of that point, which its name
    says: E epochs completed, B batches trained."""
    estimator = make_estimator()
    handler = make(tmp_path, estimator, combination)
    estimator.fit(make_batches(N_BATCHES), epochs=EPOCHS, event_handlers=[handler, recorder(tmp_path)])
    files = checkpoint.list_checkpoints(tmp_path, "ckpt")
    assert len(files) == STEPS
    for epoch, step, path in files:
        state = checkpoint.load(path)["ranks"][0]["handlers"][handler.name]
        assert (state["current_epoch"], state["current_batch"]) == (epoch, step), path


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_a_resume_from_files_brings_the_counters_back(tmp_path, combination):
    first = make_estimator()
    handler = make(tmp_path, first, combination)
    resumable = COMBINATIONS[combination][1]
    with pytest.raises(RuntimeError, match="crash"):
        first.fit(make_batches(N_BATCHES), epochs=EPOCHS, event_handlers=[handler, recorder(tmp_path), CrashAt(CRASH)])
    assert (handler.current_epoch, handler.current_batch) == ((CRASH - 1) // N_BATCHES, CRASH - 1)
    # the file the resume reads: the handler's own newest checkpoint, else the recorder's
    epoch, step, _ = checkpoint.list_checkpoints(tmp_path, "model" if resumable else "ckpt")[-1]

    estimator = make_estimator()
    handler = make(tmp_path, estimator, combination, resume=True)
    probe = Probe(handler, start=(epoch, step))
    others = [] if resumable else [recorder(tmp_path, resume=True)]
    estimator.fit(make_batches(N_BATCHES), epochs=EPOCHS, event_handlers=[handler, *others, probe])
    assert probe.seen == probe.expected and len(probe.seen) == (STEPS - step) + (EPOCHS - epoch)
    assert (handler.current_epoch, handler.current_batch) == (EPOCHS, STEPS)


def test_counters_of_a_loaded_state_outside_fit(tmp_path):
    handler = CheckpointHandler(tmp_path, epoch_period=None, batch_period=2)
    assert (handler.current_epoch, handler.current_batch) == (0, 0)
    handler.load_state_dict({"current_epoch": 4, "current_batch": 17, "best": 1.5})
    assert (handler.current_epoch, handler.current_batch, handler.best) == (4, 17, 1.5)


# -- the directory, logged once ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, files", [
    (dict(batch_period=1), ["model-epoch{E}batch{B}.pt", "model-latest"]),
    (dict(batch_period=1, save_best_only=True, save_weights_only=True), ["model-best.weights.pt"]),
])
def test_the_directory_is_logged_once_at_fit_start(tmp_path, estimatorch_log, kwargs, files):
    estimator = make_estimator()
    if kwargs.get("save_best_only"):
        kwargs = dict(kwargs, monitor=estimator.train_metrics[0])
    directory = tmp_path / "runs" / "ckpt"
    marks: list[int] = []

    class FirstBatch(BatchBegin):
        def batch_begin(self, estimator: Any, **kw: Any) -> None:
            marks.append(len(estimatorch_log))

    estimator.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[CheckpointHandler(directory, **kwargs),
                                                                     FirstBatch()])
    where = [i for i, r in enumerate(estimatorch_log) if str(directory) in r.getMessage()]
    assert len(where) == 1, [r.getMessage() for r in estimatorch_log]
    line = estimatorch_log[where[0]].getMessage()
    assert line.startswith("CheckpointHandler writes") and line.endswith(os.path.abspath(directory))
    assert all(f in line for f in files)
    assert where[0] < marks[0]  # before the first batch


# -- one handler object, several fits --------------------------------------------------------------
def scripted(values: list[float]) -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    val_loss=ScriptedValLoss(values))
    return without_sanity_pass(est)


@pytest.mark.parametrize("combination", ["both", "best-weights"])
def test_a_fresh_fit_with_the_same_handler_starts_fresh(tmp_path, combination):
    kwargs = dict(COMBINATIONS[combination][0], max_checkpoints=None)
    first_values, second_values = [0.5, 0.375], [2.0, 3.0]  # the second fit never beats the first's best
    first = scripted(first_values)
    handler = CheckpointHandler(tmp_path / "run", monitor=first.val_metrics[0], save_best=True, **kwargs)
    first.fit(make_batches(N_BATCHES), val_data=make_batches(1), epochs=2, event_handlers=[handler])
    assert handler.best == min(first_values)
    os.replace(tmp_path / "run", tmp_path / "first")  # the next fit starts in an empty model_dir

    second = scripted(second_values)
    handler.monitor = second.val_metrics[0]
    probe = Probe(handler)
    second.fit(make_batches(N_BATCHES), val_data=make_batches(1), epochs=2, event_handlers=[handler, probe])
    assert probe.seen[0] == (0, 0) and probe.seen == probe.expected
    assert (handler.current_epoch, handler.current_batch) == (2, 2 * N_BATCHES)
    assert handler.best == min(second_values)
    best = "model-best.weights.pt" if kwargs.get("save_weights_only") else "model-best.pt"
    assert (tmp_path / "run" / best).exists()


@pytest.mark.parametrize("combination", ["both", "best-weights"])
def test_a_resume_with_the_same_handler_continues(tmp_path, combination):
    kwargs = dict(COMBINATIONS[combination][0], max_checkpoints=None)
    values = [0.5, 0.75, 0.25]
    whole_est = scripted(values)
    whole = CheckpointHandler(tmp_path / "whole", monitor=whole_est.val_metrics[0], save_best=True, **kwargs)
    whole_est.fit(make_batches(N_BATCHES), val_data=make_batches(1), epochs=3, event_handlers=[whole])

    estimator = scripted(values)
    handler = CheckpointHandler(tmp_path / "parts", monitor=estimator.val_metrics[0], save_best=True, **kwargs)
    stop = N_BATCHES + 2
    with pytest.raises(KeyboardInterrupt):
        estimator.fit(make_batches(N_BATCHES), val_data=make_batches(1), epochs=3, event_handlers=[handler, CtrlC(stop)])
    assert (handler.current_epoch, handler.current_batch) == (1, stop)
    probe = Probe(handler, start=(1, stop))
    estimator.fit(make_batches(N_BATCHES), val_data=make_batches(1), epochs=3, event_handlers=[handler, probe],
                  resume=True)
    assert probe.seen == probe.expected and probe.seen[0] == (1, stop)
    assert handler.state_dict() == whole.state_dict()
    best = "model-best.weights.pt" if kwargs.get("save_weights_only") else "model-best.pt"
    assert_tree_equal(dict(checkpoint.load_weights(tmp_path / "parts" / best)),
                      dict(checkpoint.load_weights(tmp_path / "whole" / best)), best)
