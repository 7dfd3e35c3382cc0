"""MetricHandler: per-epoch reset and per-batch updates of the train metrics."""

from __future__ import annotations

import math

import pytest
import torch

from estimatorch.event_handlers import BatchEnd, EpochBegin, MetricHandler
from estimatorch.events import subscribes
from estimatorch.metrics import Accuracy, Loss
from tests.conftest import OpaqueMetric, make_batches, make_estimator


class Record(EpochBegin, BatchEnd):
    """Keeps every batch's loss, prediction and label, grouped by epoch."""

    priority = -10_000

    def __init__(self) -> None:
        self.epochs: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []

    def epoch_begin(self, estimator, **kwargs):
        self.epochs.append([])

    def batch_end(self, estimator, *, pred, label, loss, **kwargs):
        self.epochs[-1].append((loss.detach().clone(), pred.detach().clone(), label.clone()))


def uneven_batches():
    """Batch sizes 8, 8, 3: a mean over batches would differ from the mean over samples."""
    full = make_batches(n_batches=3, batch_size=8)
    x, y = full[2]
    return [full[0], full[1], (x[:3], y[:3])]


def hand_loss(batches):
    return sum(float(loss) * len(label) for loss, _, label in batches) / sum(len(label) for _, _, label in batches)


def hand_accuracy(batches):
    correct = sum(int((pred.argmax(1) == label).sum()) for _, pred, label in batches)
    return correct / sum(len(label) for _, _, label in batches)


# -- arguments ----------------------------------------------------------------------------------
def test_refuses_non_metrics():
    with pytest.raises(TypeError, match="metrics"):
        MetricHandler([Loss(), object()])
    with pytest.raises(TypeError, match="metrics"):
        MetricHandler("loss")


def test_accepts_one_metric_or_a_list():
    m = Loss()
    assert MetricHandler(m).metrics == [m]
    assert MetricHandler((m,)).metrics == [m]


def test_priority_runs_before_user_handlers():
    assert MetricHandler([]).priority == -1000 < 0


# -- behaviour ----------------------------------------------------------------------------------
def test_values_equal_a_hand_computation_over_each_epoch():
    est, rec = make_estimator(), Record()
    history = est.fit(uneven_batches(), epochs=3, event_handlers=[rec])
    assert len(rec.epochs) == 3
    for epoch, batches in enumerate(rec.epochs):
        # reset per epoch: each value covers that epoch's batches only
        assert history["train_loss"][epoch] == pytest.approx(hand_loss(batches), rel=1e-6)
        assert history["train_accuracy"][epoch] == pytest.approx(hand_accuracy(batches), rel=1e-12)
    # the network learns, so epochs differ: a cumulative value would not match the hand values
    assert history["train_loss"][0] != pytest.approx(history["train_loss"][2], rel=1e-6)


def test_metric_values_are_read_after_the_last_batch():
    est, rec = make_estimator(), Record()
    est.fit(uneven_batches(), epochs=2, event_handlers=[rec])
    assert est.train_metrics[0].compute() == pytest.approx(hand_loss(rec.epochs[-1]), rel=1e-6)
    assert est.train_metrics[1].compute() == pytest.approx(hand_accuracy(rec.epochs[-1]), rel=1e-12)


def test_reset_at_epoch_begin_unit():
    m = Loss()
    h = MetricHandler([m])
    h.batch_end(None, batch=None, pred=None, label=torch.zeros(2), loss=torch.tensor(3.0))
    assert m.compute() == 3.0
    h.epoch_begin(None)
    assert math.isnan(m.compute())


def test_loss_metrics_get_the_loss_others_the_predictions():
    seen = {}

    class Duck:
        name = "duck"
        higher_is_better = True

        def __init__(self, is_loss):
            self.is_loss_metric = is_loss

        def update(self, preds, target):
            seen[self.is_loss_metric] = preds

        def compute(self):
            return 0.0

        def reset(self):
            pass

    loss, pred = torch.tensor(0.25), torch.randn(2, 3)
    MetricHandler([Duck(True), Duck(False)]).batch_end(None, batch=None, pred=pred, label=torch.zeros(2), loss=loss)
    assert seen[True] is loss and seen[False] is pred


def test_user_handler_replaces_the_default_and_updates_only_its_metrics():
    est = make_estimator()
    loss_metric, acc_metric = est.train_metrics
    history = est.fit(make_batches(), epochs=1, event_handlers=[MetricHandler([loss_metric])])
    assert not math.isnan(history["train_loss"][0])
    assert math.isnan(history["train_accuracy"][0])  # never updated: no second MetricHandler ran
    assert math.isnan(acc_metric.compute())


def test_metric_the_estimator_does_not_own_is_refused_at_fit():
    est = make_estimator()
    with pytest.raises(ValueError, match="does not own"):
        est.fit(make_batches(), epochs=1, event_handlers=[MetricHandler([Accuracy("foreign")])])


# -- state and reuse ----------------------------------------------------------------------------
def test_state_is_empty_and_round_trips():
    # the accumulators are the metrics' own state, saved by the estimator
    h = MetricHandler([Loss()])
    assert h.state_dict() == {}
    fresh = MetricHandler([Loss()])
    fresh.load_state_dict(h.state_dict())
    assert fresh.state_dict() == {}
    with pytest.raises(TypeError):
        fresh.load_state_dict(None)


def test_one_instance_serves_two_fits():
    est = make_estimator()
    net0 = {k: v.clone() for k, v in est.net.state_dict().items()}
    h = MetricHandler(est.train_metrics)
    first = est.fit(uneven_batches(), epochs=2, event_handlers=[h])
    est.net.load_state_dict(net0)  # SGD without momentum has no state to reset
    second = est.fit(uneven_batches(), epochs=2, event_handlers=[h])
    assert first["train_loss"] == second["train_loss"]
    assert first["train_accuracy"] == second["train_accuracy"]


def test_no_metrics_means_no_call_per_step():
    assert not subscribes(MetricHandler([]), "batch_end")
    assert subscribes(MetricHandler(make_estimator().train_metrics), "batch_end")  # with metrics, one call


def test_under_cuda_graphs_updates_fold_at_every_batch_and_a_replay_adds_the_recorded_counts():
    class View:
        cuda_graphs = True

    loss, acc = Loss(), Accuracy()
    h = MetricHandler([loss, acc])
    assert h.capturable_batch_end
    h.train_begin(View())
    h.epoch_begin(View())
    pred, label = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1])
    h.batch_end(View(), batch=None, pred=pred, label=label, loss=torch.tensor(0.5))
    assert loss._pending == [] and acc._pending == []  # folded at once: the graph holds the fold
    replayed = h.record_batch_end(View())
    loss.total.add_(1.5)  # what a replay of the graph adds on the device
    acc.correct.add_(2), acc.label_correct.add_(2)
    replayed()
    assert (loss.count, acc.count) == (6, 6)
    assert loss.compute() == 0.5 and acc.compute() == pytest.approx(4 / 6)
    h.epoch_begin(View())  # reset in place: the recorded tensors stay the metrics' own
    replayed()
    loss.total = loss.total.clone()  # replaced, not updated in place: the graph would miss it
    with pytest.raises(RuntimeError, match="metric 'loss': its accumulator 'total' was replaced"):
        replayed()


def test_a_metric_that_is_not_capturable_keeps_the_handler_out_of_the_graph():
    class View:
        cuda_graphs = True

    h = MetricHandler([Loss(), OpaqueMetric()])
    assert not h.capturable_batch_end
    h.train_begin(View())
    loss = h.metrics[0]
    h.batch_end(View(), batch=None, pred=None, label=torch.zeros(2), loss=torch.tensor(1.0))
    assert len(loss._pending) == 1  # deferred as without a graph

    class Overrides(MetricHandler):
        def batch_end(self, estimator, **kwargs):
            super().batch_end(estimator, **kwargs)

    assert not Overrides([Loss()]).capturable_batch_end


def test_a_subclass_overriding_train_begin_stays_out_of_the_graph():
    """train_begin chooses to fold each update at once: a subclass replacing it (without super)
    would be held with deferred updates a graph cannot replay, so it must declare itself."""
    class View:
        cuda_graphs = True

    class NoSuper(MetricHandler):
        def train_begin(self, estimator, **kwargs):
            pass

    assert not NoSuper([Loss()]).capturable_batch_end
    h = MetricHandler([Loss()])  # held, but its train_begin never ran: an error, not wrong metrics
    with pytest.raises(RuntimeError, match="without folding its updates at once"):
        h.record_batch_end(View())
