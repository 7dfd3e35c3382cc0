"""CUDA: the captured train step (``Estimator(..., cuda_graphs=True)``) and the side-stream
batch copies. Skipped cleanly where there is no CUDA device (the decisions and the control flow
are tested on the CPU in tests/estimator/step/test_capture.py and test_graphed_step.py)."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler
from estimatorch.estimator import _loop
from estimatorch.estimator._step.graphed_step import WARMUP_STEPS
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochEnd, TrainEnd
from tests.estimator.stopping.test_interrupts import default_signals  # noqa: F401 - the fixture, used by name

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SAMPLES, BATCH = 650, 32  # 20 full batches and a partial one of 10 per epoch


def _loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 32, generator=g),
                                          torch.randint(0, 10, (SAMPLES,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True, pin_memory=True)


def _estimator(cuda_graphs, *, dropout=0.1, **kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 10))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                     device="cuda", cuda_graphs=cuda_graphs, **kwargs)


class Counts(TrainEnd):
    """The captured step's counts of replayed and eager steps, read as the fit ends."""

    def __init__(self):
        self.replayed = self.eager = None

    def train_end(self, est, **kw):
        step = est._run.step
        self.replayed, self.eager = step.replayed, step.eager
        self.held = [type(h).__name__ for h in step.held]


def _close(a, b, rtol=1e-3, atol=1e-4):
    """Parameters equal within float tolerance: the captured optimizer reads its rate from a
    float32 tensor (the eager one from a Python float), and Adam divides by small moments."""
    for (key, x), y in zip(a.net.state_dict().items(), b.net.state_dict().values()):
        assert torch.allclose(x, y, rtol=rtol, atol=atol), key


def test_a_captured_fit_trains_as_an_eager_one():
    counts = Counts()
    captured = _estimator(True, dropout=0.0)
    history = captured.fit(_loader(), epochs=2, event_handlers=[counts])
    eager = _estimator(False, dropout=0.0)
    reference = eager.fit(_loader(), epochs=2)
    assert counts.eager == WARMUP_STEPS + 2  # the warm-up and each epoch's partial batch
    assert counts.replayed == 2 * 21 - counts.eager
    assert counts.held == ["GradientUpdateHandler", "MetricHandler"]  # the metrics' updates in the graph
    assert [m.count for m in captured.train_metrics] == [SAMPLES, SAMPLES]
    _close(captured, eager)
    assert history["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-3)
    assert history["train_accuracy"] == pytest.approx(reference["train_accuracy"], abs=5e-3)


def test_the_graph_follows_a_per_batch_learning_rate_schedule():
    def schedule(optimizer, total_steps):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)

    captured = _estimator(True, dropout=0.0, lr_scheduler=schedule, lr_scheduler_interval="batch")
    captured.fit(_loader(), epochs=2)
    eager = _estimator(False, dropout=0.0, lr_scheduler=schedule, lr_scheduler_interval="batch")
    eager.fit(_loader(), epochs=2)
    assert float(captured.optimizer.param_groups[0]["lr"]) == pytest.approx(eager.optimizer.param_groups[0]["lr"])
    _close(captured, eager)


def test_clipping_and_bf16_autocast_inside_the_graph():
    captured = _estimator(True, dropout=0.0, precision="bf16-mixed")
    captured.fit(_loader(), epochs=1, event_handlers=[GradientUpdateHandler(clip_grad_norm=0.5)])
    eager = _estimator(False, dropout=0.0, precision="bf16-mixed")
    eager.fit(_loader(), epochs=1, event_handlers=[GradientUpdateHandler(clip_grad_norm=0.5)])
    _close(captured, eager, rtol=2e-2, atol=2e-3)


def test_batch_end_sees_each_step_s_own_outputs():
    seen = []

    class Probe(BatchEnd):
        def batch_end(self, est, *, pred, loss, **kw):
            seen.append((pred, loss))

    _estimator(True).fit(_loader(), epochs=1, event_handlers=[Probe()])
    losses = torch.stack([loss for _, loss in seen]).cpu()
    assert len(set(losses.tolist())) == len(seen)  # copies: no later replay overwrote one
    assert all(pred.device.type == "cuda" for pred, _ in seen)


def test_an_interrupted_captured_run_resumes_bitwise(tmp_path):
    """Dropout included: the resumed run warms up and captures again at its start; its eager
    warm-up steps are bitwise the uninterrupted run's replays."""
    reference = _estimator(True, deterministic=True)
    full = tmp_path / "full"
    expected = reference.fit(_loader(), epochs=2, event_handlers=[
        CheckpointHandler(full, batch_period=7, epoch_period=None, max_checkpoints=None)])
    # early in the first epoch (the reference replays there), its last (partial) batch, the second epoch
    for name in ("model-epoch0batch7.pt", "model-epoch0batch21.pt", "model-epoch1batch35.pt"):
        start = tmp_path / name
        start.mkdir()
        shutil.copy(full / name, start)
        resumed = _estimator(True, deterministic=True)
        history = resumed.fit(_loader(), epochs=2, event_handlers=[
            CheckpointHandler(start, batch_period=7, epoch_period=None, resume_from_checkpoint=True)])
        for key in ("train_loss", "train_accuracy"):  # the metrics, updated inside the graph
            assert history[key][-1] == expected[key][-1], (name, key)
        for key, value in reference.net.state_dict().items():
            assert torch.equal(value, resumed.net.state_dict()[key]), (name, key)
        for a, b in zip(reference.optimizer.state.values(), resumed.optimizer.state.values()):
            assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.usefixtures("default_signals")
def test_a_captured_run_stopped_by_ctrl_c_and_resumed_in_the_process_is_bitwise_an_uninterrupted_one():
    import signal

    from tests.estimator.stopping.test_interrupts import SignalAt

    reference = _estimator(True, deterministic=True)
    reference.fit(_loader(), epochs=2)
    interrupted = _estimator(True, deterministic=True)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(_loader(), epochs=2, event_handlers=[SignalAt(signal.SIGINT, step=30)])
    assert interrupted.position.step == 30
    interrupted.fit(_loader(), epochs=2, resume=True)
    for key, value in reference.net.state_dict().items():
        assert torch.equal(value, interrupted.net.state_dict()[key]), key


class SyncGuard(BatchBegin, EpochEnd, TrainEnd):
    """Makes any synchronising CUDA call raise from the second epoch's first batch_begin until
    its epoch_end (the first epoch holds the capture, which synchronises once)."""

    priority = -float("inf")

    def batch_begin(self, est, **kw):
        if est.position.epoch >= 1:
            torch.cuda.set_sync_debug_mode("error")

    def epoch_end(self, est, **kw):
        torch.cuda.set_sync_debug_mode("default")

    def train_end(self, est, **kw):
        torch.cuda.set_sync_debug_mode("default")


def test_a_replayed_step_makes_no_synchronising_call():
    counts = Counts()
    _estimator(True).fit(_loader(), epochs=2, event_handlers=[SyncGuard(), counts])
    assert counts.replayed >= 20


class Branchy(nn.Module):
    """Data-dependent control flow: a branch on a tensor's value, read on the host."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 10), nn.Linear(32, 10)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


def test_a_model_that_synchronises_trains_eagerly_with_one_warning_and_no_failed_capture():
    torch.manual_seed(0)
    net = Branchy()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), device="cuda",
                    cuda_graphs=True)
    counts = Counts()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(_loader(), epochs=1, event_handlers=[counts])
    messages = [str(w.message) for w in caught if "cuda_graphs=True" in str(w.message)]
    assert len(messages) == 1 and "makes a synchronising CUDA call (at " in messages[0], messages
    assert "test_cuda_graphs.py:" in messages[0]  # Branchy's forward, where it reads x.sum()
    assert counts.replayed == 0 and counts.eager == 21
    assert all(torch.isfinite(p).all() for p in net.parameters())
    # no capture was tried, so none failed: the process goes on (dropout draws, memory returned)
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)


_REFUSED = """
import torch
from torch import nn
from estimatorch import Estimator


class LateRead(nn.Module):
    # reads a value on the host from its fourth call on (the capture): the watched warm-up steps see none

    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(32, 10), 0

    def forward(self, x):
        self.calls += 1
        if self.calls >= 4 and x.sum() > 1e9:
            return self.fc(x) * 2
        return self.fc(x)


torch.manual_seed(0)
net = LateRead()
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()), device="cuda",
                cuda_graphs=True)
data = [(torch.randn(32, 32), torch.randint(0, 10, (32,))) for _ in range(8)]
try:
    est.fit(data, epochs=1)
except RuntimeError as err:
    print("REFUSED", est.position.step, err, flush=True)
"""


def test_a_capture_cuda_refuses_ends_the_fit_naming_the_cause(tmp_path):
    """A host read the warm-up did not see fails the capture itself: the fit ends with the cause
    (in a process of its own: PyTorch does not undo a failed capture)."""
    import subprocess
    import sys

    script = tmp_path / "refused.py"
    script.write_text(_REFUSED)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    line = next((line for line in done.stdout.splitlines() if line.startswith("REFUSED")), None)
    assert line is not None, done.stdout + done.stderr
    assert line.startswith(f"REFUSED {WARMUP_STEPS} ")  # the state of before the captured step
    assert "CUDA refused to record the train step" in line and "cuda_graphs=False" in line


def test_the_side_stream_copy_trains_as_the_plain_copy(monkeypatch):
    """The side stream changes when the copy runs, not what arrives."""
    arrived = []

    class Probe(BatchBegin):
        def batch_begin(self, est, *, batch, **kw):
            arrived.append(batch[0].sum())

    with_side = _estimator(False, deterministic=True)
    with_side.fit(_loader(), epochs=2, event_handlers=[Probe()])
    side_sums = torch.stack(arrived).cpu()
    arrived.clear()
    monkeypatch.setattr(_loop, "batch_mover", lambda device: (lambda batch: _loop_to_device(batch, device)))
    plain = _estimator(False, deterministic=True)
    plain.fit(_loader(), epochs=2, event_handlers=[Probe()])
    assert torch.equal(side_sums, torch.stack(arrived).cpu())
    for key, value in plain.net.state_dict().items():
        assert torch.equal(value, with_side.net.state_dict()[key]), key


def _loop_to_device(batch, device):
    from estimatorch._batches import to_device

    return to_device(batch, device)
