"""SWAHandler: the same run as torch's ``swa_utils`` recipe (AveragedModel from a start epoch,
SWALR, ``update_bn`` at the end) gives the same bits; validation uses the average once it has
begun; a resume continues the average and its schedule exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from estimatorch import Estimator, SWAHandler
from estimatorch.event_handlers import EpochEnd
from tests.conftest import CtrlC, assert_tree_equal, losses_recorder, make_batches

EPOCHS, N_BATCHES, START = 4, 5, 1
DATA = make_batches(n_batches=N_BATCHES)
VAL = make_batches(n_batches=2, seed=5)
BN_DATA = make_batches(n_batches=3, seed=7)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_the_module():
    """The module's shared reference runs use one thread, as each test does (conftest's
    ``_one_thread``, which is set up after module fixtures): the bits depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _estimator(**kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=1,
                     **kwargs)


class TorchRecipe(EpochEnd):
    """torch's example loop at each epoch's end: from ``START`` on, update the AveragedModel, then
    step SWALR."""

    priority = -1500

    def __init__(self, est):
        self.model = AveragedModel(copy.deepcopy(est.net))
        self.scheduler = SWALR(est.optimizer, swa_lr=0.05, anneal_epochs=2)

    def epoch_end(self, est, **kw):
        if est.position.epoch >= START:
            self.model.update_parameters(est.net)
            self.scheduler.step()


def _run(handler_of):
    est = _estimator()
    losses, recorder = losses_recorder()
    handler = handler_of(est)
    history = est.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[handler, recorder])
    return est, handler, history.to_dict(), losses


@pytest.fixture(scope="module")
def runs():
    ours = _run(lambda est: SWAHandler(swa_start=START, swa_lr=0.05, anneal_epochs=2, bn_data=BN_DATA))
    torchs = _run(TorchRecipe)
    update_bn(BN_DATA, torchs[1].model)
    return ours, torchs


def test_the_run_is_torchs_swa_recipe_bit_for_bit(runs):
    (est, swa, history, losses), (torch_est, recipe, torch_history, torch_losses) = runs
    assert losses == torch_losses  # the same rates: SWALR stepped alike
    # the rates each epoch trained with; torch's run records the rate after SWALR stepped at its end
    assert history["lr"][1:] == torch_history["lr"][:-1] and history["lr"][-1] == 0.05
    assert swa.updates == EPOCHS - START == int(recipe.model.n_averaged)
    # the average's parameters and its BatchNorm statistics (update_bn), in the net
    assert_tree_equal(est.net.state_dict(), recipe.model.module.state_dict(), "average")
    assert_tree_equal(swa.raw_state_dict(), torch_est.net.state_dict(), "trained weights")


def test_validation_uses_the_average_once_it_has_begun(runs):
    (_, _, history, _), (_, _, torch_history, _) = runs
    # none yet, then the first, a copy of the weights: the net's own values
    assert history["val_loss"][:START + 1] == torch_history["val_loss"][:START + 1]
    assert all(a != b for a, b in zip(history["val_loss"][START + 1:], torch_history["val_loss"][START + 1:]))


def test_a_resume_continues_the_average_and_its_schedule(runs):
    (est, _, history, losses), _ = runs
    stopped = _estimator()
    handler = lambda: SWAHandler(swa_start=START, swa_lr=0.05, anneal_epochs=2, bn_data=BN_DATA)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        stopped.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[handler(), CtrlC(2 * N_BATCHES + 2)])
    resumed, recorder = losses_recorder()
    again = stopped.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[handler(), recorder], resume=True)
    assert resumed == losses[2 * N_BATCHES + 2:] and again.to_dict() == history
    assert_tree_equal(stopped.net.state_dict(), est.net.state_dict(), "average")


def test_bad_arguments_are_refused_naming_them():
    for kwargs, message in [({"swa_start": -1}, "swa_start must be a non-negative int, got -1"),
                            ({"swa_start": 0, "swa_lr": -1.0}, "swa_lr must be a non-negative number"),
                            ({"swa_start": 0, "anneal_strategy": "step"}, "anneal_strategy must be 'cos' or 'linear'"),
                            ({"swa_start": 0, "anneal_epochs": -2}, "anneal_epochs must be a non-negative int")]:
        with pytest.raises(ValueError, match=message):
            SWAHandler(**kwargs)
    with pytest.raises(TypeError, match="bn_data must be a re-iterable"):
        SWAHandler(0, bn_data=iter(BN_DATA))
    est = _estimator()
    est.lr_scheduler = torch.optim.lr_scheduler.StepLR(est.optimizer, 1)
    with pytest.raises(ValueError, match="SWAHandler\\(swa_lr=...\\) steps SWALR, and the estimator has an lr_scheduler"):
        est.fit(DATA, epochs=1, event_handlers=[SWAHandler(0, swa_lr=0.05)])


def test_resume_after_a_finished_fit_trains_on_from_the_trained_weights_and_statistics(runs):
    (est, _, history, _), _ = runs
    swa = SWAHandler(swa_start=START, swa_lr=0.05, anneal_epochs=2, bn_data=BN_DATA)
    short = _estimator()
    short.fit(DATA, VAL, epochs=EPOCHS - 1, event_handlers=[swa])  # its end recomputed the BatchNorm statistics
    longer = short.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[swa], resume=True)
    assert longer.to_dict() == history
    assert_tree_equal(short.net.state_dict(), est.net.state_dict(), "average")
