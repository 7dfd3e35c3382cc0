"""CheckpointHandler(async_save=True) under torch.distributed (2 gloo processes): rank 0 writes in
the background what the ranks held at the boundary, whatever the steps during the write change;
a run killed after a background save resumes bit-identically; a failed background write is an
error on every rank at the next save (never a hang), the earlier files kept. The tests that patch
the write in this process use the writer thread (``async_save="thread"``); the killed run writes
with rank 0's writer process."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint, distributed
from estimatorch.event_handlers import BatchBegin, BatchEnd
from tests.conftest import CrashAt, assert_tree_equal, fill_disk_at

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EPOCHS, STEPS_PER_EPOCH = 2, 4  # 32 samples, 2 ranks, batches of 4


class Scribble(BatchBegin, BatchEnd):
    """On rank 0: the model at every step's end (the state its boundary's checkpoint must hold);
    and, at the start of a step while a background write runs, parameters set to 1234.5 in place
    until that write is done (held until then), then put back."""

    priority = float("inf")

    def __init__(self, handler):
        self.handler, self.states, self.scribbled = handler, {}, 0

    def batch_end(self, estimator, **kwargs):
        self.states[estimator.position.step + 1] = {k: v.clone() for k, v in estimator.net.state_dict().items()}

    def batch_begin(self, estimator, **kwargs):
        writer = self.handler._writer
        if not writer.busy:
            return
        saved = [(p, p.detach().clone()) for p in estimator.net.parameters()]
        with torch.no_grad():
            for p, _ in saved:
                p.fill_(1234.5)
        Held.go.set()
        writer.join()
        self.scribbled += 1
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)


class Held:
    """Rank 0's background writes of periodic checkpoints but the last wait for ``go`` (set by
    Scribble at the next step's start)."""

    go = threading.Event()

    @classmethod
    def install(cls):
        real = checkpoint.atomic_save

        def held(obj, path, **kwargs):
            last = f"batch{EPOCHS * STEPS_PER_EPOCH}.pt"
            if threading.current_thread() is not threading.main_thread() and os.fspath(path).endswith(".pt") \
                    and not os.fspath(path).endswith(last):
                assert cls.go.wait(60), "never released"
                cls.go.clear()
            real(obj, path, **kwargs)

        checkpoint.atomic_save = held


def _fit(model_dir, async_save, resume=False, crash=0, scribble=False, fail_on=None):
    """One rank's fit: an MLP with Adam, a checkpoint every 2 batches; returns the outcome."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if distributed.get_rank() == 0:
        if scribble:
            Held.install()
        if fail_on is not None:
            fill_disk_at(fail_on)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.05), seed=5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.arange(32) % 3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    handler = CheckpointHandler(model_dir, batch_period=2, epoch_period=None, max_checkpoints=None,
                                resume_from_checkpoint=resume, async_save=async_save)
    extra = [Scribble(handler)] if scribble and distributed.get_rank() == 0 else []
    start = time.monotonic()
    try:
        est.fit(loader, epochs=EPOCHS, event_handlers=[handler, *extra, *([CrashAt(crash)] if crash else [])])
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": type(err).__name__, "errno": getattr(err, "errno", None), "message": str(err),
                "step": est.position.step, "seconds": time.monotonic() - start}
    return {"error": None, "model": est.net.state_dict(), "optimizer": est.optimizer.state_dict(),
            "states": extra[0].states if extra else None, "scribbled": extra[0].scribbled if extra else 0}


def _name(step):
    """The checkpoint of ``step``: saved at a batch boundary, after the epochs before it."""
    return checkpoint.checkpoint_name("model", (step - 1) // STEPS_PER_EPOCH, step)


def test_rank_0_writes_the_state_at_the_boundary_whatever_the_steps_during_the_write_change(tmp_path):
    r0, r1 = distributed.spawn(_fit, 2, str(tmp_path), "thread", False, 0, True, backend="gloo")  # (patched here)
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    steps = EPOCHS * STEPS_PER_EPOCH
    assert r0["scribbled"] == steps // 2 - 1  # every save but the last had a step run during its write
    for step in range(2, steps + 1, 2):
        payload = checkpoint.load(tmp_path / _name(step))
        assert_tree_equal(payload["model"], r0["states"][step], f"model at step {step}")
    assert_tree_equal(r0["model"], r1["model"], "the ranks' models")


def test_a_run_killed_after_background_saves_resumes_bit_identically(tmp_path):
    whole = distributed.spawn(_fit, 2, str(tmp_path / "whole"), False, backend="gloo")
    crashed = distributed.spawn(_fit, 2, str(tmp_path / "run"), True, False, 6, backend="gloo")
    assert all(r["error"] == "RuntimeError" for r in crashed), crashed
    assert checkpoint.read_latest(tmp_path / "run", "model") == _name(4)
    resumed = distributed.spawn(_fit, 2, str(tmp_path / "run"), True, True, backend="gloo")
    for rank in (0, 1):
        assert resumed[rank]["error"] is None, resumed[rank]
        for key in ("model", "optimizer"):
            assert_tree_equal(resumed[rank][key], whole[rank][key], f"rank {rank} {key}")


def test_a_failed_background_write_on_rank_0_is_an_error_on_every_rank_at_the_next_save(tmp_path):
    failing = _name(4)
    r0, r1 = distributed.spawn(_fit, 2, str(tmp_path), "thread", False, 0, False, failing, backend="gloo")
    for result in (r0, r1):
        assert result["error"] == "OSError" and "No space left on device" in result["message"], result
        assert failing in result["message"] and result["step"] == 6, result  # the next save's boundary
    assert r0["errno"] == errno.ENOSPC
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("model-")) == \
        [_name(2), "model-latest"]
    assert checkpoint.read_latest(tmp_path, "model") == _name(2)


def test_a_failed_last_background_write_is_an_error_on_every_rank_in_train_end(tmp_path):
    last = EPOCHS * STEPS_PER_EPOCH
    r0, r1 = distributed.spawn(_fit, 2, str(tmp_path), "thread", False, 0, False, _name(last), backend="gloo")
    for result in (r0, r1):
        assert result["error"] == "OSError" and _name(last) in result["message"], result
        assert result["step"] == last, result  # the whole plan ran: raised in train_end
    assert checkpoint.read_latest(tmp_path, "model") == _name(last - 2)
