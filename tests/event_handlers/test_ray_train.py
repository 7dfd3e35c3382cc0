"""Ray Train: fit inside ``TorchTrainer``'s training function trains on Ray's process group with
no change to the script (the parameters equal bitwise those of the same 2-process run without
Ray), ``RayTrainReportHandler`` reports each epoch's metrics to Ray's results, and a worker killed
mid-run is restarted by Ray (``FailureConfig(max_failures=1)``) and resumes from the newest
checkpoint, ending bitwise. A real local Ray cluster with 2 CPU workers."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, cluster, distributed
from estimatorch.event_handlers import BatchEnd

ray = pytest.importorskip("ray")

from estimatorch.event_handlers.ray_train import RayTrainReportHandler  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class KillOnce(BatchEnd):
    """SIGKILLs rank 1 at step ``at``, the first time only (``marker`` remembers)."""

    def __init__(self, marker, at):
        self.marker, self.at, self.seen = marker, at, 0

    def batch_end(self, est, **kw):
        self.seen += 1
        if self.seen == self.at and distributed.get_rank() == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def _train(model_dir, kill_marker=None, report=None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                    seed=3)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.arange(64) % 3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    handlers = [CheckpointHandler(model_dir, resume_from_checkpoint=True)]
    if report is not None:
        handlers.append(RayTrainReportHandler(checkpoint_dir=report))
    if kill_marker is not None:
        handlers.append(KillOnce(kill_marker, at=12))
    est.fit(loader, epochs=2, event_handlers=handlers)
    return {"model": est.net.state_dict(), "step": est.position.step, "world": distributed.get_world_size(),
            "launcher": cluster.detect().name}


def _ray_worker(config):
    result = _train(config["model_dir"], config.get("kill_marker"), report=config["model_dir"])
    torch.save(result, os.path.join(config["out"], f"rank{distributed.get_rank()}.pt"))


#: the signals whose handlers Ray replaces in the driver (ray.init, TorchTrainer.fit) and leaves
#: replaced: later tests that raise SIGINT or SIGTERM in this process would reach Ray's handler.
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(scope="module")
def local_ray():
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def restore_signal_handlers():
    """TorchTrainer.fit installs its own SIGINT handler in the driver and keeps it after the fit."""
    saved = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return distributed.spawn(_train, 2, str(tmp_path_factory.mktemp("reference")), backend="gloo")


def _fit_on_ray(tmp_path, kill):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "out"
    out.mkdir()
    config = {"model_dir": str(tmp_path / "model"), "out": str(out)}
    if kill:
        config["kill_marker"] = str(tmp_path / "killed")
    trainer = TorchTrainer(_ray_worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="run",
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    return result, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("kill", [False, True], ids=["uninterrupted", "worker-killed"])
def test_fit_inside_torch_trainer_trains_bitwise_and_reports_each_epoch(tmp_path, local_ray, reference, kill):
    result, ranks = _fit_on_ray(tmp_path, kill)
    assert (tmp_path / "killed").exists() == kill
    for rank, got in enumerate(ranks):
        assert got["launcher"] == "process_group" and got["world"] == 2 and got["step"] == 16
        for key, value in reference[rank]["model"].items():
            assert torch.equal(got["model"][key], value), (rank, key)
    # the newest report, with the model_dir handed over as its checkpoint
    assert result.metrics["epoch"] == 2 and "train_loss" in result.metrics and result.checkpoint is not None
    epochs = [metrics["epoch"] for _, metrics in result.best_checkpoints]
    assert epochs == ([1, 2] if not kill else epochs) and epochs[-1] == 2  # one report per epoch
    with result.checkpoint.as_directory() as saved:
        assert any(name.endswith(".pt") for name in os.listdir(saved))
