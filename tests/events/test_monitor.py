"""Monitors by name: EarlyStoppingHandler, CheckpointHandler and LRSchedulerHandler take a
metric's name, resolved to the estimator's metric of that name at fit start."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from estimatorch import CheckpointHandler, EarlyStoppingHandler, Estimator, LRSchedulerHandler
from estimatorch.events.monitor import resolve_monitors
from estimatorch.metrics import Loss


def make_estimator():
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def test_every_monitoring_handler_resolves_a_name_to_the_estimators_metric(tmp_path):
    est = make_estimator()
    val_loss = next(m for m in est.val_metrics if m.name == "val_loss")
    plateau = ReduceLROnPlateau(est.optimizer)
    handlers = [EarlyStoppingHandler("val_loss", patience=5), LRSchedulerHandler(plateau, monitor="val_loss"),
                CheckpointHandler(tmp_path, monitor="val_accuracy", save_best=True)]
    assert handlers[0].mode == "auto"  # the name says nothing of the direction until it is resolved
    est.fit(batches(3), val_data=batches(2), epochs=2, event_handlers=handlers)
    assert handlers[0].monitor is val_loss and handlers[0].mode == "min"
    assert handlers[1].monitor is val_loss
    assert handlers[2].monitor.name == "val_accuracy" and handlers[2].mode == "max"
    assert (tmp_path / "model-best.pt").exists()


def test_an_unknown_name_is_an_error_at_fit_start_listing_the_names_there_are():
    est = make_estimator()
    before = [p.clone() for p in est.net.parameters()]
    with pytest.raises(ValueError, match=r"monitor 'val_los' is not a metric of this estimator.*'val_loss'"):
        est.fit(batches(2), epochs=1, event_handlers=[EarlyStoppingHandler("val_los")])
    with pytest.raises(ValueError, match=r"prefix: val_loss\?"):
        est.fit(batches(2), epochs=1, event_handlers=[EarlyStoppingHandler("loss")])
    assert all(torch.equal(a, b) for a, b in zip(before, est.net.parameters()))


def test_a_metric_object_still_works_and_a_handler_reresolves_its_name_each_fit():
    first, second = make_estimator(), make_estimator()
    handler = EarlyStoppingHandler("val_loss", patience=5)
    first.fit(batches(2), val_data=batches(1), epochs=1, event_handlers=[handler])
    assert handler.monitor is next(m for m in first.val_metrics if m.name == "val_loss")
    second.fit(batches(2), val_data=batches(1), epochs=1, event_handlers=[handler])
    assert handler.monitor is next(m for m in second.val_metrics if m.name == "val_loss")
    by_object = EarlyStoppingHandler(second.val_metrics[0], patience=5)
    second.fit(batches(2), val_data=batches(1), epochs=1, event_handlers=[by_object])
    assert by_object.monitor is second.val_metrics[0]


def test_resolve_monitors_leaves_handlers_without_a_name_alone():
    metric = Loss(name="val_loss")
    handler = EarlyStoppingHandler(metric)
    resolve_monitors([handler, object()], [metric])
    assert handler.monitor is metric
