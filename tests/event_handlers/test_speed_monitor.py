"""SpeedMonitor: the split, FLOP/s and MFU against a model whose FLOPs are known, peak memory on
CUDA, and where its values show (epoch and batch lines, History, TensorBoard, a tracker)."""

from __future__ import annotations

import logging
import math
import os
import pickle
import time

import pytest
import torch
from torch import nn

from estimatorch import Estimator, LoggingHandler, SpeedMonitor, TensorBoardHandler, distributed
from estimatorch.event_handlers._peak_flops import PEAK_FLOPS, matmul_precision, peak_flops
from estimatorch.events import PARTS, EpochEnd, Handler
from tests.conftest import make_batches, make_estimator
from tests.event_handlers.test_tensorboard import read_events

WIDTHS = (16, 32, 24, 3)  # a Linear stack without bias: its FLOPs follow from the shapes
BATCH, N_BATCHES = 8, 5
TIMES = [f"time_{part}" for part in PARTS]
SLEEP = 0.02
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _linear_stack():
    torch.manual_seed(0)
    layers = [nn.Linear(a, b, bias=False) for a, b in zip(WIDTHS, WIDTHS[1:])]
    net = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())][:-1])
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def _data(n=N_BATCHES):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (BATCH,), generator=g))
            for _ in range(n)]


def _stack_flops():
    """Forward 2*B*in*out per layer; backward the weight gradient of every layer (the same) and
    the input gradient of every layer but the first (whose input needs none): 6N per sample
    where N counts the weights that pass a gradient on, 4N for the first layer."""
    pairs = list(zip(WIDTHS, WIDTHS[1:]))
    matmul = [2 * BATCH * a * b for a, b in pairs]
    return sum(matmul) + sum(matmul) + sum(matmul[1:])


class Spy(Handler, EpochEnd):
    """Reads the split and the monitor's epoch values at each epoch's end (after the monitor)."""

    def __init__(self):
        self.splits, self.values = [], []

    def epoch_end(self, estimator, **kwargs):
        monitor = next(h for h in estimator.handlers if isinstance(h, SpeedMonitor))
        self.splits.append(estimator.step_times.split())
        self.values.append(dict(monitor.epoch_values))


# -- FLOPs and MFU ------------------------------------------------------------------------------
def test_flops_are_counted_once_and_mfu_follows_from_them():
    est = _linear_stack()
    monitor, spy = SpeedMonitor(peak_flops=1e12), Spy()
    history = est.fit(_data(), epochs=2, event_handlers=[monitor, spy])
    assert monitor.flops == _stack_flops()
    assert _stack_flops() == 6 * BATCH * sum(a * b for a, b in zip(WIDTHS, WIDTHS[1:])) - 2 * BATCH * 16 * 32
    previous = None
    for split, values in zip(spy.splits, spy.values):
        epoch = split - previous if previous is not None else split
        previous = split
        assert values["flops_per_sec"] == pytest.approx(_stack_flops() * N_BATCHES / epoch.wall, rel=1e-6)
        assert values["mfu"] == pytest.approx(values["flops_per_sec"] / 1e12)
    assert history["mfu"] == [v["mfu"] for v in spy.values]


def test_given_flops_are_used_and_the_first_batch_is_not_counted():
    est = _linear_stack()
    monitor = SpeedMonitor(flops_per_batch=1234)
    assert not monitor.listens_to("batch_begin") and not monitor.listens_to("batch_end")
    history = est.fit(_data(), epochs=1, event_handlers=[monitor])
    assert monitor.flops == 1234
    assert history["flops_per_sec"][0] > 0
    assert "mfu" not in history  # on the CPU, MFU only with peak_flops


def test_a_net_with_no_counted_flops_warns_and_reports_none(caplog):
    class Elementwise(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x[:, :3] * self.scale

    net = Elementwise()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    monitor = SpeedMonitor(peak_flops=1e9)
    with caplog.at_level(logging.WARNING):
        history = est.fit(make_batches(3), epochs=1, event_handlers=[monitor])
    assert monitor.flops is None and "flops_per_sec" not in history
    assert "pass flops_per_batch=" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    ({"flops_per_batch": -1}, "flops_per_batch must be a number > 0 or None, got -1"),
    ({"flops_per_batch": 0}, "flops_per_batch must be a number > 0 or None, got 0"),
    ({"flops_per_batch": float("inf")}, "flops_per_batch must be a number of FLOPs > 0 or None, got inf"),
    ({"flops_per_batch": "many"}, "flops_per_batch must be a number > 0 or None, got 'many'"),
    ({"flops_per_batch": True}, "flops_per_batch must be a number > 0 or None, got True"),
    ({"peak_flops": float("nan")}, "peak_flops must be a number > 0 or None, got nan"),
    ({"peak_flops": -5e12}, "peak_flops must be a number > 0 or None, got -5000000000000.0"),
    ({"memory_history": -1}, "memory_history must be True, False or a positive number of events, got -1"),
    ({"memory_history": "yes"}, "memory_history must be True, False or a positive number of events, got 'yes'"),
])
def test_bad_arguments_are_errors_naming_them(kwargs, message):
    with pytest.raises(ValueError) as raised:
        SpeedMonitor(**kwargs)
    assert str(raised.value) == message


def test_the_peak_table():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12
    assert peak_flops("NVIDIA H200", "tf32") == 494.7e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert peak_flops("NVIDIA L4", "bf16") == 121e12 and peak_flops("NVIDIA L40S", "bf16") == 362e12
    assert peak_flops("NVIDIA A10G", "fp32") == 31.2e12
    assert peak_flops("Tesla T4", "bf16") is None
    for fragment, peaks in PEAK_FLOPS:  # a fragment matched before it would shadow it
        earlier = [f for f, _ in PEAK_FLOPS[:[f for f, _ in PEAK_FLOPS].index(fragment)]]
        assert not any(f in fragment for f in earlier), fragment
        assert peaks["fp32"] < peaks.get("fp16", math.inf)
    assert matmul_precision("32", nn.Linear(2, 2)) == "fp32"  # the suite runs with TF32 off


# -- where the values show ------------------------------------------------------------------
def test_history_epoch_line_and_batch_lines_show_the_split(caplog):
    est = make_estimator()
    with caplog.at_level(logging.INFO, logger=est.logger.name):
        history = est.fit(make_batches(4), epochs=2,
                          event_handlers=[SpeedMonitor(peak_flops=1e9), LoggingHandler(log_interval=2)])
    for key in (*TIMES, "flops_per_sec", "mfu"):
        assert len(history[key]) == 2 and all(v > 0 or key == "time_move" for v in history[key]), key
    assert "memory_allocated_peak" not in history  # CUDA only
    epoch_lines = [r.getMessage() for r in caplog.records if "Finished in" in r.getMessage()]
    batch_lines = [r.getMessage() for r in caplog.records if "[Batch " in r.getMessage()]
    assert len(epoch_lines) == 2 and len(batch_lines) == 4
    for line in epoch_lines + batch_lines:
        assert "; step " in line and " = data " in line and "+ handlers " in line and "FLOP/s, MFU " in line, line


def test_without_the_monitor_nothing_changes(caplog):
    est = make_estimator()
    with caplog.at_level(logging.INFO, logger=est.logger.name):
        history = est.fit(make_batches(4), epochs=1, event_handlers=[LoggingHandler(log_interval=2)])
    assert est.step_times is None
    assert not any(key.startswith("time_") for key in history.keys())
    assert " = data " not in caplog.text


def test_tensorboard_gets_the_epoch_and_interval_values(tmp_path):
    est = make_estimator()
    tb = TensorBoardHandler(tmp_path, log_interval=2)
    history = est.fit(make_batches(4), epochs=2, event_handlers=[SpeedMonitor(), tb])
    scalars, _ = read_events(tb.run_dir)
    for key in (*TIMES, "flops_per_sec"):
        assert [step for step, _ in scalars[f"epoch/{key}"]] == [1, 2]
        assert scalars[f"epoch/{key}"][0][1] == pytest.approx(history[key][0], rel=1e-6)
        assert [step for step, _ in scalars[f"batch/{key}"]] == [2, 4, 6, 8]


def test_a_tracker_gets_the_epoch_and_interval_values(tmp_path):
    pytest.importorskip("mlflow")
    from tests.event_handlers.test_mlflow_handler import _handler, read_run

    est = make_estimator()
    tracker = _handler(tmp_path, log_interval=2)
    history = est.fit(make_batches(4), epochs=2, event_handlers=[SpeedMonitor(), tracker])
    _, metrics = read_run(tmp_path, tracker.run_id)
    for key in (*TIMES, "flops_per_sec"):
        assert [step for step, _ in metrics[f"epoch/{key}"]] == [1, 2]
        assert metrics[f"epoch/{key}"][1][1] == pytest.approx(history[key][1])
        assert [step for step, _ in metrics[f"batch/{key}"]] == [2, 4, 6, 8]


def test_in_evaluate_it_measures_nothing():
    est = make_estimator()
    monitor = SpeedMonitor()
    est.fit(make_batches(3), epochs=1, event_handlers=[monitor])
    values, flops = dict(monitor.epoch_values), monitor.flops
    est.evaluate(make_batches(2), event_handlers=[monitor])
    assert monitor.epoch_values == values and monitor.flops == flops


def test_an_out_of_memory_error_still_names_its_phase_with_the_monitor(monkeypatch):
    from tests.estimator.stopping.test_oom import FAIL_AT, Tripwire

    net = Tripwire("forward")
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(torch.cuda.OutOfMemoryError, match=rf"out of memory in step {FAIL_AT} \(forward\)"):
        est.fit(make_batches(4), epochs=1, event_handlers=[SpeedMonitor()])


# -- torch.distributed ------------------------------------------------------------------------
class SlowOnRank1(torch.utils.data.Dataset):
    def __init__(self, rank):
        self.rank, self.data = rank, _data(4)

    def __len__(self):
        return len(self.data) * BATCH

    def __getitem__(self, i):
        if self.rank == 1:
            time.sleep(SLEEP / BATCH)  # a batch waits SLEEP on rank 1 only
        x, y = self.data[i // BATCH]
        return x[i % BATCH], y[i % BATCH]


def _fit_rank():
    """One rank's fit with a SpeedMonitor: its History and FLOPs of a batch, handed back."""
    torch.set_num_threads(1)
    rank = distributed.get_rank()
    est = _linear_stack()
    monitor = SpeedMonitor(peak_flops=1e12)
    loader = torch.utils.data.DataLoader(SlowOnRank1(rank), batch_size=BATCH)
    history = est.fit(loader, epochs=2, event_handlers=[monitor])
    return {key: history[key] for key in history.keys()}, monitor.flops


@pytest.mark.distributed
def test_the_epoch_values_are_every_ranks_mean_and_flops_the_sum():
    (h0, flops0), (h1, flops1) = distributed.spawn(_fit_rank, 2, backend="gloo")
    assert flops0 == flops1 == _stack_flops()  # each rank's batch: the loader's batch size
    for key in (*TIMES, "flops_per_sec", "mfu"):
        assert h0[key] == h1[key], key  # reduced: the same on every rank
    assert all(v >= SLEEP / 2 for v in h0["time_data"])  # rank 1 waits SLEEP per batch, rank 0 hardly: the mean


# -- CUDA -------------------------------------------------------------------------------------
def _cuda_estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                     device="cuda", precision="bf16-mixed")


@pytest.mark.cuda
@needs_cuda
def test_cuda_device_time_peak_memory_and_the_tables_peak():
    est = _cuda_estimator()
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(6)]
    monitor = SpeedMonitor()
    history = est.fit(data, epochs=2, event_handlers=[monitor])
    assert all(v > 0 for v in history["time_device"])
    assert all(v > 0 for v in history["memory_allocated_peak"])
    assert all(r >= a for r, a in zip(history["memory_reserved_peak"], history["memory_allocated_peak"]))
    known = peak_flops(torch.cuda.get_device_name(), "bf16")
    assert monitor.peak == known
    if known is not None:
        assert history["mfu"][0] == pytest.approx(history["flops_per_sec"][0] / known)
    assert est.step_times.split().device_steps == 12  # every step's events read by the last epoch's end


@pytest.mark.cuda
@needs_cuda
def test_cuda_memory_history_goes_into_the_out_of_memory_snapshot(tmp_path, monkeypatch):
    from estimatorch import ProfilerHandler

    class Exhaust(Handler, EpochEnd):
        def epoch_end(self, estimator, **kwargs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (raised by the test)")

    est = _cuda_estimator()
    data = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(3)]
    with pytest.raises(torch.cuda.OutOfMemoryError, match="memory snapshot: ") as raised:
        est.fit(data, epochs=1, event_handlers=[SpeedMonitor(memory_history=True), Exhaust(),
                                                ProfilerHandler(tmp_path / "profile", wait=100)])
    path = str(raised.value).split("memory snapshot: ")[1].split(" ")[0]
    assert os.path.dirname(path) == str(tmp_path / "profile")
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert any(trace for trace in snapshot["device_traces"])  # the history was recorded
