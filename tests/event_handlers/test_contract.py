"""The contract every exported handler keeps: it can be constructed, serve two fits alike (one
instance fits twice from the same start: a fresh fit starts fresh), round-trip its state, and
behave after a resume exactly as in an uninterrupted run (a resume continues).

A new handler must be added to FACTORIES: ``test_every_exported_handler_is_covered`` fails until
it is. Options that change which events a handler listens to, or what it keeps between fits, get
their own entry (``"Name[variant]"``).
"""

from __future__ import annotations

import inspect
import io
import shutil

import pytest
import torch
from torch import nn

import estimatorch.event_handlers as eh
from estimatorch import Estimator
from estimatorch.events import Dispatch
from estimatorch.statistics import ActivationStatistics, EpochGradientNorm, GradientNorm, Throughput
from tests.conftest import CtrlC, make_batches

# CheckpointHandler here saves every 3 batches with save_best on a val metric, so its first saves
# come before any validation: the warning it gives then is expected (tested in its own tests).
pytestmark = pytest.mark.filterwarnings("ignore:CheckpointHandler.*is nan:UserWarning")

EPOCHS, N_BATCHES = 3, 5
STOP_AT = 7  # mid second epoch


class Recorder:
    """A writer for MeterHandler: records what it is given."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, step))

    def add_histogram(self, tag, values, step):
        self.scalars.append((tag, step))


def _estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=opt,
                     lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9), seed=1)


VAL = make_batches(n_batches=2, seed=5)

def _plateau(est):
    """ReduceLROnPlateau on the loss in mode max (a falling loss): it reduces the rate at every
    epoch but the first, so a watch kept from an earlier fit (its best value) changes the run."""
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(est.optimizer, mode="max", factor=0.5, patience=0)
    return eh.LRSchedulerHandler(scheduler, monitor=est.val_metrics[0])


def _wandb(est, d):
    """Offline, silent, no console capture: W&B writes only files under ``d``."""
    import wandb  # a dev dependency, needed only by this entry

    settings = wandb.Settings(mode="offline", silent=True, console="off", x_disable_stats=True)
    return eh.WandbHandler(project="contract", log_interval=2, dir=str(d), settings=settings)


# name -> factory(estimator, directory) -> handler. Each handler is built on the estimator whose
# metrics it refers to.
FACTORIES = {
    "StoppingHandler": lambda est, d: eh.StoppingHandler(max_epoch=EPOCHS),
    "MetricHandler": lambda est, d: eh.MetricHandler(est.train_metrics),
    "ValidationHandler": lambda est, d: eh.ValidationHandler(VAL, est.evaluate, epoch_period=1, batch_period=4),
    "ValidationHandler[epochs]": lambda est, d: eh.ValidationHandler(VAL, est.evaluate, epoch_period=2),
    "ValidationHandler[batches]": lambda est, d: eh.ValidationHandler(VAL, est.evaluate, epoch_period=None,
                                                                      batch_period=3),
    "LoggingHandler": lambda est, d: eh.LoggingHandler(log_interval=2, log_dir=d / "logs"),
    "LoggingHandler[epoch]": lambda est, d: eh.LoggingHandler(log_dir=d / "logs"),
    "GradientUpdateHandler": lambda est, d: eh.GradientUpdateHandler(accumulation_steps=2, clip_grad_norm=1.0),
    # mode="max" on a falling loss: the best epoch is the first, before the resume point, so a
    # resume that lost the best value or weights shows
    "EarlyStoppingHandler": lambda est, d: eh.EarlyStoppingHandler(est.val_metrics[0], mode="max", patience=5,
                                                                   restore_best_weights=True),
    # a baseline never beaten, after a warm-up epoch: the best epoch is still restored
    "EarlyStoppingHandler[baseline]": lambda est, d: eh.EarlyStoppingHandler(
        est.val_metrics[0], baseline=1e-6, patience=5, restore_best_weights=True, start_from_epoch=1),
    "LambdaHandler": lambda est, d: eh.LambdaHandler(batch_end=lambda e, **kw: None, every=3),
    # counters that a resume must bring back: the warm-up's updates, a period, a start step
    "EMAHandler": lambda est, d: eh.EMAHandler(0.9, update_every=2, start_step=3, warmup=True),
    "EMAHandler[raw]": lambda est, d: eh.EMAHandler(0.9, evaluate=False, final="raw"),
    "SWAHandler": lambda est, d: eh.SWAHandler(swa_start=1),
    "LRSchedulerHandler": lambda est, d: eh.LRSchedulerHandler(),
    "LRSchedulerHandler[plateau]": lambda est, d: _plateau(est),
    "CheckpointHandler": lambda est, d: eh.CheckpointHandler(d / "ckpt", batch_period=3, save_best=True,
                                                             monitor=est.val_metrics[0]),
    "ProfilerHandler": lambda est, d: eh.ProfilerHandler(d / "profile", wait=1, warmup=1, active=2, repeat=0),
    "ProgressBarHandler": lambda est, d: eh.ProgressBarHandler(file=io.StringIO()),
    "TensorBoardHandler": lambda est, d: eh.TensorBoardHandler(d / "tb", log_interval=2),
    "TerminateOnNaNHandler": lambda est, d: eh.TerminateOnNaNHandler(check_every=2, monitor=[est.train_metrics[0]]),
    "TerminateOnNaNHandler[raise]": lambda est, d: eh.TerminateOnNaNHandler(check_every=3, raise_error=True),
    "CSVLoggerHandler": lambda est, d: eh.CSVLoggerHandler(d / "log.csv"),
    # MLflow keeps a store open per URI for the whole process (a database deleted under it turns
    # read-only): the database lies beside d, out of _clear's reach
    "MLflowHandler": lambda est, d: eh.MLflowHandler(f"sqlite:///{d}.mlflow.db", experiment_name="contract",
                                                     log_interval=2, artifact_location=str(d / "artifacts")),
    "WandbHandler": _wandb,
    "MeterHandler": lambda est, d: eh.MeterHandler([GradientNorm(period=2), Throughput(), EpochGradientNorm(),
                                                    ActivationStatistics(["0"], period=3)], writer=Recorder()),
}
#: state keys that name this run's files (a new run writes new ones) or hold wall-clock time:
#: left out of comparisons
UNREPEATABLE = {"run_id", "seconds"}


def _comparable(state):
    if isinstance(state, dict):
        return {k: _comparable(v) for k, v in state.items() if k not in UNREPEATABLE}
    if isinstance(state, (list, tuple)):
        return [_comparable(v) for v in state]
    if isinstance(state, torch.Tensor):
        return ("tensor", state.dtype, tuple(state.shape), state.detach().cpu().flatten().tolist())
    return state


def _fit(est, handler, **kwargs):
    return est.fit(make_batches(n_batches=N_BATCHES), val_data=VAL, epochs=EPOCHS, event_handlers=[handler], **kwargs)


def test_every_exported_handler_is_covered():
    exported = {name for name in eh.__all__
                if inspect.isclass(getattr(eh, name)) and name.endswith("Handler") and name != "StatefulHandler"}
    assert exported == {name.split("[")[0] for name in FACTORIES}


def _clear(directory):
    """A second run in a fresh directory: nothing the first one wrote is in its way."""
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_construct_and_subscribe(name, tmp_path):
    """As its factory builds it, the handler listens to some event of a fit (``listens_to`` does
    not leave it deaf with these options), under a name of its own."""
    handler = FACTORIES[name](_estimator(), tmp_path)
    dispatch = Dispatch([handler])
    assert [event for event in eh.EVENTS if getattr(dispatch, event)], f"{name} listens to no event"
    assert dispatch.by_name == {handler.name: handler}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_one_instance_serves_two_fits_alike(name, tmp_path):
    est = _estimator()
    start = [{k: v.clone() for k, v in est.net.state_dict().items()},
             est.optimizer.state_dict(), est.lr_scheduler.state_dict()]
    handler = FACTORIES[name](est, tmp_path)
    history = _fit(est, handler).to_dict()
    state = _comparable(handler.state_dict())
    _clear(tmp_path)
    est.net.load_state_dict(start[0])  # the same start: the handler must bring nothing over
    est.optimizer.load_state_dict(start[1])
    est.lr_scheduler.load_state_dict(start[2])
    assert _fit(est, handler).to_dict() == history
    assert _comparable(handler.state_dict()) == state


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_round_trips(name, tmp_path):
    est = _estimator()
    handler = FACTORIES[name](est, tmp_path)
    _fit(est, handler)
    state = handler.state_dict()
    fresh = FACTORIES[name](est, tmp_path / "fresh")
    fresh.load_state_dict(state)
    assert _comparable(fresh.state_dict()) == _comparable(state)
    if state:
        missing = dict(state)
        missing.pop(sorted(missing)[0])
        with pytest.raises(ValueError, match="missing the key"):
            FACTORIES[name](est, tmp_path / "other").load_state_dict(missing)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_behaves_after_a_resume_as_without_one(name, tmp_path):
    whole_est = _estimator()
    whole = FACTORIES[name](whole_est, tmp_path / "whole")
    whole_history = _fit(whole_est, whole).to_dict()

    est = _estimator()
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(n_batches=N_BATCHES), val_data=VAL, epochs=EPOCHS,
                event_handlers=[FACTORIES[name](est, tmp_path / "parts"), CtrlC(STOP_AT)])
    assert est.position.step == STOP_AT
    resumed = FACTORIES[name](est, tmp_path / "parts")  # a new instance, as a new process would have
    resumed_history = _fit(est, resumed, resume=True).to_dict()

    assert resumed_history == whole_history
    for key, value in whole_est.net.state_dict().items():
        assert torch.equal(value, est.net.state_dict()[key]), key
    assert _comparable(resumed.state_dict()) == _comparable(whole.state_dict())
