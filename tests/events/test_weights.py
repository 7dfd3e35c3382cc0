"""``Handler.evaluation_weights``, read through ``events.evaluation_weights``: a handler of one's
own puts other weights into the net for every evaluation during ``fit`` (not outside it), the
log line names them, and the net has its own weights back afterwards."""

from __future__ import annotations

import contextlib

import torch

from estimatorch.events import Handler, TrainBegin, declared, evaluation_weights
from tests.conftest import make_batches, make_estimator


class Zeroed(Handler, TrainBegin):
    """Evaluates a net whose last layer's bias is zero (its own bias back after)."""

    def __init__(self):
        self.entered = 0

    def train_begin(self, estimator, **kwargs):
        self.bias = estimator.net[2].bias

    @contextlib.contextmanager
    def _zeroed(self):
        self.entered += 1
        held = self.bias.detach().clone()
        with torch.no_grad():
            self.bias.zero_()
        try:
            yield "zero-bias"
        finally:
            with torch.no_grad():
                self.bias.copy_(held)

    def evaluation_weights(self, estimator):
        return self._zeroed()


def test_a_handlers_weights_are_evaluated_during_fit_and_named_in_the_log(estimatorch_log):
    data, val = make_batches(), make_batches(2, seed=3)
    est, zeroed = make_estimator(), Zeroed()
    history = est.fit(data, val, epochs=2, event_handlers=[zeroed])
    assert zeroed.entered == 2 and est.net[2].bias.abs().sum() > 0  # its own bias back
    own = est.evaluate(val)["val_loss"]  # outside fit: the net's own weights
    with torch.no_grad():
        est.net[2].bias.zero_()
    assert history["val_loss"][-1] == est.evaluate(val)["val_loss"] != own
    lines = [r.getMessage() for r in estimatorch_log if r.getMessage().startswith("[Epoch")]
    assert all(line.count("(val on the zero-bias weights)") == 1 for line in lines) and len(lines) == 2


def test_without_a_fit_or_a_declaration_the_net_keeps_its_own_weights():
    class View:
        handlers = (TrainBegin(),)

    assert declared(TrainBegin(), "evaluation_weights")(View()) is None
    assert declared(TrainBegin(), "check_state_dict")({"any": 1}) is None
    with evaluation_weights(View()) as name:
        assert name is None
