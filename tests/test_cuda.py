"""CUDA: the step path makes no host-device synchronisation, batches move non-blocking, and a run
resumes bit-identically on the GPU. Skipped cleanly where there is no CUDA device."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, LoggingHandler, ProgressBarHandler, checkpoint
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochEnd, TrainEnd

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _estimator(**kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                     device="cuda", **kwargs)


def _loader(pin_memory=True):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(640, 32, generator=g), torch.randint(0, 10, (640,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=32, shuffle=True, pin_memory=pin_memory)


class SyncGuard(BatchBegin, EpochEnd, TrainEnd):
    """Makes any synchronising CUDA call raise from the first batch_begin of each epoch until
    epoch_end, where values are legitimately read (validation, logging, the History)."""

    priority = -float("inf")

    def batch_begin(self, est, **kw):
        torch.cuda.set_sync_debug_mode("error")

    def epoch_end(self, est, **kw):
        torch.cuda.set_sync_debug_mode("default")

    def train_end(self, est, **kw):
        torch.cuda.set_sync_debug_mode("default")


def test_the_default_set_makes_no_sync_on_the_step_path():
    est = _estimator()
    handlers = [SyncGuard(), LoggingHandler(log_interval="epoch"), ProgressBarHandler(refresh_interval=1e9)]
    history = est.fit(_loader(), val_data=_loader(), epochs=2, event_handlers=handlers)
    assert len(history["train_loss"]) == 2


def test_an_exponential_moving_average_makes_no_sync_on_the_step_path():
    from estimatorch import EMAHandler

    est, ema = _estimator(), EMAHandler(0.99, warmup=True, update_every=2, start_step=3)
    history = est.fit(_loader(), val_data=_loader(), epochs=2, event_handlers=[SyncGuard(), ema])
    assert len(history["val_loss"]) == 2 and ema.updates > 0
    assert all(t.is_cuda for t in ema.raw_state_dict().values())  # the average lives on the device


def test_batches_arrive_on_the_device():
    seen = []

    class Probe(BatchEnd):
        def batch_end(self, est, *, batch, pred, **kw):
            seen.append((batch[0].device.type, pred.device.type))

    _estimator().fit(_loader(), epochs=1, event_handlers=[Probe()])
    assert set(seen) == {("cuda", "cuda")}


def test_metrics_accumulate_on_the_device():
    est = _estimator()
    est.fit(_loader(), epochs=1, event_handlers=[])
    assert all(m.total.device.type == "cuda" for m in est.train_metrics if hasattr(m, "total"))


def test_resume_on_the_gpu_is_bit_identical(tmp_path):
    reference = _estimator(deterministic=True)
    full = tmp_path / "full"
    reference.fit(_loader(), epochs=2, event_handlers=[
        CheckpointHandler(full, batch_period=7, epoch_period=None, max_checkpoints=None)])
    start = tmp_path / "start"
    start.mkdir()
    shutil.copy(full / "model-epoch1batch28.pt", start)
    resumed = _estimator(deterministic=True)
    resumed.fit(_loader(), epochs=2, event_handlers=[CheckpointHandler(start, batch_period=7, epoch_period=None,
                                                                       resume_from_checkpoint=True)])
    for key, value in reference.net.state_dict().items():
        assert torch.equal(value, resumed.net.state_dict()[key]), key


def test_each_micro_batch_of_an_elastic_fit_draws_from_its_place_on_the_gpu(tmp_path):
    """Dropout on the GPU draws from the CUDA generator: elastic mode reseeds it too."""
    from tests.data.test_elastic import draws_follow_the_micro_batch

    for got, wanted in draws_follow_the_micro_batch("cuda", tmp_path):
        assert torch.equal(got, wanted)


@pytest.mark.parametrize("kind", [True, "thread"], ids=["process", "thread"])
def test_async_save_copies_through_pinned_buffers_and_writes_the_boundarys_state(tmp_path, kind):
    """The copy runs on a side stream the training stream waits for: a change made right after
    the save returns (queued on the training stream) never reaches the file. (The writer
    process's staging is shared memory registered with CUDA: pinned as well.)"""
    est = _estimator(deterministic=True)
    handler = CheckpointHandler(tmp_path, batch_period=7, epoch_period=None, max_checkpoints=None, async_save=kind)
    at_boundary = {}

    class Scribble(BatchBegin, BatchEnd):
        priority = float("inf")

        def batch_end(self, e, **kw):
            if (e.position.step + 1) % 7 == 0:
                at_boundary[e.position.step + 1] = {k: v.cpu() for k, v in e.net.state_dict().items()}

        def batch_begin(self, e, **kw):
            if e.position.step % 7 == 0 and e.position.step:
                saved = [(p, p.detach().clone()) for p in e.net.parameters()]
                with torch.no_grad():
                    for p, _ in saved:
                        p.fill_(1234.5)
                    for p, value in saved:
                        p.copy_(value)

    est.fit(_loader(), epochs=1, event_handlers=[handler, Scribble()])
    buffers = handler._writer.staging._buffers
    model_buffers = [buf for path, buf in buffers.items() if path[0] == "model"]
    assert model_buffers and all(buf.is_pinned() for buf in model_buffers)  # copied from the GPU
    if kind is True:  # the writer process: every staged tensor, of the GPU or the CPU, is sent as a place in the shared area
        staging = handler._writer.staging
        assert all(id(buf) in staging.slots for buf in buffers.values())
    for step, state in at_boundary.items():
        saved = checkpoint.load(tmp_path / checkpoint.checkpoint_name("model", 0, step))["model"]
        for key, value in state.items():
            assert torch.equal(saved[key], value), (step, key)


class _Hog(nn.Module):
    """A forward that asks for more memory than any GPU has, at its second step."""

    def __init__(self):
        super().__init__()
        self.body, self.calls = nn.Linear(32, 10), 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            x = x + torch.empty(1 << 45, device=x.device, dtype=torch.uint8).sum()  # 32 TiB
        return self.body(x)


def test_out_of_memory_names_step_phase_and_a_snapshot_it_wrote(tmp_path):
    from estimatorch import ProfilerHandler

    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        net = _Hog()
        est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError, match=r"out of memory in step 2 \(forward\), epoch 1; "
                                                              r"memory snapshot: .*oom_snapshot_rank0_step2\.pickle"):
            est.fit(_loader(), epochs=1, event_handlers=[ProfilerHandler(tmp_path, wait=100)])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert (tmp_path / "oom_snapshot_rank0_step2.pickle").stat().st_size > 0


def test_the_profiler_records_cuda_kernels(tmp_path):
    from estimatorch import ProfilerHandler

    profiler = ProfilerHandler(tmp_path, wait=1, warmup=1, active=2)
    _estimator().fit(_loader(), epochs=1, event_handlers=[profiler])
    with open(profiler.traces[0], encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert sorted(e["name"] for e in events if str(e.get("name", "")).startswith("step ")) == ["step 3", "step 4"]
