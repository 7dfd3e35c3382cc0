"""BatchProcessor's contract with the estimator (``StepEstimator``): the public question of who
listens (``estimator.dispatch``), and a processor written against the old private one still
working, with a DeprecationWarning."""

from __future__ import annotations

import warnings

import pytest
import torch

from estimatorch.estimator import BatchProcessor
from estimatorch.events import ForwardEnd
from tests.conftest import make_batches, make_estimator


class Heard(ForwardEnd):
    def __init__(self):
        self.n = 0

    def forward_end(self, estimator, **kwargs):
        self.n += 1


class OldStyle(BatchProcessor):
    """A processor of the kind users wrote before ``dispatch`` was public."""

    def fit_batch(self, estimator, batch, batch_axis=0):
        x, y = batch
        with estimator.autocast():
            pred = estimator.train_net(x)
            loss = estimator.loss(pred, y)
        if estimator._dispatch.forward_end:
            estimator.fire("forward_end", batch=batch, pred=pred, loss=loss)
        estimator.backward(loss)
        return x, y, pred, loss


def test_an_old_processor_reading_the_private_dispatch_works_and_is_warned():
    est, heard = make_estimator(batch_processor=OldStyle()), Heard()
    with pytest.warns(DeprecationWarning, match=r"Estimator._dispatch is deprecated: read Estimator.dispatch"):
        est.fit(make_batches(3), epochs=1, event_handlers=[heard])
    assert heard.n == 3


def test_the_built_in_processor_asks_the_public_dispatch():
    est, heard = make_estimator(), Heard()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        est.fit(make_batches(3), epochs=1, event_handlers=[heard])
    assert heard.n == 3 and len(est.dispatch.forward_end) == 0  # (outside fit: no lists)


def test_dispatch_lists_only_the_listeners_during_fit():
    seen = []

    class Peek(ForwardEnd):
        def forward_end(self, estimator, **kwargs):
            seen.append((len(estimator.dispatch.forward_end), len(estimator.dispatch.backward_begin)))

    make_estimator().fit(make_batches(1), epochs=1, event_handlers=[Peek()])
    assert seen == [(1, 0)]


def test_the_default_optimizer_warning_comes_once_per_estimator():
    net = torch.nn.Linear(4, 3)
    from estimatorch import Estimator
    est = Estimator(net, torch.nn.CrossEntropyLoss())
    with pytest.raises(ValueError):  # a fit refused before it starts does not spend the warning
        est.fit(make_batches(1), epochs=None)
    with pytest.warns(UserWarning, match="no optimizer given to Estimator"):
        est.fit(make_batches(1), epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.fit(make_batches(1), epochs=1)
