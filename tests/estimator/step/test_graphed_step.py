"""The control flow of the captured step (``cuda_graphs=True``) on the CPU, with stand-ins for
torch.cuda's streams and graphs: warm-up, one capture, replays for batches of the captured
layout, eager steps for others, outputs for ``batch_end``, the fallback after a failed capture.

A stand-in graph cannot record kernels: its capture runs the step (a real capture only records
it), so its first replay does nothing and later ones run the step again on the static inputs,
writing into the captured outputs, as a replay does. What only a GPU shows (the replay's
bits, the generator's offsets, the memory pool) is tested in tests/test_cuda_graphs.py.
"""

from __future__ import annotations

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from estimatorch import Estimator
from estimatorch.estimator import _start
from estimatorch.estimator._step import graphed_step as _graphed_step
from estimatorch.estimator._step.graphed_step import WARMUP_STEPS, GraphedStep, _make_capturable
from estimatorch.event_handlers import BatchEnd, GradientUpdateHandler, MetricHandler


class FakeGraph:
    """A CUDA graph's stand-in: see the module docstring."""

    made: list[FakeGraph] = []

    def __init__(self):
        self.step = None
        self.replays = 0
        FakeGraph.made.append(self)

    def replay(self):
        self.replays += 1
        if self.replays == 1:  # the capture ran this step already
            return
        step = self.step
        outputs, _ = step.outputs
        # a replay runs kernels, not the held handlers' Python nor the metrics' host counts
        python_state = [(h, dict(vars(h))) for h in step.held]
        metrics = [m for m in step.estimator.train_metrics if getattr(m, "capturable", False)]
        counts = [(m, {a: getattr(m, a) for a in m.state_defaults() if not isinstance(getattr(m, a), torch.Tensor)})
                  for m in metrics]
        fresh = step._step(step.static_batch, 0)
        for handler, attributes in python_state:
            vars(handler).clear()
            vars(handler).update(attributes)
        for metric, numbers in counts:
            vars(metric).update(numbers)
        for old, new in zip(outputs[2:], fresh[2:]):  # pred and loss: written in place
            old.detach().copy_(new.detach())


class FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """Stand-ins for what GraphedStep takes from torch.cuda; ``fail`` makes the capture raise."""
    state = {"fail": None}
    FakeGraph.made = []

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        assert pool == "pool" and capture_error_mode == "thread_local"
        assert stream is state["step"].side  # recorded on the step's own stream and device
        assert state["device"] == state["step"].device
        if state["fail"] is not None:  # before the body: a stand-in cannot undo the step it ran
            raise state["fail"]
        yield
        if state.get("fail_after") is not None:  # at the capture's end, as CUDA reports some errors
            raise state["fail_after"]

    def capture_owner(estimator, run):
        step = real_graphed_step(estimator, run)
        state["step"] = step
        return step

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(cuda, "graph", graph)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    state["mode"], state["device"] = "default", None

    @contextlib.contextmanager
    def on_device(device):
        state["device"] = device
        yield
        state["device"] = None

    monkeypatch.setattr(cuda, "device", on_device)
    monkeypatch.setattr(cuda, "get_sync_debug_mode", lambda: {"default": 0, "warn": 1}[state["mode"]])
    monkeypatch.setattr(cuda, "set_sync_debug_mode", lambda mode: state.update(mode={0: "default", 1: "warn"}.get(mode, mode)))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    # the rate stays a float here (a CPU SGD with a tensor rate would change the bits): tested apart
    monkeypatch.setattr(_graphed_step, "_make_capturable", lambda optimizer, device: None)
    monkeypatch.setattr(_graphed_step.GraphedStep, "_keep_rates", lambda self, optimizer: None)
    monkeypatch.setattr(_start, "check_capture", lambda *args: None)  # the device check: a CPU stands in
    real_graphed_step = _graphed_step.graphed_step
    from estimatorch.estimator import estimator as estimator_module
    monkeypatch.setattr(estimator_module, "graphed_step", capture_owner)

    def link(graph_made):  # the replays need the step that made them
        graph_made.step = state["step"]

    state["link"] = link
    return state


class Linking(BatchEnd):
    """Links each new fake graph to its step, and keeps what batch_end receives."""

    priority = 10

    def __init__(self, state):
        self.state, self.seen = state, []

    def batch_end(self, estimator, *, batch, pred, label, loss, **kwargs):
        for g in FakeGraph.made:
            if g.step is None:
                self.state["link"](g)
        self.seen.append((pred.detach().clone(), label, loss.detach().clone(), batch[1]))


def _data(sizes=(8, 8, 8, 8, 8, 8, 5)):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]


def _fit(cuda_graphs, handlers=(), epochs=2, **kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                    cuda_graphs=cuda_graphs, deterministic=True, **kwargs)
    history = est.fit(_data(), epochs=epochs, event_handlers=list(handlers))
    return est, history


def test_warm_up_then_one_capture_then_replays_with_other_layouts_eager(fake_cuda):
    probe = Linking(fake_cuda)
    est, history = _fit(True, [probe])
    step = fake_cuda["step"]
    assert len(FakeGraph.made) == 1
    # 2 epochs of 6 full batches and a partial one: 3 warm-up steps, the 4th captured, the
    # partial batches (one per epoch) eager, every other full batch replayed
    assert step.eager == WARMUP_STEPS + 2
    assert step.replayed == 14 - WARMUP_STEPS - 2
    assert FakeGraph.made[0].replays == step.replayed
    reference, ref_history = _fit(False)
    for a, b in zip(est.net.parameters(), reference.net.parameters()):
        assert torch.equal(a, b)
    assert history["train_loss"] == ref_history["train_loss"]
    assert history["train_accuracy"] == ref_history["train_accuracy"]


def test_batch_end_gets_the_batch_s_own_label_and_copies_of_the_graph_s_outputs(fake_cuda):
    probe = Linking(fake_cuda)
    _fit(True, [probe], epochs=1)
    preds = [seen[0] for seen in probe.seen]
    for _, label, _, batch_label in probe.seen:
        assert label is batch_label  # the step's static input is swapped back for the batch's own
    # copies: a replay does not change what an earlier batch_end received
    assert not torch.equal(preds[WARMUP_STEPS + 1], preds[WARMUP_STEPS + 2])


def test_the_optimizer_step_and_the_metric_updates_leave_batch_end_for_the_step(fake_cuda):
    probe = Linking(fake_cuda)
    est, _ = _fit(True, [probe], epochs=1)
    step = fake_cuda["step"]
    assert [type(h) for h in step.held] == [GradientUpdateHandler, MetricHandler]
    assert all(getattr(fn, "__self__", None) not in step.held for fn in est._run.dispatch.batch_end)
    assert est._run.step is None  # released with the fit
    # the loss and the accuracy counted every sample once: 6 batches of 8 and one of 5
    assert [m.count for m in est.train_metrics] == [53, 53]


def test_a_capture_cuda_refuses_ends_the_fit_with_its_cause_and_the_state_of_before_the_step(fake_cuda):
    """A capture CUDA refuses cannot be undone in the process (its memory pool, the generators):
    the fit ends, naming the cause (the error capture_end's masks), with the held handlers' and
    the metrics' Python put back, so the run's state is that of before the step. CUDA reports
    some errors only when the capture ends, after the step's Python ran."""
    for when in ("fail", "fail_after"):
        FakeGraph.made = []
        fake_cuda["fail"] = fake_cuda["fail_after"] = None
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError as err:
            cause = err
            try:
                raise RuntimeError("operation failed due to a previous error during capture")
            except RuntimeError as masking:
                fake_cuda[when] = masking
        probe = Linking(fake_cuda)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                        cuda_graphs=True)
        with pytest.raises(RuntimeError, match=r"CUDA refused to record the train step \(RuntimeError: operation "
                                               r"not permitted when stream is capturing\)") as raised:
            est.fit(_data(), epochs=1, event_handlers=[probe])
        assert raised.value.__cause__ is fake_cuda[when] and cause is fake_cuda[when].__context__
        assert "cuda_graphs=False" in str(raised.value)
        assert est.position.step == WARMUP_STEPS  # the fourth step, the capture's, never happened
        assert [m.count for m in est.train_metrics] == [8 * WARMUP_STEPS] * 2, when  # put back
        assert fake_cuda["step"].held[0].pending == 0


class WhileWatched(nn.Module):
    """The test's net, calling ``during`` in each forward run while the step is watched (the
    stand-in sync debug mode set to warn)."""

    def __init__(self, state, during):
        super().__init__()
        self.state, self.during = state, during
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        if self.state["mode"] == "warn":
            self.during()
        return self.net(x)


def _fit_watched(fake_cuda, during, epochs):
    """A captured fit of :class:`WhileWatched`; returns the estimator and every warning shown."""
    torch.manual_seed(0)
    net = WhileWatched(fake_cuda, during)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), cuda_graphs=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(_data(), epochs=epochs, event_handlers=[Linking(fake_cuda)])
    return est, caught


def test_a_step_that_synchronises_trains_eagerly_with_one_warning_naming_where(fake_cuda):
    """The warm-up steps run under torch's sync debug mode (warn): a synchronising call seen in
    the step before the capture means no capture (one CUDA refuses could not be undone)."""
    def read_on_the_host():  # what torch does for .item() under the sync debug mode
        warnings.warn("called a synchronizing CUDA operation")

    _, caught = _fit_watched(fake_cuda, read_on_the_host, epochs=2)
    messages = [str(w.message) for w in caught if "cuda_graphs" in str(w.message)]
    assert len(messages) == 1 and "makes a synchronising CUDA call (at " in messages[0]
    assert "test_graphed_step.py:" in messages[0] and "trains eagerly" in messages[0]
    assert not any("called a synchronizing" in str(w.message) for w in caught)  # the probe's own, kept
    step = fake_cuda["step"]
    assert step.replayed == 0 and step.eager == 14 and FakeGraph.made == []
    assert fake_cuda["mode"] == "default"  # the debug mode is put back


def test_a_synchronising_call_of_another_thread_does_not_stop_the_capture(fake_cuda):
    """The debug mode is the process's: a pin-memory or checkpoint-writer thread synchronising
    during a watched step is not the step's, and its warning is dropped."""
    import threading

    def neighbour_reads():
        other = threading.Thread(target=warnings.warn, args=("called a synchronizing CUDA operation",))
        other.start()
        other.join()

    _, caught = _fit_watched(fake_cuda, neighbour_reads, epochs=1)
    assert not any("synchroniz" in str(w.message) or "cuda_graphs" in str(w.message) for w in caught)
    assert len(FakeGraph.made) == 1 and fake_cuda["step"].replayed > 0


def test_the_metrics_of_a_resumed_captured_fit_equal_the_uninterrupted_one_s_bitwise(fake_cuda, tmp_path):
    """Every update of a captured fit is folded at once (warm-up and eager batches too): the
    resumed fit's sums grow in the uninterrupted one's order."""
    import shutil

    from estimatorch import CheckpointHandler, checkpoint

    full = tmp_path / "full"
    _, reference = _fit(True, [Linking(fake_cuda), CheckpointHandler(full, batch_period=5, epoch_period=None,
                                                                     max_checkpoints=None)], epochs=3)
    start = tmp_path / "start"
    start.mkdir()
    shutil.copy(full / checkpoint.checkpoint_name("model", 1, 10), start)
    _, resumed = _fit(True, [Linking(fake_cuda), CheckpointHandler(start, batch_period=5, epoch_period=None,
                                                                   resume_from_checkpoint=True)], epochs=3)
    for key in ("train_loss", "train_accuracy"):
        assert resumed[key][-2:] == reference[key][-2:]  # epoch 2 (resumed mid-way) and 3


def test_make_capturable_puts_the_rate_and_the_step_counts_on_the_device():
    net = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    net(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    cpu = torch.device("cpu")  # the device the state is put on: the CPU stands for the GPU
    _make_capturable(optimizer, cpu)
    group = optimizer.param_groups[0]
    assert group["capturable"] is True
    assert isinstance(group["lr"], torch.Tensor) and group["lr"].dim() == 0
    assert float(group["lr"]) == pytest.approx(0.01)
    rate = group["lr"]
    _make_capturable(optimizer, cpu)  # idempotent: the tensor a scheduler fills stays the same
    assert group["lr"] is rate
    scheduler.step()
    assert group["lr"] is rate and float(rate) == pytest.approx(0.005)  # filled in place
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].device == cpu for s in optimizer.state.values())


def test_a_rate_assigned_instead_of_filled_is_copied_into_the_tensor_the_graph_reads():
    net = nn.Linear(3, 2)
    optimizer = torch.optim.Adam([{"params": [net.weight]}, {"params": [net.bias]}], lr=0.01)
    _make_capturable(optimizer, torch.device("cpu"))
    step = SimpleNamespace(rates=[group["lr"] for group in optimizer.param_groups])
    first, second = step.rates
    optimizer.param_groups[0]["lr"] = 0.5  # a user's handler assigning, not filling
    optimizer.param_groups[1]["lr"] = torch.tensor([0.25])
    GraphedStep._keep_rates(step, optimizer)
    assert optimizer.param_groups[0]["lr"] is first and float(first) == 0.5
    assert optimizer.param_groups[1]["lr"] is second and float(second) == 0.25


def test_a_per_batch_schedule_steps_after_every_replayed_step(fake_cuda):
    """LRSchedulerHandler steps after each optimizer step, told by GradientUpdateHandler.stepped:
    a replay, which runs no Python, must still count as a step (also after an epoch_end)."""
    def schedule(optimizer, total_steps):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.8)

    probe = Linking(fake_cuda)
    est, history = _fit(True, [probe], epochs=3, lr_scheduler=schedule, lr_scheduler_interval="batch")
    reference, ref_history = _fit(False, epochs=3, lr_scheduler=schedule, lr_scheduler_interval="batch")
    assert est.lr_scheduler.last_epoch == reference.lr_scheduler.last_epoch == 21
    assert history["lr"] == ref_history["lr"]
    for a, b in zip(est.net.parameters(), reference.net.parameters()):
        assert torch.equal(a, b)


def test_a_resumed_fit_warms_up_and_captures_again_from_its_checkpoint(fake_cuda, tmp_path):
    import shutil

    from estimatorch import CheckpointHandler, checkpoint

    probe = Linking(fake_cuda)
    full = tmp_path / "full"
    reference, _ = _fit(True, [probe, CheckpointHandler(full, batch_period=5, epoch_period=None,
                                                        max_checkpoints=None)], epochs=3)
    start = tmp_path / "start"
    start.mkdir()
    shutil.copy(full / checkpoint.checkpoint_name("model", 1, 10), start)
    resumed, _ = _fit(True, [Linking(fake_cuda), CheckpointHandler(start, batch_period=5, epoch_period=None,
                                                                    resume_from_checkpoint=True)], epochs=3)
    step = fake_cuda["step"]
    # from step 11: 3 warm-up steps, the partial batch 14 and batch 15 (a layout after another)
    # eager, 16 captured (its layout is 15's), 17-20 replayed, the partial 21 eager
    assert step.eager == WARMUP_STEPS + 3 and step.replayed == 5
    for a, b in zip(reference.net.parameters(), resumed.net.parameters()):
        assert torch.equal(a, b)


def test_the_guide_s_capturable_handler_is_recorded_with_the_step_and_counts_every_replay(fake_cuda):
    """docs/writing-handlers.md's SquaredGradNorm, run from the page's own code: ranked before
    the optimizer step and capturable, it is held in the graph; its sum (device work, replayed)
    and its count (Python, told by record_batch_end) equal an eager fit's."""
    import re

    from tests.test_docs import DOCS, read, section

    code = re.search(r"```python\n(.*?)```", section(read(DOCS / "writing-handlers.md"),
                                                     "A `batch_end` inside a captured step"), re.DOTALL)
    namespace: dict = {"__name__": "writing_handlers_capturable"}
    exec(compile(code.group(1), "docs/writing-handlers.md", "exec"), namespace)  # noqa: S102 - our own page
    captured, eager = namespace["SquaredGradNorm"](), namespace["SquaredGradNorm"]()
    _fit(True, [Linking(fake_cuda), captured])
    assert fake_cuda["step"].held[0] is captured and fake_cuda["step"].replayed > 0
    _fit(False, [eager])
    assert captured.steps == eager.steps == 14
    assert torch.equal(captured.total, eager.total)


def test_running_out_of_memory_while_recording_stays_an_out_of_memory_error(fake_cuda):
    """The capture allocates the graph's pool: CUDA's OutOfMemoryError goes to fit's own
    description of it (where, the snapshot), not into a refused capture's wording."""
    fake_cuda["fail_after"] = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    probe = Linking(fake_cuda)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"out of memory in step 4 .*Tried to allocate") as raised:
        _fit(True, [probe], epochs=1)
    assert "CUDA refused to record" not in str(raised.value)


def test_a_handler_of_the_mixins_alone_declaring_the_capability_is_recorded(fake_cuda):
    """Every declaration has its default for a handler that inherits only the mixins: one that
    says capturable_batch_end without a record_batch_end asks nothing after a replay."""
    class Plain(BatchEnd):
        priority = -2500
        capturable_batch_end = True

        def __init__(self):
            self.calls = 0

        def batch_end(self, estimator, **kwargs):
            self.calls += 1

    plain = Plain()
    _fit(True, [Linking(fake_cuda), plain], epochs=1)
    step = fake_cuda["step"]
    assert step.held[0] is plain and step.replayed > 0
    assert plain.calls == step.eager + 1  # its Python ran in the eager steps and once, recording
