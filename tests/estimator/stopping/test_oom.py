"""A CUDA out-of-memory error in fit names the step and the phase it happened in (and, where
CUDA exists, the memory snapshot written); raised here on CPU from the step's parts."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from estimatorch import Estimator, ProfilerHandler, ValidationHandler
from estimatorch.events import BatchEnd
from tests.conftest import make_batches

N_BATCHES = 4
FAIL_AT = 3  # a step counted from 1: the forward of the third batch (or the validation after it)


class Tripwire(nn.Module):
    """A small net whose forward (training, or evaluation) or backward runs out of memory."""

    def __init__(self, where: str):
        super().__init__()
        self.where, self.calls = where, 0
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        if self.training:
            self.calls += 1
        if self.where == "forward" and self.training and self.calls == FAIL_AT:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.where == "validation" and not self.training:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        out = self.body(x)
        if self.where == "backward" and self.calls == FAIL_AT:
            out.register_hook(self._fail)
        return out

    @staticmethod
    def _fail(grad):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


class TripwireSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.steps = 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == FAIL_AT:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().step(closure)


@pytest.mark.parametrize("where, told", [
    ("forward", f"step {FAIL_AT} (forward)"),
    ("backward", f"step {FAIL_AT} (backward)"),
    ("optimizer", f"step {FAIL_AT} (optimizer)"),
    ("validation", f"validation after step {N_BATCHES}"),
])
def test_the_error_names_the_step_and_the_phase(where, told, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no snapshot on CPU
    net = Tripwire(where)
    optimizer = TripwireSGD(net.parameters()) if where == "optimizer" else torch.optim.SGD(net.parameters(), lr=0.1)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer)
    handlers = [ValidationHandler(make_batches(2, seed=1), est.evaluate)] if where == "validation" else []
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        est.fit(make_batches(N_BATCHES), epochs=2, event_handlers=handlers)
    message = str(raised.value)
    assert re.match(rf"out of memory in {re.escape(told)}, epoch 1\. CUDA out of memory\. Tried", message), message
    assert "snapshot" not in message
    assert isinstance(raised.value.__cause__, torch.cuda.OutOfMemoryError)  # the original, with its traceback


class FailingHandler(BatchEnd):
    def batch_end(self, estimator, **kwargs):
        raise RuntimeError("boom")


def test_other_errors_pass_unchanged():
    net = Tripwire("none")
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="^boom$"):
        est.fit(make_batches(N_BATCHES), epochs=1, event_handlers=[FailingHandler()])


def test_where_cuda_exists_a_snapshot_is_written_and_named(tmp_path, monkeypatch):
    """The snapshot goes to the fit's ProfilerHandler log_dir (CUDA's allocator stood in for by a
    function writing the file: this machine has no GPU; tests/test_cuda.py has none of it yet)."""
    from estimatorch.estimator._stopping import oom as _oom

    written = []

    def dump(path):
        written.append(path)
        with open(path, "wb") as f:
            f.write(b"snapshot")

    monkeypatch.setattr(_oom.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_oom.torch.cuda.memory, "_dump_snapshot", dump)
    net = Tripwire("forward")
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    with pytest.raises(torch.cuda.OutOfMemoryError) as raised:
        est.fit(make_batches(N_BATCHES), epochs=1,
                event_handlers=[ProfilerHandler(tmp_path / "profile", wait=100)])
    path = str(tmp_path / "profile" / f"oom_snapshot_rank0_step{FAIL_AT}.pickle")
    assert written == [path]
    assert f"step {FAIL_AT} (forward), epoch 1; memory snapshot: {path} " in str(raised.value)
