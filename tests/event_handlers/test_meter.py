"""MeterHandler: statistics driven by the loop's events, hooks only on firing steps."""

from __future__ import annotations

import signal
from collections import defaultdict

import pytest
import torch
from torch import nn

from estimatorch import Estimator
from estimatorch.event_handlers import (
    LambdaHandler,
    MeterHandler,
    TensorBoardHandler,
)
from estimatorch.events import subscribes
from estimatorch.statistics import (
    ActivationStatistics,
    EpochGradientNorm,
    GradientFlow,
    GradientNorm,
    LearningRate,
    Throughput,
    UpdateToWeightRatio,
    WeightNorm,
)
from tests.conftest import make_batches, make_estimator

N_BATCHES = 4  # per epoch


class Recorder:
    """A writer that keeps what it is given: ``scalars[tag] == [(step, value), ...]``."""

    def __init__(self):
        self.scalars = defaultdict(list)
        self.hists = defaultdict(list)
        self.closed = 0

    def add_scalar(self, tag, value, step):
        assert isinstance(value, float)
        self.scalars[tag].append((step, value))

    def add_histogram(self, tag, values, step):
        self.hists[tag].append((step, values))

    def close(self):
        self.closed += 1


def hooks_of(net):
    """Every module hook of ``net``, whatever its kind."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return sum(len(getattr(m, k)) for m in net.modules() for k in kinds)


def fit(est, statistics, handlers=(), epochs=3, **kwargs):
    rec = Recorder()
    est.fit(make_batches(N_BATCHES), epochs=epochs, event_handlers=[MeterHandler(statistics, writer=rec), *handlers],
            **kwargs)
    return rec


# -- callback-free, instantaneous -----------------------------------------------------------
def test_instantaneous_statistics_fire_every_period_from_start():
    est = make_estimator()
    norms = []
    probe = LambdaHandler(batch_end=lambda e, **kw: norms.append(
        {n: torch.linalg.vector_norm(p.detach()).item() for n, p in e.net.named_parameters()}))
    rec = fit(est, [WeightNorm(period=3, start=4)], [probe])
    steps = [6, 9, 12]
    for name, _ in est.net.named_parameters():
        assert rec.scalars[f"weight_norm/{name}"] == [(s, pytest.approx(norms[s - 1][name], rel=1e-6)) for s in steps]


def test_gradient_norm_is_read_after_backward_before_the_step():
    est = make_estimator()
    grads = []
    probe = LambdaHandler(backward_end=lambda e, **kw: grads.append(
        {n: torch.linalg.vector_norm(p.grad).item() for n, p in e.net.named_parameters()}), every=2)
    rec = fit(est, [GradientNorm(period=2)], [probe], epochs=1)
    for i, step in enumerate([2, 4]):
        for name, value in grads[i].items():
            assert rec.scalars[f"gradient_norm/{name}"][i] == (step, pytest.approx(value, rel=1e-6))
        total = sum(v ** 2 for v in grads[i].values()) ** 0.5
        assert rec.scalars["gradient_norm/total"][i] == (step, pytest.approx(total, rel=1e-6))


def test_update_to_weight_ratio_compares_the_weights_around_the_step():
    est = make_estimator()
    before, ratios = {}, []

    def snapshot(e, **kw):
        before.update({n: p.detach().clone() for n, p in e.net.named_parameters()})

    def compare(e, **kw):
        ratios.append({n: (torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])).item()
                       for n, p in e.net.named_parameters()})

    probes = [LambdaHandler(batch_begin=snapshot, every=2), LambdaHandler(batch_end=compare, every=2)]
    rec = fit(est, [UpdateToWeightRatio(period=2)], probes, epochs=1)
    for name in before:
        assert rec.scalars[f"update_ratio/{name}"] == [(2, pytest.approx(ratios[0][name], rel=1e-5)),
                                                       (4, pytest.approx(ratios[1][name], rel=1e-5))]
        assert all(0 < v < 1 for _, v in rec.scalars[f"update_ratio/{name}"])


def test_learning_rate_per_param_group():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD([{"params": net[0].parameters(), "lr": 0.1}, {"params": net[2].parameters(), "lr": 0.02}])
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt)
    rec = fit(est, [LearningRate(period=N_BATCHES)], epochs=2)
    assert rec.scalars["lr/group0"] == [(4, 0.1), (8, 0.1)]
    assert rec.scalars["lr/group1"] == [(4, 0.02), (8, 0.02)]


# -- running --------------------------------------------------------------------------------
def test_running_statistics_are_written_per_epoch_under_epoch():
    est = make_estimator()
    totals = []
    probe = LambdaHandler(backward_end=lambda e, **kw: totals.append(torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in e.net.parameters()])).item()))
    rec = fit(est, [Throughput(), EpochGradientNorm()], [probe])
    assert [s for s, _ in rec.scalars["epoch/throughput"]] == [1, 2, 3]
    assert all(v > 0 for _, v in rec.scalars["epoch/throughput"])
    per_epoch = [totals[i:i + N_BATCHES] for i in range(0, len(totals), N_BATCHES)]
    assert rec.scalars["epoch/epoch_gradient_norm/mean"] == [
        (e + 1, pytest.approx(sum(v) / len(v), rel=1e-9)) for e, v in enumerate(per_epoch)]
    assert rec.scalars["epoch/epoch_gradient_norm/max"] == [
        (e + 1, pytest.approx(max(v), rel=1e-9)) for e, v in enumerate(per_epoch)]


def test_running_accumulators_resume_where_they_stopped():
    reference = fit(make_estimator(), [EpochGradientNorm()]).scalars
    est = make_estimator()
    rec = Recorder()
    handlers = [MeterHandler([EpochGradientNorm()], writer=rec),
                LambdaHandler(batch_end=lambda e, **kw: signal.raise_signal(signal.SIGINT), once=6)]
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=handlers)
    est.fit(make_batches(N_BATCHES), epochs=3, event_handlers=handlers, resume=True)
    assert rec.scalars == reference  # epoch 2, cut at its second batch, accumulated whole


def test_throughput_counts_an_interrupted_epoch_whole():
    est = make_estimator()
    stat = Throughput()
    seen = []
    handlers = [MeterHandler([stat], writer=Recorder()),
                LambdaHandler(batch_end=lambda e, **kw: signal.raise_signal(signal.SIGINT), once=6),
                LambdaHandler(epoch_end=lambda e, **kw: seen.append(stat.samples), priority=-1000)]
    with pytest.raises(KeyboardInterrupt):
        est.fit(make_batches(N_BATCHES, batch_size=8), epochs=3, event_handlers=handlers)
    est.fit(make_batches(N_BATCHES, batch_size=8), epochs=3, event_handlers=handlers, resume=True)
    assert seen == [N_BATCHES * 8] * 3  # epoch 2 was cut at its second batch


# -- callback-based -------------------------------------------------------------------------
FIRST_LAYER_WARNING = "ignore:Full backward hook is firing when gradients are computed with respect to module outputs"


@pytest.mark.filterwarnings(FIRST_LAYER_WARNING)
def test_hooks_exist_only_during_firing_steps():
    est = make_estimator()
    during, after = [], []
    probes = [LambdaHandler(forward_begin=lambda e, **kw: during.append(hooks_of(e.net))),
              LambdaHandler(batch_end=lambda e, **kw: after.append(hooks_of(e.net)))]
    stats = [ActivationStatistics(period=3), GradientFlow(period=3)]
    rec = fit(est, stats, probes, epochs=2)
    steps = range(1, 2 * N_BATCHES + 1)
    # 2 leaf modules with parameters, one forward hook each, and one full backward hook each
    assert during == [4 if s % 3 == 0 else 0 for s in steps]
    assert after == [0] * len(steps)
    assert hooks_of(est.net) == 0
    assert [s for s, _ in rec.scalars["activations/0/norm"]] == [3, 6]
    assert [s for s, _ in rec.scalars["gradient_flow/2/grad_output_norm"]] == [3, 6]


def test_activation_values_and_histograms():
    est = make_estimator()
    expected = []

    def measure(e, *, batch, **kw):
        with torch.no_grad():
            expected.append(e.net[0](batch[0]))

    probe = LambdaHandler(forward_begin=measure, every=2)
    rec = fit(est, [ActivationStatistics(["0"], period=2, histograms=True)], [probe], epochs=1)
    for i, step in enumerate([2, 4]):
        out = expected[i]
        assert rec.scalars["activations/0/norm"][i] == (step, pytest.approx(out.norm().item(), rel=1e-6))
        assert rec.scalars["activations/0/mean"][i] == (step, pytest.approx(out.mean().item(), rel=1e-6, abs=1e-7))
        assert rec.scalars["activations/0/std"][i] == (step, pytest.approx(out.std().item(), rel=1e-6))
        assert rec.hists["activations/0"][i][0] == step and torch.equal(rec.hists["activations/0"][i][1], out)


def test_gradient_flow_reads_the_gradient_at_the_module_output():
    est = make_estimator()
    preds = []

    def keep(e, *, pred, **kw):
        pred.retain_grad()
        preds.append(pred)

    rec = fit(est, [GradientFlow(["2"], period=2)], [LambdaHandler(forward_end=keep, every=2)], epochs=1)
    assert rec.scalars["gradient_flow/2/grad_output_norm"] == [
        (2 * (i + 1), pytest.approx(p.grad.norm().item(), rel=1e-6)) for i, p in enumerate(preds)]
    assert "gradient_flow/2/grad_input_norm" in rec.scalars


class FailingNet(nn.Module):
    def __init__(self, fail_at):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.fail_at, self.calls = fail_at, 0

    def forward(self, x):
        self.calls += 1
        out = self.body(x)
        if self.calls == self.fail_at:
            raise RuntimeError("forward failed")
        return out


@pytest.mark.filterwarnings(FIRST_LAYER_WARNING)
def test_no_hook_survives_an_exception_on_a_firing_step():
    net = FailingNet(fail_at=4)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="forward failed"):
        fit(est, [ActivationStatistics(period=2), GradientFlow(period=2)])
    assert hooks_of(net) == 0


def test_an_unknown_module_name_is_refused_at_fit_start():
    est = make_estimator()
    with pytest.raises(ValueError, match="'body.9'"):
        fit(est, [ActivationStatistics(["body.9"])])
    assert est.position.step == 0


# -- the handler ----------------------------------------------------------------------------
def test_it_subscribes_only_to_the_events_its_statistics_use():
    plain = MeterHandler([WeightNorm(), Throughput()], writer=Recorder())
    assert not any(subscribes(plain, e) for e in ("batch_begin", "forward_end", "backward_end"))
    grads = MeterHandler([GradientNorm()], writer=Recorder())
    assert subscribes(grads, "backward_end") and not subscribes(grads, "batch_begin")
    acts = MeterHandler([ActivationStatistics()], writer=Recorder())
    assert subscribes(acts, "batch_begin") and subscribes(acts, "forward_end") and not subscribes(acts, "backward_end")
    assert plain.name == grads.name == acts.name == "MeterHandler"


def test_writing_into_a_tensorboard_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    est = make_estimator()
    tb = TensorBoardHandler(tmp_path)
    meter = MeterHandler([GradientNorm(period=2), Throughput()], writer=tb)
    est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[tb, meter])
    acc = EventAccumulator(tb.run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("gradient_norm/total")] == [2, 4, 6, 8]
    assert [e.step for e in acc.Scalars("epoch/throughput")] == [1, 2]
    assert [e.step for e in acc.Scalars("epoch/train_loss")] == [1, 2]


def test_a_writer_factory_is_called_once_per_fit_and_closed():
    made = []

    def factory():
        made.append(Recorder())
        return made[-1]

    est = make_estimator()
    meter = MeterHandler([Throughput()], writer=factory)
    for _ in range(2):
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=[meter])
    assert len(made) == 2 and [r.closed for r in made] == [1, 1]
    assert [s for s, _ in made[1].scalars["epoch/throughput"]] == [1, 2]  # counts restart each fit


def test_state_round_trip():
    est = make_estimator()
    meter = MeterHandler([EpochGradientNorm(), Throughput()], writer=Recorder())
    est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[meter])
    state = meter.state_dict()
    assert (state["step"], state["epoch"]) == (N_BATCHES, 1)
    assert state["statistics"]["epoch_gradient_norm"]["count"] == N_BATCHES
    other = MeterHandler([EpochGradientNorm(), Throughput()], writer=Recorder())
    other.load_state_dict(state)
    assert other.step == N_BATCHES and other.statistics[0].count == N_BATCHES
    with pytest.raises(ValueError, match="'epoch'"):
        other.load_state_dict({"step": 1, "statistics": {}})


@pytest.mark.parametrize("statistics, writer, error, match", [
    ([], Recorder(), ValueError, "at least one"),
    (["lr"], Recorder(), TypeError, "Statistic"),
    ([WeightNorm(), WeightNorm()], Recorder(), ValueError, "'weight_norm'"),
    ([WeightNorm()], "runs/", TypeError, "writer"),
])
def test_arguments_are_checked(statistics, writer, error, match):
    with pytest.raises(error, match=match):
        MeterHandler(statistics, writer=writer)
