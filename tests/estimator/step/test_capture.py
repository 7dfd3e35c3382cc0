"""``Estimator(..., cuda_graphs=True)``: the decisions to capture or refuse, taken on the CPU
(the captured step itself is tested on a GPU in tests/test_cuda_graphs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from estimatorch import Estimator
from estimatorch.metrics import Loss
from tests.conftest import OpaqueMetric
from estimatorch.estimator._step.capture import (
    CaptureConfig,
    capture_error,
    capture_refusal,
    check_capture,
    fallback_message,
    in_graph,
)
from estimatorch.event_handlers import (
    BackwardEnd,
    BatchEnd,
    ForwardBegin,
    GradientUpdateHandler,
    LoggingHandler,
    MetricHandler,
    StoppingHandler,
)

CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU


def _adam():
    return torch.optim.Adam(nn.Linear(3, 2).parameters(), lr=1e-3)


def _handlers(*extra):
    return [GradientUpdateHandler(), MetricHandler([]), StoppingHandler(), *extra, LoggingHandler()]


def _config(**changes):
    fields = dict(device=CUDA, precision="32", optimizer=_adam(), world_size=1, strategy=None,
                  handlers=_handlers())
    fields.update(changes)
    return CaptureConfig(**fields)


class InsideStep(ForwardBegin):
    def forward_begin(self, estimator, **kwargs):
        pass


class AfterBackward(BackwardEnd):
    def backward_end(self, estimator, **kwargs):
        pass


class EarlyBatchEnd(BatchEnd):
    priority = -3000

    def batch_end(self, estimator, **kwargs):
        pass


class LateBatchEnd(BatchEnd):
    def batch_end(self, estimator, **kwargs):
        pass


class OwnUpdate(GradientUpdateHandler):
    def batch_end(self, estimator, **kwargs):  # its own step: the graph cannot know it holds
        super().batch_end(estimator, **kwargs)


class Subclassed(GradientUpdateHandler):
    """A subclass that keeps GradientUpdateHandler's batch_end: still capturable."""


class CapturableEarly(BatchEnd):
    """A third-party handler ranked before the optimizer step that declares its batch_end
    capturable (device work only): recorded in the graph with it."""

    priority = -3000
    capturable_batch_end = True

    def batch_end(self, estimator, **kwargs):
        pass


class OwnStepper(BatchEnd):
    """A third-party optimizer stepper, through the contract's declarations only."""

    priority = -2000
    accumulation_steps = 1

    def __init__(self, capturable):
        self.capturable_batch_end = capturable

    def batch_end(self, estimator, **kwargs):
        estimator.optimizer.step()


def test_a_plain_configuration_is_captured():
    assert capture_refusal(_config()) is None
    assert capture_refusal(_config(precision="bf16-mixed")) is None
    assert capture_refusal(_config(handlers=_handlers(LateBatchEnd()))) is None  # runs after the graph
    clipped = [GradientUpdateHandler(clip_grad_norm=1.0), StoppingHandler()]
    assert capture_refusal(_config(handlers=clipped)) is None
    adamw = torch.optim.AdamW(nn.Linear(3, 2).parameters())
    assert capture_refusal(_config(optimizer=adamw)) is None


@pytest.mark.parametrize("changes, words", [
    (dict(device=torch.device("cpu")), "needs a CUDA device and this estimator trains on cpu"),
    (dict(world_size=2), "under torch.distributed (2 processes)"),
    (dict(world_size=2, strategy="ddp"), "TORCH_NCCL_ASYNC_ERROR_HANDLING=0"),
    (dict(world_size=4, strategy="fsdp"), "FSDP (strategy='fsdp', 4 processes)"),
    (dict(precision="16-mixed"), "GradScaler"),
    (dict(optimizer=torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)), "SGD has no capturable mode"),
    (dict(handlers=[StoppingHandler(), LoggingHandler()]), "no handler steps the optimizer at batch_end"),
    (dict(handlers=[OwnUpdate()]), "stepped by OwnUpdate (OwnUpdate), whose batch_end does not declare"),
    (dict(handlers=[OwnStepper(capturable=False)]), "stepped by OwnStepper"),
    (dict(handlers=[GradientUpdateHandler(accumulation_steps=4)]), "accumulation_steps=4"),
    (dict(handlers=_handlers(InsideStep())), "InsideStep listens to forward_begin"),
    (dict(handlers=_handlers(AfterBackward())), "AfterBackward listens to backward_end"),
    (dict(handlers=[EarlyBatchEnd(), *_handlers()]), "EarlyBatchEnd (priority -3000) runs at batch_end before "
                                                      "GradientUpdateHandler's optimizer step"),
])
def test_each_configuration_a_graph_cannot_hold_is_refused_with_its_reason(changes, words):
    reason = capture_refusal(_config(**changes))
    assert reason is not None and words in reason


def test_the_graph_holds_the_capturable_batch_end_listeners_up_to_the_first_that_is_not():
    early, update, metrics, late = CapturableEarly(), GradientUpdateHandler(), MetricHandler([Loss()]), LateBatchEnd()
    handlers = [early, update, metrics, StoppingHandler(), late, LoggingHandler()]
    assert capture_refusal(_config(handlers=handlers)) is None
    held = in_graph(handlers)
    assert held[:3] == [early, update, metrics] and late not in held
    # a metric that is not capturable keeps MetricHandler (and all after it) out of the graph
    assert in_graph([update, MetricHandler([Loss(), OpaqueMetric()]), late]) == [update]
    # a subclass keeping GradientUpdateHandler's batch_end, and a third-party stepper declaring it
    assert capture_refusal(_config(handlers=[Subclassed(), StoppingHandler()])) is None
    assert capture_refusal(_config(handlers=[OwnStepper(capturable=True)])) is None
    assert in_graph([OwnStepper(capturable=True)])[0].accumulation_steps == 1


def test_the_device_is_checked_first():
    config = _config(device=torch.device("cpu"), precision="16-mixed", world_size=2)
    assert capture_refusal(config).startswith("it needs a CUDA device")


def test_check_capture_raises_naming_cuda_graphs_only_when_asked():
    estimator = SimpleNamespace(device=CUDA, precision="16-mixed", optimizer=_adam(), strategy=None,
                                cuda_graphs=False, lr_scheduler=None)
    check_capture(estimator, _handlers(), 1)  # not asked: nothing to decide
    estimator.cuda_graphs = True
    with pytest.raises(ValueError, match=r"^cuda_graphs=True cannot capture this fit's train step: .*GradScaler"):
        check_capture(estimator, _handlers(), 1)
    estimator.precision = "bf16-mixed"
    check_capture(estimator, _handlers(), 1)


def test_fit_on_the_cpu_refuses_cuda_graphs_before_any_work():
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    before = [p.detach().clone() for p in net.parameters()]
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), cuda_graphs=True)
    assert est.cuda_graphs is True
    read = []

    class Data:
        def __iter__(self):
            read.append(1)
            yield torch.randn(8, 4), torch.randint(0, 2, (8,))

    with pytest.raises(ValueError, match="cuda_graphs=True .* needs a CUDA device and this estimator trains on cpu"):
        est.fit([(torch.randn(8, 4), torch.randint(0, 2, (8,)))], epochs=1)
    with pytest.raises(ValueError, match="cuda_graphs=True"):
        est.fit(Data(), epochs=1)
    assert read == []
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert est.optimizer.state == {}


def test_cuda_graphs_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graphs must be a bool, got 'yes'"):
        Estimator(nn.Linear(4, 2), nn.MSELoss(), cuda_graphs="yes")


def test_cuda_graphs_off_changes_nothing():
    net = nn.Linear(4, 2)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert est.cuda_graphs is False
    est.fit([(torch.randn(8, 4), torch.randint(0, 2, (8,)))], epochs=1, event_handlers=[InsideStep()])


def test_the_fallback_warning_names_where_the_step_synchronised_and_the_usual_causes():
    message = fallback_message("at model.py:12")
    assert message.startswith("cuda_graphs=True: the train step makes a synchronising CUDA call (at model.py:12)")
    assert ".item()" in message and "trains eagerly" in message


def test_a_refused_capture_s_error_names_the_cause_capture_end_masks():
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904 - as torch does
    except RuntimeError as err:
        masking = err
    error = capture_error(masking)
    assert isinstance(error, RuntimeError)
    assert "(RuntimeError: operation not permitted when stream is capturing)" in str(error)
    assert "train with cuda_graphs=False" in str(error)
    assert "(RuntimeError: boom)" in str(capture_error(RuntimeError("boom")))  # nothing masked


def test_a_schedule_cycling_the_momentum_is_refused_and_one_of_the_rate_alone_accepted():
    optimizer = _adam()
    cycling = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    reason = capture_refusal(_config(optimizer=optimizer, scheduler=cycling))
    assert reason is not None and "OneCycleLR cycles the optimizer's momentum" in reason
    assert "cycle_momentum=False" in reason
    optimizer = _adam()
    rate_only = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10, cycle_momentum=False)
    assert capture_refusal(_config(optimizer=optimizer, scheduler=rate_only)) is None
    optimizer = _adam()
    assert capture_refusal(_config(optimizer=optimizer,
                                   scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 3))) is None
