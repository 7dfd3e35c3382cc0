"""What the loop reads of handlers through declared capabilities (``Handler.epoch_rates``,
``Handler.epoch_readings``, ``Handler.stepped_schedule``): a handler of yours that declares them
is read as the built-in ones are, and the loop names no built-in handler class."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR

from estimatorch import Estimator
from estimatorch.events import BatchEnd, EpochEnd, Handler
from estimatorch.events.readings import epoch_learning_rates, learning_rate_names
from tests.conftest import make_batches

PACKAGE = pathlib.Path(__file__).resolve().parent.parent.parent / "estimatorch"


def make_estimator(**kwargs):
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)


class Measures(Handler, EpochEnd):
    """Measures a count per epoch, and says it only for the epoch it measured."""

    def __init__(self):
        self.measured = None

    def epoch_end(self, estimator, **kwargs):
        self.measured = estimator.position.epoch

    def epoch_readings(self, epoch):
        return {"my_count": float(epoch + 10)} if epoch == self.measured else {}


def test_a_handlers_declared_readings_reach_the_history():
    history = make_estimator().fit(make_batches(2), epochs=3, event_handlers=[Measures()])
    assert history["my_count"] == [10.0, 11.0, 12.0]


class HalvesAtEpochEnd(Handler, EpochEnd):
    """Halves the rate at each epoch's end, saying the rate the epoch trained with."""

    def __init__(self):
        self.before = None

    def epoch_end(self, estimator, **kwargs):
        group = estimator.optimizer.param_groups[0]
        self.before = (estimator.position.epoch, group["lr"])
        group["lr"] /= 2

    def epoch_rates(self, epoch):
        return [self.before[1]] if self.before is not None and self.before[0] == epoch else None


def test_declared_epoch_rates_are_the_ones_recorded():
    history = make_estimator().fit(make_batches(2), epochs=3, event_handlers=[HalvesAtEpochEnd()])
    assert history["lr"] == [0.1, 0.05, 0.025]  # the rate each epoch trained with, not the halved one


def test_without_a_declaration_the_rates_are_the_optimizers():
    est = make_estimator()

    class Est:
        handlers = (Handler(),)
        optimizer = est.optimizer
        position = est.position

    assert epoch_learning_rates(Est()) == {"lr": 0.1}
    assert learning_rate_names(3) == ["lr_group0", "lr_group1", "lr_group2"]


class StepsMySchedule(Handler, BatchEnd):
    """Steps a schedule of its own after each batch, and declares it."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def batch_end(self, estimator, **kwargs):
        self.scheduler.step()

    def stepped_schedule(self, estimator):
        return self.scheduler, "batch"


def test_a_declared_schedule_is_checked_against_the_plan():
    est = make_estimator()
    mine = StepsMySchedule(CosineAnnealingLR(est.optimizer, T_max=100))
    with pytest.warns(UserWarning, match=r"ends after 100 optimizer steps, but this fit's plan takes 6"):
        est.fit(make_batches(2), epochs=3, event_handlers=[mine])


def test_the_estimator_names_no_built_in_handler():
    """No module of estimator/ imports a handler class or tests isinstance on one: what it needs
    of a handler it reads through the contract's declarations."""
    from estimatorch import event_handlers
    handler_classes = {name for name in event_handlers.__all__ if name.endswith("Handler") or name == "SpeedMonitor"}
    found = []
    for path in sorted((PACKAGE / "estimator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "event_handlers" in node.module:
                found += [f"{path.name}: imports {a.name}" for a in node.names if a.name in handler_classes]
            if isinstance(node, ast.Name) and node.id in handler_classes:
                found.append(f"{path.name}:{node.lineno} {node.id}")
    assert not found, found
